"""Mixed precision: guards never hide a loss-scale overflow from GradScaler.

Without nanpass, a scaled gradient that overflows float16 reaches the parameters as inf:
GradScaler skips the step and halves the scale. A guard's finite-gradient fence used to turn
that inf into 0, so the step was taken with a zero gradient and the scale never backed off.
Guards now zero only their own op's singular derivative (tests/test_rule_contract.py), so the
scale sequence and the skipped steps are the unguarded run's whenever that run stays finite.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import nanpass
from nanpass._constants import bounds


class Region(nn.Module):
    """float32 master weights, a float16 region (as autocast makes one), a log in it."""

    def __init__(self, gain: float = 1.0):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)
        self.gain = gain  # how far a scaled gradient is from float16's max

    def forward(self, x):
        h = self.fc(x).half()
        h = torch.log(h.abs() + 1) * torch.sqrt(h * h + 1)
        return self.head(h.float()).sum() * self.gain


def _run(model, batches, init_scale=2.0**16, growth_interval=5):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales, losses = [], []
    for x in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(x)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(float(loss.detach()))
    return scales, losses


def _batches(n, poison_every=None):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        x = torch.randn(8, 4, generator=g)
        if poison_every and i % poison_every == poison_every - 1:
            x[0, 0] = float("inf")  # a bad sample: the unguarded loss goes non-finite
        out.append(x)
    return out


def test_an_overflowing_scale_is_seen_and_backed_off():
    torch.manual_seed(0)
    plain = Region(gain=100.0)  # 2**16 times this gradient overflows float16
    safe = nanpass.harden(copy.deepcopy(plain))
    batches = _batches(3)
    want, _ = _run(plain, batches)
    got, _ = _run(safe, batches)
    assert want[0] == 2.0**15  # 2**16 overflows float16 in backward: skipped, halved
    assert got == want


def test_200_steps_same_scale_trajectory_as_unguarded_on_clean_data():
    torch.manual_seed(0)
    plain = Region()
    safe = nanpass.harden(copy.deepcopy(plain))
    batches = _batches(200)
    want, want_losses = _run(plain, batches, init_scale=2.0**18, growth_interval=10)
    got, got_losses = _run(safe, batches, init_scale=2.0**18, growth_interval=10)
    assert len(set(want)) > 2  # the scale both backed off and grew: the test sees both
    assert got == want and got_losses == want_losses
    for a, b in zip(plain.parameters(), safe.parameters(), strict=True):
        assert torch.equal(a, b)


class Product(nn.Module):
    """A float16 linear (float32 master weights), its output summed and averaged over tokens."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        w, b = self.fc.weight.half(), self.fc.bias.half()
        return torch.nn.functional.linear(x.half(), w, b).float().sum() / x.shape[0]


def test_a_float16_products_own_gradient_overflow_reaches_gradscaler():
    """Issue 39 item 6: at a scale of 2**16 the gradient reaching the product is 2**16 / 512 =
    128, finite, and the weight's and bias's gradients, summed over 512 tokens in the product's
    own backward, pass 65504: where a too-large loss scale first overflows in a real model. The
    guard leaves that infinity (docs/guards.md), so the scale backs off and grows as without
    nanpass, step for step; a fence there (zero where the incoming gradient was finite) made
    the scale grow to 2**20 in 8 steps without one skip."""
    torch.manual_seed(0)
    plain = Product()
    safe = nanpass.harden(copy.deepcopy(plain))
    g = torch.Generator().manual_seed(0)
    batches = [1.5 + 0.25 * torch.rand(512, 8, generator=g) for _ in range(8)]
    want, _ = _run(plain, batches, growth_interval=2)
    got, _ = _run(safe, batches, growth_interval=2)
    assert want == [2.0**15, 2.0**15, 2.0**16, 2.0**15, 2.0**15, 2.0**16, 2.0**15, 2.0**15]
    assert got == want
    for a, b in zip(plain.parameters(), safe.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("poison_every", [7])
def test_poisoned_batches_recover(poison_every):
    torch.manual_seed(0)
    plain = Region()
    safe = nanpass.harden(copy.deepcopy(plain))
    batches = _batches(60, poison_every)
    _, plain_losses = _run(plain, batches)
    scales, losses = _run(safe, batches)
    assert not all(torch.isfinite(torch.tensor(plain_losses)))  # unguarded: non-finite losses
    assert all(torch.isfinite(torch.tensor(losses)))  # hardened: every loss finite
    assert all(torch.isfinite(p).all() for p in safe.parameters())
    assert scales[-1] >= 1.0


@pytest.mark.parametrize("op", ["linear", "matmul", "bmm", "addmm"])
def test_a_float16_product_is_saturated_in_place(op):
    """A product's fresh float16 result is saturated where it lies: no second tensor, no
    autograd node of nanpass's (its grad_fn is the product's own), the gradient straight
    through, and the overflow gone (65504 * 2 is inf in float16)."""
    torch.manual_seed(0)
    a = torch.full((2, 3, 4), 200.0, dtype=torch.float16, requires_grad=True)
    w = torch.full((4, 4), 100.0, dtype=torch.float16, requires_grad=True)
    calls = {
        "linear": lambda: torch.nn.functional.linear(a, w),
        "matmul": lambda: torch.matmul(a, w),
        "bmm": lambda: torch.bmm(a, w.expand(2, 4, 4)),
        "addmm": lambda: torch.addmm(w[:3], a[0], w),
    }

    class Net(torch.nn.Module):
        def forward(self):
            return calls[op]()

    plain = Net()()
    assert torch.isinf(plain).all()
    out = nanpass.harden(Net())()
    assert type(out.grad_fn) is type(plain.grad_fn)
    assert torch.isfinite(out).all() and (out == bounds(torch.float16).sat).all()
    out.float().sum().backward()
    ga, gw = a.grad.clone(), w.grad.clone()
    a.grad = w.grad = None
    calls[op]().float().sum().backward()  # the plain product's gradient: straight through
    assert torch.equal(ga, a.grad) and torch.equal(gw, w.grad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast (run on a lent GPU: benchmarks/gpu_check.py)")
def test_cuda_autocast_runs_float32_list_ops_unguarded():
    """CUDA autocast computes layer_norm and pow in float32 (torch's amp lists): their float16
    hazards (1/sqrt(eps) and x ** 3 past 65504) are not there, so the calls run as written
    (layer_norm, dtype-gated, is not looked at; pow is reported left); outside autocast the
    same float16 calls are guarded."""

    class Block(nn.Module):
        def forward(self, x):
            return torch.pow(nn.functional.layer_norm(x, (8,)), 3.0)

    x = torch.randn(4, 8, device="cuda", dtype=torch.float16)
    safe = nanpass.harden(Block())
    with torch.autocast("cuda", dtype=torch.float16):
        safe(x)
    assert {(c.op, c.action) for c in safe.changes} == {("pow", "left")}
    outside = nanpass.harden(Block())
    outside(x)
    assert {(c.op, c.action) for c in outside.changes} == {("layer_norm", "guarded"), ("pow", "guarded")}
