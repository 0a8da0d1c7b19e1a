"""The ``torch.compile`` backend: rewrite dynamo's graph, then hand it to an inner compiler.

Registered only through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="nanpass")`` works without ``import nanpass``; calling
``register_backend`` as well would make torch fail on a duplicate name.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import operator
import sys
import threading
import warnings
import weakref
from collections.abc import Callable

import torch
import torch.fx as fx

from . import _compat, _fastpath
from ._check import flagged
from ._compat import dynamo_cache_entries, inductor_with, inner_compiler
from ._config import Config, make_config
from ._errors import ConfigError
from ._intercept import Sites
from ._rewrite import Change, GraphRecord, eagerly, rewrite_and_record, untap
from ._rules import CALLS
from ._selfcheck import refuse_broken_guards
from ._shapes import compare_shapes, graph_key, graph_shapes, insert_asserts
from ._source import SELF_IS_MODULE, module_path, user_frame
from ._stats import GuardWarning
from ._watch import GraphSites, Watch
from ._watch import inplace as _inplace

OPTIONS = ("mode", "ops", "exclude_ops", "exclude", "constants", "stable", "inner",
           "shape_checks", "dynamic_dims", "count", "selfcheck")

# every graph the backend compiled, in order, and the record of each compiled callable, so
# nanpass.report(compiled_model) can find its own graphs through dynamo's cache
_COMPILED: collections.deque[GraphRecord] = collections.deque(maxlen=4096)
_BY_CALLABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RECORD = "_nanpass_graph_record"


def _dynamo_records(model: torch.nn.Module) -> set[int]:
    """Walk dynamo's cache entries of every forward in the model (and their resume functions
    after graph breaks) to the callables this backend returned. A class's code is shared by
    all its instances: an entry whose graphs were compiled for another instance (dynamo
    compiled the frame with another module as ``self``) is not this model's, nor are the
    resume functions reached from it."""
    found: set[int] = set()
    seen: set = set()
    mine = {id(m) for m in model.modules()}
    stack = [(type(m).forward, None) for m in model.modules()]
    stack.append((_compat.module_call_impl(), None))  # model.compile(): the frames are _call_impl's
    while stack:
        fn, owned = stack.pop()
        code = getattr(fn, "__code__", None)
        if code is None or (code, owned) in seen:
            continue
        seen.add((code, owned))
        for entry in dynamo_cache_entries(code):
            records, resumes = [], []
            for name in entry.code.co_names:
                obj = fn.__globals__.get(name)
                if name.startswith("__resume_at"):
                    resumes.append(obj)
                elif name.startswith("__compiled_fn"):
                    while obj is not None:
                        record = getattr(obj, _RECORD, None)  # functools.wraps copies it along
                        if record is None and _hashable(obj):
                            record = _BY_CALLABLE.get(obj)
                        if record is not None:
                            records.append(record)
                            break
                        obj = getattr(obj, "__wrapped__", None)
            owners = [_owner(r) for r in records]
            owners = {id(o) if o is not None else None for o in owners if o is not _UNKNOWN}
            if owners and not owners & mine:
                continue  # another instance's graphs (one freed since included)
            if not owners and owned is None and fn is _compat.module_call_impl():
                continue  # (every module's _call_impl: only an entry known to be this model's)
            found.update(id(r) for r in records)
            stack.extend((r, bool(owners) or owned) for r in resumes)
    return found


# the module dynamo compiled each graph's frame for (its ``self``), by the record's id
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


_UNKNOWN = object()


def _owner(record: GraphRecord):
    """The module the record's frame was compiled for; None: freed since; ``_UNKNOWN``: not a
    module's frame, or not known."""
    got = _OWNERS.get(id(record))
    if got is None or got[0]() is not record:
        return _UNKNOWN
    return got[1]()


def _note_owner(record: GraphRecord) -> None:
    """The module whose frame dynamo is compiling (``self``), if the frame is a module's."""
    owner = _compat.compiling_frame_locals().get("self")
    if isinstance(owner, torch.nn.Module):
        for k in [k for k, (r, _) in _OWNERS.items() if r() is None]:
            del _OWNERS[k]  # (records dropped from _COMPILED)
        _OWNERS[id(record)] = (weakref.ref(record), weakref.ref(owner))


def _hashable(obj) -> bool:
    try:
        hash(obj)
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def graphs_of(model: torch.nn.Module) -> list[GraphRecord]:
    """The graphs compiled for this model, in compile order: found through dynamo's cache, or
    (on a torch whose cache cannot be walked) by the parameters they read."""
    try:
        ids = _dynamo_records(model)
    except (ImportError, AttributeError):
        ids = set()
    if ids:
        return [r for r in _COMPILED if id(r) in ids]
    mine = {id(p) for p in model.parameters()}
    return [r for r in _COMPILED if any((p := ref()) is not None and id(p) in mine for ref in r.params)]


def _inner(name: str, gm: fx.GraphModule, example_inputs, inductor: Inductor | None = None):
    if name == "eager":
        return gm.forward
    try:
        if name == "inductor" and inductor is not None and inductor.given:
            return inductor_with(inductor.mode, inductor.options)(gm, example_inputs)
        return inner_compiler(name)(gm, example_inputs)
    except Exception as err:  # noqa: BLE001 - re-raised unless torch's tracer refused a run-time value
        return eagerly(gm, name, err)


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass(frozen=True)
class Inductor:
    """What ``torch.compile`` asks of inductor beyond the graph: its ``mode`` (CUDA graphs
    with "reduce-overhead") and the options that are inductor's own ("triton.cudagraphs")."""

    mode: str | None = None
    options: tuple = ()  # (key, value) pairs, as given

    @property
    def given(self) -> bool:
        return (self.mode not in (None, "default")) or bool(self.options)


def _inductor(mode, options: dict, inner: str) -> Inductor:
    """``mode`` and inductor's options checked here, so that none is dropped: each reaches
    inductor, or fails naming what cannot."""
    if mode is not None and mode not in MODES:
        raise ConfigError(f"nanpass: unknown torch.compile mode {mode!r}; valid modes: "
                          + ", ".join(repr(m) for m in MODES))
    wanted = Inductor(mode, tuple(options.items()))
    if not wanted.given:
        return wanted
    if inner != "inductor":
        asked = f"mode={mode!r}" if mode not in (None, "default") else \
            f"inductor option {next(iter(options))!r}"
        raise ConfigError(f"nanpass: {asked} is for inductor, and this backend's inner compiler "
                          f"is {inner!r}; use inner='inductor' (the default) or leave it out")
    try:
        inductor_with(mode, options)
    except RuntimeError as e:  # inductor's own check of each key and its type
        bad = next((k for k in options if k in str(e) or k.replace("-", "_") in str(e)), None)
        what = f"unknown backend option {bad!r}" if bad is not None else "an option inductor refuses"
        valid = ", ".join(repr(o) for o in OPTIONS)
        raise ConfigError(f"nanpass: {what}; valid options: {valid}, or an option of inductor's "
                          f"(torch._inductor.config; inductor says: "
                          f"{str(e).split(', known')[0]})") from None
    return wanted


class _WatchedGraph(fx.Interpreter):
    """A graph run node by node, each call's result checked as check mode checks an eager
    call (``_watch.py``), the node's module path and source line naming it."""

    def __init__(self, gm: fx.GraphModule, watch: Watch, sites: GraphSites):
        super().__init__(gm)
        self.watch, self.sites = watch, sites

    def run_node(self, n: fx.Node):
        if n.op not in ("call_function", "call_method"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        func = n.target if n.op == "call_function" else getattr(type(args[0]), n.target, None)
        if func is None or n.target in _STRUCTURAL:
            return super().run_node(n)
        self.sites.at(module_path(n)[0], user_frame(n.meta.get("stack_trace")))
        hit = CALLS.get(func) if _hashable(func) else None
        return self.watch.run(func, hit, args, kwargs, _inplace(func))


_STRUCTURAL = (operator.getitem,)


def _watched_graph(gm: fx.GraphModule, warn: bool):
    sites = GraphSites()
    watch = Watch(sites, warn)

    def run(*args):
        watch.found = False
        return _WatchedGraph(gm, watch, sites).run(*args)

    return run


_SAID: list = []


def _warn_if_eager_calls_unguarded() -> None:
    """Once a process: on a torch whose ``torch.compile`` wrapper nanpass cannot reach, the calls
    dynamo runs outside the graphs run as written; never in silence."""
    if "compile_context" not in _compat.MISSING or _SAID:
        return
    _SAID.append(True)
    warnings.warn(
        f"nanpass: torch {torch.__version__} lacks {_compat.ENTRIES['compile_context'].needs}: "
        "calls dynamo runs outside the backend's graphs (after a graph break, in a frame it skips, "
        "past its recompile limit) run unguarded; torch.compile(nanpass.harden(model)) guards them",
        GuardWarning, stacklevel=3)


def compile_graph(
    gm: fx.GraphModule,
    example_inputs,
    config: Config,
    inner: str | None = None,
    keep: Callable[[GraphRecord], None] | None = None,
    first_shapes: dict | None = None,
    inductor: Inductor | None = None,
):
    """Rewrite ``gm``, record what the report needs, then compile (inductor takes ownership
    of the graph and may mutate it, so the record is taken first)."""
    inner = inner or config.inner
    _warn_if_eager_calls_unguarded()
    frame = _compat.compiling_frame_locals()
    if frame:  # paths are taken in the frame's self where it is a module (_source.module_path)
        gm.meta[SELF_IS_MODULE] = isinstance(frame.get("self"), torch.nn.Module)
    checking = config.mode in ("check", "warn")
    sites = [] if checking and inner != "eager" else None
    eager = None
    if checking:  # the same graph, every node checked: to name the op that fired (or, with
        # inner="eager", to run it: every call checked as it runs, as harden's check mode)
        eager = _watched_graph(copy.deepcopy(gm), config.mode == "warn")
    record = rewrite_and_record(gm, config, "dynamo", example_inputs, sites)
    if config.shape_checks:
        record = _shape_checks(gm, record, config, {} if first_shapes is None else first_shapes)
    (keep or _COMPILED.append)(record)
    probe = None
    if gm.meta.get("nanpass_probe"):  # the graph's last input: see _check.tap
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        probe = tensors[0].device if tensors else torch.device("cpu")
        example_inputs = [*example_inputs, torch.zeros((), device=probe, requires_grad=True)]
    compiled = eager if checking and inner == "eager" else _inner(inner, gm, example_inputs, inductor)
    if probe is not None:
        untap(gm)
    if sites is not None:
        compiled = flagged(compiled, sites, warn=config.mode == "warn", eager=eager, probe=probe)
    compiled = _outside_eager_guards(compiled)
    _note_owner(record)
    # dynamo installs torch._dynamo.disable(compiled); where compiled is itself a disable
    # wrapper (aot_eager's, inductor's), that re-wraps the original callable and drops this
    # one: the record goes on both
    for obj in (compiled, getattr(compiled, "_torchdynamo_orig_callable", None)):
        if obj is None:
            continue
        with contextlib.suppress(AttributeError, TypeError):
            setattr(obj, _RECORD, record)
        if _hashable(obj):
            _BY_CALLABLE[obj] = record
    return compiled


def _outside_eager_guards(compiled):
    """A compiled graph runs as compiled: the eager guards of the call it runs in (the
    stand-ins, ``EagerSites``) are off inside it (the graph holds its own guards; inductor's
    extern kernels and an eager graph's guard code call torch's functions by name)."""

    def run(*args):
        prev = _fastpath.paused()
        if prev is None:
            return compiled(*args)
        try:
            return compiled(*args)
        finally:
            _fastpath.resume(prev)

    run.__wrapped__ = compiled
    return run


def _shape_checks(gm: fx.GraphModule, record: GraphRecord, config: Config,
                  first_shapes: dict) -> GraphRecord:
    """Enforce the first compile's shapes: dynamo recompiles on a new static shape, and the
    recompile is compared here (so nothing runs per call). A symbolic dim is free when its
    symbols come only from declared dynamic dims of the inputs."""
    params = [r() for r in record.params]
    key = (graph_key(gm), tuple(id(p) for p in params))
    held = first_shapes.get(key)  # (the parameters, weakly; the shapes): ids of live ones only
    if held is None or any(r() is not p for r, p in zip(held[0], params, strict=True)):
        held = first_shapes[key] = (record.params, graph_shapes(gm))
    first = held[1]
    if first is not None:
        compare_shapes(gm, first, dict(config.dynamic_dims))
    asserts = insert_asserts(gm, graph_shapes(gm))
    return dataclasses.replace(record, code=gm.code, asserts=tuple(asserts))


class EagerSites(Sites):
    """The calls a compiled model or function makes outside every graph the backend rewrote
    (after a graph break, in a frame dynamo skips, past the recompile limit, under
    ``torch.compiler.set_stance("force_eager")``): each call the rule table names is guarded
    as ``harden`` guards it (the stand-ins of ``_fastpath``), with the backend's options,
    and recorded once per site with its module path (in the outermost module whose code is
    running: the model the program called) and source line."""

    def __init__(self, config: Config):
        super().__init__(None, config)
        self.roots: list[tuple[Change, weakref.ref | None]] = []  # each change, its model

    def call(self, hit, args: tuple, kwargs: dict):
        if _compat.tracing():  # dynamo, AOTAutograd or inductor running fake tensors through
            rule, sp, swapped = hit  # torch's functions: torch's own, as written
            if swapped:
                args = (args[1], args[0], *args[2:])
            return sp.call(*args, **kwargs)
        return super().call(hit, args, kwargs)

    def _path(self, module: torch.nn.Module | None) -> str | None:
        if module is None:
            return ""
        got = self._paths.get(id(module))
        if got is None or got[0]() is not module:
            self._paths.update({id(m): (weakref.ref(m), name) for name, m in _root(module).named_modules()})
            got = self._paths.get(id(module))
        return got[1] if got is not None and got[0]() is module else None

    def _note(self, key, rule, sp, module, frame, *rest, **kwargs) -> Change | None:
        change = super()._note(key, rule, sp, module, frame, *rest, **kwargs)
        if change is not None:
            root = _root(module) if module is not None else None
            self.roots.append((change, weakref.ref(root) if root is not None else None))
        return change

    def changes_of(self, model: torch.nn.Module | None) -> list[Change]:
        """The changes made in ``model``'s calls (all of them for None)."""
        return [c for c, ref in self.roots if model is None or (ref is not None and ref() is model)]


def _root(module: torch.nn.Module) -> torch.nn.Module:
    """The outermost module whose code is running (the model the program called), past the
    wrapper ``torch.compile`` puts around a module (its paths would start ``_orig_mod.``)."""
    root = module
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_argcount and f.f_code.co_varnames[0] == "self":
            obj = f.f_locals.get("self")
            if isinstance(obj, torch.nn.Module) and not _compat.compiled_module(obj):
                root = obj
        f = f.f_back
    return root


class _EagerCalls:
    """Entered by dynamo around each call of a compiled callable: the stand-ins guard what
    runs eagerly in it; graphs and dynamo's own tracing run as they would without."""

    __slots__ = ("sites", "prev")

    def __init__(self, sites: EagerSites | None):
        self.sites = sites

    def __enter__(self):
        self.prev = _fastpath.enter(self.sites) if self.sites is not None else None

    def __exit__(self, *exc):
        if self.sites is not None:
            _fastpath.leave(self.prev)
        return False


# every live EagerSites, in order made (report() looks for a model's eager calls in each); held
# weakly: a backend made per torch.compile call (nanpass.enable's) leaves nothing behind it
_EAGER: list[weakref.ref] = []
_EAGER_LOCK = threading.Lock()


def _eager_sites(config: Config) -> EagerSites | None:
    """Eager guards for a backend's calls: in guard mode (check modes look at every call,
    which the stand-ins do not see)."""
    if config.mode != "guard":
        return None
    sites = EagerSites(config)
    with _EAGER_LOCK:
        _EAGER[:] = [r for r in _EAGER if r() is not None]
        _EAGER.append(weakref.ref(sites))
    return sites


def eager_changes(model: torch.nn.Module | None) -> list[Change]:
    return [c for r in _EAGER if (s := r()) is not None for c in s.changes_of(model)]


class Backend:
    """A configured backend: ``torch.compile(model, backend=nanpass.backend(...))``.
    ``.graphs`` holds a GraphRecord for every graph it compiled."""

    def __init__(self, config: Config, inductor: Inductor | None = None):
        self.config = config
        self.inductor = inductor or Inductor()
        self.graphs: list[GraphRecord] = []
        self._first_shapes: dict = {}  # shape_checks: the first compile's shapes, per graph
        self.eager = _eager_sites(config)
        eager = self.eager

        def context(**_):
            return _EagerCalls(eager)

        # (an attribute of the instance: dynamo's own wrapper copies the backend's __dict__)
        self.backend_ctx_ctor = _compat.compile_context(context)

    def __call__(self, gm: fx.GraphModule, example_inputs, mode: str | None = None,
                 options: dict | None = None, **_):
        inductor = self.inductor
        if mode is not None or options:  # torch.compile(backend=nanpass.backend(), mode=...)
            inductor = _inductor(mode or inductor.mode, {**dict(inductor.options), **(options or {})},
                                 self.config.inner)
        return compile_graph(gm, example_inputs, self.config, keep=self._keep,
                             first_shapes=self._first_shapes, inductor=inductor)

    def _keep(self, record: GraphRecord) -> None:
        self.graphs.append(record)
        _COMPILED.append(record)

    @property
    def changes(self) -> list[Change]:
        return [c for g in self.graphs for c in g.changes] + self.eager_changes

    @property
    def eager_changes(self) -> list[Change]:
        """The calls guarded (or left) outside every graph: see ``EagerSites``."""
        return self.eager.changes_of(None) if self.eager is not None else []

    def __deepcopy__(self, memo) -> Backend:
        """Itself: one backend is one record of what it compiled and guarded (Lightning
        Fabric's torch.compile wrapper deep-copies the keyword arguments of every call)."""
        return self

    def __repr__(self) -> str:
        return f"nanpass.backend({self.config.as_options() | {'inner': self.config.inner}})"


def _config(options: dict, inductor_ok: bool = False) -> Config:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown and not inductor_ok:
        raise ConfigError(
            f"nanpass: unknown backend option {unknown[0]!r}; valid options: "
            + ", ".join(repr(o) for o in OPTIONS)
        )
    config = make_config(**{k: v for k, v in options.items() if k in OPTIONS})
    refuse_broken_guards(config)
    if config.count and config.inner != "eager":
        what = "mode='guard+check'" if config.mode == "guard+check" else "count=True"
        raise ConfigError(
            f"nanpass: {what} keeps counters on the device from eager guards and cannot be "
            f"compiled by {config.inner!r} yet; use inner='eager', or nanpass.harden(model, ...)"
        )
    return config


def backend(inner: str = "inductor", *, compile_mode: str | None = None,
            inductor_options: dict | None = None, **options) -> Backend:
    """A backend callable with these options; ``inner`` is "inductor", "aot_eager" or "eager".
    ``compile_mode`` ("reduce-overhead": CUDA graphs, "max-autotune", ...) and
    ``inductor_options`` (``{"triton.cudagraphs": True}``) are inductor's, as
    ``torch.compile``'s ``mode=`` and ``options=`` would give them."""
    config = _config({"inner": inner, **options})
    return Backend(config, _inductor(compile_mode, dict(inductor_options or {}), config.inner))


_STATE = "__nanpass_first_shapes__"


def nanpass_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None,
                    mode: str | None = None, **_):
    """The entry-point backend; ``torch.compile(..., options={...})`` arrives as ``options``,
    the same dict on every recompile of that compiled model: per-model state (the shapes
    shape_checks compares recompiles with) lives in it, never in a global two models share.
    ``torch.compile``'s ``mode`` and the options that are not nanpass's go to inductor."""
    options = options if options is not None else {}
    given = {k: v for k, v in options.items() if k not in (_STATE, _EAGER_KEY)}
    config = _config(given, inductor_ok=True)
    inductor = _inductor(mode, {k: v for k, v in given.items() if k not in OPTIONS}, config.inner)
    first = options.setdefault(_STATE, {}) if config.shape_checks else None
    return compile_graph(gm, example_inputs, config, first_shapes=first, inductor=inductor)


_EAGER_KEY = "__nanpass_eager__"
_ENTRY_EAGER: dict = {}  # the entry point without options: its eager guards, made once


@_compat.compile_context
def _entry_context(options: dict | None = None, **_):
    """``torch.compile(model, backend="nanpass", options=...)``: the eager guards of each call,
    kept in the options dict (the same one on every call of that compiled model)."""
    if options is None:
        if "sites" not in _ENTRY_EAGER:
            _ENTRY_EAGER["sites"] = _eager_sites(_config({}, inductor_ok=True))
        return _EagerCalls(_ENTRY_EAGER["sites"])
    if _EAGER_KEY not in options:
        given = {k: v for k, v in options.items() if k not in (_STATE, _EAGER_KEY)}
        options[_EAGER_KEY] = _eager_sites(_config(given, inductor_ok=True))
    return _EagerCalls(options[_EAGER_KEY])


nanpass_backend.backend_ctx_ctor = _entry_context
