"""nanpass.certify: soundness (hypothesis, against concrete evaluation), transfer functions, verdicts.

Soundness is checked two ways on random small programs built from the rule table's ops and
ordinary arithmetic, for random ranges:

* containment: every concrete value of every aten op, for inputs sampled inside the ranges
  (the corners lo/hi, mixes of corners, uniform draws), lies inside the op's box (or is NaN
  where the box says it may be);
* verdicts: an op the certificate calls ``proven_safe`` is finite on every sample, and a
  ``proven`` certificate has finite outputs on every sample.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import nanpass
from nanpass._certify import PROVEN, Recorder, analyse, parse_ranges

INF = math.inf

# -- a generator of small programs ------------------------------------------------------------

UNARY = {
    "log": torch.log, "log2": torch.log2, "log10": torch.log10, "log1p": torch.log1p, "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt, "exp": torch.exp, "exp2": torch.exp2, "expm1": torch.expm1,
    "reciprocal": torch.reciprocal, "acos": torch.acos, "asin": torch.asin, "atanh": torch.atanh,
    "erfinv": torch.erfinv, "logit": torch.logit, "acosh": torch.acosh, "cosh": torch.cosh,
    "sigmoid": torch.sigmoid, "tanh": torch.tanh, "relu": torch.relu, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu, "abs": torch.abs,
    "neg": torch.neg, "square": torch.square, "pow2": lambda x: x ** 2, "pow3": lambda x: x ** 3,
    "pow_half": lambda x: x ** 0.5, "pow_neg1": lambda x: x ** -1, "pow_neg2": lambda x: x.pow(-2),
    "softmax": lambda x: x.softmax(-1), "log_softmax": lambda x: x.log_softmax(-1),
    "logsumexp": lambda x: x.logsumexp(-1, keepdim=True), "sum": lambda x: x.sum(-1, keepdim=True),
    "mean": lambda x: x.mean(-1, keepdim=True), "var": lambda x: x.var(-1, keepdim=True),
    "std": lambda x: x.std(-1, keepdim=True), "amax": lambda x: x.amax(-1, keepdim=True),
    "max_dim": lambda x: x.max(-1, keepdim=True).values, "cumsum": lambda x: x.cumsum(-1),
    "clamp": lambda x: x.clamp(-1, 1), "clamp_min": lambda x: x.clamp_min(0.5),
    "nan_to_num": torch.nan_to_num, "sin": torch.sin, "floor": torch.floor,
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]), "softplus": F.softplus,
    "transpose_sum": lambda x: x.t().sum(0), "flip": lambda x: x.flip(-1), "mul2": lambda x: x * 2.5,
    "add1": lambda x: x + 1, "div3": lambda x: x / 3, "rdiv": lambda x: 1 / x, "masked": lambda x: x.masked_fill(x > 0.5, -1.0),
    "where_pos": lambda x: torch.where(x > 0, x, torch.zeros_like(x)), "prod": lambda x: x.prod(-1, keepdim=True),
}
BINARY = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "maximum": torch.maximum,
    "minimum": torch.minimum, "pow": torch.pow, "xy_t": lambda a, b: a @ b.t(),
    "where": lambda a, b: torch.where(a > b, a, b), "cat": lambda a, b: torch.cat([a, b], -1)[..., : a.shape[-1]],
    "addcmul": lambda a, b: torch.addcmul(a, a, b),
}
BOUNDS = [-INF, INF, -0.0, -1e30, -1e4, -100.0, -10.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 10.0, 100.0, 1e4, 1e30]


class Program(nn.Module):
    """vals[k] = op(vals[i], vals[j]) over ``unary``/``binary``; every value is kept
    (``self.vals``) for the attack test (tests/test_certify_attack.py)."""

    unary, binary = UNARY, BINARY

    def __init__(self, steps, n_inputs=1):
        super().__init__()
        self.steps = steps
        self.n_inputs = n_inputs
        gen = torch.Generator().manual_seed(len(steps))
        self.w = nn.Parameter(torch.randn(4, 4, generator=gen) * 0.5)
        self.vals: list = []

    def forward(self, *xs):
        vals = list(xs)
        for op, i, j in self.steps:
            a = vals[i % len(vals)]
            if a.shape != (3, 4):
                a = a.expand(3, 4) if a.shape[-1] == 1 else a.sum(-1, keepdim=True).expand(3, 4)
            if op == "linear":
                vals.append(F.linear(a, self.w))
            elif op in self.unary:
                vals.append(self.unary[op](a))
            else:
                b = vals[j % len(vals)]
                if b.shape != a.shape:
                    b = b.expand_as(a) if b.shape[-1] == 1 else b.sum(-1, keepdim=True).expand_as(a)
                vals.append(self.binary[op](a, b))
        self.vals = vals
        return vals[-1]


OPS = sorted(UNARY) + sorted(BINARY) + ["linear"]


@st.composite
def programs(draw):
    n_inputs = draw(st.integers(1, 2))
    steps = draw(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 8), st.integers(0, 8)), min_size=1, max_size=5))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.float64, torch.float16]))
    ranges = []
    for _ in range(n_inputs):
        lo, hi = sorted(draw(st.lists(st.sampled_from(BOUNDS), min_size=2, max_size=2)))
        if dtype == torch.float16:
            lo, hi = min(max(lo, -1e4), 1e4), max(min(hi, 1e4), -1e4)
        ranges.append((lo, hi))
    return Program(steps, n_inputs), dtype, ranges


def samples(ranges, dtype, n=12, seed=0):
    """Inputs inside the ranges: every corner combination of the inputs, element-wise mixes of
    the corners, uniform draws and the special values 0 and +-1 where they lie inside."""
    gen = torch.Generator().manual_seed(seed)
    shape = (3, 4)
    out = []
    for k in range(n):
        xs = []
        for i, (lo, hi) in enumerate(ranges):
            lo_t = torch.tensor(lo, dtype=torch.float64)
            hi_t = torch.tensor(hi, dtype=torch.float64)
            if k < 2 ** len(ranges):
                x = (hi_t if (k >> i) & 1 else lo_t).expand(shape).clone()
            elif k % 3 == 0:
                x = torch.where(torch.rand(shape, generator=gen) < 0.5, lo_t, hi_t)
            elif k % 3 == 1:
                mid = (lo + hi) / 2 if math.isfinite(lo + hi) else 0.0
                specials = torch.tensor([lo, hi, 0.0, 1.0, -1.0, mid], dtype=torch.float64)
                x = specials[torch.randint(0, 6, shape, generator=gen)].clamp(lo, hi)
            else:
                u = torch.rand(shape, generator=gen, dtype=torch.float64)
                a, b = max(lo, -1e30), min(hi, 1e30)  # an infinite end: draws from its finite part
                a, b = (a, b) if a <= b else (lo, lo)
                x = a + u * (b - a) if math.isfinite(b - a) else a * (1 - u) + b * u
            xs.append(x.to(dtype).clamp(lo, hi))
        out.append(tuple(xs))
    return out


_IDENTITY = {"detach", "alias", "lift_fresh"}  # autograd may or may not save through them


def contains(box, value: torch.Tensor) -> torch.Tensor:
    v = value.detach().to(torch.float64)
    ok = (v >= box.lo) & (v <= box.hi)
    return ok | (torch.isnan(v) & (box.nan > 0))


def check_containment(model, inputs, ranges, dtype, n=12):
    specs = parse_ranges(ranges, inputs)
    analysis, _ = analyse(model, inputs, specs, trace=True)
    boxes = [e for e in analysis.trace if e[0] not in _IDENTITY]
    compared = 0
    for xs in samples(ranges, dtype, n):
        rec = Recorder()
        with rec:
            model(*xs)
        rec.trace = [e for e in rec.trace if e[0] not in _IDENTITY]
        if [n for n, _ in rec.trace] != [n for n, _ in boxes]:
            assert any(v.verdict == "unknown" for v in analysis.sites.values()), (
                [n for n, _ in rec.trace], [n for n, _ in boxes])
            continue  # a different path (data-dependent control flow): not comparable
        compared += 1
        for (name, values), (_, bxs) in zip(rec.trace, boxes, strict=True):
            for v, b in zip(values, bxs, strict=True):
                if b is None or v.is_complex():
                    continue
                ok = contains(b, v)
                assert bool(ok.all()), (
                    f"{name}: value {v[~ok][:4].tolist()} outside its box "
                    f"[{b.lo[~ok][:4].tolist()}, {b.hi[~ok][:4].tolist()}] nan {b.nan[~ok][:4].tolist()}; "
                    f"inputs {[float(x.flatten()[0]) for x in xs]}, ranges {ranges}, {dtype}")
    return compared


def check_verdicts(model, inputs, ranges, dtype, n=12):
    cert = nanpass.certify(model, *inputs, ranges=ranges)
    # a rule proven at every one of its call sites (the recorder does not see sites)
    proven_ops = {v.op for v in cert.verdicts if v.verdict == PROVEN} - {
        v.op for v in cert.verdicts if v.verdict != PROVEN}
    from nanpass._certify import ATEN_RULES

    for xs in samples(ranges, dtype, n):
        rec = Recorder()
        with rec:
            out = model(*xs)
        for name, values in rec.trace:
            rule = ATEN_RULES.get(name.rstrip("_"))
            if rule in proven_ops and all(not v.is_floating_point() or bool(torch.isfinite(v).all()) for v in values):
                continue
            if rule in proven_ops:
                raise AssertionError(f"{rule} proven safe but non-finite on {xs} ({ranges}, {dtype})")
        if cert.proven:
            assert bool(torch.isfinite(out).all()), f"proven, yet output {out} on {xs} ({ranges}, {dtype})\n{cert}"


# -- soundness: the property tests ------------------------------------------------------------


# NANPASS_SOUNDNESS_EXAMPLES=2000 for a long run
_EXAMPLES = int(os.environ.get("NANPASS_SOUNDNESS_EXAMPLES", "60"))


@settings(max_examples=_EXAMPLES, deadline=None)
@given(programs())
def test_soundness_containment(prog):
    model, dtype, ranges = prog
    inputs = tuple(torch.full((3, 4), (lo + hi) / 2 if math.isfinite(lo + hi) else 0.0).clamp(lo, hi).to(dtype)
                   for lo, hi in ranges)
    model = model.to(dtype)
    assert check_containment(model, inputs, ranges, dtype) > 0


@settings(max_examples=_EXAMPLES, deadline=None)
@given(programs())
def test_soundness_verdicts(prog):
    model, dtype, ranges = prog
    inputs = tuple(torch.zeros(3, 4, dtype=dtype).clamp(lo, hi) for lo, hi in ranges)
    check_verdicts(model.to(dtype), inputs, ranges, dtype)


@pytest.mark.parametrize("op", OPS)
@settings(max_examples=8, deadline=None)
@given(lo_hi=st.lists(st.sampled_from(BOUNDS), min_size=2, max_size=2).map(sorted),
       dtype=st.sampled_from([torch.float32, torch.float16]))
def test_transfer_function_sound(op, lo_hi, dtype):
    """Each op alone: its box holds every concrete value for inputs in the range."""
    lo, hi = lo_hi
    if dtype == torch.float16:
        lo, hi = min(max(lo, -1e4), 1e4), max(min(hi, 1e4), -1e4)
    model = Program([(op, 0, 1)], 2).to(dtype)
    ranges = [(lo, hi), (min(lo, 0.5), max(hi, 0.5))]
    inputs = tuple(torch.zeros(3, 4, dtype=dtype).clamp(a, b) for a, b in ranges)
    assert check_containment(model, inputs, ranges, dtype, n=10) > 0


# -- verdicts on small models ------------------------------------------------------------------


class LogRelu(nn.Module):
    def forward(self, x):
        return torch.log(torch.relu(x) + 1)


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def _verdict(cert, op):
    return next(v for v in cert.verdicts if v.op == op)


def test_log_relu_plus_one_proven():
    cert = nanpass.certify(LogRelu(), torch.zeros(2, 3), ranges=(-1, 1))
    assert cert.proven
    v = _verdict(cert, "log")
    assert v.verdict == "proven_safe" and v.grad == "finite"
    assert v.source and v.source.endswith(f"test_certify.py:{LogRelu.forward.__code__.co_firstlineno + 1}")


def test_log_of_unit_interval_unsafe():
    cert = nanpass.certify(Log(), torch.rand(2, 3), ranges=(0, 1))
    assert not cert.proven
    v = _verdict(cert, "log")
    from nanpass._rules import BY_NAME

    assert v.verdict == "unsafe" and "[0, 1]" in v.operands and v.guard == BY_NAME["log"].action
    assert "unsafe" in str(cert) and "fix" in str(cert)


def test_hardened_model_guarded():
    cert = nanpass.certify(nanpass.harden(Log()), torch.rand(2, 3), ranges=(0, 1))
    assert cert.proven
    assert _verdict(cert, "log").verdict == "guarded"


class LogSoftmaxLoss(nn.Module):
    def forward(self, x):
        return F.nll_loss(F.log_softmax(x, -1), torch.zeros(x.shape[0], dtype=torch.long))


def test_hardened_losses_read_no_value_under_the_analysis():
    """A guard that reads its result back on CPU (a finite loss takes the op's own result)
    reads nothing while certify runs: a read would be control flow (an "unknown" verdict)."""
    cert = nanpass.certify(nanpass.harden(LogSoftmaxLoss()), torch.rand(2, 3), ranges=(-1, 1))
    assert cert.proven, str(cert)
    assert not [v for v in cert.verdicts if v.verdict == "unknown"], str(cert)
    assert {v.op for v in cert.verdicts if v.verdict == "guarded"} >= {"log_softmax", "nll_loss"}


def test_hardened_excluded_op_stays_unsafe():
    cert = nanpass.certify(nanpass.harden(Log(), exclude_ops=["log"]), torch.rand(2, 3), ranges=(0, 1))
    assert not cert.proven and _verdict(cert, "log").verdict == "unsafe"


def test_overflow_flagged():
    class Square(nn.Module):
        def forward(self, x):
            return x * x

    assert nanpass.certify(Square(), torch.ones(3), ranges=(-1e3, 1e3)).proven
    cert = nanpass.certify(Square(), torch.ones(3), ranges=(-1e30, 1e30))
    assert not cert.proven and _verdict(cert, "mul").verdict == "unsafe"
    assert "overflow" in _verdict(cert, "mul").reason


def test_masked_softmax_rows():
    class Attn(nn.Module):
        def forward(self, x, mask):
            return (x + mask).softmax(-1)

    x = torch.zeros(2, 3)
    partly = torch.tensor([[0.0, -INF, 0.0], [-INF, 0.0, 0.0]])
    assert nanpass.certify(Attn(), x, partly, ranges=[(-5, 5), None]).proven
    fully = torch.tensor([[0.0, -INF, 0.0], [-INF, -INF, -INF]])
    cert = nanpass.certify(Attn(), x, fully, ranges=[(-5, 5), None])
    assert _verdict(cert, "softmax").verdict == "unsafe"


def test_mlp_with_layer_norm_and_attention():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 3), nn.LogSoftmax(-1))
    cert = nanpass.certify(model, torch.randn(5, 4), ranges=(-3, 3))
    assert cert.proven, str(cert)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    cert = nanpass.certify(mha, *(torch.randn(1, 4, 8),) * 3, ranges=(-2, 2))
    assert cert.outputs_finite, str(cert)


def test_data_dependent_branch_is_unknown():
    class Branch(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x.log()
            return x

    cert = nanpass.certify(Branch(), torch.ones(3), ranges=(0.5, 1))
    assert cert.proven  # the sum of [0.5, 1] values is certainly > 0: no branch on the data
    cert = nanpass.certify(Branch(), torch.ones(3), ranges=(-1, 1))
    assert not cert.proven and any(v.verdict == "unknown" for v in cert.verdicts)


def test_to_json_and_str():
    import json

    cert = nanpass.certify(Log(), torch.rand(2), ranges=(0, 1))
    d = json.loads(cert.to_json())
    assert d["proven"] is False and d["verdicts"][0]["op"] == "log" and d["verdicts"][0]["verdict"] == "unsafe"
    assert "NOT PROVEN" in str(cert)


@pytest.mark.parametrize("ranges,match", [
    (None, "needs ranges"), ("huge", "unknown range 'huge'"), ((1, 0), "lo <= hi"),
    ([(0, 1), (0, 1)], "2 entries for 1"), ((float("nan"), 1), "no NaN"), ([(0, 1, 2)], "bad range"),
])
def test_bad_ranges(ranges, match):
    with pytest.raises(nanpass.ConfigError, match=match) as e:
        nanpass.certify(Log(), torch.rand(2), ranges=ranges)
    assert str(e.value).startswith("nanpass:") and "valid" in str(e.value) or "ranges=" in str(e.value)


def test_finite_range_and_per_element_bounds():
    cert = nanpass.certify(Log(), torch.rand(2), ranges="finite")
    assert not cert.proven
    cert = nanpass.certify(Log(), torch.rand(2), ranges=[(torch.tensor([0.5, 1.0]), torch.tensor([1.0, 2.0]))])
    assert cert.proven


def test_certify_rejects_non_module():
    with pytest.raises(nanpass.NanpassTypeError, match="nanpass: certify takes an nn.Module"):
        nanpass.certify(torch.log, torch.rand(2), ranges=(0, 1))


def test_cli_certify_in_process(tmp_path, capsys):
    from nanpass._cli import main

    path = tmp_path / "m.py"
    path.write_text("import torch\n\n\nclass Net(torch.nn.Module):\n    def forward(self, x):\n"
                    "        return torch.log(x)\n")
    assert main(["scan", f"{path}:Net", "--input-shape", "3", "--certify", "--ranges", "0.5,2"]) == 0
    assert "PROVEN" in capsys.readouterr().out
    assert main(["scan", f"{path}:Net", "--input-shape", "3", "--certify", "--ranges", "0,2"]) == 1
    assert "unsafe" in capsys.readouterr().out
    assert main(["scan", f"{path}:Net", "--input-shape", "3", "--certify", "--ranges", "0,2", "--hardened"]) == 0
    assert main(["scan", f"{path}:Net", "--input-shape", "3", "--certify"]) == 2
    assert "needs --ranges" in capsys.readouterr().err
