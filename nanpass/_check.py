"""Check mode: name the op where a NaN or an Inf is born, forward and backward.

In ``mode="check"`` the rewrite swaps every op of the rule table for a checker that runs the
original op and raises NonFiniteError at the first op whose result is NaN, or infinite from
finite operands (an intentional ``-inf`` mask flowing through is not an error). In backward,
the same op is named when its gradient turns non-finite while the gradient it received was
finite. ``mode="warn"`` warns instead of raising. Each check reads one flag back from the
device per op: a debugging mode, not one to train with.
"""

from __future__ import annotations

import warnings

import torch

from ._errors import NanpassError

Tensor = torch.Tensor


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


def _report(message: str, warn: bool) -> None:
    if warn:
        warnings.warn(message, NonFiniteWarning, stacklevel=3)
    else:
        raise NonFiniteError(message)


class _GradState:
    __slots__ = ("out_finite",)

    def __init__(self):
        self.out_finite = True


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
    def forward(ctx, x, state, where, index, warn):
        ctx.state, ctx.where, ctx.index, ctx.warn = state, where, index, warn
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.state.out_finite and not bool(torch.isfinite(grad).all()):
            _report(f"nanpass: non-finite gradient created by the backward of {ctx.where}, for "
                    f"operand {ctx.index} ({describe(grad)})", ctx.warn)
        return grad, None, None, None, None


def checked(fn, args, kwargs, where: str, warn: bool):
    """Run ``fn`` and check its result; wire the backward check when autograd is recording."""
    inputs = list(_float_tensors((*args, *kwargs.values())))
    state = _GradState()
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        args = tuple(_InGrad.apply(a, state, where, i, warn)
                     if isinstance(a, Tensor) and a.requires_grad else a for i, a in enumerate(args))
    out = fn(*args, **kwargs)
    outs = list(_float_tensors((out,)))
    bad_in = [i for i, t in enumerate(inputs) if not bool(torch.isfinite(t).all())]
    for o in outs:
        nan = bool(torch.isnan(o).any())
        inf = bool(torch.isinf(o).any())
        if nan or (inf and not bad_in):
            kind = "NaN" if nan else "Inf"
            fed = (f"operands {bad_in} were already non-finite" if bad_in else "every operand was finite")
            detail = "; ".join(f"operand {i}: {describe(t)}" for i, t in enumerate(inputs))
            _report(f"nanpass: {kind} created by {where}: {fed}; {detail}", warn)
            break
    if isinstance(out, Tensor) and out.requires_grad and torch.is_grad_enabled():
        out = _OutGrad.apply(out, state)
    return out


def check_input(t, name: str, warn: bool):
    """A NaN in the data is the data's, not the first op's."""
    if isinstance(t, Tensor) and t.is_floating_point() and bool(torch.isnan(t).any()):
        _report(f"nanpass: NaN in the input {name!r} ({describe(t)})", warn)
    return t


check_input.__module__ = "nanpass"
