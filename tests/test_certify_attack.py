"""A soundness property test of nanpass.certify that attacks it (issue 21).

Random models of depth 2-8 over every op the generator of tests/test_certify.py knows, plus the
ops added for issue 21 (norms, atan2, xlogy, t * exp(t), constants near float boundaries), in
float32, float16 and bfloat16; ranges narrow, wide, touching 0, at the models' own constants and
their float neighbours, up to +-1e30. Samples: every corner, special values (+-0, subnormals,
the next floats inside each bound), a sign-gradient attack on every intermediate value (push it
up, then down), and for a proven certificate nanpass.search. Checks, on the model and on
nanpass.harden(model): every concrete value of every aten op lies in its box, and a proven
certificate is finite on every sample.

Fast tier: a small budget (NANPASS_ATTACK_EXAMPLES, default 10); slow tier: 400, drawn from a
fixed seed so that CI passes or fails on the same models each run (NANPASS_ATTACK_RANDOM=1 draws
new ones: the CI run of 2026-11-29 drew two holes, a search restart outside a range beyond 1e30
and bfloat16 erf's absolute error, both fixed, with tests in test_search.py and here).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nanpass
from nanpass import _intervals as iv
from nanpass._certify import Recorder, analyse, parse_ranges
from tests.test_certify import BINARY, UNARY
from tests.test_certify import Program as CertifyProgram

EXTRA_UNARY = {
    "add_eps": lambda x: x + 1e-6, "rsqrt_eps": lambda x: torch.rsqrt(x + 1e-5),
    "log_eps": lambda x: torch.log(x + 1e-6), "pow_scalar_base": lambda x: torch.pow(1.1, x),
    "pow_neg_half": lambda x: x ** -0.5, "norm": lambda x: torch.linalg.vector_norm(x, dim=-1, keepdim=True),
    "x_exp_x": lambda x: x * torch.exp(x), "square_mul": lambda x: x * x,
    "rms": lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6),
    "sqrt_softmax": lambda x: torch.sqrt(torch.softmax(x, -1)), "exp_var": lambda x: torch.exp(x.var(-1, keepdim=True)),
    "erf": torch.erf, "sigmoid_recip": lambda x: 1.0 / torch.sigmoid(x), "expm1": torch.expm1,
    "clamp_eps": lambda x: x.clamp(min=1e-6), "where_eps": lambda x: torch.where(x > 0.1, x, 1e-7),
}
EXTRA_BINARY = {"atan2": torch.atan2, "xlogy": torch.xlogy}
ALL_UNARY = {**UNARY, **EXTRA_UNARY}
ALL_BINARY = {**BINARY, **EXTRA_BINARY}
OPS = sorted(ALL_UNARY) + sorted(ALL_BINARY) + ["linear"]
SHAPE = (3, 4)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


class Program(CertifyProgram):
    """The certify tests' random program over every modelled op."""

    unary, binary = ALL_UNARY, ALL_BINARY


def _f(v: float, dtype) -> float:
    return float(torch.tensor(v, dtype=torch.float64).to(dtype))


def _next(v: float, dtype, towards: float) -> float:
    return float(torch.nextafter(torch.tensor(v, dtype=dtype), torch.tensor(towards, dtype=dtype)))


CENTERS = [0.0, 1.0, -1.0, 0.5, 2.5, 3.0, 0.1, -1e-6, -1e-5, 1e-6, 88.72, 930.885, 10.0, -100.0, 1e30, -1e30]
WIDTHS = ["point", "ulp", 1e-3, 1.0, 10.0, 100.0, 1e4, 1e30]


@st.composite
def ranges_for(draw, dtype):
    """A range at one of the models' constants (or a neighbour float), narrow to wide."""
    c = _f(draw(st.sampled_from(CENTERS)), torch.float32)
    if draw(st.booleans()):
        c = _next(c, torch.float32, draw(st.sampled_from([-math.inf, math.inf])))
    w = draw(st.sampled_from(WIDTHS))
    side = draw(st.sampled_from(["both", "up", "down"]))
    if w == "point":
        lo = hi = c
    elif w == "ulp":
        lo, hi = c, _next(c, torch.float32, math.inf)
    else:
        lo = c - w if side != "up" else c
        hi = c + w if side != "down" else c
    if dtype != torch.float32:  # keep the range inside the dtype
        mx = float(torch.finfo(dtype).max) / 2
        lo, hi = min(max(lo, -mx), mx), max(min(hi, mx), -mx)
    return (lo, hi)


@st.composite
def programs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n_inputs = draw(st.integers(1, 2))
    steps = draw(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 9), st.integers(0, 9)), min_size=2, max_size=8))
    ranges = [draw(ranges_for(dtype)) for _ in range(n_inputs)]
    return Program(steps).to(dtype), dtype, ranges


def specials(lo: float, hi: float, dtype) -> list[float]:
    """+-0, subnormals, +-1 and the next floats inside each bound, where they lie in [lo, hi]."""
    tiny = float(torch.finfo(dtype).tiny)
    out = [lo, hi, 0.0, -0.0, tiny / 4, -tiny / 4, tiny, -tiny, 1.0, -1.0]
    if hi > lo:
        out += [_next(lo, dtype, math.inf), _next(hi, dtype, -math.inf)]
    return [v for v in out if lo <= v <= hi]


def corners_and_specials(ranges, dtype, seed=0) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(2 ** len(ranges)):
        out.append(tuple(torch.full(SHAPE, (hi if (k >> i) & 1 else lo)) for i, (lo, hi) in enumerate(ranges)))
    for _ in range(4):
        xs = []
        for lo, hi in ranges:
            sp = torch.tensor(specials(lo, hi, dtype), dtype=torch.float64)
            xs.append(sp[torch.randint(0, len(sp), SHAPE, generator=gen)])
        out.append(tuple(xs))
    return [tuple(x.to(dtype).clamp(lo, hi) if x.to(dtype).isfinite().all() else x.to(dtype)
                  for x, (lo, hi) in zip(xs, ranges, strict=True)) for xs in out]


def attack(model: Program, start: tuple, ranges, dtype, steps: int = 3) -> list[tuple]:
    """Sign-gradient ascent and descent on each intermediate value's sum, inside the ranges."""
    found = []
    n_vals = len(model.steps)
    for k in range(n_vals):
        for sign in (1.0, -1.0):
            xs = [x.detach().to(torch.float32).clone() for x in start]
            for _ in range(steps):
                leaves = [x.clone().requires_grad_(True) for x in xs]
                try:
                    model([x.to(dtype) for x in leaves][0], *[x.to(dtype) for x in leaves][1:])
                    v = model.vals[len(leaves) + k]
                    g = torch.autograd.grad(sign * v.float().sum(), leaves, allow_unused=True)
                except RuntimeError:
                    break
                new = []
                for x, gi, (lo, hi) in zip(xs, g, ranges, strict=True):
                    if gi is None:
                        new.append(x)
                        continue
                    step = max((hi - lo) / 4, 1e-30) if math.isfinite(hi - lo) else 1e30
                    gi = torch.nan_to_num(gi)
                    new.append((x + step * gi.sign()).clamp(lo, hi))
                xs = new
            found.append(tuple(x.to(dtype).clamp(lo, hi) for x, (lo, hi) in zip(xs, ranges, strict=True)))
    return found


def _contains(box, value: torch.Tensor) -> torch.Tensor:
    v = value.detach().to(torch.float64)
    return ((v >= box.lo) & (v <= box.hi)) | (torch.isnan(v) & (box.nan > 0))


def check(model, ranges, dtype, samples, hardened: bool) -> None:
    """Containment of every value and finiteness of a proven certificate, on every sample."""
    inputs = tuple(torch.zeros(SHAPE, dtype=dtype).clamp(lo, hi) for lo, hi in ranges)
    target = nanpass.harden(model) if hardened else model
    specs = parse_ranges(ranges, inputs)
    analysis, _ = analyse(target, inputs, specs, hardened=hardened, trace=True)
    skip = {"detach", "alias", "lift_fresh"}
    boxes = [e for e in analysis.trace if e[0] not in skip]
    cert = nanpass.certify(target, *inputs, ranges=ranges)
    for xs in samples:
        rec = Recorder()
        with torch.no_grad(), rec:
            out = target(*xs)
        trace = [e for e in rec.trace if e[0] not in skip]
        if cert.proven:
            assert bool(torch.isfinite(out).all()), f"proven, yet {out} at {xs}\n{cert}"
        if [n for n, _ in trace] != [n for n, _ in boxes]:
            continue  # another path (a data-dependent branch): not comparable
        for (name, values), (_, bxs) in zip(trace, boxes, strict=True):
            for v, b in zip(values, bxs, strict=True):
                if b is None or v.is_complex():
                    continue
                ok = _contains(b, v)
                assert bool(ok.all()), (
                    f"{name}{' (hardened)' if hardened else ''}: {v[~ok][:3].tolist()} outside "
                    f"[{b.lo[~ok][:3].tolist()}, {b.hi[~ok][:3].tolist()}] at "
                    f"{[float(x.flatten()[0]) for x in xs]}, ranges {ranges}, {dtype}, steps {model.steps}")
    return cert


def run_attack(model, dtype, ranges, search: bool = True) -> bool:
    samples = corners_and_specials(ranges, dtype)
    samples += attack(model, samples[0], ranges, dtype)
    cert = None
    for hardened in (False, True):
        c = check(model, ranges, dtype, samples, hardened)
        cert = c if not hardened else cert
    if search and cert.proven:
        inputs = tuple(torch.zeros(SHAPE, dtype=dtype).clamp(lo, hi) for lo, hi in ranges)
        found = nanpass.search(model, *inputs, ranges=ranges, budget=0.1)
        assert not [f for f in found if f.where != "gradient"], (found, cert)  # a proof is of values
    return cert.proven


_EXAMPLES = int(os.environ.get("NANPASS_ATTACK_EXAMPLES", "10"))
_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=_EXAMPLES, **_SETTINGS)
@given(programs())
def test_attack_soundness(prog):
    model, dtype, ranges = prog
    run_attack(model, dtype, ranges, search=False)


@pytest.mark.slow
@settings(max_examples=400, derandomize=os.environ.get("NANPASS_ATTACK_RANDOM") != "1", **_SETTINGS)
@given(programs())
def test_attack_soundness_slow(prog):
    model, dtype, ranges = prog
    run_attack(model, dtype, ranges)


def test_bfloat16_erf_of_a_tiny_value_is_in_its_box():
    """The CPU's vectorised erf is off by about float32's eps absolutely: bfloat16
    erf(rsqrt(1e30)) is 0, not 1e-15 (the slow attack's draw)."""
    model = Program([("abs", 0, 0), ("abs", 0, 0), ("abs", 0, 0), ("rsqrt", 0, 0), ("erf", 5, 0)], n_inputs=2)
    run_attack(model, torch.bfloat16, [(1.0000000150474662e30, 1.0000000150474662e30), (0.0, 0.0)], search=False)


def test_attack_has_teeth(monkeypatch):
    """An exp bound made 1% too small is caught by the corners alone."""
    exp = iv.TRANSFER["exp"]

    def unsound(bx, a, k, o):
        b = exp(bx, a, k, o)
        return iv.Box(b.lo, b.hi * 0.99, b.nan)

    monkeypatch.setitem(iv.TRANSFER, "exp", unsound)
    model = Program([("exp", 0, 0), ("add1", 1, 0)])
    with pytest.raises(AssertionError, match="exp: .* outside"):
        run_attack(model, torch.float32, [(0.0, 10.0)], search=False)
