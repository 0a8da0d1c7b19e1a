"""nanpass.harden on real code: textbook recipes, module behaviour, configuration, stable forms."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanpass
import nanpass._stable
from tests.helpers import all_finite, bits, forward_backward

inf = math.inf


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, a, b=None):
        return self.fn(a) if b is None else self.fn(a, b)


def masked_div(x, d):
    return torch.where(d != 0, x / d, torch.zeros_like(x)).sum()


def clamped_bce(p, t):
    p = torch.clamp(p, 1e-8, 1 - 1e-8)
    return -(t * torch.log(p) + (1 - t) * torch.log(1 - p)).mean()


def relu_normalise(x):
    r = torch.relu(x)
    return r / r.sum(1, keepdim=True)


def masked_softmax(x, mask):
    return torch.softmax(x.masked_fill(mask, -inf), dim=-1)


RECIPES = {
    "where-div": (masked_div, lambda: (torch.tensor([1.0, 2.0], requires_grad=True),
                                       torch.tensor([0.0, 2.0], requires_grad=True))),
    "clamped-bce": (clamped_bce, lambda: (torch.tensor([1.0, 0.5, 0.0], requires_grad=True),
                                          torch.tensor([0.0, 1.0, 1.0]))),
    "relu-normalise": (relu_normalise, lambda: (torch.tensor([[-1.0, -2.0], [1.0, 3.0]], requires_grad=True),)),
    "masked-softmax": (masked_softmax, lambda: (torch.randn(2, 3, requires_grad=True),
                                                torch.tensor([[True] * 3, [False, True, False]]))),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_textbook_recipes(name):
    fn, make = RECIPES[name]
    outs, grads = forward_backward(Fn(fn), make())
    assert not all_finite(outs + grads), "the recipe should fail unguarded"
    safe = nanpass.harden(Fn(fn))
    outs, grads = forward_backward(safe, make())
    assert all_finite(outs) and all_finite(grads)
    assert safe.capture == "intercept"


def test_textbook_bce_in_float16_and_float32():
    """clamp(p, 1e-8, 1 - 1e-8): 1e-8 is 0 in float16; 1 - 1e-8 is 1.0 in float32."""
    for dtype in (torch.float16, torch.float32):
        p = torch.tensor([1.0, 0.0, 0.3], dtype=dtype, requires_grad=True)
        t = torch.tensor([0.0, 1.0, 1.0], dtype=dtype)
        assert not torch.isfinite(clamped_bce(p, t))
        outs, grads = forward_backward(nanpass.harden(Fn(clamped_bce)), (p, t))
        assert all_finite(outs + grads)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x, mask=None, *, temperature: float = 1.0):
        h = self.drop(self.fc(x)) / temperature
        if mask is not None:
            h = h.masked_fill(mask, -inf)
        return {"probs": torch.softmax(h, -1), "logp": torch.log(torch.softmax(h, -1)) * self.scale}


def test_module_behaviour():
    torch.manual_seed(0)
    net = Net()
    before = copy.deepcopy(net.state_dict())
    safe = nanpass.harden(net)
    # same tensors, same keys; the original is untouched
    assert all(a is b for a, b in zip(safe.parameters(), net.parameters(), strict=True))
    assert list(safe.state_dict()) == list(net.state_dict())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
    assert type(net).forward is Net.forward and not isinstance(net, nanpass.Hardened)

    x = torch.randn(3, 4)
    net.eval()
    safe.eval()
    assert not safe.training and not net.drop.training
    out = safe(x)
    ref = net(x)
    assert set(out) == {"probs", "logp"}
    assert torch.equal(bits(out["probs"]), bits(ref["probs"]))
    # keyword arguments, and a new non-tensor value, re-key the graph
    out = safe(x, mask=torch.ones(3, 4, dtype=torch.bool), temperature=0.5)
    assert all_finite(list(out.values()))
    # train mode follows: dropout is live again
    safe.train()
    assert net.training and net.drop.training
    a, b = safe(x)["probs"], safe(x)["probs"]
    assert not torch.equal(a, b)

    # an optimizer built on the original trains the hardened model
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    w0 = net.fc.weight.detach().clone()
    safe(x)["logp"].sum().backward()
    opt.step()
    assert not torch.equal(net.fc.weight, w0)

    # buffers replaced by .to() are read live
    safe.to(torch.float64)
    assert safe(x.double())["probs"].dtype == torch.float64

    clone = copy.deepcopy(safe)
    assert isinstance(clone, nanpass.Hardened)
    assert clone.fc.weight is not net.fc.weight
    assert torch.equal(clone.fc.weight, net.fc.weight)
    assert repr(safe).startswith("nanpass.Hardened(Net(")
    assert {c.op for c in safe.changes if c.action == "guarded"} == {"softmax", "log", "div"}


def test_stable_forms():
    def f(x, t):
        p = torch.softmax(x, -1)
        a = torch.log(p)
        b = torch.log(torch.sigmoid(x))
        c = torch.log(1 - torch.sigmoid(x))
        d = torch.log(1 + x.abs())
        e = torch.exp(x) - 1
        g = torch.log(torch.sum(torch.exp(x), dim=-1))
        h = t * torch.log(x.abs())
        return a, b, c, d, e, g, h

    x = torch.tensor([[200.0, -200.0, 0.0], [-inf, 1.0, 2.0]])
    t = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    with pytest.raises(nanpass.ConfigError, match="^nanpass: harden\\(\\) runs your forward as written"):
        nanpass.harden(Fn(f), stable=True)
    be = nanpass.backend(inner="eager", stable=True)
    outs = torch.compile(Fn(f), backend=be)(x, t)
    patterns = {c.detail for c in be.changes if c.action == "stable"}
    assert patterns == {
        "log(softmax(x)) -> log_softmax(x)", "log(sigmoid(x)) -> logsigmoid(x)",
        "log(1 - sigmoid(x)) -> logsigmoid(-x)", "log(1 + x) -> log1p(x)",
        "exp(x) - 1 -> expm1(x)", "log(sum(exp(x))) -> logsumexp(x)", "t * log(p) -> xlogy(t, p)",
    }
    assert all_finite(list(outs))
    a, b, c, d, e, g, h = outs
    # exact values where the naive form loses them
    assert torch.allclose(a[0], F.log_softmax(x[0], -1).clamp_min(-torch.finfo().max))
    assert b[0, 1] == F.logsigmoid(torch.tensor(-200.0))
    assert c[0, 0] == F.logsigmoid(torch.tensor(-200.0))
    gelu_be = nanpass.backend(inner="eager", stable=True)
    gelu = torch.compile(Fn(lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))),
                         backend=gelu_be)
    big = torch.tensor([300.0, -300.0, 1.0], dtype=torch.float16, requires_grad=True)
    out = gelu(big)
    out.sum().backward()
    assert [c.detail for c in gelu_be.changes] == [nanpass._stable.DESCRIPTIONS[-1]]
    assert torch.isfinite(out).all() and torch.isfinite(big.grad).all()
    assert torch.equal(out, F.gelu(big, approximate="tanh"))
    xs = torch.tensor([1e-10])
    assert Fn(lambda x: torch.log(1 + x))(xs) == 0  # the naive form loses it
    stable = nanpass.backend(inner="eager", stable=True)
    assert torch.compile(Fn(lambda x: torch.log(1 + x)), backend=stable)(xs) == torch.log1p(xs)
    # by default nothing changes rounding: harden keeps log(1 + x) as written, bit for bit
    assert nanpass.harden(Fn(lambda x: torch.log(1 + x)))(xs) == 0
    assert g[0] == torch.logsumexp(x[0], -1)


def test_data_dependent_control_flow_runs_as_written():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            h = self.fc(x)
            if h.sum() > 0:
                return torch.log(h - h.max())
            return torch.sqrt(h - h.max())

    torch.manual_seed(0)
    m = Branchy()
    safe = nanpass.harden(m)
    for sign in (1.0, -1.0):
        with torch.no_grad():
            m.fc.bias.fill_(10 * sign)
        x = torch.randn(2, 4, requires_grad=True)
        outs, grads = forward_backward(safe, (x,))
        assert all_finite(outs + grads)
    assert safe.capture == "intercept"
    assert {c.op for c in safe.changes if c.action == "guarded"} == {"log", "sqrt"}


def test_transformer_encoder_layer_fully_padded():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    src = torch.randn(2, 3, 8, requires_grad=True)
    pad = torch.tensor([[True, True, True], [False, False, True]])
    safe = nanpass.harden(layer)
    outs, grads = forward_backward(safe, (src,), {"src_key_padding_mask": pad})
    assert all_finite(outs + grads)
    ref = layer(src, src_key_padding_mask=pad)
    assert torch.equal(bits(outs[0][1]), bits(ref[1]))
    assert any(c.op == "multi_head_attention" for c in safe.changes)


def test_training_loop_stays_finite():
    """20 steps with a log and a normalisation that hit 0: the original goes NaN."""
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            r = torch.relu(self.fc(x))
            p = r / r.sum(-1, keepdim=True)
            return -torch.log(p[:, 0]).mean()

    def train(model, params):
        opt = torch.optim.SGD(params, lr=0.05)
        torch.manual_seed(1)
        for _ in range(20):
            x = torch.randn(8, 4)
            x[0] = -10.0  # a row where every relu is 0
            opt.zero_grad()
            loss = model(x)
            loss.backward()
            opt.step()
        return loss

    torch.manual_seed(0)
    plain = Model()
    with torch.no_grad():
        plain.fc.bias.fill_(-1.0)
    hard_model = copy.deepcopy(plain)
    assert not torch.isfinite(train(plain, plain.parameters()))
    assert not all(torch.isfinite(p).all() for p in plain.parameters())
    safe = nanpass.harden(hard_model)
    loss = train(safe, hard_model.parameters())
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p).all() for p in hard_model.parameters())


def test_integer_division_keeps_its_semantics():
    def f(a, b):
        return a / b, torch.div(a, b, rounding_mode="floor"), a // b

    a, b = torch.tensor([7, -7]), torch.tensor([2, 2])
    safe = nanpass.harden(Fn(f))
    for got, want in zip(safe(a, b), f(a, b), strict=True):
        assert torch.equal(got, want) and got.dtype == want.dtype
    z = torch.tensor([0, 2])
    div = nanpass.harden(Fn(lambda a, b: a / b))
    assert torch.equal(div(a, z), a / z)  # int / 0 true division: inf, as torch
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):  # as torch: integer floor division by 0
        nanpass.harden(Fn(lambda a, b: torch.div(a, b, rounding_mode="floor")))(a, z)


def test_exclusions_and_mode_off():
    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(2, 2), nn.LogSoftmax(-1))
            self.b = nn.Sequential(nn.Linear(2, 2), nn.LogSoftmax(-1))

        def forward(self, x):
            return self.a(x) + torch.log(self.b(x).exp())

    m = Two()

    def changes_of(safe):
        safe(torch.randn(1, 2))
        return safe.changes

    assert nanpass.harden(m).changes == []  # sites are found on the first call
    changes = changes_of(nanpass.harden(m, exclude=["a"]))
    left = {c.module for c in changes if c.action == "left"}
    assert "a.1" in left
    assert any(c.module == "b.1" and c.action == "guarded" for c in changes)
    only_log = changes_of(nanpass.harden(m, ops=["log"]))
    assert {c.op for c in only_log if c.action == "guarded"} == {"log"}
    no_log = changes_of(nanpass.harden(m, exclude_ops=["log"]))
    assert "log" not in {c.op for c in no_log if c.action == "guarded"}
    off = nanpass.harden(m, mode="off")
    x = torch.full((1, 2), inf)
    assert not torch.isfinite(off(x)).all()
    assert off.changes == []


def test_constant_overrides_tighten_only():
    m = Fn(torch.log)
    safe = nanpass.harden(m, constants={"log": {"lo": 1e-3}})
    assert safe(torch.tensor([0.0])) == torch.log(torch.tensor(1e-3))
    # 1e-8 is 0 in float16: the dtype's own bound wins
    safe16 = nanpass.harden(m, constants={"log": {"lo": 1e-8}})
    assert torch.isfinite(safe16(torch.tensor([0.0], dtype=torch.float16)))


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"mode": "fast"}, "unknown mode 'fast'; valid modes: 'guard', 'off'"),
        ({"ops": ["lgo"]}, "unknown op 'lgo' in ops (did you mean 'log'?)"),
        ({"exclude_ops": ["softmaxx"]}, "unknown op 'softmaxx' in exclude_ops"),
        ({"exclude": ["encoder.layers.9"]}, "exclude names module 'encoder.layers.9'"),
        ({"constants": {"log": {"eps": 1.0}}}, "op 'log' has no constant 'eps'; its constants: 'lo', 'hi'"),
        ({"constants": {"log": {"lo": "tiny"}}}, "constants['log']['lo'] must be a finite number"),
        ({"constants": {"nope": {}}}, "unknown op 'nope' in constants"),
        # constants may only tighten a bound (docs/guards.md): loosening ones are errors
        ({"constants": {"log": {"lo": 0.0}}}, "constants['log']['lo'] = 0.0 would loosen the log guard; "
         "its float32 bound is 1.1754943508222875e-38 and a constant may only tighten it: lo >= "),
        ({"constants": {"log": {"lo": -1.0}}}, "constants['log']['lo'] = -1.0 would loosen the log guard"),
        ({"constants": {"log": {"hi": 1e39}}}, "constants['log']['hi'] = 1e+39 (float32 rounds it to inf) "
         "would loosen the log guard"),
        ({"constants": {"acos": {"hi": 1.5}}}, "constants['acos']['hi'] = 1.5 would loosen the acos guard"),
        ({"constants": {"log": {"lo": 2.0, "hi": 1.0}}}, "constants['log'] gives lo = 2.0 above hi = 1.0"),
    ],
)
def test_config_errors(kwargs, needle):
    with pytest.raises(nanpass.ConfigError) as e:
        nanpass.harden(nn.Linear(2, 2), **kwargs)
    assert str(e.value).startswith("nanpass: ")
    assert needle in str(e.value)


def test_harden_rejects_non_modules():
    with pytest.raises(TypeError) as e:
        nanpass.harden(3)
    assert isinstance(e.value, nanpass.NanpassError)
    assert str(e.value).startswith("nanpass: harden() takes a torch.nn.Module, got int 3")


def test_compiled_modules_and_compiling_hardened_ones():
    with pytest.raises(nanpass.NanpassTypeError, match="^nanpass: harden\\(\\) got a torch.compile'd module"):
        nanpass.harden(torch.compile(nn.Linear(2, 2)))
    # an fx-captured hardened model can itself be compiled: dynamo traces through the guards
    m = nn.Sequential(nn.Linear(4, 4), nn.LogSoftmax(-1))
    with torch.no_grad():  # -inf inputs times positive weights: rows of -inf, the guard's to
        m[0].weight.abs_().add_(0.1)  # move (a NaN from upstream would stay NaN, issue 44 item 2)
    x = torch.full((2, 4), -inf, requires_grad=True)
    torch._dynamo.utils.counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs, grads = forward_backward(torch.compile(nanpass.harden(m), backend="aot_eager"), (x,))
    assert all_finite(outs + grads)
    # the guards' constants are plain lookups: no lru_cache warning, no Tensor.item() break
    assert not [w for w in caught if "lru_cache" in str(w.message)]
    assert not [r for r in torch._dynamo.utils.counters["graph_break"] if "item()" in r]

    class Branchy(nn.Module):
        def forward(self, x):
            return torch.log(x) if x.sum() > 0 else torch.sqrt(x)

    # data-dependent control flow too: dynamo traces the guards where it can, graph breaks
    # where it cannot, and the guards still run
    branchy = torch.compile(nanpass.harden(Branchy()), backend="aot_eager")
    assert torch.isfinite(branchy(torch.zeros(2))).all()  # sqrt branch, unguarded: 0 is fine
    assert torch.isfinite(branchy(torch.tensor([1.0, 0.0]))).all()  # log(0) guarded


def test_a_model_dynamo_cannot_see_into_is_guarded_too():
    class Opaque(nn.Module):
        @torch.compiler.disable  # dynamo will not look inside; harden runs it as written
        def forward(self, x):
            if x.sum() > 0:
                return torch.log(x)
            return x

    out = nanpass.harden(Opaque())(torch.tensor([1.0, 0.0]))
    assert torch.isfinite(out).all() and out[0] == 0


@pytest.mark.parametrize("dtype,guarded", [(torch.float16, True), (torch.bfloat16, False),
                                           (torch.float32, False), (torch.float64, False)])
def test_integer_powers_are_guarded_where_they_overflow(dtype, guarded):
    """x ** 3 overflows float16 past |x| = 40 (GPT-2's gelu_new); in float32 and bfloat16 (the
    same range) only past 7e12, the overflow of ordinary arithmetic: left as written there."""
    safe = nanpass.harden(Fn(lambda x: x ** 3))
    x = torch.tensor([100.0, -2.0, 1e3], dtype=torch.float64).to(dtype).requires_grad_()
    out = safe(x)
    assert [c.action for c in safe.changes] == ["guarded" if guarded else "left"]
    if guarded:
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    else:
        assert torch.equal(out, x ** 3)


@pytest.mark.parametrize("option", ["count", "quarantine"])
@pytest.mark.parametrize("value", ["false", "False", 0, 1, None])
def test_boolean_options_take_only_true_or_false(option, value):
    """harden(m, count="false") counted, as any non-empty string is true: a bool or an error."""
    with pytest.raises(nanpass.ConfigError) as e:
        nanpass.harden(Fn(torch.log), **{option: value})
    assert str(e.value) == f"nanpass: {option} must be True or False, got {value!r}"
    assert getattr(nanpass.harden(Fn(torch.log), **{option: False}).nanpass_config, option) is False


def test_stable_string_is_refused_by_harden():
    # any truthy stable= is refused before the options are read: harden has no stable forms
    with pytest.raises(nanpass.ConfigError, match="^nanpass: harden\\(\\) runs your forward as written"):
        nanpass.harden(Fn(torch.log), stable="false")
    with pytest.raises(nanpass.ConfigError, match="^nanpass: stable must be True or False, got 0$"):
        nanpass.harden(Fn(torch.log), stable=0)


@pytest.mark.parametrize("option", ["count", "stable", "shape_checks"])
def test_backend_boolean_options_take_only_true_or_false(option):
    with pytest.raises(nanpass.ConfigError) as e:
        nanpass.backend(inner="eager", **{option: "false"})
    assert str(e.value) == f"nanpass: {option} must be True or False, got 'false'"
    # the options dict of torch.compile(backend="nanpass") goes through the same check
    with pytest.raises(Exception) as e:
        torch.compile(Fn(torch.log), backend="nanpass", options={"inner": "eager", option: "false"})(torch.rand(3))
    err = e.value
    while err is not None and not isinstance(err, nanpass.NanpassError):
        err = getattr(err, "inner_exception", None) or err.__cause__
    assert isinstance(err, nanpass.ConfigError), repr(e.value)
    assert str(err) == f"nanpass: {option} must be True or False, got 'false'"


@pytest.mark.parametrize(
    "kwargs,prefix",
    [
        ({"ops": 3}, "nanpass: ops must be a list of op names, got 3"),
        ({"exclude_ops": 3}, "nanpass: exclude_ops must be a list of op names, got 3"),
        ({"exclude": 3}, "nanpass: exclude must be a list of module paths"),
        ({"exclude": [3]}, "nanpass: exclude must be a list of module paths"),
        ({"constants": [1]}, "nanpass: constants must be a dict of op name to a dict of constants"),
        ({"constants": {"log": 3}}, "nanpass: constants['log'] must be a dict of 'lo', 'hi', got 3"),
        ({"mode": 3}, "nanpass: unknown mode 3; valid modes: 'guard'"),
        ({"mode": ["guard"]}, "nanpass: unknown mode ['guard']; valid modes: 'guard'"),
        ({"dynamic_dims": "x", "shape_checks": True, "example_inputs": (torch.rand(2),)},
         "nanpass: dynamic_dims maps dim index to a name"),
    ],
)
def test_wrong_option_types_are_config_errors(kwargs, prefix):
    with pytest.raises(nanpass.NanpassError) as e:
        nanpass.harden(Fn(torch.log), **kwargs)
    assert isinstance(e.value, (nanpass.ConfigError, nanpass.NanpassTypeError)), repr(e.value)
    assert str(e.value).startswith(prefix), str(e.value)


@pytest.mark.parametrize(
    "kwargs,prefix",
    [
        ({"inner": 3}, "nanpass: unknown inner compiler 3; valid: 'inductor', 'aot_eager', 'eager'"),
        ({"inner": ["eager"]}, "nanpass: unknown inner compiler ['eager']"),
        ({"mode": 3}, "nanpass: unknown mode 3"),
        ({"ops": 3}, "nanpass: ops must be a list of op names"),
        ({"exclude": 3}, "nanpass: exclude must be a list of module paths"),
        ({"constants": [1]}, "nanpass: constants must be a dict"),
        ({"dynamic_dims": "x"}, "nanpass: dynamic_dims maps dim index to a name"),
    ],
)
def test_wrong_backend_option_types_are_config_errors(kwargs, prefix):
    with pytest.raises(nanpass.NanpassError) as e:
        nanpass.backend(**{"inner": "eager", **kwargs})
    assert isinstance(e.value, (nanpass.ConfigError, nanpass.NanpassTypeError)), repr(e.value)
    assert str(e.value).startswith(prefix), str(e.value)
