"""Every spelling of every guarded op, under both capture paths, is rewritten and comes out
finite where the original does not. Generated from the rule table."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import nanpass
from nanpass import _fastpath
from nanpass._rules import RULES
from tests.helpers import all_finite, flat_tensors, forward_backward

FAST_PATHS = ("mha_fast_path", "encoder_layer_fast_path")


# the spellings' callables, read by name at call time as a user's code reads ``torch.log``:
# dynamo 2.11 cannot call a Tensor method (``torch.Tensor.bmm``) read from a module attribute
_CALLABLES: dict = {}


class Call(nn.Module):
    """A model that calls one op through exactly one spelling."""

    def __init__(self, rule, sp, kwargs, by_name: bool = False):
        super().__init__()
        self.kind, self.target, self.name, self.inplace = sp.kind, sp.target, sp.name, sp.inplace
        # by_name: the function code that names it finds (its stand-in); else torch's own,
        # held where no scan looks (the guard mode's path)
        _CALLABLES[sp.name] = _fastpath.stand_in(sp.call) if by_name else sp.call
        self.kw = kwargs
        if sp.kind == "module":
            self.mod = sp.target(*rule.sample.ctor[sp.name])

    def forward(self, *args):
        if self.kind == "module":
            return self.mod(*args, **self.kw)
        if self.inplace:
            args = (args[0] * 1, *args[1:])
        if self.kind == "method":
            out = getattr(args[0], self.target)(*args[1:], **self.kw)
        else:
            out = _CALLABLES[self.name](*args, **self.kw)
        out = args[0] if self.inplace else out
        if isinstance(out, tuple) and any(isinstance(o, torch.Tensor) and o.is_complex() for o in out):
            out = out[0]  # eigenvalues: eigenvectors are defined up to a phase (torch raises on a loss of them)
        # complex eigenvalues (linalg.eig) as real pairs, so that their finiteness is checked
        return torch.view_as_real(out) if isinstance(out, torch.Tensor) and out.is_complex() else out


def _cases():
    for rule in RULES:
        if not rule.guarded:
            continue
        for sp in rule.spellings():
            if rule.name in FAST_PATHS or (rule.name == "multi_head_attention" and sp.kind == "function"):
                continue  # what dynamo makes of nn.MultiheadAttention: test_contract.test_attention_*
            yield pytest.param(rule, sp, id=f"{rule.name}-{sp.name}")


def _inputs(rule, sp):
    """The rule's own bad operands (``Rule.sample``), as this spelling takes them."""
    dtypes = rule.sample.dtypes
    args, kwargs = rule.sample.bad_for(sp.name)(torch.float32 if torch.float32 in dtypes else dtypes[0])
    if sp.name.endswith("float_power_"):  # in-place float_power needs a float64 operand
        args = tuple(a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) else a for a in args)
    if sp.kind == "module" and rule.name != "multi_head_attention":
        if sp.name == "nn.Softmax2d":  # (C, H, W): a channel column of -inf
            return (torch.full((2, 2, 2), -float("inf"), requires_grad=True),), {}
        return tuple(a for a in args if not isinstance(a, (int, float))), {}
    return args, kwargs


def _probe(model, args, second_order: bool):
    """Values, gradients and (where the op has them) second derivatives: some ops break only
    there (sinc at 0, mish past exp's range, a singular det)."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    try:
        outs, grads = forward_backward(model, args)
    except NotImplementedError:  # e.g. torch has no derivative for in-place atanh_
        return [model(*args)], []
    if not all_finite(outs + grads) or not grads or not second_order:
        return outs, grads
    outs = [o for o in flat_tensors(model(*args)) if o.is_floating_point() and o.requires_grad]
    firsts = torch.autograd.grad(sum(o.float().sum() for o in outs), leaves, create_graph=True, allow_unused=True)
    firsts = [f for f in firsts if f is not None and f.requires_grad]
    if not firsts:
        return outs, grads
    try:
        seconds = torch.autograd.grad(sum(f.float().sum() for f in firsts), leaves, allow_unused=True)
    except RuntimeError as e:  # torch has no double backward for it (multi_margin_loss)
        if "not implemented" not in str(e):
            raise
        return outs, grads
    return outs, grads + [h for h in seconds if h is not None]


def _captures():
    """Every spelling under harden (fast tier); under the backend (a compile each) the fast tier
    takes each rule's first out-of-place and first in-place spelling, the slow tier the rest;
    compiled harden is the slow tier's."""
    seen = set()
    for case in _cases():
        rule, sp = case.values
        kind = (rule.name, sp.inplace)
        fast_backend = kind not in seen
        seen.add(kind)
        yield pytest.param(rule, sp, "harden", id=f"{case.id}-harden")
        yield pytest.param(rule, sp, "backend", id=f"{case.id}-backend",
                           marks=[] if fast_backend else [pytest.mark.slow])
        yield pytest.param(rule, sp, "compiled-harden", id=f"{case.id}-compiled-harden",
                           marks=[pytest.mark.slow])


@pytest.mark.parametrize("rule,sp,capture", list(_captures()))
def test_every_spelling_is_guarded(rule, sp, capture):
    args, kwargs = _inputs(rule, sp)
    keep_kwargs = sp.kind != "module" or rule.name == "multi_head_attention"
    model = Call(rule, sp, kwargs if keep_kwargs else {}, by_name=capture == "backend")
    # the probe really breaks the original op (as aot_autograd decomposes it, where the eager
    # kernel is finite on it: Sample.compiled)
    second = rule.sample.second_order
    original = torch.compile(model, backend="aot_eager") if sp.name in rule.sample.compiled else model
    outs, grads = _probe(original, copy.deepcopy(args), second)
    torch._dynamo.reset()
    assert not all_finite(outs + grads), f"probe for {rule.name} is finite unguarded"

    if capture == "compiled-harden":  # no site records under dynamo: the values say it
        torch._dynamo.reset()  # else Call.forward hits dynamo's recompile limit and runs eagerly
        compiled = torch.compile(nanpass.harden(model), backend="eager")
        outs, grads = _probe(compiled, args, second)
        assert all_finite(outs), f"{sp.name} under {capture}: non-finite value"
        assert all_finite(grads), f"{sp.name} under {capture}: non-finite gradient"
        return
    if capture == "harden":
        safe = nanpass.harden(model)
        outs, grads = _probe(safe, args, second)
        changes = safe.changes
    else:
        be = nanpass.backend(inner="eager")
        safe = torch.compile(model, backend=be)
        outs, grads = _probe(safe, args, second)
        changes = be.changes
        if not rule.sample.captured(sp.name):  # dynamo graph-breaks inside it: what runs eagerly
            # is guarded as the backend's eager calls are (issue 45), what dynamo's graphs hold of
            # its body by those ops' own rules
            assert [c for c in changes if c.action == "guarded"], changes
            assert all_finite(outs), f"{sp.name} outside the graphs: non-finite value"
            assert all_finite(grads), f"{sp.name} outside the graphs: non-finite gradient"
            return
    inlined = capture == "backend" and sp.name in rule.sample.inlined  # guarded inside, by other rules
    guarded = [c for c in changes if c.action == "guarded" and (inlined or c.op == rule.name)]
    assert guarded, f"{sp.name} was not rewritten under {capture}: {changes}"
    assert all_finite(outs), f"{sp.name} under {capture}: non-finite value"
    assert all_finite(grads), f"{sp.name} under {capture}: non-finite gradient"


@pytest.mark.parametrize("capture", ["harden", "backend", "compiled-harden"])
@pytest.mark.parametrize("name,fn,good", [
    ("remainder", lambda x: x.detach() // (x.detach() - 1), [0.5, 2.0, 4.0]),
    ("div", lambda x: 2.0 / x, [0.5, 1.0, 4.0]),
    ("pow", lambda x: 2.0 ** (x * 200), [-1.0, 0.0, 0.25]),
    ("div", lambda x: x.clone().__itruediv__(x - 4), [0.5, 1.0, 5.0]),
])
def test_reflected_and_inplace_operators(name, fn, good, capture):
    """``2 / x`` reaches a TorchFunctionMode as ``x.__rtruediv__(2)``: guarded as 2 / x."""
    class Op(nn.Module):
        def forward(self, x):
            return fn(x)

    x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
    outs, grads = forward_backward(Op(), (x,))
    assert not all_finite(outs + grads)
    if capture == "compiled-harden":  # dynamo passes torch._tensor's wrapped operators too
        outs, grads = forward_backward(torch.compile(nanpass.harden(Op()), backend="eager", fullgraph=True), (x,))
        assert all_finite(outs + grads)
        return
    if capture == "harden":
        safe = nanpass.harden(Op())
        outs, grads = forward_backward(safe, (x,))
        changes = safe.changes
    else:
        be = nanpass.backend(inner="eager")
        outs, grads = forward_backward(torch.compile(Op(), backend=be), (x,))
        changes = be.changes
    assert all_finite(outs + grads)
    assert [c.op for c in changes if c.action == "guarded"] == [name]
    safe_x = torch.tensor(good)
    assert torch.isfinite(Op()(safe_x)).all()
    assert torch.equal(nanpass.harden(Op())(safe_x), Op()(safe_x))


def _reflected():
    from nanpass._rules import _operator_calls

    return [pytest.param(rule, attr, other, id=f"{rule.name}-{attr}-{other}")
            for rule in RULES if rule.guarded
            for attr, _, _, swapped in _operator_calls(rule) if swapped
            for other in ("scalar", "tensor") if not (rule.name == "matmul" and other == "scalar")]


class _Reflected(nn.Module):
    def __init__(self, attr):
        super().__init__()
        self.attr = attr

    def forward(self, x, other):
        return getattr(x, self.attr)(other)


@pytest.mark.parametrize(("rule", "attr", "other"), _reflected())
def test_reflected_operators_keep_the_originals_bits(rule, attr, other):
    """``2 / x`` reaches the mode as ``x.__rtruediv__(2)``, which torch computes as
    ``x.reciprocal() * 2``, not as a true division: the guard must run the dunder itself."""
    dtype = rule.only_dtypes[0] if rule.only_dtypes else torch.float32
    shape = (3, 3) if rule.name == "matmul" else (64,)
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(shape, generator=gen) + 0.5).to(dtype)
    y = (torch.rand(shape, generator=gen) + 0.5).to(dtype) if rule.name == "matmul" else (
        3.14 if other == "scalar" else torch.tensor(1.7658, dtype=dtype))
    model = _Reflected(attr)
    want, got = model(x, y), nanpass.harden(model)(x, y)
    assert torch.equal(got, want), (got - want).abs().max()


class _Heard(torch.overrides.TorchFunctionMode):
    """Each call of the table a TorchFunctionMode is handed, named as ``as_written`` reads it
    off the frame of ``code``: whatever callable the running Python and torch deliver."""

    def __init__(self, code):
        super().__init__()
        self.code, self.names = code, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import sys

        from nanpass._intercept import _hit  # a stand-in torch looked up by name: its entry
        from nanpass._rules import as_written

        hit = _hit(func)
        if hit is not None:
            f = sys._getframe(1)
            while f is not None and f.f_code is not self.code:
                f = f.f_back
            self.names.append(as_written(hit, f)[1].name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("source", "names"), [
    ("x / y", ["operator.truediv"]),  # handed Tensor.div (3.10 to 3.13)
    ("2 / x", ["operator.truediv"]),  # handed Tensor.__rtruediv__, operands swapped
    ("z /= y", ["operator.itruediv"]),  # handed Tensor.div_
    ("x % y", ["operator.mod"]),
    ("z %= y", ["operator.imod"]),
    ("x // y", ["operator.floordiv"]),
    ("z //= y", ["operator.ifloordiv"]),
    ("x ** y", ["operator.pow"]),
    ("z **= y", ["operator.ipow"]),
    ("a @ a", ["operator.matmul"]),
    ("c @= a", ["operator.matmul"]),  # Tensor has no __imatmul__: Python calls __matmul__
    ("x.div(y) / 2", ["Tensor.div", "operator.truediv"]),
    ("torch.div(x, y) % x.remainder(y)", ["torch.div", "Tensor.remainder", "operator.mod"]),
    ("z.div_(y); a.matmul(a)", ["Tensor.div_", "Tensor.matmul"]),
])
def test_an_operator_is_named_as_written_whatever_the_mode_is_handed(source, names):
    """A TorchFunctionMode is handed ``Tensor.div`` for ``x / y`` (torch's C dunder names its
    parser's function), a stand-in on ``Tensor.__truediv__`` and fx the operator: the report
    names the call as written either way, read off the instruction the user's frame runs."""
    ns: dict = {}
    exec(f"def f(x, y, z, a, c):\n    {source}\n", {"torch": torch}, ns)
    x, y, a = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 4.0, 8.0]), torch.eye(2)
    heard = _Heard(ns["f"].__code__)
    with heard:
        ns["f"](x, y, x.clone(), a, a.clone())
    assert heard.names == names
