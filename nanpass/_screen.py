"""Check mode's screen (issue 47): a step checked on the device, run again only on a hit.

``harden(model, mode="check"|"warn")`` used to watch every call of every forward (a
TorchFunctionMode, a record and a device scalar per call, a hook per autograd node: 3.6x a
plain step where each call's fixed cost dominates). The screen runs the forward as written,
with no mode and no stand-in between its calls, and checks on the device what leaves the step:

- the forward's floating outputs, and a NaN in the data, read once after the forward;
- the gradient reaching each output from the code after it (the loss), and the gradients the
  backward gives the parameters and the inputs, read once when the backward ends
  (``_compat.at_backward_end``): for ``loss.backward()`` one fused check of the leaves'
  ``.grad``; for ``torch.autograd.grad`` (which keeps no ``.grad``) a scalar per leaf from a
  hook put on it while that backward runs.

Only where one is not finite does the step run again (``Hardened._check_again``), from the same
inputs, random state (CPU and CUDA generators) and buffers, with the check at each op: the
forward, and for a gradient the backward with the same upstream gradients
(``torch.autograd.grad``: nothing is accumulated twice). That run names the op, its line and
its operands exactly as ``every_op=True`` would. A hit it does not reproduce (a random draw
from a generator nanpass does not replay, a data-dependent kernel) is said as not reproduced,
with what the screen saw.

Not seen: a NaN or Inf made and masked inside the step that reaches no output, no loss and no
gradient of a parameter or input (``torch.where(h > 0, h.log(), 0)`` in forward; a gradient
made non-finite in backward and masked before any leaf), and an infinity made on purpose that
stays quiet. ``every_op=True`` keeps the check of every call.

Buffers: a forward that writes a buffer (a batch norm's running statistics) is learned on the
first screened call (a model's second: its first is checked at every op), by the buffers'
versions and by their values (``batch_norm`` does not move its statistics' version); from then on those buffers are copied before each
forward so that a run again starts from the values the first run started from. The memory this
costs is the size of the buffers the forward writes (a batch norm: two vectors of its width);
a buffer no forward writes costs nothing.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import threading
import weakref

import torch

from . import _fastpath
from ._check import (COLLECT, check_input, check_state, finite_exactly, gradient_scalar, join, next_seq,
                     runs_its_own_backward)
from ._compat import at_backward_end, backward_accumulates, function_mode_stack, functorch_active, version
from ._deferred import FINITE, NAN, read, scalar, state_of
from ._watch import leaves, readable

Tensor = torch.Tensor


def float_value(t) -> bool:
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.is_floating_point() and t.numel() > 0


def rng_state() -> tuple:
    """The random state a forward draws from (host-side: no read of the device)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def set_rng_state(state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


# bumped whenever a module anywhere gets a submodule, a parameter or a buffer: a screened
# model then walks its modules again for the parameters and buffers it checks and keeps
EPOCH = [0]


def _registered(*_) -> None:
    EPOCH[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_registered)
torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_buffer_registration_hook(_registered)


class _Layout:
    """Where a screened model's parameters and buffers live, walked again only when a module
    anywhere registers something (a walk of GPT-2's 164 modules is 0.3 ms, 2.5% of a
    launch-bound step): each step reads them from their registries, so a tensor replaced in
    place of another (``.to()``, a checkpoint load) is the one read. The buffers a forward
    writes are copied before each later forward. They are learned by their versions, and, since
    a kernel may write one without moving its version (``batch_norm``'s running statistics), by
    their values on the first screened forward of each layout in train and in eval mode."""

    __slots__ = ("epoch", "params", "buffers", "written", "versions", "learned", "probe")

    def __init__(self):
        self.epoch = -1
        self.params: list = []  # (the module's _parameters, name)
        self.buffers: list = []  # (the module's _buffers, name)
        self.written: set = set()  # (id of the registry, name) a forward wrote
        self.versions: list = []
        self.learned: set = set()  # (epoch, training) whose forward was compared by value
        self.probe: list = []  # (registry, name, the value before) compared after this forward

    def _walk(self, model: torch.nn.Module) -> None:
        if self.epoch == EPOCH[0]:
            return
        self.epoch = EPOCH[0]
        seen: set = set()
        self.params, self.buffers = [], []
        for mod in model.modules():
            for name, p in mod._parameters.items():
                if p is not None and id(p) not in seen:  # (a tied weight: once)
                    seen.add(id(p))
                    self.params.append((mod._parameters, name))
            for name, b in mod._buffers.items():
                if b is not None:
                    self.buffers.append((mod._buffers, name))

    def parameters(self, model: torch.nn.Module) -> list[Tensor]:
        self._walk(model)
        return [p for reg, name in self.params if (p := reg.get(name)) is not None and p.requires_grad]

    def before(self, model: torch.nn.Module) -> dict[int, Tensor]:
        """The values the forward starts from of the buffers it writes (or may: the ones being
        learned now), by the buffer's id."""
        self._walk(model)
        self.versions = [version(b) if (b := reg.get(name)) is not None else None for reg, name in self.buffers]
        kept = {id(b): b.detach().clone() for reg, name in self.buffers
                if (id(reg), name) in self.written and (b := reg.get(name)) is not None} if self.written else {}
        key = (self.epoch, model.training)
        self.probe = []
        if key not in self.learned:
            self.learned.add(key)
            for reg, name in self.buffers:
                b = reg.get(name)
                if b is not None and (id(reg), name) not in self.written:
                    kept[id(b)] = copy_ = b.detach().clone()
                    self.probe.append((reg, name, copy_))
        return kept

    def after(self) -> None:
        for (reg, name), v in zip(self.buffers, self.versions, strict=False):
            b = reg.get(name)
            if b is not None and (v is None or version(b) != v):
                self.written.add((id(reg), name))
        probe, self.probe = self.probe, []
        for reg, name, before in probe:  # (NaN != NaN: a NaN in one is counted as written)
            b = reg.get(name)
            if b is not None and (b.shape != before.shape or not torch.equal(b, before)):
                self.written.add((id(reg), name))


@contextlib.contextmanager
def buffers_from(model: torch.nn.Module, kept: dict | None):
    """Every buffer of ``model`` swapped for a copy while a run again runs: a copy of the value
    the step started from where ``kept`` holds it (by the buffer's id), else of its value now;
    put back after, so the buffers are as the first run left them (its graph saved them at
    their version). Integer ones too: a batch norm's ``num_batches_tracked``."""
    held, copies = [], {}
    for mod in model.modules():
        for name, b in mod.named_buffers(recurse=False):
            if b is not None:
                held.append((mod, name, b))
                c = copies.get(id(b))  # (a buffer two modules share: one copy)
                if c is None:
                    before = kept.get(id(b)) if kept else None
                    c = copies[id(b)] = (before if before is not None else b).detach().clone()
                setattr(mod, name, c)
    try:
        yield
    finally:
        for mod, name, b in held:
            setattr(mod, name, b)


def layout_of(safe) -> _Layout:
    got = safe.__dict__.get("_nanpass_layout")
    if got is None:
        got = safe.__dict__["_nanpass_layout"] = _Layout()
    return got


def forward(safe, args: tuple, kwargs: dict):
    """The screened forward of ``safe`` (a ``Hardened`` in check or warn mode): the model as
    written, then one read of its outputs' and its data's scalars."""
    sites, model = safe._nanpass_sites, safe._nanpass_model
    watch = sites.checker
    stale = _unread(safe).pop(threading.get_ident(), None)
    if stale is not None:  # (the last forward's outputs: no backward reached them)
        stale.read_ahead()
    watch.found = False
    rng = rng_state()
    layout = layout_of(safe)
    kept = layout.before(model)
    sites.calls += 1
    prev = _fastpath.paused()  # (an outer hardened model's stand-ins would guard its calls)
    try:
        out = model(*args, **kwargs)
    finally:
        _fastpath.resume(prev)
        layout.after()
    outs = leaves(out)
    heads = [o for o in outs if float_value(o)]
    data = [t for t in leaves((args, kwargs)) if float_value(t)]
    ahead = _Forward([scalar(t) for t in (*heads, *data)], [_shape(t) for t in heads], [_shape(t) for t in data])
    if torch.is_grad_enabled():
        # in a training loop (this thread's last forward was reached by a backward) the
        # forward's scalars are read with the backward's, when it ends: one read a step
        later = _backed(safe).get(threading.get_ident(), False)
        step = _Backward.watch(safe, args, kwargs, rng, kept, outs, explained=False,
                               ahead=ahead if later else None)
        if step is not None and later:
            return out
        ahead.judge(safe, read(ahead.scalars), args, kwargs, rng, kept)  # the one read
        if step is not None:
            step.explained = watch.found
        return out
    ahead.judge(safe, read(ahead.scalars), args, kwargs, rng, kept)  # the one read
    return out


def _shape(t) -> str:
    return f"shape {tuple(t.shape)} {str(t.dtype)[6:]}"


class _Forward:
    """A screened forward's scalars (its outputs', then its data's), and what they were."""

    __slots__ = ("scalars", "heads", "data")

    def __init__(self, scalars: list, heads: list[str], data: list[str]):
        self.scalars, self.heads, self.data = scalars, heads, data

    def judge(self, safe, st: list[int], args, kwargs, rng, kept) -> bool:
        """On an output that is not finite, or NaN in the data, the forward again at each op,
        which names the op (True: there was one)."""
        n = len(self.heads)
        bad = [k for k in range(n) if st[k] != FINITE]
        nan_data = [k for k in range(len(self.data)) if st[n + k] == NAN]
        if not bad and not nan_data:
            return False
        name = type(safe._nanpass_model).__name__
        parts = [f"{'NaN' if st[k] == NAN else 'an infinity'} in output {k} of {name} ({self.heads[k]})" for k in bad]
        parts += [f"NaN in input tensor {k} ({self.data[k]})" for k in nan_data]
        safe._check_again(args, kwargs, rng, "definite", kept=kept, saw="the screen saw " + "; ".join(parts))
        return True


def drop_later(watch) -> None:
    """The hooks a create_graph backward left on the leaves for a backward through its
    gradients, removed at the model's next forward (no such backward came)."""
    later = getattr(watch, "later", None)
    if later:
        for h in later:
            h.remove()
        later.clear()


def not_reproduced(safe, phase: str, saw: str, run: bool = True) -> None:
    config = safe._nanpass_config
    why = (", not reproduced: the step again from the same inputs, random state and buffers, "
           "with a check at each op, made no NaN or Inf (a random draw from a generator nanpass "
           "does not replay, a data-dependent kernel, or state the step changed)") if run else " (not reproduced)"
    safe._nanpass_sites.checker._emit(
        phase, "NaN/Inf", None,
        f"{saw}{why}; {getattr(safe, '_nanpass_every_op', None) or f'harden(model, mode={config.mode!r}, every_op=True)'}"
        f" checks each op of every step as it runs")


_UNREAD: weakref.WeakSet = weakref.WeakSet()  # backward screens whose forward is not read yet
_AT_EXIT: list = []


def _unread(safe) -> dict:
    """Thread id -> the backward screen of ``safe``'s last forward there, its forward unread."""
    got = safe.__dict__.get("_nanpass_unread")
    if got is None:
        got = safe.__dict__["_nanpass_unread"] = {}
    return got


def _backed(safe) -> dict:
    """Thread id -> whether a backward reached the outputs of ``safe``'s last forward there."""
    got = safe.__dict__.get("_nanpass_backed")
    if got is None:
        got = safe.__dict__["_nanpass_backed"] = {}
    return got


def _read_at_exit() -> None:
    """The forwards no backward reached, read as the program ends (a finding is said then)."""
    for step in list(_UNREAD):
        step.read_ahead()


class _Backward:
    """The backward screen of one screened forward: a hook on each output that needs a
    gradient (the gradient the loss gives it, kept for a run again), and one read when the
    backward that reached them ends."""

    __slots__ = ("safe", "args", "kwargs", "rng", "kept", "explained", "upstream", "heads",
                 "armed", "accumulates", "leaves", "kept_in", "handles", "partial", "graphed", "second",
                 "ahead", "tid", "seq", "__weakref__")

    @classmethod
    def watch(cls, safe, args, kwargs, rng, kept, outs, explained: bool, ahead: _Forward | None = None):
        """The backward screen of a forward (None: no output needs a gradient). ``ahead``: the
        forward's scalars, read with the backward's (or, where no backward reaches the outputs,
        at the model's next forward on this thread, or when the program exits)."""
        watched = [o for o in outs if isinstance(o, Tensor) and o.requires_grad]
        if not watched:
            return None
        step = cls()
        step.ahead = ahead
        step.seq = next_seq()
        step.tid = threading.get_ident()  # (the forward's thread: a GPU's backward runs on another)
        if ahead is not None:
            _unread(safe)[step.tid] = step
            if not _AT_EXIT:
                _AT_EXIT.append(atexit.register(_read_at_exit))
            _UNREAD.add(step)
        step.safe, step.args, step.kwargs, step.rng, step.kept = safe, args, kwargs, rng, kept
        step.explained = explained
        step.upstream, step.heads, step.armed = {}, [], False
        step.accumulates, step.leaves, step.handles, step.partial = True, [], [], []
        step.kept_in = []  # the leaves, whose .grad a backward accumulates into
        step.graphed = step.second = False
        for k, o in enumerate(watched):
            o.register_hook(functools.partial(step.reached, k))
        return step

    def read_ahead(self) -> None:
        """The forward's scalars, read alone: no backward reached its outputs before the
        model's next forward (an evaluation with grad on), or the program is ending."""
        ahead, self.ahead = self.ahead, None
        _UNREAD.discard(self)
        _backed(self.safe).pop(self.tid, None)  # (its next forward: read at once)
        if ahead is not None:
            with torch.enable_grad():  # (as the forward ran)
                self.explained = ahead.judge(self.safe, read(ahead.scalars), self.args, self.kwargs,
                                             self.rng, self.kept) or self.explained

    def _leaves(self) -> list[Tensor]:
        return (layout_of(self.safe).parameters(self.safe._nanpass_model)
                + [t for t in leaves((self.args, self.kwargs))
                   if isinstance(t, Tensor) and t.requires_grad])

    def reached(self, k: int, g):
        if not self.armed:  # the first output this backward reached: a new backward
            self.armed = True
            if type(self) is _Backward:
                _backed(self.safe)[self.tid] = True
            # a backward after one that made a graph of its gradients (create_graph=True: a
            # gradient penalty) runs through those gradients: a backward of the user's code
            # between the two, which a run again of the step cannot replay
            self.second = self.graphed
            if torch.is_grad_enabled():  # (autograd runs a create_graph backward with grad on)
                self.graphed = True
                # this model's later steps are checked at every op, which sees such a
                # backward's nodes (the first step's is said as not run again, if hit)
                self.safe._nanpass_sites.checker.screening = False
            self.upstream, self.heads, self.partial = {}, [], []
            self.leaves = self._leaves()
            self.kept_in = [t for t in self.leaves if t.is_leaf]
            self.accumulates = bool(self.kept_in) and backward_accumulates(self.kept_in[0])
            nonleaf = [t for t in self.leaves if not t.is_leaf]  # (an upstream model's output)
            hooked = nonleaf if self.accumulates else self.leaves
            self.handles = [t.register_hook(self._given) for t in hooked]
            self._arm()
        if g is not None:
            self.upstream[k] = g
            if readable(g):
                self.heads.append((k, scalar(g)))

    def _later(self, g):
        """A leaf's gradient in a backward after this model's create_graph backward (a gradient
        penalty's, which may not pass through the model's outputs): screened, and said."""
        if not self.armed:
            self.armed, self.second, self.accumulates = True, True, False
            self.upstream, self.heads, self.partial = {}, [], []
            self._arm()
        self._given(g)

    def _given(self, g):  # a scalar as it passes (holding it would make AccumulateGrad copy it)
        if isinstance(g, Tensor) and float_value(g):
            self.partial.append(scalar(g))

    def _arm(self) -> None:  # read with every other verdict of this backward, as it ends
        join(_Joined(self))

    def _collect(self):
        """At the backward's end: its scalars on the device (the gradients the outputs got,
        the leaves' and the inputs'), with what judging them needs; None: nothing to read."""
        self.armed = False
        for h in self.handles:
            h.remove()
        upstream, heads, partial, self.handles = self.upstream, self.heads, self.partial, []
        self.upstream, self.heads, self.partial = {}, [], []
        watch = self.safe._nanpass_sites.checker
        if self.graphed and not self.second:  # the backward through these gradients, next
            self.handles = [t.register_hook(self._later) for t in self.leaves]
            drop_later(watch)
            watch.later = self.handles
        grads = [g for t in self.kept_in if (g := t.grad) is not None] if self.accumulates else []
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            _UNREAD.discard(self)
            unread = _unread(self.safe)
            if unread.get(self.tid) is self:
                del unread[self.tid]
        every = (list(ahead.scalars) if ahead is not None else []) + [s for _, s in heads] + partial
        norm = gradient_scalar(grads) if grads else None
        if norm is not None:  # (a 2-norm: the fastest fused reduction a CPU has, 0.14 ms for
            every.append(norm)  # GPT-2 12L 32 wide's 148 gradients, against 0.57 ms for a max)
        if not every:
            return None
        return every, ahead, heads, upstream, grads, norm

    def _judge(self, st: list[int], ahead, heads, upstream, grads, norm, absorb=None) -> None:
        """The states of ``every``, read: the forward's first (``ahead``: on a hit the forward
        again, which names it); on a gradient that is not finite, the step again (``absorb``: a
        GradScaler skipped the step: an overflow is its own, not a finding)."""
        watch = self.safe._nanpass_sites.checker
        if ahead is not None:
            n = len(ahead.scalars)
            with torch.enable_grad():  # (as the forward ran)
                if ahead.judge(self.safe, st[:n], self.args, self.kwargs, self.rng, self.kept):
                    return  # (the backward's non-finite gradients are that forward's)
            st = st[n:]
        if all(s == FINITE for s in st) or self.explained:
            return
        if all(s == FINITE for s in st[:-1]) and norm is not None and finite_exactly(grads):
            return  # (finite gradients whose squares pass the largest float: about 1e19 in float32)
        name = type(self.safe._nanpass_model).__name__
        if absorb is not None and NAN not in st:
            absorb.take(f"the backward of {name}")
            return
        if self.second:
            not_reproduced(self.safe, "backward", (
                f"the screen saw a non-finite gradient in a backward through the gradients of an "
                f"earlier backward of {name} (a gradient penalty: create_graph=True), which a run "
                f"again of the step cannot replay; this model's later steps are checked at every op"),
                run=False)
            return
        for (k, _), s in zip(heads, st, strict=False):
            if s != FINITE:  # the loss's gradient, not the model's
                watch.output_grad("the model's output", upstream[k])
                return
        self._again(upstream, grads)

    def _again(self, upstream: dict, grads: list) -> None:
        """The step again with the check at each op and at each backward node, with the same
        upstream gradients (``torch.autograd.grad``: nothing accumulated into ``.grad``)."""
        safe = self.safe
        watch = safe._nanpass_sites.checker
        ins = list(self.leaves)

        def backward(again):
            backward_again(again, upstream, ins)

        with torch.enable_grad():
            safe._check_again(self.args, self.kwargs, self.rng, None, backward, kept=self.kept)
        if not watch.found:
            names = _nonfinite_names(safe._nanpass_model, grads) if grads else ""
            not_reproduced(safe, "backward", "the screen saw a non-finite gradient given to "
                           f"{names or 'a parameter or input'} in the backward of "
                           f"{type(safe._nanpass_model).__name__}")


def _nonfinite_names(model, grads) -> str:
    """The parameters whose ``.grad`` is not finite (only on the path that reports)."""
    by_grad = {id(p.grad): n for n, p in model.named_parameters() if p.grad is not None}
    bad = [by_grad.get(id(g), "an input") for g in grads if not bool(torch.isfinite(g).all())]
    shown = ", ".join(repr(b) for b in bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
    return f"{'the parameter ' if len(bad) == 1 else ''}{shown}" if bad else ""


def backward_again(again, upstream: dict, ins) -> None:
    """The backward of a step run again, from the upstream gradients its outputs got the first
    time (``upstream``: output index -> gradient), into ``ins`` (a list, or a function giving
    it) with ``autograd.grad``, so nothing is accumulated; where a reentrant checkpoint refuses
    ``autograd.grad``, a backward with the leaves' ``.grad`` put back as they were after it."""
    outs = [o for o in leaves(again) if isinstance(o, Tensor) and o.requires_grad]
    pairs = [(o, upstream[k]) for k, o in enumerate(outs) if k in upstream]
    if not pairs:
        return
    outs, grads = [o for o, _ in pairs], [g for _, g in pairs]
    ins = ins() if callable(ins) else ins
    if ins and not runs_its_own_backward(outs):
        torch.autograd.grad(outs, ins, grads, allow_unused=True)
        return
    kept = [(t, t.grad) for t in ins if t.is_leaf]
    for t, _ in kept:
        t.grad = None
    try:
        torch.autograd.backward(outs, grads)
    finally:
        for t, g in kept:
            t.grad = g


# -- nanpass.enable / nanpass run: each outermost module call screened -------------------------

# how many screened calls a program may keep for a run again before it reads (an evaluation
# loop with no backward and no optimizer step: the inputs each keeps would pile up)
_HELD = 8
_CALL = torch.nn.Module.__call__  # torch's own: the wrapper below is in place only while screening
_MAIN = threading.main_thread().ident
_ON: list = []  # the program screens on now, the innermost last (it alone screens)


_KINDS: dict = {}  # module class -> whether the screen leaves its calls to the mode


def _skipped(module) -> bool:
    """A compiled module (its graph is the backend's to check), a hardened one (its own check),
    and a distributed wrapper (DDP, FSDP: its forward holds collectives, which a run again on
    one rank alone would hang; DDP's wrapped module is screened instead, as the outermost
    call under it): run as today, under the program's mode."""
    kind = type(module)
    got = _KINDS.get(kind)
    if got is None:
        got = _KINDS[kind] = (kind.__module__ == "torch._dynamo.eval_frame"
                              or any(k.__module__.startswith("torch.distributed") for k in kind.__mro__))
    return got or hasattr(module, "_nanpass_sites")


def _call(module, *args, **kwargs):
    """``nn.Module.__call__`` while a program is screened: an outermost call of the main thread
    is screened (``ProgramScreen.call``); every other call is torch's own."""
    if torch.compiler.is_compiling() or not _ON:  # (first: dynamo inlines this function)
        return _CALL(module, *args, **kwargs)
    screen = _ON[-1]
    if screen.depth or threading.get_ident() != _MAIN:
        return _CALL(module, *args, **kwargs)
    return screen.call(module, args, kwargs)


class _Unit:
    """One module of a program, as the screen's run again sees it (what ``_Backward`` and
    ``not_reproduced`` read of a hardened model). Holds the module weakly."""

    def __init__(self, screen: ProgramScreen, module):
        self.screen = screen
        self._module = weakref.ref(module)
        self._nanpass_sites = screen.sites
        self._nanpass_config = screen.sites.config
        self._nanpass_every_op = "nanpass.enable(every_op=True) (nanpass run --every-op)"

    @property
    def _nanpass_model(self):
        return self._module()

    def _check_again(self, args, kwargs, rng, verdict, backward=None, kept=None, saw=None):
        self.screen.again(self._module(), args, kwargs, rng, kept, saw, backward)


class ProgramScreen:
    """nanpass.enable's screen (issue 47): each outermost module call of the program's main
    thread runs as written, with the program's mode off the stack (so the calls inside it cost
    what they cost without nanpass); its outputs' scalars join the program's verdicts, and the
    backward that reaches them is screened as a hardened model's is (``_Backward``). The
    verdicts are read where the program reads them already (when ``loss.backward()`` starts,
    before an optimizer step, at the end), so a step still reads the host at most twice. On a
    hit the call runs again, from the same inputs, random state and buffers, with the check at
    each op, which names the op. The code between module calls (a loss written inline) keeps
    the check at each call. Each module's first call is checked at each op."""

    def __init__(self, enabled):
        self.enabled = enabled
        self.sites = enabled.sites
        self.watch = enabled.sites.checker
        self.depth = 0
        self.units: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.watch.screening = True
        self.called = False  # a module was called since the last optimizer step

    def start(self) -> None:
        _ON.append(self)
        if torch.nn.Module.__call__ is _CALL:
            torch.nn.Module.__call__ = _call

    def stop(self) -> None:
        if self in _ON:
            _ON.remove(self)
        if not _ON and torch.nn.Module.__call__ is _call:
            torch.nn.Module.__call__ = _CALL

    def call(self, module, args: tuple, kwargs: dict):
        en, watch = self.enabled, self.watch
        mode = en._mode
        self.called = True
        if en._lifted is not None:
            en.land()
        stack = function_mode_stack()
        unit = self.units.get(module)
        if (mode.paused or not watch.screening or not stack or stack[-1] is not mode or unit is None
                or COLLECT.get() is not None or functorch_active() or torch.jit.is_tracing()
                or _skipped(module)):
            if unit is None and not _skipped(module):  # its first call: at each op
                self.units[module] = _Unit(self, module)
            return _CALL(module, *args, **kwargs)
        if len(watch.screens) >= _HELD:
            en.flush()
        rng = rng_state()
        layout = layout_of(unit)
        kept = layout.before(module)
        mode.__exit__(None, None, None)  # the calls inside run as written, and the screen's own
        self.depth += 1
        try:
            out = _CALL(module, *args, **kwargs)
            layout.after()
            self._screen(unit, out, args, kwargs, rng, kept)
        finally:
            self.depth -= 1
            mode.__enter__()
        return out

    def _screen(self, unit, out, args, kwargs, rng, kept) -> None:
        watch = self.watch
        step = watch.pending
        if step is None:  # (not the main thread's program: cannot happen here)
            return
        outs = leaves(out)
        heads = [step.add(o) for o in outs if float_value(o)]
        data = [k if (k := step.get(t)) is not None else step.add(t)
                for t in leaves((args, kwargs)) if float_value(t)]
        watch.screens.append(_Called(unit, args, kwargs, rng, kept, heads, data))
        if torch.is_grad_enabled():
            _ProgramBackward.watch(unit, args, kwargs, rng, kept, outs, explained=False)

    def again(self, module, args, kwargs, rng, kept, saw, backward=None) -> None:
        """``module``'s call again with the check at each op, from the first run's random
        state and buffers (its buffer writes go to copies); ``backward(out)`` its backward."""
        if module is None:
            return
        watch = self.watch
        after = rng_state()
        set_rng_state(rng)
        program, paused = watch.program, self.enabled._mode.paused
        watch.program = False  # (checked at each op, here and now)
        self.enabled._mode.paused += 1  # (the program's mode, under the run again's)
        self.depth += 1
        try:
            with buffers_from(module, kept):
                warn = watch.warn
                check_state(module, warn)
                for k, t in enumerate(leaves((args, kwargs))):
                    if float_value(t):
                        check_input(t, f"input tensor {k} of {type(module).__name__}", warn)
                with watch.at_each_op(), self.sites.mode():
                    out = _CALL(module, *args, **kwargs)
                    if backward is not None:
                        backward(out)
        finally:
            self.depth -= 1
            self.enabled._mode.paused = paused
            watch.program = program
            set_rng_state(after)
        return out if backward is None else None


class _Called:
    """One screened call, its outputs' and its data's slots in the program's forward."""

    __slots__ = ("unit", "args", "kwargs", "rng", "kept", "heads", "data")

    def __init__(self, unit, args, kwargs, rng, kept, heads, data):
        self.unit, self.args, self.kwargs, self.rng, self.kept = unit, args, kwargs, rng, kept
        self.heads, self.data = heads, data

    scalars = ()  # (its scalars are the forward's)

    def judge(self, st, forward: list[int], absorb, by_slot: dict) -> None:
        """A NaN in an output, or an infinity, runs the call again at each op: a NaN or an
        overflow is named there; an infinity made on purpose is remembered with where it was
        born (``by_slot``), for the code after the call that may turn it into NaN."""
        bad = [k for k in self.heads if forward[k] != FINITE]
        nan_data = [k for k in self.data if forward[k] == NAN]
        unit, watch = self.unit, self.unit.screen.watch
        if not bad and not nan_data:
            return
        if watch.found:
            return
        module = unit._nanpass_model
        out = unit.screen.again(module, self.args, self.kwargs, self.rng, self.kept, None)
        if watch.found or out is None:
            return
        again = [o for o in leaves(out) if float_value(o)]
        for k, o in zip(self.heads, again, strict=False):
            origin = watch._origin(o) if forward[k] != FINITE else None
            if origin is not None:
                by_slot[k] = origin
        if any(forward[k] == NAN for k in bad):
            name = type(module).__name__
            not_reproduced(unit, "forward", f"the screen saw NaN in an output of {name}")


class _Joined:
    """A harden screen's backward among the verdicts its backward reads in one copy
    (``_check.join``): its forward's scalars, then its gradients'."""

    __slots__ = ("backward", "got", "n", "seq")

    def __init__(self, backward: _Backward):
        self.backward, self.got, self.n, self.seq = backward, None, 0, backward.seq

    def collect(self) -> tuple[list[Tensor], list[Tensor]]:
        self.got = got = self.backward._collect()
        if got is None:
            return [], []
        ahead = got[1]
        self.n = len(ahead.scalars) if ahead is not None else 0
        return got[0][:self.n], got[0][self.n:]

    def judge_forward(self, values: list[float]) -> bool:
        b, ahead = self.backward, self.got[1]
        return ahead.judge(b.safe, [state_of(v) for v in values], b.args, b.kwargs, b.rng, b.kept)

    def judge_backward(self, values: list[float]) -> None:
        if self.got is not None:
            self.backward._judge([state_of(v) for v in values], None, *self.got[2:])


class _ProgramBackward(_Backward):
    """A screened call's backward, its scalars read with the program's (``_Called``)."""

    __slots__ = ()

    def _arm(self) -> None:
        at_backward_end(self.finish)

    def finish(self) -> None:
        got = self._collect()
        if got is not None:
            self.explained = self.explained or self.safe._nanpass_sites.checker.found
            self.safe._nanpass_sites.checker.screens.append(_Judged(self, got))


class _Judged:
    __slots__ = ("backward", "got", "scalars")

    def __init__(self, backward: _ProgramBackward, got: tuple):
        self.backward, self.got = backward, got
        self.scalars = got[0]

    def judge(self, st, forward, absorb, by_slot) -> None:
        if self.backward.safe._nanpass_sites.checker.found:
            return  # (its forward's finding, read in the same copy, explains it)
        self.backward._judge(st, *self.got[1:], absorb=absorb)
