"""Shape checks: check_shapes on fake tensors, and asserts recorded from example inputs."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import nanpass


def line(fragment: str) -> int:
    """The line of this file that holds ``fragment``: messages cite user source lines."""
    for number, text in enumerate(pathlib.Path(__file__).read_text().splitlines(), 1):
        if fragment in text and "line(" not in text:
            return number
    raise AssertionError(fragment)


class TwoLinear(nn.Module):
    def __init__(self, hidden_in: int = 30):
        super().__init__()
        self.fc1 = nn.Linear(10, 20)
        self.fc2 = nn.Linear(hidden_in, 10)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h)


class ConvNet(nn.Module):
    def __init__(self, flat: int = 500):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc = nn.Linear(4 * 26 * 26, 10)
        self.flat = flat

    def forward(self, x):
        h = torch.relu(self.conv(x))
        h = h.reshape(h.shape[0], self.flat)
        return self.fc(h)


class Heads(nn.Module):
    """Hand-written attention that splits 32 features into a wrong number of heads."""

    def __init__(self, d: int = 32, heads: int = 5):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.view(b, t, self.heads, d // self.heads)
        return q


def test_check_shapes_names_the_layer_without_running_a_matmul(monkeypatch):
    calls = []
    real_linear = torch._C._nn.linear

    def counting_linear(x, *a, **k):
        if not isinstance(x, torch._subclasses.FakeTensor):
            calls.append(x.shape)
        return real_linear(x, *a, **k)

    monkeypatch.setattr(torch._C._nn, "linear", counting_linear)
    with pytest.raises(nanpass.ShapeError) as e:
        nanpass.check_shapes(TwoLinear(), torch.randn(1, 10))
    msg = str(e.value)
    assert msg.startswith(f"nanpass: shape mismatch entering fc2 (Linear, test_shapes.py:{line('return self.fc2(h)')}): "
                          f"expected (*, 30), got (1, 20) \u2014 produced by fc1 (test_shapes.py:{line('h = self.fc1(x)')})")
    assert calls == []  # only fake tensors went through F.linear


def test_check_shapes_on_a_model_too_big_to_run():
    with torch.device("meta"):  # 2 x 10^9 parameters: nothing can run, only shapes
        big = nn.Sequential(nn.Linear(40000, 50000), nn.Linear(40000, 10))
        x = torch.empty(4, 40000)
    with pytest.raises(nanpass.ShapeError, match=r"entering 1 \(Linear.*expected \(\*, 40000\), got \(4, 50000\)"):
        nanpass.check_shapes(big, x)


def test_check_shapes_table():
    table = nanpass.check_shapes(TwoLinear(20), torch.randn(3, 10))
    rows = [(r.module, r.kind, r.inputs, r.outputs) for r in table.rows]
    assert rows == [("", "TwoLinear", ["(3, 10)"], ["(3, 10)"]), ("fc1", "Linear", ["(3, 10)"], ["(3, 20)"]),
                    ("fc2", "Linear", ["(3, 20)"], ["(3, 10)"])]
    assert "fc2" in str(table).splitlines()[3]


def test_wrong_flatten_size():
    with pytest.raises(nanpass.ShapeError) as e:
        nanpass.check_shapes(ConvNet(), torch.randn(2, 1, 28, 28))
    assert f"test_shapes.py:{line('h = h.reshape(h.shape[0], self.flat)')} (reshape)" in str(e.value)
    assert "its input (2, 4, 26, 26) produced by relu" in str(e.value)


def test_wrong_head_count_in_a_model_fx_cannot_trace():
    where = line("q = q.view(b, t, self.heads, d // self.heads)")
    with pytest.raises(nanpass.ShapeError, match=rf"in <root> \(Heads.*test_shapes.py:{where} \(view\).*produced by chunk"):
        nanpass.check_shapes(Heads(), torch.randn(2, 5, 32))


class Broadcast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, target):
        return (self.fc(x) - target) ** 2


def test_asserts_catch_a_silent_broadcast():
    x, t = torch.randn(8, 4), torch.randn(8, 1)
    safe = nanpass.harden(Broadcast(), example_inputs=(x, t), shape_checks=True)
    assert safe(x, t).shape == (8, 1)
    assert (Broadcast()(x, t.squeeze(1))).shape == (8, 8)  # torch says nothing
    with pytest.raises(nanpass.ShapeError, match=r"^nanpass: shape mismatch entering sub \(test_shapes.py:\d+\): "
                                                 r"expected \(\*, 1\), got \(8\) \u2014 produced by input target"):
        safe(x, t.squeeze(1))


def test_batch_and_sequence_may_change_features_may_not():
    class Seq(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 16)

        def forward(self, x):
            return torch.softmax(self.proj(x), -1)

    safe = nanpass.harden(Seq(), example_inputs=(torch.randn(2, 5, 16),), shape_checks=True,
                          dynamic_dims={0: "batch", 1: "seq"})
    assert safe(torch.randn(3, 9, 16)).shape == (3, 9, 16)
    with pytest.raises(nanpass.ShapeError, match=r"entering proj \(Linear.*expected \(\*, \*, 16\), got \(3, 9, 15\)"):
        safe(torch.randn(3, 9, 15))
    # two examples of different lengths say the same without a declaration
    two = nanpass.harden(Seq(), example_inputs=[(torch.randn(2, 5, 16),), (torch.randn(2, 7, 16),)],
                         shape_checks=True)
    assert two(torch.randn(4, 11, 16)).shape == (4, 11, 16)
    report = nanpass.report(two)
    assert report.graphs[0].asserts and "shape asserts" in report.to_text(color=False)


def test_shape_check_options():
    with pytest.raises(nanpass.ConfigError, match="^nanpass: shape_checks=True needs example_inputs"):
        nanpass.harden(TwoLinear(), shape_checks=True)
    with pytest.raises(nanpass.ConfigError, match="^nanpass: example_inputs and dynamic_dims are for shape_checks"):
        nanpass.harden(TwoLinear(), example_inputs=(torch.randn(1, 10),))
    with pytest.raises(nanpass.ConfigError, match="^nanpass: dynamic_dims maps dim index to a name"):
        nanpass.harden(TwoLinear(20), example_inputs=(torch.randn(1, 10),), shape_checks=True, dynamic_dims=["b"])


@given(widths=st.lists(st.integers(2, 9), min_size=3, max_size=6), data=st.data())
def test_random_stacks_name_the_wrong_layer(widths, data):
    bad = data.draw(st.integers(1, len(widths) - 2))
    layers = []
    for i in range(len(widths) - 1):
        fan_in = widths[i] + (1 if i == bad else 0)
        layers.append(nn.Linear(fan_in, widths[i + 1]))
    model = nn.Sequential(*layers)
    with pytest.raises(nanpass.ShapeError) as e:
        nanpass.check_shapes(model, torch.randn(2, widths[0]))
    assert str(e.value).startswith(f"nanpass: shape mismatch entering {bad} (Linear")
    assert f"expected (*, {widths[bad] + 1}), got (2, {widths[bad]})" in str(e.value)


class Branchy(nn.Module):
    """Data-dependent control flow: fx cannot trace it, so dynamo captures it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return torch.log(h)
        return torch.sqrt(h)


def test_data_dependent_model_checks_shapes_too():
    safe = nanpass.harden(Branchy(), example_inputs=(torch.randn(2, 5, 16),), shape_checks=True,
                          dynamic_dims={0: "batch", 1: "seq"})
    assert safe(torch.randn(3, 7, 16)).shape == (3, 7, 8)
    with pytest.raises(nanpass.ShapeError, match=r"^nanpass: shape mismatch entering fc \(Linear, test_shapes.py:\d+\): "
                                                 r"expected \(\*, \*, 16\), got \(3, 7, 15\)"):
        safe(torch.randn(3, 7, 15))
    assert any(g.asserts for g in nanpass.report(safe).graphs)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x, t):
        return (self.proj(x) - t) ** 2


def _first_nanpass_error(e: BaseException):
    while e is not None and not isinstance(e, nanpass.NanpassError):
        e = getattr(e, "inner_exception", None) or e.__cause__
    return e


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_backend_enforces_first_compile_shapes(inner):
    be = nanpass.backend(inner=inner, shape_checks=True, dynamic_dims={0: "batch", 1: "seq"})
    compiled = torch.compile(Residual(), backend=be)
    assert compiled(torch.randn(2, 5, 16), torch.randn(2, 5, 1)).shape == (2, 5, 16)
    # batch and sequence changes recompile with symbolic dims that come from declared dims: fine
    assert compiled(torch.randn(3, 9, 16), torch.randn(3, 9, 1)).shape == (3, 9, 16)
    # t's last dim 1 -> 16 broadcasts without complaint in torch; nanpass refuses the recompile
    with pytest.raises(Exception) as e:
        compiled(torch.randn(3, 9, 16), torch.randn(3, 9, 16))
    err = _first_nanpass_error(e.value)
    assert isinstance(err, nanpass.ShapeError), repr(e.value)
    assert str(err).startswith("nanpass: shape mismatch entering sub (test_shapes.py:")
    assert re.search(r"expected \(batch, seq, 1\), got \((s\d+, s\d+|3, 9), 16\) \u2014 produced by input t$",
                     str(err)), str(err)
    assert any(g.asserts for g in be.graphs)


@given(channels=st.lists(st.integers(1, 6), min_size=3, max_size=5), data=st.data())
def test_random_conv_stacks_name_the_wrong_layer(channels, data):
    bad = data.draw(st.integers(1, len(channels) - 2))
    layers = [nn.Conv2d(channels[i] + (2 if i == bad else 0), channels[i + 1], 3, padding=1)
              for i in range(len(channels) - 1)]
    with pytest.raises(nanpass.ShapeError) as e:
        nanpass.check_shapes(nn.Sequential(*layers), torch.randn(2, channels[0], 8, 8))
    assert str(e.value).startswith(f"nanpass: shape mismatch entering {bad} (Conv2d")
    assert f"expected (N, {channels[bad] + 2}, H, W)" in str(e.value)
    assert f"got (2, {channels[bad]}, 8, 8)" in str(e.value)


def test_check_shapes_on_a_layer_fx_cannot_trace():
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    table = nanpass.check_shapes(layer, torch.randn(2, 7, 32))
    assert table.rows[0].outputs == ["(2, 7, 32)"]
    with pytest.raises(nanpass.ShapeError, match=r"entering self_attn \(MultiheadAttention.*expected \(N, L, 32\), got \(2, 7, 24\)"):
        nanpass.check_shapes(layer, torch.randn(2, 7, 24))


def test_two_parameterless_models_keep_their_own_shapes():
    """Shape state is per compiled model, not a global table two models of one class share."""

    class Scale(nn.Module):
        def forward(self, x, t):
            return (x - t) * 2

    a = torch.compile(Scale(), backend="nanpass", options={"inner": "aot_eager", "shape_checks": True})
    b = torch.compile(Scale(), backend="nanpass", options={"inner": "aot_eager", "shape_checks": True})
    assert a(torch.randn(2, 4), torch.randn(2, 1)).shape == (2, 4)
    assert b(torch.randn(2, 4), torch.randn(2, 4)).shape == (2, 4)  # its own first shapes
    be_a = nanpass.backend(inner="aot_eager", shape_checks=True)
    be_b = nanpass.backend(inner="aot_eager", shape_checks=True)
    assert torch.compile(Scale(), backend=be_a)(torch.randn(2, 4), torch.randn(2, 1)).shape == (2, 4)
    assert torch.compile(Scale(), backend=be_b)(torch.randn(2, 4), torch.randn(2, 4)).shape == (2, 4)
