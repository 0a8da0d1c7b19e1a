"""nanpass.certify in the dtype's own arithmetic: issue 21's counterexamples, one test each.

Each model here was PROVEN (or certified with an interval that misses the model's own output)
before the bounds followed float32's kernels: a Python constant is rounded as the kernel rounds
it, an inexact kernel may round past max, a variance carries the error of its rounded mean,
-0.0 is in every range that holds 0, and a result whose sign the kernel keeps keeps it.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanpass
from nanpass._certify import analyse, parse_ranges

F32 = torch.float32


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def f32(v: float) -> float:
    return float(torch.tensor(v, dtype=F32))


def out_box(model, x, ranges):
    _, boxes = analyse(model, (x,), parse_ranges(ranges, (x,)))
    return boxes[0]


def inside(box, y: torch.Tensor) -> bool:
    y = y.detach().to(torch.float64).expand_as(box.lo)
    return bool(((y >= box.lo) & (y <= box.hi) | (torch.isnan(y) & (box.nan > 0))).all())


# -- gelu's float32 tail ----------------------------------------------------------------------


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_tail_underflows_to_minus_zero(approximate):
    """float32 gelu(-6) is -0.0 (both forms): 1 / gelu(x) reaches -inf, log(-gelu(x)) -inf."""
    x = torch.full((2, 3), -6.0)
    assert F.gelu(x, approximate=approximate)[0, 0].item() == 0.0
    recip = Fn(lambda x: 1.0 / F.gelu(x, approximate=approximate))
    log = Fn(lambda x: torch.log(-F.gelu(x, approximate=approximate)))
    for m in (recip, log):
        assert not bool(torch.isfinite(m(x)).all())
        assert not nanpass.certify(m, torch.full((2, 3), -5.0), ranges=(-6, -4)).proven


# -- Python constants meet float32 tensors as float32 ----------------------------------------


@pytest.mark.parametrize("name,fn,c", [
    ("log", lambda x: torch.log(x + 1e-6), 1e-6),
    ("rsqrt", lambda x: torch.rsqrt(x + 1e-5), 1e-5),
])
def test_constant_rounded_into_float32(name, fn, c):
    """x + c with x = float32(-c) is 0 in float32 (c is float32(c) there), not 2.5e-13."""
    m = Fn(fn)
    lo = f32(-c)
    assert not bool(torch.isfinite(m(torch.full((3,), lo))).all())
    cert = nanpass.certify(m, torch.full((3,), 0.5), ranges=(lo, 1.0))
    assert not cert.proven, str(cert)


def test_scalar_base_pow_rounded_and_near_max():
    """torch.pow(1.1, x): the kernel's base is float32(1.1); at x = 930.885 the value is
    3.40282e38 (outside the old interval), one float further it is inf."""
    m = Fn(lambda x: torch.pow(1.1, x))
    x = torch.full((4,), 930.885)
    assert inside(out_box(m, x, (0.0, 930.885)), m(x))
    nxt = float(torch.nextafter(torch.tensor(930.885), torch.tensor(1e9)))
    assert not bool(torch.isfinite(m(torch.full((4,), nxt))).all())
    assert not nanpass.certify(m, x, ranges=(0.0, nxt)).proven


def test_hardened_rsqrt_output_inside_certified_interval():
    """harden(rsqrt(x + 1e-5)) at x = float32(-1e-5): the guard clamps 0 to tiny, 9.2e18."""
    m = nanpass.harden(Fn(lambda x: torch.rsqrt(x + 1e-5)))
    lo = f32(-1e-5)
    cert = nanpass.certify(m, torch.full((3,), 0.5), ranges=(lo, 1.0))
    assert cert.proven
    for v in (lo, 0.0, 1.0):
        x = torch.full((3,), v)
        assert inside(out_box(m, x, (lo, 1.0)), m(x)), (v, m(x), cert.outputs)


# -- float32 reductions -----------------------------------------------------------------------


def test_variance_carries_its_rounded_mean():
    """x in [88.72, 88.721]: float32's variance of [a, a, b, b] is 5.8e-5 above the exact
    one (cancellation around a rounded mean), so exp(var * c) overflows where the exact
    variance's bound said it would not."""
    a, b = f32(88.72), f32(88.721)
    exact_hi = (b - a) ** 2 / 3  # n span^2 / (4 (n - 1)) for n = 4
    c = 88.7228 / (exact_hi * (1 + 1e-5))
    m = Fn(lambda x: torch.exp(x.var(-1) * c))
    x = torch.tensor([a, a, b, b])
    assert not bool(torch.isfinite(m(x)).all())
    cert = nanpass.certify(m, x, ranges=(a, b))  # float32 bounds: no outward rounding
    assert not cert.proven, str(cert)


# -- signed zero ------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [lambda x: 1.0 / x, lambda x: x ** -0.5], ids=["recip", "pow_neg_half"])
def test_minus_zero_in_a_range_holding_zero(fn):
    """x in [0, 0] holds -0.0: 1 / -0.0 = -inf, and x ** -0.5 is rsqrt there (-inf)."""
    m = Fn(fn)
    assert m(torch.tensor([-0.0])).item() == -math.inf
    box = out_box(m, torch.zeros(3), (0.0, 0.0))
    assert float(box.lo.min()) == -math.inf and float(box.hi.max()) == math.inf


_SIGNED_ZERO_OPS = {
    "pow_neg_half": lambda x: x ** -0.5, "pow_neg_one_and_half": lambda x: torch.pow(x, -1.5),
    "pow_neg_three": lambda x: x.pow(-3), "pow_half": lambda x: x ** 0.5, "pow_one_and_half": lambda x: x ** 1.5,
    "rsqrt": torch.rsqrt, "sqrt": torch.sqrt, "log": torch.log, "reciprocal": torch.reciprocal,
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("lo,hi", [(-0.0, 1.0), (-0.0, -0.0), (-0.0, math.inf), (-math.inf, -0.0), (-math.inf, -1.0)])
@pytest.mark.parametrize("name", sorted(_SIGNED_ZERO_OPS))
def test_a_range_ending_at_minus_zero_or_minus_inf_holds_every_value(name, lo, hi, dtype):
    """Issue 28 item 6b: ``x ** -0.5`` over [-0, 1] was certified [-inf, -max] (the bound read
    rsqrt(-0.0) = -inf as the top of a decreasing function), which leaves out 1.0; and
    (-inf) ** -1.5 = 0 (C's pow), outside [max, inf]."""
    fn = _SIGNED_ZERO_OPS[name]
    m = Fn(fn)
    candidates = [lo, hi, -0.0, 0.0, 1e-30, 1e-3, 0.5, 1.0, -1.0, -2.0, math.inf, -math.inf]
    xs = torch.tensor([v for v in candidates if lo <= v <= hi], dtype=dtype)
    box = out_box(m, torch.full((4,), hi if math.isfinite(hi) else -1.0, dtype=dtype), (lo, hi))
    with torch.no_grad():
        ys = fn(xs).to(torch.float64)
    lo_b, hi_b, nan_b = float(box.lo.min()), float(box.hi.max()), float(box.nan.max())
    ok = ((ys >= lo_b) & (ys <= hi_b)) | (torch.isnan(ys) & (nan_b > 0))
    assert bool(ok.all()), (xs.tolist(), ys.tolist(), box.summary())


# -- relative allowances keep signs ---------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_rmsnorm_proven():
    """A mean of squares stays >= 0 after widening: rsqrt(mean + 1e-6) is finite."""
    cert = nanpass.certify(RMSNorm(), torch.zeros(2, 8), ranges=(-10, 10))
    assert cert.proven, str(cert)


@pytest.mark.parametrize("ranges", [(-100, 100), (-1e4, 1e4), "finite"])
def test_sqrt_softmax_proven(ranges):
    """A softmax stays in [0, 1] after widening: its sqrt is never NaN."""
    cert = nanpass.certify(Fn(lambda z: torch.sqrt(torch.softmax(z, -1))), torch.zeros(2, 4), ranges=ranges)
    assert cert.proven, str(cert)


# -- guards ---------------------------------------------------------------------------------


class ExpSum(nn.Module):
    def __init__(self, same_rows: bool):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        if same_rows:
            with torch.no_grad():
                self.lin.weight.copy_(self.lin.weight[:1].expand(4, 4))
                self.lin.bias.fill_(0.0)

    def forward(self, x):
        return torch.exp(self.lin(x)).sum()


def test_hardened_exp_sum_not_proven_where_it_overflows():
    """The exp guard keeps every finite exp(x) up to exp(88.71) = 3.37e38 (it only replaces an
    overflow by sat = max / 16): four outputs at 88.7 sum to inf in the hardened model too, so
    a certificate of [0, sat] per element would be unsound (see docs/certify.md)."""
    m = ExpSum(same_rows=True)
    h = nanpass.harden(m)
    w = m.lin.weight[0].detach().double()
    x = (88.7 / float(w @ w)) * w  # lin(x) = 88.7 for every output
    assert float(x.abs().max()) <= 100
    assert h(x.float()).item() == math.inf
    cert = nanpass.certify(h, torch.zeros(4), ranges=(-100, 100))
    assert not cert.proven and inside(out_box(h, torch.zeros(4), (-100, 100)), h(x.float()))
