"""A NaN from upstream stays NaN (issue 44, item 2).

A guard changes only what its own op makes non-finite from finite or infinite operands: a NaN
that arrives as an operand (a NaN parameter, a NaN in the data) gives NaN wherever the plain op
gives NaN, so the user, GradScaler, StepGuard and check mode still see it. Driven by the rule
table, as tests/test_rule_contract.py is: each guarded rule's ``good`` operands with one NaN at
index 0 of the first floating operand, in every dtype the sample covers; the guard must give
NaN at the very positions where the plain op does, in its values and (where the plain gradient
is NaN) in its gradients, eager, under ``nanpass.harden``, and compiled by the backend.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import nanpass
from nanpass._rules import BY_NAME, RULES
from nanpass._selfcheck import NO_SAMPLE, spelling
from nanpass._selfcheck import floats as _floats
from nanpass._selfcheck import grads as _grads
from tests.conftest import DTYPES
from tests.test_rule_contract import _callables, _fast_compiled

NAN = float("nan")
GUARDED = [r for r in RULES if r.guarded and r.name not in NO_SAMPLE]


def _short(dtype: torch.dtype) -> str:
    return str(dtype)[6:]


CASES = [pytest.param(r, d, id=f"{r.name}-{_short(d)}") for r in GUARDED for d in r.sample.dtypes]


def _with_nan(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The operands with a NaN at index 0 of the first floating tensor (args, then kwargs)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_floating_point() and a.numel():
            with torch.no_grad():
                a[(0,) * a.dim()] = NAN
            break
    return args, kwargs


def _operands(rule, dtype):
    return _with_nan(*rule.sample.good(dtype))


def _plain(rule, dtype, original=None):
    """The plain op's outputs and gradients on the NaN operands; skips where the plain op
    refuses a NaN (binary_cross_entropy: "all elements of input should be between 0 and 1")
    or makes no NaN of it."""
    if original is None:
        _, original = _callables(rule, dtype, compiled=False)
    try:
        outs, _, grads = _grads(original, *_operands(rule, dtype))
    except (RuntimeError, ValueError) as e:
        pytest.skip(f"the plain {rule.name} refuses a NaN operand: {str(e).splitlines()[0][:120]}")
    if not any(bool(torch.isnan(o).any()) for o in outs):
        pytest.skip(f"the plain {rule.name} gives no NaN for a NaN at index 0")
    return outs, grads


def _assert_same_nans(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} results, the plain op {len(want)}"
    for g, w in zip(got, want, strict=True):
        g, w = g.detach(), w.detach()
        assert g.shape == w.shape, f"{what}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.equal(torch.isnan(g), torch.isnan(w)), (
            f"{what}: NaN at {torch.isnan(g).nonzero().tolist()}, the plain op's at "
            f"{torch.isnan(w).nonzero().tolist()} ({g} vs {w})")


# -- the guard itself, eager ----------------------------------------------------------------

@pytest.mark.parametrize("rule,dtype", CASES)
def test_a_nan_operand_gives_nan_where_the_plain_op_does(rule, dtype):
    """Values first (with and without a gradient to take), then, where the plain op's gradient
    is NaN (the NaN element's own, or a whole reduction's), the gradient: promise 3 for a NaN
    operand, NaN at the same positions, not zeroed."""
    want, want_grads = _plain(rule, dtype)
    guarded, _ = _callables(rule, dtype, compiled=False)
    args, kwargs = _operands(rule, dtype)
    with torch.no_grad():
        got = _floats(guarded(*args, **kwargs))
    _assert_same_nans(got, want, f"{rule.name} ({_short(dtype)}), no grad")
    got, _, grads = _grads(guarded, *_operands(rule, dtype))
    _assert_same_nans(got, want, f"{rule.name} ({_short(dtype)})")
    if any(bool(torch.isnan(g).any()) for g in want_grads):
        _assert_same_nans(grads, want_grads, f"{rule.name} ({_short(dtype)}) gradient")


# -- through nanpass.harden and the backend -------------------------------------------------

class Call(torch.nn.Module):
    """A tiny model that calls the rule's sample spelling."""

    def __init__(self, rule, dtype):
        super().__init__()
        sp = spelling(rule)
        if sp.kind == "module":
            torch.manual_seed(0)
            self.mod = sp.target(*rule.sample.ctor[sp.name]).to(dtype)
        else:
            self.mod = None
            self.call = sp.call

    def forward(self, *args, **kwargs):
        return (self.mod or self.call)(*args, **kwargs)


def _captured(rule, dtype, capture: str):
    model = Call(rule, dtype)
    if capture == "harden":
        return model, nanpass.harden(model)
    if not rule.sample.captured(spelling(rule).name):
        pytest.skip(f"dynamo graph-breaks on {spelling(rule).name}: it runs outside any graph")
    return model, torch.compile(model, backend="nanpass", options={"inner": "aot_eager"})


def _through(rule, dtype, capture: str):
    model, captured = _captured(rule, dtype, capture)
    want, want_grads = _plain(rule, dtype, model)
    got, _, grads = _grads(captured, *_operands(rule, dtype))
    what = f"{rule.name} ({_short(dtype)}, {capture})"
    _assert_same_nans(got, want, what)
    if any(bool(torch.isnan(g).any()) for g in want_grads):
        _assert_same_nans(grads, want_grads, f"{what} gradient")


@pytest.mark.parametrize("rule,dtype", CASES)
def test_a_nan_operand_stays_nan_under_harden(rule, dtype):
    _through(rule, dtype, "harden")


# compiled: a compile each (~0.5 s); the fast tier takes a few guards of different kinds in
# float32 (float16 for the float16-only products and norms), the slow tier every rule and dtype
FAST_COMPILED = {("log", torch.float32), ("div", torch.float32), ("cross_entropy", torch.float32),
                 ("layer_norm", torch.float16), ("linear", torch.float16)}
COMPILED_CASES = [pytest.param(r, d, id=f"{r.name}-{_short(d)}",
                               marks=[] if (r.name, d) in FAST_COMPILED else [pytest.mark.slow])
                  for r in GUARDED for d in r.sample.dtypes if d in (torch.float16, torch.float32)]


@pytest.mark.parametrize("rule,dtype", COMPILED_CASES)
def test_a_nan_operand_stays_nan_compiled(rule, dtype):
    _through(rule, dtype, "backend")


@pytest.mark.slow
@pytest.mark.parametrize("rule,dtype", [c for c in CASES if _fast_compiled(c.values[0])
                                        and c.values[1] == torch.float32])
def test_a_nan_operand_gives_nan_in_the_compiled_guard(rule, dtype):
    """The guard's traced branches (``torch.compiler.is_compiling()``) keep NaN too."""
    want, _ = _plain(rule, dtype)
    guarded, _ = _callables(rule, dtype, compiled=True)
    got, _, _ = _grads(guarded, *_operands(rule, dtype))
    _assert_same_nans(got, want, f"{rule.name} ({_short(dtype)}, compiled guard)")


# -- what one sample per rule does not reach --------------------------------------------------

EXPONENTS = [-3, -2, -1, -0.5, 0.3, 0.5, 1.5, 2, 2.5, 3]


@pytest.mark.parametrize("dtype", DTYPES, ids=_short)
@pytest.mark.parametrize("p", EXPONENTS)
def test_pow_of_a_nan_base_is_nan_for_every_exponent(p, dtype):
    """pow's sample has one exponent; its guard moves the base by the exponent's domain (a
    base moved in from where the power overflows is +-sat): a NaN base is never moved."""
    guarded, original = _callables(BY_NAME["pow"], dtype, compiled=False)
    vals = [NAN, 2.0, 0.0, -1.0, 0.5, torch.finfo(dtype).max]
    want, _, want_grads = _grads(original, (torch.tensor(vals, dtype=dtype, requires_grad=True), p), {})
    got, _, grads = _grads(guarded, (torch.tensor(vals, dtype=dtype, requires_grad=True), p), {})
    assert torch.isnan(got[0][0]) and not torch.isnan(got[0][1:]).any(), got
    assert torch.isnan(grads[0][0]), f"x ** {p}: the NaN base's gradient became {grads[0][0]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=_short)
def test_division_keeps_nan_over_0_and_makes_its_own_nans_0(dtype):
    """NaN / 0 is NaN plain, and stays; 0 / 0, 1 / 0 and inf / inf are the op's own: 0."""
    guarded, _ = _callables(BY_NAME["div"], dtype, compiled=False)
    inf = float("inf")
    x = torch.tensor([NAN, 1.0, inf, 0.0, NAN, 3.0], dtype=dtype)
    d = torch.tensor([0.0, 0.0, inf, 0.0, 2.0, NAN], dtype=dtype)
    got = guarded(x, d)
    assert torch.equal(torch.isnan(got), torch.isnan(x) | torch.isnan(d)), got
    assert torch.equal(got[1:4], torch.zeros(3, dtype=dtype)), got
    got = guarded(x, 0.0)  # a constant 0 divisor
    assert torch.equal(torch.isnan(got), torch.isnan(x)) and torch.isfinite(got[1:4]).all(), got


@pytest.mark.parametrize("name,args,own", [
    ("pow", lambda d: (torch.tensor([NAN, -2.0, 0.0], dtype=d), torch.tensor([1.0, 0.5, -1.0], dtype=d)), [1, 2]),
    ("xlogy", lambda d: (torch.tensor([NAN, float("inf"), 0.0], dtype=d), torch.tensor([2.0, 1.0, NAN], dtype=d)), [1]),
    # no NaN operand: inf * 0 in a float16 product is the op's own NaN
    ("linear", lambda d: (torch.tensor([[float("inf"), 1.0]], dtype=d), torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=d)), [0]),
], ids=["pow", "xlogy", "linear"])
def test_an_operands_nan_stays_and_the_ops_own_becomes_finite(name, args, own):
    """One call with a NaN operand and the op's own NaN (a negative base of a fractional power,
    inf * log(1)): an elementwise guard keeps the plain op's NaN at the NaN operand's positions
    and makes its own finite elsewhere. A guard of an op that is not elementwise (a product)
    tells them apart by whether any operand holds a NaN: with none, its own NaN is finite."""
    rule = BY_NAME[name]
    dtype = rule.sample.dtypes[0]
    guarded, original = _callables(rule, dtype, compiled=False)
    want, got = original(*args(dtype)), guarded(*args(dtype))
    upstream = torch.isnan(want).flatten().clone()
    upstream[own] = False
    assert torch.equal(torch.isnan(got).flatten() & upstream, upstream), (got, want)
    assert torch.isfinite(got.flatten()[own]).all(), got


# -- the cases the issue names ----------------------------------------------------------------

class CrossEntropy(torch.nn.Module):
    def forward(self, logits, target):
        return F.cross_entropy(logits, target, ignore_index=-1)


@pytest.mark.parametrize("capture", ["harden", "backend"])
def test_cross_entropy_of_nan_logits_is_nan(capture):
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits[1, 2] = NAN
    logits.requires_grad_()
    target = torch.tensor([0, 3, 1])
    model = CrossEntropy()
    run = nanpass.harden(model) if capture == "harden" else torch.compile(
        model, backend="nanpass", options={"inner": "aot_eager"})
    loss = run(logits, target)
    assert torch.isnan(loss), loss
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.isnan(g).any(), f"the NaN loss's gradient became finite: {g}"


@pytest.mark.parametrize("capture", ["harden", "backend"])
def test_cross_entropy_with_every_target_ignored_stays_0(capture):
    """The op's own 0 / 0 (a mean over no target) is still the guard's: 0 with a zero gradient."""
    logits = torch.randn(3, 5, generator=torch.Generator().manual_seed(0)).requires_grad_()
    target = torch.full((3,), -1)
    model = CrossEntropy()
    assert torch.isnan(model(logits, target))
    run = nanpass.harden(model) if capture == "harden" else torch.compile(
        model, backend="nanpass", options={"inner": "aot_eager"})
    loss = run(logits, target)
    assert torch.equal(loss, torch.zeros(())), loss
    (g,) = torch.autograd.grad(loss, logits)
    assert torch.equal(g, torch.zeros_like(g)), g


def test_float16_linear_with_a_nan_weight_is_nan_under_harden():
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3).half()
    with torch.no_grad():
        lin.weight[1, 2] = NAN
    x = torch.randn(2, 4).half().requires_grad_()
    want = lin(x)
    (want_grad,) = torch.autograd.grad(want.float().sum(), x)
    assert torch.isnan(want[:, 1]).all() and not torch.isnan(want[:, [0, 2]]).any()
    got = nanpass.harden(lin)(x)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), got
    (grad,) = torch.autograd.grad(got.float().sum(), x)
    assert torch.equal(torch.isnan(grad), torch.isnan(want_grad)), grad
    # a float16 product that overflows (finite operands) still saturates
    with torch.no_grad():
        lin.weight.fill_(60000.0)
    out = nanpass.harden(lin)(torch.full((1, 4), 2.0).half())
    assert torch.isfinite(out).all(), out
