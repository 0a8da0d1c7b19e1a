"""Guard constants, read from ``torch.finfo`` of the operand and rounded into its dtype.

A fixed 1e-8 is 0 in float16 and ``1 - 1e-8`` is 1.0 in float32, so every bound here is
found in the dtype itself: start from the float64 estimate, round into the dtype, and step
one ulp at a time towards safety until the op (and its derivative) is finite there.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


def memo(fn: Callable) -> Callable:
    """A cache as a plain dict: torch.compile traces a hit as a constant lookup, where it
    warns on (and re-traces) functools caches."""
    cache: dict = {}

    @functools.wraps(fn)
    def get(*key):
        if key in cache:  # dynamo folds a membership test and a lookup to constants
            return cache[key]
        if torch.compiler.is_compiling():  # a write would be a side effect torch.export warns of
            return fn(*key)
        value = cache[key] = fn(*key)
        return value

    return get


def _t(value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float64).to(dtype)


def _step(t: torch.Tensor, towards: float) -> torch.Tensor:
    return torch.nextafter(t, torch.tensor(towards, dtype=t.dtype))


def _finite(*ts: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _walk(start: float, dtype: torch.dtype, towards: float, ok: Callable) -> float:
    """The first value from ``start`` (rounded into dtype) towards ``towards`` where ok(t)."""
    t = _t(start, dtype)
    if not (_finite(t) and ok(t)) and dtype in (torch.float32, torch.float64):
        # float64 estimates can sit many ulps on the wrong side: jump past them, then bisect
        # back to the first ok value (a bound that is an ulp too tight changes the original's
        # finite bits there: exp(88.7228) is finite in float32)
        jump = _t(start + math.copysign(abs(start) * 1e-4, towards - start), dtype)
        if _finite(jump) and ok(jump) and (jump > 0) == (t > 0):
            return _bisect(t, jump, ok)
    for _ in range(4096):
        if _finite(t) and ok(t):
            return float(t.item())
        t = _step(t, towards)
    raise AssertionError(f"no safe bound found for {dtype} from {start}")  # pragma: no cover


_INTS = {torch.float32: torch.int32, torch.float64: torch.int64}


def _bisect(bad: torch.Tensor, good: torch.Tensor, ok: Callable) -> float:
    """The ok value next to ``bad``, between ``bad`` (not ok) and ``good`` (ok), of one sign:
    floats of one sign are ordered as their bit patterns."""
    ints = _INTS[good.dtype]
    b, g = int(bad.view(ints)), int(good.view(ints))
    while abs(b - g) > 1:
        mid = (b + g) // 2
        m = torch.tensor(mid, dtype=ints).view(good.dtype)
        if _finite(m) and ok(m):
            g = mid
        else:
            b = mid
    return float(torch.tensor(g, dtype=ints).view(good.dtype).item())


def _in(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded into ``dtype``, then stepped down once more if rounding went up."""
    t = torch.tensor(value, dtype=torch.float64).to(dtype)
    if float(t) > value:
        t = torch.nextafter(t, torch.tensor(-math.inf, dtype=dtype))
    return float(t)


@dataclass(frozen=True)
class Bounds:
    """Per-dtype constants; every field is exactly representable in the dtype."""

    dtype: torch.dtype
    tiny: float  # smallest normal: log, rsqrt, xlogy and logit stay finite above it
    max: float  # largest finite
    # what +-inf (an operand, a pole, an overflowing result) becomes: a power of two whose
    # square is at most max / 16 (issue 28 item 2: a product of two guard outputs), so that the
    # next ordinary op (a residual add, a product with a factor up to 16, a sum of 16 such
    # values) stays finite
    sat: float
    eps: float
    below_one: float  # largest value < 1: atanh and logit stay finite below it
    above_minus_one: float  # smallest value > -1: log1p and atanh stay finite above it
    exp_hi: float  # largest x with exp(x) finite: the original's own value up to there
    exp2_hi: float
    # log(0), log2(0), log10(0) (-inf): L with exp(L + v) exactly 0 for every v whose exp is
    # finite ((smallest subnormal / 16) / max in the op's base; -194.8 for float32's log):
    # a mask written as ``logits + mask.log()`` keeps its padded entries' weight exactly 0 after
    # a softmax (issue 28 item 4), and L is a moderate number (a log feature of zeros feeds a
    # linear layer, whose gradient a stand-in of -sat would blow up)
    log_zero: float
    log2_zero: float
    log10_zero: float


HEADROOM = 16  # max / sat


@memo
def bounds(dtype: torch.dtype) -> Bounds:
    fi = torch.finfo(dtype)

    # the largest power of two whose square is at most max / HEADROOM: a product of two
    # stand-ins for inf (two saturated guard outputs) keeps the headroom one had
    sat = 2.0 ** ((math.frexp(float(fi.max) / HEADROOM)[1] - 1) // 2)

    def exp_bound(fn: Callable, start: float) -> float:
        return _walk(start, dtype, -math.inf, lambda t: _finite(fn(t)))

    one = torch.tensor(1.0, dtype=dtype)
    # natural log of (smallest subnormal / 16) / max (a margin for the rounding of L + v)
    zero_log = (math.log(float(fi.smallest_normal)) + math.log(float(fi.eps)) - math.log(16)
                - math.log(float(fi.max)))
    return Bounds(
        dtype=dtype,
        tiny=float(fi.tiny),
        max=float(fi.max),
        sat=sat,
        eps=float(fi.eps),
        below_one=float(_step(one, 0.0).item()),
        above_minus_one=float(_step(-one, 0.0).item()),
        exp_hi=exp_bound(torch.exp, math.log(fi.max)),
        exp2_hi=exp_bound(torch.exp2, math.log2(fi.max)),
        log_zero=_in(zero_log, dtype),
        log2_zero=_in(zero_log / math.log(2), dtype),
        log10_zero=_in(zero_log / math.log(10), dtype),
    )


@dataclass(frozen=True)
class PowDomain:
    """How ``x ** p`` (p a Python number) is kept finite: clamp into [lo, hi], or push
    ``|x| < away`` out to ``away`` when the domain excludes a neighbourhood of 0."""

    lo: float | None
    hi: float | None
    away: float | None = None


@memo
def pow_domain(p: float, dtype: torch.dtype) -> PowDomain | None:
    """None when ``x ** p`` is finite with a finite gradient for every finite x."""
    fi = torch.finfo(dtype)
    integer = float(p).is_integer()
    if p in (0.0, 1.0):
        return None

    def ok(t: torch.Tensor) -> bool:
        # value and the derivative p * t ** (p - 1), as autograd computes them
        return _finite(t.abs() ** p, p * t.abs() ** (p - 1))

    log_max = math.log(fi.max)
    if p > 0:
        start = fi.max
        if p > 1:  # |x| ** p <= max and p * |x| ** (p - 1) <= max
            start = math.exp(
                min(log_max, log_max / p, log_max / (p - 1), (log_max - math.log(p)) / (p - 1))
            )
        c = _walk(min(start, fi.max), dtype, 0.0, ok)
        return PowDomain(lo=-c if integer else 0.0, hi=c)
    # p < 0: x ** p blows up at 0; the smallest magnitude where the value is finite. Below the
    # magnitude where the derivative p * x ** (p - 1) is finite too the forward is still the
    # original's: the guard fences that derivative instead (issue 28: a GCN's deg ** -0.5)
    start = math.exp(log_max / p)
    m = _walk(start, dtype, math.inf, lambda t: _finite(t.abs() ** p))
    if integer:
        return PowDomain(lo=None, hi=None, away=m)
    # no upper bound: x ** p -> 0 as x -> +inf, with a derivative -> 0 (the original's own
    # finite value there, which a clamp at max would turn into max ** p)
    return PowDomain(lo=m, hi=None)


for _dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
    bounds(_dtype)  # computed here, not inside a compiled region (they read tensors back)
