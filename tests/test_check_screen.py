"""Issue 47: eager check mode screens each step on the device (its outputs, the loss's gradient,
the gradients its backward gives the parameters and inputs) and runs the step again with the
check at each op only on a hit, naming what the check of every call names. ``every_op=True``
keeps the check of every call."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanpass


def _screened(model: nn.Module, mode: str = "check") -> nanpass.Hardened:
    """``model`` hardened in check mode, past its first call (which checks every op and records
    the call sites for the report): its next calls are screened."""
    safe = nanpass.harden(model, mode=mode)
    with torch.no_grad():
        safe(torch.zeros(0, 4))  # (an empty batch: nothing to be non-finite)
    return safe


def _raised(model, *args, backward=False, **kw) -> str:
    with pytest.raises(nanpass.NonFiniteError) as e:
        out = model(*args, **kw)
        if backward:
            out.backward()
    return str(e.value)


class Log(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.fc(x) - 10.0)


class SqrtAtZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.sqrt((self.fc(x) * 0.0).pow(2).sum())


class MaskThenSoftmax(nn.Module):
    """An infinity made on purpose (a mask), quiet until a fully masked row's softmax."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x).masked_fill(torch.ones(4, dtype=torch.bool), float("-inf"))
        return torch.softmax(h, -1)


class MaskedLog(nn.Module):
    """log of a negative number, masked away before the output: made and dropped in the step."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return torch.where(h > 0, torch.log(h), 0.0)


@pytest.mark.parametrize("make,backward", [(Log, False), (SqrtAtZero, True), (MaskThenSoftmax, False)],
                         ids=["forward", "backward", "infinity-then-nan"])
def test_the_screen_names_what_the_check_at_every_op_names(make, backward):
    torch.manual_seed(0)
    model, x = make(), torch.randn(3, 4)
    every = _raised(nanpass.harden(model, mode="check", every_op=True), x, backward=backward)
    screened = _raised(_screened(model), x, backward=backward)
    first = lambda m: m.splitlines()[0]  # noqa: E731 - the op, the module, the line
    assert first(screened) == first(every), (screened, every)
    assert "test_check_screen.py" in first(screened)
    if make is MaskThenSoftmax:  # both ops: the softmax, and the mask that made the infinity
        assert "masked_fill" in screened and "softmax" in first(screened)


def test_the_forward_runs_with_no_mode_and_every_op_keeps_it():
    seen = []

    class Peek(nn.Module):
        def forward(self, x):
            seen.append(len(torch.overrides._get_current_function_mode_stack()))
            return x * 2

    x = torch.randn(2, requires_grad=True)
    safe = nanpass.harden(Peek(), mode="check")
    for _ in range(2):  # the first call at every op (it records the sites), then the screen
        safe(x).sum().backward()
    nanpass.harden(Peek(), mode="check", every_op=True)(x).sum().backward()
    assert seen == [1, 0, 1]
    assert nanpass.harden(Peek(), mode="check").interception.startswith("screen:")
    assert nanpass.harden(Peek(), mode="check", every_op=True).interception.startswith("mode:")


def test_a_nan_made_and_masked_inside_the_step_is_seen_only_at_every_op():
    torch.manual_seed(0)
    model, x = MaskedLog(), torch.randn(3, 4)
    with torch.no_grad():
        out = _screened(model)(x)  # the documented blind spot
        assert torch.isfinite(out).all()
        msg = _raised(nanpass.harden(model, mode="check", every_op=True), x)
    assert msg.startswith("nanpass: NaN created by torch.log")


def test_the_run_again_draws_the_same_random_numbers():
    """A NaN that depends on a dropout mask (the global generator) is reproduced, and named."""

    class DropLog(nn.Module):
        def forward(self, x):
            return torch.log(F.dropout(x, 0.5, training=True)).sum(0)

    torch.manual_seed(1)
    msg = _raised(_screened(DropLog()), torch.rand(64, 4) + 0.5)
    assert "not reproduced" not in msg
    assert "torch.log" in msg and "test_check_screen.py" in msg


def test_a_hit_the_run_again_does_not_reproduce_is_said_with_what_the_screen_saw():
    class Once(nn.Module):  # state the step changes outside torch: a Python counter
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x * float("nan") if self.calls == 2 else x  # (1: _screened's first call)

    msg = _raised(_screened(Once()), torch.ones(2, 3))
    assert msg.startswith("nanpass: the screen saw NaN in output 0 of Once (shape (2, 3) float32)")
    assert "not reproduced" in msg and "every_op=True" in msg
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _screened(Once(), "warn")(torch.ones(2, 3))
    found = [str(x.message) for x in w if issubclass(x.category, nanpass.NonFiniteWarning)]
    assert len(found) == 1 and "not reproduced" in found[0]


def test_the_run_again_starts_from_the_buffers_the_forward_started_from():
    """A forward that writes a buffer it reads: the run again starts from the value before the
    forward (kept for the buffers a forward was seen to write), and the step leaves the buffer
    as one plain forward does."""

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("count", torch.zeros(()))

        def forward(self, x):
            self.count += 1
            return x / (3.0 - self.count)

    model = Counter()
    safe = nanpass.harden(model, mode="check")
    x = torch.ones(2)
    safe(x), safe(x)  # (the first at every op, the second screened: it sees the write)
    msg = _raised(safe, x)
    assert "not reproduced" not in msg and "infinity" in msg and "test_check_screen.py" in msg, msg
    assert float(model.count) == 3.0


def test_a_gradient_autograd_grad_returns_is_screened_and_nothing_is_accumulated():
    torch.manual_seed(0)
    model, x = SqrtAtZero(), torch.randn(3, 4)
    safe = _screened(model)
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: non-finite gradient created by the backward of torch.sqrt"):
        torch.autograd.grad(safe(x), list(model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_a_finite_step_leaves_the_gradients_as_the_plain_step():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), torch.randn(5, 4)
    model(x).pow(2).mean().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    safe = _screened(model)
    safe(x).pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    safe(x).pow(2).mean().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters(), strict=True))


def test_a_non_finite_loss_gradient_is_the_loss_code_s():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    out = _screened(model)(torch.randn(3, 4))
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: non-finite gradient reaches the model's output"):
        (out.sum() * float("inf")).backward()


def test_a_gradient_penalty_s_second_backward_is_said_then_watched_at_every_op():
    class Sinc(nn.Module):  # finite first derivative at 0, NaN in the second (a penalty's)
        def forward(self, x):
            return torch.sinc(x)

    safe = nanpass.harden(Sinc(), mode="check")
    safe(torch.ones(3))  # (the first call at every op)

    def step():
        x = torch.zeros(3, requires_grad=True)
        (g,) = torch.autograd.grad(safe(x).sum(), x, create_graph=True)
        torch.autograd.grad(g.sum(), x)

    with pytest.raises(nanpass.NonFiniteError, match="a gradient penalty") as e:
        step()
    assert "not reproduced" in str(e.value)
    with pytest.raises(nanpass.NonFiniteError, match="^nanpass: non-finite gradient created by the backward of"):
        step()  # the next step, at every op: the op is named


class SqrtOfShifted(nn.Module):
    """sqrt(x - 1): finite for x = 2, NaN for x = 0 (exact values)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return torch.sqrt(x - 1.0) * self.w


def _loop_then(model, x, bad, backward: bool):
    """Three training steps, then ``bad`` through the model (its backward if ``backward``)."""
    for _ in range(3):
        model(x).sum().backward()
    out = model(bad)
    if backward:
        out.sum().backward()
    return out


def test_in_a_training_loop_a_forward_nan_is_named_when_its_backward_ends():
    """One read a step: the forward's scalars wait for the backward's; the finding names the
    forward's op and line as the check of every op does, raised from ``backward()``."""
    model = SqrtOfShifted()
    x, bad = torch.full((3, 4), 2.0), torch.zeros(3, 4)
    every = nanpass.harden(model, mode="check", every_op=True)
    with pytest.raises(nanpass.NonFiniteError) as want:
        _loop_then(every, x, bad, backward=False)
    safe = nanpass.harden(model, mode="check")
    out = None
    with pytest.raises(nanpass.NonFiniteError) as got:
        out = _loop_then(safe, x, bad, backward=False)  # the forward: not read yet
        out.sum().backward()
    assert out is not None  # (raised by the backward, not the forward)
    assert str(got.value).splitlines()[0] == str(want.value).splitlines()[0]


def test_a_forward_no_backward_reaches_is_read_at_the_next_forward():
    """An evaluation with grad on after training steps: its forward's scalars are read at the
    model's next forward, which names the op; the forward after that reads at once again."""
    safe = nanpass.harden(SqrtOfShifted(), mode="check")
    x, bad = torch.full((3, 4), 2.0), torch.zeros(3, 4)
    _loop_then(safe, x, bad, backward=False)  # no backward reaches the bad forward
    with pytest.raises(nanpass.NonFiniteError, match="torch.sqrt"):
        safe(x)
    with pytest.raises(nanpass.NonFiniteError, match="torch.sqrt"):
        safe(bad)  # (read at once: the last forward was not reached by a backward)


def test_a_run_again_leaves_a_batch_norms_counters_as_one_step_does():
    """A screened hit runs the forward again into copies of every buffer, integer ones too:
    ``num_batches_tracked`` and the running statistics are as one plain step left them."""

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return torch.sqrt(self.bn(x) * 0.0 + x - 1.0)  # NaN where x < 1

    torch.manual_seed(0)
    plain, safe_model = Norm(), Norm()
    safe = nanpass.harden(safe_model, mode="check")
    good, bad = torch.full((3, 4), 2.0) + torch.arange(3.0)[:, None], torch.zeros(3, 4)
    for m in (plain, safe):
        with torch.no_grad():  # (the first call at every op, then a screened one)
            m(good)
            m(good)
    with pytest.raises(nanpass.NonFiniteError), torch.no_grad():
        safe(bad)
    plain(bad)
    assert int(safe_model.bn.num_batches_tracked) == int(plain.bn.num_batches_tracked) == 3
    assert torch.equal(safe_model.bn.running_mean, plain.bn.running_mean)
    assert torch.equal(safe_model.bn.running_var, plain.bn.running_var)


def test_a_screened_hit_after_a_batch_norm_names_the_op_not_its_statistics():
    """batch_norm writes its running statistics without moving their version; the screen
    learns them by value, so the run again starts from the statistics the forward started
    from (the first run wrote NaN into them) and names the op that made the NaN."""

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.bn(torch.sqrt(x - 1.0))

    safe = nanpass.harden(Norm(), mode="check")
    good = torch.full((3, 4), 2.0) + torch.arange(3.0)[:, None]
    for _ in range(3):
        safe(good).sum().backward()
    bad = good.clone()
    bad[0, 0] = 0.0
    with pytest.raises(nanpass.NonFiniteError) as e:
        safe(bad).sum().backward()
    assert str(e.value).splitlines()[0].startswith("nanpass: NaN created by torch.sqrt"), str(e.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_the_screens_scalar_copies_nothing_of_its_tensor(dtype):
    """A screened output's scalar reads it once and allocates a few scalars, not a copy in a
    wider float (a GPT-2 head's float32 logits were copied to float64 at the forward's peak);
    finite exactly when every element is, NaN exactly when one is."""
    from nanpass._deferred import INF, scalar, state_of

    t = torch.ones(1 << 18, dtype=dtype)  # (above _deferred._SMALL: a small one gets a float64 sum)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        s = scalar(t)
    allocated = sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)
    assert allocated < t.numel() * t.element_size() // 8, allocated
    assert s.dtype == torch.float64 and state_of(s.item()) == 0
    t[7] = float("inf")
    t[9] = -float("inf")
    assert state_of(scalar(t).item()) == INF
    t[3] = float("nan")
    assert math.isnan(scalar(t).item())
    assert scalar(torch.ones(0, dtype=dtype)).item() == 0.0
