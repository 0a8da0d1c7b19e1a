"""Training-loop safety on one process: StepGuard and finite_mean."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import nanpass


def batches(n: int = 200, poison_every: int = 20):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 1, generator=g)
    for step in range(n):
        x = torch.randn(16, 8, generator=g)
        y = x @ w + 0.01 * torch.randn(16, 1, generator=g)
        kind = None
        if step % poison_every == poison_every - 1:
            kind = ("nan-sample", "inf-loss", "huge-grad")[(step // poison_every) % 3]
        yield x, y, kind


def loss_of(model, x, y, kind):
    if kind == "nan-sample":
        x = x.clone()
        x[3, 2] = float("nan")
    loss = ((model(x) - y) ** 2).mean()
    if kind == "inf-loss":
        loss = loss * float("inf")
    if kind == "huge-grad":
        loss = loss * 1e38 * 1e38  # the gradient overflows to inf
    return loss


def train(model, guard=None, skip_poisoned=False):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    if guard is not None:
        guard = nanpass.StepGuard(opt, model=model, max_consecutive_skips=5)
    for x, y, kind in batches():
        if skip_poisoned and kind is not None:
            continue
        opt.zero_grad()
        loss_of(model, x, y, kind).backward()
        (guard or opt).step()
    return guard


def test_guarded_run_matches_the_clean_run():
    torch.manual_seed(0)
    base = nn.Linear(8, 1)
    clean, guarded, plain = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    train(clean, skip_poisoned=True)
    guard = train(guarded, guard=True)
    train(plain)
    assert guard.skipped == 10 and guard.taken == 190
    for a, b in zip(clean.parameters(), guarded.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    assert not all(torch.isfinite(p).all() for p in plain.parameters())  # without it: NaN weights
    assert "non-finite gradient in" in guard.last_skip_reason


def test_clipping_uses_this_steps_gradients():
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanpass.StepGuard(opt, max_norm=0.5)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    before = [p.detach().clone() for p in model.parameters()]
    assert guard.step()
    assert guard.last_norm == pytest.approx(float(expected), rel=1e-5)
    moved = torch.linalg.vector_norm(torch.stack([(p - b).norm() for p, b in zip(model.parameters(), before, strict=True)]))
    assert float(moved) == pytest.approx(0.1 * 0.5, rel=1e-3)  # lr x clipped norm


def test_repeated_skips_raise_with_the_parameter_named():
    model = nn.Sequential(nn.Linear(2, 2))
    guard = nanpass.StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), model=model,
                              max_consecutive_skips=3)
    for i in range(3):
        model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
        if i < 2:
            assert guard.step() is False
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: 3 optimizer steps skipped in a row; "
                                                      r"last: non-finite gradient in 0.weight"):
        guard.step()


class Div(nn.Module):
    def forward(self, x):
        return x[:, 0] / x[:, 1]


def test_finite_mean_drops_bad_samples_with_finite_gradients():
    per_sample = torch.tensor([1.0, float("nan"), float("inf"), 4.0], requires_grad=True)
    mean, dropped = nanpass.finite_mean(per_sample, return_dropped=True)
    assert mean.item() == pytest.approx((1.0 + 4.0) / 2)
    assert dropped.tolist() == [1, 2]
    mean.backward()
    assert per_sample.grad.tolist() == [0.5, 0.0, 0.0, 0.5]  # exactly 0, never 0 * inf
    # with a hardened model upstream, the dropped samples' own gradients are finite too
    model = nanpass.harden(Div())
    x = torch.tensor([[1.0, 0.0], [2.0, 1.0]], requires_grad=True)
    nanpass.finite_mean(model(x)).backward()
    assert torch.isfinite(x.grad).all()
    # every sample bad: zero loss, zero gradients
    y = torch.tensor([float("inf"), float("nan")], requires_grad=True)
    total = nanpass.finite_sum(y)
    total.backward()
    assert total.item() == 0 and y.grad.tolist() == [0.0, 0.0]


def test_quarantine_keeps_bad_samples_out_of_the_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(6, 4)
    y = torch.randn(6, 1)
    bad = x.clone()
    bad[2, 1] = float("nan")
    bad[4, 0] = float("inf")
    safe = nanpass.harden(model, quarantine=True)
    per_sample = ((safe(bad) - y) ** 2).squeeze(1)
    assert torch.isnan(per_sample[[2, 4]]).all() and torch.isfinite(per_sample[[0, 1, 3, 5]]).all()
    loss, dropped = nanpass.finite_mean(per_sample, return_dropped=True)
    assert dropped.tolist() == [2, 4]
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    keep = torch.tensor([0, 1, 3, 5])
    ((model(x[keep]) - y[keep]) ** 2).mean().backward()  # the clean samples alone
    for g, want in zip(got, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(g, want)


def test_a_batch_with_no_finite_sample_is_skipped():
    model = nn.Linear(4, 1)
    guard = nanpass.StepGuard(torch.optim.Adam(model.parameters()), model=model)
    safe = nanpass.harden(model, quarantine=True)
    x = torch.full((3, 4), float("nan"))
    loss = nanpass.finite_mean(safe(x).squeeze(1))
    assert loss.item() == 0
    loss.backward()
    assert all((p.grad == 0).all() for p in model.parameters())
    assert guard.step() is False and guard.skipped == 1
    assert guard.last_skip_reason.startswith("every gradient is exactly 0")


def test_composes_with_grad_scaler():
    model = nn.Linear(4, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    guard = nanpass.StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0,
                              scaler=scaler, model=model)
    x = torch.randn(8, 4)
    scaler.scale(model(x).pow(2).mean()).backward()
    w0 = model.weight.detach().clone()
    assert guard.step() is True and not torch.equal(model.weight, w0)
    assert guard.last_norm <= 1e4  # unscaled before the norm is taken
    bad = x.clone()
    bad[0, 0] = float("nan")
    guard.optimizer.zero_grad()
    scaler.scale(model(bad).pow(2).mean()).backward()
    w1 = model.weight.detach().clone()
    assert guard.step() is False and torch.equal(model.weight, w1)
    assert scaler.get_scale() == 2.0**9  # the scaler still backed off
    guard.optimizer.zero_grad()
    scaler.scale(model(x).pow(2).mean()).backward()
    scaler.unscale_(guard.optimizer)  # a user who unscales first
    assert guard.step() is True


def test_composes_with_a_fused_optimizer():
    model = nn.Linear(4, 1)
    guard = nanpass.StepGuard(torch.optim.Adam(model.parameters(), fused=True), model=model)
    model(torch.randn(3, 4)).sum().backward()
    assert guard.step() is True
    model(torch.tensor([[float("nan"), 1.0, 1.0, 1.0]])).sum().backward()
    w = model.weight.detach().clone()
    assert guard.step() is False and torch.equal(model.weight, w)
    assert guard.last_skip_reason.startswith("non-finite gradient in weight")


def test_fused_optimizer_path_reads_nothing_back(monkeypatch):
    model = nn.Linear(4, 1)
    guard = nanpass.StepGuard(torch.optim.Adam(model.parameters(), fused=True), max_norm=1.0,
                              max_consecutive_skips=None)

    def no_sync(*a, **k):
        raise AssertionError("host sync in the fused path")

    model(torch.randn(3, 4)).sum().backward()
    w0 = model.weight.detach().clone()
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", no_sync)
        m.setattr(torch.Tensor, "__bool__", no_sync)
        assert guard.step() is None
    w1 = model.weight.detach().clone()
    assert not torch.equal(w1, w0)
    model.zero_grad()
    model(torch.tensor([[float("nan"), 1.0, 1.0, 1.0]])).sum().backward()
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", no_sync)
        m.setattr(torch.Tensor, "__bool__", no_sync)
        guard.step()
    assert torch.equal(model.weight, w1)  # skipped on the device
    assert (guard.taken, guard.skipped) == (1, 1)  # settled when read
