"""torch.compile(model, backend="nanpass"): entry point, training, dynamic shapes, graph breaks.

Most tests use the aot_eager inner compiler (seconds); the `inductor` ones compile for real."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import nanpass
from tests.helpers import all_finite, forward_backward


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask):
        h = self.fc(x).masked_fill(mask, float("-inf"))
        p = torch.softmax(h, -1)
        r = torch.relu(x)
        return (p * torch.log(p + 0.0)).sum() + (r / r.sum(-1, keepdim=True)).sum()


def _inputs(bad: bool, n: int = 3):
    torch.manual_seed(0)
    x = (torch.rand(n, 4) + 0.1).requires_grad_()
    mask = torch.zeros(n, 4, dtype=torch.bool)
    if bad:
        mask[0] = True
        with torch.no_grad():
            x[1] = -100.0
    return x, mask


@pytest.mark.slow  # a fresh interpreter (subprocess)
def test_entry_point_without_import():
    code = textwrap.dedent(
        """
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LogSoftmax(-1))
        with torch.no_grad():  # rows of -inf, the log_softmax guard's own case (no inf - inf)
            m[0].weight.fill_(1.0)
            m[0].bias.zero_()
        assert "nanpass" not in sys.modules
        c = torch.compile(m, backend="nanpass", options={"inner": "aot_eager"})
        x = torch.full((2, 3), float("-inf"), requires_grad=True)
        out = c(x)
        out.sum().backward()
        assert "nanpass" in sys.modules
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all(), out
        print("entry point ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "entry point ok" in res.stdout


def test_training_through_compiled_graph():
    model = Model()
    be = nanpass.backend(inner="aot_eager")
    compiled = torch.compile(model, backend=be)
    x, mask = _inputs(bad=True)
    assert not all_finite(forward_backward(model, (x, mask))[0])
    model.zero_grad()
    outs, grads = forward_backward(compiled, (x, mask))
    assert all_finite(outs + grads)
    params = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in params)
    # on safe inputs the compiled hardened model agrees with the eager original
    x, mask = _inputs(bad=False)
    ref, ref_grads = forward_backward(model, (x, mask))
    got, got_grads = forward_backward(compiled, (x, mask))
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(got_grads, ref_grads)
    assert {c.op for c in be.changes if c.action == "guarded"} >= {"softmax", "div"}


def test_dynamic_shapes():
    model = Model()
    be = nanpass.backend(inner="aot_eager")
    compiled = torch.compile(model, backend=be, dynamic=True)
    for n in (3, 5, 9):
        outs, grads = forward_backward(compiled, _inputs(bad=True, n=n))
        assert all_finite(outs + grads)
    assert len(be.graphs) == 1  # one graph serves every batch size


def test_graph_break_in_the_middle():
    class Broken(nn.Module):
        def forward(self, x):
            a = torch.log(x)
            torch._dynamo.graph_break()
            return a + torch.sqrt(x)

    be = nanpass.backend(inner="aot_eager")
    compiled = torch.compile(Broken(), backend=be)
    x = torch.tensor([0.0, -1.0, 4.0], requires_grad=True)
    outs, grads = forward_backward(compiled, (x,))
    assert all_finite(outs + grads)
    ops = [{c.op for c in g.changes if c.action == "guarded"} for g in be.graphs]
    assert ops == [{"log"}, {"sqrt"}]


def test_options_reach_the_pass():
    be = nanpass.backend(inner="aot_eager", exclude_ops=["softmax"])
    torch.compile(Model(), backend=be)(*_inputs(bad=False))
    changes = be.changes
    assert any(c.op == "softmax" and c.action == "left" for c in changes)
    assert not any(c.op == "softmax" and c.action == "guarded" for c in changes)


def test_string_backend_with_options():
    compiled = torch.compile(Model(), backend="nanpass", options={"inner": "aot_eager", "mode": "off"})
    outs, _ = forward_backward(compiled, _inputs(bad=True))
    assert not all_finite(outs)  # mode="off" really switches the rewrite off


@pytest.mark.parametrize(
    "options,needle",
    [({"inner": "tvm"}, "unknown inner compiler 'tvm'"),
     ({"modes": "guard"}, "unknown backend option 'modes'; valid options: 'mode'")],
)
def test_bad_backend_options(options, needle):
    with pytest.raises(Exception) as e:
        torch.compile(Model(), backend="nanpass", options=options)(*_inputs(bad=False))
    err = e.value
    while not isinstance(err, nanpass.NanpassError) and err is not None:
        err = getattr(err, "inner_exception", None) or err.__cause__
    assert isinstance(err, nanpass.ConfigError), repr(e.value)
    assert str(err).startswith("nanpass: ") and needle in str(err)


def test_backend_factory_rejects_bad_inner():
    with pytest.raises(nanpass.ConfigError, match="^nanpass: unknown inner compiler 'tvm'"):
        nanpass.backend(inner="tvm")


@pytest.mark.inductor
def test_inductor_training_step():
    model = Model()
    be = nanpass.backend()  # inductor
    compiled = torch.compile(model, backend=be)
    outs, grads = forward_backward(compiled, _inputs(bad=True))
    assert all_finite(outs + grads)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    x, mask = _inputs(bad=False)
    ref, _ = forward_backward(model, (x, mask))
    got, _ = forward_backward(compiled, (x, mask))
    torch.testing.assert_close(got, ref)


def test_ops_on_chunks_are_guarded():
    """chunk/split/unbind results reach the graph through operator.getitem: tensors, not shape
    arithmetic (MobileViTv2's softmaxes were left unguarded this way)."""

    class Chunks(nn.Module):
        def forward(self, x):
            a, b = x.chunk(2, -1)
            c, d = x.unbind(0)
            return torch.log(a) + torch.sqrt(b) + torch.softmax(a, -1) + torch.log(c)[:2] + d[:2]

    be = nanpass.backend(inner="aot_eager")
    x = torch.tensor([[0.0, -1.0, 0.0, -4.0], [1.0, 2.0, 3.0, 4.0]])
    assert torch.isfinite(torch.compile(Chunks(), backend=be)(x)).all()
    assert sorted(c.op for c in be.changes if c.action == "guarded") == ["log", "log", "softmax", "sqrt"]


# -- torch.compile's mode and inductor's options reach inductor (issue 38, item 3) -----------


class _Handed:
    """Stands in for inductor: records the mode and options it is built with, runs the graph."""

    def __init__(self):
        self.calls = []

    def __call__(self, mode, options):
        self.calls.append((mode, dict(options or {})))

        def compile_(gm, example_inputs):
            return gm.forward

        return compile_


@pytest.fixture
def handed(monkeypatch):
    from nanpass import _backend

    h = _Handed()
    monkeypatch.setattr(_backend, "inductor_with", h)
    return h


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
def test_torch_compile_mode_reaches_inductor(handed, mode):
    m = Model()
    out = torch.compile(m, backend="nanpass", mode=mode)(*_inputs(bad=True))
    assert bool(torch.isfinite(out))
    assert handed.calls and handed.calls[-1] == (mode, {})


def test_inductor_options_reach_inductor_beside_nanpass_options(handed):
    m = Model()
    compiled = torch.compile(m, backend="nanpass",
                             options={"triton.cudagraphs": True, "exclude_ops": ["pow"]})
    compiled(*_inputs(bad=False))
    assert handed.calls[-1] == (None, {"triton.cudagraphs": True})
    (record,) = nanpass.report(compiled).graphs
    assert all(c.op != "pow" or c.action == "left" for c in record.changes)


def test_a_configured_backend_hands_on_its_mode_and_torch_compiles(handed):
    b = nanpass.backend(compile_mode="reduce-overhead", inductor_options={"max_autotune": True})
    torch.compile(Model(), backend=b)(*_inputs(bad=False))
    assert handed.calls[-1] == ("reduce-overhead", {"max_autotune": True})
    torch._dynamo.reset()
    torch.compile(Model(), backend=nanpass.backend(), mode="max-autotune")(*_inputs(bad=False))
    assert handed.calls[-1] == ("max-autotune", {})


def test_plain_backend_use_builds_inductor_as_before(handed):
    torch.compile(Model(), backend="nanpass")(*_inputs(bad=False))
    assert handed.calls == []  # no mode, no option: inductor's compile_fx as it was


def test_what_cannot_reach_inductor_fails_naming_it():
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: mode='reduce-overhead' is for inductor"):
        nanpass.backend(inner="aot_eager", compile_mode="reduce-overhead")
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: inductor option 'triton.cudagraphs' is for inductor"):
        nanpass.backend(inner="eager", inductor_options={"triton.cudagraphs": True})
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: unknown torch.compile mode 'fast'"):
        nanpass.backend(compile_mode="fast")
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: unknown backend option 'no_such_option'"):
        nanpass.backend(inductor_options={"no_such_option": 1})


@pytest.mark.inductor
def test_reduce_overhead_through_the_backend_under_real_inductor():
    """On the CPU inductor skips CUDA graphs (they need CUDA inputs) and runs the graph: the
    mode reached it, and the guards are in what runs."""
    m = Model()
    out = torch.compile(m, backend="nanpass", mode="reduce-overhead")(*_inputs(bad=True))
    assert bool(torch.isfinite(out))
    assert not bool(torch.isfinite(m(*_inputs(bad=True))))  # the plain model's NaN


def test_a_mean_loss_over_no_element_compiles_and_is_zero():
    """Issue 39, item 1: aot_autograd decomposes mse_loss's backward (as smooth_l1_loss's and
    huber_loss's) with ``2.0 / input.numel()`` in Python, so compiling a plain model whose loss
    averages no element raises ZeroDivisionError at trace time. The backend guards the call
    before aot_autograd sees it (the loss with reduction='none', summed): it compiles, and the
    loss is 0 with zero gradients."""
    import torch.nn.functional as F

    class Depth(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x, target):
            return F.mse_loss(self.fc(x).squeeze(-1), target)

    model = Depth()
    x, target = torch.zeros(0, 3), torch.zeros(0)
    try:
        torch.compile(model, backend="aot_eager")(x, target).backward()
    except Exception as e:  # noqa: BLE001 - torch's own, where it still decomposes so
        assert "division by zero" in str(e), e
    torch._dynamo.reset()
    model.zero_grad()
    be = nanpass.backend(inner="aot_eager")
    loss = torch.compile(model, backend=be)(x, target)
    loss.backward()
    assert loss.item() == 0.0 and not torch.signbit(loss)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    assert [c.op for c in be.changes if c.action == "guarded"] == ["mse_loss"]
