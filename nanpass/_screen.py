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
versions; from then on those buffers are copied before each
forward so that a run again starts from the values the first run started from. The memory this
costs is the size of the buffers the forward writes (a batch norm: two vectors of its width);
a buffer no forward writes costs nothing.
"""

from __future__ import annotations

import functools

import torch

from . import _fastpath
from ._check import finite_exactly, gradient_scalar, runs_its_own_backward
from ._compat import at_backward_end, backward_accumulates, version
from ._deferred import FINITE, NAN, read, scalar
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
    """Where a screened model's parameters and floating buffers live, walked again only when a
    module anywhere registers something (a walk of GPT-2's 164 modules is 0.3 ms, 2.5% of a
    launch-bound step): each step reads them from their registries, so a tensor replaced in
    place of another (``.to()``, a checkpoint load) is the one read. The buffers a forward
    writes are learned by their versions and copied before each later forward."""

    __slots__ = ("epoch", "params", "buffers", "written", "versions")

    def __init__(self):
        self.epoch = -1
        self.params: list = []  # (the module's _parameters, name)
        self.buffers: list = []  # (the module's _buffers, name)
        self.written: set = set()  # (id of the registry, name) a forward wrote
        self.versions: list = []

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
                if b is not None and b.is_floating_point():
                    self.buffers.append((mod._buffers, name))

    def parameters(self, model: torch.nn.Module) -> list[Tensor]:
        self._walk(model)
        return [p for reg, name in self.params if (p := reg.get(name)) is not None and p.requires_grad]

    def before(self, model: torch.nn.Module) -> dict[int, Tensor]:
        self._walk(model)
        self.versions = [version(b) if (b := reg.get(name)) is not None else None for reg, name in self.buffers]
        if not self.written:
            return {}
        return {id(b): b.detach().clone() for reg, name in self.buffers
                if (id(reg), name) in self.written and (b := reg.get(name)) is not None}

    def after(self) -> None:
        for (reg, name), v in zip(self.buffers, self.versions, strict=False):
            b = reg.get(name)
            if b is not None and (v is None or version(b) != v):
                self.written.add((id(reg), name))


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
    st = read([scalar(t) for t in (*heads, *data)])  # the one read
    bad = [k for k, s in enumerate(st[:len(heads)]) if s != FINITE]
    nan_data = [k for k, s in enumerate(st[len(heads):]) if s == NAN]
    if bad or nan_data:
        saw = _saw(model, heads, bad, data, nan_data, st)
        safe._check_again(args, kwargs, rng, "definite", kept=kept, saw=saw)
    if torch.is_grad_enabled():
        _Backward.watch(safe, args, kwargs, rng, kept, outs, explained=watch.found)
    return out


def _saw(model, heads, bad, data, nan_data, st) -> str:
    name = type(model).__name__
    parts = [f"{'NaN' if st[k] == NAN else 'an infinity'} in output {k} of {name} "
             f"(shape {tuple(heads[k].shape)} {str(heads[k].dtype)[6:]})" for k in bad]
    parts += [f"NaN in input tensor {k} (shape {tuple(data[k].shape)} {str(data[k].dtype)[6:]})"
              for k in nan_data]
    return "the screen saw " + "; ".join(parts)


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
        f"{saw}{why}; harden(model, mode={config.mode!r}, every_op=True) checks each op of every "
        f"step as it runs")


class _Backward:
    """The backward screen of one screened forward: a hook on each output that needs a
    gradient (the gradient the loss gives it, kept for a run again), and one read when the
    backward that reached them ends."""

    __slots__ = ("safe", "args", "kwargs", "rng", "kept", "explained", "upstream", "heads",
                 "armed", "accumulates", "leaves", "kept_in", "handles", "partial", "graphed", "second",
                 "__weakref__")

    @classmethod
    def watch(cls, safe, args, kwargs, rng, kept, outs, explained: bool) -> None:
        watched = [o for o in outs if isinstance(o, Tensor) and o.requires_grad]
        if not watched:
            return
        step = cls()
        step.safe, step.args, step.kwargs, step.rng, step.kept = safe, args, kwargs, rng, kept
        step.explained = explained
        step.upstream, step.heads, step.armed = {}, [], False
        step.accumulates, step.leaves, step.handles, step.partial = True, [], [], []
        step.kept_in = []  # the leaves, whose .grad a backward accumulates into
        step.graphed = step.second = False
        for k, o in enumerate(watched):
            o.register_hook(functools.partial(step.reached, k))

    def _leaves(self) -> list[Tensor]:
        return (layout_of(self.safe).parameters(self.safe._nanpass_model)
                + [t for t in leaves((self.args, self.kwargs))
                   if isinstance(t, Tensor) and t.requires_grad])

    def reached(self, k: int, g):
        if not self.armed:  # the first output this backward reached: a new backward
            self.armed = True
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
            at_backward_end(self.finish)
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
            at_backward_end(self.finish)
        self._given(g)

    def _given(self, g):  # a scalar as it passes (holding it would make AccumulateGrad copy it)
        if isinstance(g, Tensor) and float_value(g):
            self.partial.append(scalar(g))

    def finish(self) -> None:
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
        every = [s for _, s in heads] + partial
        norm = gradient_scalar(grads) if grads else None
        if norm is not None:  # (a 2-norm: the fastest fused reduction a CPU has, 0.14 ms for
            every.append(norm)  # GPT-2 12L 32 wide's 148 gradients, against 0.57 ms for a max)
        if not every:
            return
        st = read([s.to(every[0].device) for s in every])  # the one read
        if all(s == FINITE for s in st) or self.explained:
            return
        if all(s == FINITE for s in st[:-1]) and norm is not None and finite_exactly(grads):
            return  # (finite gradients whose squares pass the largest float: about 1e19 in float32)
        name = type(self.safe._nanpass_model).__name__
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
