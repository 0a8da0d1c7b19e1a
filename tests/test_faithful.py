"""Faithfulness: the hardened model IS the original model, except for numbers its guards change.

On safe inputs (where the original is finite) ``nanpass.harden(model)`` must give the same
outputs and gradients bit for bit, the same ``None`` grads, the same buffers and parameters
after a step, the same hook calls and the same RNG use, whatever Python the forward is written
in: grad-mode and autocast regions, checkpoint, hooks, module swaps, train/eval, side effects,
other methods, control flow, threads, pickling. ``torch.compile(model, backend=nanpass...)``
must match to a close tolerance.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import itertools
import math
import os
import pickle
import threading
import weakref
from collections import Counter
from collections.abc import Mapping

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import nanpass
from nanpass import _guards

D = 8  # feature width of the small models
B = 4  # batch
THIS_FILE = os.path.abspath(__file__)


# -- helpers ---------------------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern of a float tensor (tells -0.0 from 0.0); other tensors as they are."""
    if t.is_floating_point():
        ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        return t.detach().contiguous().view(ints[t.element_size()])
    return t.detach()


def tensors(obj):
    """Every tensor in a nested output, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in tensors(getattr(obj, f.name))]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in tensors(v)]
    return []


def assert_tree(a, b, path="out", exact=True):
    """Same structure, types, dtypes, shapes, requires_grad, and values (bitwise if exact)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: {type(b).__name__} is not a tensor"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.requires_grad == b.requires_grad, f"{path}: requires_grad differs"
        if exact:
            assert torch.equal(bits(a), bits(b)), (
                f"{path}: not bitwise equal, max abs diff "
                f"{(a.detach().double() - b.detach().double()).abs().max().item()}"
            )
        else:
            torch.testing.assert_close(a.detach(), b.detach(), msg=lambda m: f"{path}: {m}")
        return
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        for f in dataclasses.fields(a):
            assert_tree(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}", exact)
    elif isinstance(a, Mapping):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_tree(a[k], b[k], f"{path}[{k!r}]", exact)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree(x, y, f"{path}[{i}]", exact)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_finite(obj, what="output"):
    for t in tensors(obj):
        if t.is_floating_point():
            assert torch.isfinite(t).all(), f"the {what} is not finite: pick a safe input"


def fresh(obj):
    """A copy of the inputs: tensors that require grad become new leaves."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone().requires_grad_(obj.requires_grad)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: fresh(getattr(obj, f.name))
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: fresh(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(fresh(v) for v in obj)
    return obj


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone()
            for n, t in itertools.chain(module.named_parameters(), module.named_buffers())}


def restore(module: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, t in itertools.chain(module.named_parameters(), module.named_buffers()):
            t.copy_(saved[n])


def default_loss(out, root):
    outs = [t for t in tensors(out) if t.is_floating_point() and t.requires_grad]
    return sum(t.float().sum() for t in outs) if outs else None


@dataclasses.dataclass
class Run:
    out: object
    grads: dict
    input_grads: list
    state: dict
    rng: torch.Tensor | None


def run_once(fn, root, args, kwargs, grads, seed, loss) -> Run:
    root.zero_grad(set_to_none=True)
    args, kwargs = fresh(args), fresh(kwargs)
    leaves = [t for t in tensors((args, kwargs)) if t.requires_grad]
    if seed is not None:
        torch.manual_seed(seed)
    out = fn(*args, **kwargs)
    if grads:
        with torch.enable_grad():  # the caller may run the model under no_grad
            total = loss(out, root)
        if total is not None:
            total.backward()
    rng = torch.get_rng_state() if seed is not None else None
    return Run(
        out,
        {n: None if p.grad is None else p.grad.clone() for n, p in root.named_parameters()},
        [t.grad for t in leaves],
        state(root),
        rng,
    )


def compare(a: Run, b: Run, exact=True):
    assert_tree(a.out, b.out, "out", exact)
    none_a = {n for n, g in a.grads.items() if g is None}
    none_b = {n for n, g in b.grads.items() if g is None}
    assert none_a == none_b, f"params with grad None differ: {sorted(none_a ^ none_b)}"
    for n, g in a.grads.items():
        if g is not None:
            assert_tree(g, b.grads[n], f"{n}.grad", exact)
    assert len(a.input_grads) == len(b.input_grads)
    for i, (g, h) in enumerate(zip(a.input_grads, b.input_grads, strict=True)):
        assert (g is None) == (h is None), f"input {i}: grad None differs"
        if g is not None:
            assert_tree(g, h, f"input[{i}].grad", exact)
    assert list(a.state) == list(b.state)
    for n in a.state:
        assert_tree(a.state[n], b.state[n], f"state {n}", exact)
    if a.rng is not None:
        assert torch.equal(a.rng, b.rng), "RNG state after the call differs"


def same(original, hardened, *args, grads=True, seed=None, kwargs=None, root=None,
         loss=default_loss, exact=True):
    """Run ``original`` then ``hardened`` on copies of the same inputs, from the same parameter
    and buffer values (and the same RNG seed, if given); assert that outputs, parameter and
    input gradients, the set of None grads, the parameters/buffers after the call and the RNG
    state are equal (bitwise unless exact=False). Returns both runs."""
    root = root if root is not None else original
    kwargs = kwargs or {}
    before = state(root)
    a = run_once(original, root, args, kwargs, grads, seed, loss)
    assert_finite(a.out)
    for n, g in a.grads.items():
        if g is not None:
            assert torch.isfinite(g).all(), f"the original's grad of {n} is not finite"
    restore(root, before)
    b = run_once(hardened, root, args, kwargs, grads, seed, loss)
    compare(a, b, exact)
    return a, b


def seeded(cls, *args, seed=0, **kwargs):
    torch.manual_seed(seed)
    return cls(*args, **kwargs)


def positive(*shape, seed=1, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(*shape, generator=g) + 0.1).requires_grad_(requires_grad)


def normal(*shape, seed=1, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_(requires_grad)


def all_finite(obj) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors(obj) if t.is_floating_point())


def fast_backend():
    return nanpass.backend(inner="aot_eager")


# -- small models ----------------------------------------------------------------------------


class Block(nn.Module):
    """log, sqrt and division, all safe on any finite input."""

    def __init__(self, d=D):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        h = self.fc(x)
        return torch.log(F.softplus(h)) + torch.sqrt(h.abs() + 1e-3) / (h.abs() + 1)


class OtherBlock(nn.Module):
    def __init__(self, d=D):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.exp(-self.fc(x).abs()) * 3.0 - torch.rsqrt(x * x + 1)


class Teacher(nn.Module):
    """A student trained against a frozen/EMA teacher used only under no_grad."""

    def __init__(self, variant="region"):
        super().__init__()
        self.variant = variant
        self.student = Block()
        self.teacher = Block()
        self.head = nn.Linear(D, D)

    @torch.no_grad()
    def target(self, x):
        return self.teacher(x).softmax(-1)

    def forward(self, x):
        s = self.student(x)
        if self.variant == "region":
            with torch.no_grad():
                t = self.teacher(x).softmax(-1)
                for pt, ps in zip(self.teacher.parameters(), self.student.parameters(), strict=True):
                    pt.mul_(0.9).add_(ps, alpha=0.1)  # EMA update
        elif self.variant == "decorated":
            t = self.target(x)
        else:  # "enable_grad": the caller runs under no_grad, the student part does not
            t = self.teacher(x).softmax(-1)
            with torch.enable_grad():
                p = self.head(self.student(x)).softmax(-1)
                return p, (p * (torch.log(p) - torch.log(t))).sum(-1)
        p = self.head(s).softmax(-1)
        kl = (p * (torch.log(p) - torch.log(t))).sum(-1)
        return p, kl


class AutocastNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)
        self.fc3 = nn.Linear(D, D)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.fc1(x)
            p = torch.softmax(h, -1)
            lg = torch.log(F.softplus(h))
            with torch.autocast("cpu", enabled=False):
                q = torch.sqrt(lg.float().abs() + 1) / (p.float() + 1)
                r = self.fc2(q)
            s = self.fc3(r)
        return h, p, lg, q, r, s, torch.log_softmax(s.float(), -1)


class CkptNet(nn.Module):
    """An unsafe region (log of an activation), checkpointed or not."""

    def __init__(self, mode="nonreentrant", act="softplus", width=D, p=0.1):
        super().__init__()
        self.mode, self.act = mode, act
        self.inp = nn.Linear(D, width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)
        self.drop = nn.Dropout(p)
        self.out = nn.Linear(width, D)

    def region(self, h):
        a = self.fc1(h)
        a = F.softplus(a) if self.act == "softplus" else torch.relu(a)
        a = torch.log(a)
        a = torch.sqrt(a * a + 1)
        a = self.drop(a)
        return self.fc2(a / (a.abs() + 1))

    def forward(self, x):
        h = self.inp(x)
        if self.mode == "none":
            r = self.region(h)
        else:
            r = checkpoint(self.region, h, use_reentrant=self.mode == "reentrant")
        return self.out(r)


class HookNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(D, D)

    def forward(self, x):
        return torch.log_softmax(self.head(self.block(x)), -1)


class Swappable(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(D, D)

    def forward(self, x):
        return self.head(self.block(x)).softmax(-1)


class DropBN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D)
        self.drop = nn.Dropout(0.5)
        self.bn2 = nn.BatchNorm1d(D)
        self.out = nn.Linear(D, D)

    def forward(self, x):
        h = self.bn(self.fc(x))
        h = self.drop(torch.log(F.softplus(h)))
        return self.out(self.bn2(h)) / (h.abs().sum(-1, keepdim=True) + 1)


class MoE(nn.Module):
    """Stores its load-balancing loss on self during forward."""

    def __init__(self, experts=4):
        super().__init__()
        self.gate = nn.Linear(D, experts)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(experts))
        self.calls = 0
        self.aux = None

    def forward(self, x):
        probs = torch.softmax(self.gate(x), -1)
        load = probs.mean(0)
        self.aux = (load * torch.log(load)).sum() + math.log(len(self.experts))
        self.calls += 1
        return sum(probs[:, i : i + 1] * e(x) for i, e in enumerate(self.experts))


class WithMethods(nn.Module):
    classes = 3

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, self.classes)

    def forward(self, x):
        return self.fc(torch.log(x))

    def predict(self, x):
        return self(x).softmax(-1)

    def score(self, x):
        return torch.log(x).mean(-1) * self.fc.weight.sum()


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor | None = None


@dataclasses.dataclass
class Result:
    y: torch.Tensor
    logp: torch.Tensor
    steps: int


class Flow(nn.Module):
    """Data-dependent branches and loops, *args/**kwargs, structured inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.fc2 = nn.Linear(D, D)

    def forward(self, x, *rest, steps=None, scale=None, **opts):
        h = self.fc(x)
        if h.sum() > 0:  # noqa: SIM108 - a Python if statement is the point
            h = torch.log(F.softplus(h))
        else:
            h = torch.sqrt(h * h + 1)
        if steps is None:
            steps = int(x.detach().abs().sum().item() * 10) % 3 + 1  # a count known at run time
        for _ in range(steps):
            h = self.fc2(h) / (h.abs() + 1)
        for r in rest:
            h = h + torch.log1p(r.abs())
        if scale is not None:
            h = h * scale
        if opts.get("temperature") is not None:
            h = h / opts["temperature"]
        return {"h": h, "parts": [h.mean(), h.softmax(-1)], "steps": steps}


class StructIO(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, batch: Batch, *, temperature: float = 1.0, bias=None):
        h = self.fc(batch.x)
        if batch.mask is not None:
            h = h.masked_fill(~batch.mask, -1e4)
        if bias is not None:
            h = h + bias
        return Result(h, torch.log_softmax(h / temperature, -1), steps=len(h))


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.register_buffer("running", torch.zeros(D))
        self.register_buffer("scratch", torch.zeros(B, D), persistent=False)

    def forward(self, x):
        self.count += 1
        h = self.fc(x)
        y = h.clone()
        y.div_(h.abs() + 1)
        y /= (x.abs() + 2)
        z = F.softplus(h).log_()
        w = (h * h + 1).sqrt_()
        torch.log(w.detach(), out=self.scratch)
        self.running.mul_(0.9).add_(0.1 * z.detach().mean(0))
        return y + z + w + self.scratch


class Dropouts(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(torch.log(F.softplus(self.fc(x))))
        h = F.dropout(h, 0.2, training=self.training)
        noise = torch.rand_like(h) * 0.01 + torch.bernoulli(torch.full_like(h, 0.5))
        return (h + noise) / (h.abs() + 1)


class StableForms(nn.Module):
    def forward(self, x):
        return torch.log(1 + x), torch.log(torch.softmax(x, -1)), torch.exp(x) - 1


class Leaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.sqrt(torch.log(F.softplus(self.lin(x))) ** 2 + 1)


class Middle(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = Leaf()

    def forward(self, x):
        return self.fc(x) / (x.abs() + 1)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Middle()

    def forward(self, x):
        return torch.softmax(self.block(x), -1)


# -- 1. grad-mode regions --------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["region", "decorated", "enable_grad"])
def test_no_grad_regions(variant):
    model = seeded(Teacher, variant)
    safe = nanpass.harden(model)
    x = normal(B, D, requires_grad=variant != "enable_grad")
    if variant == "enable_grad":
        with torch.no_grad():
            a, b = same(model, safe, x)
    else:
        a, b = same(model, safe, x)
    for r in (a, b):
        for n, g in r.grads.items():
            if n.startswith("teacher."):
                assert g is None, n
            elif n.startswith("student."):
                assert g is not None, n


# -- 2. autocast -----------------------------------------------------------------------------


@pytest.mark.parametrize("outer", [False, True])
def test_autocast_regions(outer):
    model = seeded(AutocastNet)
    safe = nanpass.harden(model)
    x = normal(B, D)
    if outer:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a, _ = same(model, safe, x)
    else:
        a, _ = same(model, safe, x)
    dtypes = [t.dtype for t in a.out]
    assert dtypes[0] == torch.bfloat16 and dtypes[4] == torch.float32 and dtypes[5] == torch.bfloat16


# -- 3. checkpoint ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_checkpoint_safe_inputs(mode):
    model = seeded(CkptNet, mode).train()
    safe = nanpass.harden(model)
    same(model, safe, normal(B, D), seed=3)


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_checkpoint_recompute_is_guarded(mode):
    """log(relu(h)) = log(0) inside the checkpointed region: the hardened gradients are finite,
    and equal those of the same hardened model without checkpoint (the recompute in backward
    ran the same guards as the forward)."""
    x = normal(B, D, requires_grad=False)
    model = seeded(CkptNet, mode, act="relu", p=0.0)
    out = model(x)
    assert not torch.isfinite(out).all(), "the input should be unsafe for the original"

    results = {}
    for m in (mode, "none"):
        model = seeded(CkptNet, m, act="relu", p=0.0)
        safe = nanpass.harden(model)
        xi = x.clone().requires_grad_()
        out = safe(xi)
        assert torch.isfinite(out).all()
        out.sum().backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        for n, g in grads.items():
            assert g is not None and torch.isfinite(g).all(), f"{m}: grad of {n} not finite"
        assert torch.isfinite(xi.grad).all()
        results[m] = (out, grads, xi.grad)
    out_c, grads_c, xg_c = results[mode]
    out_n, grads_n, xg_n = results["none"]
    assert torch.equal(out_c, out_n)
    assert torch.equal(xg_c, xg_n)
    for n in grads_c:
        assert torch.equal(grads_c[n], grads_n[n]), n


def saved_numel(fn, x) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(x)
    out.sum().backward()
    return total


@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_checkpoint_saves_no_more_than_the_original(mode):
    width = 64
    x = normal(16, D)
    counts = {}
    for m in (mode, "none"):
        model = seeded(CkptNet, m, width=width).eval()
        counts[m, "original"] = saved_numel(model, x.detach().clone().requires_grad_())
        model.zero_grad(set_to_none=True)
        counts[m, "hardened"] = saved_numel(nanpass.harden(model),
                                            x.detach().clone().requires_grad_())
    region = 16 * width  # one activation of the region
    # the checkpointed region's activations are not saved, original or hardened
    assert counts[mode, "original"] <= counts["none", "original"] - 3 * region, counts
    assert counts[mode, "hardened"] <= counts["none", "hardened"] - 3 * region, counts
    # and the guards save nothing more than a few scalars outside it
    assert counts[mode, "hardened"] <= counts[mode, "original"] + 16, counts


# -- 4. hooks --------------------------------------------------------------------------------


def counting_hooks(model, calls):
    handles = []
    for name, m in [("root", model), ("block", model.block), ("head", model.head)]:
        handles.append(m.register_forward_pre_hook(
            lambda mod, args, name=name: calls.update([f"pre:{name}"])))
        handles.append(m.register_forward_hook(
            lambda mod, args, out, name=name: calls.update([f"fwd:{name}"])))
    handles.append(model.block.register_forward_pre_hook(
        lambda mod, args, kwargs: calls.update(["pre_kw:block"]), with_kwargs=True))
    handles.append(model.block.register_full_backward_hook(
        lambda mod, gin, gout: calls.update(["bwd:block"])))
    return handles


def test_hooks_run_as_on_the_original():
    model = seeded(HookNet)
    calls = Counter()
    counting_hooks(model, calls)
    safe = nanpass.harden(model)
    x = normal(B, D)

    model(x).sum().backward()
    original_calls = Counter(calls)
    assert original_calls["fwd:root"] == 1 and original_calls["bwd:block"] == 1
    calls.clear()
    model.zero_grad(set_to_none=True)
    safe(x).sum().backward()
    assert calls == original_calls
    calls.clear()
    same(model, safe, x)
    assert calls == original_calls + original_calls


def test_hooks_added_removed_and_modifying_after_harden():
    model = seeded(HookNet)
    safe = nanpass.harden(model)
    x = normal(B, D)
    before, _ = same(model, safe, x)

    calls = Counter()
    handles = counting_hooks(model, calls)  # all added after harden()
    same(model, safe, x)
    assert all(v % 2 == 0 for v in calls.values()) and calls["fwd:head"] == 2, calls

    double = model.head.register_forward_hook(lambda m, args, out: out * 2)
    shift = model.block.register_forward_pre_hook(lambda m, args: (args[0] + 1,))
    changed, _ = same(model, safe, x)
    assert not torch.equal(changed.out, before.out), "the modifying hooks did not run"

    double.remove()
    shift.remove()
    for h in handles:
        h.remove()
    calls.clear()
    after, _ = same(model, safe, x)
    assert not calls, f"removed hooks still ran: {calls}"
    assert torch.equal(after.out, before.out)


def test_root_hooks_run_once_per_hardened_call():
    model = seeded(HookNet)
    calls = Counter()
    model.register_forward_hook(lambda m, a, o: calls.update(["root"]))
    safe = nanpass.harden(model)
    safe(normal(B, D))
    assert calls["root"] == 1


# -- 5. module swaps -------------------------------------------------------------------------


def test_submodule_swapped_after_harden():
    model = seeded(Swappable)
    safe = nanpass.harden(model)
    x = normal(B, D)
    first, _ = same(model, safe, x)

    torch.manual_seed(5)
    model.block = OtherBlock()  # on the original
    assert safe.block is model.block
    second, _ = same(model, safe, x)
    assert not torch.equal(first.out, second.out)
    assert any(c.module == "block" and c.module_type == "OtherBlock" for c in safe.changes), (
        [(c.module, c.module_type, c.op) for c in safe.changes])

    torch.manual_seed(6)
    safe.block = Block()  # on the hardened model
    assert model.block is safe.block
    third, _ = same(model, safe, x)
    assert not torch.equal(second.out, third.out)

    model.block.fc = nn.Linear(D, D)  # deeper
    same(model, safe, x)


# -- 6. train / eval -------------------------------------------------------------------------


def test_eval_on_the_original_makes_the_hardened_model_eval():
    model = seeded(DropBN)
    safe = nanpass.harden(model)
    x = normal(B, D)
    model.eval()
    stats = state(model)
    rng = torch.get_rng_state()
    out1 = safe(x)
    out2 = safe(x)
    assert torch.equal(out1, out2), "dropout ran in eval mode"
    assert torch.equal(rng, torch.get_rng_state()), "eval call used the RNG"
    for n, t in state(model).items():
        assert torch.equal(t, stats[n]), f"{n} changed in eval mode"
    same(model, safe, x)


def test_training_flag_reads_through_to_the_original():
    model = seeded(DropBN)
    safe = nanpass.harden(model)
    model.eval()
    assert safe.training is False
    model.train()
    assert safe.training is True


def test_frozen_batchnorm_keeps_running_stats():
    model = seeded(DropBN)
    safe = nanpass.harden(model)
    model.train()
    model.bn.eval()
    x = normal(B, D)
    bn_before = {n: t.clone() for n, t in model.bn.named_buffers()}
    bn2_before = model.bn2.running_mean.clone()
    for _ in range(2):
        same(model, safe, x, seed=11)
        safe(x)
    for n, t in model.bn.named_buffers():
        assert torch.equal(t, bn_before[n]), f"frozen bn.{n} changed"
    assert not torch.equal(model.bn2.running_mean, bn2_before), "training bn2 did not update"


def test_hardened_train_eval_flip_the_original():
    model = seeded(DropBN)
    safe = nanpass.harden(model)
    assert safe.eval() is safe
    assert not any(m.training for m in model.modules())
    safe.train()
    assert all(m.training for m in model.modules())
    safe.train(False)
    assert not model.training and not model.bn.training


# -- 7. side effects -------------------------------------------------------------------------


def test_tensor_stored_on_self_in_forward():
    model = seeded(MoE)
    safe = nanpass.harden(model)
    x = normal(B, D)

    def with_aux(out, root):
        return out.sum() + root.aux

    a, b = same(model, safe, x, loss=with_aux)
    assert model.calls == 2
    safe(x)
    assert isinstance(model.aux, torch.Tensor) and model.aux.grad_fn is not None
    assert safe.aux is model.aux
    assert model.calls == 3
    assert all(b.grads[f"gate.{n}"] is not None for n in ("weight", "bias"))


# -- 8. other methods ------------------------------------------------------------------------


def test_methods_other_than_forward():
    model = seeded(WithMethods)
    safe = nanpass.harden(model)
    x = positive(B, D)
    same(model.predict, safe.predict, x, root=model)
    same(model.score, safe.score, x, root=model)
    assert safe.classes == 3

    zero = torch.zeros(B, D, requires_grad=True)
    assert not all_finite(model.score(zero.detach()))
    assert not all_finite(model.predict(zero.detach()))
    for method in (safe.score, safe.predict):
        model.zero_grad(set_to_none=True)
        z = zero.detach().clone().requires_grad_()
        out = method(z)
        assert all_finite(out)
        out.sum().backward()
        assert torch.isfinite(z.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    for c in safe.changes:
        assert c.source and c.source.startswith(THIS_FILE + ":"), c


# -- 9. Hugging Face -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100,
                                  n_positions=32, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_gpt2_logits_and_grads(gpt2):
    safe = nanpass.harden(gpt2)
    ids = torch.randint(1, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    same(gpt2, safe, ids, kwargs={"labels": ids, "use_cache": False},
         loss=lambda out, root: out.loss)


def test_gpt2_generate(gpt2):
    safe = nanpass.harden(gpt2)
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    expected = gpt2.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = safe.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(expected, got)
    assert safe.changes, "generate ran unguarded"


def test_gpt2_attributes_read_through(gpt2):
    """Attributes of the model (HF's ``config``, ``device``, ...) are the original's."""
    safe = nanpass.harden(gpt2)
    assert safe.device == gpt2.device
    assert safe.generation_config is gpt2.generation_config
    assert safe.config is gpt2.config


# -- 10-12. instances, freeing, threads ------------------------------------------------------


def test_many_instances():
    x = normal(B, D)
    models = [seeded(Block, seed=i) for i in range(12)]
    hardened = [nanpass.harden(m) for m in models]
    for m, s in zip(models, hardened, strict=True):
        same(m, s, x)
    outs = [s(x) for s in hardened]
    assert not torch.equal(outs[0], outs[1])
    assert all(len(s.changes) == len(hardened[0].changes) for s in hardened)


@pytest.mark.parametrize("cls", [Block, CkptNet])
def test_freed_after_delete(cls):
    model = seeded(cls)
    ref = weakref.ref(model)
    safe = nanpass.harden(model)
    safe_ref = weakref.ref(safe)
    out = safe(normal(B, D))
    out.sum().backward()
    del model, safe, out
    gc.collect()
    assert ref() is None, f"the original is kept alive by {gc.get_referrers(ref())!r:.300}"
    assert safe_ref() is None


def test_threads():
    x = normal(B, D)
    zero = torch.zeros(B, D)
    plain = seeded(WithMethods, seed=7)
    expected_plain = plain.score(zero).detach()  # log(0) unguarded: -inf
    assert not torch.isfinite(expected_plain).all()
    originals = [seeded(Teacher, "decorated", seed=1), seeded(Swappable, seed=2)]
    expected = []
    for m in originals:
        out = m(x)
        expected.append(tuple(t.detach() for t in tensors(out)))
        default_loss(out, m).backward()
        expected[-1] += tuple(p.grad.clone() for p in m.parameters() if p.grad is not None)
        m.zero_grad(set_to_none=True)
    hardened = [nanpass.harden(m) for m in originals]
    barrier = threading.Barrier(3)
    results: dict = {}
    errors: list = []

    def work(i):
        try:
            barrier.wait()
            if i == 2:
                results[i] = [plain.score(zero).detach() for _ in range(20)]
                return
            out = hardened[i](x)
            default_loss(out, originals[i]).backward()
            results[i] = tuple(t.detach() for t in tensors(out)) + tuple(
                p.grad.clone() for p in originals[i].parameters() if p.grad is not None)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i in (0, 1):
        assert len(results[i]) == len(expected[i])
        for got, want in zip(results[i], expected[i], strict=True):
            assert torch.equal(bits(got), bits(want))
    for got in results[2]:
        assert torch.equal(bits(got), bits(expected_plain)), "guards leaked into another thread"


def test_registries_are_shared():
    model = seeded(DropBN)
    safe = nanpass.harden(model)
    assert [id(p) for p in safe.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in safe.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert safe.state_dict().keys() == model.state_dict().keys()
    safe.to(torch.float64)
    assert model.fc.weight.dtype == torch.float64 and model.bn.running_mean.dtype == torch.float64
    same(model, safe, normal(B, D).double(), seed=2)
    opt = torch.optim.SGD(safe.parameters(), lr=0.1)
    w = model.fc.weight.detach().clone()
    safe(normal(B, D).double()).sum().backward()
    opt.step()
    assert not torch.equal(model.fc.weight, w)


# -- 13. pickling and copies -----------------------------------------------------------------


def _pickle(safe):
    return pickle.loads(pickle.dumps(safe))


def _torch_save(safe):
    buf = io.BytesIO()
    torch.save(safe, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("roundtrip", [_pickle, _torch_save, copy.deepcopy],
                         ids=["pickle", "torch.save", "deepcopy"])
def test_roundtrips(roundtrip):
    model = seeded(Swappable)
    safe = nanpass.harden(model)
    x = normal(B, D)
    safe(x)
    loaded = roundtrip(safe)
    assert isinstance(loaded, nanpass.Hardened)
    assert loaded.original is not model
    assert loaded.block.fc.weight is loaded.original.block.fc.weight
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k])
    same(loaded.original, loaded, x)
    same(model, loaded, x, root=model, grads=False)
    with torch.no_grad():  # independent copies
        loaded.original.head.weight.add_(1.0)
    assert not torch.equal(loaded.head.weight, model.head.weight)
    # still guarded after the round trip
    with torch.no_grad():
        loaded.original.block.fc.weight.zero_()
        loaded.original.block.fc.bias.fill_(-200.0)  # softplus underflows to 0: log(0)
    assert not all_finite(loaded.original(x))
    assert all_finite(loaded(x))


# -- 14. Python control flow and call conventions --------------------------------------------


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("call", ["plain", "varargs", "kwargs", "none_kwargs"])
def test_control_flow_and_call_conventions(sign, call):
    model = seeded(Flow)
    safe = nanpass.harden(model)
    # flip the branch by the sign of the first layer's output sum
    x = normal(B, D)
    with torch.no_grad():
        if (model.fc(x).sum() > 0) != (sign > 0):
            x = (-x).detach().requires_grad_()
            model.fc.bias.neg_()
    args, kwargs = (x,), {}
    if call == "varargs":
        args = (x, positive(B, D, seed=4), normal(B, D, seed=5))
    elif call == "kwargs":
        kwargs = {"steps": 2, "scale": positive(B, D, seed=6), "temperature": 0.5}
    elif call == "none_kwargs":
        kwargs = {"steps": None, "scale": None, "temperature": None}
    a, _ = same(model, safe, *args, kwargs=kwargs)
    assert isinstance(a.out["steps"], int)


@pytest.mark.parametrize("masked", [False, True])
def test_dataclass_inputs_and_outputs(masked):
    model = seeded(StructIO)
    safe = nanpass.harden(model)
    mask = torch.rand(B, D, generator=torch.Generator().manual_seed(2)) > 0.3 if masked else None
    batch = Batch(normal(B, D), mask)
    a, _ = same(model, safe, batch, kwargs={"temperature": 0.7, "bias": None})
    assert isinstance(a.out, Result)
    same(model, safe, batch, kwargs={"bias": normal(D, seed=3)})


# -- 15-16. RNG, in-place ops and buffers ----------------------------------------------------


def test_dropout_uses_the_rng_identically():
    model = seeded(Dropouts).train()
    safe = nanpass.harden(model)
    x = normal(B, D)
    a, b = same(model, safe, x, seed=1234)
    assert a.rng is not None and torch.equal(a.rng, b.rng)
    other, _ = same(model, safe, x, seed=4321)
    assert not torch.equal(a.out, other.out)  # the RNG does matter
    assert not torch.equal(a.rng, other.rng)


def test_inplace_ops_and_buffer_updates():
    model = seeded(InPlace)
    safe = nanpass.harden(model)
    x = normal(B, D)
    a, b = same(model, safe, x)
    assert int(a.state["count"]) == 1 and int(b.state["count"]) == 1
    for _ in range(3):
        same(model, safe, x)
        safe(x)
    assert int(model.count) == 7  # 1, then +2 per loop: same() restores between its two runs
    assert not torch.equal(model.running, torch.zeros(D))


# -- 17. stable forms ------------------------------------------------------------------------


def test_no_stable_rewrites_by_default():
    model = StableForms()
    safe = nanpass.harden(model)
    x = torch.tensor([[1e-8, 3e-8, -2e-9, 0.5]], requires_grad=True)
    a, _ = same(model, safe, x)
    assert torch.equal(a.out[0][0, :3], torch.zeros(3)), "float32 log(1 + tiny) is 0"


def test_stable_true_is_a_config_error():
    with pytest.raises(nanpass.ConfigError) as info:
        nanpass.harden(StableForms(), stable=True)
    assert str(info.value).startswith("nanpass:")


# -- nanpass's own record --------------------------------------------------------------------


def test_changes_name_the_submodule_and_source_line():
    model = seeded(Outer)
    safe = nanpass.harden(model)
    assert safe.changes == []
    same(model, safe, normal(B, D))
    changes = safe.changes
    by_op = {(c.op, c.module): c for c in changes}
    paths = {name for name, _ in model.named_modules()}
    for c in changes:
        assert c.module in paths, c
        assert c.source is not None and c.source.startswith(THIS_FILE + ":"), c
        # x ** 2 of a float32 base is left (it overflows only past 1.8e19); the rest are guarded
        assert c.action == ("left" if c.op == "pow" else "guarded"), c
    log = by_op[("log", "block.fc")]
    assert log.module_type == "Leaf"
    assert "torch.log" in (log.code or ""), log
    line = int(log.source.rsplit(":", 1)[1])
    with open(THIS_FILE) as f:
        assert "torch.log(F.softplus(self.lin(x)))" in f.read().splitlines()[line - 1]
    assert ("sqrt", "block.fc") in by_op
    assert ("div", "block") in by_op
    assert ("softmax", "") in by_op
    n = len(changes)
    safe(normal(B, D))
    assert len(safe.changes) == n, "a site is recorded once"


# -- torch.compile with the nanpass backend --------------------------------------------------


COMPILED = {
    "no_grad": (lambda: seeded(Teacher, "region"), lambda: (normal(B, D),)),
    "autocast": (lambda: seeded(AutocastNet), lambda: (normal(B, D),)),
    "hooks": (lambda: seeded(HookNet), lambda: (normal(B, D),)),
    "control_flow": (lambda: seeded(Flow), lambda: (normal(B, D),)),
    "checkpoint": (lambda: seeded(CkptNet, "nonreentrant", p=0.0), lambda: (normal(B, D),)),
}


@pytest.mark.parametrize("name", list(COMPILED))
def test_compiled_with_the_nanpass_backend(name):
    make, inputs = COMPILED[name]
    model = make()
    calls = Counter()
    if name == "hooks":
        model.block.register_forward_hook(lambda m, a, o: calls.update(["block"]))
    backend = fast_backend()
    compiled = torch.compile(model, backend=backend)
    args = inputs()
    same(model, compiled, *args, exact=False)
    same(model, compiled, *args, exact=False)  # a second, cached call
    if name == "hooks":
        assert calls["block"] == 4
    guarded = {c.op for c in backend.changes if c.action == "guarded"}
    assert "log" in guarded, f"the compiled graphs guarded only {sorted(guarded)}"


@pytest.mark.parametrize("mode", ["nonreentrant", "none"])
def test_compiled_checkpoint_region_is_guarded(mode):
    """log(relu(h)) = log(0) inside a checkpointed region, compiled with the nanpass backend:
    finite like the same model without checkpoint."""
    x = normal(B, D, requires_grad=False)
    model = seeded(CkptNet, mode, act="relu", p=0.0)
    assert not all_finite(model(x))
    compiled = torch.compile(model, backend=fast_backend())
    xi = x.clone().requires_grad_()
    out = compiled(xi)
    assert all_finite(out), "the compiled checkpointed region ran unguarded"
    out.sum().backward()
    assert torch.isfinite(xi.grad).all()
    for n, p in model.named_parameters():
        assert torch.isfinite(p.grad).all(), n


# -- 18. random module trees -----------------------------------------------------------------


UNSAFE = {
    "log_softplus": lambda h: torch.log(F.softplus(h)),
    "sqrt_abs": lambda h: torch.sqrt(h.abs() + 1e-2),
    "div": lambda h: h / (h.abs() + 1),
    "softmax": lambda h: torch.softmax(h, -1),
}


class Node(nn.Module):
    def __init__(self, op, region, bn_eval, side_effect, branch):
        super().__init__()
        self.op, self.region, self.side_effect, self.branch = op, region, side_effect, branch
        self.fc = nn.Linear(D, D)
        self.bn = nn.BatchNorm1d(D) if bn_eval is not None else None
        self.bn_frozen = bool(bn_eval)
        self.last = None

    def body(self, h):
        h = self.fc(h)
        if self.bn is not None:
            h = self.bn(h)
        h = UNSAFE[self.op](h)
        if self.branch and h.mean() > 0.3:
            h = h * 0.5
        return h

    def forward(self, h):
        if self.region == "no_grad":
            with torch.no_grad():
                out = self.body(h)
        elif self.region == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = self.body(h)
            out = out.float()
        elif self.region in ("ckpt", "ckpt_reentrant"):
            out = checkpoint(self.body, h, use_reentrant=self.region == "ckpt_reentrant")
        else:
            out = self.body(h)
        if self.side_effect:
            self.last = out.mean()
        return out + h


class Tree(nn.Module):
    def __init__(self, specs, children):
        super().__init__()
        self.nodes = nn.ModuleList(Node(*s) for s in specs)
        self.kids = nn.ModuleList(children)

    def forward(self, x):
        h = x
        for node in self.nodes:
            h = node(h)
        for kid in self.kids:
            h = h + kid(h)
        return h


node_specs = st.tuples(
    st.sampled_from(sorted(UNSAFE)),
    st.sampled_from(["plain", "no_grad", "autocast", "ckpt", "ckpt_reentrant"]),
    st.sampled_from([None, True, False]),
    st.booleans(),
    st.booleans(),
)
trees = st.recursive(
    st.builds(lambda specs: ("tree", specs, []), st.lists(node_specs, min_size=1, max_size=3)),
    lambda kids: st.builds(lambda specs, ch: ("tree", specs, ch),
                           st.lists(node_specs, min_size=1, max_size=2),
                           st.lists(kids, max_size=2)),
    max_leaves=4,
)


def build(spec):
    _, specs, kids = spec
    return Tree(specs, [build(k) for k in kids])


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=trees, seed=st.integers(0, 2**16), hook=st.booleans(), train=st.booleans())
def test_random_module_trees(spec, seed, hook, train):
    torch.manual_seed(seed)
    model = build(spec).train(train)
    for m in model.modules():
        if isinstance(m, Node) and m.bn is not None and m.bn_frozen:
            m.bn.eval()  # frozen while the rest trains
    calls = Counter()
    if hook:
        first = next(m for m in model.modules() if isinstance(m, Node))
        first.register_forward_hook(lambda m, a, o: calls.update(["hook"]))
    safe = nanpass.harden(model)
    x = normal(B, D, seed=seed)
    same(model, safe, x, seed=seed)
    if hook:
        assert calls["hook"] % 2 == 0 and calls["hook"] > 0
    sides = [m.last for m in model.modules() if isinstance(m, Node) and m.side_effect]
    assert all(isinstance(s, torch.Tensor) for s in sides)


@pytest.mark.parametrize("kind", ["mha", "encoder_layer", "encoder"])
def test_attention_inference_fast_path_is_kept(kind):
    """eval + no_grad: torch's fused attention kernels run hardened too (bit for bit), and a
    fully padded sequence, NaN in torch's kernel, comes out finite."""
    torch.manual_seed(0)
    src = torch.randn(2, 3, 8)
    if kind == "mha":
        model = nn.MultiheadAttention(8, 2, batch_first=True).eval()

        def call(m, pad):
            return m(src, src, src, key_padding_mask=pad, need_weights=False)[0]
    else:
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        model = (layer if kind == "encoder_layer" else
                 nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)).eval()

        def call(m, pad):
            return m(src, src_key_padding_mask=pad)
    safe = nanpass.harden(model)
    partial = torch.tensor([[False, False, True], [False, True, False]])
    full = torch.tensor([[True, True, True], [False, True, False]])
    with torch.no_grad():
        assert torch.equal(bits(call(safe, partial)), bits(call(model, partial)))
        assert not torch.isfinite(call(model, full)).all()
        out = call(safe, full)
    assert torch.isfinite(out).all()
    assert {c.op for c in safe.changes if c.action == "guarded"} <= {"mha_fast_path", "encoder_layer_fast_path"}
    assert safe.changes


def test_low_precision_product_guard_follows_autocast():
    """A float32 nn.Linear under float16 autocast computes in float16: its overflow is guarded;
    without autocast (or under bfloat16 autocast: float32's range), products are not looked at
    (not reported, no cost)."""
    lin = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(2.0**10)
    x = torch.full((1, 2), 2.0**10)
    safe = nanpass.harden(lin)
    assert torch.isfinite(safe(x)).all() and safe.changes == []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(safe(x)).all() and safe.changes == []
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(lin(x)).all()
        out = safe(x)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert [(c.op, c.action) for c in safe.changes] == [("linear", "guarded")]


def test_gradient_penalty_inside_forward():
    """WGAN-GP: torch.autograd.grad(create_graph=True) inside forward, then a second backward
    through it: the same numbers, and a sqrt at a zero gradient norm stays finite."""

    class Critic(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, 1)

        def forward(self, x):
            x = x.requires_grad_()
            score = self.fc(torch.tanh(x)).sum()
            (g,) = torch.autograd.grad(score, x, create_graph=True)
            return score + ((torch.sqrt((g * g).sum(-1)) - 1) ** 2).mean()

    model = seeded(Critic)
    x = normal(B, D)
    same(model, nanpass.harden(model), x)
    with torch.no_grad():
        model.fc.weight.zero_()  # a zero gradient norm: sqrt's derivative at 0 is inf
    model.zero_grad(set_to_none=True)
    model(x.clone()).backward()
    assert not torch.isfinite(model.fc.weight.grad).all()
    model.zero_grad(set_to_none=True)
    nanpass.harden(model)(x.clone()).backward()
    assert torch.isfinite(model.fc.weight.grad).all()


class _CE(nn.Module):
    def forward(self, logits, y, reduction="mean"):
        return F.cross_entropy(logits, y, reduction=reduction)


@pytest.mark.parametrize("bad_row", [False, True], ids=["finite", "inf_logit"])
def test_cross_entropy_makes_no_copy_of_the_logits(bad_row):
    """A vocabulary's logits are a step's largest activation: in forward, where a step's peak
    memory is, the guard allocates no float tensor of their size beyond what the plain loss does
    (its log_softmax); in backward, finite CPU logits and loss take the plain loss's own graph
    (nothing more), and otherwise one more (the fence's) after the loss's own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sized(TorchDispatchMode):
        def __init__(self, numel):
            super().__init__()
            self.numel, self.ops = numel, []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            into = {a.untyped_storage().data_ptr() for a in (*args, *kwargs.values())
                    if isinstance(a, torch.Tensor)}  # a write into an operand makes nothing new
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if (isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel() == self.numel
                        and o.untyped_storage().data_ptr() not in into):
                    self.ops.append(func.overloadpacket.__name__)
            return out

    def sized_ops(model):
        logits = torch.randn(4, 16, 1000)
        if bad_row:
            logits[1, 3, 7] = float("inf")
        logits.requires_grad_()
        y = torch.randint(0, 1000, (4, 16))
        with Sized(logits.numel()) as fwd:
            loss = model(logits.view(-1, 1000), y.view(-1))
        with Sized(logits.numel()) as bwd:
            loss.backward()
        real = lambda ops: sorted(op for op in ops if op not in ("view", "detach"))  # noqa: E731
        return real(fwd.ops), real(bwd.ops)

    (plain_fwd, plain_bwd), (safe_fwd, safe_bwd) = sized_ops(_CE()), sized_ops(nanpass.harden(_CE()))
    assert plain_fwd == safe_fwd == ["_log_softmax"]
    fence = ["nan_to_num"] if bad_row else []  # its where() writes into it
    assert sorted(safe_bwd) == sorted([*plain_bwd, *fence])


class _Energy(nn.Module):
    """An energy of positions ``v`` whose norm feeds a term beside other uses of ``v``, as in a
    force field (e3nn, PaiNN): forces are ``-dE/dv``, and a loss on them is trained with their
    gradient, a second derivative."""

    def __init__(self, term: str):
        super().__init__()
        self.term = term
        self.lin = nn.Linear(3, 3)

    def forward(self, v):
        w = self.lin(v)
        if self.term == "norm":
            extra = v.norm(dim=-1).pow(2).sum()
        elif self.term == "normalize":
            extra = (F.normalize(v, dim=-1) * w).sum()
        else:
            extra = (F.cosine_similarity(v, w) * v.norm(dim=-1)).sum()
        return (v * w).sum() + extra


@pytest.mark.parametrize("term", ["norm", "normalize", "cosine_times_norm"])
def test_second_derivatives_through_a_norm_of_a_fanned_out_input_keep_the_originals_bits(term):
    """Issue 28 item 3, its open case: with one fence node before the norm, the second backward
    summed the norm's second-order terms at the fence before adding the others (the last bit of
    ``d2/dv`` differed in 20 to 30 of 30 draws). norm and normalize now fence with hooks on
    their own nodes (``composite_call``): no node of their own, the graph is the original's."""
    for seed in range(10):
        torch.manual_seed(seed)
        model = _Energy(term)
        v = torch.randn(8, 3, requires_grad=True)
        got = []
        for m in (model, nanpass.harden(model)):
            (f,) = torch.autograd.grad(m(v), v, create_graph=True)
            got.append([f.detach(), *torch.autograd.grad(f.pow(2).sum(), [v, *model.parameters()])])
        for a, b in zip(*got, strict=True):
            assert torch.equal(bits(a), bits(b)), seed


class _Losses(nn.Module):
    """The losses a Hugging Face model returns as ``.loss``, each spelling once."""

    def forward(self, x, y, probs):
        return (F.nll_loss(F.log_softmax(x, -1), y) + F.cross_entropy(x, y, label_smoothing=0.1)
                + F.cross_entropy(x * 2, probs) + x.log_softmax(1).mean())


def _nodes(t) -> list[str]:
    """The autograd graph behind ``t``, breadth first, by node name."""
    seen, order, todo = set(), [], [t.grad_fn]
    while todo:
        node = todo.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return order


def test_finite_losses_keep_the_originals_graph_node_for_node():
    """Issue 28 item 7: on CPU, where reading a value back is free, log_softmax, cross_entropy
    and nll_loss whose logits and result are finite return the op's own result: the original's
    autograd graph node for node (no straight-through or fence node), so its gradients and
    second derivatives are the original's and the step costs what the plain one does. Inf logits
    in an ignored row (finite loss, NaN gradient plain) still take the guard."""
    torch.manual_seed(0)
    x = torch.randn(6, 5, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 4, -100])
    probs = torch.rand(6, 5).softmax(-1)
    plain, safe = _Losses()(x, y, probs), nanpass.harden(_Losses())(x, y, probs)
    assert _nodes(safe) == _nodes(plain)
    (gp,) = torch.autograd.grad(plain, x, create_graph=True)
    (gs,) = torch.autograd.grad(safe, x, create_graph=True)
    assert torch.equal(bits(gs), bits(gp))
    assert torch.equal(bits(torch.autograd.grad(gs.pow(2).sum(), x)[0]),
                       bits(torch.autograd.grad(gp.pow(2).sum(), x)[0]))
    bad = x.detach().clone()
    bad[5, 2] = float("inf")  # the ignored row
    bad.requires_grad_()
    loss = nanpass.harden(_CE())(bad, y)
    (g,) = torch.autograd.grad(loss, bad)
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert torch.isnan(torch.autograd.grad(F.cross_entropy(bad, y), bad)[0]).any()  # plain: NaN


def test_a_bad_row_of_logits_leaves_the_other_rows_training():
    """+inf in one row's logits (or a row of -inf): that row's loss and gradient are 0; every
    other row's loss and gradient are the plain model's, bit for bit."""
    torch.manual_seed(0)
    y = torch.tensor([0, 2, 1, 3])
    for bad in (lambda r: r.__setitem__(2, float("inf")), lambda r: r.fill_(-float("inf"))):
        x = torch.randn(4, 5)
        bad(x[1])
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        plain, safe = _CE()(a, y, "none"), nanpass.harden(_CE())(b, y, "none")
        assert not torch.isfinite(plain[1]) and safe[1] == 0
        keep = [0, 2, 3]
        assert torch.equal(safe[keep], plain[keep])
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        _CE()(a, y).backward()
        nanpass.harden(_CE())(b, y).backward()
        assert torch.equal(b.grad[keep], a.grad[keep]) and (b.grad[1] == 0).all()


# -- crossed clip bounds (issue 37, item 5) ------------------------------------------------


class _Logit(nn.Module):
    def __init__(self, eps):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return torch.logit(x, eps=self.eps)


@pytest.mark.parametrize("eps", [0.6, 0.75, 0.9, 0.5, 0.25, 0.125])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_logit_with_the_users_eps_keeps_the_originals_bits(eps, dtype):
    """``torch.logit(x, eps)`` reads ``x < eps ? eps : x > 1 - eps ? 1 - eps : x``: above 0.5
    the bounds cross, and values below eps go to eps, the rest to 1 - eps (an OpInfo sample).
    The hardened call keeps every value and gradient bit, bounds crossed or not."""
    values = [0.0, 0.1, 0.25, 0.5, 0.55, 0.7, 0.9, 1.0]
    x = torch.tensor(values, dtype=dtype, requires_grad=True)
    xh = torch.tensor(values, dtype=dtype, requires_grad=True)
    want, got = _Logit(eps)(x), nanpass.harden(_Logit(eps))(xh)
    assert torch.isfinite(want).all()  # every eps here is inside the dtype: the original is finite
    assert torch.equal(bits(got), bits(want)), f"{got} != {want}"
    want.sum().backward()
    got.sum().backward()
    assert torch.equal(bits(xh.grad), bits(x.grad))


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lo=st.floats(-3, 3), hi=st.floats(-3, 3),
       xs=st.lists(st.one_of(st.floats(-4, 4), st.sampled_from([-math.inf, math.inf, 0.0, -0.0])),
                   min_size=1, max_size=8))
def test_the_where_form_of_clip_is_clamp_on_every_input(monkeypatch, lo, hi, xs):
    """The clip a guard takes where clamp's gradient at a bound is 0 (torch >= 2.14) gives
    clamp's values on every input, crossed bounds (``lo > hi``: clamp gives ``hi``) included;
    forced here on every torch."""
    monkeypatch.setattr(_guards, "CLAMP_GRAD_AT_BOUNDS", False)
    x = torch.tensor(xs, requires_grad=True)
    for a, b in ((lo, hi), (lo, None), (None, hi)):
        got = _guards.clip(x, a, b)
        assert torch.equal(bits(got), bits(torch.clamp(x, a, b))), (a, b, xs)
