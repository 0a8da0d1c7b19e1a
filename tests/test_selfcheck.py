"""The self-check (issue 37, item 3): on a torch outside the tested releases the first harden,
backend or enable use runs the rule table's bad operands through the guards and refuses, with
a ``nanpass:`` error naming the op and the torch, any guard that is not finite there. The test
suite runs it on every tested torch (``NANPASS_SELFCHECK=1`` in conftest)."""

from __future__ import annotations

import threading

import pytest
import torch

import nanpass
from nanpass import _selfcheck
from nanpass._compat import function_mode_stack
from nanpass._rules import BY_NAME, RULES


def test_every_guard_is_finite_on_its_own_bad_operands_on_this_torch():
    failed = _selfcheck.run_selfcheck()
    assert failed == {}, f"torch {torch.__version__}: {failed}"
    guarded = [r for r in RULES if r.guarded and r.name not in _selfcheck.NO_SAMPLE]
    assert _selfcheck.checked_rules() == guarded  # the whole table, not a handful


def _unguarded(fn, args, kwargs, consts, fence):
    return fn(*args, **kwargs)  # a guard broken on purpose: the op as written


@pytest.fixture
def broken_log():
    """The log rule's guard replaced by the op as written, as a torch could break it."""
    rule = BY_NAME["log"]
    saved = rule.guard
    object.__setattr__(rule, "guard", _unguarded)  # Rule is frozen
    _selfcheck.forget()
    yield rule
    object.__setattr__(rule, "guard", saved)
    _selfcheck.forget()


class _Log(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_a_broken_guard_is_refused_naming_the_op_and_the_torch(broken_log):
    with pytest.raises(_selfcheck.SelfCheckError) as e:
        nanpass.harden(_Log(), selfcheck=True)
    msg = str(e.value)
    assert msg.startswith("nanpass: on torch ") and torch.__version__ in msg
    assert "guard of log is" in msg and "exclude_ops=['log']" in msg and "selfcheck=False" in msg
    assert isinstance(e.value, nanpass.NanpassError)


@pytest.mark.parametrize("entry", ["backend", "enable"])
def test_the_backend_and_enable_refuse_it_too(broken_log, entry):
    with pytest.raises(_selfcheck.SelfCheckError, match=r"^nanpass: on torch .* guard of log is"):
        if entry == "backend":
            nanpass.backend(inner="aot_eager", selfcheck=True)
        else:
            nanpass.enable("guard", selfcheck=True)


def test_the_user_can_skip_it_or_leave_the_op_alone(broken_log):
    x = torch.tensor([0.0, 1.0])
    assert isinstance(nanpass.harden(_Log(), selfcheck=False), nanpass.Hardened)
    out = nanpass.harden(_Log(), selfcheck=True, exclude_ops=["log"])(x)
    assert torch.equal(out, torch.log(x))  # excluded: left as written, as asked
    nanpass.harden(_Log(), mode="check", selfcheck=True)  # check mode guards nothing


def test_an_untested_torch_checks_by_default(broken_log, monkeypatch):
    monkeypatch.delenv(_selfcheck.ENV, raising=False)
    monkeypatch.setattr(_selfcheck, "TESTED", ("2.0", "2.1"))  # this torch is not among them
    with pytest.raises(_selfcheck.SelfCheckError, match=r"^nanpass: on torch "):
        nanpass.harden(_Log())


def test_a_tested_torch_does_not_check_unless_asked(broken_log, monkeypatch):
    monkeypatch.delenv(_selfcheck.ENV, raising=False)
    monkeypatch.setattr(_selfcheck, "TESTED", (torch.__version__[:4],))
    nanpass.harden(_Log())  # no check: tested here
    assert _selfcheck._VERDICT is None


def test_the_option_is_a_bool():
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: selfcheck must be True or False"):
        nanpass.harden(_Log(), selfcheck="no")


def test_the_thread_that_ran_the_check_lives_on(monkeypatch):
    """A thread that ran a backward frees torch's thread-local Python objects as it ends, after
    ``join`` returned; on torch 2.12 that raced the interpreter's exit and aborted one process
    in ten ("terminate called without an active exception", CI on 2.12.1). So the check runs
    in a thread that never ends, the same one each time, with the caller's modes out of sight."""
    seen = []

    def check(rules=None):
        seen.append((threading.current_thread(), function_mode_stack()))
        return {}

    monkeypatch.setattr(_selfcheck, "run_selfcheck", check)
    _selfcheck.forget()
    try:
        with nanpass.enable("check"):  # a mode of the caller's
            _selfcheck.failures()
        _selfcheck.forget()
        _selfcheck.failures()
    finally:
        _selfcheck.forget()
    (first, modes), (second, _) = seen
    assert first is second and first is not threading.current_thread() and modes == []
    assert first.is_alive() and first.daemon


def test_a_check_that_cannot_run_says_why(monkeypatch):
    def check(rules=None):
        raise MemoryError("no room")

    monkeypatch.setattr(_selfcheck, "run_selfcheck", check)
    _selfcheck.forget()
    try:
        with pytest.raises(_selfcheck.SelfCheckError,
                           match=r"^nanpass: the self-check of the guards failed to run "
                                 r"\(MemoryError: no room\); selfcheck=False skips it"):
            _selfcheck.failures()
    finally:
        _selfcheck.forget()
