"""``nanpass.search``: concrete inputs within the ranges that make the original model non-finite.

For each op that ``certify`` cannot prove safe, the search tries (within a time budget):

1. the interval witnesses: the corners of the ranges (every input at lo or at hi, element-wise
   mixes of the corners), and the values where unsafe domains begin (0, +-1) clamped into them;
2. gradient-guided search, as GRIST (ICSE'22) does: a differentiable distance of the op's
   operand to its unsafe domain (the smallest operand of a log, the smallest |divisor|, the
   largest operand of an exp, ...) is driven down by projected sign-gradient steps on the inputs,
   clamped into the ranges, checking the model after every step;
3. uniform draws inside the ranges.

A finding is an input on which the *original* model's output, or the gradient of the sum of its
outputs with respect to its inputs and parameters, is non-finite; it names the op where the first
non-finite value appeared (module path, source line) and the guard that fixes it.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from ._certify import GUARDED, PROVEN, _float_tensors, certify, input_box, parse_ranges
from ._compat import eager_handler
from ._errors import NanpassTypeError
from ._rules import BY_NAME

Tensor = torch.Tensor
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANPASS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

# how to push each rule's operand towards its unsafe domain: (operand index, objective to minimise)
_LOW = {"log", "log2", "log10", "log1p", "sqrt", "rsqrt", "pow", "acosh", "logit", "lgamma", "xlogy", "entr",
        "ndtri", "xlog1py"}
_SMALL = {"div": 1, "reciprocal": 0, "remainder": 1, "addcdiv": 2}
_HIGH = {"exp", "exp2", "expm1", "cosh", "poisson_nll_loss", "soft_margin_loss", "mish"}
_EDGE = {"acos", "asin", "atanh", "erfinv"}
_ROWS = {"softmax", "log_softmax", "logsumexp", "softmin", "logaddexp", "cross_entropy", "nll_loss"}
_SPREAD = {"std", "var", "layer_norm", "normalize", "norm", "group_norm", "instance_norm", "rms_norm",
           "batch_norm", "cosine_similarity", "pairwise_distance", "weight_norm", "hypot"}


@dataclass
class SearchFinding:
    """An input inside the ranges on which the original model's output or gradient is non-finite."""

    inputs: tuple  # the model's positional arguments
    op: str  # the rule (or aten op) where the first non-finite value appeared
    module: str
    source: str | None
    guard: str  # what nanpass.harden does there (the fix); "" for an op it does not guard
    where: str  # "output" or "gradient"
    how: str  # "corner" | "gradient" | "random"
    seconds: float  # search time until found

    def __str__(self) -> str:
        fix = f"; fix: nanpass.harden ({self.guard})" if self.guard else ""
        return (f"{self.op} in {self.module or '<root>'}" + (f" at {self.source}" if self.source else "")
                + f": non-finite {self.where} (found by {self.how} search in {self.seconds:.2f} s){fix}")


def _user_source() -> str | None:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if not name.startswith((_NANPASS_DIR, _TORCH_DIR)) and not name.startswith("<"):
            return f"{name}:{f.f_lineno}"
        f = f.f_back
    return None


class _Probe(TorchFunctionMode):
    """Records the first call whose float result is non-finite while its float operands are
    finite (where a NaN/Inf is born), and captures the operands and result of the calls at one
    source line (the target's), for the objective."""

    def __init__(self, target_source: str | None):
        super().__init__()
        self.target = target_source
        self.birth: str | None = None
        self.captured: list[tuple[list[Tensor], list[Tensor]]] = []

    @eager_handler
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.target is None and self.birth is not None:
            return out
        outs = _float_tensors(out)
        if not outs:
            return out
        src = None
        if self.target is not None:
            src = _user_source()
            if src == self.target:
                ins = [a for a in _float_tensors(list(args) + list(kwargs.values()))]
                self.captured.append((ins, outs))
        if self.birth is None:
            with torch.no_grad():
                bad = any(not bool(torch.isfinite(o).all()) for o in outs)
                if bad and all(bool(torch.isfinite(a).all()) for a in _float_tensors(list(args))):
                    self.birth = src or _user_source()
        return out


def _evaluate(model, xs, leaves_idx, target_source=None, want_graph=False):
    """(where non-finite: None | "output" | "gradient", birth source, probe) for inputs ``xs``."""
    xs = list(xs)
    for i in leaves_idx:
        xs[i] = xs[i].detach().clone().requires_grad_(True)
    probe = _Probe(target_source)
    try:
        with torch.enable_grad(), probe:
            out = model(*xs)
        outs = _float_tensors(out)
        if any(not bool(torch.isfinite(o).all()) for o in outs):
            return "output", probe.birth, probe, xs
        loss = sum(o.float().sum() for o in outs if o.requires_grad)
        if not isinstance(loss, Tensor):
            return None, None, probe, xs
        wrt = [xs[i] for i in leaves_idx] + [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, wrt, allow_unused=True, retain_graph=want_graph)
        if any(g is not None and not bool(torch.isfinite(g).all()) for g in grads):
            return "gradient", probe.birth, probe, xs
        return None, None, probe, xs
    except Exception:  # noqa: BLE001 - an input the model rejects is no finding
        return None, None, probe, xs


def _objective(rule: str, ins: list[Tensor], outs: list[Tensor]) -> Tensor | None:
    """A quantity to minimise that drives the op towards its unsafe domain."""
    if rule in _SMALL and len(ins) > _SMALL[rule]:
        return ins[_SMALL[rule]].abs().min()
    if not ins:
        return -outs[0].abs().max() if outs else None
    x = ins[0]
    if rule in _LOW:
        return x.min()
    if rule in _HIGH:
        return -x.max()
    if rule in _EDGE:
        return -x.abs().max()
    if rule in _ROWS:
        return x.max()
    if rule in _SPREAD:
        return x.float().var() if x.numel() > 1 else x.abs().min()
    return -outs[0].float().abs().max() if outs else None


def _uniform(lo: Tensor, hi: Tensor, gen) -> Tensor:
    """A float64 draw inside [lo, hi]. An infinite bound is drawn as ±1e30, never past the
    other bound: clamping both bounds to ±1e30 put a range beyond 1e30 outside itself, and a
    finding there did not reproduce at its own inputs."""
    far = torch.full_like(lo, 1e30)
    fl = torch.where(torch.isinf(lo), torch.minimum(hi, -far), lo)
    fh = torch.where(torch.isinf(hi), torch.maximum(fl, far), hi)
    u = torch.rand(lo.shape, generator=gen, dtype=torch.float64)
    return torch.where(lo == hi, lo, fl + u * (fh - fl))


def _corners(specs, example, boxes, gen, n_random):
    """Candidate inputs: corners, special values clamped into the ranges, random mixes, uniform."""
    idx = [i for i, s in enumerate(specs) if s is not None]
    cands = []

    def make(choice):
        xs = list(example)
        for i, c in zip(idx, choice, strict=True):
            lo, hi = boxes[i].lo, boxes[i].hi
            x = example[i]
            if isinstance(c, float):
                v = torch.full_like(lo, c).clamp(lo, hi)
            elif c == "lo":
                v = lo
            elif c == "hi":
                v = hi
            elif c == "example":
                v = x.to(torch.float64).clamp(lo, hi)
            elif c == "mix":
                v = torch.where(torch.rand(lo.shape, generator=gen, dtype=torch.float64) < 0.5, lo, hi)
            else:  # uniform
                v = _uniform(lo, hi, gen)
            v = v.to(x.dtype) if x.is_floating_point() else v.round().to(x.dtype)
            xs[i] = torch.maximum(torch.minimum(v, hi.to(v.dtype)), lo.to(v.dtype))
        return ("corner" if all(c in ("lo", "hi") or isinstance(c, float) for c in choice) else "random"), xs

    k = len(idx)
    for choice in itertools.product(("lo", "hi"), repeat=min(k, 4)):
        cands.append(make(list(choice) + ["lo"] * (k - len(choice))))
    for special in (0.0, 1.0, -1.0):
        cands.append(make([special] * k))
    cands.append(make(["example"] * k))
    for _ in range(n_random):
        cands.append(make(["mix"] * k))
        cands.append(make(["uniform"] * k))
    return cands


def search(model: torch.nn.Module, *example_inputs, ranges=None, budget: float = 2.0,
           certificate=None) -> list:
    """Inputs within ``ranges`` (as for ``certify``) on which the original model's output or
    gradient is non-finite, one finding per op, searched for ``budget`` seconds in all. The ops
    searched are those ``certify`` cannot prove safe (pass ``certificate`` to reuse one); a
    ``nanpass.harden`` model is searched through its original."""
    from ._harden import Hardened

    if not isinstance(model, torch.nn.Module):
        raise NanpassTypeError(f"nanpass: search takes an nn.Module, got {type(model).__name__}")
    start = time.perf_counter()
    original = model._nanpass_model if isinstance(model, Hardened) else model
    specs = parse_ranges(ranges, example_inputs)
    cert = certificate if certificate is not None else certify(original, *example_inputs, ranges=ranges)
    # an op whose value is proven finite may still have an infinite derivative in the ranges
    # (acos at 1, a norm at 0): certify does not prove gradients, so those are searched too
    targets = [v for v in cert.verdicts if v.verdict not in (PROVEN, GUARDED)
               or (v.verdict == PROVEN and v.grad == "unproven")]
    if not targets and cert.outputs_finite:
        return []
    boxes = [input_box(x, s) if s is not None else None for x, s in zip(example_inputs, specs, strict=True)]
    leaves = [i for i, (x, s) in enumerate(zip(example_inputs, specs, strict=True))
              if s is not None and isinstance(x, Tensor) and x.is_floating_point()]
    by_source = {v.source: v for v in targets}
    findings: dict = {}
    gen = torch.Generator().manual_seed(0)

    def note(where, birth, xs, how, fallback):
        v = by_source.get(birth) or fallback
        key = (v.op, v.module, v.source) if v is not None else ("output", "", birth)
        if key in findings:
            return False
        rule = BY_NAME.get(v.op) if v is not None else None
        findings[key] = SearchFinding(
            inputs=tuple(x.detach().clone() if isinstance(x, Tensor) else x for x in xs),
            op=v.op if v is not None else "output", module=v.module if v is not None else "",
            source=v.source if v is not None else birth,
            guard=rule.action if rule is not None and rule.guarded else "", where=where, how=how,
            seconds=time.perf_counter() - start)
        return True

    deadline = start + budget
    # 1. witnesses: corners and special values
    for how, xs in _corners(specs, example_inputs, boxes, gen, n_random=0):
        if time.perf_counter() > deadline:
            break
        where, birth, _, _ = _evaluate(original, xs, leaves)
        if where:
            note(where, birth, xs, how, targets[0] if len(targets) == 1 else None)
    # 2. gradient-guided, per op not yet found
    remaining = [v for v in targets if (v.op, v.module, v.source) not in findings and v.source]
    for n, v in enumerate(remaining):
        now = time.perf_counter()
        if now > deadline or not leaves:
            break
        stop = now + (deadline - now) / (len(remaining) - n)
        _gradient_search(original, example_inputs, boxes, leaves, v, stop, gen, note)
    # 3. uniform draws with what is left
    while time.perf_counter() < deadline and len(findings) < len(targets):
        for how, xs in _corners(specs, example_inputs, boxes, gen, n_random=1)[-2:]:
            where, birth, _, _ = _evaluate(original, xs, leaves)
            if where:
                note(where, birth, xs, how, None)
    return list(findings.values())


def _gradient_search(model, example, boxes, leaves, target, stop, gen, note) -> None:
    xs = list(example)
    for i in leaves:  # start inside the ranges: the example, clamped
        lo, hi = boxes[i].lo.to(xs[i].dtype), boxes[i].hi.to(xs[i].dtype)
        xs[i] = torch.maximum(torch.minimum(xs[i].detach(), hi), lo)
    step = 0.25
    restarts = 0
    while time.perf_counter() < stop:
        where, birth, probe, run = _evaluate(model, xs, leaves, target.source, want_graph=True)
        if where:
            note(where, birth, xs, "gradient", target)
            return
        objs = [o for o in (_objective(target.op, ins, outs) for ins, outs in probe.captured) if o is not None]
        if not objs:
            return  # the op is not reached from here
        obj = torch.stack([o.float() for o in objs]).min()
        leaf_t = [run[i] for i in leaves]
        try:
            grads = torch.autograd.grad(obj, leaf_t, allow_unused=True)
        except RuntimeError:
            return
        moved = False
        for i, g in zip(leaves, grads, strict=True):
            if g is None or not bool(torch.isfinite(g).all()):
                continue
            lo, hi = boxes[i].lo, boxes[i].hi
            width = torch.where(torch.isfinite(hi - lo), hi - lo, run[i].detach().abs().to(torch.float64) + 1)
            x = run[i].detach().to(torch.float64) - step * width * torch.sign(g.to(torch.float64))
            x = torch.maximum(torch.minimum(x, hi), lo).to(xs[i].dtype)
            moved = moved or not torch.equal(x, xs[i])
            xs[i] = x
        step *= 0.7
        if not moved or step < 1e-4:
            restarts += 1
            step = 0.25
            for i in leaves:  # restart from a random point in the ranges
                lo, hi = boxes[i].lo, boxes[i].hi
                x = _uniform(lo, hi, gen).to(example[i].dtype)
                xs[i] = torch.maximum(torch.minimum(x, hi.to(x.dtype)), lo.to(x.dtype))
