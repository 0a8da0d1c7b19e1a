"""Census: which PyTorch ops turn finite operands into NaN/Inf, and is each one guarded?

Walks PyTorch's OpInfo database (``torch.testing._internal.common_methods_invocations.op_db``,
which needs the ``expecttest`` package) and probes every op with a floating dtype: forward,
backward (gradient of the outputs against an all-ones upstream) and double backward (gradient
of those gradients, ``create_graph=True``). The operands come from the op's own
``sample_inputs`` (valid shapes and arguments); their floating-point values are then replaced
by extremal *finite* values:

- ``ordinary``: 0, -0, +-tiny (``finfo.tiny``), +-eps, +-0.5, +-1, +-2, and for linear algebra
  the identity (repeated eigen/singular values), a singular and a near-singular matrix;
- ``large``: +-big, big = floor(2 ln(max)) (177 in float32/bfloat16, 22 in float16): where
  exp-like functions overflow, a size real activations reach;
- ``huge``: +-sqrt(max), +-max.

Each op is recorded with the mildest tier that gives a non-finite value, per dtype and phase
(a backward counts only where the forward was finite, a double backward only where forward and
backward were). Then it is classified: ``guarded`` (a guarded nanpass rule intercepts one of its
callables: ``nanpass._rules.CALLS``), ``accepted`` (a reason in ``ACCEPTED`` below, or the
overflow policy: non-finite only from ``huge`` operands, i.e. a finite result past max) or
``UNGUARDED``.

A guarded op's non-finite probes are re-run through ``nanpass.harden`` and what stays non-finite
is reported. Each op is probed in a forked child process, so an op that crashes the process
(``grid_sampler_2d`` segfaults on +-max grids) is recorded and skipped, not fatal.

    python benchmarks/census.py [--ops a,b] [--dtypes float32,float16] [--samples 5]
        [--out docs/census.md] [--json census.json] [--no-verify] [--no-isolate]
        [--empty | --groups]

``--empty`` (issue 39) cuts every sample to zero-size operands; ``--groups`` (issue 48) gives
every op that reduces over groups (segments, bags, index slots, masked rows, ignored targets)
one empty group; each writes its own section of ``--out``. Both run each case as torch runs it,
under ``nanpass.harden`` and under ``nanpass.backend``, and run each op in forked children: a case
that crashes the process is recorded and left unprobed, and the op's other cases still run.

The full census (all ops, four dtypes) takes about two minutes on one CPU core.
``tests/test_census.py`` re-runs a subset and fails on a new unguarded op.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import itertools
import json
import math
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16,
          "float32": torch.float32, "float64": torch.float64}
TIERS = ("ordinary", "large", "huge")
EXAMPLE_ORDER = ("float32", "float64", "float16", "bfloat16")  # the example shown: first at the mildest tier
PHASES = ("forward", "backward", "double backward")

# --------------------------------------------------------------------------------------------
# Why an op's non-finite result is acceptable. Keyed by OpInfo name ("div") or full id
# ("div.floor_rounding"). Ops whose NaN/Inf comes only from huge operands (+-sqrt(max), +-max)
# are accepted by the overflow policy (OVERFLOW_POLICY) and need no entry here.
# --------------------------------------------------------------------------------------------
_PRODUCT = ("a product of many factors overflows (2**125 in float16) or underflows to 0, where "
            "its higher gradients divide by it: finite-product saturation, out of op-guard scope")
_CHAIN = ("a product of three or more operands: with every operand (weights included) at big "
          "it overflows float16; finite-product saturation, out of op-guard scope")
_NOT_IN_MODELS = "not used inside models (testing / data-preparation utility)"
_MASKED = ("torch.masked prototype op (not used in models); nanpass guards the plain op where "
           "it guards one")
_SPECIAL = ("special function not used in models; the non-finite value is its pole or its true "
            "value past max")
_POLY = ("orthogonal polynomial whose degree is a float tensor, not used in models; non-finite "
         "only for a degree or argument of big (177)")

_LOWRANK = ("randomised low-rank SVD, written in Python: for plain tensors it dispatches no torch "
            "function, so no TorchFunctionMode sees the call; the qr and svd inside are guarded "
            "(finite values and gradients); a double backward through its products at a zero "
            "matrix is not")

ACCEPTED: dict[str, str] = {
    "prod": _PRODUCT,
    "cumprod": _PRODUCT,
    "scatter_reduce.prod": _PRODUCT,
    "index_reduce.prod": _PRODUCT,
    "linalg.vander": "powers x**k of the operand, " + _PRODUCT,
    "nn.functional.bilinear": _CHAIN,
    "linalg.multi_dot": _CHAIN,
    "ldexp": ("x * 2**e with 2**e computed in the operand dtype (2**22 is inf in float16, and "
              "0 * inf NaN): " + _NOT_IN_MODELS),
    "frexp": ("mantissa/exponent split; its gradient 2**-e overflows near tiny: " + _NOT_IN_MODELS),
    "histogram": _NOT_IN_MODELS,
    "histogramdd": _NOT_IN_MODELS,
    "i0": _SPECIAL + " (i0(x) ~ e^x / sqrt(2 pi x); models use the scaled i0e)",
    "special.i1": _SPECIAL + " (models use the scaled i1e)",
    "special.erfcx": _SPECIAL + " (erfcx(-x) ~ 2 e^(x^2))",
    "special.zeta": _SPECIAL,
    "special.bessel_y0": _SPECIAL, "special.bessel_y1": _SPECIAL,
    "special.modified_bessel_i0": _SPECIAL, "special.modified_bessel_i1": _SPECIAL,
    "special.modified_bessel_k0": _SPECIAL, "special.modified_bessel_k1": _SPECIAL,
    "special.scaled_modified_bessel_k0": _SPECIAL, "special.scaled_modified_bessel_k1": _SPECIAL,
    "pca_lowrank": _LOWRANK, "svd_lowrank": _LOWRANK,
    "_batch_norm_with_update": ("an aten operator (torch.ops.aten), below the Python calls nanpass "
                                "sees: F.batch_norm, the call that reaches it, is guarded"),
}
for _name in ("chebyshev_polynomial_t", "chebyshev_polynomial_u", "chebyshev_polynomial_v",
              "chebyshev_polynomial_w", "shifted_chebyshev_polynomial_t",
              "shifted_chebyshev_polynomial_u", "shifted_chebyshev_polynomial_v",
              "shifted_chebyshev_polynomial_w", "hermite_polynomial_h", "hermite_polynomial_he",
              "laguerre_polynomial_l", "legendre_polynomial_p"):
    ACCEPTED["special." + _name] = _POLY
for _name in ("cumprod", "logaddexp", "norm", "normalize", "std"):
    ACCEPTED["masked." + _name] = _MASKED

OVERFLOW_POLICY = ("non-finite only from huge operands (+-sqrt(max), +-max): a finite result "
                   "past max, saturation of ordinary arithmetic, out of op-guard scope")
POLICY_STATUS = "accepted: overflow policy"  # the status cell of an op accepted by OVERFLOW_POLICY

# not probed at all: their output is not a function of the operand values
SKIP = {
    "empty": "uninitialised memory", "empty_like": "uninitialised memory",
    "empty_strided": "uninitialised memory", "empty_permuted": "uninitialised memory",
    "new_empty": "uninitialised memory", "new_empty_strided": "uninitialised memory",
    "resize_": "uninitialised memory", "resize_as_": "uninitialised memory",
}

LINALG = {"det", "logdet", "slogdet", "inverse", "pinverse", "cholesky", "cholesky_inverse",
          "cholesky_solve", "svd", "svd_lowrank", "pca_lowrank", "lu", "lu_solve", "lu_unpack",
          "qr", "geqrf", "ormqr", "triangular_solve", "matrix_exp", "trace", "cdist", "cov",
          "corrcoef", "kron", "nn.functional.pdist"}


# --------------------------------------------------------------------------------------------
# values
# --------------------------------------------------------------------------------------------
def value_table(dtype: torch.dtype) -> list[tuple[str, float, int]]:
    """(label, value, tier index) of the extremal finite values, in ``dtype``."""
    fi = torch.finfo(dtype)
    big = float(math.floor(2 * math.log(fi.max)))
    rows = [("0", 0.0, 0), ("-0", -0.0, 0), ("tiny", fi.tiny, 0), ("-tiny", -fi.tiny, 0),
            ("eps", fi.eps, 0), ("-eps", -fi.eps, 0), ("0.5", 0.5, 0), ("-0.5", -0.5, 0),
            ("1", 1.0, 0), ("-1", -1.0, 0), ("2", 2.0, 0), ("-2", -2.0, 0),
            (f"{big:g}", big, 1), (f"-{big:g}", -big, 1),
            ("sqrt(max)", math.sqrt(fi.max), 2), ("-sqrt(max)", -math.sqrt(fi.max), 2),
            ("max", fi.max, 2), ("-max", -fi.max, 2)]
    return rows


MAX_NUMEL = 4096  # samples with more float elements are skipped (the smallest is kept if none fit)
CROSS = ("0", "tiny", "1", "-1", "-2", "big")  # first operand / other operands pairs (big: +big)


# --------------------------------------------------------------------------------------------
# probes
# --------------------------------------------------------------------------------------------
@dataclass
class Probe:
    """One set of operand values for one sample: a rebuild of the sample's float leaves."""

    desc: str  # how the values were set (for the example)
    leaves: list  # new float tensors, in the order of the sample's float leaves
    tier: int  # tier of the whole probe (generic probes)
    elem_tiers: torch.Tensor | None = None  # per element (elementwise probes)
    elem_desc: list | None = None  # per element: the operand labels


@dataclass
class Finding:
    tier: int
    example: str


@dataclass
class OpResult:
    id: str
    name: str
    probed: dict = field(default_factory=dict)  # dtype -> number of probes run
    errors: dict = field(default_factory=dict)  # dtype -> number of probes whose forward raised
    grad_errors: dict = field(default_factory=dict)  # dtype -> probes whose (double) backward raised
    first_error: str = ""
    found: dict = field(default_factory=dict)  # dtype -> phase -> Finding
    seconds: float = 0.0
    truncated: bool = False
    skipped: str = ""
    status: str = ""
    detail: str = ""
    verified: str = ""
    verify_example: str = ""
    verify_tier: int | None = None  # mildest tier still non-finite under nanpass.harden
    crashed: list = field(default_factory=list)  # probes that killed the process (isolate=True)
    bad_probes: set = field(default_factory=set)  # (dtype, sample, probe) that gave a non-finite

    @property
    def tier(self) -> int | None:
        tiers = [f.tier for ph in self.found.values() for f in ph.values()]
        return min(tiers) if tiers else None


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _float_outputs(out) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(out)
    return [t if t.layout == torch.strided else t.to_dense() for t in leaves
            if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())]


def _bad(tensors, n: int | None) -> torch.Tensor:
    """Non-finite mask: per element (length n) for elementwise probes, else one bool."""
    if n is None:
        bad = False
        for t in tensors:
            if t is not None and not bool(torch.isfinite(t).all()):
                bad = True
        return torch.tensor([bad])
    mask = torch.zeros(n, dtype=torch.bool)
    for t in tensors:
        if t is None:
            continue
        fin = torch.isfinite(t.detach())
        if fin.numel() == n:
            mask |= ~fin.reshape(-1)
        elif not bool(fin.all()):
            mask[:] = True
    return mask


def _fmt(x: torch.Tensor) -> str:
    v = x.item() if x.numel() == 1 else x.reshape(-1)[0].item()
    if isinstance(v, complex):
        return f"{v}"
    return "nan" if math.isnan(v) else ("inf" if v == math.inf else ("-inf" if v == -math.inf else f"{v:.4g}"))


def run_probe(fn, sample, spec, probe: Probe, phases: int, n: int | None):
    """Run one probe; per phase the non-finite mask (None where the phase did not run).

    Returns (masks, outputs, error): outputs[phase] the tensors checked, for examples."""
    flat, spec_tree = spec
    leaves = list(flat)
    it = iter(probe.leaves)
    for i, x in enumerate(leaves):
        if _is_float(x):
            leaves[i] = next(it)
    inp, args, kwargs = tree_unflatten(leaves, spec_tree)
    masks = [None, None, None]
    outs = [None, None, None]
    try:
        out = fn(inp, *args, **kwargs)
        fouts = _float_outputs(out)
        masks[0] = _bad(fouts, n)
    except Exception as e:  # noqa: BLE001 - an op that raises is an error, not a NaN
        return masks, outs, f"forward: {type(e).__name__}: {str(e)[:120]}"
    outs[0] = fouts
    if phases < 2 or bool(masks[0].all()):
        return masks, outs, None
    diff_in = [t for t in probe.leaves if t.requires_grad]
    if not diff_in:
        return masks, outs, None
    try:
        gout = sample.output_process_fn_grad(out)
        gouts = [t for t in _float_outputs(gout) if t.requires_grad]
        if not gouts:
            return masks, outs, None
        grads = torch.autograd.grad(gouts, diff_in, [torch.ones_like(t) for t in gouts],
                                    allow_unused=True, create_graph=phases >= 3)
        masks[1] = _bad(grads, n) & ~masks[0]
    except Exception as e:  # noqa: BLE001
        return masks, outs, f"backward: {type(e).__name__}: {str(e)[:120]}"
    outs[1] = [g for g in grads if g is not None]
    if phases < 3 or bool((masks[0] | masks[1]).all()):
        return masks, outs, None
    pairs = [(g, x) for g, x in zip(grads, diff_in, strict=True) if g is not None and g.requires_grad]
    if not pairs:
        return masks, outs, None
    try:
        gg = torch.autograd.grad([g for g, _ in pairs], diff_in,
                                 [torch.ones_like(g) for g, _ in pairs], allow_unused=True)
        masks[2] = _bad(gg, n) & ~masks[0] & ~masks[1]
    except Exception as e:  # noqa: BLE001
        return masks, outs, f"double backward: {type(e).__name__}: {str(e)[:120]}"
    outs[2] = [g for g in gg if g is not None]
    return masks, outs, None


def _new_leaf(like: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    fmax = torch.finfo(like.dtype).max  # a leaf of another float dtype than the probe's
    t = values.to(torch.float64).clamp(-fmax, fmax).to(like.dtype).detach().clone()
    return t.requires_grad_(like.requires_grad)


def _fill(like: torch.Tensor, v: float) -> torch.Tensor:
    return _new_leaf(like, torch.full(like.shape, v, dtype=torch.float64))


def _matrix(like: torch.Tensor, kind: str, tiny: float) -> torch.Tensor:
    if like.ndim < 2:
        return _fill(like, 1.0)
    m, n = like.shape[-2:]
    e = torch.eye(m, n, dtype=like.dtype)
    k = min(m, n)
    if k and kind == "singular":
        e[k - 1, k - 1] = 0
    elif k and kind == "near-singular":
        e[k - 1, k - 1] = tiny
    return _new_leaf(like, e.expand(like.shape).contiguous())


def _shapes(floats) -> str:
    return ", ".join(str(tuple(t.shape)) for t in floats)


def generic_probes(floats, dtype, linalg: bool, seed: int):
    table = value_table(dtype)
    lab = {label: (v, tier) for label, v, tier in table}
    big = table[12][0]
    for label, v, tier in table:
        yield Probe(f"every float operand = {label}", [_fill(t, v) for t in floats], tier)
    if len(floats) >= 2:
        for a, b in itertools.permutations(CROSS, 2):
            a_, b_ = (big if a == "big" else a), (big if b == "big" else b)
            (va, ta), (vb, tb) = lab[a_], lab[b_]
            yield Probe(f"first float operand = {a_}, the others = {b_}",
                        [_fill(t, va if i == 0 else vb) for i, t in enumerate(floats)], max(ta, tb))
    g = torch.Generator().manual_seed(seed)
    for tier, reps in ((0, 2), (1, 1), (2, 1)):
        vals = torch.tensor([v for _, v, t in table if t <= tier], dtype=torch.float64)
        for r in range(reps):
            leaves = []
            for t in floats:
                idx = torch.randint(len(vals), t.shape, generator=g)
                leaves.append(_new_leaf(t, vals[idx]))
            yield Probe(f"float operands drawn at random from the {TIERS[tier]} values"
                        f"{' and below' if tier else ''} (draw {r + 1})", leaves, tier)
    if linalg:
        tiny = torch.finfo(dtype).tiny
        for kind, what in (("identity", "identity (repeated eigen/singular values)"),
                           ("singular", "singular (identity with a 0 last pivot)"),
                           ("near-singular", "near-singular (identity with a tiny last pivot)")):
            yield Probe(f"matrices = {what}, other float operands = 1",
                        [_matrix(t, kind, tiny) for t in floats], 0)


def elementwise_probe(floats, dtype):
    """All values (unary) or all value pairs (binary) as one 1-D probe."""
    table = value_table(dtype)
    vals = torch.tensor([v for _, v, _ in table], dtype=torch.float64)
    tiers = torch.tensor([t for _, _, t in table])
    labels = [label for label, _, _ in table]
    k = len(table)
    if len(floats) == 1:
        return Probe("elementwise", [_new_leaf(floats[0], vals)], 2, tiers,
                     [(labels[i],) for i in range(k)])
    ia = torch.arange(k).repeat_interleave(k)
    ib = torch.arange(k).repeat(k)
    return Probe("elementwise", [_new_leaf(floats[0], vals[ia]), _new_leaf(floats[1], vals[ib])], 2,
                 torch.maximum(tiers[ia], tiers[ib]),
                 [(labels[a], labels[b]) for a, b in zip(ia.tolist(), ib.tolist(), strict=True)])


# --------------------------------------------------------------------------------------------
# one op
# --------------------------------------------------------------------------------------------
def op_id(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _elementwise_kind(op) -> bool:
    from torch.testing._internal.opinfo.core import BinaryUfuncInfo, UnaryUfuncInfo

    return isinstance(getattr(op, "_op", op), (UnaryUfuncInfo, BinaryUfuncInfo))


def probe_op(op, dtypes, samples: int = 5, budget: float = 20.0, seed: int = 0,
             on_probe=None, skip=frozenset(), only=None) -> OpResult:
    res = OpResult(op_id(op), op.name)
    if op.name in SKIP:
        res.skipped = SKIP[op.name]
        return res
    supported = op.supported_dtypes("cpu")
    todo = [d for d in dtypes if DTYPES[d] in supported]
    if not todo:
        res.skipped = "no requested floating dtype on CPU"
        return res
    t0 = time.perf_counter()
    fn = _wrapped(op)
    linalg = op.name.startswith("linalg.") or op.name in LINALG
    any_float = False
    for dname in todo:
        dtype = DTYPES[dname]
        bwd = op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
        phases = 1 + bwd + (bwd and op.supports_gradgrad)
        torch.manual_seed(seed)
        res.probed[dname] = 0
        res.errors[dname] = 0
        found = res.found.setdefault(dname, {})
        try:
            it = op.sample_inputs("cpu", dtype, requires_grad=bool(bwd))
            picked, spare = [], None
            for s in itertools.islice(it, 64):
                if _nonsense(s, op.name):
                    continue
                numel = sum(t.numel() for t in tree_flatten((s.input, s.args, s.kwargs))[0] if _is_float(t))
                if 0 < numel <= MAX_NUMEL:
                    picked.append(s)
                elif numel and (spare is None or numel < spare[0]):
                    spare = (numel, s)
                if len(picked) == samples:
                    break
            if not picked and spare is not None:
                picked = [spare[1]]
        except Exception as e:  # noqa: BLE001
            res.first_error = res.first_error or f"sample_inputs: {type(e).__name__}: {str(e)[:120]}"
            res.errors[dname] += 1
            continue
        for si, sample in enumerate(picked):
            flat, tree = tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))
            floats = [x for x in flat if _is_float(x)]
            if not floats:
                continue
            any_float = True

            ctx = _Ctx(op, fn, sample, flat, tree, phases, dname, si, found, t0, budget, skip,
                       only, on_probe)
            if _elementwise_kind(op) and len(floats) <= 2 and _is_float(flat[0]):
                p = elementwise_probe(floats, dtype)
                err = _run_one(res, ctx, p, p.elem_tiers.numel(), fallback=True)
                if err is None or not err.startswith("forward"):
                    if err == "budget":
                        break
                    continue
            for p in _safe_iter(generic_probes(floats, dtype, linalg, seed + si), res):
                if _run_one(res, ctx, p, None, fallback=False) == "budget":
                    break
            if res.truncated:
                break
        if not found:
            del res.found[dname]
    if not any_float and not res.found:
        res.skipped = res.skipped or ("no floating-point tensor operand in its samples"
                                      if not res.first_error else "")
    res.seconds = time.perf_counter() - t0
    return res


@dataclass
class _Ctx:
    """What one probe of one sample of one op needs."""

    op: object
    fn: object
    sample: object
    flat: list
    tree: object
    phases: int
    dname: str
    si: int
    found: dict
    t0: float
    budget: float
    skip: frozenset
    only: set | None
    on_probe: object


def _run_one(res: OpResult, c: _Ctx, p: Probe, n: int | None, fallback: bool) -> str | None:
    """Run probe p; the error text, or "budget" when the op's time is up."""
    if time.perf_counter() - c.t0 > c.budget:
        res.truncated = True
        return "budget"
    key = (c.dname, c.si, p.desc)
    if key in c.skip or (c.only is not None and key not in c.only):
        return None  # it crashed the process before / not asked for
    if c.on_probe is not None:
        c.on_probe(c.dname, c.si, p.desc)
    masks, outs, err = run_probe(c.fn, c.sample, (c.flat, c.tree), p, c.phases, n)
    if fallback and err is not None and err.startswith("forward"):
        return err  # the elementwise layout does not fit: the generic probes run
    res.probed[c.dname] += 1
    if err is not None:
        if err.startswith("forward"):
            res.errors[c.dname] += 1
        else:
            res.grad_errors[c.dname] = res.grad_errors.get(c.dname, 0) + 1
        res.first_error = res.first_error or err
    for ph, mask in enumerate(masks):
        if mask is None or not bool(mask.any()):
            continue
        res.bad_probes.add(key)
        if n is None:
            tier = p.tier
            ex = f"{_call_str(c.op, c.flat, c.tree, None)}, {p.desc} -> " \
                 f"{PHASES[ph]} {_example_value(outs[ph])}"
        else:
            tiers = torch.where(mask, p.elem_tiers, 99)
            tier = int(tiers.min())
            i = int(torch.nonzero(tiers == tier)[0])
            ex = f"{_call_str(c.op, c.flat, c.tree, p.elem_desc[i])} -> " \
                 f"{PHASES[ph]} {_elem_value(outs[ph], i, n)}"
        old = c.found.get(PHASES[ph])
        if old is None or tier < old.tier:
            c.found[PHASES[ph]] = Finding(tier, ex)
    return err


# where an op takes eps positionally (OpInfo's args, after the input)
_EPS_ARG = {"native_layer_norm": 3, "native_group_norm": 6, "native_batch_norm": 6,
            "_native_batch_norm_legit": 6, "_batch_norm_with_update": 5}


def _nonsense(sample, name: str = "") -> bool:
    """Samples that test argument checking, not numerics: a negative ``eps``."""
    eps = sample.kwargs.get("eps")
    i = _EPS_ARG.get(name)
    if i is not None and len(sample.args) > i:
        eps = sample.args[i]
    return isinstance(eps, (int, float)) and not isinstance(eps, bool) and eps < 0


def _safe_iter(probes, res: OpResult):
    try:
        yield from probes
    except Exception as e:  # noqa: BLE001 - building the operands failed
        res.first_error = res.first_error or f"probe: {type(e).__name__}: {str(e)[:120]}"


def _example_value(outs) -> str:
    for t in outs or ():
        bad = ~torch.isfinite(t.detach())
        if bool(bad.any()):
            return _fmt(t.detach()[bad])
    return "?"


def _elem_value(outs, i: int, n: int) -> str:
    for t in outs or ():
        t = t.detach()
        if t.numel() == n:
            v = t.reshape(-1)[i]
            if not bool(torch.isfinite(v)):
                return _fmt(v)
    return _example_value(outs)


def _call_str(op, flat, tree, labels) -> str:
    """The call as written: float operands as their label (elementwise) or T[shape], other
    arguments as given."""
    it = iter(labels or ())
    shown = []
    for x in flat:
        if _is_float(x):
            label = next(it, None)
            shown.append(_Raw(label if label is not None else f"T{list(x.shape)}"))
        elif isinstance(x, torch.Tensor):
            shown.append(_Raw(f"T{list(x.shape)}:{str(x.dtype).removeprefix('torch.')}"
                              if x.numel() != 1 else f"{x.item()!r}"))
        else:
            shown.append(x)
    inp, args, kwargs = tree_unflatten(shown, tree)
    parts = ", ".join([repr(inp), *map(repr, args), *(f"{k}={v!r}" for k, v in kwargs.items())])
    if len(parts) > 120:
        parts = parts[:117].rstrip(", ") + ", ..."
    return f"{op.name}({parts})"


class _Raw(str):
    def __repr__(self) -> str:
        return str(self)


def _wrapped(op):
    wrapper = op.gradcheck_wrapper
    f = op.op

    def fn(inp, *args, **kwargs):
        return wrapper(f, inp, *args, **kwargs)

    return fn


# --------------------------------------------------------------------------------------------
# classification
# --------------------------------------------------------------------------------------------
def callables(op) -> list:
    """The torch callables a user writes for this OpInfo op: the op, its method and in-place
    variants, its operator, its aliases, and what its name resolves to."""
    found = [op.op, op.method_variant, op.inplace_variant]
    for attr in ("operator_variant", "inplace_operator_variant"):
        f = getattr(op, attr, None)
        if f is not None:
            found.append(f)
            dunder = getattr(torch.Tensor, f"__{f.__name__.strip('_')}__", None)
            found.append(dunder)
    for al in op.aliases:
        found += [al.op, al.method_variant, al.inplace_variant]
    name = op.name
    for mod, attr in (("torch", name), ("torch.nn.functional", name.removeprefix("nn.functional."))):
        path = (mod + "." + attr) if mod == "torch" else (mod + "." + attr if name.startswith("nn.functional.") else "")
        if not path:
            continue
        obj = _resolve(path)
        if obj is not None:
            found.append(obj)
    if "." not in name:
        found.append(getattr(torch.Tensor, name, None))
    return [f for f in found if f is not None]


def _resolve(path: str):
    import importlib

    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
            return obj
        except AttributeError:
            return None
    return None


def rules_for(op) -> tuple[list[str], list[str]]:
    """(guarded rule names, rule names that call it safe) of the nanpass rules that intercept
    one of the op's callables."""
    from nanpass._rules import CALLS

    guarded, safe = [], []
    for f in callables(op):
        try:
            hit = CALLS.get(f)
        except TypeError:  # an unhashable callable
            hit = None
        if hit is not None:
            (guarded if hit[0].guarded else safe).append(hit[0].name)
    return list(dict.fromkeys(guarded)), list(dict.fromkeys(safe))


def accepted_reason(op) -> str | None:
    """The ``ACCEPTED`` reason for an OpInfo op (by full id, then by name)."""
    return ACCEPTED.get(op_id(op)) or ACCEPTED.get(op.name)


def classify(op, res: OpResult) -> None:
    if res.tier is None:
        res.status = "finite"
        return
    rules, safe = rules_for(op)
    if rules:
        res.status, res.detail = "guarded", ", ".join(rules)
        return
    reason = accepted_reason(op)
    if reason:
        res.status, res.detail = "accepted", reason
    elif res.tier == 2:
        res.status, res.detail = "accepted", OVERFLOW_POLICY
    else:
        res.status = "UNGUARDED"
        if safe:
            res.detail = f"nanpass rule {', '.join(safe)} calls it safe"


def verify(op, res: OpResult, dtypes, samples: int, seed: int = 0) -> None:
    """For a guarded op: re-run its probes under ``nanpass.harden``; record what stays non-finite."""
    import nanpass

    class Call(torch.nn.Module):
        def __init__(self, f):
            super().__init__()
            self.f = f

        def forward(self, *args, **kwargs):
            return self.f(*args, **kwargs)

    hardened = nanpass.harden(Call(_wrapped(op)))
    again = probe_op(_HardenedOp(op, hardened), [d for d in dtypes if d in res.found], samples,
                     seed=seed, only=res.bad_probes)
    res.verify_tier = again.tier
    if again.tier is None:
        res.verified = "finite under nanpass.harden"
    else:
        left = sorted({f"{d} {ph} ({TIERS[f.tier]})" for d, phs in again.found.items()
                       for ph, f in phs.items()})
        res.verified = "still non-finite under nanpass.harden: " + "; ".join(left)
        res.verify_example = min((f for phs in again.found.values() for f in phs.values()),
                                 key=lambda f: f.tier).example


class _HardenedOp:
    """An OpInfo op whose call goes through a hardened module."""

    def __init__(self, op, hardened):
        self._op = op
        self._hardened = hardened

    def __getattr__(self, name):
        return getattr(self._op, name)

    @property
    def gradcheck_wrapper(self):
        return lambda f, *a, **k: f(*a, **k)

    @property
    def op(self):
        return self._hardened


# --------------------------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------------------------
def status_text(r: OpResult) -> str:
    if r.status == "guarded":
        v = "" if not r.verified else (" (verified finite)" if r.verified.startswith("finite")
                                       else f" ({r.verified})")
        return f"guarded: {r.detail}{v}"
    if r.status == "accepted":
        return POLICY_STATUS if r.detail == OVERFLOW_POLICY else f"accepted: {r.detail}"
    return "UNGUARDED" + (f" ({r.detail})" if r.detail else "")


def render(results: list[OpResult], args, seconds: float) -> str:
    found = [r for r in results if r.tier is not None]
    probed = [r for r in results if not r.skipped and r.probed]
    by = {s: [r for r in found if r.status == s] for s in ("guarded", "accepted", "UNGUARDED")}
    policy = [r for r in by["accepted"] if r.detail == OVERFLOW_POLICY]
    crashes = [r for r in results if r.crashed]
    errors = [r for r in probed if sum(r.errors.values()) and not r.found and
              sum(r.errors.values()) >= sum(r.probed.values())]
    date = datetime.date.today().isoformat()
    cmd = "python benchmarks/census.py" + (f" --out {args.out}" if args.out else "") + \
        (f" --dtypes {','.join(args.dtypes)}" if args.dtypes != list(DTYPES) else "") + \
        (f" --samples {args.samples}" if args.samples != 5 else "") + \
        (f" --ops {','.join(args.ops)}" if args.ops else "")
    tier_order = {"UNGUARDED": 0, "guarded": 1, "accepted": 2}

    def row(r: OpResult) -> str:
        dts = ", ".join(d for d in args.dtypes if d in r.found)
        phases = ", ".join(f"{ph} ({TIERS[min(r.found[d][ph].tier for d in r.found if ph in r.found[d])]})"
                           for ph in PHASES if any(ph in r.found[d] for d in r.found))
        ex = _best_example(r, [d for d in EXAMPLE_ORDER if d in args.dtypes])
        return f"| `{r.id}` | {TIERS[r.tier]} | {dts} | {phases} | {_md(ex)} | {_md(status_text(r))} |"

    lines = [
        "# Census: ops that turn finite operands into NaN/Inf",
        "",
        f"Generated by `{cmd}` on {date} with torch {torch.__version__} (CPU), in "
        f"{seconds / 60:.1f} min; `tests/test_census.py` re-runs a subset and fails on a new "
        "unguarded op. Regenerate with the command above (add `--json census.json` for the raw "
        "data).",
        "",
        "Every op of PyTorch's OpInfo database (`op_db`) with a floating dtype was probed in "
        f"{', '.join(args.dtypes)}: its own `sample_inputs` (first {args.samples} with at most "
        f"{MAX_NUMEL} elements, else the smallest) give valid shapes and arguments, then the floating-point values are "
        "replaced by extremal *finite* values, and the forward, the backward (gradient against an "
        "all-ones upstream) and the double backward (`create_graph=True`) are checked. "
        "Elementwise ops (unary / binary ufuncs) get every value (every pair of values) at once; "
        "other ops get each value everywhere, pairs (first operand / the others), random mixes, "
        "and for linear algebra identity, singular and near-singular matrices. A backward counts "
        "only where the forward was finite, a double backward only where both were. An op whose "
        "probe raises is an error, not a finding. Operands are finite only: +-inf operands are "
        "outside this census's criterion. Examples are written in OpInfo's order (input, *args, "
        "**kwargs), `T[shape]` for a float tensor operand.",
        "",
        "Value tiers (the *tier* column is the mildest that gives a non-finite value):",
        "",
        "- **ordinary**: 0, -0, +-tiny (`finfo.tiny`), +-eps, +-0.5, +-1, +-2; identity, singular and "
        "near-singular matrices.",
        "- **large**: +-floor(2 ln(max)) (177 in float32 / bfloat16, 22 in float16, 1419 in float64): "
        "where exp-like functions overflow.",
        "- **huge**: +-sqrt(max), +-max. The **overflow policy**: an op whose NaN/Inf comes only from "
        f"huge operands is accepted ({OVERFLOW_POLICY}).",
        "",
        "Status: **guarded** (a guarded nanpass rule intercepts one of the op's callables, "
        "`nanpass._rules.CALLS`; the probe is re-run under `nanpass.harden` and what stays "
        "non-finite is shown), **accepted** (a reason in `ACCEPTED` in `benchmarks/census.py`, or the "
        "overflow policy), **UNGUARDED** (neither; listed in `KNOWN_UNGUARDED` in "
        "`tests/test_census.py`).",
        "",
        "## Counts",
        "",
        f"- OpInfo entries: {len(results)}; probed: {len(probed)} (others: no floating dtype or "
        "floating tensor operand on CPU, or skipped as uninitialised memory); every probe raised "
        f"for {len(errors)}.",
        f"- Non-finite from finite operands: **{len(found)}** "
        f"(ordinary {sum(r.tier == 0 for r in found)}, large {sum(r.tier == 1 for r in found)}, "
        f"huge only {sum(r.tier == 2 for r in found)}).",
        f"- Guarded: **{len(by['guarded'])}**; accepted: **{len(by['accepted'])}** "
        f"({len(by['accepted']) - len(policy)} with a reason in `ACCEPTED`, {len(policy)} by the "
        f"overflow policy); UNGUARDED: **{len(by['UNGUARDED'])}**.",
        f"- Crashed the process (segfault) on some probe: {len(crashes)}"
        + (f" ({', '.join(f'`{r.id}`' for r in crashes)}; see the end)." if crashes else "."),
        "",
    ]
    for title, rs in (
        ("UNGUARDED", by["UNGUARDED"]),
        ("Guarded", by["guarded"]),
        ("Accepted with a reason", [r for r in by["accepted"] if r.detail != OVERFLOW_POLICY]),
        ("Accepted by the overflow policy (huge operands only)", policy),
    ):
        lines += [f"## {title} ({len(rs)})", ""]
        if not rs:
            lines += ["None.", ""]
            continue
        lines += ["| op | tier | dtypes | phases (tier) | example | status |", "|---|---|---|---|---|---|"]
        rs = sorted(rs, key=lambda r: (tier_order[r.status], r.tier, r.id))
        lines += [row(r) for r in rs]
        lines.append("")
    crashes = [r for r in results if r.crashed]
    if crashes:
        lines += [f"## Crashed the process ({len(crashes)})", "",
                  "These probes killed the census process (run in a forked child, the probe is then "
                  "skipped and the census goes on): a crash from finite operands, worse than a NaN, "
                  "and out of reach of a guard that runs after the op.", ""]
        lines += [f"- `{r.id}`: " + "; ".join(_md(c) for c in r.crashed) for r in crashes]
        lines.append("")
    if errors:
        lines += [f"## Every probe raised ({len(errors)})", "",
                  "Not counted as findings: " + ", ".join(f"`{r.id}`" for r in sorted(errors, key=lambda r: r.id)), ""]
    return "\n".join(lines)


def _best_example(r: OpResult, order) -> str:
    best = None
    for d in order:
        for ph in PHASES:
            f = r.found.get(d, {}).get(ph)
            if f is not None and (best is None or f.tier < best[0].tier):
                best = (f, d)
    f, d = best
    return f"{d}: {f.example}"


def _md(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def to_json(results: list[OpResult]) -> list[dict]:
    out = []
    for r in results:
        out.append({
            "op": r.id, "status": r.status, "detail": r.detail, "verified": r.verified,
            "tier": TIERS[r.tier] if r.tier is not None else None,
            "found": {d: {ph: {"tier": TIERS[f.tier], "example": f.example} for ph, f in phs.items()}
                      for d, phs in r.found.items()},
            "probes": r.probed, "errors": r.errors, "grad_errors": r.grad_errors,
            "first_error": r.first_error,
            "seconds": round(r.seconds, 3), "truncated": r.truncated, "skipped": r.skipped,
            "crashed": r.crashed,
        })
    return out


# --------------------------------------------------------------------------------------------
def load_ops(names=None):
    from torch.testing._internal.common_methods_invocations import op_db

    ops = [op for op in op_db if any(d.is_floating_point for d in op.supported_dtypes("cpu"))]
    if names:
        want = set(names)
        ops = [op for op in ops if op.name in want or op_id(op) in want]
        missing = want - {op.name for op in ops} - {op_id(op) for op in ops}
        if missing:
            raise SystemExit(f"census: no such OpInfo op: {', '.join(sorted(missing))}")
    return ops


def census_op(op, dtypes, samples=5, budget=20.0, do_verify=True, on_probe=None,
              skip=frozenset()) -> OpResult:
    """Probe, classify and (for a guarded op) verify one op; never raises."""
    try:
        r = probe_op(op, dtypes, samples, budget, on_probe=on_probe, skip=skip)
    except Exception as e:  # noqa: BLE001 - one op never stops the census
        r = OpResult(op_id(op), op.name, first_error=f"census: {type(e).__name__}: {e}"[:160])
    classify(op, r)
    verify_key = ("hardened", -1, "re-run under nanpass.harden")
    if do_verify and r.status == "guarded" and verify_key in skip:
        r.verified = "verification crashed the process"
    elif do_verify and r.status == "guarded":
        if on_probe is not None:
            on_probe(*verify_key)
        t0 = time.perf_counter()
        try:
            verify(op, r, dtypes, samples)
        except Exception as e:  # noqa: BLE001
            r.verified = f"verification raised {type(e).__name__}: {str(e)[:80]}"
        r.seconds += time.perf_counter() - t0
    return r


def census(ops, dtypes, samples=5, budget=20.0, do_verify=True, progress=None,
           isolate=False) -> list[OpResult]:
    """Every op's result. ``isolate``: probe in a forked child, so that an op that crashes the
    process (a segfault) is recorded, its crashing dtype dropped, and the census goes on."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors: threads only contend
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            if isolate and hasattr(os, "fork"):
                return _census_forked(ops, dtypes, samples, budget, do_verify, progress)
            results = []
            for i, op in enumerate(ops):
                results.append(census_op(op, dtypes, samples, budget, do_verify))
                if progress:
                    progress(i, len(ops), results[-1])
            return results
    finally:
        torch.set_num_threads(threads)


def _census_forked(ops, dtypes, samples, budget, do_verify, progress) -> list[OpResult]:
    import pickle
    import signal

    results: list[OpResult | None] = [None] * len(ops)
    crashed: dict[int, dict[tuple, str]] = {}  # op index -> (dtype, sample, probe) -> signal
    start = 0
    while start < len(ops):
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: probe ops[start:], one message per probe and per op
            os.close(rfd)
            out = os.fdopen(wfd, "wb")

            def send(msg, out=out):
                pickle.dump(msg, out)
                out.flush()

            try:
                for j in range(start, len(ops)):
                    res = census_op(ops[j], dtypes, samples, budget, do_verify,
                                    on_probe=lambda d, si, desc, j=j: send(("at", j, d, si, desc)),
                                    skip=frozenset(crashed.get(j, ())))
                    send(("done", j, res))
            finally:
                os._exit(0)
        os.close(wfd)
        at = None
        with os.fdopen(rfd, "rb") as f:
            while True:
                try:
                    msg = pickle.load(f)
                except EOFError:
                    break
                if msg[0] == "at":
                    at = msg[1:]
                    continue
                j, res = msg[1], msg[2]
                res.crashed = [f"{d}, sample {si}, {desc}: {sig}"
                               for (d, si, desc), sig in crashed.get(j, {}).items()]
                results[j] = res
                at = None
                if progress:
                    progress(j, len(ops), res)
        _, status = os.waitpid(pid, 0)
        todo = [j for j, r in enumerate(results) if r is None]
        if not todo:
            break
        why = (signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status)
               else f"exit status {os.WEXITSTATUS(status)}")
        if at is None:  # died outside a probe: give up on the op it was at
            j = todo[0]
            results[j] = OpResult(op_id(ops[j]), ops[j].name, skipped=f"the census process died ({why})")
            start = j + 1
            continue
        j, d, si, desc = at
        crashed.setdefault(j, {})[(d, si, desc)] = why
        start = j
    return results  # type: ignore[return-value]


# --------------------------------------------------------------------------------------------
# zero-size operands (issue 39): a mean over an empty selection
# --------------------------------------------------------------------------------------------
# Why an op's result on zero-size operands may stay non-finite under nanpass.harden or its
# backend. Keyed by OpInfo name or full id, as ACCEPTED.
_EMPTY_POOL = ("a feature map with a spatial size of 0 averaged into an output of size 1: NaN; "
               "convolutions and the other poolings refuse such an input, so a model does not reach "
               "it, and guarding it would intercept every adaptive pooling of a CNN")
EMPTY_ACCEPTED: dict[str, str] = {
    "histogram": "density=True over no sample is 0 / 0: " + _NOT_IN_MODELS,
    "histogramdd": "density=True over no sample is 0 / 0: " + _NOT_IN_MODELS,
    "nn.functional.adaptive_avg_pool1d": _EMPTY_POOL,
    "nn.functional.adaptive_avg_pool2d": _EMPTY_POOL,
    "nn.functional.adaptive_avg_pool3d": _EMPTY_POOL,
    "nn.functional.linear_cross_entropy.chunked": (
        "under the backend only: dynamo traces into F.linear_cross_entropy, whose chunked form "
        "averages with its own sum and division, no guarded call; `nanpass.harden` guards the call"),
}
for _name in ("logsumexp", "mean", "std", "var"):  # dynamo traces them into sums and divisions
    EMPTY_ACCEPTED["masked." + _name] = "under the backend only: " + _MASKED
_GRAPH_BREAK = ("under the backend only: dynamo graph-breaks on it (docs/guards.md), so it runs "
                "outside any graph, eagerly and unguarded; `nanpass.harden` guards it, and so does "
                "`torch.compile(nanpass.harden(model))`")
EMPTY_SECTION = "## Zero-size operands"
EMPTY_CMD = "python benchmarks/census.py --empty --out docs/census.md"
EMPTY_RERUN = "### Re-run of the ops whose case crashed"  # the subsection of an --empty --ops run


@dataclass
class EmptyResult:
    """One op's cases (zero-size operands, or one empty group): the first non-finite result (or
    error where torch ran) under each runner ("torch", "harden", "backend"); empty where all
    was finite."""

    id: str
    name: str
    probed: int = 0
    found: dict = field(default_factory=dict)  # runner -> example
    crashed: list = field(default_factory=list)  # "dtype, sample i, case (runner): SIGNAL", left unprobed
    died: str = ""  # the op's child died outside any case (making its samples): the op is unprobed
    status: str = ""  # finite | guarded | accepted | UNGUARDED
    detail: str = ""
    kind: str = ""  # group census: segment | index | bag | mask | ignore
    done: list = field(default_factory=list)  # (dtype, sample, case) run: where a resumed child starts
    compiled: int = 0  # cases run under the backend (backend_cases counts them)


def empty_variants(sample):
    """(description, (input, args, kwargs)) of a sample cut to no element: every tensor that
    shares the input's leading size cut to 0 there (a batch of no sample), the same for the
    last dim (no feature), and every tensor cut to 0 in every dim."""
    flat, tree = tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))
    x = sample.input
    if not isinstance(x, torch.Tensor) or x.ndim == 0 or x.layout != torch.strided:
        return

    def cut(pred, index):
        out = []
        for t in flat:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                grad = t.requires_grad
                t = (t[index(t)] if t.ndim >= 1 and pred(t) else t).detach().clone()
                t.requires_grad_(grad and t.is_floating_point())
            out.append(t)
        inp, args, kwargs = tree_unflatten(out, tree)
        return inp, tuple(args), kwargs

    n0, nl = x.shape[0], x.shape[-1]
    yield "a leading dim of size 0", cut(lambda t: t.shape[0] == n0, lambda t: slice(0, 0))
    yield "a last dim of size 0", cut(lambda t: t.shape[-1] == nl, lambda t: (..., slice(0, 0)))
    yield "every dim of size 0", cut(lambda t: True, lambda t: (slice(0, 0),) * t.ndim)


def _empty_check(fn, inp, args, kwargs) -> str | None:
    """The first non-finite value or gradient (against an all-ones upstream; a zero-size
    operand's gradient is zero-size, a non-empty one's must be finite), or None."""
    out = fn(inp, *args, **kwargs)
    outs = _float_outputs(out)
    for t in outs:
        if not bool(torch.isfinite(t).all()):
            return f"forward {_example_value([t])}"
    leaves = [t for t in tree_flatten((inp, args, kwargs))[0]
              if isinstance(t, torch.Tensor) and t.requires_grad]
    gouts = [t for t in outs if t.requires_grad]
    if not leaves or not gouts:
        return None
    grads = torch.autograd.grad(gouts, leaves, [torch.ones_like(t) for t in gouts], allow_unused=True)
    bad = [g for g in grads if g is not None and not bool(torch.isfinite(g).all())]
    return f"backward {_example_value(bad)}" if bad else None


class _Call(torch.nn.Module):
    def __init__(self, f):
        super().__init__()
        self.f = f

    def forward(self, *args, **kwargs):
        return self.f(*args, **kwargs)


EMPTY_SAMPLES = 12  # samples per op and dtype: OpInfo lists a loss's reductions a few samples apart


def _empty_cases(op, dtype, bwd, samples):
    """[(sample index, [(description, operands)])] of the zero-size census: the samples whose
    input has a dim to cut (OpInfo lists 0-d inputs first), the first of each reduction a
    loss's samples name (OpInfo lists 'none' first), then the others in order."""
    every = [s for s in itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=bool(bwd)), 256)
             if isinstance(s.input, torch.Tensor) and s.input.ndim]
    firsts = list({repr(s.kwargs.get("reduction")): s for s in reversed(every)}.values())[::-1]
    picked = (firsts + [s for s in every if not any(s is f for f in firsts)])[:samples]
    out = []
    for si, sample in enumerate(picked):
        try:
            out.append((si, list(empty_variants(sample))))
        except Exception:  # noqa: BLE001 - a sample that cannot be cut (a sparse layout)
            continue
    return out


def _run_cases(op, dtypes, make_cases, samples, backend=True, backend_cases=2, res=None,
               skip=frozenset(), on_case=None, after_case=None, fn=None) -> EmptyResult:
    """Every case ``make_cases(op, dtype, bwd, samples)`` gives, in each dtype: as torch runs
    it, under ``nanpass.harden``, and (float32, the cases torch breaks on, else the first
    ``backend_cases`` of a guarded op) under ``nanpass.backend(inner="aot_eager")``. A case
    torch refuses (it raises) is not a finding; one that harden or the backend breaks where
    torch runs is. ``res``: a result to go on with (after a crash), ``skip``: the cases
    (dtype, sample, description) not to run, ``on_case(key)`` before and ``after_case(res)``
    after each case (``_isolated`` reports through them). ``fn``: the call (OpInfo's, by
    default)."""
    import nanpass

    res = res if res is not None else EmptyResult(op_id(op), op.name)
    if op.name in SKIP:
        return res
    fn = fn or _wrapped(op)
    hardened = nanpass.harden(_Call(fn))
    guarded = bool(rules_for(op)[0])
    for dname in dtypes:
        dtype = DTYPES[dname]
        if dtype not in op.supported_dtypes("cpu"):
            continue
        bwd = op.supports_autograd and dtype in op.supported_backward_dtypes("cpu")
        torch.manual_seed(0)  # the same samples in a child that goes on after a crash
        try:
            picked = make_cases(op, dtype, bwd, samples)
        except Exception:  # noqa: BLE001 - no samples: nothing to probe
            continue
        for si, cases in picked:
            for desc, (inp, args, kwargs) in cases:
                key = (dname, si, desc)
                if key in skip:
                    continue
                if on_case is not None:
                    on_case(key)
                _run_case(res, op, fn, hardened, guarded, dname, dtypes, desc, inp, args, kwargs,
                          backend, backend_cases)
                res.done.append(key)
                if after_case is not None:
                    after_case(res)
    return res


def _run_case(res, op, fn, hardened, guarded, dname, dtypes, desc, inp, args, kwargs, backend,
              backend_cases) -> None:
    import nanpass

    call = f"{_call_str(op, *tree_flatten((inp, args, kwargs)), None)}, {desc}"
    try:
        bad = _empty_check(fn, inp, args, kwargs)
    except Exception:  # noqa: BLE001 - torch refuses these operands
        return
    res.probed += 1
    if bad:
        res.found.setdefault("torch", f"{dname}: {call} -> {bad}")
    runners = [("harden", hardened)]
    if backend and dname == dtypes[0] and (bad or (guarded and res.compiled < backend_cases)):
        res.compiled += 1
        torch._dynamo.reset()
        runners.append(("backend", torch.compile(_Call(fn), backend=nanpass.backend(inner="aot_eager"))))
    for runner, f in runners:
        try:
            worse = _empty_check(f, inp, args, kwargs)
        except Exception as e:  # noqa: BLE001 - torch ran it: an error is a finding
            worse = f"raised {type(e).__name__}: {str(e).splitlines()[0][:100]}"
            if runner == "backend" and _plain_compile_raises(fn, inp, args, kwargs):
                worse = None  # torch's own: the plain op does not compile either
        if worse:
            res.found.setdefault(runner, f"{dname}: {call} -> {worse}")


def empty_op(op, dtypes, samples: int = EMPTY_SAMPLES, backend: bool = True,
             backend_cases: int = 2, **resume) -> EmptyResult:
    """Every sample of ``op`` cut to no element (``empty_variants``), in each dtype, through
    ``_run_cases``."""
    return _run_cases(op, dtypes, _empty_cases, samples, backend, backend_cases, **resume)


def _plain_compile_raises(fn, inp, args, kwargs) -> bool:
    """Whether ``torch.compile(backend="aot_eager")`` of the plain op raises on these operands
    (linalg.vector_norm's meta function refuses an inf norm next to an empty dim)."""
    torch._dynamo.reset()
    try:
        _empty_check(torch.compile(_Call(fn), backend="aot_eager"), inp, args, kwargs)
    except Exception:  # noqa: BLE001
        return True
    return False


def _breaks_in_dynamo(rules) -> bool:
    """A rule that intercepts the op says dynamo graph-breaks on it (``Sample.dynamo``)."""
    from nanpass._rules import BY_NAME

    return any(BY_NAME[r].sample is not None and not BY_NAME[r].sample.dynamo for r in rules)


def empty_accepted_reason(op, harden_finite: bool = True) -> str | None:
    """Why ``op`` may stay non-finite on zero-size operands: ``EMPTY_ACCEPTED``, or (when
    harden is finite there) the graph break of the rule that guards it."""
    reason = EMPTY_ACCEPTED.get(op_id(op)) or EMPTY_ACCEPTED.get(op.name)
    if reason is None and harden_finite and _breaks_in_dynamo(rules_for(op)[0]):
        reason = _GRAPH_BREAK
    return reason


def classify_empty(op, res: EmptyResult, accepted=None) -> None:
    """finite / guarded / accepted (``accepted(op, harden_finite)``: empty_accepted_reason by
    default) / UNGUARDED."""
    accepted = accepted or empty_accepted_reason
    if not res.found:
        res.status = "finite"
        return
    rules = rules_for(op)[0]
    if "harden" not in res.found and "backend" not in res.found:
        res.status, res.detail = "guarded", ", ".join(rules) or "-"
        return
    reason = accepted(op, "harden" not in res.found)
    if reason:
        res.status, res.detail = "accepted", reason
    else:
        res.status = "UNGUARDED"
        res.detail = "; ".join(f"{k}: {v}" for k, v in res.found.items() if k != "torch")


def _signal_name(status: int) -> str:
    import signal

    return (signal.Signals(os.WTERMSIG(status)).name if os.WIFSIGNALED(status)
            else f"exit status {os.WEXITSTATUS(status)}")


def _isolated(op, run, res: EmptyResult) -> EmptyResult:
    """``run(op, res=, skip=, on_case=, after_case=)`` in a forked child, one case at a time
    reported back: a case that crashes the process (``_segment_reduce.lengths`` on a zero-size
    operand: SIGSEGV) is recorded in ``res.crashed`` and left unprobed, and a new child goes on
    with the op's other cases."""
    import pickle

    crashed: dict[tuple, str] = {}
    while True:
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: the op's cases not yet run, one message each
            import faulthandler

            faulthandler.disable()  # a crash is recorded here, its signal is the report
            os.close(rfd)
            out = os.fdopen(wfd, "wb")

            def send(msg, out=out):
                pickle.dump(msg, out)
                out.flush()

            try:
                r = run(op, res=res, skip=frozenset(res.done) | frozenset(crashed),
                        on_case=lambda key: send(("at", key)),
                        after_case=lambda r: send(("case", r)))
                send(("done", r))
            finally:
                os._exit(0)
        os.close(wfd)
        at, final = None, None
        with os.fdopen(rfd, "rb") as f:
            while True:
                try:
                    msg = pickle.load(f)
                except (EOFError, pickle.UnpicklingError):
                    break
                if msg[0] == "at":
                    at = msg[1]
                elif msg[0] == "case":
                    res, at = msg[1], None
                else:
                    final = msg[1]
        _, status = os.waitpid(pid, 0)
        if final is not None:
            res = final
            break
        why = _signal_name(status)
        if at is None or at in crashed:  # died outside a case: the rest of the op is unprobed
            res.died = why
            break
        crashed[at] = why
    res.crashed = [f"{d}, sample {si}, {desc}: {why}" for (d, si, desc), why in crashed.items()]
    return res


def _case_census(ops, run, progress=None, isolate=True, classify=classify_empty,
                 fresh=None) -> list[EmptyResult]:
    """``run(op, res=, skip=, on_case=, after_case=)`` for every op; ``isolate``: each op in
    forked children, a child per crash (``_isolated``), so that a case that crashes the process
    is recorded and the op's other cases, and the census, go on."""
    import nanpass

    fresh = fresh or (lambda op: EmptyResult(op_id(op), op.name))
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            nanpass.harden(_Call(torch.mean))(torch.zeros(0))  # imported once, not in each child
            for i, op in enumerate(ops):
                if isolate and hasattr(os, "fork"):
                    r = _isolated(op, run, fresh(op))
                else:
                    r = run(op, res=fresh(op))
                classify(op, r)
                results.append(r)
                if progress:
                    progress(i, len(ops), r)
    finally:
        torch.set_num_threads(threads)
    return results


def empty_census(ops, dtypes, samples=EMPTY_SAMPLES, backend=True, progress=None,
                 isolate=True) -> list[EmptyResult]:
    """Every op on zero-size operands; ``isolate``: each case that crashes the process
    (native_batch_norm divides by zero in C++ on an empty batch: SIGFPE) is recorded, the
    op's other cases and the census go on."""

    def run(op, **resume):
        return empty_op(op, dtypes, samples, backend, **resume)

    return _case_census(ops, run, progress, isolate)


def _crash_lines(results) -> list[str]:
    """One bullet per op whose case crashed the process: each crashed case (left unprobed)."""
    out = []
    for r in results:
        if r.crashed or r.died:
            what = "; ".join(_md(c) for c in r.crashed)
            if r.died:
                what += ("; " if what else "") + f"died outside any case ({r.died}): the op is unprobed"
            out.append(f"  - `{r.id}` ({r.probed} cases probed): {what}")
    return out


def render_empty(results: list[EmptyResult], dtypes, seconds: float, ops=None) -> str:
    found = sorted((r for r in results if r.found), key=lambda r: ({"UNGUARDED": 0, "guarded": 1,
                                                                    "accepted": 2}[r.status], r.id))
    crashes = _crash_lines(results)
    cmd = EMPTY_CMD + (f" --ops {','.join(ops)}" if ops else "")
    lines = [
        EMPTY_SECTION if not ops else EMPTY_RERUN,
        "",
        f"Generated by `{cmd}` (this {'section' if not ops else 'subsection'} only) with torch "
        f"{torch.__version__} (CPU), in {seconds / 60:.1f} min; `tests/test_census.py` re-runs a subset. "
        + (f"A re-run of {len(ops)} ops only (those whose case crashed the process), each crashing case "
           "now alone in a forked child: it supersedes the crash bullet above for these ops (the "
           "full run takes about 20 min)." if ops else
           "A mean over an empty "
           "selection (a masked loss with no valid element) is 0 / 0 = NaN, and OpInfo's samples are "
           "never empty, so the census above cannot see it. Here every sample of every op (the first "
           f"{EMPTY_SAMPLES} with an input of a dim or more, in {', '.join(dtypes)}) is cut to no element: each tensor sharing the input's leading "
           "size cut to 0 there, the same for the last dim, and every dim of every tensor. " + _RUNNERS_TEXT
           + " Status: **guarded** (finite under harden and the backend), "
           "**accepted** (a reason in `EMPTY_ACCEPTED` in `benchmarks/census.py`), **UNGUARDED** "
           "(neither: `tests/test_census.py` fails)."),
        "",
        f"- Ops probed on zero-size operands: {sum(1 for r in results if r.probed)}; non-finite as "
        f"torch runs them: **{sum('torch' in r.found for r in results)}**; guarded "
        f"{sum(r.status == 'guarded' for r in results)}, accepted "
        f"{sum(r.status == 'accepted' for r in results)}, UNGUARDED "
        f"{sum(r.status == 'UNGUARDED' for r in results)}.",
        "- " + _CRASH_TEXT + (":" if crashes else ": none."),
        *crashes,
        "",
    ]
    lines += _findings_table(found)
    return "\n".join(lines)


_RUNNERS_TEXT = (
    "Each case runs as torch runs it, under `nanpass.harden`, and (float32: every case torch breaks "
    "on, and the first two of each guarded op) under `nanpass.backend(inner=\"aot_eager\")`. A value "
    "or gradient (against an all-ones upstream: a zero-size operand's gradient is zero-size, a "
    "weight's must be finite) that is not finite is a finding; a case torch refuses (it raises) is "
    "not.")
_CRASH_TEXT = ("Cases that crashed the process (torch's kernel, out of reach of a guard that runs "
               "the op; each ran alone in a forked child and is left unprobed, the op's other cases "
               "ran)")


def _findings_table(found) -> list[str]:
    if not found:
        return []
    lines = ["| op | as torch runs it | status |", "|---|---|---|"]
    for r in found:
        status = {"guarded": f"guarded: {r.detail} (finite under harden and the backend)",
                  "accepted": f"accepted: {r.detail}",
                  "UNGUARDED": f"UNGUARDED ({r.detail})"}[r.status]
        ex = r.found.get("torch", "finite (" + "; ".join(f"{k}: {v}" for k, v in r.found.items()) + ")")
        if r.status == "accepted":
            ex += "; " + "; ".join(f"{k}: {v}" for k, v in r.found.items() if k != "torch")
        lines.append(f"| `{r.id}` | {_md(ex)} | {_md(status)} |")
    lines.append("")
    return lines


def write_section(path: str, text: str, heading: str, before: str = "## Real bugs beyond the census",
                  level: str = "## ") -> None:
    """Replace (or add, before ``before``) the section of census.md that starts with ``heading``
    (up to the next heading of ``level`` or above)."""
    with open(path) as f:
        doc = f.read()
    start = doc.find(heading + "\n")
    if start >= 0:
        stops = ["\n## "] if level == "## " else ["\n## ", "\n### "]
        ends = [e for e in (doc.find(s, start + len(heading)) for s in stops) if e >= 0]
        end = min(ends) + 1 if ends else len(doc)
        doc = doc[:start] + text + "\n" + doc[end:]
    else:
        at = doc.find(before)
        at = len(doc) if at < 0 else at
        doc = doc[:at] + text + "\n" + doc[at:]
    with open(path, "w") as f:
        f.write(doc)


def write_empty_section(path: str, text: str) -> None:
    """Replace (or add, before the hand-written section) the zero-size section of census.md."""
    write_section(path, text, EMPTY_SECTION)


# --------------------------------------------------------------------------------------------
# empty groups (issue 48): a segment, bag, index slot or masked row with no element
# --------------------------------------------------------------------------------------------
GROUPS_SECTION = "## Empty groups"
GROUPS_CMD = "python benchmarks/census.py --groups --out docs/census.md"
GROUP_SAMPLES = 4  # transformable samples per op and dtype

# how an op's groups are named: a parameter (its signature, or a keyword its samples pass) or
# its name; the first that matches gives its kind
_GROUP_PARAMS = (("lengths", "segment"), ("offsets", "segment"), ("include_self", "index"),
                 ("mask", "mask"), ("input_mask", "mask"), ("other_mask", "mask"),
                 ("attn_mask", "mask"), ("key_padding_mask", "mask"), ("ignore_index", "ignore"))
_INDEX_REDUCTIONS = {"scatter", "scatter_add", "scatter_reduce", "index_add", "index_reduce", "put",
                     "index_put", "_unsafe_masked_index_put_accumulate"}
# names that look like a grouping: every op they match is probed (a kind) or has a reason here
_GROUP_NAMES = re.compile(r"segment|scatter|index_(add|reduce|put)|^put$|embedding_bag|^masked\.|"
                          r"unique|histc|histogram|bincount|^nn\.functional\.(nll_loss|cross_entropy)$")
_COPY = "writes given values at given positions (a copy): no reduction, so no group to empty"
NOT_GROUPS: dict[str, str] = {
    "diagonal_scatter": _COPY, "select_scatter": _COPY, "slice_scatter": _COPY,
    "as_strided_scatter": _COPY, "masked_scatter": _COPY,
    "unique": "groups equal values, returns each value and an integer count: no float reduction",
    "unique_consecutive": "groups equal runs, returns each value and an integer count: no float reduction",
    "histc": "an empty bin is a count of 0 (its all-empty case, density over no sample, is in the "
             "zero-size section)",
    "histogram": "an empty bin is a count of 0 (its all-empty case, density over no sample, is in "
                 "the zero-size section)",
    "histogramdd": "an empty bin is a count of 0 (its all-empty case, density over no sample, is "
                   "in the zero-size section)",
    "bincount": "an empty bin is a count (or a sum of weights) of 0",
}

# Why an op's result on an empty group may stay non-finite under nanpass.harden or its backend.
_MASKED_IDENTITY = ("torch.masked prototype op (not used in models): a fully masked row is the "
                    "reduction of nothing, its identity ({}); torch.masked masks that output out "
                    "(torch.masked._output_mask), and a model writes masked pooling with plain ops "
                    "and a finite fill (sentence-transformers' max pooling fills -1e9); the plain "
                    "ops' empty groups are guarded (softmax of a -inf row, mean, var, logsumexp)")
GROUPS_ACCEPTED: dict[str, str] = {
    "masked.amax": _MASKED_IDENTITY.format("-inf"),
    "masked.amin": _MASKED_IDENTITY.format("+inf"),
    "masked.median": _MASKED_IDENTITY.format("NaN"),
    "index_reduce.prod": "float16 only: the sample's product itself overflows (" + _PRODUCT + "); "
                         "the slot no index hits keeps its input value",
    "scatter_reduce.prod": "float16 only: the sample's product itself overflows (" + _PRODUCT + "); "
                           "the slot no index hits keeps its input value",
}
# finite under nanpass.harden, not under the backend: the reason holds only where harden is finite
_MASKED_TRACED = ("under the backend only: torch.masked prototype op (not used in models); dynamo "
                  "traces its Python into the fill of the masked-out elements and a plain reduction "
                  "of a row with nothing left (a softmax of a -inf row, a sum divided by a count of "
                  "0); `nanpass.harden` guards the call")
GROUPS_BACKEND_ONLY: dict[str, str] = {
    "masked." + _name: _MASKED_TRACED
    for _name in ("log_softmax", "logaddexp", "logsumexp", "mean", "softmax", "softmin", "std", "var",
                  "normalize")
}
GROUPS_BACKEND_ONLY["nn.functional.linear_cross_entropy.chunked"] = (
    "under the backend only: dynamo traces into F.linear_cross_entropy, whose chunked form is a "
    "torch.library custom op that divides by NaN on purpose where no target counts (an opaque "
    "node to the rewrite); `nanpass.harden` guards the call")


def _params(op) -> set[str]:
    """The op's parameter names: its signature's, and the keywords its float32 samples pass."""
    import inspect

    names: set[str] = set()
    try:
        names |= set(inspect.signature(op.op).parameters)
    except (TypeError, ValueError):  # a builtin
        pass
    try:
        for s in itertools.islice(op.sample_inputs("cpu", torch.float32), 64):
            names |= set(s.kwargs)
    except Exception:  # noqa: BLE001
        pass
    return names


def group_kind(op, params=None) -> str | None:
    """segment | bag | index | mask | ignore, or None: how to give ``op`` one empty group."""
    if op.name == "nn.functional.embedding_bag":
        return "bag"
    params = _params(op) if params is None else params
    if op.name in _INDEX_REDUCTIONS:
        return "index"
    for p, kind in _GROUP_PARAMS:
        if p in params:
            return kind
    return None


def group_ops(ops):
    """(ops with a kind, [(op, reason)] of the ops whose name looks like a grouping but that have
    none): every op whose parameters name a group (lengths, offsets, a mask, include_self,
    ignore_index) or whose name is a segment / scatter / index / bag reduction."""
    probed, left = [], []
    for op in ops:
        kind = group_kind(op)
        if kind is not None:
            probed.append((op, kind))
        elif _GROUP_NAMES.search(op.name):
            left.append((op, NOT_GROUPS.get(op_id(op)) or NOT_GROUPS.get(op.name)
                         or "no transform to an empty group (add one, or a reason in NOT_GROUPS)"))
    return probed, left


def _fresh(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


def group_variants(op, kind: str, sample):
    """(description, (input, args, kwargs)) of ``sample`` with one empty group inside its
    otherwise ordinary operands; nothing where this sample cannot hold one."""
    inp, args, kwargs = tree_unflatten(
        [_fresh(x) for x in tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))[0]],
        tree_flatten((sample.input, list(sample.args), dict(sample.kwargs)))[1])
    if kind == "segment":
        for name in ("lengths", "offsets"):
            t = kwargs.get(name)
            if isinstance(t, torch.Tensor):
                front = torch.zeros_like(t[..., :1]) if name == "lengths" else t[..., :1]
                kwargs[name] = torch.cat([front, t], -1)
                desc = ("a segment of length 0 in front" if name == "lengths"
                        else "a repeated first offset (an empty first segment)")
                yield desc, (inp, tuple(args), kwargs)
                if "initial" in kwargs:  # the sample gives the empty segment a value: also without
                    k2 = {k: v for k, v in kwargs.items() if k != "initial"}
                    yield desc + ", no initial=", (inp, tuple(args), k2)
                return
    elif kind == "bag":
        idx, offsets, pad = args[0], kwargs.get("offsets"), kwargs.get("padding_idx")
        if isinstance(offsets, torch.Tensor) and offsets.numel():
            kwargs["offsets"] = torch.cat([offsets[:1], offsets])
            yield "an empty first bag (a repeated offset)", (inp, tuple(args), kwargs)
        elif idx.ndim == 2 and pad is not None:
            args[0] = idx.clone()
            args[0][0] = pad if pad >= 0 else inp.shape[0] + pad
            yield "an empty first bag (every index of its row = padding_idx)", (inp, tuple(args), kwargs)
    elif kind == "index":
        leaves, tree = tree_flatten(args)
        at = next((i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)
                   and not t.is_floating_point() and t.dtype != torch.bool), None)
        if at is None:
            return
        idx = leaves[at]
        vals = torch.unique(idx)
        if vals.numel() < 2:
            return
        k, j = vals[0], vals[1]
        leaves[at] = torch.where(idx == k, j, idx)
        if "include_self" in kwargs:
            kwargs["include_self"] = False
        yield (f"index {int(k)} never hit (mapped to {int(j)})"
               + (", include_self=False" if "include_self" in kwargs else ""),
               (inp, tuple(tree_unflatten(leaves, tree)), kwargs))
    elif kind == "mask":
        yield from _mask_variants(op, inp, args, kwargs)
    elif kind == "ignore":
        at = next((i for i, t in enumerate(args) if isinstance(t, torch.Tensor)
                   and not t.is_floating_point()), None)  # the class-index target
        if at is None:
            return
        ignore = kwargs.get("ignore_index", -100)
        args[at] = torch.full_like(args[at], ignore)
        yield f"every target = ignore_index ({ignore}): no counted target", (inp, tuple(args), kwargs)


def _mask_variants(op, inp, args, kwargs):
    import inspect

    if op.name.startswith("masked.") and isinstance(inp, torch.Tensor):
        if inp.ndim == 0:  # masked out, a 0-d operand is the op's masked-out fill: no group
            return
        sig = inspect.signature(op.op)
        names = [n for n in ("mask", "input_mask", "other_mask") if n in sig.parameters]
        try:
            bound = sig.bind(inp, *args, **kwargs)
        except TypeError:
            return
        bound.apply_defaults()
        dim = bound.arguments.get("dim")
        nd = inp.ndim
        if dim is None or names != ["mask"]:  # a full reduction, or elementwise: the first element
            dims = set(range(nd)) if dim is None and names == ["mask"] else set()
        else:
            dims = {d % max(nd, 1) for d in ((dim,) if isinstance(dim, int) else dim)}
        sel = tuple(slice(None) if d in dims else 0 for d in range(nd))
        for n in names:
            m = kwargs.get(n)
            m = (torch.ones(inp.shape, dtype=torch.bool) if m is None
                 else m.expand(inp.shape).clone())
            m[sel] = False
            kwargs[n] = m
        what = ("every element masked out (dim=None: the only group)" if dims == set(range(nd)) and nd
                else "the first element masked out of every operand" if not dims
                else f"the first row over dim {sorted(dims)} masked out")
        yield what, (inp, tuple(args), kwargs)
        return
    m = kwargs.get("attn_mask")
    if isinstance(m, torch.Tensor):
        m = m.detach().clone()
        hidden = True if "multi_head" in op.name else False  # MHA: True = not attended; SDPA: True = attended
        m[..., 0, :] = hidden if m.dtype == torch.bool else -math.inf
        kwargs["attn_mask"] = m
        yield ("attention mask hides every key from query 0"
               + (" (-inf, as masked_fill writes it)" if m.is_floating_point() else "")), \
            (inp, tuple(args), kwargs)


def _group_cases(kind):
    def make(op, dtype, bwd, samples):
        out = []
        for s in itertools.islice(op.sample_inputs("cpu", dtype, requires_grad=bool(bwd)), 64):
            try:
                cases = list(group_variants(op, kind, s))
            except Exception:  # noqa: BLE001 - a sample this transform does not fit
                continue
            if cases:
                out.append(cases)
        # a group emptied among others first (a masked row, not a reduction of everything)
        out.sort(key=lambda cases: cases[0][0].startswith("every element masked out"))
        return list(enumerate(out[:samples]))

    return make


def groups_op(op, kind: str, dtypes, samples: int = GROUP_SAMPLES, backend: bool = True,
              backend_cases: int = 2, **resume) -> EmptyResult:
    """``op``'s samples with one empty group each (``group_variants``), through ``_run_cases``,
    as a user calls the op (``_user_call``)."""
    return _run_cases(op, dtypes, _group_cases(kind), samples, backend, backend_cases,
                      fn=_user_call(op), **resume)


def _user_call(op):
    """The op as a user calls it: OpInfo's wrapper, except the one of the ``torch.masked`` ops
    (``gradcheck_wrapper_masked_operation``), which zeroes the outputs whose mask is all False:
    exactly the empty groups this census looks at."""
    if getattr(op.gradcheck_wrapper, "__name__", "").startswith("gradcheck_wrapper_masked"):
        return op.op
    return _wrapped(op)


def groups_accepted_reason(op, harden_finite: bool = True) -> str | None:
    """Why ``op`` may stay non-finite on an empty group: ``GROUPS_ACCEPTED``, or (when harden is
    finite there) ``GROUPS_BACKEND_ONLY`` or the graph break of the rule that guards it."""
    reason = GROUPS_ACCEPTED.get(op_id(op)) or GROUPS_ACCEPTED.get(op.name)
    if reason is None and harden_finite:
        reason = GROUPS_BACKEND_ONLY.get(op_id(op)) or GROUPS_BACKEND_ONLY.get(op.name)
    if reason is None and harden_finite and _breaks_in_dynamo(rules_for(op)[0]):
        reason = _GRAPH_BREAK
    return reason


def classify_groups(op, res: EmptyResult) -> None:
    classify_empty(op, res, groups_accepted_reason)


def groups_census(ops, dtypes, samples=GROUP_SAMPLES, backend=True, progress=None, isolate=True,
                  kinds=None):
    """(results, [(op, reason)] left out): every op with a kind (``group_ops``), each case
    that crashes the process in a forked child of its own."""
    if kinds is None:
        probed, left = group_ops(ops)
    else:
        probed, left = [(op, kinds[op_id(op)]) for op in ops], []
    kind_of = {op_id(op): k for op, k in probed}

    def run(op, **resume):
        return groups_op(op, kind_of[op_id(op)], dtypes, samples, backend, **resume)

    def fresh(op):
        return EmptyResult(op_id(op), op.name, kind=kind_of[op_id(op)])

    return _case_census([op for op, _ in probed], run, progress, isolate, classify_groups, fresh), left


def render_groups(results, left, dtypes, seconds: float, ops=None) -> str:
    found = sorted((r for r in results if r.found), key=lambda r: ({"UNGUARDED": 0, "guarded": 1,
                                                                    "accepted": 2}[r.status], r.id))
    crashes = _crash_lines(results)
    cmd = GROUPS_CMD + (f" --ops {','.join(ops)}" if ops else "")
    by_kind: dict[str, list[str]] = {}
    for r in results:
        by_kind.setdefault(r.kind, []).append(f"`{r.id}`" + ("" if r.probed else " (no case)"))
    lines = [
        GROUPS_SECTION,
        "",
        f"Generated by `{cmd}` (this section only) with torch {torch.__version__} (CPU), in "
        f"{seconds / 60:.1f} min; `tests/test_census.py` re-runs a subset. "
        + (f"Restricted to {len(ops)} ops (`--ops`). " if ops else "")
        + "An empty group (an item with no category id: a segment of length 0, alibaba/TorchEasyRec#104; "
        "an empty bag; an output slot no index hits; a masked row with nothing left) is a reduction "
        "of nothing: 0 / 0 or the identity of max/min, +-inf. OpInfo's samples rarely hold one. Here "
        f"the first {GROUP_SAMPLES} samples (in {', '.join(dtypes)}) of every op whose parameters name a "
        "group (`lengths`, `offsets`, `mask`, `attn_mask`, `include_self`, `ignore_index`: from its "
        "signature and its samples' keywords) or whose name is a segment, scatter, index or bag "
        "reduction are each given ONE empty group in otherwise ordinary operands: a segment of "
        "length 0 (or a repeated offset) in front, also without the sample's `initial=`; a "
        "repeated offset in front of an embedding bag (a row of `padding_idx` for 2-D input); one "
        "index value of a scatter/index reduction mapped to another, so that its slot is never "
        "hit, with `include_self=False`; a row over the reduced dims masked out of a `torch.masked` "
        "op (every element for `dim=None`; one element of both masks of `masked.logaddexp`); "
        "every key hidden from one query of an attention mask (-inf in a float mask); every "
        "target of a loss equal to `ignore_index`. " + _RUNNERS_TEXT
        + " Status: **guarded** (finite under harden and the backend), **accepted** (a reason in "
        "`GROUPS_ACCEPTED` in `benchmarks/census.py`), **UNGUARDED** (neither: `tests/test_census.py` fails).",
        "",
        f"- Ops probed with an empty group: {sum(1 for r in results if r.probed)} of {len(results)} "
        f"({', '.join(f'{k} {len(v)}' for k, v in sorted(by_kind.items()))}); non-finite as torch "
        f"runs them: **{sum('torch' in r.found for r in results)}**; guarded "
        f"{sum(r.status == 'guarded' for r in results)}, accepted "
        f"{sum(r.status == 'accepted' for r in results)}, UNGUARDED "
        f"{sum(r.status == 'UNGUARDED' for r in results)}.",
        "- By kind: " + "; ".join(f"{k}: {', '.join(v)}" for k, v in sorted(by_kind.items())) + ".",
        "- Named like a grouping, not probed: " + ("; ".join(f"`{op_id(op)}` ({reason})" for op, reason in left)
                                                   if left else "none") + ".",
        "- " + _CRASH_TEXT + (":" if crashes else ": none."),
        *crashes,
        "",
    ]
    lines += _findings_table(found)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=lambda s: [x for x in s.split(",") if x], default=None,
                    help="OpInfo names or ids (name.variant), comma-separated (default: all)")
    ap.add_argument("--dtypes", type=lambda s: s.split(","), default=list(DTYPES),
                    help="comma-separated, from float16,bfloat16,float32,float64 (default: all four)")
    ap.add_argument("--samples", type=int, default=5, help="sample inputs per op and dtype")
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per op (all dtypes)")
    ap.add_argument("--out", default=None, help="write the markdown census here (docs/census.md)")
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--no-verify", action="store_true", help="skip re-running guarded ops hardened")
    ap.add_argument("--no-isolate", action="store_true",
                    help="probe in this process (a crashing op then ends the census)")
    ap.add_argument("--empty", action="store_true",
                    help="only the zero-size-operand census: write (or replace) its section of --out "
                         "(with --ops: a subsection for the ops re-run)")
    ap.add_argument("--groups", action="store_true",
                    help="only the empty-group census: write (or replace) its section of --out")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    for d in args.dtypes:
        if d not in DTYPES:
            ap.error(f"unknown dtype {d!r}")
    torch.set_num_threads(1)  # before the first parallel region: the census forks
    ops = load_ops(args.ops)
    t0 = time.perf_counter()
    if args.empty or args.groups:
        dtypes = args.dtypes if args.dtypes != list(DTYPES) else ["float32", "float16"]

        def progress_cases(i, n, r):
            if not args.quiet:
                mark = "" if not r.found else f"  {r.status}: {', '.join(r.found)}"
                crash = f"  crashed: {len(r.crashed)}" if r.crashed else ""
                print(f"[{i + 1:3d}/{n}] {r.id:45s} {r.probed:4d} cases{mark}{crash}", flush=True)

        if args.empty:
            samples = args.samples if args.samples != 5 else EMPTY_SAMPLES
            results = empty_census(ops, dtypes, samples, progress=progress_cases,
                                   isolate=not args.no_isolate)
            text = render_empty(results, dtypes, time.perf_counter() - t0, args.ops)
            heading, level = (EMPTY_SECTION, "## ") if not args.ops else (EMPTY_RERUN, "### ")
        else:
            samples = args.samples if args.samples != 5 else GROUP_SAMPLES
            results, left = groups_census(ops, dtypes, samples, progress=progress_cases,
                                          isolate=not args.no_isolate)
            text = render_groups(results, left, dtypes, time.perf_counter() - t0, args.ops)
            heading, level = GROUPS_SECTION, "## "
        if args.out:
            with open(args.out) as f:
                doc = f.read()
            before = "## Real bugs beyond the census"
            if heading == EMPTY_RERUN and GROUPS_SECTION in doc:
                before = GROUPS_SECTION
            write_section(args.out, text, heading, before, level)
        else:
            print(text)
        un = sorted(r.id for r in results if r.status == "UNGUARDED")
        print(f"census --{'empty' if args.empty else 'groups'}: {len(results)} ops; "
              f"UNGUARDED {len(un)}" + (f": {', '.join(un)}" if un else ""))
        return 0

    def progress(i, n, r):
        if args.quiet:
            return
        mark = "" if r.tier is None else f"  {TIERS[r.tier]:8s} {status_text(r)[:70]}"
        print(f"[{i + 1:3d}/{n}] {r.id:45s} {r.seconds:6.2f}s{' (truncated)' if r.truncated else ''}{mark}",
              flush=True)

    results = census(ops, args.dtypes, args.samples, args.budget, not args.no_verify, progress,
                     isolate=not args.no_isolate)
    seconds = time.perf_counter() - t0
    text = render(results, args, seconds)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "dtypes": args.dtypes, "samples": args.samples,
                       "seconds": round(seconds, 1), "ops": to_json(results)}, f, indent=1)
    un = sorted(r.id for r in results if r.status == "UNGUARDED")
    print(f"census: {len(results)} ops in {seconds:.0f} s; non-finite {sum(r.tier is not None for r in results)}; "
          f"guarded {sum(r.status == 'guarded' for r in results)}, accepted "
          f"{sum(r.status == 'accepted' for r in results)}, UNGUARDED {len(un)}")
    if un:
        print("UNGUARDED: " + ", ".join(un))
    return 0


if __name__ == "__main__":
    sys.exit(main())
