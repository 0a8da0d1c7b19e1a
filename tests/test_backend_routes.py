"""Issue 45: what ``backend="nanpass"`` used to leave unguarded in silence. Each case is a graph
dynamo hands the backend in a form the rewrite did not read: an autocast region, an unbacked
size, a ``.item()`` scalar, a dunder written out, an ``allow_in_graph`` function, a
``while_loop`` with gradients, forward-mode AD inside the graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanpass


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def all_finite(*tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _backend(inner: str = "aot_eager"):
    return nanpass.backend(inner=inner)


def _actions(be, op: str) -> list[str]:
    return [c.action for c in be.changes if c.op == op]


# -- 1. autocast: a product computes in the region's dtype, not its operands' ------------------


def _autocast_model():
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.fill_(300.0)  # 4 * 300 * 100 = 120000: past float16's max (65504)
        lin.bias.zero_()
    return lin


def test_a_product_inside_an_autocast_region_is_guarded_in_its_dtype():
    lin = _autocast_model()

    def f(x):
        with torch.autocast("cpu", dtype=torch.float16):
            h = lin(x)
        return F.layer_norm(h.float() + x, (4,))

    x = torch.full((2, 4), 100.0)
    assert not all_finite(torch.compile(f, backend="aot_eager")(x))  # inf - inf in the norm
    be = _backend()
    assert all_finite(torch.compile(f, backend=be)(x))
    assert _actions(be, "linear") == ["guarded"]


def test_a_product_under_autocast_around_the_compiled_call_is_guarded():
    lin = _autocast_model()
    x = torch.full((2, 4), 100.0)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not all_finite(torch.compile(lin, backend="aot_eager")(x))
    be = _backend()
    with torch.autocast("cpu", dtype=torch.float16):
        out = torch.compile(lin, backend=be)(x)
    assert out.dtype == torch.float16 and all_finite(out)
    assert _actions(be, "linear") == ["guarded"]


def test_a_bfloat16_autocast_region_leaves_a_product_as_written():
    lin = _autocast_model()

    def f(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return lin(x)

    be = _backend()
    torch.compile(f, backend=be)(torch.full((2, 4), 100.0))
    assert _actions(be, "linear") == []  # bfloat16 has float32's range: not looked at


@pytest.mark.inductor
def test_a_product_inside_an_autocast_region_is_guarded_under_inductor():
    lin = _autocast_model()

    def f(x):
        with torch.autocast("cpu", dtype=torch.float16):
            h = lin(x)
        return F.layer_norm(h.float() + x, (4,))

    be = _backend("inductor")
    assert all_finite(torch.compile(f, backend=be)(torch.full((2, 4), 100.0)))
    assert _actions(be, "linear") == ["guarded"]


# -- 2. unbacked sizes: a size not known to be non-zero may be zero -----------------------------


@pytest.mark.parametrize("loss", [F.mse_loss, F.l1_loss, F.smooth_l1_loss])
@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_a_loss_over_a_data_dependent_selection_is_guarded(loss):
    def f(p, d):
        i = (d > 0).nonzero().squeeze(1)
        return loss(p[i], d[i])

    be = _backend()
    c = torch.compile(f, backend=be, fullgraph=True)
    p = torch.tensor([0.5, -1.0, 2.0, 3.0], requires_grad=True)
    out = c(p, torch.zeros(4))  # no element selected: the mean is 0 / 0
    out.backward()
    assert out.item() == 0.0 and p.grad.tolist() == [0.0] * 4
    assert _actions(be, "mse_loss") == ["guarded"]
    # a non-empty selection: the plain loss, bit for bit
    d = torch.tensor([0.0, 2.0, 0.0, 1.0])
    assert c(p, d).item() == loss(p[d > 0], d[d > 0]).item()


# -- 3. a scalar out of .item(): the division by it is guarded, and compiles ----------------------


@torch._dynamo.config.patch(capture_scalar_outputs=True)
def test_a_division_by_an_item_scalar_compiles_and_is_guarded():
    def f(loss, mask):
        return (loss * mask).sum() / mask.sum().item()

    be = _backend()
    c = torch.compile(f, backend=be, fullgraph=True)
    assert c(torch.ones(3), torch.zeros(3)).item() == 0.0  # 0 / 0
    assert c(torch.ones(3), torch.tensor([1.0, 1.0, 0.0])).item() == 1.0
    assert _actions(be, "div") == ["guarded"]


# -- 4. dunders written out ---------------------------------------------------------------------


_DUNDERS = {
    "__rtruediv__": (lambda x: x.__rtruediv__(1.0), "div"),
    "__rdiv__": (lambda x: x.__rdiv__(2.0), "div"),
    "__div__": (lambda x: torch.ones(2).__div__(x), "div"),
    "__idiv__": (lambda x: torch.ones(2).__idiv__(x), "div"),
    "__rpow__": (lambda x: x.__rpow__(0.0) * 0 + (x - 1).__rpow__(0.0), "pow"),
}


@pytest.mark.parametrize("name", sorted(_DUNDERS))
def test_a_dunder_written_out_is_guarded(name):
    fn, op = _DUNDERS[name]
    x = torch.zeros(2)
    assert not all_finite(torch.compile(fn, backend="aot_eager")(x.clone()))
    be = _backend()
    assert all_finite(torch.compile(fn, backend=be)(x.clone()))
    assert "guarded" in _actions(be, op)


def test_a_reflected_dunder_reads_its_divisor_as_the_divisor():
    be = _backend()
    out = torch.compile(lambda x: x.__rtruediv__(1.0), backend=be)(torch.tensor([0.0, 2.0]))
    assert out.tolist() == [0.0, 0.5]  # 1 / 0 is the division by zero: 0, not +sat


# -- 5. allow_in_graph: the function's own calls are guarded -------------------------------------


def _allowed_log(x):
    return torch.log(x)


def test_an_allowed_function_s_calls_are_guarded_and_reported():
    torch._dynamo.allow_in_graph(_allowed_log)

    def f(x):
        return _allowed_log(x) + 1

    x = torch.tensor([0.0, 1.0], requires_grad=True)
    assert not all_finite(torch.compile(f, backend="aot_eager")(x))
    be = _backend()
    out = torch.compile(f, backend=be)(x)
    out.sum().backward()
    assert all_finite(out, x.grad) and out[1].item() == 1.0
    (change,) = [c for c in be.changes if c.op == "log"]
    assert change.action == "guarded" and "_allowed_log" in change.spelling
    assert change.source is not None and "test_backend_routes.py" in change.source


# -- 6. while_loop with an input that requires grad ------------------------------------------------


def test_a_while_loop_body_is_guarded_when_its_input_requires_grad():
    from torch._higher_order_ops import while_loop

    def f(v):
        def cond(i, v):
            return i < 2

        def body(i, v):
            return i + 1, v / (v - v)

        return while_loop(cond, body, (torch.tensor(0), v))[1]

    v = torch.ones(2, requires_grad=True)
    be = _backend()
    # torch's own while_loop backward reads .item(): aot_autograd refuses the graph, and dynamo
    # would run the loop eagerly without its guards; the backend runs the rewritten graph
    with pytest.warns(nanpass.GuardWarning, match="nanpass: the inner compiler 'aot_eager' cannot trace"):
        out = torch.compile(f, backend=be)(v)
    out.sum().backward()
    assert out.tolist() == [0.0, 0.0] and all_finite(v.grad)
    assert "guarded" in _actions(be, "div")


# -- 7. forward-mode AD (hessian) inside the compiled graph ------------------------------------------


def test_a_hessian_inside_a_compiled_function_runs_guarded():
    def f(x):
        return torch.func.hessian(lambda y: torch.log(y).sum())(x)

    be = _backend()
    x = torch.tensor([0.5, 2.0])
    h = torch.compile(f, backend=be)(x)
    assert torch.equal(h, torch.func.hessian(lambda y: torch.log(y).sum())(x))  # -1 / y ** 2
    h0 = torch.compile(f, backend=be)(torch.tensor([0.0, 2.0]))
    assert all_finite(h0)
    assert "guarded" in _actions(be, "log")


def _allowed_exp(x):
    return torch.exp(x)


def test_an_allowed_function_s_calls_take_the_backends_constants():
    torch._dynamo.allow_in_graph(_allowed_exp)
    constants = {"exp": {"hi": 2.0}}  # past 2, exp's guard gives its stand-in for inf
    x = torch.tensor([1.0, 50.0])  # exp(50) is finite in float32
    default = torch.compile(lambda x: _allowed_exp(x) * 1, backend=_backend())(x)
    torch._dynamo.reset()
    be = nanpass.backend(inner="aot_eager", constants=constants)
    out = torch.compile(lambda x: _allowed_exp(x) * 1, backend=be)(x)

    class Exp(torch.nn.Module):
        def forward(self, x):
            return torch.exp(x)

    assert torch.equal(out, nanpass.harden(Exp(), constants=constants)(x))
    assert not torch.equal(out, default)
