"""Check mode names the op where a NaN or Inf is born, forward and backward."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn as nn

import nanpass
from nanpass._rules import RULES
from tests.test_spellings import FAST_PATHS, Call, _inputs

# only non-finite for an infinite operand, which is passed through, not created
PROPAGATE_ONLY = {"logsigmoid"}


def _function_cases():
    for rule in RULES:
        if not rule.guarded or rule.name in FAST_PATHS or rule.name in PROPAGATE_ONLY:
            continue
        kind = "module" if rule.name == "multi_head_attention" else "function"
        sp = next(s for s in rule.spellings() if s.kind == kind)
        # an op dynamo graph-breaks on has no graph to check (test_spellings asserts that)
        for capture in ("harden", "backend") if rule.sample.captured(sp.name) else ("harden",):
            yield pytest.param(rule, sp, capture, id=f"{rule.name}-{capture}")


@pytest.mark.parametrize("rule,sp,capture", list(_function_cases()))
def test_check_mode_names_the_op(rule, sp, capture):
    args, kwargs = _inputs(rule, sp)
    keep = sp.kind != "module" or rule.name == "multi_head_attention"
    model = Call(rule, sp, kwargs if keep else {})
    # (issue 47) a NaN born only in a second derivative (a gradient penalty's backward through
    # the first backward's gradients) is seen by the screen but cannot be run again: every_op
    checked = (nanpass.harden(model, mode="check", every_op=rule.sample.second_order) if capture == "harden"
               else torch.compile(model, backend=nanpass.backend(inner="eager", mode="check")))
    with pytest.raises(nanpass.NonFiniteError) as e:
        inputs = copy.deepcopy(args)
        out = checked(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        loss = sum(o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad)
        leaves = [a for a in inputs if isinstance(a, torch.Tensor) and a.requires_grad]
        # ops that break only in their second derivative (sinc at 0): a gradient penalty
        grads = torch.autograd.grad(loss, leaves, create_graph=rule.sample.second_order, allow_unused=True)
        firsts = [g for g in grads if g is not None and g.requires_grad]
        if firsts:
            torch.autograd.grad(sum(g.sum() for g in firsts), leaves, allow_unused=True)
    msg = str(e.value)
    assert msg.startswith("nanpass: "), msg
    assert "test_spellings.py" in msg  # the line in Call.forward that calls the op
    spelled = {s.name for s in rule.spellings()}
    if capture == "backend" and sp.name in rule.sample.inlined:  # dynamo traced into its body:
        spelled = {s.name for r in RULES for s in r.spellings()}  # the op inside it is named
    assert any(name in msg for name in spelled), msg


def test_propagated_infinity_is_quiet_until_it_reaches_the_output():
    """-inf in, -inf out is not made by the op; an infinity that dies (a max over a row that
    keeps a finite entry) is no error, one that reaches the output is, naming the last op."""
    rule = next(r for r in RULES if r.name == "logsigmoid")
    (x,), _ = rule.sample.bad(torch.float32)
    sp = next(s for s in rule.spellings())

    class Dies(nn.Module):
        def forward(self, x):
            return sp.call(x).amax(-1)

    assert torch.isfinite(nanpass.harden(Dies(), mode="check")(x)).all()
    with pytest.raises(nanpass.NonFiniteError, match="^nanpass: an infinity reaches the output") as e:
        nanpass.harden(Call(rule, sp, {}), mode="check")(x)
    assert "test_spellings.py" in str(e.value)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x, pad):
        scores = x @ x.transpose(1, 2)
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        a = torch.softmax(scores, -1) @ x
        return a + self.mha(x, x, x, key_padding_mask=pad)[0]


def test_masked_attention_runs_in_check_mode():
    x = torch.randn(2, 3, 8, requires_grad=True)
    pad = torch.tensor([[False, False, True], [False, True, True]])  # partial masks only
    out = nanpass.harden(Attention(), mode="check")(x, pad)
    out.sum().backward()
    assert torch.isfinite(out).all()
    pad[1] = True  # now a fully masked row: softmax makes NaN from -inf, and check mode says so
    with pytest.raises(nanpass.NonFiniteError, match=r"NaN created by torch.softmax in <root>"):
        nanpass.harden(Attention(), mode="check")(x, pad)


def test_nan_in_the_data_is_the_datas():
    x = torch.tensor([[1.0, float("nan")]])
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: NaN in the input 'input'"):
        nanpass.harden(nn.Sequential(nn.Linear(2, 2), nn.LogSoftmax(-1)), mode="check")(x)


class Backward(nn.Module):
    def forward(self, a, b):
        dist = torch.sqrt(((a - b) ** 2).sum(-1))  # 0 for identical rows: infinite gradient
        cos = torch.nn.functional.cosine_similarity(a, a + 0.0)
        return dist.sum() + torch.acos(cos.clamp(-1, 1)).sum()


def test_backward_names_sqrt_at_zero_then_acos_at_one():
    a = torch.randn(3, 4, requires_grad=True)
    b = a.detach().clone()
    b[1] += 1.0
    model = nanpass.harden(Backward(), mode="check")
    loss = model(a, b)
    with pytest.raises(nanpass.NonFiniteError, match=r"non-finite gradient created by the backward of torch.(acos|sqrt)"):
        loss.backward()


def test_warn_mode_warns():
    with pytest.warns(nanpass.NonFiniteWarning, match="NaN created by torch.log"):
        out = nanpass.harden(nn.Sequential(nn.Identity()), mode="warn")  # nothing to check
        assert out(torch.ones(1)) == 1
        nanpass.harden(LogModel(), mode="warn")(torch.tensor([-1.0]))


class LogModel(nn.Module):
    def forward(self, x):
        return torch.log(x)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, mask):
        h = self.fc(x).masked_fill(mask, float("-inf"))
        return torch.log(torch.softmax(h, -1) + 1e-3).sum()


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_compiled_check_mode_flags_on_the_device(inner):
    """Under a real compiler: one fused check of the graph's outputs; when it fires, an eager
    re-run of the graph names the op with its operands. In a training loop the check is read
    with the backward's, as the backward ends (one read a step): the finding is raised there."""
    be = nanpass.backend(inner=inner, mode="check")
    compiled = torch.compile(Masked(), backend=be)
    x = torch.randn(2, 4, requires_grad=True)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, :2] = True  # a partial -inf mask: fine
    compiled(x, mask).backward()
    assert torch.isfinite(x.grad).all()
    mask[1] = True  # a row with no finite entry: softmax makes NaN
    with pytest.raises(nanpass.NonFiniteError, match=r"(?s)^nanpass: NaN created by torch.softmax in <root> at "
                                                     r".*test_check.py:\d+: .*operand 0: shape \(2, 4\)"):
        compiled(x, mask).backward()
    assert all(c.action == "checked" for c in be.changes)


def test_compiled_check_mode_checks_each_backward_once(monkeypatch):
    """The backward check is a hook on the parameters: one check per backward, however many
    steps ran before (a hook left on a parameter after it fired made every later step pay
    for all earlier ones)."""
    import nanpass._check as check

    calls = []
    real = check.foreach_norm
    monkeypatch.setattr(check, "foreach_norm", lambda *a: calls.append(1) or real(*a))
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    compiled = torch.compile(model, backend=nanpass.backend(inner="aot_eager", mode="check"))
    per_step = []
    for _ in range(6):
        before = len(calls)
        compiled(torch.randn(3, 4)).sum().backward()
        per_step.append(len(calls) - before)
    assert per_step == [1] * 6


class Layer(nn.Module):
    def __init__(self, bad: bool = False):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bad = bad

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        if self.bad:
            h = torch.log(h - 2.0)  # always negative: NaN
        return h / h.norm(dim=-1, keepdim=True)


class Deep(nn.Module):
    def __init__(self, n: int = 24, bad: int | None = 12):
        super().__init__()
        self.layers = nn.ModuleList([Layer(i == bad) for i in range(n)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_locate_finds_the_middle_layer(capsys):
    finding = nanpass.locate(Deep(), torch.randn(4, 8, requires_grad=True), loss_fn=lambda o: o.sum(),
                             progress=True)
    assert finding.forward.site.module == "layers.12" and finding.forward.site.op == "log"
    assert finding.forward.created and finding.forward.kind == "NaN"
    assert finding.backward is None  # the forward NaN explains the backward one
    chain = [e.site.module for e in finding.chain[1:]]  # then where the NaN flowed
    assert chain[0] == "layers.12" and chain.index("layers.13") < chain.index("layers.14")
    assert finding.suggestion.startswith("guard this log (torch.log at ")
    assert "batch index 0" in finding.suggestion
    data = json.loads(finding.to_json())
    assert data["schema"] == "nanpass.finding/1" and data["forward"]["module"] == "layers.12"
    assert "layers.12" in str(finding)
    assert "checked ops" in capsys.readouterr().err  # progress on a long model


def test_locate_backward_only_and_clean_runs():
    a = torch.randn(3, 4, requires_grad=True)
    b = a.detach().clone()
    finding = nanpass.locate(Backward(), a, b, loss_fn=lambda out: out, progress=False)
    assert finding.forward is None
    assert finding.backward.site.op in ("sqrt", "acos") and finding.backward.created
    clean = nanpass.locate(Deep(4, bad=None), torch.randn(2, 8), progress=False)
    assert clean.forward is None and clean.backward is None and "no NaN" in str(clean)


def test_locate_blames_the_data():
    x = torch.randn(5, 8)
    x[3, 2] = float("nan")
    finding = nanpass.locate(Deep(4, bad=None), x, progress=False)
    assert finding.forward.phase == "input" and finding.forward.index == 3
    assert finding.suggestion.startswith("the data already holds NaN at batch index 3")

class _HalfDouble(nn.Module):
    """A loss or metric: no parameters, a float16 product that overflows."""

    def forward(self, x):
        return (x * 2.0).sum(-1)


class _RootSum(nn.Module):
    def forward(self, a):
        return a.sqrt().sum()  # finite forward at 0, infinite gradient


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad-anywhere", "input-requires-grad"])
def test_locate_a_model_with_no_parameters(grad):
    """Issue 39 item 3: with a loss_fn and nothing that requires a gradient, the backward
    raised torch's 'element 0 of tensors does not require grad' instead of the finding."""
    x = torch.full((2, 4), torch.finfo(torch.float16).max, dtype=torch.float16, requires_grad=grad)
    for loss_fn in (None, lambda o: o.float().sum()):
        finding = nanpass.locate(_HalfDouble(), x, loss_fn=loss_fn, progress=False)
        assert finding.forward is not None and finding.forward.created
        assert finding.forward.kind == "Inf" and finding.forward.site.spelling == "Tensor.mul"
        assert finding.backward is None
        assert "overflow" in finding.suggestion
    # a parameter-free model whose input requires grad: the backward still runs, and is checked
    a = torch.zeros(2, 3, requires_grad=grad)
    finding = nanpass.locate(_RootSum(), a, loss_fn=lambda o: o, progress=False)
    assert finding.forward is None
    assert (finding.backward is not None and finding.backward.site.op == "sqrt") == grad


class Stat(nn.Module):
    def forward(self, x, d):
        return torch.log(x) + x / d + torch.softmax(x, -1)


def test_guard_statistics_count_changed_elements_on_the_device():
    safe = nanpass.harden(Stat(), count=True)
    safe(torch.tensor([0.0, 1.0, -2.0, 3.0]), torch.tensor([0.0, 1.0, 2.0, 0.0]))
    rows = {r.op: r for r in nanpass.stats(safe).rows}
    assert (rows["log"].last, rows["div"].last, rows["softmax"].last) == (2, 2, 0)
    safe(torch.tensor([1.0, 1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 2.0, 3.0]))
    rows = {r.op: r for r in nanpass.stats(safe).rows}
    assert (rows["log"].calls, rows["log"].last, rows["log"].total) == (2, 1, 3)
    assert (rows["div"].last, rows["div"].total) == (0, 2)
    # the counts are device tensors until read: no host sync per op
    assert all(isinstance(c.total, torch.Tensor) for g in safe.graphs for c in g.counters)
    assert str(nanpass.stats(safe)).splitlines()[1].startswith("log")  # most changed first


class Cube(nn.Module):
    """gelu_new's torch.pow(x, 3.0): guarded in float16 (past 40 it overflows), left as written
    in float32 (past 7e12 only)."""

    def forward(self, x):
        return torch.pow(x, 3.0)


@pytest.mark.parametrize("count", [False, True])
def test_the_report_says_what_each_site_really_did(count):
    """A site that is never guarded is reported left, not guarded, and has no statistics row;
    a site that takes both actions (its dtype changes between calls) is counted once for each."""
    safe = nanpass.harden(Cube(), count=count)
    safe(torch.randn(4))
    report = nanpass.report(safe)
    assert [(c.op, c.action) for c in report.changes] == [("pow", "left")]
    assert report.summary().endswith("0 guarded, 0 stable forms, 1 left alone")
    if count:
        assert nanpass.stats(safe).rows == []
    safe(torch.randn(4, dtype=torch.float16))
    report = nanpass.report(safe)
    assert sorted((c.op, c.action, c.dtype) for c in report.changes) == [
        ("pow", "guarded", "float16"), ("pow", "left", "float32")]
    assert report.summary().endswith("1 guarded, 0 stable forms, 1 left alone")
    if count:
        assert [(r.op, r.calls) for r in nanpass.stats(safe).rows] == [("pow", 1)]


@pytest.mark.slow  # (3 s)
def test_hf_gpt2_gelu_cube_is_reported_left_in_float32():
    """The issue's case: Hugging Face GPT-2's gelu_new in float32, counted."""
    pytest.importorskip("transformers")
    from tests.hf_models import build

    model, batch = build("gpt2")
    safe = nanpass.harden(model, count=True)
    safe(**batch).loss.backward()
    pows = {(c.module, c.action) for c in safe.changes if c.op == "pow"}
    assert pows == {("transformer.h.0.mlp.act", "left"), ("transformer.h.1.mlp.act", "left")}
    assert all(r.op != "pow" and r.calls >= 1 for r in nanpass.stats(safe).rows)


def test_stats_needs_count():
    with pytest.raises(nanpass.NanpassError, match=r"^nanpass: stats\(\) needs a model hardened with count=True"):
        nanpass.stats(nanpass.harden(Stat()))
    with pytest.raises(nanpass.ConfigError, match="^nanpass: count=True keeps counters"):
        nanpass.backend(count=True)


def test_guard_plus_check_guards_and_says_which_fired():
    import warnings

    safe = nanpass.harden(Stat(), mode="guard+check")
    with pytest.warns(nanpass.GuardWarning, match=r"^nanpass: 2 guards fired: torch.log in <root> at .*: 1 elements; "
                                                  r"operator.truediv in <root> at .*: 1 elements$"):
        out = safe(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]))
    assert torch.isfinite(out).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        safe(torch.tensor([2.0, 1.0]), torch.tensor([1.0, 1.0]))  # nothing fired: silent
    with pytest.raises(nanpass.ConfigError, match="^nanpass: mode='guard\\+check' keeps counters"):
        nanpass.backend(mode="guard+check")


class Dist(nn.Module):
    def forward(self, a, b):
        return torch.sqrt(((a - b) ** 2).sum(-1)).sum()


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_compiled_backward_check_names_the_op(inner):
    """One fused check of the input gradients per backward; only on a hit, an eager replay
    with the same upstream gradients names the op."""
    compiled = torch.compile(Dist(), backend=nanpass.backend(inner=inner, mode="check"))
    a = torch.randn(3, 4, requires_grad=True)
    clean = compiled(a, torch.randn(3, 4))
    clean.backward()
    assert torch.isfinite(a.grad).all()
    b = a.detach().clone()
    b[1] += 1.0  # rows 0 and 2 identical: sqrt at 0, infinite gradient
    out = compiled(a, b)
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: non-finite gradient created by the backward of "
                                                     r"torch.sqrt in <root> at .*test_check.py:\d+"):
        out.backward()


class MaskedSqrt(nn.Module):
    """sqrt at 0 behind a relu: the forward is finite, sqrt's backward makes 0/0, and relu's
    backward masks it before the weights: the parameters' gradients are finite by luck."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        return torch.where(h > 0, torch.sqrt(h), 0.0).sum()


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_compiled_check_sees_a_backward_nan_that_a_later_op_masks(inner):
    """Issue 20, item 4: the input needs no gradient and the NaN never reaches a parameter's
    gradient, yet eager check mode names sqrt's backward; the compiled check mode must too
    (each checked op's operand is tapped: one fused reduction per tap in the backward)."""
    torch.manual_seed(0)
    model = MaskedSqrt()
    x = torch.randn(3, 4)
    model(x).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())  # plain: finite
    assert (torch.relu(model.fc(x)) == 0).any()
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: non-finite gradient created by the backward of torch.sqrt"):
        # (issue 47: a gradient masked before any parameter reaches none: the screen does
        # not see it, the check at every op does)
        nanpass.harden(model, mode="check", every_op=True)(x).backward()
    compiled = torch.compile(model, backend=nanpass.backend(inner=inner, mode="check"))
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: non-finite gradient created by the backward of "
                                                     r"torch.sqrt in <root> at .*test_check.py:\d+"):
        compiled(x).backward()


@pytest.mark.parametrize("inner", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_compiled_check_taps_change_no_bit(inner):
    """The taps are x - 0 in forward and pass the gradient through: outputs and gradients
    equal the plain compiled model's bit for bit, -0.0 included."""
    torch.manual_seed(0)
    model = Dist()
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, 4)
    plain = torch.compile(model, backend=inner)(a, b)
    plain.backward()
    ref = a.grad.clone()
    a.grad = None
    torch._dynamo.reset()
    out = torch.compile(model, backend=nanpass.backend(inner=inner, mode="check"))(a, b)
    out.backward()
    assert torch.equal(out, plain) and torch.equal(a.grad, ref)
    neg = torch.tensor([-0.0, 1.0], requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(lambda t: torch.atan2(t, -torch.ones(2)), backend=nanpass.backend(inner=inner, mode="check"))(neg)
    assert y[0] == -math.pi  # atan2(-0.0, -1); x + 0 would have made it +pi


@pytest.mark.parametrize("where", ["parameter", "buffer"])
def test_a_nan_already_in_the_state_is_named_as_such(where):
    """A NaN in a weight (an earlier bad step, a bad checkpoint) is the state's, not the first
    softmax's that reads it: check mode and locate name the parameter or buffer."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4))

        def forward(self, x):
            return torch.softmax(self.fc(x) * self.scale, -1)

    model = Net()
    with torch.no_grad():
        (model.fc.weight if where == "parameter" else model.scale)[1] = float("nan")
    name = "fc.weight" if where == "parameter" else "scale"
    with pytest.raises(nanpass.NonFiniteError, match=rf"^nanpass: NaN in the {where} '{name}'"):
        nanpass.harden(model, mode="check")(torch.randn(2, 4))
    finding = nanpass.locate(model, torch.randn(2, 4))
    assert finding.forward.phase == "state" and name in finding.forward.message
    assert finding.suggestion.startswith("a parameter or buffer is already non-finite")


class Tempered(nn.Module):
    """A learned temperature that has reached 0: the division guard keeps every number finite,
    the output is a constant uniform distribution, and learning has silently stopped."""

    def __init__(self, temp: float):
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(temp))
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return torch.softmax(self.fc(x) / self.temp, -1)


def _calls(model, n):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(n):
            model(torch.randn(2, 4)).sum().backward()
    return [str(w.message) for w in seen if issubclass(w.category, nanpass.GuardWarning)]


def test_a_guard_that_keeps_firing_is_named_once():
    said = _calls(nanpass.harden(Tempered(0.0), watch=5), 40)
    assert len(said) == 1  # rate-limited: once per site
    assert said[0].startswith("nanpass: the div guard (operator.truediv in <root> at ")
    assert "test_check.py" in said[0] and "watch=None" in said[0]
    assert _calls(nanpass.harden(Tempered(0.0), watch=None), 40) == []  # silenced
    assert _calls(nanpass.harden(Tempered(1.0), watch=5), 40) == []  # a healthy model: nothing
    with pytest.raises(nanpass.ConfigError, match="^nanpass: watch is how many calls apart"):
        nanpass.harden(Tempered(1.0), watch=0)


class _HalfMasked(torch.nn.Module):
    """A float16 model whose causal mask buffer holds -10000 (diffusers' PriorTransformer): its
    L2 norm is past 65504, every value finite."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)  # 120 entries of -10000: an L2 norm of 109545
        self.register_buffer("mask", torch.triu(torch.full((16, 16), -10000.0), 1))

    def forward(self, x):
        return torch.softmax(self.fc(x) + self.mask, -1)


@pytest.mark.parametrize("stop_at_op", [False, True])
def test_a_finite_half_state_with_a_large_norm_is_not_reported(stop_at_op):
    """Issue 39, item 4: the fused state check took an L2 norm in float16, which overflowed on a
    finite buffer, and then crashed looking for the culprit. The largest magnitude is exact."""
    torch.manual_seed(0)
    m = _HalfMasked().half()
    safe = nanpass.harden(m, mode="check", stop_at_op=stop_at_op)
    out = safe(torch.randn(2, 16, 16, dtype=torch.float16))
    out.float().sum().backward()
    assert torch.isfinite(out).all()
