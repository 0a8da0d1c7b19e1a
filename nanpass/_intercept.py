"""Capture by interception: the user's forward runs exactly as written, and a
``TorchFunctionMode`` swaps only the calls the rule table names for their guards.

Why not a graph (docs/architecture.md, "Capture"): a traced graph is a second copy of the
model that has to re-implement every piece of Python semantics (grad mode, autocast,
checkpoint, hooks, module swaps, train/eval, attribute side effects, other methods) and
silently loses what it does not. Here nothing is copied: every line of the user's Python runs
as written, and only a call the table names goes to its guard, with the user's own arguments.

A call site is the innermost module whose code made the call plus the user's source line;
the first call at a site records its ``Change``. Everything here is per hardened model and per
call: no global state, so many instances, threads and freeing work as for a plain module.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import linecache
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from . import _compat, _fastpath, _guards
from ._bodies import guard_bodies
from ._check import Site
from ._compat import ATEN_OPS
from ._config import Config
from ._deferred import pole_flag, scalar
from ._rewrite import Change, counted, guard_fn, make_checker, make_guard
from ._rule import computes_in
from ._rules import CALLS, Rule, Spelling, as_written
from ._stats import Counter, GuardWarning
from ._watch import MOVE_ONLY, REARRANGE, Watch, leaves, readable
from ._watch import inplace as _inplace

Tensor = torch.Tensor
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANPASS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

# the mode of the hardened call running in this thread/context (checkpoint's recompute reads it)
ACTIVE: contextvars.ContextVar[GuardMode | None] = contextvars.ContextVar("nanpass_active", default=None)

# frames where the walk for a call site stops: the hardened model's entry point (run_guarded),
# as the ids of their code objects (a code object dynamo rewrote around a graph break can hold its
# globals dict as a constant: unhashable, so the walk never hashes a frame's code)
BOUNDARY: set[int] = set()


def _float_operand(args, kwargs) -> bool:
    for a in (*args, *kwargs.values()):  # noqa: SIM110 - runs on every guarded call
        if isinstance(a, Tensor) and a.is_floating_point():
            return True
    return False


_PLAIN = (Tensor, torch.nn.Parameter)
_DEFAULT_TF = Tensor.__torch_function__.__func__
_DISABLED_TF = getattr(torch.nn.Parameter.__torch_function__, "__func__", torch.nn.Parameter.__torch_function__)


def _own_dispatch(args, kwargs) -> str | None:
    """Why a call is left to a tensor subclass that handles torch's calls itself (Opacus's
    ExpandedWeight computes per-sample gradients for a table of functions and refuses every
    other call, a guard's included), or None. A subclass that keeps torch's handling is
    guarded as a tensor."""
    for a in (*args, *kwargs.values()):
        t = type(a)
        if t in _PLAIN or not isinstance(a, Tensor):
            continue
        tf = getattr(t.__torch_function__, "__func__", t.__torch_function__)
        if tf is not _DEFAULT_TF and tf is not _DISABLED_TF:
            return (f"a {t.__name__} operand handles torch's calls itself (its __torch_function__): "
                    f"the call is its")
    return None


def _left_as_written(rule: Rule, args, kwargs) -> bool:
    """A call its rule's ``safe_if`` proves safe, or one with no float operand."""
    return (rule.safe_if is not None and rule.safe_if(args, kwargs) is not None) or not _float_operand(args, kwargs)


def _fresh_guard(rule: Rule, sp: Spelling, config: Config, impl: Callable | None = None) -> Callable:
    return guard_fn(rule, sp, config.consts(rule.name) if rule.constants else None, impl)


def _in_dtypes(rule: Rule, args) -> bool:
    """Whether the call computes in one of ``rule.only_dtypes`` (under autocast a float32
    product is computed, and can overflow, in low precision)."""
    return computes_in(args, rule.only_dtypes, rule.autocast_float32)


_SERIALS = itertools.count()
_SITES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # serial -> Sites


class Sites:
    """The call sites of one hardened model: what each does, and the Change it recorded."""

    def __init__(self, model: torch.nn.Module, config: Config, watch: int | None = None):
        self.model = model
        self.config = config
        self.changes: list[Change] = []
        self.counters: list[Counter] = []
        self.calls = 0  # hardened calls made (the report of a model with no unsafe call is empty)
        # the watch: every `watch` calls one call counts what each guard changes (on the device)
        self.watch = watch
        self.sampling = False
        self._sampled: dict = {}  # site key -> Counter, this sampled call
        self._streak: dict = {}  # site key -> sampled calls in a row in which the guard fired
        self._warned: set = set()
        self._runs: dict = {}  # site key -> (the callable that runs the call, its decision)
        self._seen: set = set()  # (site key, action, reason) already recorded
        self._changes_by_key: dict = {}
        self._pending: dict = {}  # site key -> its Counter, until the guard first runs
        self._paths: dict[int, tuple[weakref.ref, str]] = {}  # id -> (the module, its path)
        # the modules whose ids the site keys hold, held weakly: a module freed (one swapped
        # out) can leave its id to a new one, whose sites must not be taken for the old one's
        self._modules: dict[int, weakref.ref] = {}
        self._lock = threading.Lock()
        # check mode looks at every call, not only the table's (_watch.py)
        # harden's check mode reads its verdicts once a forward and once a backward; enable's
        # (a program, no forward to run again) and stop_at_op=True read at each op
        self.checker = Watch(self, config.mode == "warn", deferred=model is not None and not config.stop_at_op) \
            if config.mode in ("check", "warn") else None
        if self.checker is not None:  # (issue 47) the step screened, run again at each op on a hit
            self.checker.screening = model is not None and not config.stop_at_op and not config.every_op
        self.customs: bool | None = None  # whether its graphs hold custom Function nodes
        # the changes made to the higher-order-op bodies of its compiled graphs (_bodies)
        self.compiled_bodies: list[Change] = []
        # called, not traced, where dynamo traces one of its calls (_compat.traced_with)
        self.traced = _compat.traced_with(next(_SERIALS))
        _SITES[self.traced.note] = self
        # guard mode's fast path (_fastpath): the stand-ins send the table's calls here; the
        # model's code is scanned on the first call and when a module class is swapped in;
        # `fast` says why the mode runs instead, where it does
        self.fast: str | None = None if config.fast else "fast=False"
        self._scanned = False
        self._kinds: tuple = ()  # the module classes the last scan read
        self._epoch = -1  # _fastpath.EPOCH at the last look

    def missed(self, sp: Spelling, func) -> None:
        """A call the stand-ins did not reach (a reference to torch's own function taken before
        ``import nanpass``, where no scan looks): the mode from now on, said where calls
        before this one may have run unguarded."""
        if self.fast is not None:
            return
        module, frame = self._where(3)
        at = _source(frame)[0] or "an unknown line"
        self.fast = (f"{sp.name} at {at} is reached through a reference to torch's own function "
                     f"taken before import nanpass")
        if self.calls > 1:
            warnings.warn(
                f"nanpass: {self.fast}: the calls before this one may have run it unguarded; "
                f"this model runs under a TorchFunctionMode from now on (import nanpass before "
                f"the code that takes the reference, or harden(..., fast=False))",
                GuardWarning, stacklevel=4)

    def fast_ok(self, rescan: bool) -> bool:
        """Whether this call runs on the stand-ins (else under the mode)."""
        if not self.config.fast or self.model is None or _compat.functorch_active():
            return False
        if self.fast is not None:
            return False
        epoch = _fastpath.EPOCH[0]
        if (rescan or epoch != self._epoch) and self._scanned:
            # a module registered since (maybe swapped in here): a new class's code is scanned
            kinds = tuple(map(type, self.model.modules()))
            rescan, self._kinds = kinds != self._kinds, kinds
        self._epoch = epoch
        if not self._scanned or rescan:
            self._scanned = True
            self._kinds = tuple(map(type, self.model.modules()))
            self.fast = _fastpath.scan(self.model)
        return self.fast is None

    def locate(self):
        """(module, its path, file, line) of the user's frame making the current call."""
        module, frame = self._where(2)
        if frame is None:
            return module, self._path(module), None, None
        return module, self._path(module), frame.f_code.co_filename, frame.f_lineno

    def mode(self) -> GuardMode:
        """A mode running calls as this model's call does (check mode: through its watch)."""
        return GuardMode(self)

    # -- where a call comes from ------------------------------------------------------------
    def _path(self, module: torch.nn.Module | None) -> str | None:
        if module is None:
            return ""
        got = self._paths.get(id(module))
        if got is None or got[0]() is not module:  # a module swapped in since the last look
            found = {id(m): (weakref.ref(m), name) for name, m in
                     (self.model if self.model is not None else _outermost(module)).named_modules()}
            if self.model is not None:
                self._paths = found
            else:  # nanpass.enable: every model the program runs, each named from its root
                self._paths.update(found)
            got = self._paths.get(id(module))
        return got[1] if got is not None and got[0]() is module else None

    def _module_key(self, module) -> int:
        """``id(module)`` for a site key, the sites of a freed module with the same id
        forgotten first."""
        mid = id(module)
        if module is None:
            return mid
        ref = self._modules.get(mid)
        if ref is None or ref() is not module:
            if ref is not None:
                self._forget(mid)
            self._modules[mid] = weakref.ref(module)
        return mid

    def _forget(self, mid: int) -> None:
        with self._lock:
            for d in (self._runs, self._pending, self._sampled, self._streak, self._changes_by_key):
                for k in [k for k in d if isinstance(k, tuple) and len(k) > 2 and k[2] == mid]:
                    del d[k]
            self._seen = {t for t in self._seen if not (t[0] and t[0][2] == mid)}

    @staticmethod
    def _where(depth: int):
        """(innermost module whose code made the call, the user's frame): walks up from the
        call to the hardened model's entry point."""
        f = sys._getframe(depth)
        module = src = first = None
        while f is not None:
            code = f.f_code
            if id(code) in BOUNDARY:
                break
            name = code.co_filename
            if not name.startswith(_NANPASS_DIR):
                if first is None:
                    first = f
                if src is None and not name.startswith(_TORCH_DIR) and not name.startswith("<"):
                    src = f
                if module is None and code.co_argcount and code.co_varnames[0] == "self":
                    obj = f.f_locals.get("self")
                    if isinstance(obj, torch.nn.Module):
                        module = obj
                if module is not None and src is not None:
                    break
            f = f.f_back
        return module, src or first

    # -- what a call does ---------------------------------------------------------------------
    def call(self, hit: tuple[Rule, Spelling, bool], args: tuple, kwargs: dict):
        rule, sp, swapped = hit
        if swapped:  # 2 / x arrives as x.__rtruediv__(2): guard it as 2 / x
            args = (args[1], args[0], *args[2:])
        if rule.only_dtypes and not _in_dtypes(rule, args):
            return self._as_written(rule, sp, args, kwargs)  # not unsafe in this dtype: not looked at
        if torch.compiler.is_compiling():  # no frames to walk, no site dict to read
            return self._traced(rule, sp, args, kwargs)
        module, frame = self._where(3)
        sp = as_written(hit, frame)[1]  # x / y reaches a mode as Tensor.div: named as written
        # (one instruction can run 2 / x, then x / y: the reflected spelling is another site)
        key = (rule.name, sp.name + "'" if swapped else sp.name, self._module_key(module),
               _code_key(frame), frame.f_lasti if frame else None)
        return self._run_for(key, rule, sp, module, frame, args, kwargs)

    def _run_for(self, key, rule, sp, module, frame, args, kwargs):
        entry = self._runs.get(key)
        if entry is None:
            entry = self._make_run(key, rule, sp, module, frame, args)
        run, decision = entry
        why = None
        if run is not sp.call:
            why = _own_dispatch(args, kwargs)
            if why is None and rule.safe_if is not None:
                why = rule.safe_if(args, kwargs)
            if why is None and not _float_operand(args, kwargs):
                why = "integer/bool/complex operands keep their exact semantics"
        if why is not None:
            self._note(key, rule, sp, module, frame, "left", "", why, args)
            return self._as_written(rule, sp, args, kwargs)
        change = self._note(key, rule, sp, module, frame, *decision, args)
        if change is not None and key in self._pending:
            counter = self._pending.pop(key)
            counter.change = change
            with self._lock:
                self.counters.append(counter)
        if self.sampling and key is not None and decision[0] == "guarded":
            counter = self._sampled.get(key)
            if counter is None:
                counter = self._sampled[key] = Counter(change or self._change_of(key))
            return counted(run, counter)(*args, **kwargs)  # a sampled call only: 1 in `watch`
        return run(*args, **kwargs)

    def _as_written(self, rule: Rule, sp: Spelling, args, kwargs):
        """A call left as written: in check mode still watched, as every call is."""
        if self.checker is None or torch.compiler.is_compiling():
            return sp.call(*args, **kwargs)
        return self.checker.run(sp.call, (rule, sp, False), args, kwargs, sp.inplace)

    def _traced(self, rule: Rule, sp: Spelling, args, kwargs):
        """Under dynamo: the guard built afresh from the rule and the config alone, so a
        traced region reads no per-site state (dynamo would guard on it, and recompile or fail
        on the code objects in its keys). The report of a compiled hardened model comes from
        the eager calls or from the backend."""
        action = self._decision(rule, None)[0]
        if action == "left" or _left_as_written(rule, args, kwargs):
            return sp.call(*args, **kwargs)
        if action == "checked":
            site = Site(rule.name, sp.name, "", "", None, None)
            return make_checker(rule, sp, site, self.config.mode == "warn")(*args, **kwargs)
        return _fresh_guard(rule, sp, self.config)(*args, **kwargs)

    def _change_of(self, key) -> Change | None:
        return self._changes_by_key.get(key)

    def end_sample(self) -> None:
        """After a sampled call: one sync for every guard that ran; a guard that changed values
        in three sampled calls in a row is named once (a model stuck on a guard, e.g. a learned
        temperature at 0, trains on constants while every number stays finite)."""
        ran = [(k, c) for k, c in self._sampled.items() if c.last is not None]
        self._sampled = {}
        if not ran:
            return
        counts = torch.stack([c.last.to(ran[0][1].last.device) for _, c in ran]).tolist()
        fired = {k for (k, _), n in zip(ran, counts, strict=True) if n}
        self._streak = {k: self._streak.get(k, 0) + 1 for k in fired}
        for (k, c), n in zip(ran, counts, strict=True):
            if self._streak.get(k, 0) >= 3 and k not in self._warned and c.change is not None:
                self._warned.add(k)
                ch = c.change
                warnings.warn(
                    f"nanpass: the {ch.op} guard ({ch.spelling} in {ch.module or '<root>'}"
                    f"{' at ' + ch.source if ch.source else ''}) changed {int(n)} elements in each "
                    f"of {self._streak[k]} sampled calls in a row: the model may be stuck on it "
                    f"(see nanpass.harden(model, count=True) and nanpass.stats); silence with "
                    f"harden(..., watch=None)", GuardWarning, stacklevel=4)

    def _decision(self, rule: Rule, module) -> tuple[str, str, str]:
        """(action, guard, reason) of a site, as the report shows it."""
        cfg = self.config
        if not rule.guarded:
            return "left", "", rule.reason
        if rule.name not in cfg.ops:
            return "left", "", "op excluded by config"
        path = self._path(module)
        if path and cfg.excluded(path):
            return "left", "", f"module {path!r} excluded by config"
        if cfg.mode in ("check", "warn"):
            return "checked", f"raises NonFiniteError here ({cfg.mode})", rule.reason
        return "guarded", rule.action, rule.reason

    def _make_run(self, key, rule: Rule, sp: Spelling, module, frame, args=()):
        cfg = self.config
        action = self._decision(rule, module)
        if action[0] == "left" and self.checker is None:
            run = sp.call
        elif action[0] in ("left", "checked"):  # check mode: every call, watched
            watch, hit = self.checker, (rule, sp, False)

            def run(*args, **kwargs):
                return watch.run(sp.call, hit, args, kwargs, sp.inplace)
        else:
            run = make_guard(rule, sp, cfg.consts(rule.name) if rule.constants else None)
            if cfg.count and key is not None:
                # listed (and given its Change) on the first call the guard really runs: a site
                # whose calls are all statically safe is reported left, never guarded
                counter = self._pending[key] = Counter(None)
                run = counted(run, counter)
        if key is not None:
            self._runs[key] = (run, action)
        return run, action

    def _site(self, rule: Rule, sp: Spelling, module, frame) -> Site:
        source, code = _source(frame)
        cls = type(module).__name__ if module is not None else ""
        return Site(rule.name, sp.name, self._path(module) or "", cls, source, code)

    def _note(self, key, rule, sp, module, frame, action, guard, reason, args=()) -> Change | None:
        """Record the first call at a site (per action and reason) as a Change."""
        tag = (key, action, reason)
        if key is None or tag in self._seen:
            return None
        with self._lock:
            if tag in self._seen:  # pragma: no cover - another thread was first
                return None
            self._seen.add(tag)
            site = self._site(rule, sp, module, frame)
            dtype = next((a.dtype for a in args if isinstance(a, Tensor) and a.is_floating_point()), None)
            consts = ()
            if action == "guarded" and rule.constants and dtype is not None:
                consts = tuple(sorted(self.config.consts(rule.name)(dtype).items()))
            change = Change(
                node="", original="", op=rule.name, spelling=sp.name, module=site.module,
                module_type=site.module_type, source=site.source, code=site.code,
                action=action, guard=guard, reason=reason,
                dtype=str(dtype).replace("torch.", "") if dtype is not None else None, constants=consts,
            )
            self.changes.append(change)
            if action == "guarded":
                self._changes_by_key[key] = change
            return change


def _code_key(frame):
    """A frame's code object, as a site key holds it. Dynamo's rewrite of a frame around a graph
    break can hold an unhashable constant (the globals dict of a nested function or lambda it
    rebuilds): such a code object is keyed by its file, name and first line."""
    if frame is None:
        return None
    code = frame.f_code
    try:
        hash(code)
    except TypeError:
        return code.co_filename, code.co_name, code.co_firstlineno
    return code


def _outermost(module: torch.nn.Module) -> torch.nn.Module:
    """nanpass.enable has no model: a module's path is taken in the outermost module whose
    code is running (the model the program called)."""
    root = module
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_argcount and f.f_code.co_varnames[0] == "self":
            obj = f.f_locals.get("self")
            if isinstance(obj, torch.nn.Module):
                root = obj
        f = f.f_back
    return root


def _source(frame) -> tuple[str | None, str | None]:
    if frame is None:
        return None, None
    line = frame.f_lineno
    path = frame.f_code.co_filename
    return f"{path}:{line}", linecache.getline(path, line).strip() or None


def _as_called(func, args, kwargs):
    """A call the table does not name, as called. Under dynamo a Tensor method written in
    Python (``Tensor.unflatten``, ``Tensor.dim_order``) runs as a method of its tensor, as
    dynamo traces it in a plain model: it cannot trace the function's own ``super()`` call."""
    if (isinstance(func, types.FunctionType) and torch.compiler.is_compiling()
            and func.__module__ == "torch._tensor" and args and isinstance(args[0], Tensor)):
        return getattr(args[0], func.__name__)(*args[1:], **kwargs)
    return func(*args, **kwargs)


def _hit(func) -> tuple[Rule, Spelling, bool] | None:
    """The rule table's entry for a call, if it names it."""
    if torch.compiler.is_compiling():
        return _HITS[_hit_index(func)]
    try:
        hit = CALLS.get(func)
    except TypeError:  # an unhashable callable
        return None
    # (a stand-in, handed to a mode where torch looks the callable up by name, ``x.log()``, is
    # in CALLS as its original: _fastpath.install)
    return hit


# Under dynamo the lookup runs as Python, not traced: a traced lookup in CALLS guards the
# table's key order, every key up to the one found (4,648 guard lines on GPT-2 4L against
# 2,016 plain, checked on each call of each frame). Its result, an index, is a constant of
# the call; what dynamo guards is the entry read.
_HITS: list = [None, *CALLS.values()]
_HIT_INDEX: dict = {fn: i for i, fn in enumerate(CALLS, 1)}


@_compat.constant_result
def _hit_index(func) -> int:
    try:
        i = _HIT_INDEX.get(func, 0)
        if not i and func in _fastpath.ORIGINALS:  # a stand-in, looked up by name
            i = _HIT_INDEX.get(_fastpath.ORIGINALS[func], 0)
        return i
    except TypeError:  # an unhashable callable
        return 0


class CallsGuarded(TorchFunctionMode):
    """Each call the rule table names, to its guard (default constants unless given a config;
    no site, no report):
    what a guard of a torch composite written in Python runs that composite's own code under,
    so the calls inside it are guarded as the user's would be (float16 attention scores
    inside F.multi_head_attention_forward). Its one site is the composite's."""

    def __init__(self, guards: dict[str, Callable] | None = None, config: Config | None = None):
        super().__init__()
        self.guards = guards or {}  # rule name -> the guard this composite's calls take instead
        self.config = config or _DEFAULTS  # (a backend's, for a function dynamo keeps whole)

    @_compat.eager_handler
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        hit = _hit(func)
        kwargs = kwargs or {}
        if hit is None or not hit[0].guarded:
            return _as_called(func, args, kwargs)
        rule, sp, swapped = hit
        if swapped:
            args = (args[1], args[0], *args[2:])
        if (rule.only_dtypes and not _in_dtypes(rule, args)) or _left_as_written(rule, args, kwargs):
            return sp.call(*args, **kwargs)
        guarded = rule  # noqa: F841 - certify reads it, as it reads _run_for's decision
        return _fresh_guard(rule, sp, self.config, self.guards.get(rule.name))(*args, **kwargs)


_DEFAULTS = Config()
_guards.guard_calls_with(CallsGuarded)
_fastpath._ADMIT.append(_in_dtypes)


class GuardMode(TorchFunctionMode):
    """Swaps the rule table's calls for guards while a hardened model runs. One per call: a
    mode is per thread, so threads never see each other's. ``noted``: check mode under
    torch.compile, every call as written and its new values' scalars collected (``_noted``)."""

    def __init__(self, sites: Sites, noted: list | None = None):
        super().__init__()
        self.sites = sites
        self.noted = noted

    @_compat.eager_handler
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        hit = _hit(func)
        if self.noted is not None:
            return _noted(self.noted, func, hit, args, kwargs or {})
        watch = self.sites.checker
        if watch is not None and not torch.compiler.is_compiling():
            return _watched(watch, self.sites, func, hit, args, kwargs or {})
        if hit is not None:
            rule = hit[0]
            if rule.only_dtypes and not hit[2] and not _in_dtypes(rule, args):
                return func(*args, **(kwargs or {}))  # not unsafe in this dtype: not looked at
            return self.sites.call(hit, args, kwargs or {})
        # anything else runs as called; a torch composite written in Python (F.normalize)
        # runs with the mode off, as each of torch's own functions re-dispatches to a mode
        if isinstance(func, types.FunctionType):
            return _as_called(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


_compat.graphs_run_outside(GuardMode)


def _noted(noted: list, func, hit, args, kwargs):
    """A call of a compiled check-mode forward: as written, with one scalar per new floating
    value (``_deferred.scalar``: NaN or infinite exactly when the value holds one) added to
    ``noted``, which the hardened call reads once after the forward; a call that only moves
    values (a view, a slice, a concatenation) makes none. Where the rule table gives the op's
    poles, a scalar also says whether an infinity sits at one (``log(0)``), so that a pattern
    of infinities checked once and found made on purpose is known again."""
    out = _as_called(func, args, kwargs)
    name = getattr(func, "__name__", None)
    if isinstance(func, ATEN_OPS) or name in _UNWATCHED or name in MOVE_ONLY:
        return out
    new = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, Tensor) and readable(o)]
    # (one element, not 0-dim: where the model graph-breaks, the frame dynamo resumes holds
    # ``noted``, and it guards a 0-dim CPU tensor's value, one read each)
    noted.extend(scalar(o).view(1) for o in new)
    if new and hit is not None and hit[0].poles:
        ops = (args[1], args[0], *args[2:]) if hit[2] else args
        k = hit[0].pole_operand
        x = ops[k] if k < len(ops) else None
        if isinstance(x, Tensor) and readable(x) and x.dim() <= new[0].dim():
            noted.append(pole_flag(new[0], x, hit[0].poles, {}).view(1))
    return out


class Survey(TorchFunctionMode):
    """Over the fast path's first call and each sampled one: a call the table names that
    reaches torch outside a stand-in (through a name the swap does not reach: a bound method
    kept from before, a spelling held where the scan does not look) is guarded here, and the
    model runs under the mode from then on (``Sites.fast`` names the call)."""

    def __init__(self, sites: Sites):
        super().__init__()
        self.sites = sites

    @_compat.eager_handler
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _fastpath.active():  # outside every stand-in and guard
            hit = _hit(func)
            if hit is not None and (not hit[0].only_dtypes or hit[2] or _in_dtypes(hit[0], args)):
                self.sites.missed(hit[1], getattr(func, "__wrapped__", func))
                prev = _fastpath.paused()
                try:
                    return self.sites.call(hit, args, kwargs)
                finally:
                    _fastpath.resume(prev)
        if isinstance(func, types.FunctionType):
            return _as_called(func, args, kwargs)
        return func(*args, **kwargs)


# calls check mode runs as called and does not look at: attribute reads and writes (``x.grad``
# reads a gradient, it makes nothing), printing, and aten ops a tracer runs under the mode
_UNWATCHED = frozenset(("__get__", "__set__", "__repr__", "__format__", "__str__", "__len__",
                        "__bool__", "item", "tolist", "numpy", "backward", "dim", "size", "stride",
                        "data_ptr", "is_floating_point", "requires_grad_", "register_hook",
                        "retain_grad", "detach_", "__reduce_ex__", "__deepcopy__",
                        # uninitialised memory: whatever bits it holds are not made by the program
                        "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"))


_BACKWARD, _GRAD = torch.autograd.backward, torch.autograd.grad


def _watched(watch: Watch, sites: Sites, func, hit, args, kwargs):
    """Check mode: every call runs as called and its result is checked; a call the table
    names also records its site for the report."""
    func = _fastpath.ORIGINALS.get(func, func)  # a stand-in torch looked up by name: its original
    name = getattr(func, "__name__", None)
    if name == "backward" and (func is _BACKWARD or (args and isinstance(args[0], Tensor))):
        return watch.loss_backward(func, args, kwargs)  # loss.backward(), autograd.backward
    if func is _GRAD and watch.program:  # enable's autograd.grad: read before, as backward(), and after
        return watch.loss_backward(func, args, kwargs, grad=True)
    if isinstance(func, ATEN_OPS) or name in _UNWATCHED:
        return func(*args, **kwargs)
    if name in REARRANGE and watch.collecting():  # (half the calls of a GPT-2 step)
        return _as_called(func, args, kwargs)
    if hit is not None and (not hit[0].only_dtypes or hit[2] or _in_dtypes(hit[0], args)):
        return sites.call(hit, args, kwargs)
    if isinstance(func, types.FunctionType):  # a torch composite written in Python: one call
        return watch.run(lambda *a, **k: _as_called(func, a, k), None, args, kwargs, False, func)
    return watch.run(func, None, args, kwargs, _inplace(func))


def run_guarded(sites: Sites, fn: Callable, args: tuple, kwargs: dict, noted: list | None = None):
    """``fn(*args, **kwargs)`` with the rule table's calls guarded, unless already so
    (``noted``: check mode under torch.compile, see ``_noted``)."""
    if noted is not None or torch.compiler.is_compiling():
        # traced by dynamo: the mode is inlined into the graph; no ContextVar, no counters
        sites.traced()
        with GuardMode(sites, noted):
            return fn(*args, **kwargs)
    mode = ACTIVE.get()
    if mode is not None and mode.sites is sites:
        return fn(*args, **kwargs)
    sites.calls += 1
    mode = GuardMode(sites)
    token = ACTIVE.set(mode)
    sample = bool(sites.watch) and sites.calls % sites.watch == 0 and not torch.compiler.is_compiling()
    sites.sampling = sample
    try:
        if sites.checker is None and sites.fast_ok(sample):  # the stand-ins: no mode
            prev = _fastpath.enter(sites)
            try:
                surveyed = sites.calls == 1 or sample
                if surveyed:  # the survey: a call that reaches torch past the stand-ins is found
                    with Survey(sites):
                        out = fn(*args, **kwargs)
                else:
                    out = fn(*args, **kwargs)
            finally:
                _fastpath.leave(prev)
        else:
            prev = _fastpath.paused()  # (an outer model's stand-ins would guard this one's calls)
            try:
                with mode:
                    out = fn(*args, **kwargs)
            finally:
                _fastpath.resume(prev)
        if (sites.customs is not False and sites.checker is None and torch.is_grad_enabled()
                and not _compat.functorch_active()):  # (under vmap a value cannot be read)
            _guard_custom_backwards(sites, out)
        return out
    finally:
        ACTIVE.reset(token)
        if sample:
            sites.sampling = False
            sites.end_sample()


BOUNDARY.add(id(run_guarded.__code__))


def _guard_custom_backwards(sites: Sites, out) -> None:
    """A custom autograd.Function's backward runs after the hardened call, outside its mode:
    each such node in the call's graph gets a hook that, only when the backward made a
    gradient non-finite from a finite one, runs it again with its calls guarded. A model
    whose first graph has none is not walked again."""
    todo = [t.grad_fn for t in leaves(out) if isinstance(t, Tensor) and t.grad_fn is not None]
    if not todo:
        return
    seen, found = set(), False
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        cls = _compat.custom_function(n)
        if cls is not None and not cls.__module__.startswith("nanpass."):  # not a guard's own
            found = True
            if _CUSTOM not in n.metadata:
                n.metadata[_CUSTOM] = True
                n.register_hook(_GuardedBackward(sites, cls, n))
        todo.extend(f for f, _ in n.next_functions)
    if sites.customs is None:
        sites.customs = found


_CUSTOM = "nanpass_custom_backward"


def _finite(t) -> bool:
    return not isinstance(t, Tensor) or not t.is_floating_point() or bool(torch.isfinite(t).all())


class _GuardedBackward:
    """A custom Function node's post hook: its gradients, as they are when finite (and when
    the gradient it received was not: that passes through, for GradScaler and StepGuard to
    see); otherwise its backward again under the guards, and what no guard made finite there
    (the Function's own derivative, overflowing) fenced to 0."""

    def __init__(self, sites: Sites, cls, node):
        self.sites, self.cls = sites, cls
        try:
            self.node = weakref.ref(node)
        except TypeError:
            self.node = lambda: node

    def __call__(self, grad_inputs, grad_outputs):
        if _compat.functorch_active() or all(_finite(g) for g in grad_inputs) or not all(
                _finite(g) for g in grad_outputs):
            return None
        ctx = self.node()
        if ctx is None:
            return None
        try:
            with self.sites.mode():
                again = self.cls.backward(ctx, *grad_outputs)
        except RuntimeError:  # a backward that runs once (torch.library's chunked linear
            again = grad_inputs  # cross-entropy): its non-finite gradients fenced as they came
        again = again if isinstance(again, tuple) else (again,)
        fixed = []
        for old, new in zip(grad_inputs, again, strict=False):
            g = new if isinstance(new, Tensor) and old is not None else old
            if isinstance(g, Tensor) and g.is_floating_point():
                g = torch.where(torch.isfinite(g), g, torch.zeros((), dtype=g.dtype, device=g.device))
            fixed.append(g)
        return (*fixed, *grad_inputs[len(fixed):])


def _bind(fn: Callable) -> Callable:
    """Checkpoint's recompute, outside the hardened call, re-enters its guards."""
    mode = ACTIVE.get()
    if mode is None:
        return fn
    sites = mode.sites

    def run(*args, **kwargs):
        watch = sites.checker
        if watch is None or ACTIVE.get() is not None or not watch.deferred:
            return run_guarded(sites, fn, args, kwargs)
        with watch.recomputing():  # in backward: the forward's values again, checked already
            return run_guarded(sites, fn, args, kwargs)

    return functools.wraps(fn)(run)


def _guarding() -> bool:
    if ACTIVE.get() is None:
        return False
    stack = _compat.function_mode_stack()
    return bool(stack) and isinstance(stack[-1], (GuardMode, Survey))


def _traced_bodies(gm, notes, modes) -> None:
    """A graph dynamo traced: the bodies of its higher-order ops get the guards of the hardened
    calls traced in its frame (``notes``) or entered around it (``modes``)."""
    found = [_SITES.get(n) for n in notes] + [m.sites for m in modes if isinstance(m, GuardMode)]
    found = [s for s in found if s is not None and s.config.mode == "guard"]
    if not found:
        return
    # several hardened models in one frame: the outermost's config (a region is guarded as the
    # model that holds it is, unless that model excludes it)
    changes = guard_bodies(gm, found[0].config)
    if changes:
        with found[0]._lock:
            found[0].compiled_bodies.extend(changes)


_compat.on_guarded_call(_bind, _guarding, _traced_bodies)
_compat.offer_to_traced_modes(fn for fn in CALLS if isinstance(fn, types.BuiltinFunctionType))
