"""Check mode for every op: the first call of any kind whose result turns NaN, or overflows,
forward and backward.

The rule table names the ops that *can* make a NaN on their own; a debugging mode has to see
the rest too (an overflow in a float16 product, ``-inf * 0`` after a mask, a mean of nothing, a
custom Function's backward). So check mode runs every call as written and looks at its result:
one reduction per floating result, and more only when that is not finite. In backward, a hook
on each autograd node the call made compares the gradients it received with those it gave.

An infinity is not always an error: ``masked_fill(mask, -inf)`` and ``mask.log()`` make one on
purpose, and a softmax that keeps a finite entry in its row lets it die. An Inf made from a
constant or at one of an op's poles (``log(0)``, ``x / 0``; the rule table's ``poles``) is
remembered and stays quiet; it is named, with where it was born, when it turns into NaN or
reaches the output, the loss or a gradient. Any other Inf from finite operands is an overflow,
never on purpose, and is named at once.
"""

from __future__ import annotations

import collections
import contextlib
import linecache
import math
import threading
import weakref
from collections.abc import Mapping

import torch

from . import _deferred as deferred
from ._check import COLLECT, PROGRESS, Event, Site, _report, _suspicious_row, describe, unread
from ._compat import custom_function, is_view, view_base, weak_id_dict
from ._deferred import FINITE, INF, NAN, Backward, Forward, Record, pole_flag, read

Tensor = torch.Tensor
_HALF = (torch.float16, torch.bfloat16)
_KEY = "nanpass_watch"  # an autograd node's metadata: the site that made it
# nanpass.enable: the verdicts of a program that neither steps an optimizer nor runs a backward
# (an evaluation loop) are read once this many are kept, so that they never pile up
_MOST = 20_000
_FREED = "freed (or written over) before nanpass read the step's verdicts"
# autograd nodes whose backward only moves a gradient (a view, a transpose, a slice): it
# cannot make one non-finite, so they are not hooked (an expand's backward sums: it is)
_MOVES = frozenset({
    "ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "TBackward0",
    "TransposeBackward0", "TransposeBackward1", "PermuteBackward0", "SliceBackward0",
    "SelectBackward0", "SqueezeBackward0", "SqueezeBackward1", "SqueezeBackward2",
    "UnsqueezeBackward0", "SplitBackward0", "SplitWithSizesBackward0", "UnbindBackward0",
    "CatBackward0", "StackBackward0", "CloneBackward0", "AliasBackward0", "NegBackward0",
    "MaskedFillBackward0", "ViewAsRealBackward0", "UnfoldBackward0"})

# calls whose value and backward only move values already made (a view's, a concatenation's):
# eager check mode's collecting pass lets them run as called (their results are views, or
# copies a later call reads as values of their own; the run again at each op watches them)
REARRANGE = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "t", "permute", "split",
    "split_with_sizes", "chunk", "unbind", "narrow", "select", "squeeze", "unsqueeze", "flatten",
    "unflatten", "contiguous", "clone", "detach", "cat", "concat", "concatenate", "stack",
    "movedim", "moveaxis", "swapaxes", "swapdims"})

# and the calls whose value only selects or repeats values already made, though their backward
# sums (compiled check mode notes no new value for any of these; a cast, which can overflow, is
# not among them)
MOVE_ONLY = REARRANGE | {
    "__getitem__", "expand", "expand_as", "index_select", "gather", "take_along_dim", "roll",
    "flip", "repeat", "tile", "tril", "triu", "unfold", "diagonal", "as_strided", "real", "imag"}

_OPERATORS = {
    "__add__": "+", "__radd__": "+", "__iadd__": "+=", "__sub__": "-", "__rsub__": "-",
    "__isub__": "-=", "__mul__": "*", "__rmul__": "*", "__imul__": "*=", "__truediv__": "/",
    "__rtruediv__": "/", "__itruediv__": "/=", "__div__": "/", "__rdiv__": "/",
    "__matmul__": "@", "__rmatmul__": "@", "__pow__": "**", "__rpow__": "**", "__ipow__": "**=",
    "__neg__": "unary -", "__floordiv__": "//", "__rfloordiv__": "//", "__mod__": "%",
}
_MODULES = {"torch._C._nn": "F", "torch.nn.functional": "F", "torch._C._linalg": "torch.linalg",
            "torch._C._special": "torch.special", "torch._C._fft": "torch.fft",
            "torch.functional": "torch", "torch": "torch"}


def op_name(func) -> str:
    """How a user would write the call: ``*``, ``Tensor.masked_fill``, ``F.linear``."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name in _OPERATORS:
        return _OPERATORS[name]
    mod = getattr(func, "__module__", None) or ""
    if mod in ("_operator", "operator") and f"__{name}__" in _OPERATORS:
        return _OPERATORS[f"__{name}__"]
    qual = getattr(func, "__qualname__", name)
    if qual.split(".")[0] in ("TensorBase", "_TensorBase", "Tensor"):
        return f"Tensor.{name}"
    prefix = _MODULES.get(mod, mod)
    return f"{prefix}.{name}" if prefix else name


def inplace(func) -> bool:
    """Whether a call writes into its first operand (``add_``, ``+=``)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i") or (
        name.startswith("i") and getattr(func, "__module__", None) in ("_operator", "operator"))


def _finite(t: Tensor) -> bool:
    """One reduction and one read: a sum is finite only if every element is (a half sum is
    taken in float32; a sum that overflows is looked at again, element by element)."""
    s = t.sum(dtype=torch.float32) if t.dtype in _HALF else t.sum()
    return math.isfinite(s.item()) or bool(torch.isfinite(t).all())


# the dtypes a check reduces (float8's have no reduction: not watched, counted)
_READ = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_STRIDED = torch.strided


def readable(t) -> bool:
    """A dense floating tensor whose values can be read here (a subclass such as a DTensor
    or a FakeTensor is checked by the ops it runs, not read as a whole; a meta, sparse or
    float8 tensor has nothing a check can reduce: ``unwatched`` says which)."""
    return ((type(t) is Tensor or type(t) is torch.nn.Parameter) and t.dtype in _READ
            and t.layout is _STRIDED and not t.is_meta and t.numel() > 0)


def unwatched(t) -> str | None:
    """Why a floating result a check cannot reduce is not watched (None: a tensor the check
    does not look at by design: an integer, an empty one, a subclass that runs its own ops)."""
    if not isinstance(t, Tensor) or not (t.is_floating_point() or t.is_complex()):
        return None
    if t.is_nested:
        return "nested tensors"
    if type(t) is not Tensor and type(t) is not torch.nn.Parameter:
        return None
    if t.is_meta:
        return "meta tensors (no values)"
    if t.layout is not _STRIDED:
        return f"{str(t.layout).removeprefix('torch.')} tensors"
    if t.is_complex():
        return None
    if t.dtype not in _READ:
        return f"{str(t.dtype).removeprefix('torch.')} tensors"
    return None


def _tensors(xs, out: list) -> list:
    for x in xs:
        if isinstance(x, Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            _tensors(x, out)
    return out


def _view_of_operand(o: Tensor, args, kwargs) -> bool:
    base = view_base(o)
    for t in _tensors((*args, *kwargs.values()), []):
        if t is base or (is_view(t) and view_base(t) is base):
            return True
    return False


def leaves(x, out: list | None = None) -> list:
    """The tensors in a model's output (tuples, lists, dicts, a Hugging Face ModelOutput)."""
    out = [] if out is None else out
    if isinstance(x, Tensor):
        out.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            leaves(v, out)
    elif isinstance(x, Mapping):
        for v in x.values():
            leaves(v, out)
    return out


def _nonfinite_number(xs) -> bool:
    for x in xs:
        if isinstance(x, float) and not math.isfinite(x):
            return True
        if isinstance(x, (tuple, list)) and _nonfinite_number(x):
            return True
    return False


class _Origin:
    """Where an infinity was made on purpose (a constant or a pole), and what it was."""

    __slots__ = ("site", "why")

    def __init__(self, site: Site, why: str):
        self.site, self.why = site, why

    def __str__(self) -> str:
        return f"{self.why} {self.site}"


class _Made:
    """What an autograd node's backward is named by: the call that made it, kept cheap (the
    source line is read only when something is reported)."""

    __slots__ = ("op", "spelling", "module", "path", "file", "line", "nonfinite", "fn")

    def __init__(self, op, spelling, module, path, file, line, fn=None):
        self.op, self.spelling, self.module, self.path = op, spelling, module, path
        self.file, self.line, self.nonfinite, self.fn = file, line, False, fn

    def site(self) -> Site:
        source = f"{self.file}:{self.line}" if self.file else None
        code = (linecache.getline(self.file, self.line).strip() or None) if self.file else None
        cls = type(self.module).__name__ if self.module is not None else ""
        return Site(self.op, self.spelling, self.path or "", cls, source, code)


class Watch:
    """The every-op check of one hardened model (or of ``nanpass.enable``). ``sites`` gives
    the call site (``_where``) and module paths (``_path``), as for the guards."""

    def __init__(self, sites, warn: bool, deferred: bool = False):
        self.sites = sites
        self.warn = warn
        self.origins = weak_id_dict()  # tensor -> _Origin of the infinity it holds
        self.found = False  # something was reported since the last reset (warn, locate)
        # verdicts kept on the device and read once after the forward and the backward
        # (_deferred.py); False: read at each op (stop_at_op=True, nanpass.locate, enable)
        self.deferring = deferred
        # harden's default (issue 47): the forward runs as written with no mode, its outputs and
        # the backward's gradients screened on the device, the step run again at each op on a
        # hit (``_harden._screen``); False: every call watched (every_op=True, stop_at_op=True)
        self.screening = False
        self.later: list = []  # hooks waiting for a backward through a create_graph backward's gradients
        self._local = threading.local()  # the forward being collected, per thread
        self.pending_backward: Backward | None = None
        self._poles: dict = {}
        # nanpass.enable: one Forward kept open for the program's main thread, read when a
        # backward starts, before an optimizer step and at the end (``flush``), with the
        # backwards that ended since the last read
        self.program = False
        self._program: Forward | None = None
        self._backwards: list[Backward] = []
        # nanpass.enable's screen: outermost module calls and their backwards, judged when the
        # program's verdicts are read (``_screen.ProgramScreen``)
        self.screens: list = []
        # compiled check mode: patterns of infinities found made on purpose, and the backward
        # checks waiting (``_harden._settle``)
        self.quiet: set = set()
        self.born = 0  # infinities made on purpose seen (a run again that saw none, saw nothing)
        self.compiled_pending: collections.deque = collections.deque()
        self.unwatched: dict[str, int] = {}  # results a check cannot reduce, by kind
        self._travelled = None  # (origin, site): the last call an infinity went on through

    def unwatched_summary(self) -> str:
        kinds = ", ".join(f"{n} result{'s' if n != 1 else ''} of {why}" for why, n in self.unwatched.items())
        return f"nanpass: not watched (a check cannot reduce them): {kinds}"

    def collecting(self) -> bool:
        """A hardened forward's verdicts are being collected on the device in this thread
        (not nanpass.enable's program, whose records make its findings; not locate)."""
        return (not self.program and getattr(self._local, "forward", None) is not None
                and COLLECT.get() is None)

    @property
    def deferred(self) -> bool:
        """Verdicts kept on the device, except in this thread's run again at each op."""
        return self.deferring and not getattr(self._local, "again", False)

    @contextlib.contextmanager
    def at_each_op(self):
        """This thread's calls checked at each op (a run again that names the op): other
        threads running the same model keep their verdicts on the device."""
        self._local.again = True
        try:
            yield
        finally:
            self._local.again = False

    @contextlib.contextmanager
    def recomputing(self):
        """A checkpointed region's recompute in backward: the values the forward made and the
        check looked at, made again. Its nodes are hooked (a reentrant checkpoint's backward
        runs through them), its values not read again (a read at each op of the backward)."""
        self._local.recompute = getattr(self._local, "recompute", 0) + 1
        try:
            yield
        finally:
            self._local.recompute -= 1

    def start_program(self) -> None:
        """nanpass.enable's check: verdicts on the device, read at the step's few points."""
        self.deferring = self.program = True

    @property
    def pending(self) -> Forward | None:
        if self.program:
            if threading.current_thread() is not threading.main_thread():
                return None  # (the program's mode is the main thread's)
            if self._program is None:
                self._program = Forward()
            return self._program
        return getattr(self._local, "forward", None)

    @pending.setter
    def pending(self, step: Forward | None) -> None:
        self._local.forward = step

    # -- forward ------------------------------------------------------------------------------
    def run(self, func, hit, args: tuple, kwargs: dict, inplace: bool = False, named=None):
        """``func(*args, **kwargs)`` as called, then its result checked (``named``: the
        callable to name, where ``func`` wraps it)."""
        first = args[0] if args else None
        before = None
        skip = unread(func, args, kwargs)  # (baddbmm's input with beta=0: never blamed)
        wrote = inplace and isinstance(first, Tensor) and readable(first) and first is not skip
        step = self.pending
        if step is not None and COLLECT.get() is not None:
            step = None  # nanpass.locate: every event, at its op
        again = step is None and getattr(self._local, "recompute", 0) and COLLECT.get() is None
        if step is not None:  # the operands' values, looked up before an in-place op writes
            tensors = _tensors((*args, *kwargs.values()), [])
            operands = [step.slot_of(t) for t in tensors if readable(t) and t is not skip]
        elif wrote and not again:
            before = _finite(first)  # an in-place op overwrites its operand: look first
        out = func(*args, **kwargs)
        func = named or func
        tick = PROGRESS.get()
        if tick is not None:
            tick()
        if isinstance(out, Tensor):
            outs = (out,)
        elif isinstance(out, (tuple, list)):
            outs = [o for o in out if isinstance(o, Tensor)]
        else:
            if step is not None:
                if isinstance(first, Tensor) and readable(first):  # x[mask] = v writes into x
                    call = self._call(func, hit, args, kwargs, [first], -1) if self.program else None
                    step.records.append(Record([step.add(first)], operands, _nonfinite_number(args[1:]),
                                               None, None, inplace=True, call=call))
                    self._enough(step)
            elif isinstance(first, Tensor) and _nonfinite_number(args[1:]):  # x[mask] = -inf
                self._born(first, _Origin(self._site(func, hit), "made on purpose (an infinite constant) by"))
            return out
        made = None
        grad = torch.is_grad_enabled()
        new = [] if step is not None else None
        for o in outs:
            if grad and o.grad_fn is not None and _KEY not in o.grad_fn.metadata:
                made = made or self._made(func, hit)
                self._hook(o, args, kwargs, made)
            if not readable(o):
                why = unwatched(o)
                if why is not None:  # (said once, at the end: what was not watched)
                    self.unwatched[why] = self.unwatched.get(why, 0) + 1
                continue
            if o is not first and is_view(o) and _view_of_operand(o, args, kwargs):
                continue  # a view of an operand makes no new value
            if new is not None:
                new.append(o)
            elif not again and not _finite(o):
                self._nonfinite(func, hit, args, kwargs, o, before, made)
                if made is not None:
                    made.nonfinite = True
        if new:
            self._record(step, hit, args, kwargs, new, tensors, operands, made, wrote and new[0] is first,
                         func, wrote)
            self._enough(step)
        elif again and made is not None:
            self._recomputed(made, [o for o in outs if readable(o)])
        return out

    def _recomputed(self, made: _Made, values: list) -> None:
        """A recomputed call's values join the backward's one read, so that its nodes know
        whether their forward value was finite (a NaN the forward named is not named again as
        the backward's own)."""
        if not values:
            return
        try:
            bw = deferred.start_backward(self)
        except RuntimeError:  # (not inside a backward after all: nothing to join)
            return
        bw.records.append((made, None, bw.slots_of(values), [], None))

    def _call(self, func, hit, args, kwargs, outs, before, made=None) -> tuple:
        """What the check of a call needs once its verdict is read (nanpass.enable): its site
        (the frames are gone by then), its results and its floating operands (in the order
        the check describes them), held weakly."""
        skip = unread(func, args, kwargs)
        plain = [deferred.Ref(t) for t in _tensors((*args, *kwargs.values()), [])
                 if readable(t) and t is not skip]
        return hit, [deferred.Ref(o) for o in outs], before, made or self._made(func, hit), plain

    def _enough(self, step: Forward) -> None:
        if self.program and len(step.scalars) > _MOST:
            self.flush()

    def _record(self, step: Forward, hit, args, kwargs, new, tensors, operands, made, inplace,
                func=None, wrote=False) -> None:
        """The deferred check of one call: a scalar per new value, and what it was made from."""
        outs = [step.add(o) for o in new]
        constant = not tensors or _nonfinite_number((*args, *kwargs.values()))
        pole = None
        if hit is not None and hit[0].poles:
            ops = (args[1], args[0], *args[2:]) if hit[2] else args
            k = hit[0].pole_operand
            x = ops[k] if k < len(ops) else None
            if isinstance(x, Tensor) and readable(x) and x.dim() <= new[0].dim():
                pole = step.add(new[0], pole_flag(new[0], x, hit[0].poles, self._poles))
        call = None
        if self.program:  # the operand an in-place call overwrote: its state before
            call = self._call(func, hit, args, kwargs, new, operands[0][0] if wrote and operands else None, made)
        step.records.append(Record(outs, operands, constant, pole, made, inplace, call))

    def _made(self, func, hit) -> _Made:
        module, path, file, line = self.sites.locate()
        op = hit[0].name if hit is not None else ""
        return _Made(op, hit[1].name if hit is not None else op_name(func), module, path, file, line)

    def _site(self, func, hit) -> Site:
        return self._made(func, hit).site()

    def _nonfinite(self, func, hit, args, kwargs, o: Tensor, before, made) -> None:
        tensors = _tensors((*args, *kwargs.values()), [])
        skip = unread(func, args, kwargs)
        inputs = [t for t in tensors if readable(t) and t is not skip]
        # made from nothing but numbers (torch.full, torch.tensor): a constant, on purpose
        constant = not tensors or _nonfinite_number((*args, *kwargs.values()))
        if before is not None and inputs and inputs[0] is o:
            inputs = inputs[1:]
        in_nan = any(bool(torch.isnan(t).any()) for t in inputs)
        in_inf = [t for t in inputs if bool(torch.isinf(t).any())]
        nan = bool(torch.isnan(o).any())
        if before is False:  # the in-place operand was already non-finite
            in_inf = in_inf or [o]
            in_nan = in_nan or nan
        if nan and not in_nan and constant:
            # a NaN constant (torch.tensor(nan), a NaN fill a nan-reduction ignores): on purpose
            self._born(o, _Origin(self._site(func, hit), "made on purpose (a NaN constant) by"))
            return
        if nan and not in_nan:
            origin = next((x for x in map(self._origin, in_inf) if x is not None), None)
            site = self._site(func, hit)
            if in_inf:
                why = (f"the infinity in its operand was {origin}" if origin is not None else
                       "the infinity in its operand came from code nanpass did not watch")
                self._emit("forward", "NaN", site, f"NaN created by {site}\n  from an infinity: {why}",
                           inputs)
            else:
                self._emit("forward", "NaN", site,
                           f"NaN created by {site}\n  every operand was finite", inputs)
            return
        if nan or in_nan:
            site = None
            if COLLECT.get() is not None:  # locate's chain: what the NaN went through
                site = self._site(func, hit)
                COLLECT.get().append(Event("forward", "NaN", False, site,
                                           f"nanpass: NaN passed through {site}"))
            if not self.found:  # where it was first seen, for the output's error
                nans = [t for t in inputs if bool(torch.isnan(t).any())]
                origin = next((x for x in map(self._origin, nans) if x is not None), None)
                if origin is None:
                    site = site or self._site(func, hit)
                    param = any(isinstance(t, torch.nn.Parameter) for t in nans)
                    origin = _Origin(site, "already in a parameter (an earlier step put it there) "
                                     "read by" if param else "first seen in an operand of")
                self._born(o, origin)
            return
        if in_inf:  # an infinity travelling on
            origin = next((x for x in map(self._origin, in_inf) if x is not None), None)
            if origin is None:  # from the input, or code nanpass did not watch
                origin = _Origin(self._site(func, hit), "first seen in an operand of")
            self._born(o, origin)
            return
        # an Inf from finite operands: on purpose (a constant, a pole) or an overflow
        site = self._site(func, hit)
        if constant:
            self._born(o, _Origin(site, "made on purpose (an infinite constant) by"))
            return
        if hit is not None and hit[0].poles:
            operands = (args[1], args[0], *args[2:]) if hit[2] else args
            k = hit[0].pole_operand
            x = operands[k] if k < len(operands) else None
            if isinstance(x, Tensor) and readable(x) and x.dim() <= o.dim():
                at = torch.isin(x, torch.tensor(hit[0].poles, dtype=x.dtype, device=x.device))
                if bool((torch.isinf(o) & at).any()):
                    self._born(o, _Origin(site, f"made at a pole of {hit[0].name} by"))
                    return
        self._emit("forward", "Inf", site,
                   f"Inf created by {site}\n  an overflow past the {str(o.dtype)[6:]} maximum "
                   f"({torch.finfo(o.dtype).max:.4g}) from finite operands", inputs)

    def _origin(self, t: Tensor) -> _Origin | None:
        o = self.origins.get(t)
        if o is None and is_view(t):
            o = self.origins.get(view_base(t))
        return o

    def _born(self, t: Tensor, origin: _Origin) -> None:
        """An infinity (or a NaN constant) made on purpose, remembered with where."""
        self.origins[t] = origin
        self.born += 1

    def _emit(self, phase, kind, site, text, inputs=(), created=True) -> None:
        """Report ``text`` with each operand described (None: an operand freed before a
        deferred verdict was read, ``_from_states``)."""
        self.found = True
        operands = tuple(_FREED if t is None else describe(t) for t in inputs)
        detail = "".join(f"\n  operand {i}: {d}" for i, d in enumerate(operands))
        message = f"nanpass: {text}{detail}"
        if any(t is None for t in inputs):
            message += ("\n  (nanpass.enable reads its verdicts once a step, not at each op: "
                        "enable(mode, stop_at_op=True) stops at the op itself)")
        index = _suspicious_row(inputs[0]) if inputs and inputs[0] is not None else None
        _report(Event(phase, kind, created, site, message, operands, index), self.warn)

    # -- the output and the loss ----------------------------------------------------------------
    def escaped(self, tensors, what: str) -> None:
        """A NaN or Inf in ``what`` (the model's output, the loss) is never silent: named with
        the op that made it, or the infinity's birth."""
        for t in tensors:
            if not readable(t) or _finite(t):
                continue
            if bool(torch.isnan(t).any()):
                if self.found:
                    return  # its birth was named already (warn mode, locate)
                origin = self._origin(t)
                seen = f"\n  it was {origin}" if origin is not None else ""
                self._emit("forward", "NaN", origin.site if origin is not None else None,
                           f"NaN in {what}, made by no call nanpass watched (an op that runs "
                           f"outside it, or data): {describe(t)}{seen}", created=False)
            else:
                origin = self._origin(t)
                born = f"\n  it was {origin}" if origin is not None else ""
                self._emit("forward", "Inf", origin.site if origin is not None else None,
                           f"an infinity reaches {what}: {describe(t)}{born}",
                           created=origin is None)
            return

    def watch_output_grads(self, tensors, what: str) -> None:
        """The gradient reaching the output comes from the code after it (the loss)."""
        for t in tensors:
            if isinstance(t, Tensor) and t.requires_grad and t.is_floating_point():
                t.register_hook(_OutputGrad(self, what))

    # -- backward -------------------------------------------------------------------------------
    def _hook(self, o: Tensor, args, kwargs, made: _Made) -> None:
        """Hook every autograd node this call made (walking back from its result to its
        operands'), and an operand's custom Function node, which no call made here."""
        stop = set()
        for t in _tensors((*args, *kwargs.values()), []):
            n = t.grad_fn
            if n is None:
                continue
            stop.add(n)
            cls = custom_function(n)
            if _KEY not in n.metadata and cls is not None and not cls.__module__.startswith("nanpass."):
                self._hook_custom(n, made)
        todo = [o.grad_fn]
        while todo:
            n = todo.pop()
            if n is None or n in stop:
                continue
            md = n.metadata
            if _KEY in md:
                continue
            name = type(n).__name__
            if name == "AccumulateGrad":
                continue
            md[_KEY] = made
            if name not in _MOVES:
                n.register_hook(_NodeCheck(self, made, name))
            todo.extend(f for f, _ in n.next_functions)

    def _hook_custom(self, node, near: _Made) -> None:
        cls = custom_function(node)
        code = getattr(cls.backward, "__code__", None)
        # (torch's own Functions, a reentrant checkpoint's among them, are checked with the
        # rest of the backward, once; a user's is run again to name the line inside it)
        mine = None if cls.__module__.startswith("torch.") else cls
        made = _Made("", f"{cls.__qualname__}.backward", near.module, near.path,
                     code.co_filename if code else None, code.co_firstlineno if code else None, mine)
        node.metadata[_KEY] = made
        try:
            ref = weakref.ref(node)
        except TypeError:
            ref = lambda n=node: n  # noqa: E731
        node.register_hook(_NodeCheck(self, made, type(node).__name__, ref))

    def backward(self, made: _Made, name: str, grad_inputs, grad_outputs, node=None) -> None:
        if torch.is_grad_enabled():  # create_graph: its nodes are checked in the next backward
            for g in grad_inputs:
                if isinstance(g, Tensor) and g.grad_fn is not None and _KEY not in g.grad_fn.metadata:
                    self._hook(g, grad_outputs, {}, made)
        given = [g for g in grad_inputs if isinstance(g, Tensor) and readable(g)]
        # (under torch's anomaly mode a backward raises at the first node whose output holds a
        # NaN: each node is read at once, so that the node that made it is named first)
        if self.deferred and made.fn is None and COLLECT.get() is None and not torch.is_anomaly_enabled():
            # read once when the backward ends (a custom Function's backward is checked here,
            # at its node, so that its own line can be named by running it again)
            received = [g for g in grad_outputs if isinstance(g, Tensor) and readable(g)]
            bw = deferred.start_backward(self)
            bw.records.append((made, name, bw.slots_of(given), bw.slots_of(received),
                               [(tuple(g.shape), g.dtype) for g in given]))
            return
        if all(_finite(g) for g in given):
            return
        received = [g for g in grad_outputs if isinstance(g, Tensor) and readable(g)]
        passed = not all(_finite(g) for g in received)
        if (passed or made.nonfinite) and self.found:
            return  # passed on, or explained by a NaN/Inf already named
        at = None
        if made.fn is not None and node is not None and not passed:
            at = self._rerun_custom(made, node, grad_outputs)
            if at is True:
                return
        bad = next(g for g in given if not _finite(g))
        self._emit_backward(made, name, passed, describe(bad), at or None)

    def _emit_backward(self, made: _Made, name: str, passed: bool, gave: str, site: Site | None = None) -> None:
        site = site or made.site()
        if passed:
            text = (f"non-finite gradient reaches the backward of {site}\n  though every gradient "
                    f"nanpass saw before it was finite: autograd's sum of the gradients flowing "
                    f"into this value overflowed, or a backward nanpass does not watch made it")
        elif made.nonfinite:
            text = (f"non-finite gradient from the backward of {site}\n  whose forward value was "
                    f"already not finite")
        else:
            text = f"non-finite gradient created by the backward of {site}\n  from a finite gradient"
        self._emit("backward", "non-finite gradient", site,
                   f"{text}\n  autograd node {name}; the gradient it gave: {gave}", created=not passed)

    def output_grad(self, what: str, grad: Tensor) -> None:
        self._emit("backward", "non-finite gradient", None,
                   f"non-finite gradient reaches {what} from the code after it (the loss): "
                   f"{describe(grad)}")

    def backward_ended(self, bw: Backward) -> None:
        if self.program:  # read with the calls after it: before the optimizer step, at the
            bw.explained = self.found  # next backward or when enable ends (one read a step)
            self._backwards.append(bw)
        else:
            self.backward_verdicts(bw)

    def backward_verdicts(self, bw: Backward, st: list[int] | None = None, absorb=None,
                          note: str | None = None) -> None:
        """The backward's scalars, read once: the first node that made a finite gradient
        non-finite is named, with its forward site (as ``backward`` names it at the node).
        ``absorb``: a GradScaler skipped this backward's step: an infinity it made is the
        scaler's overflow (given to ``absorb.take``); a NaN made from finite gradients is not."""
        st = read(bw.scalars) if st is None else st
        for made, name, given, received, shapes in bw.records:
            bad = [st[k] for k in given if st[k] != FINITE]
            if name is None:  # a recomputed forward value (``_recomputed``)
                if bad:
                    made.nonfinite = True
                continue
            if made is None:  # the gradient reaching an output, from the loss
                if bad and absorb is not None and NAN not in bad:
                    absorb.take(f"the gradient reaching {name}")
                    return
                if bad:
                    self.output_grad(name, shapes)
                continue
            if not bad:
                continue
            passed = any(st[k] != FINITE for k in received)
            if (passed or made.nonfinite) and self.found:
                return  # passed on, or explained by a NaN/Inf already named
            if absorb is not None and NAN not in bad and not made.nonfinite:
                site = made.site()
                absorb.take(f"{site.spelling} at {site.source}" if site.source else site.spelling)
                return  # (what follows in this backward is that overflow passed on)
            what = "NaN" if NAN in bad else "an infinity"
            gave = ", ".join(f"shape {s} {str(d)[6:]}" for s, d in shapes)
            self._emit_backward(made, name, passed, f"{gave}, with {what} (read once, after the "
                                f"backward; stop_at_op=True stops at the node and describes its values)"
                                + (f"\n{note}" if note else ""))

    # -- nanpass.enable: a program's verdicts ---------------------------------------------------
    def loss_backward(self, func, args, kwargs, grad: bool = False):
        """``loss.backward()`` (and ``torch.autograd.backward``/``grad``): a loss that is not
        finite is named (where its NaN or Inf came from); the next step starts afresh.
        ``torch.autograd.grad`` is most often followed by a manual update, with no optimizer
        step to read before: its backward's verdicts are read as soon as it returns."""
        roots = [t for t in leaves(args[0] if args else kwargs.get("outputs", kwargs.get("tensors")))
                 if isinstance(t, Tensor)]
        step = self.pending if self.program and COLLECT.get() is None else None
        if step is None:
            self.escaped(roots, "the loss")
        else:  # the forward's read: before the backward frees what it saved, which the
            # findings of the code between module calls describe (the backward's verdicts are
            # read when it ends); where no such call ran (the loss made inside the model), only
            # screened module calls, which a run again describes: read with the backward's
            for loss in roots:
                if readable(loss):
                    k = step.get(loss)
                    step.reasons.append(k if k is not None else step.add(loss))
                    step.escapes.append((loss, "the loss"))
            if step.records or not self.screens:
                self.flush()
        try:
            out = func(*args, **kwargs)
        finally:
            self.found = False
        if grad and self.program and COLLECT.get() is None:
            self.flush()
        return out

    def flush(self, absorb=None, note: str | None = None, failing: bool = False) -> None:
        """Read the program's verdicts (the backwards' since the last read with the calls',
        in one copy) and report what the check at each op would have reported, in the order
        it would have. ``absorb``: the backwards were a GradScaler's, whose step it skipped:
        an overflow in them is its (``_enable._ScalerLog.take``), not a finding; ``note``: said
        with a backward's finding. ``failing``: the program is raising: an infinity made on
        purpose that was still travelling is named too (the program's own check of it failed)."""
        step, self._program = self._program, None
        backwards, self._backwards = self._backwards, []
        screens, self.screens = self.screens, []
        fw = step.scalars if step is not None else []
        scalars = [s for bw in backwards for s in bw.scalars] + [s for c in screens for s in c.scalars] + fw
        if not scalars:
            return
        st = read(scalars)  # the one read
        k = 0
        for bw in backwards:  # (each ran before the calls still pending)
            self.found = self.found or bw.explained  # (a NaN its forward had, named already)
            self.backward_verdicts(bw, st[k:k + len(bw.scalars)], absorb, note)
            k += len(bw.scalars)
        st_fw = st[k + sum(len(c.scalars) for c in screens):]
        by_slot: dict = {}
        for c in screens:  # the screened module calls and their backwards, in the order they ran
            c.judge(st[k:k + len(c.scalars)], st_fw, absorb, by_slot)
            k += len(c.scalars)
        st = st_fw
        if fw and (step.verdict(st) is not None or (failing and any(v != FINITE for v in st))):
            self._travelled = None
            self._replay(step, st, by_slot)
            for t, what in step.escapes:
                self.escaped([t], what)
            if failing and not self.found and self._travelled is not None:
                origin, site = self._travelled
                self._emit("forward", "Inf", origin.site,
                           f"an infinity reached {site} before the program raised\n  it was "
                           f"{origin} (quiet while it dies; this one did not)", created=False)

    def _replay(self, step: Forward, st: list[int], by_slot: dict | None = None) -> None:
        """The per-op check, made now from the states on each recorded call whose result was
        not finite, in the order the calls ran (``_from_states``). ``by_slot``: where each
        non-finite value's infinity was born, as far as known already (a screened call's)."""
        by_slot = {} if by_slot is None else by_slot
        for r in step.records:
            if r.call is not None and any(st[k] != FINITE for k in r.outs):
                self._from_states(step, r, st, by_slot)

    def _from_states(self, step: Forward, r: Record, st: list[int], by_slot: dict) -> None:
        """``_nonfinite`` of a recorded call: the same decisions from the states of its
        operands and results, the same message, each operand described where it is still held
        as it was (autograd keeps what it saved; the rest were freed or written over)."""
        hit, wouts, before_k, at, wplain = r.call
        inputs = [x.get() for x in wplain]
        ops = [(k, st[k]) for k, _ in r.operands]
        before = FINITE
        if before_k is not None and before_k != -1 and ops:
            before = ops.pop(0)[1]  # the in-place operand, as it was
            inputs = inputs[1:]

        def origin_of(slots):
            return next((by_slot[k] for k in slots if k in by_slot), None)

        for ref_, k in zip(wouts, r.outs, strict=True):
            if st[k] == FINITE:
                continue
            nan = st[k] == NAN
            in_nan = any(s == NAN for _, s in ops)
            in_inf = [k2 for k2, s in ops if s == INF]
            if before != FINITE:  # the in-place operand was already non-finite
                in_inf, in_nan = in_inf or [before_k], in_nan or nan
            site = at.site()
            if before_k == -1:  # x[mask] = v
                origin = _Origin(site, "made on purpose (an infinite constant) by") if r.constant else None
            elif nan and not in_nan and r.constant:
                origin = _Origin(site, "made on purpose (a NaN constant) by")
            elif nan and not in_nan:
                if in_inf:
                    origin = origin_of(in_inf)
                    why = (f"the infinity in its operand was {origin}" if origin is not None else
                           "the infinity in its operand came from code nanpass did not watch")
                    self._emit("forward", "NaN", site, f"NaN created by {site}\n  from an infinity: {why}", inputs)
                else:
                    self._emit("forward", "NaN", site, f"NaN created by {site}\n  every operand was finite", inputs)
                return
            elif nan or in_nan:
                origin = None
                if not self.found:
                    nans = [i for i, (_, s) in enumerate(ops) if s == NAN]
                    origin = origin_of([ops[i][0] for i in nans])
                    if origin is None:
                        param = any(isinstance(inputs[i], torch.nn.Parameter) for i in nans if i < len(inputs))
                        origin = _Origin(site, "already in a parameter (an earlier step put it there) "
                                         "read by" if param else "first seen in an operand of")
            elif in_inf:
                origin = origin_of(in_inf) or _Origin(site, "first seen in an operand of")
                self._travelled = (origin, site)
            elif r.constant:
                origin = _Origin(site, "made on purpose (an infinite constant) by")
            elif r.pole is not None and st[r.pole] != FINITE:
                origin = _Origin(site, f"made at a pole of {hit[0].name} by")
            elif step.classify(r, st) is None:
                continue  # finite values whose sum alone passed the largest float
            else:
                self._emit("forward", "Inf", site, f"Inf created by {site}\n  an overflow past the "
                           f"{str(ref_.dtype)[6:]} maximum ({torch.finfo(ref_.dtype).max:.4g}) from "
                           f"finite operands", inputs)
                return
            if origin is not None:
                by_slot[k] = origin
                o = ref_.get()
                if o is not None:
                    self._born(o, origin)
            if r.made is not None:
                r.made.nonfinite = True

    def _rerun_custom(self, made: _Made, node, grad_outputs):
        """A custom Function's backward made it: run that backward again with every call
        checked, so the report names the line inside it. True: named there; a ``Site``: no
        op inside it was to blame on its own (an infinity at a pole, ``g / x`` at 0), and this
        is the line that made the gradient it returned; None: not known."""
        ctx = node()
        if ctx is None:
            return None
        before, program = self.found, self.program
        self.program = False  # (nanpass.enable: checked at each op, here and now)
        try:
            with torch.no_grad(), self.sites.mode():
                again = made.fn.backward(ctx, *grad_outputs)
        except RuntimeError:
            return None  # its saved tensors are gone (a second backward): name the method
        finally:
            self.program = program
        if self.found and not before:
            return True
        for g in leaves(again):
            if readable(g) and not _finite(g):
                origin = self._origin(g)
                if origin is not None:
                    s = origin.site
                    return Site(s.op, made.spelling, s.module, s.module_type, s.source, s.code)
        return None


class _NodeCheck:
    """A node's post hook: did its backward make the gradient non-finite?"""

    __slots__ = ("watch", "made", "name", "node")

    def __init__(self, watch, made, name, node=None):
        self.watch, self.made, self.name, self.node = watch, made, name, node

    def __call__(self, grad_inputs, grad_outputs):
        self.watch.backward(self.made, self.name, grad_inputs, grad_outputs, self.node)


class _OutputGrad:
    """The first gradient to reach an output, from the loss (a later one, in a gradient
    penalty's second backward, is a gradient of gradients the node checks see)."""

    __slots__ = ("watch", "what", "done")

    def __init__(self, watch, what):
        self.watch, self.what, self.done = watch, what, False

    def __call__(self, grad):
        if self.done:  # (not removed while autograd walks the tensor's hooks)
            return
        self.done = True
        if readable(grad) and self.watch.deferred and COLLECT.get() is None:
            bw = deferred.start_backward(self.watch)
            bw.records.append((None, self.what, bw.slots_of([grad]), [], grad))
            return
        if readable(grad) and not _finite(grad):
            self.watch.output_grad(self.what, grad)


class GraphSites:
    """Where a node of a captured graph comes from, for a Watch re-running that graph node by
    node (the compiled check mode's eager re-run): the node's recorded module path and the
    user's frame of its stack trace."""

    def __init__(self):
        self.node = None
        self.where = (None, "", None, None)

    def at(self, path: str, frame: tuple | None) -> None:
        file, line = None, None
        if frame is not None:
            file, _, line = frame[0].rpartition(":")
            line = int(line) if line.isdigit() else None
        self.where = (None, path, file or None, line)

    def locate(self):
        return self.where

    def mode(self):
        return contextlib.nullcontext()
