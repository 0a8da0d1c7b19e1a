"""Issue 47: ``nanpass.locate`` screens the step on the device (its outputs, the data, the
parameters and buffers, the loss, the gradients: one read) and runs it again with the check at
each op only on a hit, naming what ``every_op=True`` (the check at each op of its one run, all
``locate`` did before) names. The existing locate tests are in tests/test_check.py and
tests/test_watch.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import nanpass
from tests.test_host_reads import _Reads


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.LogSoftmax(-1)), torch.randn(4, 8)


def _loss(o):
    return o.pow(2).mean()


def test_a_finite_step_is_screened_with_one_read_and_no_check_at_each_op(capsys):
    """No mode during the forward, no progress (no op checked), at most one host read beyond
    the plain step's; every_op=True keeps the check at each op."""
    model, x = _mlp()
    modes = []
    model.register_forward_pre_hook(lambda *a: modes.append(len(torch.overrides._get_current_function_mode_stack())))
    with _Reads() as plain:
        _loss(model(x)).backward()
    model.zero_grad(set_to_none=True)
    with _Reads() as screened:
        clean = nanpass.locate(model, x, loss_fn=_loss, progress=True)
    assert clean.forward is None and clean.backward is None
    assert screened.n <= plain.n + 1, (screened.ops, plain.ops)
    assert capsys.readouterr().err == ""  # no op checked, so no progress line
    model.zero_grad(set_to_none=True)
    nanpass.locate(model, x, loss_fn=_loss, progress=True, every_op=True)
    assert "checked ops" in capsys.readouterr().err
    assert modes == [0, 0, 1]  # the plain step, the screened one, every_op=True's


def test_a_clean_finding_says_what_was_screened():
    model, x = _mlp()
    text = str(nanpass.locate(model, x, loss_fn=_loss, progress=False))
    assert "no NaN or Inf found" in text and "every call checked" not in text
    assert ("screened on the device, one read: 1 output, the loss, its gradient at the output, 4 gradients "
            "of parameters and inputs, the data, the parameters and buffers") in text and "every_op=True" in text
    every = str(nanpass.locate(model, x, loss_fn=_loss, progress=False, every_op=True))
    assert "no NaN or Inf found, forward or backward (every call checked)" in every


class _Log(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.log(self.fc(x) * 0.0 - 1.0)  # log(-1): NaN from finite operands


class _SqrtAtZero(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.sqrt((self.fc(x) * 0.0).pow(2).sum())  # finite forward, infinite gradient


class _Masked(nn.Module):
    """An infinity made on purpose (a mask) that a fully masked row's softmax turns into NaN."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.softmax(self.fc(x).masked_fill(torch.ones(4, dtype=torch.bool), float("-inf")), -1)


class _Softmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.softmax(self.fc(x), -1)


def _nan_input():
    x = torch.randn(3, 4)
    x[2, 1] = float("nan")
    return x


def _nan_weight():
    m = _Softmax()
    with torch.no_grad():
        m.fc.weight[1, 2] = float("nan")
    return m


CASES = {  # model, input, loss_fn, what the screen saw first
    "forward": (_Log, lambda: torch.randn(3, 4), lambda o: o.sum(), "NaN in output 0 of _Log"),
    "backward": (_SqrtAtZero, lambda: torch.randn(3, 4), lambda o: o, "in the gradient given to the parameter"),
    "infinity-then-nan": (_Masked, lambda: torch.randn(3, 4), lambda o: o.sum(), "NaN in output 0 of _Masked"),
    "data": (_Softmax, _nan_input, lambda o: o.sum(), "NaN in input tensor 0"),
    "state": (_nan_weight, lambda: torch.randn(3, 4), lambda o: o.sum(), "NaN in a parameter or buffer of _Softmax"),
    "loss-gradient": (nn.Linear, lambda: torch.randn(3, 4), lambda o: (o * 0.0).sqrt().sum(),
                      "in the gradient the loss gives output 0 of Linear"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_hit_names_what_every_op_names(case):
    make, data, loss_fn, saw = CASES[case]
    torch.manual_seed(0)
    model = make(4, 4) if make is nn.Linear else make()
    x = data()
    screened = nanpass.locate(model, x, loss_fn=loss_fn, progress=False)
    model.zero_grad(set_to_none=True)
    every = nanpass.locate(model, x, loss_fn=loss_fn, progress=False, every_op=True)
    for found in (screened.forward, screened.backward):
        assert found is None or "not reproduced" not in found.message
    assert (screened.forward is None) == (every.forward is None)
    assert (screened.backward is None) == (every.backward is None)
    messages = lambda f: ([e.message for e in (f.forward, f.backward) if e is not None],  # noqa: E731
                          [e.message for e in f.chain], f.suggestion)
    assert messages(screened) == messages(every)
    if case in ("forward", "backward", "infinity-then-nan"):  # the op and your line
        first = screened.forward or screened.backward
        assert first.created and "test_locate.py" in first.site.source
    assert saw in screened.screen and every.screen == ""


class _OwnGenerator(nn.Module):
    """Dropout drawn from a generator of the model's own, which nanpass does not replay: its
    first draw drops every element (0 / 0), its second none."""

    def __init__(self):
        super().__init__()
        self.g = torch.Generator().manual_seed(0)
        first = torch.Generator().manual_seed(0)
        u1, u2 = torch.rand(1, generator=first), torch.rand(1, generator=first)
        assert u1 != u2
        self.t, self.below = (u1 + u2) / 2, bool(u1 < u2)

    def forward(self, x):
        u = torch.rand(1, generator=self.g)
        keep = ((u > self.t) if self.below else (u < self.t)).float()
        return x * keep / keep


def test_a_hit_the_run_again_does_not_reproduce_says_what_the_screen_saw():
    model, x = _OwnGenerator(), torch.ones(2, 3)
    finding = nanpass.locate(model, x, progress=False)
    assert finding.backward is None and finding.forward is not None
    msg = finding.forward.message
    assert msg.startswith("nanpass: the screen saw NaN in output 0 of _OwnGenerator (shape (2, 3) float32), "
                          "not reproduced: "), msg
    assert "every_op=True" in msg and finding.suggestion.startswith("not reproduced")
    model.g.manual_seed(0)  # the first draw again, in every_op=True's one run: named
    every = nanpass.locate(model, x, progress=False, every_op=True)
    assert every.forward.created and every.forward.site.spelling == "operator.truediv"


class _Step(nn.Module):
    """A forward that draws from torch's generator (a NaN only for the first draw after
    seeding with 0, made by a log of a negative number) and writes a batch norm's statistics."""

    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(4, 4), nn.BatchNorm1d(4)
        torch.manual_seed(0)
        u1, u2 = torch.rand(()), torch.rand(())
        self.t, self.below = (u1 + u2) / 2, bool(u1 < u2)

    def forward(self, x):
        h = self.bn(self.fc(x))
        u = torch.rand(())
        drop = (u < self.t) if self.below else (u > self.t)
        return h, torch.log(x * (1.0 - 2.0 * drop.float()))


def test_the_run_again_starts_where_the_step_started_and_leaves_one_step_s_effects():
    model, x = _Step(), torch.rand(3, 4) + 0.5
    plain = copy.deepcopy(model)
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.ones_like(p)  # (a gradient accumulated twice would be 1 + 2g)
    torch.manual_seed(0)
    plain(x)[0].pow(2).sum().backward()
    rng = torch.get_rng_state()
    torch.manual_seed(0)
    finding = nanpass.locate(model, x, loss_fn=lambda o: o[0].pow(2).sum(), progress=False)
    assert "NaN in output 1 of _Step" in finding.screen  # the screen saw it, the run again named it
    assert finding.forward.created and finding.forward.site.spelling == "torch.log"  # the same draw
    assert torch.equal(torch.get_rng_state(), rng)  # the random state as after one step
    assert torch.equal(model.bn.running_mean, plain.bn.running_mean)  # one step's statistics
    assert int(model.bn.num_batches_tracked) == 1
    for p, q in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)  # accumulated once into .grad


class _MaskedLog(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x) * 0.0 - 1.0
        return torch.where(h > 0, torch.log(h), 0.0)  # NaN made, then masked: reaches nothing


def test_a_nan_made_and_masked_inside_the_step_is_seen_only_with_every_op():
    model, x = _MaskedLog(), torch.randn(3, 4)
    assert nanpass.locate(model, x, loss_fn=lambda o: o.sum(), progress=False).forward is None
    every = nanpass.locate(model, x, loss_fn=lambda o: o.sum(), progress=False, every_op=True)
    assert every.forward.created and every.forward.site.spelling == "torch.log"


def test_a_nan_the_loss_code_makes_from_finite_outputs_is_the_loss_s():
    """The loss code runs unchecked at each op (today's locate said "no NaN found" here): the
    screen sees the loss, the run again finds the model's values finite, and says so."""
    torch.manual_seed(0)
    model, x = nn.Linear(4, 2), torch.randn(3, 4)
    finding = nanpass.locate(model, x, loss_fn=lambda o: (o * 0.0 - 1.0).log().sum(), progress=False)
    assert finding.forward.message.startswith("nanpass: NaN in the loss, made by loss_fn from finite outputs of Linear")
    assert "not reproduced" not in finding.forward.message
    assert finding.suggestion.startswith("the loss code makes it")


class _TwoPaths(nn.Module):
    """A weight at 0 read twice: the forward is 0, each path's gradient 2e38, and their sum,
    which autograd makes between two calls, passes the float32 maximum."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return (self.w * 2e38 + self.w * 2e38) * x


def test_a_gradient_no_call_makes_is_said_as_made_again_and_unnamed():
    """The check at each op names no op here (before the screen: "no NaN or Inf found")."""
    found = nanpass.locate(_TwoPaths(), torch.ones(()), loss_fn=lambda o: o, progress=False)
    assert found.forward is None
    assert found.backward.message.startswith(
        "nanpass: the screen saw an infinity in the gradient given to the parameter 'w' (shape () float32); "
        "the run again made it too"), found.backward.message
    assert "not reproduced" not in found.backward.message
