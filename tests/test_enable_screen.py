"""``nanpass.enable`` / ``nanpass run`` screen (issue 47, item 1): each outermost module call
runs as written after its first, its outputs and its backward's gradients checked on the
device with the program's own reads; on a hit it runs again with the check at each op, which
names the op as ``every_op=True`` (the check of every call) does."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import nanpass
from nanpass import _intercept
from nanpass._compat import function_mode_stack
from nanpass._screen import _HELD


class _Net(nn.Module):
    """A trigger at its step ``bad`` (1-based), chosen by ``where``; finite before it."""

    def __init__(self, where: str):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.where = where
        self.gate = nn.Parameter(torch.ones(4))

    def forward(self, x, zero):
        h = self.lin(x)
        if self.where == "forward-nan":
            return h * torch.sqrt(-zero)  # sqrt(-1) where zero == 1
        if self.where == "forward-overflow":
            return h * torch.exp(zero * 1e4)  # exp(1e4) = inf from a finite operand
        if self.where == "backward":
            return h * torch.sqrt(self.gate * (1.0 - zero))  # sqrt's gradient at 0: inf
        if self.where == "pole":
            return torch.log(self.gate * (1.0 - zero)) + h  # log(0) = -inf, on purpose
        raise AssertionError(self.where)


def _program(where: str, every_op: bool, steps: int = 4, bad: int = 3) -> str | None:
    """A training loop under enable("check"), the loss inline; the finding's text."""
    net = _Net(where)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    x = torch.ones(2, 4)
    try:
        with nanpass.enable("check", **({"every_op": True} if every_op else {})):
            for step in range(1, steps + 1):
                zero = torch.zeros(2, 4)
                if step == bad:
                    zero[0, 0] = 1.0
                out = net(x, zero)
                loss = (out - out.detach().mean()).pow(2).mean() * 0.0 + out.sum() * 0.0 if where == "pole" \
                    else out.sum()
                if where == "pole":
                    loss = loss + (out - out).sum()  # -inf - -inf = NaN in the loss code
                opt.zero_grad()
                loss.backward()
                opt.step()
    except nanpass.NonFiniteError as e:
        return str(e)
    return None


@pytest.mark.parametrize("where", ["forward-nan", "forward-overflow", "backward", "pole"])
def test_the_screen_names_what_every_op_names(where):
    """A trigger at the third step, after two screened steps: the op, its module and line as
    the check of every call names them (the backward: the node and its forward line)."""
    got, want = _program(where, False), _program(where, True)
    assert want is not None and got is not None
    assert got.startswith("nanpass: ")
    n = 2 if where in ("backward", "pole") else 1
    assert got.split("\n")[:n] == want.split("\n")[:n], (got, want)


def _calls_watched(every_op: bool) -> list[str]:
    """Calls the check looked at in the third step of a loop over an MLP, the loss inline."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    seen = []
    run = _intercept._watched

    def counting(watch, sites, func, *args, **kwargs):
        seen.append(getattr(func, "__name__", str(func)))
        return run(watch, sites, func, *args, **kwargs)

    with nanpass.enable("check", **({"every_op": True} if every_op else {})):
        for step in range(3):
            if step == 2:
                _intercept._watched = counting
            try:
                opt.zero_grad()
                loss = (net(x) - y).pow(2).mean()
                loss.backward()
                opt.step()
            finally:
                _intercept._watched = run
    return seen


def test_a_screened_module_call_runs_as_written():
    """After its first call, a module's calls inside run with no check: only the loss code
    between module calls is watched call by call (``pow``, ``mean``, ``sub``)."""
    every, screened = _calls_watched(True), _calls_watched(False)
    inside = {"linear", "relu", "layer_norm"}
    assert inside <= set(every), every
    assert not inside & set(screened), screened
    assert {"sub", "pow", "mean"} <= set(screened), screened
    assert len(screened) <= 6, screened


def test_a_step_the_run_again_does_not_reproduce_is_said():
    """Python state the step changed (a module that makes NaN only on its third call): the
    screen saw it, the run again did not, and the finding says so."""

    class Once(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.n = 0

        def forward(self, x):
            self.n += 1
            h = self.lin(x)
            return h * (h - h) / (h - h) if self.n == 3 else h

    net = Once()
    with pytest.raises(nanpass.NonFiniteError, match="not reproduced") as e:
        with nanpass.enable("check"):
            for _ in range(4):
                net(torch.ones(2, 4)).sum().backward()
    assert "nanpass.enable(every_op=True)" in str(e.value)


def test_an_evaluation_loop_keeps_few_calls_for_a_run_again():
    """No backward, no optimizer step: the screened calls' inputs (kept for a run again) are
    read and let go every few calls, never piled up."""
    import weakref

    net = nn.Linear(4, 4)
    refs = []
    with nanpass.enable("check"), torch.no_grad():
        for _ in range(3 * _HELD):
            x = torch.ones(2, 4)
            refs.append(weakref.ref(x))
            net(x)
            del x
        alive = sum(r() is not None for r in refs)
    assert alive <= _HELD + 1, alive


def test_a_mode_entered_after_an_optimizer_step_is_left_in_place():
    """The program's mode is off the stack from an optimizer step to the next module call: a
    mode the program enters in between (``torch.device``) stays where it was put, and the
    program's mode is back at the next module call outside it."""
    net = nn.Linear(4, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.0)
    plain_call = nn.Module.__call__
    with nanpass.enable("check") as on:
        for _ in range(2):
            net(torch.ones(2, 4)).sum().backward()
            opt.step()
        before = list(function_mode_stack())
        with torch.device("cpu"):
            inner = list(function_mode_stack())
            net(torch.ones(2, 4)).sum().backward()
            assert list(function_mode_stack())[:len(inner)] == inner
        assert list(function_mode_stack()) == before
        net(torch.ones(2, 4))
        assert function_mode_stack()[-1] is on._mode
        assert nn.Module.__call__ is not plain_call  # (the screen's wrapper, while enabled)
    assert on._mode not in function_mode_stack()
    assert nn.Module.__call__ is plain_call  # torch's own again once enable ends


def test_a_program_with_no_module_stays_watched_after_its_steps():
    """Functional code with no module (no call to screen): every call is watched, each step."""
    w = torch.ones(4, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.0)
    with pytest.raises(nanpass.NonFiniteError, match="torch.log"):
        with nanpass.enable("check"):
            for step in range(3):
                x = torch.ones(4) * (step != 2)
                loss = torch.log(x * w).sum() * 0.0 + (torch.log(x * w) - torch.log(x * w)).sum()
                loss.backward()
                opt.step()


def test_warn_mode_names_a_screened_nan_once():
    net = _Net("forward-nan")
    x = torch.ones(2, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanpass.enable("warn"):
            for step in range(1, 4):
                zero = torch.zeros(2, 4)
                if step == 3:
                    zero[0, 0] = 1.0
                net(x, zero).sum().backward()
    found = [str(w.message) for w in caught if issubclass(w.category, nanpass.NonFiniteWarning)]
    assert len(found) == 1 and "torch.sqrt" in found[0], found


def test_nanpass_run_every_op_names_what_the_screen_names(tmp_path, capsys):
    """``nanpass run --every-op`` checks every call of every step (a debugger's view); the
    default screen names the same op and line of tests/nan_scripts/log_zero.py (an infinity
    made on purpose inside the model at step 3, made NaN by the loss written inline)."""
    import os

    from nanpass._cli import main as cli

    script = os.path.join(os.path.dirname(__file__), "nan_scripts", "log_zero.py")
    found = {}
    for flags in ([], ["--every-op"]):
        assert cli(["run", *flags, script, str(tmp_path / "w.pt")]) == 1
        err = capsys.readouterr().err
        found[bool(flags)] = [line for line in err.splitlines() if line.startswith(("nanpass: ", "  from"))]
    assert found[False] and found[False][:2] == found[True][:2], found
    assert "log_zero.py:29" in found[False][0] and "torch.log" in found[False][1]


def test_a_batch_norms_statistics_are_where_the_call_started_in_its_run_again():
    """batch_norm writes its running statistics without moving their version: the screen
    learns the buffers a forward writes by value too, so the run again starts from the
    statistics the call started from and names the op, not a NaN it finds in the buffer."""

    class Features(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(8)
            self.lin = nn.Linear(8, 2)

        def forward(self, x):
            return self.lin(self.norm(torch.sqrt(x)))

    torch.manual_seed(0)
    m = Features()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    with pytest.raises(nanpass.NonFiniteError) as e:
        with nanpass.enable("check"):
            for step in range(5):
                x = torch.full((16, 8), 4.0) + torch.arange(16.0)[:, None]
                if step == 3:
                    x[0, 0] = -1.0
                loss = m(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert str(e.value).splitlines()[0].startswith("nanpass: NaN created by torch.sqrt"), str(e.value)


class _WithLoss(nn.Module):
    """A model that makes its own loss (as a Hugging Face model given labels does)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 2)

    def forward(self, x, y):
        return (self.lin(torch.sqrt(x)) - y).pow(2).mean()


@pytest.mark.parametrize("every_op", [False, True])
def test_a_model_that_makes_its_loss_is_read_once_a_step_and_named_the_same(every_op):
    """No call between module calls: the forward's screen is read with the backward's, before
    the optimizer step (which it stops before the step is taken), naming the op and line as the
    check of every call does at the op."""
    net = _WithLoss()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    y = torch.zeros(3, 2)
    where = None
    try:
        with nanpass.enable("check", **({"every_op": True} if every_op else {})):
            for step in range(5):
                x = torch.ones(3, 4)
                if step == 3:
                    x[1, 2] = -1.0
                where = "forward"
                loss = net(x, y)
                where = "backward"
                loss.backward()
                where = "step"
                before = net.lin.weight.detach().clone()
                opt.step()
                opt.zero_grad()
    except nanpass.NonFiniteError as e:
        assert str(e).splitlines()[0].startswith("nanpass: NaN created by torch.sqrt in <root> (_WithLoss)"), str(e)
        assert "test_enable_screen.py" in str(e).splitlines()[0]
        assert where == ("step" if not every_op else "backward"), where  # (every_op: read when backward starts)
        if where == "step":
            assert torch.equal(net.lin.weight, before)  # stopped before the step was taken
        return
    raise AssertionError("no finding")
