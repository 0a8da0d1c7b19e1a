"""``nanpass.locate``: re-run one step in check mode and say where the first NaN came from."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch

from ._check import COLLECT, PROGRESS, Event
from ._rules import BY_NAME


@dataclass
class Finding:
    """The first non-finite value forward and backward, what it flowed through, and a fix."""

    model: str
    forward: Event | None
    backward: Event | None
    chain: list[Event]  # every checked op the bad value reached, in order
    suggestion: str

    def __str__(self) -> str:
        lines = [f"nanpass.locate: {self.model}"]
        if self.forward is None and self.backward is None:
            lines.append("  no NaN or Inf found, forward or backward (every call checked)")
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


def locate(model: torch.nn.Module, *inputs, loss_fn=None, progress: bool | None = None,
           **kwargs) -> Finding:
    """Re-run ``model(*inputs, **kwargs)`` (and ``loss_fn(output).backward()`` when given) with
    every unsafe op checked, and return a Finding instead of raising.

    >>> import torch, nanpass
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LogSoftmax(-1))
    >>> nanpass.locate(m, torch.tensor([[float("inf"), 0.0]])).forward.kind
    'NaN'
    """
    from ._harden import harden

    checked = harden(model, mode="check")
    bar = _Progress(sys.stderr.isatty() if progress is None else progress)
    events: list[Event] = []
    token, ptoken = COLLECT.set(events), PROGRESS.set(lambda: bar("forward"))
    try:
        out = checked(*inputs, **kwargs)
        forward = list(events)
        if loss_fn is not None:
            PROGRESS.set(lambda: bar("backward"))
            loss = loss_fn(out)
            # a loss that nothing requires a gradient of (a model with no parameters, a metric,
            # inputs that do not require grad) has no backward: the forward's finding stands
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                loss.backward()
    finally:
        COLLECT.reset(token)
        PROGRESS.reset(ptoken)
        if bar.enabled:
            print(file=sys.stderr)
    backward = events[len(forward):]
    first_fwd = next((e for e in forward if e.created or e.phase in ("input", "state")),
                     forward[0] if forward else None)
    # a backward NaN that a forward NaN explains is not a second finding
    first_bwd = next((e for e in backward if e.created), None)
    chain = forward[forward.index(first_fwd):] if first_fwd is not None else []
    return Finding(type(model).__name__, first_fwd, first_bwd, chain,
                   _suggest(first_fwd if first_fwd is not None else first_bwd))
