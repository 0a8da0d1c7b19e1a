"""The model as a whole stays finite, not only each guarded op: a guard that replaces an
overflow leaves headroom (max / 16), so the ordinary op after it cannot overflow in turn
(docs/guards.md, "The model as a whole")."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import nanpass
from tests.helpers import Spiking, all_finite, forward_backward

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


class ExpTwice(nn.Module):
    """The issue's example: exp(100) saturated, then doubled."""

    def forward(self, x):
        return torch.exp(x) * 2 + torch.expm1(x) * 2 + torch.exp2(x) * 2


class NormsSummed(nn.Module):
    """Three overflowing norms, summed."""

    def forward(self, a, b, c):
        return a.norm() + b.norm() + c.norm()


class Quotients(nn.Module):
    """100 / tiny overflows; the quotient then scaled and added to a residual."""

    def forward(self, x, d):
        return (x / d) * 4 + x


class HalfBlock(nn.Module):
    """float16: a linear output past 65504, a residual add, an RMS norm of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4, bias=False)
        nn.init.constant_(self.lin.weight, 300.0)

    def forward(self, x):
        h = x + self.lin(x)
        return h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)


class TwoGuardsMultiplied(nn.Module):
    """Issue 28 item 2: the products of two guard outputs, each an infinity's stand-in (an
    overflowing exp and cosh, a fully masked logsumexp, rsqrt of 0), and a sum of them."""

    def forward(self, x):
        masked = torch.full_like(x, float("-inf"))
        return (torch.exp(x) * torch.cosh(x) + torch.logsumexp(masked, 0) * torch.logsumexp(masked, 0)
                + torch.rsqrt(x - x) * torch.rsqrt(x - x))


def _operands(model, dtype):
    big = float(torch.finfo(dtype).max)
    if isinstance(model, ExpTwice):
        return (torch.tensor([100.0, 1e4, 1.0], dtype=dtype, requires_grad=True),)
    if isinstance(model, TwoGuardsMultiplied):
        return (torch.tensor([1e4, 1e4, 1e4], dtype=dtype, requires_grad=True),)
    if isinstance(model, NormsSummed):
        return tuple(torch.full((4,), big, dtype=dtype, requires_grad=True) for _ in range(3))
    if isinstance(model, Quotients):
        tiny = float(torch.finfo(dtype).tiny)
        return (torch.tensor([100.0, -100.0, 1.0], dtype=dtype, requires_grad=True),
                torch.tensor([tiny, tiny, 2.0], dtype=dtype, requires_grad=True))
    return (torch.full((2, 4), 300.0, dtype=dtype, requires_grad=True),)


CASES = [pytest.param(m, d, id=f"{m.__name__}-{str(d)[6:]}") for m in (ExpTwice, NormsSummed, Quotients, TwoGuardsMultiplied)
         for d in DTYPES] + [pytest.param(HalfBlock, torch.float16, id="HalfBlock-float16")]


@pytest.mark.parametrize("capture", ["harden", "backend"])
@pytest.mark.parametrize("cls,dtype", CASES)
def test_the_op_after_a_saturated_guard_stays_finite(cls, dtype, capture):
    model = cls().to(dtype)
    args = _operands(model, dtype)
    outs, grads = forward_backward(model, [a.detach().clone().requires_grad_() for a in args])
    assert not all_finite(outs + grads), "the unguarded model should overflow here"
    safe = nanpass.harden(model) if capture == "harden" else torch.compile(model, backend=nanpass.backend(inner="eager"))
    outs, grads = forward_backward(safe, args)
    assert all_finite(outs), f"{cls.__name__} {dtype}: {outs}"
    assert all_finite(grads), f"{cls.__name__} {dtype}: {grads}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_headroom_is_exact_and_leaves_finite_results_alone(dtype):
    """+inf becomes sat, a power of two (exact) whose square is at most max / 16 (issue 28 item
    2: a product of two guard outputs keeps the headroom); a finite result near max is its own."""
    from nanpass._constants import bounds

    b = bounds(dtype)
    mx = float(torch.finfo(dtype).max)
    assert b.sat * b.sat <= mx / 16 < (2 * b.sat) ** 2
    assert b.sat == 2.0 ** round(torch.tensor(b.sat, dtype=torch.float64).log2().item())
    assert float(torch.tensor(b.sat, dtype=dtype)) == b.sat
    x = torch.tensor([b.exp_hi, b.exp_hi + 1, float("inf")], dtype=dtype)
    got = nanpass.harden(ExpOnly())(x)
    assert got[0] == torch.exp(x[0])  # the last finite exp, near max: untouched
    assert got[1] == b.sat and got[2] == b.sat


class ExpOnly(nn.Module):
    def forward(self, x):
        return torch.exp(x)


class SILogLoss(nn.Module):
    """ZoeDepth's scale-invariant log loss (isl-org/ZoeDepth#54), as written there: over the
    valid pixels only, so a depth map with no valid pixel takes the mean of an empty selection."""

    def __init__(self, beta: float = 0.15):
        super().__init__()
        self.beta = beta

    def forward(self, pred, target, mask):
        g = torch.log(pred[mask]) - torch.log(target[mask])
        dg = torch.var(g) + self.beta * torch.pow(torch.mean(g), 2)
        return 10 * torch.sqrt(dg)


def _run(model, mask):
    pred = (torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(0)) + 0.5).requires_grad_()
    target = torch.rand(2, 1, 4, 4, generator=torch.Generator().manual_seed(1)) + 0.5
    outs, grads = forward_backward(model, (pred, target, mask))
    return outs + grads


@pytest.mark.parametrize("capture", ["harden", "backend"])
def test_a_mean_over_an_empty_selection_is_guarded(capture):
    """Issue 28 item 5: ``mean`` of no elements is 0 / 0 = NaN; hardened it is 0, with finite
    gradients, and a mean over a non-empty selection keeps the original's bits."""
    empty = torch.zeros(2, 1, 4, 4, dtype=torch.bool)
    assert not all_finite(_run(SILogLoss(), empty))
    model = (nanpass.harden(SILogLoss()) if capture == "harden"
             else torch.compile(SILogLoss(), backend=nanpass.backend(inner="aot_eager"), dynamic=False))
    assert all_finite(_run(model, empty))
    some = empty.clone()
    some[0, 0, :2] = True
    want, got = _run(SILogLoss(), some), _run(nanpass.harden(SILogLoss()), some)
    assert all_finite(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_custom_function_backward_is_guarded_under_harden():
    """The backward of a custom autograd.Function runs after the hardened call: where it turns
    a finite gradient non-finite it is run again under the guards; on a safe input its
    gradient bits are the plain model's; a non-finite gradient from upstream passes through."""
    torch.manual_seed(0)
    model = Spiking()
    safe = nanpass.harden(model)
    x = torch.randn(8, 4) * 100
    model(x).backward()
    assert not torch.isfinite(model.l.weight.grad).all()  # plain: NaN
    model.zero_grad()
    safe(x).backward()
    assert torch.isfinite(model.l.weight.grad).all()
    assert any(c.spelling == "torch.exp" and c.action == "guarded" for c in safe.changes)
    x = torch.randn(8, 4) * 0.1
    model.zero_grad()
    model(x).backward()
    plain = model.l.weight.grad.clone()
    model.zero_grad()
    safe(x).backward()
    assert torch.equal(plain, model.l.weight.grad)
    model.zero_grad()
    (safe(x) * float("inf")).backward()
    assert not torch.isfinite(model.l.weight.grad).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax_keeps_the_finite_entries_next_to_a_masked_one(dtype):
    """A row masked both ways (-inf and finfo.min, as Hugging Face masks): the original's
    log_softmax is finite on the finfo.min entry (0: it takes all the weight). A finite stand-in
    for the -inf entry would take it instead; the guard moves only rows whose largest entry is
    not finite, and the -inf result becomes -sat (issue 28 item 2)."""
    from nanpass._constants import bounds

    lo = torch.finfo(dtype).min
    x = torch.tensor([[float("-inf"), lo, lo], [float("-inf"), 1.0, 2.0], [float("-inf")] * 3], dtype=dtype,
                     requires_grad=True)

    class LogSoftmax(nn.Module):
        def forward(self, x):
            return torch.log_softmax(x, -1)

    want = LogSoftmax()(x)
    got = nanpass.harden(LogSoftmax())(x)
    finite = torch.isfinite(want)
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[0, 0], torch.tensor(-bounds(dtype).sat, dtype=dtype))
    assert torch.isfinite(got).all()
    assert torch.allclose(got[2].float().exp(), torch.full((3,), 1 / 3), atol=1e-2)  # fully masked: uniform
    got.float().sum().backward()
    assert torch.isfinite(x.grad).all()


def _masked_log_softmax(vector, mask, dim=-1):
    """AllenNLP's ``masked_log_softmax`` as the issue cites it (allenai/allennlp#890): the mask's
    log, -inf at padded positions, added to the logits before ``log_softmax``."""
    mask = mask.to(vector.dtype)
    while mask.dim() < vector.dim():
        mask = mask.unsqueeze(1)
    return nn.functional.log_softmax(vector + mask.log(), dim=dim)


class MaskedScorer(nn.Module):
    def __init__(self):
        super().__init__()
        self.score = nn.Linear(8, 1)

    def forward(self, h, mask, target):
        logits = self.score(h).squeeze(-1)
        return nn.functional.nll_loss(_masked_log_softmax(logits, mask), target)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_mask_made_with_log_of_zero_keeps_the_originals_bits(dtype):
    """Issue 28 item 4: log(0) is -inf, and the original's padded entries get weight exactly 0.
    Hardened, log(0) is log_zero (-194.8 in float32), low enough that exp of it plus any logit
    whose exp is finite is exactly 0: the loss and every gradient are the original's bit for bit
    (the padded entries' gradient exactly 0), where log(tiny) (-87) leaked ~1e-38 of weight."""
    torch.manual_seed(0)
    model = MaskedScorer().to(dtype)
    h = torch.randn(4, 6, 8, dtype=dtype) * 3
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0], [1] * 6])
    target = torch.tensor([2, 4, 0, 5])

    def step(m):
        m.zero_grad()
        x = h.clone().requires_grad_()
        loss = m(x, mask, target)
        loss.backward()
        return [loss.detach(), x.grad, *[p.grad.clone() for p in m.parameters()]]

    want, got = step(model), step(nanpass.harden(model))
    assert all(torch.isfinite(w).all() for w in want)
    for w, g in zip(want, got, strict=True):
        assert torch.equal(w, g), (w - g).abs().max()
    assert (got[1][mask == 0] == 0).all()
