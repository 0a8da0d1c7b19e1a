"""Training-loop safety on one process: StepGuard and finite_mean."""

from __future__ import annotations

import copy
import io
import warnings

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
    moved = torch.linalg.vector_norm(torch.stack([(p.detach() - b).norm() for p, b in zip(model.parameters(), before, strict=True)]))
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
    # skip_zero is opt-in now (it used to be the default, which killed healthy runs whose
    # gradients are legitimately all zero: see test_all_zero_gradients_never_kill_a_healthy_run)
    model = nn.Linear(4, 1)
    guard = nanpass.StepGuard(torch.optim.Adam(model.parameters()), model=model, skip_zero=True)
    safe = nanpass.harden(model, quarantine=True)
    x = torch.full((3, 4), float("nan"))
    loss = nanpass.finite_mean(safe(x).squeeze(1))
    assert loss.item() == 0
    loss.backward()
    assert all((p.grad == 0).all() for p in model.parameters())
    assert guard.step() is False and guard.skipped == 1
    assert guard.last_skip_reason.startswith("every gradient is exactly 0")
    assert guard.consecutive == 0  # not a non-finite skip: never counts toward the limit
    # the default takes the same all-zero step
    default = nanpass.StepGuard(torch.optim.Adam(model.parameters()), model=model)
    nanpass.finite_mean(safe(x).squeeze(1)).backward()
    assert default.step() is True and (default.taken, default.skipped) == (1, 0)


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


# -- all-zero gradients --------------------------------------------------------------------------


def zero_grad_step(model):
    model.zero_grad()
    (model(torch.randn(4, 4)).sum() * 0.0).backward()  # every gradient exactly 0, finite


def test_all_zero_gradients_never_kill_a_healthy_run():
    # a frozen tower / dead ReLUs / a masked batch: 150 all-zero steps (past the default
    # max_consecutive_skips=100) are taken, and AdamW's decoupled weight decay applies each time
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    w0 = model.weight.detach().clone()
    lr, wd = 0.01, 0.5
    guard = nanpass.StepGuard(torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd), model=model)
    assert guard.skip_zero is False and guard.max_consecutive_skips == 100
    for _ in range(150):
        zero_grad_step(model)
        assert guard.step() is True
    assert (guard.taken, guard.skipped, guard.consecutive) == (150, 0, 0)
    # zero gradient, zero moments: the update is exactly the decay, w * (1 - lr * wd) per step
    torch.testing.assert_close(model.weight.detach(), w0 * (1 - lr * wd) ** 150)
    assert model.weight.abs().sum() < 0.5 * w0.abs().sum()  # the weights shrank


def test_skip_zero_true_skips_but_never_counts_toward_the_limit():
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    w0 = model.weight.detach().clone()
    guard = nanpass.StepGuard(torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.5),
                              model=model, skip_zero=True, max_consecutive_skips=3)
    for _ in range(150):
        zero_grad_step(model)
        assert guard.step() is False
    assert (guard.taken, guard.skipped, guard.consecutive) == (0, 150, 0)
    assert torch.equal(model.weight, w0)  # skipped: no decay
    assert guard.last_skip_reason.startswith("every gradient is exactly 0")

    def nan_step():
        model.zero_grad()
        model(torch.tensor([[float("nan"), 1.0, 1.0, 1.0]])).sum().backward()
        return guard.step()

    # non-finite skips count; all-zero skips in between neither count nor reset the run
    assert nan_step() is False and guard.consecutive == 1
    zero_grad_step(model)
    assert guard.step() is False and guard.consecutive == 1
    assert nan_step() is False and guard.consecutive == 2
    zero_grad_step(model)
    guard.step()
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: 3 optimizer steps skipped in a row; "
                                                      r"last: non-finite gradient in weight"):
        nan_step()


# -- LR schedulers -------------------------------------------------------------------------------


def run_with_schedule(guard_kwargs, poisoned, n=10, user_steps_scheduler=False, fused=False):
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = (torch.optim.Adam(model.parameters(), lr=0.1, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5 ** epoch)
    guard = nanpass.StepGuard(opt, model=model, **guard_kwargs,
                              scheduler=None if user_steps_scheduler else sched)
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(n):
            opt.zero_grad()
            x = torch.randn(8, 4)
            if i in poisoned:
                x[0, 0] = float("nan")
            model(x).pow(2).mean().backward()
            results.append(guard.step())
            if user_steps_scheduler:
                sched.step()
    lr_warnings = [w for w in caught if issubclass(w.category, UserWarning) and "lr_scheduler" in str(w.message)]
    return guard, sched, opt, results, lr_warnings


def test_scheduler_steps_only_on_taken_steps():
    guard, sched, opt, results, lr_warnings = run_with_schedule({}, poisoned={0, 4, 5})
    assert results == [False, True, True, True, False, False, True, True, True, True]
    assert sched.last_epoch == 10 - 3 and guard.taken == 7
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 7)
    assert lr_warnings == []
    # the control: stepping the scheduler by hand every iteration (first step skipped) both
    # advances the schedule on skipped steps and makes torch warn
    _, sched, _, _, lr_warnings = run_with_schedule({}, poisoned={0, 4, 5}, user_steps_scheduler=True)
    assert sched.last_epoch == 10
    assert any("before `optimizer.step()`" in str(w.message) for w in lr_warnings)


def test_scheduler_with_a_fused_optimizer_reads_the_verdict():
    # the no-sync fused path cannot know on the host whether to advance the schedule: with a
    # scheduler, the guard reads the verdict back and returns it
    guard, sched, _, results, lr_warnings = run_with_schedule(
        {"max_consecutive_skips": None}, poisoned={0, 3}, n=6, fused=True)
    assert results == [False, True, True, False, True, True]
    assert sched.last_epoch == 4 and lr_warnings == []


def test_bad_scheduler_is_a_clear_error():
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: .*ReduceLROnPlateau.*Valid: a per-step"):
        nanpass.StepGuard(opt, scheduler=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: .*StepLR.*not the guard's optimizer"):
        nanpass.StepGuard(opt, scheduler=torch.optim.lr_scheduler.StepLR(other, 1))
    with pytest.raises(nanpass.NanpassTypeError, match=r"^nanpass: StepGuard scheduler='cosine'.*valid:"):
        nanpass.StepGuard(opt, scheduler="cosine")


# -- sparse gradients ----------------------------------------------------------------------------


class SparseModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, idx):
        return self.head(self.emb(idx).mean(1))


def test_sparse_embedding_with_sparse_adam_and_adam():
    torch.manual_seed(0)
    model = SparseModel()
    sparse_opt = torch.optim.SparseAdam(model.emb.parameters(), lr=0.05)
    dense_opt = torch.optim.Adam(model.head.parameters(), lr=0.05)
    guard = nanpass.StepGuard([sparse_opt, dense_opt], max_norm=1.0, model=model)
    assert guard.optimizers == (sparse_opt, dense_opt)
    g = torch.Generator().manual_seed(1)
    for step in range(6):
        for opt in guard.optimizers:
            opt.zero_grad()
        idx = torch.randint(0, 10, (8, 3), generator=g)  # rows 10..19 never looked up
        model(idx).pow(2).mean().backward()
        assert model.emb.weight.grad.is_sparse
        before = [p.detach().clone() for p in model.parameters()]
        if step == 2:
            model.emb.weight.grad._values()[0, 0] = float("nan")  # NaN in the sparse gradient
            assert guard.step() is False
            # the whole step is skipped: the dense head too, though its gradient was finite
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
            assert guard.last_skip_reason.startswith("non-finite gradient in emb.weight (sparse, values:")
            assert "1 NaN" in guard.last_skip_reason
        else:
            assert guard.step() is True
            assert not torch.equal(model.emb.weight[idx.unique()], before[0][idx.unique()])
            assert not torch.equal(model.head.weight, before[1])
    assert (guard.taken, guard.skipped) == (5, 1)
    assert torch.isfinite(model.emb.weight).all()
    assert torch.equal(model.emb.weight[10:], before[0][10:])  # untouched rows never move


def test_sparse_gradient_norm_and_clipping_are_those_of_the_dense_gradient():
    torch.manual_seed(0)
    emb = nn.Embedding(6, 3, sparse=True)
    emb(torch.tensor([1, 1, 1, 4])).sum().backward()  # index 1 three times: uncoalesced values
    grad = emb.weight.grad
    assert not grad.is_coalesced()
    dense_norm = float(grad.to_dense().norm())
    assert dense_norm != pytest.approx(float(grad._values().norm()))  # the naive norm is wrong
    guard = nanpass.StepGuard(torch.optim.SGD(emb.parameters(), lr=1.0), max_norm=0.5)
    before = emb.weight.detach().clone()
    assert guard.step() is True
    assert guard.last_norm == pytest.approx(dense_norm, rel=1e-6)
    moved = (emb.weight.detach() - before).norm()
    assert float(moved) == pytest.approx(0.5, rel=1e-4)  # lr 1 x clipped norm


def test_several_optimizers_share_one_verdict_and_one_scaler_update():
    body, head = nn.Linear(4, 2), nn.Linear(2, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    opts = [torch.optim.SGD(body.parameters(), lr=0.1), torch.optim.SGD(head.parameters(), lr=0.1)]
    guard = nanpass.StepGuard(opts, scaler=scaler, max_norm=1.0)
    scaler.scale(head(body(torch.randn(3, 4))).sum()).backward()
    w = body.weight.detach().clone()
    assert guard.step() is True and not torch.equal(body.weight, w)
    x = torch.randn(3, 4)
    x[0, 0] = float("nan")
    scaler.scale(head(body(x)).sum()).backward()
    w = [p.detach().clone() for p in (*body.parameters(), *head.parameters())]
    assert guard.step() is False
    assert all(torch.equal(p, b) for p, b in zip((*body.parameters(), *head.parameters()), w, strict=True))
    assert scaler.get_scale() == 2.0**9  # backed off once, not once per optimizer


# -- checkpoint and resume -----------------------------------------------------------------------


def resumable_run(guard, model, steps, poisoned):
    g = torch.Generator().manual_seed(0)
    for i in range(steps.stop):
        x = torch.randn(8, 4, generator=g)  # same data stream whether resumed or not
        if i not in steps:
            continue
        if i in poisoned:
            x[0, 0] = float("nan")
        guard.optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        guard.step()


def save_load(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True: the state is plain Python values


def test_resumed_guard_continues_with_the_same_counters_and_policy():
    torch.manual_seed(0)
    base = nn.Linear(4, 1)
    policy = dict(max_norm=0.5, norm_type=1.0, max_consecutive_skips=7, skip_zero=True)
    whole = copy.deepcopy(base)
    ref = nanpass.StepGuard(torch.optim.Adam(whole.parameters(), lr=0.1), model=whole, **policy)
    resumable_run(ref, whole, range(0, 8), poisoned={1, 6, 7})  # ends on 2 skips

    first = copy.deepcopy(base)
    guard = nanpass.StepGuard(torch.optim.Adam(first.parameters(), lr=0.1), model=first, **policy)
    resumable_run(guard, first, range(0, 5), poisoned={1, 6, 7})
    assert (guard.taken, guard.skipped) == (4, 1)
    ckpt = save_load({"guard": guard.state_dict(), "opt": guard.optimizer.state_dict(),
                      "model": first.state_dict()})

    second = nn.Linear(4, 1)
    second.load_state_dict(ckpt["model"])
    opt = torch.optim.Adam(second.parameters(), lr=0.1)
    opt.load_state_dict(ckpt["opt"])
    resumed = nanpass.StepGuard(opt, model=second)  # built with the default policy...
    resumed.load_state_dict(ckpt["guard"])
    assert {k: getattr(resumed, k) for k in policy} == policy  # ...the saved policy wins
    resumable_run(resumed, second, range(5, 8), poisoned={1, 6, 7})
    assert resumed.state_dict() == ref.state_dict()
    assert (resumed.taken, resumed.skipped, resumed.consecutive) == (5, 3, 2)
    assert resumed.last_skip_reason == ref.last_skip_reason
    assert resumed.last_skip_reason.startswith("non-finite gradient in weight")
    for a, b in zip(whole.parameters(), second.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def test_consecutive_skips_carry_over_a_resume():
    model = nn.Linear(4, 1)
    guard = nanpass.StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), max_consecutive_skips=3)
    resumable_run(guard, model, range(0, 4), poisoned={2, 3})  # taken, taken, skip, skip
    assert (guard.taken, guard.skipped, guard.consecutive) == (2, 2, 2)
    state = save_load(guard.state_dict())
    resumed = nanpass.StepGuard(torch.optim.SGD(model.parameters(), lr=0.1))
    resumed.load_state_dict(state)
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: 3 optimizer steps skipped in a row"):
        resumable_run(resumed, model, range(4, 5), poisoned={4})


def test_load_state_dict_rejects_bad_input_clearly():
    guard = nanpass.StepGuard(torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1))
    good = guard.state_dict()
    missing = {k: v for k, v in good.items() if k != "consecutive"}
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: StepGuard.load_state_dict: missing key\(s\) "
                                                   r"'consecutive'; valid: .*keys taken, skipped, consecutive"):
        guard.load_state_dict(missing)
    with pytest.raises(nanpass.ConfigError, match=r"unexpected key\(s\) 'scale'"):
        guard.load_state_dict({**good, "scale": 1.0})
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: .*taken=-1 is not valid; valid: an int >= 0"):
        guard.load_state_dict({**good, "taken": -1})
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: StepGuard max_norm=-1.0 is not valid; use a positive"):
        guard.load_state_dict({**good, "max_norm": -1.0})
    with pytest.raises(nanpass.NanpassTypeError, match=r"^nanpass: StepGuard.load_state_dict got a list; valid:"):
        guard.load_state_dict([1, 2])
    assert guard.state_dict() == good  # a rejected load changes nothing


def test_bad_options_are_clear_errors():
    params = nn.Linear(2, 1).parameters()
    opt = torch.optim.SGD(params, lr=0.1)
    with pytest.raises(nanpass.NanpassTypeError, match=r"^nanpass: StepGuard optimizer=.*is not an optimizer; valid:"):
        nanpass.StepGuard(nn.Linear(2, 1))
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: StepGuard max_norm=0.0 is not valid"):
        nanpass.StepGuard(opt, max_norm=0)
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: StepGuard norm_type=-2.0 is not valid; use a positive"):
        nanpass.StepGuard(opt, norm_type=-2)
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: StepGuard max_consecutive_skips=0 is not valid"):
        nanpass.StepGuard(opt, max_consecutive_skips=0)
    with pytest.raises(nanpass.NanpassTypeError, match=r"^nanpass: StepGuard skip_zero='yes' is not valid; use True or False"):
        nanpass.StepGuard(opt, skip_zero="yes")
    two = nanpass.StepGuard([opt, torch.optim.SGD(nn.Linear(2, 1).parameters(), lr=0.1)])
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: StepGuard.step\(closure=.*with 2 optimizers"):
        two.step(lambda: 0.0)
