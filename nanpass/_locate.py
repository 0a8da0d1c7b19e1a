"""``nanpass.locate``: run one step, and where it goes wrong, say where the first NaN came from.

The step is screened (issue 47), as eager check mode screens one: the forward runs as written,
with no mode and no stand-in between its calls, then ``loss_fn`` and ``loss.backward()``; on the
device, the model's outputs, a NaN in the data, the parameters and buffers as the step found
them, the loss, the gradient the loss gives each output and the gradient the backward gives
each parameter and input are reduced to a scalar each, and read in one copy. Only where one is
not finite does the step run again, from the same inputs, random state and buffers, with the
check at each op collecting instead of raising (what ``every_op=True`` runs on every call, and
all ``locate`` did before): its events make the ``Finding``. The run again's buffer writes go
to copies, and its backward is ``torch.autograd.grad`` (``_screen.backward_again``; where a
reentrant checkpoint refuses it, a backward with ``.grad`` put back after it), so one call
leaves the buffers, the random state and ``.grad`` as one plain step does. A hit the run again
does not reproduce is said, with what the screen saw.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from . import _fastpath
from ._check import COLLECT, PROGRESS, Event, state_scalar, state_tensors
from ._deferred import FINITE, NAN, read, scalar
from ._rules import BY_NAME
from ._screen import backward_again, rng_state
from ._watch import leaves, readable

Tensor = torch.Tensor


@dataclass
class Finding:
    """The first non-finite value forward and backward, what it flowed through, and a fix."""

    model: str
    forward: Event | None
    backward: Event | None
    chain: list[Event]  # every checked op the bad value reached, in order
    suggestion: str
    # what the screen looked at, and on a hit what it saw ("": every_op=True, no screen)
    screen: str = ""

    def __str__(self) -> str:
        lines = [f"nanpass.locate: {self.model}"]
        if self.forward is None and self.backward is None:
            how = f"({self.screen})" if self.screen else "(every call checked)"
            lines.append(f"  no NaN or Inf found, forward or backward {how}")
        if self.forward is not None:
            lines.append(f"  forward:  {self.forward.message.removeprefix('nanpass: ')}")
        if self.backward is not None:
            lines.append(f"  backward: {self.backward.message.removeprefix('nanpass: ')}")
        if len(self.chain) > 1:
            lines.append("  then through:")
            lines.extend(f"    {e.site}" for e in self.chain[1:] if e.site is not None)
        lines.append(f"  suggestion: {self.suggestion}")
        return "\n".join(lines) + "\n"

    def to_json(self) -> str:
        return json.dumps({
            "schema": "nanpass.finding/1",
            "model": self.model,
            "forward": self.forward.to_dict() if self.forward else None,
            "backward": self.backward.to_dict() if self.backward else None,
            "chain": [e.to_dict() for e in self.chain],
            "suggestion": self.suggestion,
            "screen": self.screen,
        }, indent=2) + "\n"


def _suggest(event: Event | None) -> str:
    if event is None:
        return "nothing to fix on these inputs"
    at = f" at batch index {event.index}" if event.index is not None else ""
    if event.phase == "input":
        return (f"the data already holds NaN{at}: clean or drop that sample before the model "
                "sees it")
    if event.phase == "state":
        return ("a parameter or buffer is already non-finite: restore a finite checkpoint, and "
                "skip non-finite optimizer steps (nanpass.StepGuard) so it cannot happen again")
    if event.site is None:
        return ("a NaN or Inf reached the result without an op nanpass watched making it (an op "
                "that runs outside the model's Python, or data): look at the last op named above")
    rule = BY_NAME.get(event.site.op)
    where = f"{event.site.spelling} at {event.site.source}" if event.site.source else event.site.spelling
    if rule is None or not rule.guarded:  # ordinary arithmetic, or an op no guard makes finite
        if event.kind == "Inf":
            return (f"an overflow in {where}: keep the operands in range (normalise, scale down, "
                    f"compute it in float32), or train with nanpass.StepGuard to skip such steps")
        if "infinity" in event.message:
            return (f"an infinity made on purpose reaches {where} and turns into NaN there: use a "
                    f"large finite fill (torch.finfo(dtype).min) instead of -inf, or mask after "
                    f"the op; the infinity's birth is named above")
        return (f"{where} makes NaN from finite operands: check the values named above "
                f"(an empty selection, 0 / 0, inf - inf)")
    operand = f"; its operand turns zero, negative or non-finite{at}" if at else ""
    return (f"guard this {rule.name} ({where}): {rule.reason}{operand}. "
            f"nanpass.harden(model) does: {rule.action}")


class _Progress:
    """Checked ops so far, on stderr; the sites are found as the model runs, so there is no
    total up front: the line is refreshed every ``every`` ops."""

    def __init__(self, enabled: bool, every: int = 16):
        self.enabled, self.every, self.done = enabled, every, 0

    def __call__(self, phase: str) -> None:
        self.done += 1
        if self.enabled and (self.done == 1 or self.done % self.every == 0):
            print(f"\rnanpass.locate: {phase} {self.done} checked ops", end="", file=sys.stderr, flush=True)


class _Screen:
    """The device scalars of one step, each with what it is, read in one copy."""

    def __init__(self, model: torch.nn.Module, name: str, inputs: tuple, kwargs: dict):
        self.model, self.name, self.inputs, self.kwargs = model, name, inputs, kwargs
        self.scalars: list[Tensor] = []
        self.what: list[tuple[str, bool]] = []  # (what the scalar is of, only a NaN counts)
        self.counts: dict[str, int] = {}
        self.handles: list = []

    def add(self, value: Tensor, what: str, kind: str, nan_only: bool = False) -> None:
        self.scalars.append(value)
        self.what.append((what, nan_only))
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def tensor(self, t, what: str, kind: str, nan_only: bool = False) -> None:
        if readable(t):
            self.add(scalar(t), f"{what} (shape {tuple(t.shape)} {str(t.dtype)[6:]})", kind, nan_only)

    def before(self) -> None:
        """The data (a NaN there is the data's) and the parameters and buffers as the step
        finds them (a NaN or an infinity there is the state's)."""
        for k, t in enumerate(t for t in leaves((self.inputs, self.kwargs)) if readable(t)):
            self.tensor(t, f"input tensor {k}", "data", nan_only=True)
        state = state_tensors(self.model)
        if state:
            self.add(state_scalar(state), f"a parameter or buffer of {self.name}", "state")

    def outputs(self, out) -> list[Tensor]:
        outs = leaves(out)
        for k, o in enumerate(o for o in outs if readable(o)):
            self.tensor(o, f"output {k} of {self.name}", "output")
        return outs

    def loss(self, loss) -> None:
        if isinstance(loss, Tensor):
            self.tensor(loss, "the loss", "loss")

    def gradients(self, outs: list) -> None:
        """A hook on each output that needs a gradient (the gradient the loss gives it) and on
        each parameter and input that needs one (the gradient the backward gives it): a scalar
        as it passes, before it is accumulated into ``.grad``. ``done`` removes them."""
        for k, o in enumerate(o for o in outs if isinstance(o, Tensor) and o.requires_grad):
            self._hook(o, f"the gradient the loss gives output {k} of {self.name}", "at the output")
        seen: set = set()
        for name, p in self.model.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self._hook(p, f"the gradient given to the parameter {name!r}", "given")
        for k, t in enumerate(t for t in leaves((self.inputs, self.kwargs)) if isinstance(t, Tensor)):
            if t.requires_grad and id(t) not in seen:
                seen.add(id(t))
                self._hook(t, f"the gradient given to input tensor {k}", "given")

    def _hook(self, t: Tensor, what: str, kind: str) -> None:
        def given(g):
            self.tensor(g, what, kind)

        self.handles.append(t.register_hook(given))

    def done(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def read(self) -> list[tuple[str, int]]:
        """What is not finite, with its state (the one read)."""
        st = read(self.scalars)
        return [(what, s) for (what, nan_only), s in zip(self.what, st, strict=True)
                if (s == NAN if nan_only else s != FINITE)]

    def looked_at(self) -> str:
        c = self.counts
        parts = [f"{c['output']} output{'s' if c['output'] != 1 else ''}" if c.get("output") else "",
                 "the loss" if c.get("loss") else "",
                 "its gradient at the output" if c.get("at the output") else "",
                 f"{c['given']} gradient{'s' if c['given'] != 1 else ''} of parameters and inputs"
                 if c.get("given") else "",
                 "the data" if c.get("data") else "",
                 "the parameters and buffers" if c.get("state") else ""]
        parts = [p for p in parts if p]
        return (f"screened on the device, one read: {', '.join(parts) or 'nothing to look at'}; a NaN made "
                f"and masked inside the step is not seen: every_op=True checks every call")


def _saw(found: list[tuple[str, int]]) -> str:
    return "the screen saw " + "; ".join(
        f"{'NaN' if s == NAN else 'an infinity'} in {what}" for what, s in found)


def _buffers(model: torch.nn.Module) -> dict[int, Tensor]:
    """A copy of each buffer (a batch norm's running statistics and its count) by the buffer's
    id, for a run again that starts where the step started (``_screen.buffers_from``)."""
    return {id(b): b.detach().clone() for b in model.buffers()}


def _leaves_of(model, inputs, kwargs, loss: Tensor):
    """What the run again's backward gives a gradient to (``autograd.grad``'s inputs): every
    leaf the loss's graph accumulates into, the parameters (a reentrant checkpoint's inside
    it too) and the inputs that need one."""
    def ins():
        found: dict[int, Tensor] = {}
        seen: set = set()
        todo = [loss.grad_fn]
        while todo:
            n = todo.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            if type(n).__name__ == "AccumulateGrad":
                found.setdefault(id(n.variable), n.variable)
            todo.extend(c for c, _ in n.next_functions if c is not None)
        for t in (*model.parameters(), *leaves((inputs, kwargs))):
            if isinstance(t, Tensor) and t.requires_grad:
                found.setdefault(id(t), t)
        return list(found.values())

    return ins


def _finding(name: str, events: list[Event], n_forward: int, screen: str = "") -> Finding:
    forward, backward = events[:n_forward], events[n_forward:]
    first_fwd = next((e for e in forward if e.created or e.phase in ("input", "state")),
                     forward[0] if forward else None)
    # a backward NaN that a forward NaN explains is not a second finding
    first_bwd = next((e for e in backward if e.created), None)
    chain = forward[forward.index(first_fwd):] if first_fwd is not None else []
    return Finding(name, first_fwd, first_bwd, chain,
                   _suggest(first_fwd if first_fwd is not None else first_bwd), screen)


def _collect(bar: _Progress, run, loss_fn, backward, again: _Screen | None = None):
    """``run(step)`` with the check at each op collecting its events; ``step(out)`` runs the
    loss and its backward (``backward(loss)``). Returns the events and how many are the
    forward's; ``again`` screens the run's output, loss and gradients as the first run's were."""
    events: list[Event] = []
    split: list[int] = []

    def step(out):
        split.append(len(events))
        outs = again.outputs(out) if again is not None else []
        if loss_fn is None:
            return
        PROGRESS.set(lambda: bar("backward"))
        loss = loss_fn(out)
        if again is not None:
            again.loss(loss)
        # a loss that nothing requires a gradient of (a model with no parameters, a metric,
        # inputs that do not require grad) has no backward: the forward's finding stands
        if isinstance(loss, Tensor) and loss.requires_grad:
            if again is not None:
                again.gradients(outs)
            try:
                backward(loss)
            finally:
                if again is not None:
                    again.done()

    token, ptoken = COLLECT.set(events), PROGRESS.set(lambda: bar("forward"))
    try:
        run(step)
    finally:
        COLLECT.reset(token)
        PROGRESS.reset(ptoken)
        if bar.enabled and (again is None or bar.done):
            print(file=sys.stderr)
    return events, split[0] if split else len(events)


def locate(model: torch.nn.Module, *inputs, loss_fn=None, progress: bool | None = None,
           every_op: bool = False, **kwargs) -> Finding:
    """Run ``model(*inputs, **kwargs)`` (and ``loss_fn(output).backward()`` when given) and
    return a Finding instead of raising: where the first NaN or Inf of the step was born.

    The step is screened on the device (its outputs, the data, the parameters and buffers, the
    loss and the gradients, read once); only where one is not finite does it run again, from
    the same inputs, random state and buffers, with every call checked, which names the op.
    ``every_op=True`` checks every call of the one run instead (a NaN made and masked inside
    the step, which reaches no output, loss or gradient, is seen only so).

    >>> import torch, nanpass
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LogSoftmax(-1))
    >>> nanpass.locate(m, torch.tensor([[float("inf"), 0.0]])).forward.kind
    'NaN'
    """
    from ._harden import harden

    checked = harden(model, mode="check")
    bar = _Progress(sys.stderr.isatty() if progress is None else progress)
    name = type(model).__name__

    def backward(loss):
        loss.backward()

    if every_op:
        events, n = _collect(bar, lambda step: step(checked(*inputs, **kwargs)), loss_fn, backward)
        return _finding(name, events, n)

    plain = checked.original  # (a hardened model's own: its guards would hide what it makes)
    screen = _Screen(plain, name, inputs, kwargs)
    rng, kept = rng_state(), _buffers(plain)
    screen.before()
    prev = _fastpath.paused()  # (an outer hardened model's stand-ins would guard its calls)
    try:
        out = plain(*inputs, **kwargs)
    finally:
        _fastpath.resume(prev)
    outs = screen.outputs(out)
    if loss_fn is not None:
        loss = loss_fn(out)
        screen.loss(loss)
        if isinstance(loss, Tensor) and loss.requires_grad:
            screen.gradients(outs)
            try:
                loss.backward()
            finally:
                screen.done()
    found = screen.read()  # the one read
    looked = screen.looked_at()
    if not found:
        return Finding(name, None, None, [], _suggest(None), looked)
    saw = _saw(found)

    # the step again, with every call checked: the same inputs and random state, the buffers as
    # the step found them (its writes are put back after), and a backward that gives the
    # gradients without accumulating them into .grad a second time
    again = _Screen(plain, name, inputs, kwargs)

    def run(step):
        checked._check_again(inputs, kwargs, rng, None, step, kept=kept)

    def backward_once(loss):
        backward_again(loss, {0: torch.ones_like(loss)}, _leaves_of(plain, inputs, kwargs, loss))

    events, n = _collect(bar, run, loss_fn, backward_once, again)
    if events:
        return _finding(name, events, n, f"{looked}; {saw}")
    return _unnamed(name, found, again, saw, looked)


def _unnamed(name: str, found, again: _Screen, saw: str, looked: str) -> Finding:
    """A hit that the check at each op of the run again did not name: made by the loss code
    (which locate runs, but does not check at each op), made where no watched call is (the
    run again's screen sees it too), or not reproduced."""
    screen = f"{looked}; {saw}"
    still = again.read()  # (the run again's own screen: on this path only)
    loss = [s for what, s in found if what.startswith("the loss")]
    if loss and any(what.startswith("the loss") for what, _ in still):
        kind = "NaN" if NAN in loss else "Inf"
        event = Event("forward", kind, True, None,
                      f"nanpass: {kind} in the loss, made by loss_fn from finite outputs of {name} "
                      f"(the run again checked each op of the model and found every value it made "
                      f"finite); {saw}")
        return Finding(name, event, None, [], (
            "the loss code makes it: look at loss_fn's log, division or sqrt of the model's output "
            "(nanpass.enable checks code outside a model at each op)"), screen)
    phase = "backward" if all(what.startswith("the gradient") for what, _ in found) else "forward"
    if still:
        event = Event(phase, "NaN/Inf", False, None, (
            f"nanpass: {saw}; the run again made it too, with every call of {name} checked, and no "
            f"call made it: autograd's sum of the gradients that reach one value overflowed, or "
            f"an op nanpass does not watch made it (an extension kernel, an aten op called "
            f"directly)"))
        suggestion = _suggest(event)
    else:
        event = Event(phase, "NaN/Inf", False, None, (
            f"nanpass: {saw}, not reproduced: the step again from the same inputs, random state "
            f"and buffers, with a check at each op, made no NaN or Inf (a random draw from a "
            f"generator nanpass does not replay, a data-dependent kernel, or state the step "
            f"changed); nanpass.locate(..., every_op=True) checks each op of the step as it runs"))
        suggestion = ("not reproduced: run nanpass.locate(model, *inputs, loss_fn=..., "
                      "every_op=True), which checks each op of its one run, or draw the step's "
                      "random numbers from torch's default generator, which the run again replays")
    if phase == "forward":
        return Finding(name, event, None, [], suggestion, screen)
    return Finding(name, None, event, [], suggestion, screen)
