"""The guard contract, property-tested per op and per dtype:

1. finite: for finite or +-inf operands, finite values and finite gradients;
2. identity: inside the safe domain, where the original op's value and gradient are finite,
   the same value and gradient, bit for bit (eager).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import nanpass
from nanpass._config import make_config
from nanpass._constants import bounds, pow_domain
from nanpass._rewrite import make_guard
from nanpass._rules import BY_NAME
from tests.conftest import DTYPES
from tests.helpers import bits

CONFIG = make_config()


def guard(name: str, spelling: str | None = None):
    rule = BY_NAME[name]
    sp = next(s for s in rule.spellings() if s.kind == "function" and (spelling in (None, s.name)))
    return make_guard(rule, sp, CONFIG.consts(name) if rule.constants else None), sp.call


def special(dtype):
    b = bounds(dtype)
    fi = torch.finfo(dtype)
    sub = float(fi.smallest_normal) / 4 if dtype != torch.bfloat16 else 1e-39
    return [0.0, -0.0, 1.0, -1.0, 0.5, 2.0, math.inf, -math.inf, b.tiny, -b.tiny, sub, b.max,
            -b.max, b.eps, 1 - b.eps, b.below_one, b.above_minus_one, 100.0, -100.0, 1e30]


def values(dtype, min_size=1, max_size=12):
    elem = st.one_of(st.floats(allow_nan=False, width=64), st.sampled_from(special(dtype)),
                     st.floats(-10, 10))
    return st.lists(elem, min_size=min_size, max_size=max_size)


def leaf(vals, dtype, shape=None):
    t = torch.tensor(vals, dtype=torch.float64).to(dtype)
    if shape is not None:
        t = t.reshape(shape)
    return t.requires_grad_()


def run(fn, *args, **kwargs):
    leaves = [a for a in args if isinstance(a, torch.Tensor)]
    for x in leaves:
        x.grad = None
    out = fn(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.float().sum() for o in outs).backward()
    return outs, [x.grad if x.grad is not None else torch.zeros_like(x) for x in leaves]


def finite(t):
    return torch.isfinite(t)


def assert_finite(outs, grads):
    for o in outs:
        assert finite(o).all(), f"non-finite value: {o}"
    for g in grads:
        assert finite(g).all(), f"non-finite gradient: {g}"


def assert_same_where(a, b, mask, what):
    a, b = a.expand_as(mask), b.expand_as(mask)
    assert torch.equal(bits(a)[mask], bits(b)[mask]), f"{what} differs on the safe domain:\n{a}\n{b}"


# -- elementwise ops with a closed safe domain -------------------------------------------

ELEMENTWISE = ["log", "log2", "log10", "log1p", "sqrt", "rsqrt", "exp", "exp2", "expm1",
               "acos", "asin", "atanh", "logit", "logsigmoid"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ELEMENTWISE)
@given(data=st.data())
def test_elementwise(name, dtype, data):
    vals = data.draw(values(dtype))
    g, orig = guard(name)
    outs, grads = run(g, leaf(vals, dtype))
    assert_finite(outs, grads)

    # identity inside [lo, hi], where the original value and gradient are finite
    c = CONFIG.consts(name)(dtype)
    x = leaf(vals, dtype)
    (ref,), (ref_grad,) = run(orig, x)
    inside = finite(ref) & finite(ref_grad)
    if "lo" in c:
        inside &= x.detach() >= c["lo"]
    if "hi" in c:
        inside &= x.detach() <= c["hi"]
    assert_same_where(outs[0], ref, inside, "value")
    assert_same_where(grads[0], ref_grad, inside, "gradient")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ELEMENTWISE)
@given(data=st.data())
def test_elementwise_keeps_every_finite_value(name, dtype, data):
    """Promise 1, audited per rule: the forward is the original's wherever its value is finite,
    also where its derivative is not (no cut-off drawn from the derivative), with and without
    a gradient to take."""
    vals = data.draw(values(dtype))
    g, orig = guard(name)
    xs = torch.tensor(vals, dtype=torch.float64).to(dtype)
    ref = orig(xs)
    (out,), _ = run(g, leaf(vals, dtype))
    with torch.no_grad():
        cold = g(xs)
    assert_same_where(out, ref, finite(ref), "value")
    assert_same_where(cold, ref, finite(ref), "value under no_grad")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clamp_bounds_are_dtype_aware(dtype):
    """The textbook constants fail where ours do not: 1e-8 is 0 in float16, 1 - 1e-8 is 1."""
    lo = torch.tensor(1e-8, dtype=torch.float64).to(dtype)
    c = CONFIG.consts("log")(dtype)
    assert c["lo"] > 0 and torch.log(torch.tensor(c["lo"], dtype=dtype)).isfinite()
    if dtype == torch.float16:
        assert lo == 0  # why a fixed 1e-8 is wrong
    hi = CONFIG.consts("logit")(dtype)["hi"]
    assert hi < 1 and torch.logit(torch.tensor(hi, dtype=dtype)).isfinite()


# -- div, reciprocal ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_div(dtype, data):
    n = data.draw(st.integers(1, 10))
    xv = data.draw(values(dtype, n, n))
    dv = data.draw(values(dtype, n, n))
    g, orig = guard("div")
    x, d = leaf(xv, dtype), leaf(dv, dtype)
    outs, grads = run(g, x, d)
    assert_finite(outs, grads)
    assert (outs[0][d.detach() == 0] == 0).all(), "x / 0 must be 0"

    x2, d2 = leaf(xv, dtype), leaf(dv, dtype)
    (ref,), (gx, gd) = run(orig, x2, d2)
    inside = (d2.detach() != 0) & finite(ref) & finite(gx) & finite(gd)
    assert_same_where(outs[0], ref, inside, "value")
    assert_same_where(grads[0], gx, inside, "gradient wrt x")
    assert_same_where(grads[1], gd, inside, "gradient wrt d")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_reciprocal(dtype, data):
    vals = data.draw(values(dtype))
    g, orig = guard("reciprocal")
    outs, grads = run(g, leaf(vals, dtype))
    assert_finite(outs, grads)
    x = leaf(vals, dtype)
    (ref,), (rg,) = run(orig, x)
    inside = (x.detach() != 0) & finite(ref) & finite(rg)
    assert_same_where(outs[0], ref, inside, "value")
    assert_same_where(grads[0], rg, inside, "gradient")


# -- pow ------------------------------------------------------------------------------------

EXPONENTS = [-3, -2, -1, -0.5, 0.3, 0.5, 1.5, 2, 2.5, 3, 0, 1]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", EXPONENTS)
@given(data=st.data())
def test_pow_scalar_exponent(dtype, p, data):
    vals = data.draw(values(dtype))
    g, orig = guard("pow", "torch.pow")
    dom = pow_domain(float(p), dtype)
    outs, grads = run(g, leaf(vals, dtype), p)
    if dom is not None:  # exponents 0 and 1 are left alone: x ** 1 passes an inf through
        assert_finite(outs, grads)
    x = leaf(vals, dtype)
    (ref,), (rg,) = run(orig, x, p)
    xs = x.detach()
    inside = finite(ref) & finite(rg) if dom is not None else torch.ones_like(ref, dtype=torch.bool)
    if dom is not None:
        if dom.away:
            inside &= xs.abs() >= dom.away
        else:
            inside &= (xs >= dom.lo) & (xs <= (dom.hi if dom.hi is not None else math.inf))
    assert_same_where(outs[0], ref, inside, "value")
    assert_same_where(grads[0], rg, inside, "gradient")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [e for e in EXPONENTS if e not in (0, 1)])
@given(data=st.data())
def test_pow_keeps_every_finite_value(dtype, p, data):
    """Promise 1: the forward is the original's wherever its value is finite, also where the
    derivative overflows beside it (float16 1e-4 ** -0.5 is 100, its derivative -5e5); that
    derivative is fenced (0). A negative base of a fractional power (NaN) gives 0, as
    -inf ** p (0 plain) does, so products of two guard outputs stay finite."""
    vals = data.draw(values(dtype))
    g, orig = guard("pow", "torch.pow")
    outs, grads = run(g, leaf(vals, dtype), p)
    assert_finite(outs, grads)
    xs = torch.tensor(vals, dtype=torch.float64).to(dtype)
    ref = orig(xs, p)
    with torch.no_grad():
        cold = g(xs, p)
    for out in (outs[0], cold):
        assert_same_where(out, ref, finite(ref), "value")
        if p < 0 and not float(p).is_integer():
            assert (out[xs < 0] == 0).all()
    prod = outs[0].detach() * outs[0].detach()
    assert finite(prod[ref.isnan() | (ref == 0)]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_pow_tensor_exponent(dtype, data):
    n = data.draw(st.integers(1, 10))
    bv, ev = data.draw(values(dtype, n, n)), data.draw(values(dtype, n, n))
    g, orig = guard("pow", "torch.pow")
    outs, grads = run(g, leaf(bv, dtype), leaf(ev, dtype))
    assert_finite(outs, grads)
    b2, e2 = leaf(bv, dtype), leaf(ev, dtype)
    (ref,), (gb, ge) = run(orig, b2, e2)
    inside = finite(ref) & finite(gb) & finite(ge) & finite(b2.detach()) & finite(e2.detach())
    assert_same_where(outs[0], ref, inside, "value")
    assert_same_where(grads[0], gb, inside, "gradient wrt base")
    assert_same_where(grads[1], ge, inside, "gradient wrt exponent")


# -- softmax family -------------------------------------------------------------------------

ROWWISE = {"softmax": "torch.softmax", "softmin": "F.softmin", "log_softmax": "torch.log_softmax",
           "logsumexp": "torch.logsumexp"}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(ROWWISE))
@given(data=st.data())
def test_rowwise(name, dtype, data):
    rows, cols = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 5))
    vals = data.draw(values(dtype, rows * cols, rows * cols))
    g, orig = guard(name, ROWWISE[name])
    outs, grads = run(g, leaf(vals, dtype, (rows, cols)), dim=-1)
    assert_finite(outs, grads)

    x = leaf(vals, dtype, (rows, cols))
    (ref,), (rg,) = run(orig, x, dim=-1)
    finite_rows = finite(x.detach()).all(-1, keepdim=True)
    out_mask = finite(ref) & finite_rows.expand_as(ref) if ref.dim() == 2 else finite(ref) & finite_rows[:, 0]
    grad_mask = finite_rows.expand_as(rg) & finite(rg)
    assert_same_where(outs[0], ref, out_mask, "value")
    assert_same_where(grads[0], rg, grad_mask & out_mask.reshape(rows, -1).all(-1, keepdim=True), "gradient")


@pytest.mark.parametrize("shape", [(2, 0), (0, 3)], ids=["empty-dim", "no-rows"])
@pytest.mark.parametrize("name", list(ROWWISE))
def test_rowwise_over_zero_size(name, shape):
    """torch's own OpInfo sample: a zero-size tensor (plain softmax returns an empty one, and
    logsumexp over an empty dim -inf, which the guard saturates); the guard must not raise."""
    g, orig = guard(name, ROWWISE[name])
    outs, grads = run(g, leaf([], torch.float32, shape), dim=-1)
    (ref,), (rg,) = run(orig, leaf([], torch.float32, shape), dim=-1)
    assert outs[0].shape == ref.shape and grads[0].shape == rg.shape
    assert_finite(outs, grads)
    if ref.numel() and not finite(ref).all():  # logsumexp over an empty dim: -inf -> -sat
        assert torch.equal(outs[0], torch.full_like(ref, -bounds(ref.dtype).sat))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_masked_rows_keep_their_softmax(dtype):
    """A -inf mask is the safe domain's edge, not outside it: partially masked rows are unchanged."""
    x = torch.tensor([[1.0, -math.inf, 3.0], [-math.inf] * 3], dtype=dtype)
    g, orig = guard("softmax", "torch.softmax")
    out = g(x, -1)
    assert torch.equal(bits(out[0]), bits(orig(x[:1], -1)[0]))
    assert finite(out).all()
    assert torch.allclose(out[1].float(), torch.full((3,), 1 / 3), atol=1e-2)


# -- reductions, xlogy ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,spelling", [("std", "torch.std"), ("var", "torch.var"),
                                           ("std", "torch.std_mean"), ("var", "torch.var_mean")])
@given(data=st.data())
def test_spread(name, spelling, dtype, data):
    vals = data.draw(values(dtype, 1, 8))
    g, orig = guard(name, spelling)
    outs, grads = run(g, leaf(vals, dtype))
    assert_finite(outs, grads)
    x = leaf(vals, dtype)
    refs, (rg,) = run(orig, x)
    ok = len(vals) >= 2 and all(bool(finite(r).all()) for r in refs) and bool(finite(rg).all())
    if ok and bool(finite(x.detach()).all()):
        for o, r in zip(outs, refs, strict=True):
            assert torch.equal(bits(o), bits(r))
        assert torch.equal(bits(grads[0]), bits(rg))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_xlogy(dtype, data):
    n = data.draw(st.integers(1, 10))
    xv, yv = data.draw(values(dtype, n, n)), data.draw(values(dtype, n, n))
    g, orig = guard("xlogy")
    outs, grads = run(g, leaf(xv, dtype), leaf(yv, dtype))
    assert_finite(outs, grads)
    x, y = leaf(xv, dtype), leaf(yv, dtype)
    (ref,), (gx, gy) = run(orig, x, y)
    c = CONFIG.consts("xlogy")(dtype)
    inside = (y.detach() >= c["lo"]) & (y.detach() <= c["hi"]) & finite(ref) & finite(gx) & finite(gy)
    assert_same_where(outs[0], ref, inside, "value")
    assert_same_where(grads[0], gx, inside, "gradient wrt x")
    assert_same_where(grads[1], gy, inside, "gradient wrt y")


# -- composite calls ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", ["cross_entropy", "nll_loss"])
@given(data=st.data())
def test_classification_losses(name, dtype, data):
    n, k = data.draw(st.integers(1, 4)), data.draw(st.integers(2, 4))
    vals = data.draw(values(dtype, n * k, n * k))
    target = torch.tensor(data.draw(st.lists(st.sampled_from([-100, *range(k)]), min_size=n, max_size=n)))
    g, orig = guard(name)
    outs, grads = run(lambda x: g(x, target), leaf(vals, dtype, (n, k)))
    assert_finite(outs, grads)
    x = leaf(vals, dtype, (n, k))
    (ref,), (rg,) = run(lambda x: orig(x, target), x)
    if bool(finite(x.detach()).all() & finite(ref).all() & finite(rg).all()):
        assert torch.equal(bits(outs[0]), bits(ref))
        assert torch.equal(bits(grads[0]), bits(rg))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_kl_div(dtype, data):
    n = data.draw(st.integers(1, 6))
    lp = data.draw(values(dtype, n, n))
    tv = data.draw(st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=n, max_size=n))
    g, orig = guard("kl_div")
    t = torch.tensor(tv, dtype=dtype, requires_grad=True)
    outs, grads = run(lambda x, t: g(x, t, reduction="sum"), leaf(lp, dtype), t)
    assert_finite(outs, grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@given(data=st.data())
def test_cosine_then_acos(dtype, data):
    n = data.draw(st.integers(1, 5))
    a = data.draw(values(dtype, n, n))
    g, orig = guard("cosine_similarity")
    acos, _ = guard("acos")
    outs, grads = run(lambda x: acos(g(x[None], x[None])), leaf(a, dtype))
    assert_finite(outs, grads)
    assert (outs[0].abs() <= math.pi).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("need_weights", [True, False])
def test_mha_fully_padded(dtype, need_weights):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(8, 2).to(dtype)
    q = torch.randn(3, 2, 8, dtype=dtype, requires_grad=True)
    pad = torch.tensor([[True, True, True], [False, True, False]])
    g = make_guard(BY_NAME["multi_head_attention"],
                   next(s for s in BY_NAME["multi_head_attention"].spellings() if s.kind == "module"))
    outs, grads = run(lambda q: g(mha, q, q, q, key_padding_mask=pad, need_weights=need_weights)[0], q)
    assert_finite(outs, grads)
    ref = mha(q, q, q, key_padding_mask=pad, need_weights=need_weights)[0]
    if need_weights:
        assert not finite(ref[:, 0]).all()  # what torch itself gives
    else:  # scaled_dot_product_attention gives the fully padded row 0 itself: all bits kept
        assert torch.equal(bits(outs[0]), bits(ref))
    # the sequence that has a real key is unchanged, bit for bit
    assert torch.equal(bits(outs[0][:, 1]), bits(ref[:, 1]))


def _identity_attention():
    """One head of width 2 whose projections are the identity: scores are q . k exactly."""
    m = torch.nn.MultiheadAttention(2, 1, bias=False).half()
    with torch.no_grad():
        m.in_proj_weight.copy_(torch.eye(2).repeat(3, 1))
        m.out_proj.weight.copy_(torch.eye(2))
    return m


@pytest.mark.parametrize("case", ["score -inf beside -5000", "padded key scoring 21213"])
def test_float16_attention_keeps_the_originals_weights(case):
    """Inside nn.MultiheadAttention a float16 score that overflows to -inf keeps weight 0 (a
    saturated -4094 would beat a finite -5000), and a padded key keeps weight 0 whatever its
    score (a finite stand-in for its -inf mask would lose to a score past it)."""
    import nanpass

    m = _identity_attention()
    v = torch.tensor([[[1.0, 1.0]], [[-5.0, -5.0]]]).half()
    if case.startswith("score"):
        q, k, pad = torch.tensor([[[-100.0, 0.0]]]), torch.tensor([[[70.7, 0.0]], [[990.0, 0.0]]]), None
    else:
        q, k, pad = torch.tensor([[[150.0, 0.0]]]), torch.tensor([[[0.0, 0.0]], [[200.0, 0.0]]]), torch.tensor([[False, True]])
    q, k = q.half(), k.half()
    want = m(q, k, v, key_padding_mask=pad)
    got = nanpass.harden(m)(q, k, v, key_padding_mask=pad)
    assert torch.equal(want[1], torch.tensor([[[1.0, 0.0]]]).half())  # the plain model is finite
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("need_weights", [True, False])
def test_float16_attention_with_finfo_min_masks_keeps_every_bit(need_weights):
    """A Hugging Face style additive mask (finfo.min, not -inf) over a whole row: the plain
    model is finite, and so every bit of outputs, weights and gradients must stay."""
    import nanpass

    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(8, 2).half()
    x = (torch.randn(4, 3, 8) * 4).half().requires_grad_()
    mask = torch.zeros(4, 4, dtype=torch.half)
    mask[0, :] = torch.finfo(torch.half).min
    want = m(x, x, x, attn_mask=mask, need_weights=need_weights)
    got = nanpass.harden(m)(x, x, x, attn_mask=mask, need_weights=need_weights)
    assert torch.isfinite(want[0]).all()
    assert torch.equal(got[0], want[0]) and (not need_weights or torch.equal(got[1], want[1]))
    params = [x, *m.parameters()]
    for a, b in zip(torch.autograd.grad(got[0].float().sum(), params),
                    torch.autograd.grad(want[0].float().sum(), params), strict=True):
        assert torch.equal(a, b)


def test_attention_sees_a_later_patch_of_torch_functional(monkeypatch):
    """The attention guard runs torch's own code with torch.nn.functional's globals looked up
    live: a patch made after import (context parallel wraps F.scaled_dot_product_attention)
    reaches the hardened model as it reaches the plain one."""
    import torch.nn.functional as F

    import nanpass

    calls = []
    sdpa = F.scaled_dot_product_attention

    def wrapped(*a, **k):
        calls.append(1)
        return sdpa(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", wrapped)
    m = torch.nn.MultiheadAttention(8, 2)
    x = torch.randn(4, 3, 8)
    nanpass.harden(m)(x, x, x, need_weights=False)
    assert calls == [1]


def test_nested_encoder_fast_path_runs_hardened():
    """eval + no_grad with a padding mask: TransformerEncoder drops the padding into a nested
    tensor, which its fast path's guard must take (nan_to_num has no nested kernel)."""
    import nanpass

    torch.manual_seed(0)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2).eval()
    x = torch.randn(3, 4, 8)
    pad = torch.zeros(3, 4, dtype=torch.bool)
    pad[1, -1] = True
    with torch.no_grad():
        want = enc(x, src_key_padding_mask=pad)
        got = nanpass.harden(enc)(x, src_key_padding_mask=pad)
    assert torch.equal(got, want)


def _encoder(dtype):
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", ["mha", "encoder"])
def test_attention_inference_fast_paths(kind, dtype):
    """eval() + no_grad() takes torch's fused fast paths; dynamo keeps them as single calls."""
    import nanpass

    pad = torch.tensor([[True, True, True], [False, True, False]])
    src = torch.randn(2, 3, 8, dtype=dtype)
    if kind == "mha":
        model = torch.nn.MultiheadAttention(8, 2, batch_first=True).to(dtype).eval()
        call = {"query": src, "key": src, "value": src, "key_padding_mask": pad, "need_weights": False}
        rule = "mha_fast_path"
    else:
        model = _encoder(dtype).eval()
        call = {"src": src, "src_key_padding_mask": pad}
        rule = "encoder_layer_fast_path"
    safe = nanpass.harden(model)
    with torch.no_grad():
        ref = model(**call)
        out = safe(**call)
    ref, out = (ref[0], out[0]) if kind == "mha" else (ref, out)
    assert not finite(ref[0]).all()  # what torch itself gives
    assert finite(out).all()
    # fx keeps nn.MultiheadAttention whole (its guard); dynamo exposes the fast path
    ops = {c.op for c in safe.changes if c.action == "guarded"}
    assert ops & {rule, "multi_head_attention"}, safe.changes
    torch.testing.assert_close(out[1], ref[1])


def test_native_mha_fast_path_call():
    """torch._native_multi_head_attention, as a model calling it directly would spell it."""
    mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    src = torch.randn(2, 3, 8)
    pad = torch.tensor([[True, True, True], [False, True, False]])
    args = (src, src, src, 8, 2, mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight,
            mha.out_proj.bias, pad, False, True, 1)
    g, orig = guard("mha_fast_path")
    with torch.no_grad():
        ref, out = orig(*args)[0], g(*args)[0]
    assert not finite(ref[0]).all() and finite(out).all()
    assert torch.equal(bits(out[1]), bits(ref[1]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("float_mask", [False, True])
def test_sdpa_is_already_safe(dtype, compiled, float_mask):
    """Why scaled_dot_product_attention is left alone: torch itself returns 0 for a query with
    no unmasked key, with finite gradients, eager and compiled."""
    q = torch.randn(1, 2, 3, 4, dtype=dtype, requires_grad=True)
    m = torch.ones(3, 3, dtype=torch.bool)
    m[1] = False
    if float_mask:
        m = torch.zeros(3, 3, dtype=dtype).masked_fill(~m, -math.inf)
    fn = F.scaled_dot_product_attention
    if compiled:
        fn = torch.compile(fn, backend="aot_eager")
    out = fn(q, q, q, attn_mask=m)
    out.float().sum().backward()
    assert finite(out).all() and finite(q.grad).all() and (out[0, :, 1] == 0).all()


def test_out_argument_gets_the_guarded_value():
    g, _ = guard("log")
    y = torch.empty(2)
    assert g(torch.tensor([0.0, 1.0]), out=y) is y and finite(y).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("call", ["x ** -0.5", "x ** -1.5", "torch.rsqrt(x)"])
def test_the_originals_bits_at_plus_inf_and_max(call, dtype):
    """x ** -0.5 and rsqrt are 0 at +inf, and x ** -1.5 at +inf and max: finite, so the guard
    must return exactly that (a clamp at max gave max ** p, or sat). Issue 19, item 1."""

    class Net(torch.nn.Module):
        def forward(self, x):
            return eval(call)

    x = torch.tensor([float("inf"), torch.finfo(dtype).max, 4.0], dtype=dtype, requires_grad=True)
    plain, safe = Net()(x), nanpass.harden(Net())(x)
    assert torch.equal(safe, plain), (safe, plain)
    (gp,), (gs,) = torch.autograd.grad(plain.sum(), x), torch.autograd.grad(safe.sum(), x)
    assert torch.equal(gs, gp)
