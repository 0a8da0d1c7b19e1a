"""Composability: a hardened model is a model to every PyTorch tool (issue 18).

In-place writes on a guard's result, ``torch.compile(nanpass.harden(model))`` with no graph
break the plain model lacks, ``torch.func`` transforms, and frameworks that take the hardened
model as the model. Each case compares against the plain model, which must work first.
"""

from __future__ import annotations

import operator
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import nanpass
from nanpass._rules import RULES
from tests.helpers import bits

# -- in-place writes on a guard's result -----------------------------------------------------

# what users write after an op: residual +=, masking after a division, renormalising a router
INPLACE = {
    "+=": lambda y: y.__iadd__(1.0),
    "-=": lambda y: y.__isub__(0.5),
    "*=": lambda y: y.__imul__(2.0),
    "/=": lambda y: y.__itruediv__(4.0),
    "y[mask] = 0": lambda y: y.__setitem__(y.detach().abs() > 1, 0.0),
    "masked_fill_": lambda y: y.masked_fill_(y.detach() < -1, 0.0),
    "clamp_": lambda y: y.clamp_(-10.0, 10.0),
    "copy_": lambda y: y.copy_(y.detach() * 0.5 + y),
    "zero_ on a slice": lambda y: y.reshape(-1)[:1].zero_(),
}


def _function_spelling(rule):
    return next((s for s in rule.spellings() if s.kind == "function"), None)


def _op(rule):
    """The op as a user calls it: the function spelling, or a module built from the sample."""
    if rule.name == "multi_head_attention":
        sp = next(s for s in rule.spellings() if s.kind == "module")
        torch.manual_seed(0)
        return sp.target(*rule.sample.ctor[sp.name])
    return _function_spelling(rule).call


# every guarded rule with a function spelling and a float32 sample
INPLACE_RULES = [r for r in RULES if r.guarded and r.sample is not None and _function_spelling(r)
                 and torch.float32 in r.sample.dtypes and r.name not in ("mha_fast_path",
                                                                         "encoder_layer_fast_path")]


class _OpThenWrite(torch.nn.Module):
    """Calls one op as the user spells it, writes into its result in place, returns a loss."""

    def __init__(self, call, write):
        super().__init__()
        self.op, self.write = call, write

    def forward(self, *args, **kwargs):
        out = self.op(*args, **kwargs)
        y = next(o for o in (out if isinstance(out, tuple) else (out,))
                 if isinstance(o, torch.Tensor) and o.is_floating_point())
        self.write(y)
        return y.float().sum()


def _train(model, rule, dtype=torch.float32):
    """(loss, grads) of one step on the rule's good operands; None where the model raises."""
    args, kwargs = rule.sample.good(dtype)
    leaves = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.requires_grad]
    torch.manual_seed(0)
    try:
        loss = model(*args, **kwargs)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    except RuntimeError:
        return None
    return loss, [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, leaves, strict=True)]


def _same(got, want, exact=True):
    assert got is not None, "the plain model trains; the hardened one raised"
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        if exact:
            assert torch.equal(bits(a.detach()), bits(b.detach())), f"{a} != {b}"
        else:
            torch.testing.assert_close(a, b)


@settings(deadline=None)
@given(rule=st.sampled_from(INPLACE_RULES), write=st.sampled_from(sorted(INPLACE)))
def test_inplace_writes_on_a_guards_result_train_as_in_the_plain_model(rule, write):
    """Hypothesis draws the rule and the in-place write: wherever the plain model trains (an op
    whose backward saves its result refuses an in-place write there too), the hardened model
    trains with the same loss and gradients, bit for bit."""
    model = _OpThenWrite(_op(rule), INPLACE[write])
    want = _train(model, rule)
    if want is None:
        return
    _same(_train(nanpass.harden(model), rule), want)


@pytest.mark.parametrize("write", ["+=", "y[mask] = 0"])
@pytest.mark.parametrize("rule", INPLACE_RULES, ids=[r.name for r in INPLACE_RULES])
def test_every_rule_takes_an_inplace_write(rule, write):
    model = _OpThenWrite(_op(rule), INPLACE[write])
    want = _train(model, rule)
    if want is None:
        pytest.skip(f"the plain model refuses {write} after {rule.name}")
    _same(_train(nanpass.harden(model), rule), want)


@pytest.mark.parametrize("write", sorted(INPLACE))
@pytest.mark.parametrize("name", ["div", *(pytest.param(n, marks=pytest.mark.slow)  # a compile each
                                          for n in ("log", "cross_entropy", "xlogy"))])
def test_inplace_writes_under_the_backend(name, write):
    rule = next(r for r in RULES if r.name == name)
    model = _OpThenWrite(_op(rule), INPLACE[write])
    want = _train(model, rule)
    if want is None:
        pytest.skip(f"the plain model refuses {write} after {name}")
    compiled = torch.compile(model, backend=nanpass.backend(inner="aot_eager"))
    _same(_train(compiled, rule), want, exact=False)


def _mape(a, b):
    """darts' MAPE with its own NaN handling: the division, then NaN set to 0 in place."""
    result = (a - b).abs() / b.abs()
    result[result != result] = 0
    return result.mean()


def _angle(x, y):
    """e3nn-style: the cosine of two normalised vectors clamped in place before acos."""
    c = (torch.nn.functional.normalize(x, dim=-1) * torch.nn.functional.normalize(y, dim=-1)).sum(-1)
    c.masked_fill_(c < -1, -1)
    return torch.acos(c.clamp(max=1)).sum()


@pytest.mark.parametrize("fn", [_mape, _angle], ids=["darts-mape", "e3nn-angle"])
@pytest.mark.parametrize("how", ["harden", "backend"])
def test_user_nan_handling_in_place_keeps_working(fn, how):
    class Loss(torch.nn.Module):
        def forward(self, a, b):
            return fn(a, b)

    def run(model):
        torch.manual_seed(0)
        a = torch.randn(4, 3, requires_grad=True)
        b = torch.randn(4, 3, requires_grad=True)
        loss = model(a, b)
        return loss, list(torch.autograd.grad(loss, (a, b)))

    want = run(Loss())
    model = nanpass.harden(Loss()) if how == "harden" else torch.compile(
        Loss(), backend=nanpass.backend(inner="aot_eager"))
    _same(run(model), want, exact=how == "harden")


class _Router(torch.nn.Module):
    """Mixtral's top-k router: softmax, top-k, renormalise in place."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(8, 4)

    def forward(self, x):
        weights = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(weights, 2, dim=-1)
        weights /= weights.sum(dim=-1, keepdim=True)
        return (weights * chosen.float()).sum()


@pytest.mark.parametrize("how", ["harden", "backend"])
def test_mixtral_router_renormalised_in_place(how):
    def run(model, params):
        torch.manual_seed(1)
        x = torch.randn(6, 8)
        loss = model(x)
        return loss, list(torch.autograd.grad(loss, params))

    torch.manual_seed(0)
    plain = _Router()
    want = run(plain, list(plain.parameters()))
    model = nanpass.harden(plain) if how == "harden" else torch.compile(
        plain, backend=nanpass.backend(inner="aot_eager"))
    _same(run(model, list(plain.parameters())), want, exact=how == "harden")


# -- torch.compile(nanpass.harden(model)) ---------------------------------------------------

class _Unsafe(torch.nn.Module):
    """A guarded op whose result is written in place, and a NaN the plain model makes."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        y = torch.log(h.abs() * 0)  # -inf
        y += 1.0
        z = y / h.sum(-1, keepdim=True)  # +-inf
        z[z.abs() < 1e-3] = 0
        return torch.softmax(z, -1).sqrt().sum()  # the plain model's loss is NaN


def _step(model, params, x):
    loss = model(x)
    return loss, torch.autograd.grad(loss, params)


def test_compiled_hardened_model_is_one_graph_and_finite():
    """fullgraph=True, after eager calls (validate, then compile), two hardened models in one
    process: each compiled call is finite where the plain model is NaN, and matches eager."""
    torch.manual_seed(0)
    plain, other = _Unsafe(), _Unsafe()
    x = torch.randn(3, 4)
    assert not torch.isfinite(plain(x))
    safe, safe2 = nanpass.harden(plain), nanpass.harden(other)
    eager = _step(safe, list(plain.parameters()), x)  # eager first
    _step(safe2, list(other.parameters()), x)
    compiled = torch.compile(safe, backend="aot_eager", fullgraph=True)
    compiled2 = torch.compile(safe2, backend="aot_eager", fullgraph=True)
    for _ in range(2):
        got = _step(compiled, list(plain.parameters()), x)
        _step(compiled2, list(other.parameters()), x)
    assert all(torch.isfinite(t).all() for t in (got[0], *got[1]))
    for a, b in zip((got[0], *got[1]), (eager[0], *eager[1]), strict=True):
        torch.testing.assert_close(a, b)


class _PythonMethods(torch.nn.Module):
    """Tensor methods torch writes in Python (their bodies call ``super()``), then a guard."""

    def forward(self, x):
        y = x.unflatten(-1, (2, 2)).flatten(-2) * len(x.dim_order())
        return torch.log(y.abs()).sum()


def test_python_tensor_methods_compile_fullgraph_under_harden():
    """dynamo traces ``x.unflatten`` in a plain model; handed to a mode as the function
    Tensor.unflatten, its ``super()`` call was a graph break (fullgraph=True raised)."""
    model = _PythonMethods()
    x = torch.randn(3, 4)
    x[0, 0] = 0.0
    torch._dynamo.reset()
    plain = torch.compile(model, backend="aot_eager", fullgraph=True)(x)
    assert not torch.isfinite(plain)
    out = torch.compile(nanpass.harden(model), backend="aot_eager", fullgraph=True)(x)
    assert torch.isfinite(out)


class _HalfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(8, 2, batch_first=True).half()

    def forward(self, x, pad=None):
        out, weights = self.mha(x, x, x, key_padding_mask=pad)
        return out.float().sum() + weights.float().sum()


@pytest.mark.parametrize("masked", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no-mask", "padded"])
def test_float16_attention_compiles_fullgraph_finite_and_bitwise(masked):
    """The attention guard runs torch's own F.multi_head_attention_forward with its calls
    guarded (float16 scores past 65504, pytorch#60939): one graph, finite on an outlier token,
    and the plain model's bits on ordinary ones."""
    torch.manual_seed(1)
    model = _HalfAttention()
    gen = torch.Generator().manual_seed(1)
    good = torch.randn(2, 5, 8, generator=gen).half()
    bad = good.clone()
    bad[0, 1] *= 1000
    pad = torch.tensor([[False] * 5, [False, False, True, True, True]]) if masked else None
    assert not torch.isfinite(model(bad, pad))
    torch._dynamo.reset()
    compiled = torch.compile(nanpass.harden(model), backend="aot_eager", fullgraph=True)
    params = list(model.parameters())
    loss = compiled(bad, pad)
    grads = torch.autograd.grad(loss, params)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
    want = torch.autograd.grad(model(good, pad), params)
    got = torch.autograd.grad(compiled(good, pad), params)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want, strict=True))


def _explain(model, batch):
    torch._dynamo.reset()
    out = torch._dynamo.explain(model)(**batch)
    return out.graph_count, out.graph_break_count


@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.slow) for n in ("gpt2", "llama", "bert", "t5", "mixtral", "vit")])
def test_compiling_a_hardened_hf_model_adds_no_graph_break(name):
    """torch._dynamo.explain counts are those of the plain model, and the compiled hardened
    training step matches the plain one."""
    pytest.importorskip("transformers")
    from tests.hf_models import build

    model, batch = build(name)
    assert _explain(nanpass.harden(model), batch) == _explain(model, batch)
    torch._dynamo.reset()
    model.eval()  # no dropout: eager and compiled draw different masks
    want = model(**batch).loss
    got = torch.compile(nanpass.harden(model), backend="aot_eager")(**batch).loss
    torch.testing.assert_close(got, want)
    got.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


class _BreaksOnce(torch.nn.Module):
    """Guarded calls on both sides of a graph break, as GPT-2's loss call makes one."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = torch.log(self.lin(x).abs()).softmax(-1)
        torch._dynamo.graph_break()
        return (h / h.norm(dim=-1, keepdim=True)).sqrt().sum()


def _frames(model, x) -> int:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch._dynamo.explain(model)(x)
    return torch._dynamo.utils.counters["frames"]["ok"]


@pytest.mark.slow  # (2.8 s: the fast tier's 3 minutes)
def test_a_graph_break_in_a_compiled_hardened_model_costs_one_frame_more():
    """Issue 28 item 7: a graph break in the model splits every frame between dynamo and it.
    Hardened, that was four of nanpass's frames (and two resumes), each a cache lookup on
    every call; now one."""
    model, x = _BreaksOnce(), torch.randn(3, 4)
    plain_frames = _frames(model, x)
    frames = _frames(nanpass.harden(model), x)
    assert frames <= plain_frames + 2, (frames, plain_frames)  # its frame and its resume
    torch._dynamo.reset()
    compiled = torch.compile(nanpass.harden(model), backend="aot_eager")
    assert torch.equal(compiled(x), model(x))


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_compiled_graphs_of_a_hardened_model_run_outside_the_mode(backend, monkeypatch):
    """Issue 28 item 7: where the model graph-breaks, dynamo runs the frames after the break
    with the mode entered, and each compiled graph's own runtime calls (AOTAutograd's
    ``_is_view`` per saved tensor, each aten op of an aot_eager graph) went through the
    mode's Python handler. The graphs hold the guards; they now run with the mode popped."""
    from nanpass._intercept import GuardMode

    torch._dynamo.reset()
    model, x = _BreaksOnce(), torch.randn(3, 4)
    compiled = torch.compile(nanpass.harden(model), backend=backend)
    compiled(x).backward()
    seen = []
    handler = GuardMode.__torch_function__

    def counting(self, func, types_, args=(), kwargs=None):
        if not torch.compiler.is_compiling():
            seen.append(getattr(func, "__name__", repr(func)))
        return handler(self, func, types_, args, kwargs)

    monkeypatch.setattr(GuardMode, "__torch_function__", counting)
    out = compiled(x)
    out.backward()
    assert seen == [], seen  # graph_break() itself makes no torch call
    assert torch.equal(out, nanpass.harden(model)(x))


def test_the_rule_lookup_costs_dynamo_a_guard_per_call_not_per_table_key():
    """Issue 28 item 7: dynamo guards a dict lookup keyed by a callable on the dict's key order,
    every key up to the one found (hundreds of guards a frame, checked on each call); the
    lookup is now a constant to dynamo, and what it guards is the entry each call reads."""

    class Three(torch.nn.Module):
        def forward(self, x):
            return torch.log(x.abs()).exp().sum()

    torch._dynamo.reset()
    out = torch._dynamo.explain(nanpass.harden(Three()))(torch.randn(3))
    table = {g.name for g in out.out_guards if "CALLS" in g.name or "_HITS" in g.name}
    assert table and not [n for n in table if "dict.keys(" in n]  # no guard on the key order
    entries = {re.search(r"_HITS\[(\d+)\]", n).group(1) for n in table if "_HITS[" in n}
    assert len(entries) <= 3, entries  # log, abs, exp: the entry each reads (sum has none)


class _ReadsAfterABreakInAGuard(torch.nn.Module):
    """corrcoef's guard reads a value (a graph break inside the mode's ``__torch_function__``);
    the calls after it, on the same tensor, make no graph: dynamo runs them eagerly."""

    def forward(self, x):
        a = x.acos()
        c = a.corrcoef()
        return c, a.is_complex(), a.dtype, a.shape, a


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_graph_break_inside_a_guard_keeps_every_call_after_it(backend):
    """Where a guard graph-breaks, dynamo runs the mode's ``__torch_function__`` eagerly, and
    then compiled it as a frame of its own that guards nothing on ``func``: every later call
    through that frame ran the first call's graph (``a.is_complex()`` returned a tensor,
    ``torch.full`` in nn.TransformerEncoder got a dtype for its device). The modes' handlers
    now run as written wherever they run eagerly."""
    torch._dynamo.reset()
    model, x = _ReadsAfterABreakInAGuard(), torch.tensor([[0.5, 0.25, 1.0], [0.5, 0.5, 0.5]])
    want = nanpass.harden(model)(x)
    for _ in range(2):  # the second call runs what the first compiled
        got = torch.compile(nanpass.harden(model), backend=backend)(x)
        assert got[1] is False and got[2] is torch.float32 and got[3] == x.shape
        assert torch.equal(got[0], want[0]) and torch.equal(got[4], want[4])


# -- eager calls under a frame dynamo rewrote (issue 39 item 2) ------------------------------

# aot_autograd's own warning, from the plain compiled model too (anomaly mode on an index_put)
_TORCH_OWN = pytest.mark.filterwarnings("ignore:Error detected in IndexPutBackward0")


class _HistogramLoss(torch.nn.Module):
    """The histogram loss of valerystrizh/pytorch-histogram-loss (its issue #12), trimmed and
    written anew: the similarities of the positive and of the negative pairs are binned by
    linear interpolation in a nested function whose boolean-mask writes divide by a float
    attribute, after data-dependent graph breaks (``.item()``, ``.nonzero()``); the loss is the
    chance that a negative pair is more similar than a positive one. Compiled hardened, a
    division in ``histogram`` raised ``TypeError: unsupported operand type(s) for /: 'Tensor'
    and 'float'`` (or 'int') on torch 2.11 and 2.13, where dynamo runs those calls eagerly."""

    def __init__(self, bins: int = 25):
        super().__init__()
        self.step = 2 / (bins - 1)
        self.eps = 1 / bins
        self.t = torch.arange(-1, 1 + self.step, self.step).view(-1, 1)

    def forward(self, feats, labels):
        def histogram(mask, count):
            s = sims.clone()
            lower = ((floor - (self.t - self.step)).abs() < self.eps) & mask
            assert lower.nonzero().size(0) == count, "another number of bins should be used"
            upper = torch.cat((lower, torch.zeros(1, lower.size(1), dtype=torch.bool)))[1:]
            s[~(lower | upper)] = 0
            s[lower] = (s - self.t + self.step)[lower] / self.step
            s[upper] = (-s + self.t + self.step)[upper] / self.step
            return s.sum(1) / count

        n, bins = labels.size(0), self.t.size(0)
        same = (labels.view(1, -1) == labels.view(-1, 1)).data
        dots = feats @ feats.t()
        assert ((dots > 1 + self.eps).sum().item() + (dots < -1 - self.eps).sum().item()) == 0, \
            "features must be L2-normalised"
        pairs = torch.ones(n, n).triu(1).bool()
        pos = same[pairs]
        sims = dots[pairs].view(1, -1).repeat(bins, 1)
        floor = (torch.floor(sims.data / self.step) * self.step).float()
        hist_pos = histogram(pos.repeat(bins, 1), pos.sum().item())
        hist_neg = histogram((~pos).repeat(bins, 1), (~pos).sum().item())
        cdf = hist_pos.view(-1, 1).repeat(1, bins)
        cdf[torch.ones(bins, bins).tril(-1).bool()] = 0
        return (hist_neg * cdf.sum(0)).sum()


@pytest.mark.slow  # (3.5 s)
@_TORCH_OWN
def test_compiled_hardened_histogram_loss_runs_as_eager_harden():
    """Issue 39 item 2: the plain loss compiles and eager harden runs; compiled hardened, it
    raised a TypeError at its divisions, on every input."""
    torch.manual_seed(0)
    feats = torch.nn.functional.normalize(torch.randn(8, 4), dim=1)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1])
    loss = _HistogramLoss()
    results = []
    for model in (loss, nanpass.harden(loss), torch.compile(loss, backend="aot_eager"),
                  torch.compile(nanpass.harden(loss), backend="aot_eager")):
        x = feats.clone().requires_grad_()
        out = model(x, labels)
        out.backward()
        results.append((out, x.grad))
    torch._dynamo.reset()
    want = results[0]
    for out, grad in results[1:]:
        assert torch.equal(out, want[0]) and torch.equal(grad, want[1])


# The cause: where dynamo graph-breaks it rewrites the frame, and a nested function or lambda
# alive across the break is rebuilt from its globals dict, held as a constant of the new code
# object: that code object is unhashable. A guarded call run eagerly below such a frame (at the
# break, in a frame dynamo does not compile, after a break inside a guard of check mode) walked
# the stack for its call site, hashing each frame's code object; the TypeError came out of a
# Tensor operator as NotImplemented ("unsupported operand type(s)"), and of a function as
# "unhashable type: 'dict'". Every spelling, in every context that runs it eagerly there:
SCALAR_SPELLINGS = {
    "x / 2.0": lambda x: x / 2.0,
    "2.0 / x": lambda x: 2.0 / x,
    "x /= 2.0": lambda x: x.clone().__itruediv__(2.0),
    "x.div(2.0)": lambda x: x.div(2.0),
    "torch.div(x, 2.0)": lambda x: torch.div(x, 2.0),
    "x ** 0.5": lambda x: x ** 0.5,
    "2.0 ** x": lambda x: 2.0 ** x,
    "x.log()": lambda x: x.log(),
    "torch.sqrt(x)": lambda x: torch.sqrt(x),
}


@torch.compiler.disable
def _eager_helper(fn, y):
    return fn(y)


class _NestedAfterBreak(torch.nn.Module):
    """The histogram loss's idiom: a mask write in a nested function after a ``.nonzero()``."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        def inner(y):
            m = y > 0
            assert m.nonzero().size(0) >= 0
            z = y.clone()
            z[m] = self.fn(y)[m]
            return z
        return inner(x) + inner(x * 2)


class _LambdaOverBreak(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        g = lambda y: self.fn(y) * 2  # noqa: E731 - the construct under test
        n = x.nonzero().shape[0]
        torch._dynamo.graph_break()
        return g(x) + n


class _DisabledHelper(torch.nn.Module):
    """The call in a function dynamo does not compile, under a frame holding a lambda."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        g = lambda y: y * 2  # noqa: E731 - the construct under test
        return g(_eager_helper(self.fn, x))


CONTEXTS = {"nested function after a break": _NestedAfterBreak, "lambda over a break": _LambdaOverBreak,
            "torch.compiler.disable": _DisabledHelper}
# guard mode on values the guards change; check mode on safe ones (it would raise there)
_SCALAR_INPUTS = {"guard": [[0.0, -1.0, 2.0, 4.0], [1e-30, 3.0, -0.5, 8.0]],
                  "check": [[0.5, 1.0, 2.0, 4.0], [1.5, 3.0, 0.25, 8.0]]}


def _fast(context, spelling, mode):
    # in the fast tier: every spelling where guard mode failed (a guard mode compile is cheap),
    # and each context in check mode on one spelling; the rest in the slow tier
    if mode == "guard":
        return context == "torch.compiler.disable"
    return spelling == "x.log()"


@_TORCH_OWN
@pytest.mark.parametrize(("context", "spelling", "mode"), [
    pytest.param(c, s, m, marks=() if _fast(c, s, m) else pytest.mark.slow)
    for c in CONTEXTS for s in SCALAR_SPELLINGS for m in ("guard", "check")])
def test_eager_calls_under_a_rewritten_frame_run_as_eager_harden(context, spelling, mode):
    model = CONTEXTS[context](SCALAR_SPELLINGS[spelling])
    results = []
    for m in (nanpass.harden(model, mode=mode), torch.compile(nanpass.harden(model, mode=mode), backend="aot_eager")):
        x = torch.tensor(_SCALAR_INPUTS[mode], requires_grad=True)
        out = m(x)
        out.sum().backward()
        results.append((out, x.grad))
    torch._dynamo.reset()
    (want, want_grad), (got, got_grad) = results
    assert torch.isfinite(got).all() and torch.isfinite(got_grad).all()
    assert torch.equal(got, want) and torch.equal(got_grad, want_grad)


@pytest.mark.parametrize("mode", ["guard", "check"])
def test_a_disabled_torch_callable_in_a_rewritten_frame_keys_its_site(mode):
    """A torch callable run eagerly from a rewritten frame: that frame is the call's own site,
    and the site's key held its unhashable code object."""
    calls = [torch.compiler.disable(f) for f in (torch.log, torch.Tensor.div, operator.truediv)]

    class Model(torch.nn.Module):
        def forward(self, x):
            g = lambda y: y * 2  # noqa: E731 - the construct under test
            return g(calls[0](x) + calls[1](x, 2.0) + calls[2](2.0, x))

    x = torch.tensor(_SCALAR_INPUTS[mode])
    want = nanpass.harden(Model(), mode=mode)(x)
    hardened = nanpass.harden(Model(), mode=mode)
    got = torch.compile(hardened, backend="aot_eager")(x)
    torch._dynamo.reset()
    assert torch.equal(got, want)
    if mode == "guard":  # the sites are recorded, each at its own line
        assert {c.op for c in hardened.changes} >= {"log", "div"}


# -- torch.func -------------------------------------------------------------------------------

class _PerSample(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        h = self.lin(x)
        return torch.log(h.abs()).sum() + torch.sqrt(h.pow(2).sum())


def _per_sample_grads(model, params, xs):
    from torch.func import functional_call, grad, vmap

    def loss(p, x):
        return functional_call(model, p, (x.unsqueeze(0),))

    return vmap(grad(loss), in_dims=(None, 0))(params, xs)


def test_vmap_grad_per_sample_gradients():
    """Per-sample gradients (DP-SGD, influence functions): equal to the plain model's on safe
    samples; a bad sample's gradient is finite and leaves the others' unchanged."""
    torch.manual_seed(0)
    plain = _PerSample()
    safe = nanpass.harden(plain)
    params = {k: v.detach() for k, v in plain.named_parameters()}
    xs = torch.randn(4, 3)
    want, got = _per_sample_grads(plain, params, xs), _per_sample_grads(safe, params, xs)
    assert all(torch.equal(bits(got[k]), bits(want[k])) for k in want)
    params["lin.bias"] = torch.zeros(3)
    xs[1] = 0  # h = 0: log(0), and sqrt at 0
    want, got = _per_sample_grads(plain, params, xs), _per_sample_grads(safe, params, xs)
    assert not all(torch.isfinite(want[k][1]).all() for k in want)
    for k in want:
        assert torch.isfinite(got[k]).all()
        assert torch.equal(bits(got[k][[0, 2, 3]]), bits(want[k][[0, 2, 3]]))


@pytest.mark.parametrize("transform", ["jacrev", "jacfwd", "hessian", "vmap"])
def test_func_transforms_of_the_forward(transform):
    import torch.func as func

    torch.manual_seed(0)
    plain = _PerSample()
    safe = nanpass.harden(plain)
    x = torch.randn(3)
    if transform == "vmap":
        xs = torch.randn(4, 1, 3)
        torch.testing.assert_close(func.vmap(safe)(xs), func.vmap(plain)(xs))
        return
    t = getattr(func, transform)
    torch.testing.assert_close(t(safe)(x), t(plain)(x))


# -- torch.export, AOTInductor, TorchScript --------------------------------------------------

class _Deploy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        y = torch.log(h.abs()) / h.sum(-1, keepdim=True)
        y /= h  # Python operators, in place and reflected: strict export hands the mode these
        return y + 1 / h


def _deploy_case():
    torch.manual_seed(0)
    plain = _Deploy()
    with torch.no_grad():
        plain.lin.bias.zero_()
    bad = torch.zeros(3, 7, 4)  # another batch and length than the example: h = 0
    assert not torch.isfinite(plain(bad)).all()
    return plain, torch.randn(2, 5, 4), bad


def _dims():
    batch = torch.export.Dim("batch", min=1, max=64)
    seq = torch.export.Dim("seq", min=1, max=64)
    return ({0: batch, 1: seq},)


@pytest.mark.parametrize("strict", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["non-strict", "strict"])
def test_export_with_dynamic_shapes_keeps_the_guards(strict):
    plain, x, bad = _deploy_case()
    ep = torch.export.export(nanpass.harden(plain), (x,), dynamic_shapes=_dims(), strict=strict)
    assert torch.isfinite(ep.module()(bad)).all()
    torch.testing.assert_close(ep.module()(x), plain(x))
    decomposed = ep.run_decompositions()
    assert torch.isfinite(decomposed.module()(bad)).all()


@pytest.mark.slow
def test_aot_inductor_package_of_a_hardened_model(tmp_path):
    """harden, export, ship: the .pt2 loads and runs finite where the plain export is not."""
    plain, x, bad = _deploy_case()
    ep = torch.export.export(nanpass.harden(plain), (x,), dynamic_shapes=_dims())
    path = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "model.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    assert torch.isfinite(loaded(bad)).all()
    torch.testing.assert_close(loaded(x), plain(x))


@pytest.mark.parametrize("how", ["trace", "script"])
def test_torchscript_says_to_use_export(how):
    plain, x, _ = _deploy_case()
    safe = nanpass.harden(plain)
    with pytest.raises(nanpass.NanpassError, match="^nanpass: .*torch.export"):
        torch.jit.trace(safe, (x,)) if how == "trace" else torch.jit.script(safe)


# -- frameworks take the hardened model as the model ----------------------------------------

class _Tokens(torch.utils.data.Dataset):
    """input_ids and labels, and a column the model does not take (the Trainer drops it by
    reading the forward's signature)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids, "source": "doc"}


@pytest.mark.slow
def test_hf_trainer_takes_the_hardened_model_with_default_arguments(tmp_path):
    """Default TrainingArguments: the column filter reads the signature, the loss is scaled in
    place, and save_model writes a checkpoint the plain class loads (tied weights included);
    a resumed run continues from it."""
    T = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tests.hf_models import build

    model, _ = build("gpt2")
    safe = nanpass.harden(model)
    assert isinstance(safe, T.PreTrainedModel) and isinstance(safe, nanpass.Hardened)
    args = T.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                               report_to=[], use_cpu=True, save_steps=1)
    trainer = T.Trainer(model=safe, args=args, train_dataset=_Tokens())
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded = T.GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    for (k, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    resumed = T.Trainer(model=nanpass.harden(build("gpt2")[0]), train_dataset=_Tokens(),
                        args=T.TrainingArguments(output_dir=str(tmp_path), max_steps=3,
                                                 per_device_train_batch_size=4, report_to=[], use_cpu=True))
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert resumed.state.global_step == 3


@pytest.mark.slow
def test_hf_trainer_torch_compile_adds_no_graph_break_of_nanpass(tmp_path):
    """``TrainingArguments(torch_compile=True)``: the compiled hardened model breaks its graph
    only for the plain model's reasons (transformers' own logging call in the loss) and
    compiles as many graphs. Dynamo counts a break once per Python frame it unwinds, and the
    wrapper adds frames, so the counts of one reason may differ; the set of reasons may not."""
    T = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from torch._dynamo.utils import counters

    from tests.hf_models import build

    def breaks(model):
        torch._dynamo.reset()
        counters.clear()
        args = T.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                   report_to=[], use_cpu=True, save_strategy="no", torch_compile=True,
                                   torch_compile_backend="aot_eager")
        trainer = T.Trainer(model=model, args=args, train_dataset=_Tokens())
        loss = trainer.train().training_loss
        assert torch.isfinite(torch.tensor(loss))
        return dict(counters["graph_break"]), counters["stats"]["unique_graphs"]

    plain_breaks, plain_graphs = breaks(build("gpt2")[0])
    safe_breaks, safe_graphs = breaks(nanpass.harden(build("gpt2")[0]))
    assert safe_graphs > 0 and safe_graphs == plain_graphs
    assert set(safe_breaks) == set(plain_breaks)


def _lightning_net(net):
    L = pytest.importorskip("lightning.pytorch")

    class Regression(L.LightningModule):
        """The user's LightningModule holds the hardened model as an ordinary submodule."""

        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return L, Regression()


class _LogNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x):
        return self.lin(torch.log(x))  # a feature column of zeros: -inf, and the loss is inf


@pytest.mark.filterwarnings("ignore:.*isinstance\\(treespec, LeafSpec\\)")  # lightning 2.6's own
def test_lightning_module_wrapping_a_hardened_model_trains_checkpoints_and_reloads(tmp_path):
    """Lightning's own fit, save_checkpoint and load_from_checkpoint, with ``harden(model)`` as
    a submodule: training stays finite where the plain model's loss is inf, and the checkpoint
    has the plain model's keys, so the plain module loads it strictly."""
    torch.manual_seed(0)
    x = torch.rand(16, 3) + 0.5
    x[4:8, 0] = 0.0
    y = torch.randn(16, 1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    plain = _LogNet()
    assert not torch.isfinite(((plain(x[4:8]) - y[4:8]) ** 2).mean())

    L, module = _lightning_net(nanpass.harden(_LogNet()))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, loader)
    assert trainer.global_step == 8
    assert all(torch.isfinite(p).all() for p in module.parameters())
    path = tmp_path / "final.ckpt"
    trainer.save_checkpoint(str(path))
    _, reference = _lightning_net(_LogNet())
    loaded = type(reference).load_from_checkpoint(str(path), strict=True)
    for (k, a), (k2, b) in zip(module.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k


class _NewForms(torch.nn.Module):
    """The guard forms of issue 19: softmax/logsumexp that keep -inf entries (an amax under
    no_grad inside the guard) and the double-where form at singular points (sqrt, acos,
    x ** 0.5)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        a = torch.softmax(h.masked_fill(h < -0.5, float("-inf")), -1)
        b = torch.logsumexp(h, -1, keepdim=True)
        c = torch.sqrt(h.relu()) + torch.acos(torch.tanh(h)) + h.abs() ** 0.5
        return (a * c + b).sum(-1)


def test_the_new_guard_forms_compose():
    """fullgraph after eager calls, vmap(grad) per-sample gradients and export with a dynamic
    batch, on a batch whose first row is fully masked and sits at sqrt's and pow's 0."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = _NewForms()
    safe = nanpass.harden(model)
    x = torch.randn(5, 4)
    with torch.no_grad():  # h = x.sum(-1) / 4 in every column
        model.lin.weight.fill_(0.25)
        model.lin.bias.zero_()
    x[0] = -10.0
    assert not torch.isfinite(model(x)).all()  # the plain model: NaN in the masked row
    good = torch.rand(5, 4)
    assert torch.equal(safe(good), model(good))
    eager = safe(x)
    compiled = torch.compile(safe, backend="aot_eager", fullgraph=True)
    out = compiled(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.allclose(out, eager)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(lambda p, xi: functional_call(safe, p, (xi[None],)).sum()), in_dims=(None, 0))(params, x)
    assert all(torch.isfinite(g).all() for g in per_sample.values())
    batch = torch.export.Dim("batch")
    exported = torch.export.export(safe, (x,), dynamic_shapes=({0: batch},)).module()
    assert torch.isfinite(exported(x)).all() and torch.isfinite(exported(x[:3])).all()
