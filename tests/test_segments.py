"""Issue 48: reductions over groups that can be empty. ``torch.segment_reduce`` gives an empty
segment 0 / 0 (mean) or the identity of max/min (-+inf); guarded, it gives 0 there, as torch's
other reductions give an empty group, with a zero gradient, and every other segment keeps the
original's bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanpass
from tests.helpers import bits

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
REDUCTIONS = ("mean", "max", "min", "sum", "prod")


class Segments(nn.Module):
    def __init__(self, reduce: str, how: str, axis: int = 0, initial=None):
        super().__init__()
        self.reduce, self.how, self.axis, self.initial = reduce, how, axis, initial

    def forward(self, data, lengths):
        kw = {"initial": self.initial} if self.initial is not None else {}
        if self.how == "offsets":
            zero = torch.zeros(lengths.shape[:-1] + (1,), dtype=lengths.dtype)
            kw["offsets"] = torch.cat([zero, lengths.cumsum(-1)], -1)
        else:
            kw["lengths"] = lengths
        return torch.segment_reduce(data, self.reduce, axis=self.axis, **kw)


def _run(model, data, lengths):
    data = data.detach().clone().requires_grad_()
    out = model(data, lengths)
    (grad,) = torch.autograd.grad(out.float().sum(), data)
    return out, grad


def _routes(model):
    torch._dynamo.reset()
    return {"eager": nanpass.harden(model),
            "backend": torch.compile(model, backend=nanpass.backend(inner="aot_eager"))}


@pytest.mark.parametrize("how", ["lengths", "offsets"])
@pytest.mark.parametrize("reduce", REDUCTIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_an_empty_segment_gives_zero_and_every_other_segment_its_bits(dtype, reduce, how):
    data = torch.tensor([1.0, 2.0, 3.0, -4.0, 5.0], dtype=dtype)
    lengths = torch.tensor([2, 0, 3, 0])
    model = Segments(reduce, how)
    plain, plain_grad = _run(model, data, lengths)
    nonempty = lengths > 0
    for route, m in _routes(model).items():
        out, grad = _run(m, data, lengths)
        assert torch.isfinite(out).all() and torch.isfinite(grad).all(), route
        assert torch.equal(bits(out[nonempty]), bits(plain[nonempty])), route
        assert torch.equal(bits(grad), bits(plain_grad)), route  # no element has an empty segment
        want = plain[~nonempty] if reduce in ("sum", "prod") else torch.zeros(2, dtype=dtype)
        assert torch.equal(out[~nonempty], want), route  # 0, and a sum's 0 and a prod's 1 kept


@pytest.mark.parametrize("reduce", ["mean", "max"])
def test_initial_is_kept_on_an_empty_segment_and_a_nan_in_the_data_stays(reduce):
    data = torch.tensor([1.0, float("nan"), 3.0])
    lengths = torch.tensor([1, 0, 2])
    for route, m in _routes(Segments(reduce, "lengths", initial=7.0)).items():
        out = m(data, lengths)
        assert out[1] == 7.0, route
        assert torch.isnan(out[2]), route  # the data's NaN: not the guard's to hide
    for route, m in _routes(Segments(reduce, "lengths")).items():
        out = m(data, lengths)
        assert out[1] == 0.0 and torch.isnan(out[2]), route


def test_a_batched_segment_reduce_along_axis_one():
    data = torch.arange(12, dtype=torch.float32).reshape(2, 3, 2)
    lengths = torch.tensor([[3, 0], [1, 2]])
    model = Segments("mean", "lengths", axis=1)
    plain, plain_grad = _run(model, data, lengths)
    assert torch.isnan(plain[0, 1]).all()
    for route, m in _routes(model).items():
        out, grad = _run(m, data, lengths)
        assert torch.equal(out[0, 1], torch.zeros(2)), route
        assert torch.equal(out[lengths > 0], plain[lengths > 0]), route
        assert torch.equal(grad, plain_grad), route


def test_the_report_names_segment_reduce():
    model = nanpass.harden(Segments("mean", "lengths"))
    model(torch.ones(3), torch.tensor([3, 0]))
    assert [c.op for c in nanpass.report(model).changes if c.action == "guarded"] == ["segment_reduce"]
