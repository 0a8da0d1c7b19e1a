"""Check mode's pieces: what a finding is (``Site``, ``Event``, ``NonFiniteError``), the
input and state checks, and the compiled check (``flagged``: one fused flag per graph, an
eager re-run only when it fires).

Eager check mode looks at every call (``_watch.py``). ``checked`` is the per-op checker of
the rule table's ops that a hardened model traced by dynamo runs (``torch.compile(harden(m,
mode="check"))``): it raises NonFiniteError at the op whose result is NaN, or infinite from
finite operands, and in backward where its gradient turns non-finite from a finite one.
``mode="warn"`` warns instead of raising.
"""

from __future__ import annotations

import atexit
import collections
import contextvars
import functools
import itertools
import os
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from ._compat import at_backward_end, custom_function, foreach_norm, graph_task_id
from ._deferred import read_values
from ._errors import NanpassError
from ._source import _rel

Tensor = torch.Tensor


def _short_source(source: str) -> str:
    """``file:line`` as the report shows it (the user's own file relative to the working
    directory: a script's ``__file__`` is absolute, as under python)."""
    return _rel(source) or source


@dataclass(frozen=True)
class Site:
    """Where a checked op is: filled in by the rewrite from the node's metadata."""

    op: str  # rule name
    spelling: str
    module: str
    module_type: str
    source: str | None
    code: str | None

    def __str__(self) -> str:
        cls = f" ({self.module_type})" if self.module_type else ""
        at = f" at {_short_source(self.source)}: {self.code}" if self.source else ""
        return f"{self.spelling} in {self.module or '<root>'}{cls}{at}"


@dataclass(frozen=True)
class Event:
    """One non-finite value, as check mode saw it."""

    phase: str  # "input" | "state" (a parameter or buffer) | "forward" | "backward"
    kind: str  # "NaN" | "Inf" | "non-finite gradient"
    created: bool  # made here from finite operands (forward) or a finite gradient (backward)
    site: Site | None  # None for an input
    message: str
    operands: tuple[str, ...] = field(default=())
    index: int | None = None  # first batch index whose operand row is already suspicious

    def to_dict(self) -> dict:
        return {
            "phase": self.phase, "kind": self.kind, "created": self.created,
            "op": self.site.op if self.site else None,
            "spelling": self.site.spelling if self.site else None,
            "module": self.site.module if self.site else None,
            "source": self.site.source if self.site else None,
            "code": self.site.code if self.site else None,
            "operands": list(self.operands), "batch_index": self.index, "message": self.message,
        }


# while nanpass.locate runs, events are collected here instead of raised, and each checked
# op calls PROGRESS
COLLECT: contextvars.ContextVar[list | None] = contextvars.ContextVar("nanpass_collect", default=None)
PROGRESS: contextvars.ContextVar = contextvars.ContextVar("nanpass_progress", default=None)


class NonFiniteError(NanpassError, FloatingPointError):
    """A NaN or Inf was created; the message names the op, its module and source line."""


class NonFiniteWarning(UserWarning):
    """mode="warn": the same finding as NonFiniteError, as a warning."""


def describe(t: Tensor) -> str:
    """min, max and the counts that usually explain a NaN."""
    t = t.detach()
    f = t.float() if t.is_floating_point() else t
    finite = f[torch.isfinite(f)] if t.is_floating_point() else f
    parts = [f"shape {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"]
    if finite.numel():
        parts.append(f"finite min {finite.min().item():.4g}, max {finite.max().item():.4g}")
    if t.is_floating_point():
        parts.append(f"{int((f == 0).sum())} zeros, {int((f < 0).sum())} negative, "
                     f"{int(torch.isnan(f).sum())} NaN, {int((f == float('inf')).sum())} +inf, "
                     f"{int((f == float('-inf')).sum())} -inf")
    return "; ".join(parts)


def _float_tensors(xs):
    for x in xs:
        if isinstance(x, Tensor) and x.is_floating_point():
            yield x
        elif isinstance(x, (tuple, list)):
            yield from _float_tensors(x)


def _user_level() -> int:
    """The stacklevel of the first frame outside nanpass and torch: a warning names the
    user's line, as the error's message does."""
    f, level = sys._getframe(2), 2
    while f is not None and f.f_code.co_filename.startswith((_HERE, _TORCH)):
        f, level = f.f_back, level + 1
    return level if f is not None else 2


_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep


def _report(event: Event, warn: bool) -> None:
    sink = COLLECT.get()
    if sink is not None:
        sink.append(event)
    elif warn:
        warnings.warn(event.message, NonFiniteWarning, stacklevel=_user_level())
    else:
        raise NonFiniteError(event.message)


def _suspicious_row(t: Tensor, nan_only: bool = False) -> int | None:
    """First index along dim 0 holding a NaN, or (for an op's operand) a zero, a negative or a
    non-finite value: where a log, a division or a sqrt goes wrong."""
    if t.dim() == 0 or not t.is_floating_point() or t.numel() == 0:  # (a mean of no elements)
        return None
    bad = torch.isnan(t) if nan_only else (t == 0) | (t < 0) | ~torch.isfinite(t)
    rows = bad.reshape(t.shape[0], -1).any(1)
    hit = rows.nonzero()
    return int(hit[0, 0]) if hit.numel() else None


class _GradState:
    __slots__ = ("out_finite", "in_finite")

    def __init__(self):
        self.out_finite = True  # the gradient the op received
        self.in_finite = True  # no NaN among the op's operands (a NaN forward explains a NaN backward)


class _OutGrad(torch.autograd.Function):
    """Identity; in backward, notes whether the gradient reaching the op's output was finite."""

    @staticmethod
    def forward(ctx, x, state):
        ctx.state = state
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.state.out_finite = bool(torch.isfinite(grad).all())
        return grad, None


class _InGrad(torch.autograd.Function):
    """Identity; in backward, raises when the op's own backward made the gradient non-finite."""

    @staticmethod
    def forward(ctx, x, state, site, index, warn):
        ctx.state, ctx.site, ctx.index, ctx.warn = state, site, index, warn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if not bool(torch.isfinite(grad).all()):
            created = ctx.state.out_finite and ctx.state.in_finite
            what = "created by the backward of" if created else "passed on by the backward of"
            message = (f"nanpass: non-finite gradient {what} {ctx.site}, for operand {ctx.index} "
                       f"({describe(grad)})")
            if created or COLLECT.get() is not None:
                _report(Event("backward", "non-finite gradient", created, ctx.site, message,
                              (describe(grad),)), ctx.warn)
        return grad, None, None, None, None


# the ops whose first operand, ``input``, is not read where ``beta`` is 0: torch's documentation
# says its NaN and inf are not propagated (diffusers' attention passes torch.empty there)
_BETA_INPUT = frozenset(n + s for n in ("addmm", "baddbmm", "addbmm", "addmv", "addr") for s in ("", "_"))


def unread(func, args, kwargs):
    """The operand a call does not read, which a check never blames (None where it reads all):
    ``input`` of ``torch.baddbmm(input, b1, b2, beta=0)``, uninitialised memory as often as not."""
    if getattr(func, "__name__", None) not in _BETA_INPUT:
        return None
    beta = kwargs.get("beta", 1)
    if not isinstance(beta, (int, float)) or beta != 0:
        return None
    return args[0] if args else kwargs.get("input", kwargs.get("self"))


def checked(fn, args, kwargs, site: Site, warn: bool):
    """Run ``fn`` and check its result; wire the backward check when autograd is recording."""
    skip = unread(fn, args, kwargs)
    inputs = [t for t in _float_tensors((*args, *kwargs.values())) if t is not skip]
    state = _GradState()
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        args = tuple(_InGrad.apply(a, state, site, i, warn)
                     if isinstance(a, Tensor) and a.requires_grad else a for i, a in enumerate(args))
    out = fn(*args, **kwargs)
    tick = PROGRESS.get()
    if tick is not None:
        tick()
    outs = list(_float_tensors((out,)))
    bad_in = [i for i, t in enumerate(inputs) if not bool(torch.isfinite(t).all())]
    nan_in = any(bool(torch.isnan(t).any()) for t in inputs)
    state.in_finite = not nan_in  # an -inf mask is fine; a NaN operand explains a NaN gradient
    for o in outs:
        nan = bool(torch.isnan(o).any())
        inf = bool(torch.isinf(o).any())
        created = (nan and not nan_in) or (inf and not bad_in)
        if created or ((nan or inf) and COLLECT.get() is not None):
            kind = "NaN" if nan else "Inf"
            fed = (f"operands {bad_in} were already non-finite" if bad_in else "every operand was finite")
            operands = tuple(describe(t) for t in inputs)
            detail = "; ".join(f"operand {i}: {d}" for i, d in enumerate(operands))
            verb = "created by" if created else "passed through"
            _report(Event("forward", kind, created, site, f"nanpass: {kind} {verb} {site}: {fed}; {detail}",
                          operands, _suspicious_row(inputs[0]) if inputs else None), warn)
            break
    if isinstance(out, Tensor) and out.requires_grad and torch.is_grad_enabled():
        out = _OutGrad.apply(out, state)
    return out


def check_input(t, name: str, warn: bool):
    """A NaN in the data is the data's, not the first op's."""
    if isinstance(t, Tensor) and t.is_floating_point() and bool(torch.isnan(t).any()):
        _report(Event("input", "NaN", False, None, f"nanpass: NaN in the input {name!r} ({describe(t)})",
                      (describe(t),), _suspicious_row(t, nan_only=True)), warn)
    return t


check_input.__module__ = "nanpass"


def check_state(model: torch.nn.Module, warn: bool) -> None:
    """A NaN/Inf already in a parameter or buffer is the state's, not the first op's that reads
    it: one fused check (one sync) per call, and only on a hit a look for the name."""
    named = _state(model)
    if not named:
        return
    if bool(torch.isfinite(state_scalar([t for _, t in named]))):
        return
    flags = torch.stack([(~torch.isfinite(t)).any() for _, t in named])
    hit = flags.nonzero()
    if not hit.numel():
        return  # (not reached: a largest magnitude is finite exactly when every value is)
    i = int(hit[0, 0])
    name, t = named[i]
    kind = "parameter" if isinstance(t, torch.nn.Parameter) else "buffer"
    what = "NaN" if bool(torch.isnan(t).any()) else "Inf"
    module = name.rpartition(".")[0]
    owner = type(model.get_submodule(module)).__name__ if module else type(model).__name__
    _report(Event("state", what, False, None,
                  f"nanpass: {what} in the {kind} {name!r} ({owner}) before the model ran: an earlier "
                  f"step or a checkpoint put it there ({describe(t)})", (describe(t),)), warn)


def _state(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    return [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers())
            if t.is_floating_point() and t.numel()]


def state_tensors(model: torch.nn.Module) -> list[Tensor]:
    return [t for _, t in _state(model)]


def state_scalar(tensors: list[Tensor]) -> Tensor:
    """A float64 scalar, finite exactly when every value of ``tensors`` is: one fused largest
    magnitude (``ord=inf``) per device and dtype, which a finite tensor cannot overflow (an L2
    norm of a float16 buffer holding -10000 does, issue 39)."""
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    norms = [n for ts in groups.values() for n in foreach_norm(ts, float("inf"))]
    first = norms[0].device
    wide = torch.float32 if first.type == "mps" else torch.float64  # (MPS has no float64)
    return torch.stack([n.to(first, wide) for n in norms]).sum()


def nonfinite_flag(*tensors):
    """0-dim bool tensor: any of ``tensors`` (a compiled graph's floating outputs) holds a NaN
    or an Inf. One reduction each, fused by inductor into the kernels that make them."""
    bad = torch.zeros((), dtype=torch.bool, device=tensors[0].device if tensors else None)
    for t in tensors:
        bad = bad | ~(t.abs() <= torch.finfo(t.dtype).max).all()  # false for NaN and Inf
    return bad


nonfinite_flag.__module__ = "nanpass"


def tap(x, probe):
    """``x`` to the bit (``probe`` is 0, and ``x - 0`` keeps -0.0, unlike ``x + 0``); in
    backward, the gradient of ``probe`` becomes NaN when the gradient reaching ``x`` is not
    finite (``sum(g) * 0``). The compiled check mode taps every operand of a checked op, so a
    non-finite gradient born inside a compiled backward is seen even where a later op masks
    it before a parameter. The 0 is ``probe.detach()``, not a literal: inductor folds a
    product with a literal 0 and then sums the gradient after the mask."""
    return x - (probe * probe.detach()).to(x.dtype)


tap.__module__ = "nanpass"


_PENDING = 8  # forwards whose backward check may still be waiting (pipelined micro-batches)


def _counted(g) -> bool:
    return g is not None and g.is_floating_point() and g.numel() > 0


def _gradients(grads) -> list[Tensor]:
    return [g for g in grads if _counted(g)]


def gradient_scalar(grads) -> Tensor | None:
    """One fused reduction of gradients on their device (no read), the fastest a CPU has: a
    2-norm, in float32 at least. Finite when every gradient is; not finite also where finite
    gradients' squares pass the largest float (above about 1e19 in float32, where a gradient
    is about to diverge), which ``finite_exactly`` then tells apart, on that path only."""
    groups: dict = {}
    for g in _gradients(grads):
        groups.setdefault((g.dtype, g.device), []).append(g)
    if not groups:
        return None
    maxima = []
    with torch.no_grad():  # (create_graph: not a node of the graph)
        for (dtype, _), gs in groups.items():
            wider = torch.float32 if dtype in (torch.float16, torch.bfloat16) else None
            maxima.append(torch.stack(foreach_norm(gs, 2.0, wider)).amax())  # (amax keeps a NaN)
        on = maxima[0].device
        wide = torch.float32 if on.type == "mps" else torch.float64  # (MPS has no float64)
        if len(maxima) == 1:
            return maxima[0].to(wide)
        return torch.stack([n.to(device=on, dtype=wide) for n in maxima]).amax()


def finite_exactly(grads) -> bool:
    """Every element of every gradient finite (one read): where a 2-norm was not."""
    grads = _gradients(grads)
    if not grads:
        return True
    on = grads[0].device
    return bool(torch.stack([torch.isfinite(g).all().to(on) for g in grads]).all())


class _Handles:
    __slots__ = ("handles",)

    def __init__(self, handles):
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _places(leaf: Tensor, g: Tensor) -> tuple:
    """Where a leaf's gradient ``g`` may be found once AccumulateGrad ran: ``g`` itself kept
    as .grad, or the .grad it was added into (read as addresses: nothing is held)."""
    old = leaf.grad if leaf is not None and leaf.is_leaf else None
    return (g.data_ptr(),) if old is None else (g.data_ptr(), old.data_ptr())


# -- one read a step ------------------------------------------------------------------------------
# A compiled forward's flag and its backward's gradient scalar are read together as the backward
# ends, with those of every other graph that backward ran through (a model that graph-breaks):
# one read a training step. A forward no backward reaches is read alone, at the next forward of
# its graph on the same thread, or as the program exits.


class Ahead:
    """A forward's scalars on the device, read with its backward's (``judge(values)`` -> True
    where it named a finding: the backward's then are that finding's), or alone."""

    __slots__ = ("scalars", "judge", "seq", "__weakref__")

    def __init__(self, scalars: list[Tensor], judge):
        self.scalars, self.judge = scalars, judge
        self.seq = next_seq()
        _UNREAD.add(self)
        if not _AT_EXIT:
            _AT_EXIT.append(atexit.register(_read_at_exit))

    def take(self) -> list[Tensor] | None:
        scalars, self.scalars = self.scalars, None
        _UNREAD.discard(self)
        return scalars

    def read_alone(self) -> bool:
        scalars = self.take()
        if scalars is None:
            return False
        with torch.enable_grad():  # (as the forward ran)
            return self.judge(read_values(scalars))


_UNREAD: weakref.WeakSet = weakref.WeakSet()
_AT_EXIT: list = []


def _read_at_exit() -> None:
    for ahead in sorted(_UNREAD, key=lambda a: a.seq):
        ahead.read_alone()


_JOINED: dict[int, list] = {}  # the backward running (graph task id) -> its verdicts
_JOINED_LOCK = threading.Lock()
_JOINED_MAX = 16  # backwards whose verdicts wait at once (threads; backwards that raised)
_SEQ = itertools.count(1)


def join(verdict) -> None:
    """From a hook of the backward running now: ``verdict`` is read with every other verdict
    of that backward, in one read, as it ends (its hooks may run on several threads).
    A verdict has ``seq`` (its forward's order), ``collect()`` -> (its forward's scalars not
    read yet, its backward's), ``judge_forward(values)`` -> whether it named a finding, and
    ``judge_backward(values)``."""
    task = graph_task_id()
    with _JOINED_LOCK:
        joined = _JOINED.setdefault(task, [])
        joined.append(verdict)
        first = len(joined) == 1
        while len(_JOINED) > _JOINED_MAX:  # a backward that raised never ran its end callback:
            _JOINED.pop(next(iter(_JOINED)))  # its verdicts (and gradients they hold) dropped
    if first:
        at_backward_end(functools.partial(_read_backward, task))


def next_seq() -> int:
    """The order forwards ran in (a verdict's forward is judged before a later one's)."""
    return next(_SEQ)  # (one C call: two threads never get the same number)


def _read_backward(task: int) -> None:
    with _JOINED_LOCK:
        joined = _JOINED.pop(task, [])
    got = [(v, *v.collect()) for v in joined]
    values = read_values([s for _, fwd, bwd in got for s in (*fwd, *bwd)])  # the one read
    parts, at = [], 0
    for v, fwd, bwd in got:
        n, m = sum(s.numel() for s in fwd), sum(s.numel() for s in bwd)
        parts.append((v, values[at:at + n], values[at + n:at + n + m]))
        at += n + m
    # the forwards first, in the order they ran: a forward's NaN is where the step went wrong,
    # and the backward's non-finite gradients are its consequence
    named = False
    for v, fwd, _ in sorted(parts, key=lambda p: p[0].seq):
        if fwd:
            with torch.enable_grad():  # (as the forward ran)
                named = v.judge_forward(fwd) or named
    if named:
        return
    for v, _, bwd in parts:  # (in the order the backward reached each: the first made first)
        v.judge_backward(bwd)


class _Verdict:
    """One backward of one watched forward: the scalars of the gradients it gives the leaves
    (taken as they pass: holding a gradient till the backward ends would make AccumulateGrad
    copy it into .grad), where each gradient may end up, and the gradients its outputs got."""

    __slots__ = ("on_hit", "ahead", "reached", "upstream", "partial", "given", "armed", "handle",
                 "multi", "seq")

    def __init__(self, on_hit, ahead: Ahead | None, reached, multi: bool):
        self.on_hit, self.ahead, self.reached, self.multi = on_hit, ahead, reached, multi
        self.seq = ahead.seq if ahead is not None else next_seq()
        self.upstream: dict[int, Tensor] = {}
        self.partial: list[Tensor] = []
        self.given: list[tuple] = []  # (a leaf or None, where its gradient may end up): not held
        self.armed = False
        self.handle = None

    def got(self, pairs) -> None:  # (a leaf, or None for an input that is not one; its gradient)
        s = gradient_scalar([g for _, g in pairs])
        if s is not None:
            self.partial.append(s)
            self.given.extend((leaf, _places(leaf, g)) for leaf, g in pairs if _counted(g))
        if not self.armed:
            self.armed = True
            join(self)

    def collect(self) -> tuple[list[Tensor], list[Tensor]]:
        """At the backward's end: the forward's scalars (not read yet) and the gradients'."""
        self.armed = False
        if self.multi:
            if not self.upstream:  # another forward's backward reached the leaves: not this one's
                self.partial, self.given = [], []
                return [], []
            self.handle.remove()
        ahead = self.ahead.take() if self.ahead is not None else None
        if self.reached is not None:
            self.reached()
        return ahead or [], list(self.partial)

    def judge_forward(self, values: list[float]) -> bool:
        return self.ahead.judge(values)

    def judge_backward(self, values: list[float]) -> None:
        upstream, given = self.upstream, self.given
        self.upstream, self.partial, self.given = {}, [], []  # (the outputs' hooks hold it)
        if all(v - v == 0 for v in values):
            return
        # a norm not finite: the gradients again, element by element, where each is in its
        # leaf's .grad (kept as given, or added into the .grad there before, which a
        # non-finite gradient leaves non-finite; not autograd.grad's)
        held = [leaf.grad if leaf is not None and leaf.is_leaf else None for leaf, _ in given]
        if any(g is None or g.data_ptr() not in ptrs for g, (_, ptrs) in zip(held, given, strict=True)) \
                or not finite_exactly(held):
            self.on_hit(upstream)


def watch_backward(inputs, outs: list, on_hit, pending: collections.deque, one_graph: bool = True,
                   nonleaf: list = (), ahead: Ahead | None = None, reached=None) -> bool:
    """Once the backward from ``outs`` has given every gradient of ``inputs`` (the graph's
    inputs that need one: the parameters among them; or a function giving them, called only
    where the leaves are not found by walking back from ``outs``, with ``nonleaf``, the
    inputs that are not leaves), one fused check of those gradients, read with every other
    of that backward (and ``ahead``, the forward's own scalars) as it ends;
    only when one is not finite, ``on_hit(upstream)`` with the gradients each output
    received (by its index among the outputs that require one), to run the step again.
    ``reached()``: called when a backward reached this forward's outputs.
    A hook on a leaf lives until removed (one on a node, as long as its graph): each is removed
    when it fires, and at most ``_PENDING`` wait for a backward (forwards with grad and no
    backward).
    ``one_graph``: ``inputs`` are the inputs of the graph that made ``outs`` (a backend's
    graph), so where one node made them all, its post hook sees every gradient.
    False: nothing to watch (``ahead`` is the caller's to read)."""
    watched = [o for o in outs if isinstance(o, Tensor) and o.requires_grad]
    if not watched or (not callable(inputs) and not inputs):
        return False
    nodes = {o.grad_fn for o in watched}
    if one_graph and len(nodes) == 1 and None not in nodes:
        # a compiled graph's one backward node: one post hook sees the gradient of every
        # input it gives and every output's it received (a hook per input cost 4 ms of a
        # 72 ms GPT-2 step)
        verdict = _Verdict(on_hit, ahead, reached, multi=False)
        slots = [o.output_nr for o in watched]
        node = next(iter(nodes))

        def after_node(grad_inputs, grad_outputs):
            if verdict.handle is None:  # once (it is not removed while autograd runs the node's hooks)
                return
            verdict.handle = None
            verdict.upstream = {k: grad_outputs[nr] for k, nr in enumerate(slots)
                                if nr < len(grad_outputs) and grad_outputs[nr] is not None}
            verdict.got([(nf.variable if nf is not None and type(nf).__name__ == "AccumulateGrad" else None, g)
                         for (nf, _), g in zip(node.next_functions, grad_inputs)])

        handle = verdict.handle = node.register_hook(after_node)
    else:  # outputs from several nodes (a view of an input among them), several graphs
        verdict = _Verdict(on_hit, ahead, reached, multi=True)
        for k, o in enumerate(watched):
            o.register_hook(lambda g, k=k: verdict.upstream.__setitem__(k, g))
        givers = _givers(watched, list(nonleaf) if callable(inputs) else inputs)
        if givers is not None:  # a post hook on each node that gives a leaf its gradient
            def after(slots):
                def hook(grad_inputs, grad_outputs):
                    verdict.got([(leaf, grad_inputs[pos]) for leaf, pos in slots])
                return hook

            handle = _Handles([n.register_hook(after(slots)) for n, slots in givers])
        else:  # (a tensor hook: autograd.grad runs it too, a multi-grad hook not)
            leaves_ = inputs() if callable(inputs) else inputs
            handle = _Handles([t.register_hook(lambda g, t=t: verdict.got([(t, g)])) for t in leaves_])
        verdict.handle = handle
    pending.append(handle)
    while len(pending) > _PENDING:
        pending.popleft().remove()
    return True


_WALK = 64  # nodes walked back from a compiled forward's outputs to find its leaves' givers


def _givers(outs: list, inputs: list) -> list | None:
    """The nodes that give the leaves (the parameters, an input that needs a gradient) and the
    ``inputs`` that are not leaves (an upstream model's output) their gradients, walking back
    from ``outs``, with each one's place among the gradients its node gives:
    (node, [(tensor, place)]). A compiled graph is one node giving every parameter its
    gradient, so one post hook replaces a tensor hook per parameter, and the walk replaces a
    walk of the model's modules for its parameters (1 ms of a compiled GPT-2 step).
    None (hook each leaf) where one has two givers (its gradient is their sum, which a tensor
    hook sees), where the graph is long (eager code between graphs), or where a Function's
    backward may run a backward of its own that the walk cannot see (a reentrant
    checkpoint's gives the parameters inside it their gradients)."""
    stops = {(t.grad_fn, t.output_nr): t for t in inputs
             if isinstance(t, Tensor) and t.grad_fn is not None}
    by_node: dict = {}
    placed: set = set()  # (ids of tensors the lists below hold)
    walked = [0]

    def onward(n):
        walked[0] += 1
        if walked[0] > _WALK or _opaque(n):
            return None
        nxt = []
        for pos, (child, nr) in enumerate(n.next_functions):
            if child is None:
                continue
            got = stops.get((child, nr)) if stops else None
            if got is None and type(child).__name__ == "AccumulateGrad":
                got = child.variable
            if got is None:
                nxt.append(child)
                continue
            if id(got) in placed:
                return None
            placed.add(id(got))
            by_node.setdefault(n, []).append((got, pos))
        return nxt

    return list(by_node.items()) if _walk(outs, onward) else None


def _walk(outs: list, onward) -> bool:
    """Each autograd node behind ``outs`` once, depth first: ``onward(node)`` gives the nodes
    to go on to, or None to end the walk there (False)."""
    seen: set = set()
    todo = [o.grad_fn for o in outs]
    while todo:
        n = todo.pop()
        if n is None or n in seen:
            continue
        seen.add(n)
        nxt = onward(n)
        if nxt is None:
            return False
        todo.extend(nxt)
    return True


def runs_its_own_backward(outs: list) -> bool:
    """Whether the graph behind ``outs`` holds a Function whose backward runs a backward of its
    own (a reentrant checkpoint's, which refuses ``torch.autograd.grad``)."""
    return not _walk(outs, lambda n: None if _opaque(n) else [c for c, _ in n.next_functions if c is not None])


def _opaque(node) -> bool:
    """A Function's node other than a compiled graph's: its backward may run a backward of its
    own (``torch.utils.checkpoint``'s reentrant one does)."""
    cls = custom_function(node)
    return cls is not None and not cls.__module__.startswith("torch._functorch")


def flagged(compiled, sites: list, warn: bool, eager=None, probe: torch.device | None = None):
    """Wrap a compiled graph whose last output says whether any of its floating outputs is
    non-finite: one fused check and one sync per call. Only when it fires is the graph re-run
    eagerly through ``eager`` (the same graph with the eager checkers), which names the op, its
    module and source line. Backward: one fused check of every input gradient, in a hook, once
    per backward, which also reads the ``probe`` input's gradient (``tap``: NaN when a checked
    op's operand got a non-finite gradient inside the graph; ``probe`` is its device, None
    where the graph has no taps); only when it fires, the step is re-run eagerly with the
    same upstream gradients."""
    # a multi-grad hook on leaves (the parameters) lives until removed: each is removed when it
    # fires, and at most a few wait for a backward (forwards with grad and no backward)
    pending: collections.deque = collections.deque()

    def check(args) -> bool:
        """The graph again eagerly, at each op: the op that made the NaN or Inf, named."""
        found: list[Event] = []
        token = COLLECT.set(found)
        try:
            with torch.no_grad():
                eager(*args)
        finally:
            COLLECT.reset(token)
        if not found:  # not reproduced (an RNG draw, a nondeterministic kernel)
            found = [Event("forward", "NaN/Inf", True, None,
                           "nanpass: NaN or Inf in an output of a compiled graph, which an eager "
                           "re-run of the graph did not reproduce (a random draw such as dropout?); "
                           "nanpass.harden(model, mode='check') checks every op as it runs")]
        for event in found:
            _report(event, warn)
        return True

    def replay(upstream: dict, args) -> None:
        """On a hit: the graph again, node by node, with the same upstream gradients."""
        replay = [a.detach().requires_grad_() if isinstance(a, Tensor) and a.requires_grad else a
                  for a in args]
        with torch.enable_grad():
            again = [o for o in eager(*replay) if isinstance(o, Tensor) and o.requires_grad]
            pairs = [(o, upstream[k]) for k, o in enumerate(again) if k in upstream]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    # in a training loop (a backward reached this graph's last forward on the thread) the
    # flag is read with the backward's gradients, as the backward ends: one read a step
    backed: dict[int, bool] = {}  # thread -> a backward reached its last forward of the graph
    unread: dict[int, Ahead] = {}  # thread -> that forward's flag, not read yet

    def run(*args):  # dynamo calls what a backend returns with the flat inputs
        tid = threading.get_ident()
        stale = unread.pop(tid, None)
        if stale is not None and stale.scalars is not None:  # no backward reached it
            backed.pop(tid, None)
            stale.read_alone()
        tapped = () if probe is None else (torch.zeros((), device=probe, requires_grad=True),)
        outs = list(compiled(*args, *tapped))
        bad = outs.pop()
        if not (torch.is_grad_enabled() and eager is not None):
            if bool(bad):  # the one sync
                check(args)
            return outs
        inputs = [a for a in (*args, *tapped) if isinstance(a, Tensor) and a.requires_grad]
        ahead = Ahead([bad], lambda values: bool(values[0]) and check(args)) if backed.get(tid) else None
        if ahead is None and bool(bad):  # the one sync
            check(args)

        def reached():
            backed[tid] = True

        if watch_backward(inputs, outs, lambda upstream: replay(upstream, args), pending,
                          ahead=ahead, reached=reached):
            if ahead is not None:
                unread[tid] = ahead
        elif ahead is not None:
            ahead.read_alone()
        return outs

    return run
