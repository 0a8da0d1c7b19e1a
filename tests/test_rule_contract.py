"""The guard contract for every guarded rule, driven by the operands the rule carries
(``Rule.sample``), in every dtype, eager and compiled (aot_eager):

1. ``bad`` operands break the original op; the guard gives finite values, finite gradients
   and finite second derivatives;
2. ``good`` operands lie in the safe domain: the guard returns the original's value and
   gradient, bit for bit in eager (to rounding compiled, where the compiler may fuse).

A new rule is covered here by its ``sample``; tests/test_contract.py adds hypothesis tests
over random operands for the op families.
"""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import nanpass
from nanpass._config import make_config
from nanpass._guards import finite_call as g_finite_call
from nanpass._rules import RULES
from nanpass._selfcheck import NO_SAMPLE, callables, spelling
from nanpass._selfcheck import finite as _finite
from nanpass._selfcheck import floats as _floats
from nanpass._selfcheck import grads as _grads
from nanpass._selfcheck import leaves as _leaves
from nanpass._selfcheck import seconds as _seconds
from tests.helpers import bits

CONFIG = make_config()


def _implementation(guard) -> tuple:
    """A guard's code: its function, and the functions its factory closed over (``clamped``
    with ``at_zero`` is other code than ``clamped`` alone; its constants are not)."""
    cells = [c.cell_contents for c in (guard.__closure__ or ())]
    return guard.__qualname__, tuple(sorted(c.__qualname__ for c in cells if hasattr(c, "__qualname__")))


def _fast_compiled(rule) -> bool:
    """Compiled cases are a compile each (~0.5 s): the fast tier compiles each guard
    implementation once, for the first rule that uses it, in float32; the slow tier compiles
    every rule, in float16 too."""
    first = {}
    for r in RULES:
        if r.guarded and r.name not in NO_SAMPLE and torch.float32 in r.sample.dtypes:
            first.setdefault(_implementation(r.guard), r.name)
    return first.get(_implementation(rule.guard)) == rule.name


def _cases(compiled: bool):
    for rule in RULES:
        if rule.guarded and rule.name not in NO_SAMPLE:
            for dtype in rule.sample.dtypes:
                if compiled and dtype not in (torch.float16, torch.float32):
                    continue
                slow = compiled and (dtype == torch.float16 or not _fast_compiled(rule))
                marks = [pytest.mark.slow] if slow else []
                yield pytest.param(rule, dtype, compiled, marks=marks,
                                   id=f"{rule.name}-{str(dtype)[6:]}-{'compiled' if compiled else 'eager'}")


CASES = [*_cases(False), *_cases(True)]
# compiled identity (to rounding) is the slow tier's: the fast tier compiles the finiteness cases
GOOD_CASES = [pytest.param(*c.values, marks=[*c.marks, pytest.mark.slow], id=c.id) if c.values[2] else c
              for c in CASES]


def _callables(rule, dtype, compiled: bool):
    """(guarded, original): both take the sample's operands."""
    guarded, original = callables(rule, dtype, CONFIG.consts(rule.name) if rule.constants else None)
    if compiled:
        guarded = torch.compile(guarded, backend="aot_eager", fullgraph=False)
    return guarded, original


@pytest.mark.parametrize("rule,dtype,compiled", CASES)
def test_bad_operands_give_finite_values_and_derivatives(rule, dtype, compiled):
    guarded, original = _callables(rule, dtype, compiled)
    # an op whose values and gradients are finite may still break in its second derivative
    # (sinc, copysign, mish): the sample then breaks that
    args, kwargs = rule.sample.bad(dtype)
    outs, leaves, grads = _grads(original, args, kwargs, create_graph=rule.sample.second_order)
    assert not _finite(outs + grads + _seconds(grads, leaves)), (
        f"the sample for {rule.name} does not break the original op")

    args, kwargs = rule.sample.bad(dtype)
    # torch.compile's aot_autograd has no double backward: second derivatives are eager's
    second = not compiled and rule.sample.second_order
    outs, leaves, grads = _grads(guarded, args, kwargs, create_graph=second)
    assert _finite(outs), f"{rule.name}: non-finite value {outs}"
    assert _finite(grads), f"{rule.name}: non-finite gradient {grads}"
    # second derivatives (a gradient penalty, forces as -dE/dx): finite too
    hess = _seconds(grads, leaves) if second else []
    assert _finite(hess), f"{rule.name}: non-finite second derivative {hess}"


@pytest.mark.parametrize("rule,dtype,compiled", GOOD_CASES)
def test_good_operands_are_left_as_they_are(rule, dtype, compiled):
    guarded, original = _callables(rule, dtype, compiled)
    args, kwargs = rule.sample.good(dtype)
    ref, _, ref_grads = _grads(original, args, kwargs)
    assert _finite(ref + ref_grads), f"the good sample for {rule.name} is not in the safe domain"
    args, kwargs = rule.sample.good(dtype)
    outs, _, grads = _grads(guarded, args, kwargs)
    for got, want in zip(outs + grads, ref + ref_grads, strict=True):
        if compiled:
            torch.testing.assert_close(got, want)
        else:
            assert torch.equal(bits(got), bits(want)), f"{rule.name}: {got} != {want}"


def test_every_guarded_rule_carries_operands():
    assert all(r.sample is not None for r in RULES if r.guarded and r.name not in NO_SAMPLE)


@pytest.mark.parametrize("upstream", [float("inf"), float("nan")], ids=["inf", "nan"])
@pytest.mark.parametrize("rule,dtype,compiled", GOOD_CASES)
def test_a_non_finite_upstream_gradient_passes_through(rule, dtype, compiled, upstream):
    """Exact backward: a loss-scale overflow (inf) or a NaN already in the gradient reaches the
    operands as it would without the guard, for GradScaler and StepGuard to see; the guard
    zeroes only its own op's singular derivative (the bad-operand test above)."""
    guarded, original = _callables(rule, dtype, compiled)
    masks = []
    for fn in (original, guarded):
        args, kwargs = rule.sample.good(dtype)
        outs = [o for o in _floats(fn(*args, **kwargs)) if o.requires_grad]
        leaves = _leaves(args, kwargs)
        grads = torch.autograd.grad(outs, leaves, [torch.full_like(o, upstream) for o in outs], allow_unused=True)
        masks.append([None if g is None else ~torch.isfinite(g) for g in grads])
    for want, got in zip(*masks, strict=True):
        if want is not None:
            assert got is not None and torch.equal(got, want), f"{rule.name}: non-finite {want} became {got}"


OVERFLOW_CASES = [pytest.param(*c.values, marks=c.marks, id=c.id) for c in CASES
                  if c.values[0].sample.backward_overflow is not None]


@pytest.mark.parametrize("rule,dtype,compiled", OVERFLOW_CASES)
def test_a_gradient_the_ops_own_backward_overflows_is_left_for_gradscaler(rule, dtype, compiled):
    """Issue 39 item 6: the one non-finite gradient a guard leaves (docs/guards.md). Finite
    operands, a finite value and a finite upstream gradient, and the plain backward overflows (a
    float16 product's grad_out @ B^T past max, where a too-large loss scale first shows): the
    guard's value and gradients are the original's, the infinity included, so GradScaler and
    StepGuard see it; check mode names the op's backward."""
    guarded, original = _callables(rule, dtype, compiled)
    args, kwargs = rule.sample.backward_overflow(dtype)
    assert _finite([a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)])
    ref, _, ref_grads = _grads(original, args, kwargs)
    assert _finite(ref) and not _finite(ref_grads), f"the backward_overflow operands of {rule.name} do not overflow"
    outs, _, grads = _grads(guarded, *rule.sample.backward_overflow(dtype))
    for got, want in zip(outs + grads, ref + ref_grads, strict=True):
        assert torch.equal(bits(got), bits(want)), f"{rule.name}: {got} != {want}"
    if compiled:
        return

    class Call(torch.nn.Module):
        def forward(self, *a, **k):
            return original(*a, **k)

    args, kwargs = rule.sample.backward_overflow(dtype)
    with pytest.raises(nanpass.NonFiniteError, match=rf"^nanpass: non-finite gradient created by the backward of "
                       rf"{re.escape(spelling(rule).name)} in <root> \(Call\)[^\n]*\n  from a finite gradient"):
        nanpass.harden(Call(), mode="check")(*args, **kwargs).float().sum().backward()


@pytest.mark.inductor
@pytest.mark.parametrize("name", ["div", "log", "sqrt", "softmax", "cross_entropy"])
def test_a_sample_under_real_inductor(name):
    """Inductor generates its own kernels for the guards (clamp/where forms under compile): the
    bad operands stay finite and the good ones match the original to rounding."""
    rule = next(r for r in RULES if r.name == name)
    guarded, original = _callables(rule, torch.float32, compiled=False)
    guarded = torch.compile(guarded, backend="inductor")
    outs, _, grads = _grads(guarded, *rule.sample.bad(torch.float32))
    assert _finite(outs + grads), f"{name} under inductor: {outs} {grads}"
    ref, _, ref_grads = _grads(original, *rule.sample.good(torch.float32))
    got, _, got_grads = _grads(guarded, *rule.sample.good(torch.float32))
    for a, b in zip(got + got_grads, ref + ref_grads, strict=True):
        torch.testing.assert_close(a, b)


# -- random operands -----------------------------------------------------------------------

def _extremal(dtype):
    """Finite values of the census's ordinary and large tiers (docs/census.md): past those
    (+-sqrt(max), +-max) ordinary arithmetic overflows on its own, out of op-guard scope."""
    fi = torch.finfo(dtype)
    big = float(int(2 * torch.log(torch.tensor(fi.max, dtype=torch.float64))))
    vals = [0.0, -0.0, fi.tiny, -fi.tiny, fi.eps, -fi.eps, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, big, -big]
    return st.one_of(st.sampled_from(vals), st.floats(-big, big, width=32 if dtype != torch.float64 else 64))


def _redrawn(data, args, kwargs, dtype):
    """The good operands with every floating value redrawn (shapes, integer operands and
    options kept), so that each op meets its own singular points and random values alike."""
    values = _extremal(dtype)

    def one(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            vals = data.draw(st.lists(values, min_size=a.numel(), max_size=a.numel()))
            return torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(a.shape).requires_grad_(a.requires_grad)
        return a

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


# eager in float32 and float16 (fast tier); compiled (aot_eager, one compile per rule, then
# every example reuses it) in float32 (slow tier)
RANDOM_CASES = [pytest.param(r, d, False, id=f"{r.name}-{str(d)[6:]}-eager",
                             marks=[pytest.mark.slow] if d == torch.float16 else [])
                for r in RULES if r.guarded and r.name not in NO_SAMPLE
                for d in r.sample.dtypes if d in (torch.float32, torch.float16)] + [
                pytest.param(r, torch.float32, True, marks=pytest.mark.slow, id=f"{r.name}-float32-compiled")
                for r in RULES if r.guarded and r.name not in NO_SAMPLE
                and torch.float32 in r.sample.dtypes and r.sample.dynamo]


@pytest.mark.parametrize("rule,dtype,compiled", RANDOM_CASES)
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_operands_give_finite_values_and_derivatives(rule, dtype, compiled, data):
    """Hypothesis over each op's operands (zeros, tinies, ones, exp's overflow point, random):
    the guard's values, gradients and (eager) second derivatives are finite; and a guard that
    runs the op as written (``finite_call``) returns the original's values and gradients
    wherever those are finite (bit for bit eager, to rounding compiled)."""
    guarded, original = _callables(rule, dtype, compiled=compiled)
    args, kwargs = _redrawn(data, *rule.sample.good(dtype), dtype)
    fresh = lambda: _redrawn_copy(args, kwargs)  # noqa: E731
    second = rule.sample.second_order and not compiled
    try:  # (create_graph picks torch's twice-differentiable backward formulas: alike for both)
        ref, _, ref_grads = _grads(original, *fresh(), create_graph=second)
    except (RuntimeError, ValueError):
        return  # the op refuses these operands (a target outside [0, 1], a singular solve)
    outs, leaves, grads = _grads(guarded, *fresh(), create_graph=second)
    assert _finite(outs), f"{rule.name}: non-finite value {outs} for {args} {kwargs}"
    assert _finite(grads), f"{rule.name}: non-finite gradient {grads} for {args} {kwargs}"
    if second:
        hess = _seconds(grads, leaves)
        assert _finite(hess), f"{rule.name}: non-finite second derivative {hess} for {args} {kwargs}"
    if rule.guard is g_finite_call and _finite(ref + ref_grads):
        for got, want in zip(outs + grads, ref + ref_grads, strict=True):
            if compiled:
                torch.testing.assert_close(got.detach(), want.detach())
            else:
                assert torch.equal(bits(got.detach()), bits(want.detach())), f"{rule.name}: {got} != {want}"


def _redrawn_copy(args, kwargs):
    def one(a):
        return a.detach().clone().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


# -- the extremal grid (issue 19, item 1) --------------------------------------------------

def _grid(rule, dtype) -> list[float]:
    """Every value where an op or its guard changes behaviour: +-0, +-tiny, subnormals, +-eps,
    +-1, +-max, +-inf, and the rule's own thresholds with their float neighbours."""
    fi = torch.finfo(dtype)
    sub = float(torch.tensor(fi.tiny, dtype=dtype) / 4) if dtype != torch.bfloat16 else fi.tiny / 4
    vals = [0.0, fi.tiny, sub, fi.smallest_normal / 2 ** (fi.bits - 6), fi.eps, 0.5, 1.0, 2.0,
            float(int(2 * torch.log(torch.tensor(fi.max, dtype=torch.float64)))), fi.max, float("inf")]
    if rule.constants:
        for c in CONFIG.consts(rule.name)(dtype).values():
            t = torch.tensor(abs(float(c)), dtype=dtype)
            vals += [float(t), float(torch.nextafter(t, torch.tensor(0.0, dtype=dtype))),
                     float(torch.nextafter(t, torch.tensor(float("inf"), dtype=dtype)))]
    return sorted({v for x in vals for v in (x, -x)}, key=lambda v: (abs(v), v))


def _on_grid(data, args, kwargs, rule, dtype):
    grid = _grid(rule, dtype)

    def one(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            vals = data.draw(st.lists(st.sampled_from(grid), min_size=a.numel(), max_size=a.numel()))
            return torch.tensor(vals, dtype=torch.float64).to(dtype).reshape(a.shape).requires_grad_(a.requires_grad)
        return a

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


# the fast tier draws float32 and float16 operands (each a dtype's grid of its own); the slow
# tier the others; examples per case as the hypothesis profile says (tests/conftest.py)
GRID_CASES = [pytest.param(r, d, id=f"{r.name}-{str(d)[6:]}",
                           marks=[] if d in (torch.float32, torch.float16) else [pytest.mark.slow])
              for r in RULES if r.guarded and r.name not in NO_SAMPLE for d in r.sample.dtypes]


@pytest.mark.parametrize("rule,dtype", GRID_CASES)
@settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_the_extremal_grid_keeps_the_originals_bits(rule, dtype, data):
    """Wherever the original's values and gradients are finite, also at +-max, +-inf,
    subnormals and the guard's own thresholds, the guard returns the same bits (x ** -0.5 at
    +inf is 0, not sat). Every guarded rule, every dtype, eager; operands from the grid."""
    guarded, original = _callables(rule, dtype, compiled=False)
    args, kwargs = _on_grid(data, *rule.sample.good(dtype), rule, dtype)
    try:
        ref, _, ref_grads = _grads(original, *_redrawn_copy(args, kwargs))
    except (RuntimeError, ValueError):
        return  # the op refuses these operands (a target outside [0, 1], a singular solve)
    if not _finite(ref + ref_grads):
        return
    outs, _, grads = _grads(guarded, *_redrawn_copy(args, kwargs))
    for got, want in zip(outs + grads, ref + ref_grads, strict=True):
        assert torch.equal(bits(got.detach()), bits(want.detach())), (
            f"{rule.name} ({str(dtype)[6:]}) at {args} {kwargs}: guard {got} != original {want}")


def _fanned_out(fn, args, kwargs):
    """The op's gradient into each operand summed with two more uses of it, as in a model (e3nn:
    ``F.normalize(vec)`` beside ``vec.norm()``): autograd adds the contributions in the order
    its nodes run, so a guard that adds a node between the operand and a use inside the op
    changes that order, and the gradient's last bit (issue 28, item 3)."""
    torch.manual_seed(0)
    outs = _floats(fn(*args, **kwargs))
    leaves = _leaves(args, kwargs)
    loss = sum(o.float().sum() for o in outs if o.requires_grad)
    for x in leaves:
        loss = loss + (x.sin() * 0.37).float().sum() + (x * x.tanh()).float().sum()
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves, strict=True)]


EAGER_CASES = [c for c in CASES if not c.values[2]]


@pytest.mark.parametrize("rule,dtype,compiled", EAGER_CASES)
def test_an_operand_that_fans_out_keeps_the_originals_gradient_bits(rule, dtype, compiled):
    guarded, original = _callables(rule, dtype, compiled)
    want = _fanned_out(original, *rule.sample.good(dtype))
    got = _fanned_out(guarded, *rule.sample.good(dtype))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(bits(g), bits(w)), f"{rule.name}: {g} != {w}"


@pytest.mark.parametrize("rule,dtype,compiled", [c for c in CASES if not c.values[2]])
def test_two_stand_ins_multiplied_and_added_stayfinite(rule, dtype, compiled):
    """Issue 28 item 2: where the original is not finite the guard's value is a stand-in whose
    square is at most max / 16 (sat, or log2(0)'s -44 in float16), so the ordinary arithmetic after two guards
    (``d[row] * w * d[col]``, a product plus a residual) stays finite; every finite value of
    the original is its own (test_good_operands_are_left_as_they_are)."""
    from nanpass._constants import bounds

    guarded, original = _callables(rule, dtype, compiled)
    with torch.no_grad():
        want = _floats(original(*rule.sample.bad(dtype)[0], **rule.sample.bad(dtype)[1]))
        got = _floats(guarded(*rule.sample.bad(dtype)[0], **rule.sample.bad(dtype)[1]))
    for g, w in zip(got, want, strict=True):
        stand_in = g[~torch.isfinite(w)] if g.shape == w.shape else g
        room = bounds(g.dtype).max / 16
        assert (stand_in.double() ** 2 <= room).all(), f"{rule.name}: {stand_in} squared past {room}"
        product = stand_in * stand_in.flip(0)
        assert torch.isfinite(product + product + product * 2).all(), f"{rule.name}: {product}"


# -- a loss over an empty selection (issue 39, item 1) ---------------------------------------

def _through(shape, dtype, weights):
    """A zero-size operand made from a non-empty leaf (a model's weight): its gradient is the
    one a loss over no element must leave finite and zero."""
    w = torch.linspace(0.5, 1.5, shape[-1] if len(shape) > 1 else 1, dtype=dtype).requires_grad_()
    weights.append(w)
    return torch.zeros(shape, dtype=dtype) * w


def _index(shape, high=1):
    return torch.zeros(shape, dtype=torch.int64).clamp(max=high)


# every torch.nn.functional loss on a batch of no sample: (args, kwargs) in a dtype, with the
# weights its float operands are made from
EMPTY_LOSSES = {
    "binary_cross_entropy": lambda d, w: ((_through((0,), d, w).sigmoid(), torch.full((0,), 0.5, dtype=d)), {}),
    "binary_cross_entropy_with_logits": lambda d, w: ((_through((0,), d, w), torch.full((0,), 0.5, dtype=d)), {}),
    "cosine_embedding_loss": lambda d, w: ((_through((0, 3), d, w), _through((0, 3), d, w),
                                            torch.ones(0, dtype=d)), {}),
    "cross_entropy": lambda d, w: ((_through((0, 3), d, w), _index((0,))), {}),
    "ctc_loss": lambda d, w: ((_through((2, 0, 3), d, w).log_softmax(-1), _index((0, 1)), _index((0,)),
                               _index((0,))), {}),
    "gaussian_nll_loss": lambda d, w: ((_through((0,), d, w), _through((0,), d, w), torch.ones(0, dtype=d)), {}),
    "hinge_embedding_loss": lambda d, w: ((_through((0,), d, w), torch.ones(0, dtype=d)), {}),
    "huber_loss": lambda d, w: ((_through((0,), d, w), _through((0,), d, w)), {}),
    "kl_div": lambda d, w: ((_through((0, 3), d, w).log_softmax(-1), torch.full((0, 3), 0.5, dtype=d)), {}),
    "l1_loss": lambda d, w: ((_through((0,), d, w), _through((0,), d, w)), {}),
    "linear_cross_entropy": lambda d, w: ((_through((0, 3), d, w), _through((4, 3), d, w), _index((0,))), {}),
    "margin_ranking_loss": lambda d, w: ((_through((0,), d, w), _through((0,), d, w), torch.ones(0, dtype=d)), {}),
    "mse_loss": lambda d, w: ((_through((0,), d, w), _through((0,), d, w)), {}),
    "multi_margin_loss": lambda d, w: ((_through((0, 3), d, w), _index((0,))), {}),
    "multilabel_margin_loss": lambda d, w: ((_through((0, 3), d, w), _index((0, 3))), {}),
    "multilabel_soft_margin_loss": lambda d, w: ((_through((0, 3), d, w), torch.full((0, 3), 0.5, dtype=d)), {}),
    "nll_loss": lambda d, w: ((_through((0, 3), d, w).log_softmax(-1), _index((0,))), {}),
    "poisson_nll_loss": lambda d, w: ((_through((0,), d, w), torch.full((0,), 0.5, dtype=d)), {}),
    "smooth_l1_loss": lambda d, w: ((_through((0,), d, w), _through((0,), d, w)), {}),
    "soft_margin_loss": lambda d, w: ((_through((0,), d, w), torch.ones(0, dtype=d)), {}),
    "triplet_margin_loss": lambda d, w: ((_through((0, 3), d, w), _through((0, 3), d, w), _through((0, 3), d, w)), {}),
    "triplet_margin_with_distance_loss": lambda d, w: ((_through((0, 3), d, w), _through((0, 3), d, w),
                                                        _through((0, 3), d, w)), {}),
}


def _functional_losses() -> set[str]:
    F = torch.nn.functional
    return {n for n in dir(F) if not n.startswith("_") and callable(getattr(F, n))
            and (n.endswith("_loss") or n in ("cross_entropy", "binary_cross_entropy",
                                              "binary_cross_entropy_with_logits", "kl_div",
                                              "linear_cross_entropy"))}


def test_every_functional_loss_is_a_guarded_spelling_with_empty_operands():
    """A loss torch adds fails here until it is listed (and guarded where it averages)."""
    losses = _functional_losses()
    assert losses <= set(EMPTY_LOSSES), sorted(losses - set(EMPTY_LOSSES))
    spelled = {sp.name for r in RULES if r.guarded for sp in r.spellings()}
    assert {f"F.{n}" for n in losses} <= spelled, sorted({f"F.{n}" for n in losses} - spelled)


def _loss_rule(name: str):
    return next(r for r in RULES if r.guarded and any(sp.name == f"F.{name}" for sp in r.spellings()))


def _empty_loss_cases():
    for name in sorted(EMPTY_LOSSES):
        reductions = ("mean", "sum", "none") + (("batchmean",) if name == "kl_div" else ())
        for reduction in reductions:
            for capture, dtype in (("harden", torch.float32), ("harden", torch.float16),
                                   ("backend", torch.float32)):
                slow = capture == "backend" and reduction != "mean"
                yield pytest.param(name, reduction, capture, dtype, marks=[pytest.mark.slow] if slow else [],
                                   id=f"{name}-{reduction}-{capture}-{str(dtype)[6:]}")


class _Loss(torch.nn.Module):
    def __init__(self, name, reduction):
        super().__init__()
        self.name, self.reduction = name, reduction

    def forward(self, *args):
        return getattr(torch.nn.functional, self.name)(*args, reduction=self.reduction)


@pytest.mark.parametrize("name,reduction,capture,dtype", list(_empty_loss_cases()))
def test_a_loss_over_an_empty_selection_is_finite(name, reduction, capture, dtype):
    """Every ``torch.nn.functional`` loss on a batch of no sample (a depth loss with no valid
    pixel, pytorch#50224), in each reduction, under harden and the backend: 0 (no element for
    'none'), and the gradient of every weight its operands come from zero."""
    import nanpass

    if not hasattr(torch.nn.functional, name):
        pytest.skip(f"torch {torch.__version__} has no F.{name}")
    model = _Loss(name, reduction)

    def run(m):
        weights = []
        args, kwargs = EMPTY_LOSSES[name](dtype, weights)
        out = m(*args, **kwargs)
        grads = torch.autograd.grad(out.float().sum(), weights, allow_unused=True)
        return out, [torch.zeros_like(w) if g is None else g for g, w in zip(grads, weights, strict=True)]

    try:
        want, want_grads = run(model)
    except (RuntimeError, NotImplementedError) as e:  # torch refuses them (ctc_loss: an empty batch) or the dtype
        pytest.skip(f"F.{name} in {dtype}: {e}"[:200])
    rule = _loss_rule(name)
    if capture == "backend":
        # (where dynamo graph-breaks inside the loss, it runs eagerly, guarded as the backend's
        # eager calls are)
        got, grads = run(torch.compile(model, backend=nanpass.backend(inner="aot_eager")))
    else:
        got, grads = run(nanpass.harden(model))
    assert _finite([got]), f"F.{name}(reduction={reduction!r}) over no element: {got}"
    for g in grads:
        assert torch.equal(g, torch.zeros_like(g)), f"F.{name}: a weight's gradient {g}"
    # reduced to one value: the sum over no element, +0 (multi_margin_loss's kernel returns
    # memory it never wrote); 'none': no element, as the original
    assert got.shape == want.shape and torch.equal(bits(got), bits(torch.zeros_like(want))), (got, want)


@pytest.mark.parametrize("call,shape", [
    (lambda F, x, y: F.mse_loss(x, y, None, None, "mean"), ()),
    (lambda F, x, y: F.mse_loss(x, y, size_average=True), ()),
    (lambda F, x, y: F.mse_loss(x, y, size_average=False), ()),
    (lambda F, x, y: F.mse_loss(x, y, reduce=False), (0,)),
    (lambda F, x, y: F.huber_loss(x, y, "mean"), ()),
    (lambda F, x, y: torch.nn.MSELoss()(x, y), ()),
    (lambda F, x, y: torch.nn.L1Loss(reduction="sum")(x, y), ()),
], ids=["positional", "size_average", "size_average-false", "reduce-false", "huber-positional", "module",
        "module-sum"])
def test_a_loss_over_no_element_reads_its_reduction_however_spelled(call, shape):
    import warnings

    import nanpass

    class Loss(torch.nn.Module):
        def forward(self, x, y):
            return call(torch.nn.functional, x, y)

    x = torch.zeros(0, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # size_average and reduce are deprecated
        out = nanpass.harden(Loss())(x, torch.zeros(0))
    assert out.shape == shape and torch.equal(bits(out), bits(torch.zeros(shape))), out
    (g,) = torch.autograd.grad(out.sum(), x)
    assert g.shape == (0,)
