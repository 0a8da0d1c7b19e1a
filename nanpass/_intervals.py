"""The interval domain of ``nanpass.certify`` and its transfer functions, one per aten op.

A ``Box`` is a per-element interval: ``lo`` and ``hi`` (float64 tensors of the value's shape)
and ``nan`` (a float64 0/1 tensor: 1 where the element may be NaN). Bounds are computed in
float64 and widened outward by the rounding error of the value's own dtype (``widen``), and a
bound past the dtype's ``max`` becomes infinite (the value may round to inf there), so a box
always contains every value the op can produce in that dtype for operands in the operand boxes.

A transfer function is ``f(box_of, args, kwargs, out) -> Box | list[Box | None] | None``:
``box_of(x)`` gives the box of an operand (a tensor or a Python number), ``out`` is the
concrete result (its dtype and shape). ``TRANSFER`` maps aten op names (the overload packet:
``"add"``, ``"_softmax"``) to them; an op missing from it is not modelled and the analysis
gives its result the full range and NaN (``top``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

Tensor = torch.Tensor
F64 = torch.float64
INF = math.inf


class Box:
    """Per-element [lo, hi] and a may-be-NaN flag. ``exact``: the box is a concrete value (the
    sign of each zero is known); an interval [0, 0] computed by a transfer function or given as
    a range holds -0.0 as well, so 1 / x there is -inf as well as +inf."""

    __slots__ = ("lo", "hi", "nan", "exact")

    def __init__(self, lo: Tensor, hi: Tensor, nan: Tensor | None = None, exact: bool = False):
        self.lo = lo
        self.hi = hi
        self.nan = torch.zeros_like(lo) if nan is None else nan
        self.exact = exact

    @staticmethod
    def point(t) -> Box:
        v = torch.as_tensor(t).detach()
        if v.is_complex():
            return top_like(v.real)
        v = v.to(F64)
        isnan = torch.isnan(v)
        lo = torch.where(isnan, -INF, v)
        hi = torch.where(isnan, INF, v)
        return Box(lo, hi, isnan.to(F64), exact=True)

    def is_point(self) -> bool:
        return bool((self.lo == self.hi).all()) and not bool(self.nan.any())

    def known(self) -> bool:
        """A single value, signed zeros included: the op's concrete result is its box."""
        return self.is_point() and (self.exact or not bool((self.lo == 0).any()))

    def finite(self) -> bool:
        return bool(torch.isfinite(self.lo).all() and torch.isfinite(self.hi).all()) and not bool(self.nan.any())

    def contains_zero(self) -> Tensor:
        return (self.lo <= 0) & (self.hi >= 0)

    def summary(self) -> str:
        if self.lo.numel() == 0:
            return "[] (empty)"
        lo, hi = float(self.lo.min()), float(self.hi.max())
        text = f"[{lo:.4g}, {hi:.4g}]"
        if bool(self.nan.any()):
            text += " and NaN"
        return text

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"Box{self.summary()}"


def top_like(t: Tensor, nan: bool = True) -> Box:
    shape = t.shape
    lo = torch.full(shape, -INF, dtype=F64)
    hi = torch.full(shape, INF, dtype=F64)
    if t.dtype == torch.bool:
        return Box(torch.zeros(shape, dtype=F64), torch.ones(shape, dtype=F64))
    floating = t.is_floating_point() or t.is_complex()
    return Box(lo, hi, torch.full(shape, 1.0 if (nan and floating) else 0.0, dtype=F64))


def hull_like(b: Box, t: Tensor) -> Box:
    """One interval for every element: the hull of ``b``, in ``t``'s shape."""
    shape = t.shape
    if b.lo.numel() == 0:
        return top_like(t)
    return Box(torch.full(shape, float(b.lo.min()), dtype=F64), torch.full(shape, float(b.hi.max()), dtype=F64),
               torch.full(shape, float(b.nan.max()), dtype=F64))


def join(a: Box, b: Box) -> Box:
    return Box(torch.minimum(a.lo, b.lo), torch.maximum(a.hi, b.hi), torch.maximum(a.nan, b.nan))


def _clean(lo: Tensor, hi: Tensor) -> tuple[Tensor, Tensor]:
    """A NaN bound (inf - inf, 0 * inf in the bound arithmetic) becomes the widest bound."""
    return torch.where(torch.isnan(lo), -INF, lo), torch.where(torch.isnan(hi), INF, hi)


def _eps(dtype: torch.dtype) -> tuple[float, float, float]:
    """(relative rounding error, absolute underflow error, max) of a floating dtype."""
    fi = torch.finfo(dtype)
    return float(fi.eps), float(fi.tiny), float(fi.max)


def widen(b: Box, dtype: torch.dtype, k: float = 2.0, n: int = 1, mag: Tensor | None = None,
          keep_sign: bool | Tensor = False) -> Box:
    """Outward rounding for a result in ``dtype``: ``k`` ulps relative (plus float64's own
    rounding), ``n`` accumulated roundings of a sum whose terms are bounded by ``mag``, the
    dtype's smallest normal absolute (underflow, flush to zero); past max becomes +-inf.

    A correctly rounded op (k <= 2, n = 1) never rounds an exact value at most max to inf; an
    op with a larger error (a transcendental kernel, a sum) may, once its error reaches max.
    ``keep_sign`` (True, or a per-element mask): the kernel keeps the exact result's sign (one
    rounding of the result, or a sum of terms of one sign), so a bound >= 0 stays >= 0 and a
    bound <= 0 stays <= 0 (a mean of squares is never negative)."""
    if dtype == torch.bool:
        return Box(b.lo.clamp(0, 1), b.hi.clamp(0, 1), torch.zeros_like(b.nan))
    lo, hi = _clean(b.lo, b.hi)
    if not dtype.is_floating_point:
        return Box(torch.floor(lo), torch.ceil(hi), torch.zeros_like(b.nan))
    eps, tiny, mx = _eps(dtype)
    rel = k * eps + 4 * torch.finfo(F64).eps
    err_lo = lo.abs() * rel + tiny
    err_hi = hi.abs() * rel + tiny
    if mag is not None:
        acc = (n + 1) * (eps + torch.finfo(F64).eps) * mag
        err_lo = err_lo + acc
        err_hi = err_hi + acc
    if k <= 2 and n <= 1 and mag is None:  # rounds to inf from max + half an ulp of max on
        half = 2.0 ** math.floor(math.log2(mx)) * eps / 2
        over_hi, over_lo = hi * (1 + 1e-15) >= mx + half, lo * (1 + 1e-15) <= -mx - half
    else:  # the kernel's error may carry a value within its error of max past it
        over_hi, over_lo = hi + err_hi > mx, lo - err_lo < -mx
    pos, neg = b.lo >= 0, b.hi <= 0
    lo_w = torch.where(torch.isfinite(lo), lo - err_lo, lo)
    hi_w = torch.where(torch.isfinite(hi), hi + err_hi, hi)
    if keep_sign is not False:
        lo_w = torch.where(pos & keep_sign, torch.maximum(lo_w, torch.zeros_like(lo_w)), lo_w)
        hi_w = torch.where(neg & keep_sign, torch.minimum(hi_w, torch.zeros_like(hi_w)), hi_w)
    lo = torch.where(over_lo, -INF, lo_w.clamp(min=-mx))
    hi = torch.where(over_hi, INF, hi_w.clamp(max=mx))
    lo = torch.where(lo > mx, mx, lo)  # a lower bound past max: the value may round to max
    hi = torch.where(hi < -mx, -mx, hi)
    return Box(lo, hi, b.nan)


def within(b: Box, lo: float = -INF, hi: float = INF) -> Box:
    """``b`` cut to an op's range that its kernel keeps by construction (sigmoid in [0, 1],
    a softmax in [0, 1], tanh in [-1, 1]): a widened bound never leaves it."""
    return Box(b.lo.clamp(lo, hi), b.hi.clamp(lo, hi), b.nan)


def rounded_operand(b: Box, dtype: torch.dtype) -> Box:
    """An operand the kernel converts into ``dtype`` first (a Python number, a 0-d float64
    tensor, an integer tensor): every value it may take, as given, in ``dtype`` and in float32
    (the compute type of float16 and bfloat16 kernels). ``x + 1e-6`` on float32 adds
    float32(1e-6) = 9.99999997e-07."""
    if not dtype.is_floating_point or dtype == F64:
        return b
    los, his = [b.lo], [b.hi]
    for dt in {dtype, torch.float32}:
        los.append(b.lo.to(dt).to(F64))
        his.append(b.hi.to(dt).to(F64))
    lo = torch.stack(los).amin(0)
    hi = torch.stack(his).amax(0)
    return Box(lo, hi, b.nan, exact=b.exact and bool((lo == b.lo).all() and (hi == b.hi).all()))


# ---------------------------------------------------------------------------------------------
# elementwise


def _bc(*boxes: Box) -> list[Box]:
    shape = torch.broadcast_shapes(*(b.lo.shape for b in boxes))
    return [Box(b.lo.expand(shape), b.hi.expand(shape), b.nan.expand(shape)) for b in boxes]


def add(a: Box, b: Box, alpha=1) -> Box:
    if alpha != 1:
        b = mul(b, Box.point(float(alpha)))
    a, b = _bc(a, b)
    nan = torch.maximum(a.nan, b.nan)
    nan = torch.maximum(nan, (((a.lo == -INF) & (b.hi == INF)) | ((a.hi == INF) & (b.lo == -INF))).to(F64))
    lo, hi = _clean(a.lo + b.lo, a.hi + b.hi)
    return Box(lo, hi, nan)


def neg(a: Box) -> Box:
    return Box(-a.hi, -a.lo, a.nan)


def sub(a: Box, b: Box, alpha=1) -> Box:
    return add(a, neg(b), alpha)


def _has_inf(b: Box) -> Tensor:
    return (b.lo == -INF) | (b.hi == INF)


def mul(a: Box, b: Box) -> Box:
    a, b = _bc(a, b)
    corners = torch.stack([a.lo * b.lo, a.lo * b.hi, a.hi * b.lo, a.hi * b.hi])
    corners = torch.nan_to_num(corners, nan=0.0, posinf=INF, neginf=-INF)  # 0 * inf: the NaN is flagged
    nan = torch.maximum(a.nan, b.nan)
    nan = torch.maximum(nan, ((a.contains_zero() & _has_inf(b)) | (b.contains_zero() & _has_inf(a))).to(F64))
    return Box(corners.amin(0), corners.amax(0), nan)


def reciprocal(b: Box) -> Box:
    z = b.contains_zero()  # either sign: a zero may be -0.0 (x * 0 for x < 0), and 1 / -0.0 = -inf
    lo = torch.where(z, -INF, 1.0 / b.hi)
    hi = torch.where(z, INF, 1.0 / b.lo)
    lo, hi = _clean(lo, hi)
    return Box(torch.minimum(lo, hi), torch.maximum(lo, hi), b.nan)


def div(a: Box, b: Box, rounding_mode=None) -> Box:
    a, b = _bc(a, b)
    z = b.contains_zero()
    r = b if not bool(z.any()) else b
    q = mul(a, reciprocal(r))
    # where the divisor excludes 0, the quotient's corners are exact: recompute them directly
    corners = torch.stack([a.lo / b.lo, a.lo / b.hi, a.hi / b.lo, a.hi / b.hi])
    finite_corners = ~torch.isnan(corners).any(0)
    lo = torch.where(~z & finite_corners, corners.amin(0), q.lo)
    hi = torch.where(~z & finite_corners, corners.amax(0), q.hi)
    nan = torch.maximum(a.nan, b.nan)
    nan = torch.maximum(nan, ((z & a.contains_zero()) | (_has_inf(a) & _has_inf(b))).to(F64))
    lo, hi = _clean(lo, hi)
    if rounding_mode == "floor":
        lo, hi = torch.floor(lo), torch.floor(hi)
    elif rounding_mode == "trunc":
        lo, hi = torch.trunc(lo), torch.trunc(hi)
    return Box(lo, hi, nan)


def monotone(a: Box, f: Callable, lo_dom: float = -INF, hi_dom: float = INF, decreasing: bool = False,
             open_lo: bool = False, open_hi: bool = False) -> Box:
    """f on [lo_dom, hi_dom] (NaN outside; an open end is in the domain but f is inf there)."""
    nan = torch.maximum(a.nan, ((a.lo < lo_dom) | (a.hi > hi_dom)).to(F64))
    lo = a.lo.clamp(lo_dom, hi_dom) + 0.0  # + 0.0 reads -0.0 as +0.0: a sign of zero that matters
    hi = a.hi.clamp(lo_dom, hi_dom) + 0.0  # (rsqrt(-0.0) = -inf) is the caller's to add
    empty = (a.hi < lo_dom) | (a.lo > hi_dom)
    flo, fhi = f(lo), f(hi)
    if decreasing:
        flo, fhi = fhi, flo
    flo, fhi = _clean(flo, fhi)
    flo = torch.where(empty, INF, flo)  # only NaN: an empty range of values
    fhi = torch.where(empty, -INF, fhi)
    return Box(flo, fhi, nan)


def with_min(a: Box, f: Callable, xmin: float, fmin: float, nan_at_neg_inf: bool = False) -> Box:
    """A function decreasing up to ``xmin`` (where it is ``fmin``), increasing after
    (``nan_at_neg_inf``: x * g(x) with g(-inf) = 0, as gelu and silu, is NaN at -inf)."""
    flo, fhi = f(a.lo), f(a.hi)
    lo = torch.minimum(flo, fhi)
    lo = torch.where((a.lo <= xmin) & (a.hi >= xmin), torch.full_like(lo, fmin), lo)
    lo, hi = _clean(lo, torch.maximum(flo, fhi))
    nan = torch.maximum(a.nan, (a.lo == -INF).to(F64)) if nan_at_neg_inf else a.nan
    return Box(lo, hi, nan)


def clamp(a: Box, lo=None, hi=None) -> Box:
    """torch.clamp: NaN stays NaN; bounds are numbers or boxes."""
    out = a
    if lo is not None:
        lb = lo if isinstance(lo, Box) else Box.point(float(lo))
        out, lb = _bc(out, lb)
        out = Box(torch.maximum(out.lo, lb.lo), torch.maximum(out.hi, lb.hi), torch.maximum(out.nan, lb.nan))
    if hi is not None:
        hb = hi if isinstance(hi, Box) else Box.point(float(hi))
        out, hb = _bc(out, hb)
        out = Box(torch.minimum(out.lo, hb.lo), torch.minimum(out.hi, hb.hi), torch.maximum(out.nan, hb.nan))
    return out


def maximum(a: Box, b: Box) -> Box:
    a, b = _bc(a, b)
    return Box(torch.maximum(a.lo, b.lo), torch.maximum(a.hi, b.hi), torch.maximum(a.nan, b.nan))


def minimum(a: Box, b: Box) -> Box:
    a, b = _bc(a, b)
    return Box(torch.minimum(a.lo, b.lo), torch.minimum(a.hi, b.hi), torch.maximum(a.nan, b.nan))


def absolute(a: Box) -> Box:
    lo = torch.where(a.contains_zero(), torch.zeros_like(a.lo), torch.minimum(a.lo.abs(), a.hi.abs()))
    return Box(lo, torch.maximum(a.lo.abs(), a.hi.abs()), a.nan)


def where(c: Box, a: Box, b: Box) -> Box:
    c, a, b = _bc(c, a, b)
    true = c.lo >= 1  # certainly true
    false = c.hi <= 0  # certainly false
    j = join(a, b)
    lo = torch.where(true, a.lo, torch.where(false, b.lo, j.lo))
    hi = torch.where(true, a.hi, torch.where(false, b.hi, j.hi))
    nan = torch.where(true, a.nan, torch.where(false, b.nan, j.nan))
    return Box(lo, hi, nan)


def powi(a: Box, p: float) -> Box:
    """x ** p for a number p."""
    if p == 0:
        return Box(torch.ones_like(a.lo), torch.ones_like(a.lo))  # NaN ** 0 == 1
    if p == 1:
        return a
    if float(p).is_integer():
        n = int(p)
        if n > 0:
            if n % 2:
                return monotone(a, lambda t: t.pow(n))
            return with_min(a, lambda t: t.pow(n), 0.0, 0.0)
        # a negative integer power: 1 / x ** |n|
        return reciprocal(powi(a, -n))
    # fractional: NaN below 0, except at -inf (C's pow: (-inf) ** p is inf for p > 0, 0 for p < 0)
    # and at -0.0, which monotone reads as +0.0: (-0.0) ** -1.5 is +inf
    r = monotone(a, lambda t: t.pow(p), lo_dom=0.0, decreasing=p < 0)
    only_neg_inf = a.hi == -INF
    nan = torch.where(only_neg_inf, a.nan, torch.maximum(a.nan, (a.lo < 0).to(F64)))
    at_neg_inf = a.lo == -INF
    lo = torch.where(at_neg_inf, torch.minimum(r.lo, torch.full_like(r.lo, 0.0 if p < 0 else INF)), r.lo)
    hi = torch.where(at_neg_inf, torch.maximum(r.hi, torch.full_like(r.hi, 0.0 if p < 0 else INF)), r.hi)
    if p == -0.5:  # torch may compute x ** -0.5 as rsqrt, and rsqrt(-0.0) = -inf
        lo = torch.where(a.contains_zero(), -INF, lo)
    return Box(lo, hi, nan)


def powi_rounded(a: Box, p: float, dtype: torch.dtype) -> Box:
    """x ** p where the kernel may use p as given or rounded into ``dtype``/float32 (1.1 is
    1.10000002 in float32): the hull of both."""
    r = powi(a, p)
    for dt in {dtype, torch.float32} if dtype.is_floating_point and dtype != F64 else ():
        q = float(torch.tensor(p, dtype=F64).to(dt))
        if q != p and math.isfinite(q):
            r = join(r, powi(a, q))
    return r


def exp_box(a: Box) -> Box:
    return monotone(a, torch.exp)


def log_box(a: Box) -> Box:
    return monotone(a, torch.log, lo_dom=0.0)


def pow_tensor(a: Box, b: Box) -> Box:
    """x ** y for tensors: exp(y log x) where x > 0, else the full range."""
    a, b = _bc(a, b)
    pos = a.lo > 0
    r = exp_box(mul(b, log_box(Box(a.lo.clamp_min(torch.finfo(F64).tiny), a.hi, a.nan))))
    top = top_like(a.lo)
    lo = torch.where(pos, r.lo, top.lo)
    hi = torch.where(pos, r.hi, top.hi)
    nan = torch.where(pos, torch.maximum(r.nan, b.nan), top.nan)
    # y == 0 everywhere: 1
    one = (b.lo == 0) & (b.hi == 0) & (b.nan == 0)
    return Box(torch.where(one, 1.0, lo), torch.where(one, 1.0, hi), torch.where(one, 0.0, nan))


def nan_to_num(a: Box, dtype: torch.dtype, nan=0.0, posinf=None, neginf=None) -> Box:
    mx = float(torch.finfo(dtype).max)
    nan = 0.0 if nan is None else float(nan)
    posinf = mx if posinf is None else float(posinf)
    neginf = -mx if neginf is None else float(neginf)
    flo = a.lo.clamp(min=-mx)
    fhi = a.hi.clamp(max=mx)
    has_finite = (flo <= fhi) & (a.lo < INF) & (a.hi > -INF)
    lo = torch.where(has_finite, flo, INF)
    hi = torch.where(has_finite, fhi, -INF)
    pinf, ninf, isn = a.hi == INF, a.lo == -INF, a.nan > 0
    lo = torch.where(pinf, torch.minimum(lo, torch.full_like(lo, posinf)), lo)
    hi = torch.where(pinf, torch.maximum(hi, torch.full_like(hi, posinf)), hi)
    lo = torch.where(ninf, torch.minimum(lo, torch.full_like(lo, neginf)), lo)
    hi = torch.where(ninf, torch.maximum(hi, torch.full_like(hi, neginf)), hi)
    lo = torch.where(isn, torch.minimum(lo, torch.full_like(lo, nan)), lo)
    hi = torch.where(isn, torch.maximum(hi, torch.full_like(hi, nan)), hi)
    return Box(lo, hi)


def compare(a: Box, b: Box, op: str) -> Box:
    """A bool box: [1, 1] where certainly true, [0, 0] where certainly false."""
    a, b = _bc(a, b)
    anynan = torch.maximum(a.nan, b.nan) > 0
    if op in ("lt", "gt"):
        if op == "gt":
            a, b = b, a
        true = a.hi < b.lo
        false = a.lo >= b.hi
    elif op in ("le", "ge"):
        if op == "ge":
            a, b = b, a
        true = a.hi <= b.lo
        false = a.lo > b.hi
    elif op == "eq":
        true = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
        false = (a.hi < b.lo) | (a.lo > b.hi)
    else:  # ne
        true = (a.hi < b.lo) | (a.lo > b.hi)
        false = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    if op == "ne":
        false = false & ~anynan  # NaN != x is True
    else:
        true = true & ~anynan  # a comparison with NaN is False
    lo = true.to(F64)
    hi = (~false).to(F64)
    return Box(lo, hi)


# ---------------------------------------------------------------------------------------------
# reductions


def _dims(x: Tensor, dim) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    return [d % max(x.dim(), 1) for d in dim]


def _count(x: Tensor, dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= x.shape[d] if x.dim() else 1
    return n


def _red(t: Tensor, dims, keepdim, f) -> Tensor:
    if t.dim() == 0:
        return t
    return f(t, dim=dims, keepdim=keepdim)


def sum_box(a: Box, dim=None, keepdim=False) -> tuple[Box, int, Tensor]:
    """(sum box, number of terms, magnitude bound of the sum of |terms|)."""
    dims = _dims(a.lo, dim)
    n = _count(a.lo, dims)
    lo = _red(a.lo, dims, keepdim, torch.sum)
    hi = _red(a.hi, dims, keepdim, torch.sum)
    neg_inf = _red((a.lo == -INF).to(F64), dims, keepdim, torch.amax) if a.lo.numel() else lo
    pos_inf = _red((a.hi == INF).to(F64), dims, keepdim, torch.amax) if a.lo.numel() else hi
    nan = _red(a.nan, dims, keepdim, torch.amax) if a.lo.numel() else torch.zeros_like(lo)
    nan = torch.maximum(nan, neg_inf * pos_inf)
    mag = _red(torch.maximum(a.lo.abs(), a.hi.abs()), dims, keepdim, torch.sum)
    lo, hi = _clean(lo, hi)
    return Box(lo, hi, nan), n, mag


def amax_box(a: Box, dim=None, keepdim=False, f=torch.amax) -> Box:
    dims = _dims(a.lo, dim)
    lo = _red(a.lo, dims, keepdim, f)
    hi = _red(a.hi, dims, keepdim, f)
    nan = _red(a.nan, dims, keepdim, torch.amax)
    return Box(lo, hi, nan)


def logsumexp_box(a: Box, dim, keepdim=False) -> Box:
    dims = _dims(a.lo, dim)
    lo = _red(a.lo, dims, keepdim, torch.logsumexp)
    hi = _red(a.hi, dims, keepdim, torch.logsumexp)
    nan = _red(a.nan, dims, keepdim, torch.amax)
    lo, hi = _clean(lo, hi)
    return Box(lo, hi, nan)


def var_box(a: Box, dim=None, correction=1, keepdim=False, dtype: torch.dtype = F64) -> Box:
    """sum((x - m')^2) / (n - correction) with m' the mean as the kernel rounds it: m' = m + d,
    |d| <= (n + 1) eps max|x|, and sum((x - m')^2) = sum((x - m)^2) + n d^2 <= n span^2 / 4 + n d^2
    (x near 88.72 with a spread of 1e-3: d^2 is 6e-5 of the variance in float32)."""
    dims = _dims(a.lo, dim)
    n = _count(a.lo, dims)
    span = _red(a.hi, dims, keepdim, torch.amax) - _red(a.lo, dims, keepdim, torch.amin)
    m = _red(torch.maximum(a.lo.abs(), a.hi.abs()), dims, keepdim, torch.amax)
    d = (n + 1) * (_eps(dtype)[0] if dtype.is_floating_point else 0.0) * m
    nan = _red(a.nan, dims, keepdim, torch.amax)
    nan = torch.maximum(nan, torch.isnan(span).to(F64))
    dof = n - correction
    if dof <= 0:
        return Box(torch.zeros_like(span), torch.full_like(span, INF), torch.ones_like(span))
    hi = (span.square() * n / 4 + n * d.square()) / dof if n > 1 else torch.zeros_like(span)
    hi = torch.where(torch.isnan(hi), INF, hi)
    nan = torch.maximum(nan, (span == INF).to(F64))
    return Box(torch.zeros_like(hi), hi, nan)


def softmax_box(a: Box, dim: int, log: bool = False, masked_rows: bool = False) -> Box:
    """softmax / log_softmax along ``dim``. A row may be NaN if all of it may be -inf, if an
    element may be +inf, or if an element may be NaN. ``masked_rows``: inside nanpass's
    softmax guard, which moves exactly those rows and entries before the op (only NaN is left)."""
    d = dim % max(a.lo.dim(), 1)
    row_nan = a.nan.amax(d, keepdim=True)
    all_ninf = (a.lo == -INF).all(d, keepdim=True)  # every element may be -inf at once
    pinf = (a.hi == INF).any(d, keepdim=True)
    bad = (row_nan > 0) if masked_rows else (row_nan > 0) | all_ninf | pinf
    nan = torch.maximum(a.nan, bad.to(F64).expand_as(a.lo))
    lse_hi = torch.logsumexp(a.hi, d, keepdim=True)
    lse_lo = torch.logsumexp(a.lo, d, keepdim=True)
    lo = a.lo - lse_hi  # log_softmax_i >= x_i.lo - lse(hi)
    hi = a.hi - lse_lo
    lo, hi = _clean(lo, hi)
    hi = hi.clamp(max=0.0)
    if log:
        return Box(torch.where(bad, -INF, lo), torch.where(bad, 0.0, hi), nan)
    elo, ehi = torch.exp(lo).clamp(0, 1), torch.exp(hi).clamp(0, 1)
    return Box(torch.where(bad, 0.0, elo), torch.where(bad, 1.0, ehi), nan)


def matmul_box(a: Box, b: Box, dtype: torch.dtype) -> Box:
    """a @ b by midpoint-radius (sound for finite bounds), plus the dtype's accumulated rounding."""
    n = a.lo.shape[-1]
    if not (a.finite() and b.finite()):
        shape = torch.matmul(a.lo, b.lo).shape
        bad = torch.ones(shape, dtype=F64)
        return Box(torch.full(shape, -INF, dtype=F64), torch.full(shape, INF, dtype=F64), bad)
    am, ar = (a.lo + a.hi) / 2, (a.hi - a.lo) / 2
    bm, br = (b.lo + b.hi) / 2, (b.hi - b.lo) / 2
    mid = am @ bm
    a_point, b_point = not bool(ar.any()), not bool(br.any())  # weights are points: fewer products
    rad = torch.zeros_like(mid)
    if not b_point:
        rad = rad + am.abs() @ br
    if not a_point:
        rad = rad + ar @ bm.abs()
    if not (a_point or b_point):
        rad = rad + ar @ br
    mag = (am.abs() + ar) @ (bm.abs() + br)
    return widen(Box(mid - rad, mid + rad, _overflow_nan(mag, dtype)), dtype, k=2, n=n, mag=mag)


def _overflow_nan(mag: Tensor, dtype: torch.dtype) -> Tensor:
    """A sum whose terms' magnitudes add up past max may hold +inf and -inf partial sums: NaN."""
    if not dtype.is_floating_point:
        return torch.zeros_like(mag)
    return (mag * (1 + 1e-3) >= float(torch.finfo(dtype).max)).to(F64)


def layer_norm_box(x: Box, normalized_shape, w: Box | None, b: Box | None, eps: float,
                   dtype: torch.dtype) -> tuple[Box, Box, Box]:
    """(y, mean, rstd) of native_layer_norm: |x_i - mean| / sqrt(var + eps) <= sqrt(N)."""
    k = len(normalized_shape)
    dims = list(range(x.lo.dim() - k, x.lo.dim()))
    n = _count(x.lo, dims)
    mx = float(torch.finfo(dtype).max)
    eps_d = float(torch.tensor(eps, dtype=dtype))  # eps as the dtype rounds it (1e-12 is 0 in float16)
    m = float(max(x.lo.abs().max(), x.hi.abs().max())) if x.lo.numel() else 0.0
    row_nan = x.nan.amax(dims, keepdim=True) if x.lo.numel() else x.nan
    ok = (eps_d > 0) and math.isfinite(m) and (2 * m) ** 2 * n * 4 < mx
    root = math.sqrt(n) * (1 + 1e-3)
    shape = x.lo.shape
    y = Box(torch.full(shape, -root, dtype=F64), torch.full(shape, root, dtype=F64),
            torch.maximum(x.nan, row_nan.expand(shape)))
    if not ok:
        y = Box(torch.full(shape, -INF, dtype=F64), torch.full(shape, INF, dtype=F64), torch.ones(shape, dtype=F64))
    if w is not None:
        y = mul(y, w)
    if b is not None:
        y = add(y, b)
    mean = Box(x.lo.amin(dims, keepdim=True), x.hi.amax(dims, keepdim=True),
               row_nan if ok else torch.ones_like(row_nan))  # inf - inf, or a sum past max
    if ok:
        big = (2 * m) ** 2 + eps_d
        rstd = Box(torch.full_like(mean.lo, 1 / math.sqrt(big * 1.01)), torch.full_like(mean.lo, 1.01 / math.sqrt(eps_d)),
                   row_nan)
    else:
        rstd = Box(torch.zeros_like(mean.lo), torch.full_like(mean.lo, INF), torch.ones_like(mean.lo))
    return y, mean, rstd


# ---------------------------------------------------------------------------------------------
# the table: aten op name -> transfer function

TRANSFER: dict[str, Callable] = {}
# ops whose result only moves, copies or selects elements (or fills constants): applying the op
# itself to lo, hi and nan is exact
STRUCTURAL = {
    "view", "_unsafe_view", "reshape", "expand", "permute", "transpose", "t", "squeeze", "unsqueeze",
    "flatten", "contiguous", "clone", "alias", "select", "slice", "narrow", "unfold", "diagonal",
    "movedim", "repeat", "flip", "roll", "tril", "triu", "split", "split_with_sizes", "unbind",
    "chunk", "cat", "stack", "detach", "lift_fresh", "lift_fresh_copy", "expand_copy", "view_copy",
    "permute_copy", "t_copy", "slice_copy", "select_copy", "squeeze_copy", "unsqueeze_copy",
    "transpose_copy", "_reshape_alias", "diag_embed", "diag", "tile", "broadcast_to", "select_scatter",
    "slice_scatter", "diagonal_scatter", "pixel_shuffle", "pixel_unshuffle", "channel_shuffle",
    "view_as", "expand_as", "reshape_as", "unflatten", "swapaxes", "swapdims", "_unsafe_split",
    "hstack", "vstack", "column_stack", "split_copy", "unbind_copy", "alias_copy", "as_strided_scatter",
    "repeat_interleave", "im2col", "hsplit", "vsplit", "tensor_split", "rot90", "fliplr", "flipud",
    "_conj", "resolve_conj", "resolve_neg", "positive", "new_empty_strided",
    "reflection_pad1d", "reflection_pad2d", "reflection_pad3d", "replication_pad1d", "replication_pad2d",
    "replication_pad3d", "_pad_circular", "col2im_off",
}
# selections by an index operand: exact when the index is known (a point), else the hull
INDEXED = {"index_select": (2,), "gather": (2,), "index": (1,), "embedding": (1,), "take": (1,),
           "take_along_dim": (1,), "scatter": (2,), "index_put": (1,), "_index_put_impl": (1,),
           "index_copy": (2,), "masked_scatter": (1,), "index_add": (2,), "scatter_add": (2,),
           "index_fill": (2,)}


def _arg(args, kwargs, i, name, default=None):
    if len(args) > i:
        return args[i]
    return kwargs.get(name, default)


def _map_tensors(obj, f):
    if isinstance(obj, Tensor):
        return f(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(o, f) for o in obj)
    return obj


def _outs(out) -> list:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def structural(bx, func, args, kwargs, out, fill_args=None, index_ids=frozenset()) -> list:
    """Run the op itself on lo, hi and nan (exact for ops that only move elements).
    ``index_ids``: the operands that are indices (their point values in every pass)."""
    boxes = {}

    def part(which):
        def f(t):
            b = boxes.get(id(t))
            if b is None:
                b = boxes[id(t)] = bx(t)
            if id(t) in index_ids:
                return b.lo.to(t.dtype).contiguous()  # an index: its (point) values
            if which == "nan" or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                return getattr(b, which).to(F64).contiguous()
            return getattr(b, which).to(t.dtype).contiguous()
        return f

    res = {}
    for which in ("lo", "hi", "nan"):
        a = _map_tensors(args, part(which))
        kw = {k: _map_tensors(v, part(which)) for k, v in kwargs.items()}
        kw.pop("dtype", None)
        kw.pop("memory_format", None)
        if which == "nan" and fill_args is not None:
            a = fill_args(a)
        r = func(*a, **kw)
        res[which] = _outs(r)
    exact = all(b is not None and b.exact for b in boxes.values())  # moved constants stay known
    return [Box(lo.to(F64), hi.to(F64), nan.to(F64), exact) if isinstance(lo, Tensor) else None
            for lo, hi, nan in zip(res["lo"], res["hi"], res["nan"], strict=True)]


def _unary(f: Callable, **kw) -> Callable:
    def t(bx, args, kwargs, out):
        return monotone(bx(args[0]), f, **kw)
    return t


def _reg(*names):
    def deco(f):
        for n in names:
            TRANSFER[n] = f
        return f
    return deco


# elementwise arithmetic
_reg("add")(lambda bx, a, k, o: add(bx(a[0]), bx(a[1]), _arg(a, k, 2, "alpha", 1)))
_reg("sub")(lambda bx, a, k, o: sub(bx(a[0]), bx(a[1]), _arg(a, k, 2, "alpha", 1)))
_reg("rsub")(lambda bx, a, k, o: sub(bx(a[1]), bx(a[0]), _arg(a, k, 2, "alpha", 1)))
_reg("mul")(lambda bx, a, k, o: mul(bx(a[0]), bx(a[1])))
_reg("div")(lambda bx, a, k, o: div(bx(a[0]), bx(a[1]), k.get("rounding_mode")))
_reg("true_divide")(lambda bx, a, k, o: div(bx(a[0]), bx(a[1])))
_reg("floor_divide")(lambda bx, a, k, o: div(bx(a[0]), bx(a[1]), "floor"))
_reg("neg")(lambda bx, a, k, o: neg(bx(a[0])))
_reg("reciprocal")(lambda bx, a, k, o: reciprocal(bx(a[0])))
_reg("abs")(lambda bx, a, k, o: absolute(bx(a[0])))
_reg("square")(lambda bx, a, k, o: powi(bx(a[0]), 2))
_reg("relu")(lambda bx, a, k, o: clamp(bx(a[0]), 0.0))
# bounds through bx: a number bound is the kernel's (clamp(x, 1e-6) in float32 is float32(1e-6))
_reg("clamp", "clip")(lambda bx, a, k, o: clamp(
    bx(a[0]), *[None if v is None else bx(v) for v in (_arg(a, k, 1, "min"), _arg(a, k, 2, "max"))]))
_reg("clamp_min")(lambda bx, a, k, o: clamp(bx(a[0]), bx(a[1])))
_reg("clamp_max")(lambda bx, a, k, o: clamp(bx(a[0]), None, bx(a[1])))
_reg("hardtanh")(lambda bx, a, k, o: clamp(bx(a[0]), bx(_arg(a, k, 1, "min_val", -1.0)), bx(_arg(a, k, 2, "max_val", 1.0))))
_reg("maximum", "fmax", "max.other")(lambda bx, a, k, o: maximum(bx(a[0]), bx(a[1])))
_reg("minimum", "fmin")(lambda bx, a, k, o: minimum(bx(a[0]), bx(a[1])))
_reg("where")(lambda bx, a, k, o: where(bx(a[0]), bx(a[1]), bx(a[2])))
_reg("masked_fill")(lambda bx, a, k, o: where(bx(a[1]), bx(a[2]), bx(a[0])))
_reg("lerp")(lambda bx, a, k, o: add(bx(a[0]), mul(bx(a[2]), sub(bx(a[1]), bx(a[0])))))
_reg("addcmul")(lambda bx, a, k, o: add(bx(a[0]), mul(mul(bx(a[1]), bx(a[2])), Box.point(float(k.get("value", 1))))))
_reg("addcdiv")(lambda bx, a, k, o: add(bx(a[0]), mul(div(bx(a[1]), bx(a[2])), Box.point(float(k.get("value", 1))))))
_reg("sign", "sgn")(lambda bx, a, k, o: clamp(monotone(bx(a[0]), torch.sign), -1, 1))
for _n, _f in (("floor", torch.floor), ("ceil", torch.ceil), ("round", torch.round), ("trunc", torch.trunc),
               ("exp", torch.exp), ("exp2", torch.exp2), ("expm1", torch.expm1), ("sigmoid", torch.sigmoid),
               ("tanh", torch.tanh), ("erf", torch.erf), ("atan", torch.atan), ("asinh", torch.asinh),
               ("sinh", torch.sinh), ("softplus", torch.nn.functional.softplus), ("log_sigmoid_forward", None),
               ("hardsigmoid", torch.nn.functional.hardsigmoid), ("relu6", torch.nn.functional.relu6),
               ("leaky_relu", None), ("elu", None), ("erfc", None)):
    if _f is not None:
        TRANSFER[_n] = _unary(_f)
TRANSFER["erfc"] = _unary(torch.erfc, decreasing=True)


def _erf(bx, a, k, o):
    """The CPU's vectorised erf (1 - t * exp(-x^2), in float32 for the half dtypes) is off by
    about float32's eps absolutely, not by ulps: bfloat16 erf(1e-15) is 0."""
    r = monotone(bx(a[0]), torch.erf)
    slack = 8 * max(float(torch.finfo(torch.float32).eps), float(torch.finfo(o.dtype).eps))
    return Box((r.lo - slack).clamp(min=-1.0), (r.hi + slack).clamp(max=1.0), r.nan)


TRANSFER["erf"] = _erf
TRANSFER["leaky_relu"] = lambda bx, a, k, o: monotone(bx(a[0]), lambda t: torch.nn.functional.leaky_relu(t, float(_arg(a, k, 1, "negative_slope", 0.01)))) if float(_arg(a, k, 1, "negative_slope", 0.01)) >= 0 else None  # noqa: E501
TRANSFER["elu"] = lambda bx, a, k, o: monotone(bx(a[0]), torch.nn.functional.elu) if len(a) < 2 or a[1] == 1 else None
TRANSFER["log_sigmoid_forward"] = lambda bx, a, k, o: [monotone(bx(a[0]), torch.nn.functional.logsigmoid), top_like(o[1])]
TRANSFER["log"] = _unary(torch.log, lo_dom=0.0)
TRANSFER["log2"] = _unary(torch.log2, lo_dom=0.0)
TRANSFER["log10"] = _unary(torch.log10, lo_dom=0.0)
TRANSFER["log1p"] = _unary(torch.log1p, lo_dom=-1.0)
TRANSFER["sqrt"] = _unary(torch.sqrt, lo_dom=0.0)
_rsqrt = _unary(torch.rsqrt, lo_dom=0.0, decreasing=True)


def _rsqrt_signed(bx, a, k, o):
    r = _rsqrt(bx, a, k, o)
    x = bx(a[0])
    return Box(torch.where(x.contains_zero(), -INF, r.lo), r.hi, r.nan)  # rsqrt(-0.0) = -inf


TRANSFER["rsqrt"] = _rsqrt_signed
TRANSFER["acos"] = _unary(torch.acos, lo_dom=-1.0, hi_dom=1.0, decreasing=True)
TRANSFER["asin"] = _unary(torch.asin, lo_dom=-1.0, hi_dom=1.0)
TRANSFER["atanh"] = _unary(torch.atanh, lo_dom=-1.0, hi_dom=1.0)
TRANSFER["erfinv"] = _unary(torch.erfinv, lo_dom=-1.0, hi_dom=1.0)
TRANSFER["acosh"] = _unary(torch.acosh, lo_dom=1.0)
TRANSFER["logit"] = lambda bx, a, k, o: monotone(
    bx(a[0]) if _arg(a, k, 1, "eps") is None else clamp(bx(a[0]), a[1], 1 - a[1]), torch.logit, lo_dom=0.0, hi_dom=1.0)
TRANSFER["sin"] = TRANSFER["cos"] = lambda bx, a, k, o: Box(
    torch.full(o.shape, -1.0, dtype=F64), torch.full(o.shape, 1.0, dtype=F64),
    torch.maximum(bx(a[0]).nan, _has_inf(bx(a[0])).to(F64)).expand(o.shape))
TRANSFER["cosh"] = lambda bx, a, k, o: with_min(bx(a[0]), torch.cosh, 0.0, 1.0)
def _gelu(bx, a, k, o):
    x = bx(a[0])
    approx = k.get("approximate", "none")
    r = with_min(x, lambda t: torch.nn.functional.gelu(t, approximate=approx), -0.7517916, -0.1701, True)
    mx = float(torch.finfo(o.dtype).max)
    # x * 0.5 * (1 + erf(x / sqrt 2)) in the dtype: 1 + erf cancels in the negative tail, so the
    # kernel's error is absolute, about |x| eps, not a few ulps of the result (float32 gelu(-2)
    # is 22 ulps off; gelu(-6) underflows to -0.0, which this allowance keeps in the box)
    eps = float(torch.finfo(o.dtype).eps) if o.dtype.is_floating_point else 0.0
    slack = 4 * eps * torch.maximum(x.lo.abs(), x.hi.abs()).clamp(max=mx)
    slack = torch.where(torch.isfinite(slack), slack, torch.zeros_like(slack))
    lo = r.lo - slack
    hi = torch.where(x.hi > mx / 4, INF, r.hi + slack)  # x * 0.5 * (1 + erf) overflows on the way
    nan = torch.maximum(r.nan, (x.hi == INF).to(F64)) if approx == "none" else r.nan  # gelu(inf) is NaN
    return Box(lo, hi, nan)


TRANSFER["gelu"] = _gelu
TRANSFER["silu"] = lambda bx, a, k, o: with_min(bx(a[0]), torch.nn.functional.silu, -1.2784645, -0.27847, True)
TRANSFER["mish"] = lambda bx, a, k, o: with_min(bx(a[0]), torch.nn.functional.mish, -1.1924, -0.30885, True)


@_reg("pow")
def _pow(bx, a, k, o):
    base, p = a[0], a[1]
    if isinstance(base, Tensor) and not isinstance(p, Tensor):
        return powi_rounded(bx(base), float(p), o.dtype)
    if not isinstance(base, Tensor):  # a number to a tensor power: the number as the kernel rounds it
        b = rounded_operand(Box.point(float(base)), o.dtype)
        e = bx(p)
        blo, bhi = float(b.lo.min()), float(b.hi.max())
        if blo > 0:
            return exp_box(mul(e, Box(torch.tensor(math.log(blo), dtype=F64), torch.tensor(math.log(bhi), dtype=F64))))
        return None
    pb = bx(p)
    if pb.is_point() and pb.lo.numel() and bool((pb.lo == pb.lo.flatten()[0]).all()):
        return powi(bx(base), float(pb.lo.flatten()[0]))
    return pow_tensor(bx(base), pb)


TRANSFER["float_power"] = _pow


@_reg("nan_to_num")
def _nan_to_num(bx, a, k, o):
    def r(v):  # the kernel casts each replacement into the dtype
        return None if v is None else float(torch.tensor(float(v), dtype=F64).to(o.dtype))
    return nan_to_num(bx(a[0]), o.dtype, r(_arg(a, k, 1, "nan", 0.0)), r(_arg(a, k, 2, "posinf")),
                      r(_arg(a, k, 3, "neginf")))


for _n in ("eq", "ne", "lt", "le", "gt", "ge"):
    TRANSFER[_n] = (lambda op: lambda bx, a, k, o: compare(bx(a[0]), bx(a[1]), op))(_n)


@_reg("isnan")
def _isnan(bx, a, k, o):
    b = bx(a[0])
    return Box(torch.zeros_like(b.lo), b.nan.clone())


@_reg("isinf")
def _isinf(bx, a, k, o):
    b = bx(a[0])
    sure = (b.lo == b.hi) & torch.isinf(b.lo) & (b.nan == 0)
    return Box(sure.to(F64), _has_inf(b).to(F64))


@_reg("isfinite")
def _isfinite(bx, a, k, o):
    b = bx(a[0])
    sure = torch.isfinite(b.lo) & torch.isfinite(b.hi) & (b.nan == 0)
    return Box(sure.to(F64), torch.ones_like(b.lo))


@_reg("logical_not", "bitwise_not")
def _not(bx, a, k, o):
    if a[0].dtype != torch.bool:
        return None
    b = bx(a[0])
    return Box(1 - b.hi, 1 - b.lo)


@_reg("logical_and", "bitwise_and", "__and__")
def _and(bx, a, k, o):
    if not all(isinstance(x, Tensor) and x.dtype == torch.bool for x in a[:2]):
        return None
    x, y = _bc(bx(a[0]), bx(a[1]))
    return Box(x.lo * y.lo, x.hi * y.hi)


@_reg("logical_or", "bitwise_or", "__or__")
def _or(bx, a, k, o):
    if not all(isinstance(x, Tensor) and x.dtype == torch.bool for x in a[:2]):
        return None
    x, y = _bc(bx(a[0]), bx(a[1]))
    return Box(torch.maximum(x.lo, y.lo), torch.maximum(x.hi, y.hi))


# reductions
def _one_sign(x: Box, dims, keepdim) -> Tensor:
    """Where every term of a sum has one sign: the rounded partial sums keep it."""
    if x.lo.numel() == 0:
        return torch.ones((), dtype=torch.bool)
    pos = _red((x.lo >= 0).to(F64), dims, keepdim, torch.amin) > 0
    neg = _red((x.hi <= 0).to(F64), dims, keepdim, torch.amin) > 0
    return pos | neg


@_reg("sum")
def _sum(bx, a, k, o):
    x = bx(a[0])
    dims, keep = _dims(x.lo, _arg(a, k, 1, "dim")), _arg(a, k, 2, "keepdim", False)
    b, n, mag = sum_box(x, dims, keep)
    if not o.is_floating_point():
        return b
    b.nan = torch.maximum(b.nan, _overflow_nan(mag, o.dtype))
    return widen(b, o.dtype, n=n, mag=mag, keep_sign=_one_sign(x, dims, keep))


@_reg("mean")
def _mean(bx, a, k, o):
    x = bx(a[0])
    dims = _dims(x.lo, _arg(a, k, 1, "dim"))
    b, n, mag = sum_box(x, dims, _arg(a, k, 2, "keepdim", False))
    if n == 0:
        return top_like(o)
    b.nan = torch.maximum(b.nan, _overflow_nan(mag, o.dtype))
    return widen(Box(b.lo / n, b.hi / n, b.nan), o.dtype, n=n, mag=mag / n,
                 keep_sign=_one_sign(x, dims, _arg(a, k, 2, "keepdim", False)))


@_reg("amax")
def _amax(bx, a, k, o):
    return amax_box(bx(a[0]), _arg(a, k, 1, "dim"), _arg(a, k, 2, "keepdim", False))


TRANSFER["amin"] = lambda bx, a, k, o: amax_box(bx(a[0]), _arg(a, k, 1, "dim"), _arg(a, k, 2, "keepdim", False), torch.amin)


def _maxmin(name):
    f = torch.amax if name == "max" else torch.amin

    def t(bx, a, k, o):
        if len(a) >= 2 and isinstance(a[1], Tensor):  # max.other
            return (maximum if name == "max" else minimum)(bx(a[0]), bx(a[1]))
        x = bx(a[0])
        if isinstance(o, (tuple, list)):  # max.dim: (values, indices)
            d = _arg(a, k, 1, "dim")
            v = amax_box(x, d, _arg(a, k, 2, "keepdim", False), f)
            n = a[0].shape[d] if a[0].dim() else 1
            return [v, Box(torch.zeros(o[1].shape, dtype=F64), torch.full(o[1].shape, float(n - 1), dtype=F64))]
        return amax_box(x, None, False, f)
    return t


TRANSFER["max"] = _maxmin("max")
TRANSFER["min"] = _maxmin("min")


@_reg("argmax", "argmin")
def _argmax(bx, a, k, o):
    d = _arg(a, k, 1, "dim")
    n = a[0].numel() if d is None else a[0].shape[d]
    return Box(torch.zeros(o.shape, dtype=F64), torch.full(o.shape, float(max(n - 1, 0)), dtype=F64))


@_reg("logsumexp")
def _lse(bx, a, k, o):
    return widen(logsumexp_box(bx(a[0]), _arg(a, k, 1, "dim"), _arg(a, k, 2, "keepdim", False)), o.dtype, k=8)


def _var_op(name):
    def t(bx, a, k, o):
        x = bx(a[0])
        dim = _arg(a, k, 1, "dim")
        corr = k.get("correction")
        if corr is None:
            unb = k.get("unbiased", True)
            corr = 1 if unb else 0
        keep = k.get("keepdim", False)
        v = var_box(x, dim, float(corr), keep, a[0].dtype)
        n = max(_count(x.lo, _dims(x.lo, dim)), 1)
        v.nan = torch.maximum(v.nan, _overflow_nan(v.hi * n * 4, a[0].dtype))  # (x - mean)^2 sums past max
        res = v if name.startswith("var") else monotone(v, torch.sqrt, lo_dom=0.0)
        res = widen(res, a[0].dtype, k=4, n=_count(x.lo, _dims(x.lo, dim)), mag=v.hi, keep_sign=True)
        if name.endswith("_mean"):
            b, n, mag = sum_box(x, dim, keep)
            return [res, widen(Box(b.lo / max(n, 1), b.hi / max(n, 1), b.nan), a[0].dtype, n=n, mag=mag / max(n, 1))]
        return res
    return t


for _n in ("var", "std", "var_mean", "std_mean"):
    TRANSFER[_n] = _var_op(_n)


@_reg("cumsum")
def _cumsum(bx, a, k, o):
    x = bx(a[0])
    d = _arg(a, k, 1, "dim")
    lo, hi = _clean(torch.cumsum(x.lo, d), torch.cumsum(x.hi, d))
    nan = torch.cummax(torch.maximum(x.nan, (torch.cummax((x.lo == -INF).to(F64), d).values
                                              * torch.cummax((x.hi == INF).to(F64), d).values)), d).values
    mag = torch.cumsum(torch.maximum(x.lo.abs(), x.hi.abs()), d)
    if o.is_floating_point():
        nan = torch.maximum(nan, _overflow_nan(mag, o.dtype))
    return widen(Box(lo, hi, nan), o.dtype, n=x.lo.shape[d] if x.lo.dim() else 1, mag=mag) \
        if o.is_floating_point() else Box(lo, hi, nan)


@_reg("prod")
def _prod(bx, a, k, o):
    x = bx(a[0])
    dim = _arg(a, k, 1, "dim")
    keep = _arg(a, k, 2, "keepdim", False)
    dims = _dims(x.lo, dim)
    m = _red(torch.maximum(x.lo.abs(), x.hi.abs()), dims, keep, lambda t, dim, keepdim: _prod_dims(t, dim, keepdim))
    nan = _red(x.nan, dims, keep, torch.amax)
    # a partial product may overflow to inf and meet a 0: inf * 0 = NaN
    zero = _red(x.contains_zero().to(F64), dims, keep, torch.amax)
    big = (m * 2 > float(torch.finfo(o.dtype).max)).to(F64) if o.is_floating_point() else torch.zeros_like(m)
    nan = torch.maximum(nan, zero * big)
    return widen(Box(-m, m, nan), o.dtype, k=2 * max(_count(x.lo, dims), 1))


def _prod_dims(t, dim, keepdim):
    for d in sorted(dim, reverse=True):
        t = torch.prod(t, d, keepdim=keepdim)
    return t


# products
@_reg("mm", "bmm", "matmul", "dot", "mv")
def _mm(bx, a, k, o):
    return matmul_box(bx(a[0]), bx(a[1]), o.dtype)


@_reg("addmm", "baddbmm", "addbmm", "addmv")
def _addmm(bx, a, k, o):
    beta = k.get("beta", 1)
    alpha = k.get("alpha", 1)
    prod = matmul_box(bx(a[1]), bx(a[2]), o.dtype)
    if alpha != 1:
        prod = mul(prod, Box.point(float(alpha)))
    base = bx(a[0])
    if beta == 0:
        return prod if prod.lo.shape == o.shape else Box(*[t.expand(o.shape) for t in (prod.lo, prod.hi, prod.nan)])
    if beta != 1:
        base = mul(base, Box.point(float(beta)))
    return widen(add(prod, base), o.dtype)


@_reg("_softmax", "softmax")
def _softmax(bx, a, k, o):
    return within(widen(softmax_box(bx(a[0]), _arg(a, k, 1, "dim")), o.dtype, k=8), 0.0, 1.0)


@_reg("_log_softmax", "log_softmax")
def _log_softmax(bx, a, k, o):
    return within(widen(softmax_box(bx(a[0]), _arg(a, k, 1, "dim"), log=True), o.dtype, k=8), hi=0.0)


@_reg("native_layer_norm")
def _native_layer_norm(bx, a, k, o):
    w = bx(a[2]) if isinstance(a[2], Tensor) else None
    b = bx(a[3]) if isinstance(a[3], Tensor) else None
    y, mean, rstd = layer_norm_box(bx(a[0]), a[1], w, b, float(a[4]), a[0].dtype)
    return [widen(y, o[0].dtype, k=8), mean, rstd]


@_reg("_to_copy", "to", "_to_dtype", "type_as", "_autocast_to_reduced_precision", "_autocast_to_full_precision")
def _to_copy(bx, a, k, o):
    x = bx(a[0])
    if o.is_floating_point():
        src = a[0].dtype
        if src.is_floating_point and torch.finfo(o.dtype).bits >= torch.finfo(src).bits \
                and torch.finfo(o.dtype).max >= torch.finfo(src).max:
            return x  # exact
        return widen(x, o.dtype, k=1)
    if o.dtype == torch.bool:
        zero = x.contains_zero()
        nonzero = (x.lo != 0) | (x.hi != 0) | (x.nan > 0)
        return Box((~zero).to(F64), nonzero.to(F64))
    return widen(x, o.dtype)


@_reg("fill", "zero", "zeros_like", "ones_like", "full_like", "new_zeros", "new_ones", "new_full", "scalar_tensor",
      "zeros", "ones", "full", "arange", "linspace", "eye", "tensor", "_local_scalar_dense")
def _constant(bx, a, k, o):
    value = a[1] if len(a) > 1 and isinstance(a[1], Tensor) else None
    if value is not None:  # fill(x, tensor value)
        v = bx(value)
        return Box(v.lo.expand(o.shape).clone(), v.hi.expand(o.shape).clone(), v.nan.expand(o.shape).clone())
    return Box.point(o)


# random numbers: the range of the distribution, whatever the draw
@_reg("rand", "rand_like")
def _rand(bx, a, k, o):
    return Box(torch.zeros(o.shape, dtype=F64), torch.ones(o.shape, dtype=F64))


@_reg("uniform")
def _uniform(bx, a, k, o):
    lo, hi = float(_arg(a, k, 1, "from", 0.0)), float(_arg(a, k, 2, "to", 1.0))
    return Box(torch.full(o.shape, lo, dtype=F64), torch.full(o.shape, hi, dtype=F64))


@_reg("randn", "randn_like", "normal")
def _normal(bx, a, k, o):
    mx = float(torch.finfo(o.dtype).max) if o.is_floating_point() else INF
    return Box(torch.full(o.shape, -mx, dtype=F64), torch.full(o.shape, mx, dtype=F64))


@_reg("exponential")
def _exponential(bx, a, k, o):
    mx = float(torch.finfo(o.dtype).max)
    return Box(torch.zeros(o.shape, dtype=F64), torch.full(o.shape, mx, dtype=F64))


@_reg("bernoulli")
def _bernoulli(bx, a, k, o):
    return Box(torch.zeros(o.shape, dtype=F64), torch.ones(o.shape, dtype=F64))


@_reg("native_dropout")
def _dropout(bx, a, k, o):
    x = bx(a[0])
    p = float(a[1])
    train = a[2] if len(a) > 2 else k.get("train", True)
    if not train or p == 0:
        return [x, Box(torch.ones(o[1].shape, dtype=F64), torch.ones(o[1].shape, dtype=F64))]
    scaled = mul(x, Box.point(1.0 / (1 - p))) if p < 1 else Box.point(torch.zeros(()))
    zero = Box(torch.zeros_like(x.lo), torch.zeros_like(x.lo))
    return [widen(join(scaled, zero), o[0].dtype), Box(torch.zeros(o[1].shape, dtype=F64), torch.ones(o[1].shape, dtype=F64))]


@_reg("constant_pad_nd")
def _pad(bx, a, k, o):
    x = bx(a[0])
    pad = a[1]
    value = float(_arg(a, k, 2, "value", 0.0))
    f = torch.constant_pad_nd
    return Box(f(x.lo, pad, value), f(x.hi, pad, value), f(x.nan, pad, 0.0))


def sdpa_box(q: Box, k_: Box, v: Box, dtype: torch.dtype) -> Box:
    """scaled_dot_product_attention: a convex combination of v's rows (0 for a fully masked
    row), finite when the scores q.k cannot overflow."""
    shape = q.lo.shape[:-1] + v.lo.shape[-1:]
    mq = float(max(q.lo.abs().max(), q.hi.abs().max())) if q.lo.numel() else 0.0
    mk = float(max(k_.lo.abs().max(), k_.hi.abs().max())) if k_.lo.numel() else 0.0
    d = q.lo.shape[-1]
    mx = float(torch.finfo(dtype).max)
    ok = q.finite() and k_.finite() and v.finite() and mq * mk * d * 2 < mx
    if not ok:
        return Box(torch.full(shape, -INF, dtype=F64), torch.full(shape, INF, dtype=F64), torch.ones(shape, dtype=F64))
    lo = min(float(v.lo.min()), 0.0)
    hi = max(float(v.hi.max()), 0.0)
    return widen(Box(torch.full(shape, lo, dtype=F64), torch.full(shape, hi, dtype=F64)), dtype, k=8 * d)


@_reg("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
      "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
      "_scaled_dot_product_attention_math", "scaled_dot_product_attention")
def _sdpa(bx, a, k, o):
    outs = _outs(o)
    main = sdpa_box(bx(a[0]), bx(a[1]), bx(a[2]), outs[0].dtype)
    return [main] + [top_like(t) if isinstance(t, Tensor) else None for t in outs[1:]]


# ---------------------------------------------------------------------------------------------
# relations the intervals alone lose, normalisation, linear algebra, FFT


def x_exp_x(t: Box) -> Box:
    """t * exp(t): decreasing to -1/e at t = -1, increasing after; -0.0 for a very negative
    finite t (exp underflows first), but NaN at t = -inf itself (-inf * 0: the attack test
    found (-1e30) ** 3 = -inf in float32 feeding it)."""
    def f(v):
        return torch.where(v == -INF, torch.zeros_like(v), v * torch.exp(v))
    r = with_min(t, f, -1.0, -math.exp(-1.0))
    nan = torch.maximum(t.nan, ((t.hi == INF) | (t.lo == -INF)).to(F64))
    return Box(r.lo, r.hi, nan)


def _mag(b: Box) -> Tensor:
    return torch.maximum(b.lo.abs(), b.hi.abs())


@_reg("linalg_vector_norm", "norm")
def _vector_norm(bx, a, k, o):
    """||x||_p over dims: between the norm of the smallest and of the largest magnitudes."""
    x = bx(a[0])
    p = _arg(a, k, 1, "ord", 2)
    p = 2.0 if p is None else float(p)
    dim = _arg(a, k, 2, "dim")
    keep = bool(_arg(a, k, 3, "keepdim", False))
    dims = _dims(x.lo, dim)
    lo_m = torch.where(x.contains_zero(), torch.zeros_like(x.lo), torch.minimum(x.lo.abs(), x.hi.abs()))
    hi_m = _mag(x)
    if p == INF:
        lo, hi = _red(lo_m, dims, keep, torch.amax), _red(hi_m, dims, keep, torch.amax)
    elif p == -INF:
        lo, hi = _red(lo_m, dims, keep, torch.amin), _red(hi_m, dims, keep, torch.amin)
    elif p > 0:
        lo = _red(lo_m, dims, keep, lambda t, dim, keepdim: torch.linalg.vector_norm(t, p, dim, keepdim))
        hi = _red(hi_m, dims, keep, lambda t, dim, keepdim: torch.linalg.vector_norm(t, p, dim, keepdim))
    else:
        return None
    n = max(_count(x.lo, dims), 1)
    nan = _red(x.nan, dims, keep, torch.amax) if x.lo.numel() else torch.zeros_like(lo)
    if p not in (INF, -INF):
        # the kernel sums |x|^p unscaled (float32 norm of 1e30 is inf though the norm fits):
        # where that sum may pass the dtype's max, so may the result (the attack test's find)
        powered = _red(hi_m.pow(p), dims, keep, lambda t, dim, keepdim: t.sum(dim, keepdim=keepdim))
        hi = torch.where(powered > torch.finfo(o.dtype).max, INF, hi)
    # the kernel sums |x|^p in the dtype: each term and the sum may overflow (||x|| near max)
    return widen(Box(lo, hi, nan), o.dtype, k=4 * n + 4, keep_sign=True)


def _norm_stats(x: Box, dims: list[int], eps: float, dtype: torch.dtype):
    """(y bound, ok): |x_i - mean| / sqrt(var + eps) <= sqrt(N) over ``dims`` (N values)."""
    n = _count(x.lo, dims)
    mx = float(torch.finfo(dtype).max)
    eps_d = float(torch.tensor(eps, dtype=dtype))
    m = float(_mag(x).max()) if x.lo.numel() else 0.0
    ok = eps_d > 0 and math.isfinite(m) and (2 * m) ** 2 * n * 4 < mx and not bool(x.nan.any())
    return math.sqrt(n) * (1 + 1e-3), ok, eps_d, m


@_reg("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
      "_native_batch_norm_legit_functional")
def _batch_norm(bx, a, k, o):
    """Training: batch statistics, |y - b| <= sqrt(N) |w| as layer_norm; eval: the running
    statistics, (x - mean) * rsqrt(var + eps) * w + b elementwise (a negative running
    variance is NaN)."""
    x_t = a[0]
    x = bx(x_t)
    w = bx(a[1]) if isinstance(a[1], Tensor) else None
    b = bx(a[2]) if isinstance(a[2], Tensor) else None
    nums = [v for v in a[3:] if isinstance(v, (bool, float, int)) and not isinstance(v, bool)]
    flags = [v for v in a[3:] if isinstance(v, bool)]
    training = flags[0] if flags else False
    eps = float(nums[-1]) if nums else 1e-5
    rm = a[3] if len(a) > 3 and isinstance(a[3], Tensor) else None
    rv = a[4] if len(a) > 4 and isinstance(a[4], Tensor) else None
    outs = _outs(o)
    shape = [1, -1] + [1] * (x_t.dim() - 2)
    if training or rm is None or rv is None:
        dims = [d for d in range(x_t.dim()) if d != 1]
        root, ok, eps_d, m = _norm_stats(x, dims, eps, x_t.dtype)
        if not ok:
            return None
        y = Box(torch.full(x.lo.shape, -root, dtype=F64), torch.full(x.lo.shape, root, dtype=F64))
        mean = Box(torch.full(outs[1].shape, float(x.lo.min()), dtype=F64), torch.full(outs[1].shape, float(x.hi.max()), dtype=F64))
        invstd = Box(torch.full(outs[2].shape, 1 / math.sqrt(((2 * m) ** 2 + eps_d) * 1.01), dtype=F64),
                     torch.full(outs[2].shape, 1.01 / math.sqrt(eps_d), dtype=F64))
    else:
        mean_b = Box(*(t.reshape(shape) for t in (bx(rm).lo, bx(rm).hi, bx(rm).nan)))
        var_b = Box(*(t.reshape(shape) for t in (bx(rv).lo, bx(rv).hi, bx(rv).nan)))
        r = widen(powi(add(var_b, rounded_operand(Box.point(eps), x_t.dtype)), -0.5), x_t.dtype, k=8)
        y = widen(mul(sub(x, mean_b), r), x_t.dtype, k=4)
        mean = invstd = None
    if w is not None:
        y = mul(y, Box(*(t.reshape(shape) for t in (w.lo, w.hi, w.nan))))
    if b is not None:
        y = add(y, Box(*(t.reshape(shape) for t in (b.lo, b.hi, b.nan))))
    y = Box(y.lo, y.hi, torch.maximum(y.nan, x.nan))
    return [widen(y, outs[0].dtype, k=8), mean, invstd] + [None] * (len(outs) - 3)


@_reg("_weight_norm_interface")
def _weight_norm(bx, a, k, o):
    """w = v * g / ||v|| (the norm over every dim but ``dim``): |w| <= |g|, NaN where a slice of
    v may be all zero."""
    v, g = bx(a[0]), bx(a[1])
    dim = int(_arg(a, k, 2, "dim", 0))
    outs = _outs(o)
    dims = [d for d in range(v.lo.dim()) if d != dim % max(v.lo.dim(), 1)]
    zero = _red(v.contains_zero().to(F64), dims, True, torch.amin) if dims else v.contains_zero().to(F64)
    gm = _mag(g).reshape(zero.shape) if g.lo.numel() == zero.numel() else _mag(g).max().expand(zero.shape)
    m = gm.expand(v.lo.shape)
    nan = torch.maximum(torch.maximum(v.nan, zero.expand(v.lo.shape)), g.nan.max().expand(v.lo.shape))
    w = widen(Box(-m, m, nan), outs[0].dtype, k=8)
    hi = _red(_mag(v), dims, True, lambda t, dim, keepdim: torch.linalg.vector_norm(t, 2, dim, keepdim)) \
        if dims else _mag(v)
    norms = widen(Box(torch.zeros_like(hi), hi), outs[1].dtype, k=4 * max(v.lo.numel(), 1), keep_sign=True)
    return [w, norms]


def _frobenius(x: Box, batch: int) -> Tensor:
    """||A||_F of each matrix: bounds its singular values, eigenvalues and R's entries."""
    m = _mag(x)
    return torch.linalg.matrix_norm(m, "fro") if m.dim() >= 2 else m


def _unit(shape, slack: float) -> Box:
    return Box(torch.full(shape, -1 - slack, dtype=F64), torch.full(shape, 1 + slack, dtype=F64))


def _decomposition(kinds: str):
    """svd / eigh / qr of finite matrices: orthonormal factors ("u") hold entries in [-1, 1];
    singular values ("s"), eigenvalues ("e") and R's entries ("r") are bounded by ||A||_F
    (LAPACK's backward error: a relative slack of 1e-3 covers n eps up to n = 8000 in float32)."""
    def t(bx, a, k, o):
        x = bx(a[0])
        if not x.finite():
            return None
        fro = _frobenius(x, 0) * (1 + 1e-3)
        res = []
        for kind, out in zip(kinds, _outs(o), strict=False):
            if not isinstance(out, Tensor) or not out.is_floating_point():
                res.append(None)
            elif kind == "u":
                res.append(_unit(out.shape, 1e-3))
            else:
                f = fro.reshape(fro.shape + (1,) * (out.dim() - fro.dim())).expand(out.shape)
                res.append(Box(torch.zeros_like(f) if kind == "s" else -f, f.clone()))
        return res
    return t


TRANSFER["_linalg_svd"] = TRANSFER["linalg_svd"] = _decomposition("usu")
TRANSFER["_linalg_eigh"] = TRANSFER["linalg_eigh"] = _decomposition("eu")
TRANSFER["linalg_qr"] = _decomposition("ur")


@_reg("atan2")
def _atan2(bx, a, k, o):
    y, x = _bc(bx(a[0]), bx(a[1]))
    pi = float(torch.tensor(math.pi, dtype=o.dtype)) if o.is_floating_point() else math.pi
    return Box(torch.full(y.lo.shape, -pi, dtype=F64), torch.full(y.lo.shape, pi, dtype=F64), torch.maximum(y.nan, x.nan))


@_reg("xlogy")
def _xlogy(bx, a, k, o):
    """x * log(y), 0 where x == 0 (even for y = 0 or NaN? no: NaN y gives NaN)."""
    x, y = _bc(bx(a[0]), bx(a[1]))
    p = mul(x, log_box(y))
    zero = (x.lo == 0) & (x.hi == 0)
    lo = torch.where(zero, 0.0, torch.where(x.contains_zero(), torch.minimum(p.lo, torch.zeros_like(p.lo)), p.lo))
    hi = torch.where(zero, 0.0, torch.where(x.contains_zero(), torch.maximum(p.hi, torch.zeros_like(p.hi)), p.hi))
    nan = torch.where(zero, y.nan, torch.maximum(p.nan, y.nan))
    # log(y) at y = 0 is -inf: 0 * -inf is not taken (xlogy gives 0 where x == 0); inf * log(1)
    # = inf * 0 still is (float16 x past 65504 beside y = 1: found by the attack test)
    inf_times_zero = (((x.lo == -INF) | (x.hi == INF)) & (y.lo <= 1) & (y.hi >= 1)).to(F64)
    nan = torch.where(x.contains_zero() & ~((x.lo == 0) & (x.hi == 0)) & (y.lo <= 0) & (y.nan == 0)
                      & ~(y.lo < 0), torch.maximum(torch.maximum(x.nan, y.nan), inf_times_zero), nan)
    return Box(lo, hi, nan)


def _all_any(f):
    def t(bx, a, k, o):
        x = bx(a[0])
        dim = _arg(a, k, 1, "dim")
        keep = bool(_arg(a, k, 2, "keepdim", False))
        truthy = Box((~x.contains_zero()).to(F64), ((x.lo != 0) | (x.hi != 0) | (x.nan > 0)).to(F64))
        dims = _dims(truthy.lo, dim)
        return Box(_red(truthy.lo, dims, keep, f), _red(truthy.hi, dims, keep, f))
    return t


TRANSFER["all"] = TRANSFER["_is_all_true"] = _all_any(torch.amin)
TRANSFER["any"] = TRANSFER["_is_any_true"] = _all_any(torch.amax)


@_reg("as_strided")
def _as_strided(bx, a, k, o):
    """A window over a contiguous operand: the same window over its bounds (stft's frames)."""
    x_t = a[0]
    if not x_t.is_contiguous():
        return None
    size, stride = list(a[1]), list(a[2])
    off = _arg(a, k, 3, "storage_offset")
    off = x_t.storage_offset() if off is None else int(off)
    rel = off - x_t.storage_offset()
    last = rel + sum((s - 1) * st for s, st in zip(size, stride, strict=True) if s > 0)
    if rel < 0 or last >= max(x_t.numel(), 1):
        return None
    x = bx(x_t)
    return Box(*(torch.as_strided(t.contiguous(), size, stride, rel) for t in (x.lo, x.hi, x.nan)))


@_reg("_fft_r2c", "_fft_c2c", "_fft_c2r")
def _fft(bx, a, k, o):
    """|X_k| <= sum_n |x_n| (times the normalisation) over the transformed dims: a bound on the
    real and imaginary parts. A complex value's box bounds both parts."""
    x_t = a[0]
    x = bx(x_t)
    dims = [d % x_t.dim() for d in a[1]]
    norm = int(a[2])
    n = _count(x.lo, dims)
    s = _red(_mag(x), dims, True, torch.sum)
    if norm == 1:
        s = s / math.sqrt(n)
    elif norm == 2:
        s = s / n
    nan = _red(torch.maximum(x.nan, _has_inf(x).to(F64)), dims, True, torch.amax)
    dtype = o.real.dtype if o.is_complex() else o.dtype
    b = widen(Box(-s, s, nan), dtype, k=4 * max(int(math.log2(max(n, 2))), 1), n=n, mag=s)
    return Box(*(t.expand(o.shape).clone() for t in (b.lo, b.hi, b.nan)))


@_reg("view_as_real")
def _view_as_real(bx, a, k, o):
    x = bx(a[0])
    return Box(*(t.unsqueeze(-1).expand(o.shape).clone() for t in (x.lo, x.hi, x.nan)))


@_reg("view_as_complex")
def _view_as_complex(bx, a, k, o):
    x = bx(a[0])
    return Box(*(f(t, -1) for f, t in ((torch.amin, x.lo), (torch.amax, x.hi), (torch.amax, x.nan))))
