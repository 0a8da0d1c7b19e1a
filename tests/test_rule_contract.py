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

import pytest
import torch

from nanpass._config import make_config
from nanpass._rewrite import make_guard
from nanpass._rules import RULES
from tests.helpers import bits

CONFIG = make_config()
# inference fast paths, reached only as dynamo captures nn.MultiheadAttention in eval + no_grad:
# their operands are a dozen internals, tested as such in test_contract.py
NO_SAMPLE = {"mha_fast_path", "encoder_layer_fast_path"}


def _spelling(rule):
    kind = "module" if rule.name == "multi_head_attention" else "function"
    return next(s for s in rule.spellings() if s.kind == kind)


def _cases(compiled: bool):
    for rule in RULES:
        if rule.guarded and rule.name not in NO_SAMPLE:
            # compiled: each case is a compile; float32 in the fast tier, float16 in the slow one
            for dtype in rule.sample.dtypes:
                if compiled and dtype not in (torch.float16, torch.float32):
                    continue
                marks = [pytest.mark.slow] if compiled and dtype == torch.float16 else []
                yield pytest.param(rule, dtype, compiled, marks=marks,
                                   id=f"{rule.name}-{str(dtype)[6:]}-{'compiled' if compiled else 'eager'}")


CASES = [*_cases(False), *_cases(True)]
# compiled identity (to rounding) is the slow tier's: the fast tier compiles the finiteness cases
GOOD_CASES = [pytest.param(*c.values, marks=[*c.marks, pytest.mark.slow], id=c.id) if c.values[2] else c
              for c in CASES]


def _callables(rule, dtype, compiled: bool):
    """(guarded, original): both take the sample's operands."""
    sp = _spelling(rule)
    g = make_guard(rule, sp, CONFIG.consts(rule.name) if rule.constants else None)
    if sp.kind == "module":
        torch.manual_seed(0)
        mod = sp.target(*rule.sample.ctor[sp.name]).to(dtype)

        def guarded(*a, **k):
            return g(mod, *a, **k)

        original = mod
    else:
        guarded, original = g, sp.call
    if compiled:
        guarded = torch.compile(guarded, backend="aot_eager", fullgraph=False)
    return guarded, original


def _floats(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]


def _leaves(args, kwargs):
    seen, out = set(), []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.requires_grad and id(a) not in seen:
            seen.add(id(a))
            out.append(a)
    return out


def _grads(fn, args, kwargs, create_graph=False):
    torch.manual_seed(0)  # ops that sample (gumbel_softmax) draw the same noise each run
    outs = _floats(fn(*args, **kwargs))
    leaves = _leaves(args, kwargs)
    loss = sum(o.float().sum() for o in outs if o.requires_grad)
    grads = torch.autograd.grad(loss, leaves, create_graph=create_graph, allow_unused=True)
    return outs, leaves, [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves, strict=True)]


def _finite(ts) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


@pytest.mark.parametrize("rule,dtype,compiled", CASES)
def test_bad_operands_give_finite_values_and_derivatives(rule, dtype, compiled):
    guarded, original = _callables(rule, dtype, compiled)
    args, kwargs = rule.sample.bad(dtype)
    outs, _, grads = _grads(original, args, kwargs)
    assert not _finite(outs + grads), f"the sample for {rule.name} does not break the original op"

    args, kwargs = rule.sample.bad(dtype)
    # torch.compile's aot_autograd has no double backward: second derivatives are eager's
    second = not compiled and rule.sample.second_order
    outs, leaves, grads = _grads(guarded, args, kwargs, create_graph=second)
    assert _finite(outs), f"{rule.name}: non-finite value {outs}"
    assert _finite(grads), f"{rule.name}: non-finite gradient {grads}"
    # second derivatives (a gradient penalty, forces as -dE/dx): finite too
    seconds = [g for g in grads if g.requires_grad and second]
    if seconds:
        hess = torch.autograd.grad(sum(g.float().sum() for g in seconds), leaves, allow_unused=True)
        assert _finite([h for h in hess if h is not None]), f"{rule.name}: non-finite second derivative {hess}"


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
