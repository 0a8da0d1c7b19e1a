"""``nanpass.certify``: interval analysis of a model's forward for inputs within ranges.

The model runs once on its example inputs, as written (like ``harden``, nothing is traced or
copied), under a ``TorchDispatchMode`` that sees every aten op after autograd and
decomposition. Next to each concrete value the mode keeps a ``Box`` (``_intervals``): for every
element, an interval containing all values that element can take for inputs within ``ranges``,
and whether it may be NaN. Each op the rule table names, and each op that turns finite
operands into inf or NaN, gets a verdict: ``proven_safe`` (its value is finite for every input
in the ranges), ``guarded`` (inside a guard of a ``nanpass.harden`` model), ``unsafe`` (with the
interval that reaches the unsafe domain) or ``unknown`` (the path depends on the data: the
analysis follows the branch the example inputs take).

Soundness rests on three things: every transfer function over-approximates its op in float64,
widened outward by the dtype's rounding; an op without a transfer function gets the full range
and NaN; and a Python branch on a value that is not a constant (``.item()``, ``bool(t)``,
data-dependent shapes) makes the certificate ``unknown`` there. Docs: docs/certify.md.
"""

from __future__ import annotations

import json
import linecache
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from . import _intervals as iv
from ._compat import TorchDispatchMode, op_arguments, op_overload_name, require
from ._errors import ConfigError, NanpassTypeError
from ._guards import HOST_READS
from ._intervals import F64, INF, Box, top_like
from ._rules import BY_NAME

Tensor = torch.Tensor
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NANPASS_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_INTERCEPT = os.path.join(_NANPASS_DIR, "_intercept.py")

PROVEN, GUARDED, UNSAFE, UNKNOWN = "proven_safe", "guarded", "unsafe", "unknown"
_RANK = {PROVEN: 0, GUARDED: 1, UNKNOWN: 2, UNSAFE: 3}

# aten op (overload packet name) -> the rule of the table it belongs to
ATEN_RULES: dict[str, str] = {
    "div": "div", "true_divide": "div", "reciprocal": "reciprocal", "log": "log", "log2": "log2",
    "log10": "log10", "log1p": "log1p", "sqrt": "sqrt", "rsqrt": "rsqrt", "pow": "pow", "float_power": "pow",
    "exp": "exp", "exp2": "exp2", "expm1": "expm1", "_softmax": "softmax", "softmax": "softmax",
    "_log_softmax": "log_softmax", "log_softmax": "log_softmax", "log_sigmoid_forward": "logsigmoid",
    "logsumexp": "logsumexp", "acos": "acos", "asin": "asin", "atanh": "atanh", "logit": "logit",
    "std": "std", "std_mean": "std", "var": "var", "var_mean": "var", "xlogy": "xlogy",
    "nll_loss_forward": "nll_loss", "nll_loss2d_forward": "nll_loss", "kl_div": "kl_div",
    "binary_cross_entropy_with_logits": "binary_cross_entropy_with_logits", "_ctc_loss": "ctc_loss",
    "native_layer_norm": "layer_norm", "linalg_vector_norm": "norm", "norm": "norm",
    "_weight_norm_interface": "weight_norm", "_linalg_eigh": "eigh", "linalg_eigh": "eigh",
    "logdet": "logdet", "_linalg_slogdet": "logdet", "_linalg_det": "logdet", "erfinv": "erfinv",
    "acosh": "acosh", "logaddexp": "logaddexp", "cosh": "cosh", "sinh": "cosh", "lgamma": "lgamma",
    "digamma": "lgamma", "polygamma": "lgamma", "mvlgamma": "lgamma", "atan2": "atan2",
    "remainder": "remainder", "fmod": "remainder", "floor_divide": "remainder", "hypot": "hypot",
    "addcdiv": "addcdiv", "copysign": "copysign", "sinc": "sinc", "igamma": "igamma", "igammac": "igamma",
    "special_ndtri": "ndtri", "special_entr": "entr", "special_xlog1py": "xlog1py", "mish": "mish",
    "soft_margin_loss": "soft_margin_loss", "binary_cross_entropy": "binary_cross_entropy",
    "renorm": "renorm", "native_batch_norm": "batch_norm", "_native_batch_norm_legit": "batch_norm",
    "_native_batch_norm_legit_no_training": "batch_norm", "native_group_norm": "group_norm",
    "_fused_rms_norm": "rms_norm", "linalg_inv_ex": "inv", "_linalg_solve_ex": "inv",
    "linalg_cholesky_ex": "qr", "linalg_qr": "qr", "_linalg_svd": "qr", "linalg_lu_factor_ex": "qr",
    "mm": "matmul", "bmm": "matmul", "addmm": "matmul", "baddbmm": "matmul",
    "_scaled_dot_product_flash_attention_for_cpu": "scaled_dot_product_attention",
    "_scaled_dot_product_efficient_attention": "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention": "scaled_dot_product_attention",
}
ATEN_RULES = {k: v for k, v in ATEN_RULES.items() if v in BY_NAME}

# ops whose transfer function is exact up to the value's own dtype (no rounding to widen for)
_EXACT = {"where", "masked_fill", "clamp", "clip", "clamp_min", "clamp_max", "relu", "hardtanh", "maximum",
          "minimum", "fmax", "fmin", "abs", "neg", "eq", "ne", "lt", "le", "gt", "ge", "isnan", "isinf",
          "isfinite", "logical_not", "bitwise_not", "logical_and", "bitwise_and", "logical_or", "bitwise_or",
          "__and__", "__or__", "nan_to_num", "fill", "zero", "zeros_like", "ones_like", "full_like",
          "new_zeros", "new_ones", "new_full", "scalar_tensor", "zeros", "ones", "full", "arange", "linspace",
          "eye", "tensor", "max", "min", "amax", "amin", "argmax", "argmin", "sign", "sgn", "floor", "ceil",
          "round", "trunc", "_to_copy", "to", "_to_dtype", "type_as", "rand", "rand_like", "uniform", "randn",
          "randn_like", "normal", "exponential", "bernoulli", "native_dropout", "constant_pad_nd",
          "_softmax", "_log_softmax", "softmax", "log_softmax", "native_layer_norm", "sum", "mean", "mm",
          "bmm", "matmul", "dot", "mv", "addmm", "baddbmm", "addbmm", "addmv", "var", "std", "var_mean",
          "std_mean", "cumsum", "prod", "logsumexp",
          "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
          "_scaled_dot_product_attention_math", "scaled_dot_product_attention"}
# composite kernels (several roundings, terms of either sign): the exact result's sign may flip
_COMPOSITE = {"lerp", "addcmul", "addcdiv"}
# the range each kernel keeps by construction (1 / (1 + exp(-x)) <= 1): a widened bound is cut to it
_RANGE = {"sigmoid": (0.0, 1.0), "tanh": (-1.0, 1.0), "erf": (-1.0, 1.0), "erfc": (0.0, 2.0),
          "exp": (0.0, INF), "exp2": (0.0, INF), "expm1": (-1.0, INF), "softplus": (0.0, INF),
          "cosh": (1.0, INF), "hardsigmoid": (0.0, 1.0), "relu6": (0.0, 6.0), "abs": (0.0, INF)}
_TRANSCENDENTAL = {"exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt", "rsqrt", "pow", "float_power",
                   "sigmoid", "tanh", "erf", "erfc", "erfinv", "atan", "asin", "acos", "atanh", "asinh",
                   "acosh", "sinh", "cosh", "softplus", "gelu", "silu", "mish", "logit", "elu",
                   "log_sigmoid_forward", "sin", "cos"}
# Python-level reads of a value: the code branches (or sizes a shape) on the data here
_SCALAR_READS = {"_local_scalar_dense", "is_nonzero", "equal", "allclose", "item"}
_DATA_SHAPES = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                "unique_dim", "nonzero_static", "argwhere"}


@dataclass
class Verdict:
    """One op (one call site: rule or aten op, module, source line) and what is known about it."""

    op: str  # the rule's name (``log``), or the aten op of an overflow (``mul``)
    aten: str  # the aten op the verdict was made on
    verdict: str  # proven_safe | guarded | unsafe | unknown
    operands: str  # the operands' interval summary
    result: str  # the result's interval summary
    reason: str  # why, in words
    module: str = ""
    source: str | None = None
    code: str | None = None
    guard: str = ""  # the rule's guard action: the fix for an unsafe op
    grad: str = ""  # the local derivative: "finite" (proven), "guarded", or "unproven"
    count: int = 1  # calls of this site in the run

    def __str__(self) -> str:
        where = f"{self.module or '<root>'}" + (f" at {self.source}" if self.source else "")
        g = f"; gradient {self.grad}" if self.grad else ""
        return (f"{self.verdict:11} {self.op:18} {where}: operands {self.operands} -> {self.result}"
                f" ({self.reason}{g})")


@dataclass
class Certificate:
    """The result of ``nanpass.certify``: ``proven`` is True when every unsafe op is proven safe
    or guarded, no op can overflow or make NaN from finite operands, and every output is finite,
    for all inputs within ``ranges`` (forward values; see ``Verdict.grad`` for derivatives)."""

    model: str
    ranges: list[str]
    verdicts: list[Verdict]
    outputs: list[str]  # each floating output's interval
    outputs_finite: bool
    nodes: int  # aten ops analysed
    unmodelled: dict[str, int] = field(default_factory=dict)  # ops given the full range, with counts
    seconds: float = 0.0

    @property
    def proven(self) -> bool:
        return self.outputs_finite and all(v.verdict in (PROVEN, GUARDED) for v in self.verdicts)

    def unsafe(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.verdict in (UNSAFE, UNKNOWN)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["proven"] = self.proven
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def __str__(self) -> str:
        head = ("PROVEN: no NaN or Inf for any input in the ranges" if self.proven
                else f"NOT PROVEN: {len(self.unsafe())} op(s) may give NaN/Inf"
                + ("" if self.outputs_finite else "; an output may be non-finite"))
        lines = [f"certificate for {self.model}, inputs {', '.join(self.ranges)}: {head}",
                 f"  {self.nodes} aten ops analysed in {self.seconds * 1000:.0f} ms"]
        for v in sorted(self.verdicts, key=lambda v: -_RANK[v.verdict]):
            lines.append(f"  {v}")
            if v.verdict == UNSAFE and v.guard:
                lines.append(f"{'':15}fix: nanpass.harden guards it ({v.guard})")
        if self.unmodelled:
            lines.append("  not modelled (full range): " + ", ".join(f"{k} x{n}" for k, n in sorted(self.unmodelled.items())))
        lines.append("  outputs: " + ", ".join(self.outputs))
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# ranges


def _is_bound(x) -> bool:
    return isinstance(x, (int, float, Tensor)) and not isinstance(x, bool)


def parse_ranges(ranges, inputs: tuple) -> list:
    """One spec per positional input: (lo, hi), or None (held at the example's value)."""
    choices = ("a (lo, hi) pair for every floating input, 'finite', or a list with one (lo, hi) "
               "pair, 'finite' or None per positional input")
    if ranges is None:
        raise ConfigError(f"nanpass: certify needs ranges=...: {choices}")

    def one(spec, x, explicit: bool):
        if spec is None:
            return None
        if isinstance(spec, str):
            if spec != "finite":
                raise ConfigError(f"nanpass: unknown range {spec!r}; valid: {choices}")
            if isinstance(x, Tensor) and x.is_floating_point():
                mx = float(torch.finfo(x.dtype).max)
                return (torch.tensor(-mx, dtype=F64), torch.tensor(mx, dtype=F64))
            return None
        if not (isinstance(spec, (tuple, list)) and len(spec) == 2 and all(_is_bound(b) for b in spec)):
            raise ConfigError(f"nanpass: bad range {spec!r}; valid: {choices}")
        lo, hi = spec
        lo_t, hi_t = torch.as_tensor(lo, dtype=F64), torch.as_tensor(hi, dtype=F64)
        if bool(torch.isnan(lo_t).any() | torch.isnan(hi_t).any()) or bool((lo_t > hi_t).any()):
            raise ConfigError(f"nanpass: bad range {spec!r}: need lo <= hi, no NaN; valid: {choices}")
        if not isinstance(x, Tensor):
            if explicit:
                raise ConfigError(f"nanpass: a range was given for a {type(x).__name__} input ({x!r}); "
                                  "ranges apply to tensor inputs: give None for it")
            return None
        if not explicit and not x.is_floating_point():
            return None  # one pair for all: floating inputs only
        return (lo_t, hi_t)

    if isinstance(ranges, str) or (isinstance(ranges, (tuple, list)) and len(ranges) == 2
                                   and all(_is_bound(b) for b in ranges)):
        return [one(ranges, x, False) for x in inputs]
    if isinstance(ranges, (tuple, list)):
        if len(ranges) != len(inputs):
            raise ConfigError(f"nanpass: ranges has {len(ranges)} entries for {len(inputs)} positional "
                              f"inputs; valid: {choices}")
        return [one(r, x, True) for r, x in zip(ranges, inputs, strict=True)]
    raise ConfigError(f"nanpass: bad ranges {ranges!r}; valid: {choices}")


def input_box(x: Tensor, spec) -> Box:
    """The box of an input: its range rounded outward into the input's dtype (a float32 input
    of -1e30 is -1.0000000150474662e+30)."""
    lo, hi = (b.to(F64).expand(x.shape).clone() for b in spec)
    if x.is_floating_point():
        lo_d, hi_d = lo.to(x.dtype), hi.to(x.dtype)
        lo_d = torch.where(lo_d.to(F64) > lo, torch.nextafter(lo_d, torch.tensor(-INF, dtype=x.dtype)), lo_d)
        hi_d = torch.where(hi_d.to(F64) < hi, torch.nextafter(hi_d, torch.tensor(INF, dtype=x.dtype)), hi_d)
        lo, hi = lo_d.to(F64), hi_d.to(F64)
    return Box(lo, hi)


def _describe_range(x, spec) -> str:
    if spec is None:
        return "fixed"
    lo, hi = spec
    return f"[{float(lo.min()):.4g}, {float(hi.max()):.4g}]"


# ---------------------------------------------------------------------------------------------
# the analysis


def _float_tensors(obj) -> list[Tensor]:
    out = []
    if isinstance(obj, Tensor):
        if obj.is_floating_point():
            out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            out.extend(_float_tensors(o))
    elif isinstance(obj, dict):
        for o in obj.values():
            out.extend(_float_tensors(o))
    elif hasattr(obj, "to_tuple"):  # transformers ModelOutput
        out.extend(_float_tensors(obj.to_tuple()))
    return out


def _tensors(obj) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _storage(t: Tensor):
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - no storage (a wrapper subclass)
        return None


def _results(func, args, out) -> list[Tensor]:
    """The tensors an op writes: its mutated operands, else its outputs."""
    mutated = [a for a, s in zip(args, op_arguments(func), strict=False)
               if s.alias_info is not None and s.alias_info.is_write and isinstance(a, Tensor)]
    return mutated[:1] if mutated else _tensors(out)


class Recorder(TorchDispatchMode):
    """The concrete values of every op, in the order the analysis records its boxes (tests)."""

    def __init__(self):
        super().__init__()
        self.trace: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.trace.append((func.overloadpacket.__name__, [t.detach().clone() for t in _results(func, args, out)]))
        return out


class Analysis(TorchDispatchMode):
    def __init__(self, root: torch.nn.Module, hardened: bool):
        super().__init__()
        self.env: dict[int, tuple[Tensor, Box]] = {}
        self.sites: dict[tuple, Verdict] = {}
        self.unmodelled: dict[str, int] = {}
        self.nodes = 0
        self.hardened = hardened
        self.paths = {id(m): name for name, m in root.named_modules()}
        self.trace: list | None = None  # (op, boxes of its results) per op, for the tests
        self.taint: dict[int, tuple[Tensor, frozenset]] = {}  # value -> overflow sites it may carry
        self.absorbed: set = set()  # overflow sites a guard saturated
        self.escaped: set = set()  # overflow sites that reached an output or ended outside a guard
        # relations the intervals lose: exp(t) -> (t, h) where it equals exp(t) for t <= h; a
        # clamp(t, max=h) -> (t, h); t > c -> (t, c)
        self.exp_of: dict[int, tuple] = {}
        self.same_below: dict[int, tuple] = {}
        self.gt_of: dict[int, tuple] = {}
        self.cmp_of: dict[int, tuple] = {}  # x <op> c -> (x, op, c): where() refines its branches

    # -- boxes ------------------------------------------------------------------------------
    def box(self, x) -> Box | None:
        if isinstance(x, Tensor):
            e = self.env.get(id(x))
            if e is not None and e[0] is x:
                return e[1]
            return Box.point(x)
        if isinstance(x, bool):
            return Box.point(torch.tensor(float(x), dtype=F64))
        if isinstance(x, (int, float)):
            return Box.point(torch.tensor(float(x), dtype=F64))
        if isinstance(x, complex):
            return top_like(torch.zeros(()))
        if x is None:
            return None
        try:  # a SymInt/SymFloat or other number-like
            return Box.point(torch.tensor(float(x), dtype=F64))
        except Exception:  # noqa: BLE001
            return None

    def set(self, t: Tensor, b: Box) -> None:
        self.env[id(t)] = (t, b)

    # -- where an op comes from ------------------------------------------------------------
    def _where(self):
        """(module path, source "file:line", code, guard state): guard state is None outside a
        guard of a hardened model, else the guarded rule's name."""
        f = sys._getframe(2)
        module = src = None
        guard = None
        while f is not None:
            code = f.f_code
            name = code.co_filename
            if self.hardened and guard is None and name == _INTERCEPT and code.co_name == "_run_for":
                loc = f.f_locals
                decision = loc.get("decision")
                if loc.get("why") is None and decision is not None and decision[0] == "guarded":
                    guard = loc["rule"].name
            elif self.hardened and guard is None and name == _INTERCEPT and code.co_name == "__torch_function__":
                inner = f.f_locals.get("guarded")  # CallsGuarded: a call inside a composite's guard
                if inner is not None:
                    guard = inner.name
            if not name.startswith(_NANPASS_DIR):
                if src is None and not name.startswith(_TORCH_DIR) and not name.startswith("<"):
                    src = f
                if module is None and code.co_argcount and code.co_varnames[0] == "self":
                    obj = f.f_locals.get("self")
                    if isinstance(obj, torch.nn.Module) and id(obj) in self.paths:
                        module = obj
            f = f.f_back
        path = self.paths.get(id(module), "") if module is not None else ""
        if src is None:
            return path, None, None, guard
        line = src.f_lineno
        return path, f"{src.f_code.co_filename}:{line}", linecache.getline(src.f_code.co_filename, line).strip() or None, guard

    def record(self, op, aten, verdict, operands, result, reason, grad=""):
        module, source, code, guard = self._where()
        if guard is not None:
            if verdict == PROVEN and op != guard:
                return  # an ordinary op inside a guard
            op, verdict, reason, grad = guard, GUARDED, f"guarded by nanpass.harden ({BY_NAME[guard].action})", "guarded"
        key = (op, module, source)
        v = self.sites.get(key)
        rule = BY_NAME.get(op)
        guard_action = rule.action if rule is not None and rule.guarded else ""
        if v is None:
            self.sites[key] = Verdict(op, aten, verdict, operands, result, reason, module, source, code,
                                      guard_action, grad)
            return key
        v.count += 1
        if _RANK[verdict] > _RANK[v.verdict]:
            v.verdict, v.aten, v.operands, v.result, v.reason, v.grad = verdict, aten, operands, result, reason, grad
        return key

    # -- one op -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.nodes += 1
        try:
            self.step(func, args, kwargs, out)
        except Exception as e:  # noqa: BLE001 - a transfer function failed: the full range
            name = func.overloadpacket.__name__
            key = f"{name} (failed: {type(e).__name__})"
            self.unmodelled[key] = self.unmodelled.get(key, 0) + 1
            outs = _results(func, args, out)
            for t in outs:
                self.set(t, top_like(t))
            if any(t.is_floating_point() for t in outs):
                self.record(ATEN_RULES.get(name, name), name, UNSAFE, "-", "[-inf, inf] and NaN",
                            f"not modelled (the transfer function failed: {type(e).__name__}): the full range")
        if self.trace is not None:
            self.trace.append((func.overloadpacket.__name__, [self.box(t) for t in _results(func, args, out)]))
        return out

    def step(self, func, args, kwargs, out) -> None:
        name = func.overloadpacket.__name__
        mutated = [a for a, s in zip(args, op_arguments(func), strict=False)
                   if s.alias_info is not None and s.alias_info.is_write and isinstance(a, Tensor)]
        base = name.rstrip("_") if (mutated and name.endswith("_") and not name.startswith("__")) else name
        in_tensors = [a for a in _tensors(list(args) + list(kwargs.values()))]
        in_boxes = [self.box(t) for t in in_tensors]
        if base in _SCALAR_READS:
            if not all(b.is_point() for b in in_boxes):
                self.record("control flow", name, UNKNOWN, "; ".join(b.summary() for b in in_boxes[:2]), "-",
                            "the code reads a value that depends on the inputs (.item(), bool(t), "
                            "a comparison in Python): the analysis follows the branch of the example inputs")
            return
        # an op that writes into buffers besides returning fresh results (batch_norm's running
        # statistics): the results are its outputs, and the buffers may hold any value now
        fresh = [t for t in _tensors(out) if not any(t is m for m in mutated)] if mutated else []
        side = mutated if fresh else []
        if side:
            mutated = []
        outs = _tensors(out) if not mutated else [mutated[0]]
        if not outs:
            return
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        if base in _DATA_SHAPES and not all(b.is_point() for b in in_boxes):
            self.record("data-dependent shape", name, UNKNOWN, in_boxes[0].summary() if in_boxes else "-", "-",
                        "an output shape depends on the input values: the analysis follows the example's")
        if base == "copy" and mutated:
            src = self.box(args[1])
            dst = args[0]
            b = Box(src.lo.expand(dst.shape).clone(), src.hi.expand(dst.shape).clone(), src.nan.expand(dst.shape).clone())
            if dst.is_floating_point() and args[1].is_floating_point() and \
                    torch.finfo(dst.dtype).bits < torch.finfo(args[1].dtype).bits:
                b = iv.widen(b, dst.dtype, k=1)
            elif not dst.is_floating_point():
                b = iv.widen(b, dst.dtype)
            results = [b]
        elif not seeded and all(b.known() for b in in_boxes):
            results = [Box.point(t) for t in outs]  # constants in, the concrete value out: exact
        else:
            results = self.transfer(func, name, base, args, kwargs, out if not mutated else mutated[0])
            if base == "_softmax" and self.hardened and self._where()[3] in ("softmax", "softmin"):
                # the guard (masked_rows) moved every all -inf row and +inf entry: a relation
                # between its amax and its where that boxes do not keep
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                box = iv.softmax_box(self.box(args[0]), dim, masked_rows=True)
                results = [iv.within(iv.widen(box, outs[0].dtype, k=8), 0.0, 1.0)]
        results = list(results) + [None] * (len(outs) - len(results))
        fixed = []
        for t, b in zip(outs, results, strict=False):
            if b is None or tuple(b.lo.shape) != tuple(t.shape):
                if b is not None and b.lo.dim() <= t.dim():
                    try:
                        b = Box(*(x.expand(t.shape).clone() for x in (b.lo, b.hi, b.nan)))
                    except RuntimeError:
                        b = None
                if b is None:
                    self.unmodelled[base] = self.unmodelled.get(base, 0) + 1
                    b = top_like(t)
            fixed.append(b)
        for t, b in zip(outs, fixed, strict=True):
            self.set(t, b)
        if mutated:
            self.alias(mutated[0], fixed[0])
        for t in side:
            self.set(t, top_like(t))
            self.alias(t, top_like(t))
        site = self.judge(name, base, args, in_tensors, in_boxes, outs, fixed, seeded)
        self.follow(in_tensors, outs, fixed, site)
        self.relate(base, args, outs)

    def _rel(self, table, t):
        e = table.get(id(t)) if isinstance(t, Tensor) else None
        return e if e is not None and e[0] is t else None

    def relate(self, base, args, outs) -> None:
        """Remember which values are exp(t) for t up to a bound (through the exp guard of a
        hardened model: exp(clamp(t, max=h)) or exp(where(t > h, h, t)), then sat where t > c)."""
        if not outs or not args:
            return
        o, x = outs[0], args[0]
        if base == "clamp" and len(args) >= 3 and args[1] is None and isinstance(args[2], (int, float)):
            self.same_below[id(o)] = (o, x, float(args[2]))
        elif base in ("gt", "ge", "lt", "le") and len(args) >= 2 and isinstance(args[1], (int, float)) \
                and not isinstance(args[1], bool) and isinstance(x, Tensor) and x.is_floating_point():
            self.cmp_of[id(o)] = (o, x, base, float(args[1]))
            if base == "gt":
                self.gt_of[id(o)] = (o, x, float(args[1]))
        elif base == "exp":
            e = self._rel(self.same_below, x)
            self.exp_of[id(o)] = (o, e[1], e[2]) if e else (o, x, INF)
        elif base == "where" and len(args) >= 3:
            c, e = self._rel(self.gt_of, args[0]), self._rel(self.exp_of, args[2])
            if c and e and c[1] is e[1]:
                self.exp_of[id(o)] = (o, e[1], min(e[2], c[2]))
            elif c and c[1] is args[2]:  # where(t > h, h, t): the guards' clamp from torch 2.14
                self.same_below[id(o)] = (o, args[2], c[2])

    # -- overflow that a guard absorbs -----------------------------------------------------
    def follow(self, in_tensors, outs, boxes, site) -> None:
        """Carry the sites whose overflow a value may hold: a non-finite value passes them on; a
        finite one ends them, absorbed by a guard of a hardened model (nan_to_num, a clamp) or,
        outside a guard, by the model's own code (which certifies nothing)."""
        if not self.hardened:
            return
        carried = set()
        for t in in_tensors:
            e = self.taint.get(id(t))
            if e is not None and e[0] is t:
                carried |= e[1]
        if site is not None:
            carried.add(site)
        if not carried:
            return
        in_guard = self._where()[3] is not None
        for t, b in zip(outs, boxes, strict=True):
            if not t.is_floating_point() and not t.is_complex():
                continue
            if b.finite():
                (self.absorbed if in_guard else self.escaped).update(carried)
            else:
                self.taint[id(t)] = (t, frozenset(carried))

    def resolve(self, outputs) -> None:
        """An overflow every one of whose values ended inside a guard is guarded."""
        for t in outputs:
            e = self.taint.get(id(t))
            if e is not None and e[0] is t:
                self.escaped |= e[1]
        for key in self.absorbed - self.escaped:
            v = self.sites.get(key)
            if v is not None and v.verdict == UNSAFE:
                v.verdict, v.grad = GUARDED, "unproven"
                v.reason = f"{v.reason}; every such value reaches a guard of nanpass.harden that saturates it"

    def transfer(self, func, name, base, args, kwargs, out) -> list:
        outs = iv._outs(out)
        if base in iv.STRUCTURAL or (base in iv.INDEXED and self._points(args, kwargs, base)):
            f = getattr(torch.ops.aten, base, None)
            f = func if f is None or base == name else getattr(f, op_overload_name(func), f)
            index_ids = set()
            for pos in iv.INDEXED.get(base, ()):
                idx = args[pos] if len(args) > pos else None
                index_ids.update(id(t) for t in _tensors(idx if isinstance(idx, (list, tuple)) else [idx])
                                 if not t.is_floating_point())
            return iv.structural(self.box, f, args, kwargs, out, None, frozenset(index_ids))
        if base in iv.INDEXED:
            if base in ("index_add", "scatter_add") or kwargs.get("accumulate") or \
                    (base in ("index_put", "_index_put_impl") and len(args) > 3 and args[3]):
                return [None] * len(outs)
            boxes = [self.box(t) for t in _tensors(list(args)) if t.is_floating_point()]
            if not boxes:
                return [None] * len(outs)
            h = boxes[0]
            for b in boxes[1:]:
                h = iv.join(iv.hull_like(h, torch.zeros(())), iv.hull_like(b, torch.zeros(())))
            return [iv.hull_like(h, t) for t in outs]
        t = iv.TRANSFER.get(base)
        if t is None:
            return [None] * len(outs)
        r = self.related(base, args, out)
        if r is None:
            r = t(self._operand_boxes(args, out), args, kwargs, out)
        if r is None:
            return [None] * len(outs)
        r = iv._outs(r) if isinstance(r, (list, tuple)) else [r]
        if base not in _EXACT:
            k = 8.0 if base in _TRANSCENDENTAL else 2.0
            keep = base not in _COMPOSITE
            r = [iv.widen(b, o.dtype, k=k, keep_sign=keep) if b is not None and isinstance(o, Tensor) else b
                 for b, o in zip(r, outs, strict=False)]
        if base in _RANGE and r and r[0] is not None:
            r[0] = iv.within(r[0], *_RANGE[base])
        return r

    def related(self, base, args, out):
        """Operands that are one value (x * x, x == x) or a value and its exp (p * log p's
        cousin, the entropy's exp(l) * l): the intervals alone lose the relation."""
        if base == "where" and len(args) == 3:
            return self.refined_where(args, out)
        if len(args) < 2 or not isinstance(args[0], Tensor) or not isinstance(args[1], Tensor):
            return None
        a, b = args[0], args[1]
        if a is b and base == "mul":
            return iv.powi(self.box(a), 2)
        if a is b and base in ("eq", "le", "ge", "ne", "lt", "gt"):
            x = self.box(a)
            nan = x.nan > 0
            yes = base in ("eq", "le", "ge")
            one, zero = torch.ones_like(x.lo), torch.zeros_like(x.lo)
            if yes:  # x == x: true unless x is NaN
                return Box(torch.where(nan, zero, one), one)
            return Box(zero, torch.where(nan, one, zero) if base == "ne" else zero)  # NaN != NaN
        if base == "mul" and out.is_floating_point():
            for e, t in ((a, b), (b, a)):
                src = self._rel(self.exp_of, e)
                if src is not None and src[1] is t and e.shape == t.shape == out.shape:
                    tb = self.box(t)
                    p, q = iv.x_exp_x(tb), iv.mul(self.box(e), tb)
                    below = tb.hi <= src[2]
                    return Box(torch.where(below, p.lo, q.lo), torch.where(below, p.hi, q.hi),
                               torch.where(below, p.nan, q.nan))
        return None

    def refined_where(self, args, out):
        """where(x <op> c, x, y) or where(x <op> c, y, x): in its branch x satisfies the test
        (where(x <= 0, tiny, x) never passes a value <= 0 on)."""
        c = self._rel(self.cmp_of, args[0])
        if c is None or not out.is_floating_point():
            return None
        _, x, op, k = c
        if args[1] is not x and args[2] is not x:
            return None
        box = self._operand_boxes(args, out)
        a, b = box(args[1]), box(args[2])
        ks = [k, float(torch.tensor(k, dtype=F64).to(x.dtype)), float(torch.tensor(k, dtype=F64).to(torch.float32))]
        up = [float(torch.nextafter(torch.tensor(v, dtype=x.dtype), torch.tensor(INF, dtype=x.dtype))) for v in ks]
        down = [float(torch.nextafter(torch.tensor(v, dtype=x.dtype), torch.tensor(-INF, dtype=x.dtype))) for v in ks]
        # the values x may hold where the test is true / false (NaN: false)
        floor_true = {"gt": min(up), "ge": min(ks)}.get(op)
        ceil_true = {"lt": max(down), "le": max(ks)}.get(op)
        floor_false = {"lt": min(ks), "le": min(up)}.get(op)
        ceil_false = {"gt": max(ks), "ge": max(down)}.get(op)

        def cut(bx, lo, hi, nan_ok):
            lo_t = bx.lo if lo is None else torch.minimum(torch.maximum(bx.lo, torch.tensor(lo, dtype=F64)), bx.hi)
            hi_t = bx.hi if hi is None else torch.maximum(torch.minimum(bx.hi, torch.tensor(hi, dtype=F64)), lo_t)
            return Box(lo_t, hi_t, bx.nan if nan_ok else torch.zeros_like(bx.nan))

        if args[1] is x:
            a = cut(a, floor_true, ceil_true, False)
        if args[2] is x:
            b = cut(b, floor_false, ceil_false, True)
        return iv.where(box(args[0]), a, b)

    def _operand_boxes(self, args, out):
        """``box`` for a transfer function, with each operand the kernel converts first (a
        Python number, a 0-d tensor or an integer tensor of another dtype) rounded as the
        kernel rounds it: into the dtype it computes in."""
        dtype = next((t.dtype for t in iv._outs(out) if isinstance(t, Tensor) and t.is_floating_point()), None)
        if dtype is None:
            dtype = next((t.dtype for t in _tensors(list(args)) if t.is_floating_point()), None)
        if dtype is None or dtype == F64:
            return self.box

        def box(x):
            b = self.box(x)
            if b is None or isinstance(x, bool) or (isinstance(x, Tensor) and x.dtype in (dtype, torch.bool)):
                return b
            return iv.rounded_operand(b, dtype)
        return box

    def _points(self, args, kwargs, base) -> bool:
        positions = iv.INDEXED[base]
        for p in positions:
            idx = args[p] if len(args) > p else None
            for t in _tensors(idx if isinstance(idx, (list, tuple)) else [idx]):
                if not self.box(t).is_point():
                    return False
        return True

    def alias(self, t: Tensor, b: Box) -> None:
        """A write into ``t``: every other tensor sharing its storage may now hold any of the
        written values (joined with its own)."""
        ptr = _storage(t)
        if ptr is None:
            return
        h = iv.hull_like(b, torch.zeros(()))
        for key, (other, ob) in list(self.env.items()):
            if other is t or other.device != t.device or _storage(other) != ptr:
                continue
            if (other.shape, other.stride(), other.storage_offset(), other.dtype) == \
                    (t.shape, t.stride(), t.storage_offset(), t.dtype):
                self.env[key] = (other, b)  # the same elements (a detached alias): overwritten
            else:
                self.env[key] = (other, iv.join(ob, iv.hull_like(h, other)))

    # -- verdicts ---------------------------------------------------------------------------
    def judge(self, name, base, args, in_tensors, in_boxes, outs, boxes, seeded) -> None:
        fl_in = [b for t, b in zip(in_tensors, in_boxes, strict=True) if t.is_floating_point()]
        fl_out = [(t, b) for t, b in zip(outs, boxes, strict=True) if t.is_floating_point()]
        if base.startswith("_scaled_dot_product"):
            fl_out = fl_out[:1]  # the attention output; the others are softmax statistics
        if not fl_out:
            return
        out_ok = all(b.finite() for _, b in fl_out)
        in_ok = all(b.finite() for b in fl_in) and all(
            math.isfinite(a) for a in args if isinstance(a, float))  # masked_fill(m, -inf), full(-inf)
        rule = ATEN_RULES.get(base)
        if rule is not None:
            r = BY_NAME[rule]
            if r.only_dtypes and not any(t.dtype in r.only_dtypes for t in in_tensors):
                rule = None
            elif r.safe and rule is not None and out_ok:
                rule = None  # a safe op (sdpa): only its overflow matters
        operands = "; ".join(b.summary() for b in fl_in[:3]) or "-"
        result = fl_out[0][1].summary()
        if rule is not None:
            if out_ok:
                self.record(rule, name, PROVEN, operands, result, "operands never reach the unsafe domain",
                            self.grad(rule, base, args, fl_in, fl_out))
            else:
                why = "the result may be " + ("NaN" if any(bool(b.nan.any()) for _, b in fl_out) else "infinite")
                if base in self.unmodelled:
                    why = "not modelled: the result is taken as the full range and NaN"
                self.record(rule, name, UNSAFE, operands, result, why)
            return
        if out_ok or not in_ok:
            return  # finite, or non-finite only because an operand is (flagged where it began)
        if base in self.unmodelled:
            self.record(base, name, UNSAFE, operands, result,
                        "not modelled: the result is taken as the full range and NaN")
            return None
        nan = any(bool(b.nan.any()) for _, b in fl_out)
        return self.record(base, name, UNSAFE, operands, result,
                           "finite operands can give NaN here" if nan else f"overflow: the result may exceed "
                           f"{str(fl_out[0][0].dtype).replace('torch.', '')}'s max")

    @staticmethod
    def grad(rule, base, args, fl_in, fl_out) -> str:
        """Whether the op's local derivative is finite for every operand in the boxes."""
        if not fl_in:
            return "finite"
        x = fl_in[0]
        dt = fl_out[0][0].dtype
        mx = float(torch.finfo(dt).max)
        away = float(x.lo.min()) > 2 / mx or float(x.hi.max()) < -2 / mx
        if rule in ("exp", "exp2", "expm1", "softmax", "log_softmax", "logsumexp", "logsigmoid", "matmul",
                    "layer_norm", "atanh", "erfinv", "scaled_dot_product_attention"):
            return "finite"
        if rule in ("log", "log2", "log10", "log1p", "reciprocal", "rsqrt", "logit"):
            if rule == "log1p":
                away = float(x.lo.min()) > -1 + 1e-6
            if rule == "logit":
                away = float(x.lo.min()) > 2 / mx and float(x.hi.max()) < 1 - 1e-6
            return "finite" if away else "unproven"
        if rule == "sqrt":
            return "finite" if float(x.lo.min()) > 4 / mx else "unproven"
        if rule in ("acos", "asin"):
            return "finite" if max(abs(float(x.lo.min())), abs(float(x.hi.max()))) < 1 else "unproven"
        if rule == "div" and len(fl_in) >= 2:
            a, d = fl_in[0], fl_in[1]
            dmin = float(torch.minimum(d.lo.abs(), d.hi.abs()).min()) if not bool(d.contains_zero().any()) else 0.0
            amax = float(torch.maximum(a.lo.abs(), a.hi.abs()).max())
            return "finite" if dmin > 0 and amax / dmin / dmin < mx / 4 and 1 / dmin < mx / 4 else "unproven"
        if rule == "div":  # tensor / number
            return "finite"
        if rule == "pow" and len(args) > 1 and not isinstance(args[1], Tensor):
            p = float(args[1])
            if p >= 1 or p == 0:
                m = max(abs(float(x.lo.min())), abs(float(x.hi.max())))
                return "finite" if p == 0 or abs(p) * m ** max(p - 1, 0) < mx / 4 else "unproven"
            return "finite" if float(x.lo.min()) > 4 / mx else "unproven"
        return "unproven"


# ---------------------------------------------------------------------------------------------
# the entry point


def analyse(model, example_inputs, specs, hardened=False, trace=False) -> tuple[Analysis, list[Box]]:
    """Run ``model`` once under the analysis: (the analysis, the boxes of its floating outputs)."""
    analysis = Analysis(model, hardened)
    if trace:
        analysis.trace = []
    inputs = []
    for x in example_inputs:
        if isinstance(x, Tensor):
            x = x.detach().clone().requires_grad_(x.requires_grad)
        inputs.append(x)
    for i, (x, spec) in enumerate(zip(inputs, specs, strict=True)):
        if spec is not None:
            b = input_box(x, spec)
            if x.is_floating_point():  # the example itself inside the range: constants fold exactly
                with torch.no_grad():
                    x = torch.maximum(torch.minimum(x, b.hi.to(x.dtype)), b.lo.to(x.dtype))
                x = x.requires_grad_(inputs[i].requires_grad)
                inputs[i] = x
            analysis.set(x, b)
    reads = HOST_READS.set(False)  # a guard's shortcut reads a value: control flow to the analysis
    try:
        with analysis:
            result = model(*inputs)
    finally:
        HOST_READS.reset(reads)
    out_boxes = [analysis.box(t) for t in _float_tensors(result)]
    analysis.resolve(_float_tensors(result))
    return analysis, out_boxes


def certify(model: torch.nn.Module, *example_inputs, ranges=None) -> Certificate:
    """Interval analysis of ``model``'s forward for every input within ``ranges``, with the
    model's current parameters. ``ranges``: one ``(lo, hi)`` pair for every floating input,
    ``"finite"`` (the dtype's finite range), or a list with one entry per positional input (a
    pair, ``"finite"``, or ``None``: held at the example's value). Non-floating inputs (masks,
    indices) are held at the example's values unless a pair is given for them. ``lo`` and ``hi``
    may be tensors that broadcast to the input (a range per element)."""
    from ._harden import Hardened

    require("dispatch_mode", "nanpass.certify")
    require("op_schema", "nanpass.certify")
    if not isinstance(model, torch.nn.Module):
        raise NanpassTypeError(f"nanpass: certify takes an nn.Module, got {type(model).__name__}")
    specs = parse_ranges(ranges, example_inputs)
    start = time.perf_counter()
    hardened = isinstance(model, Hardened)
    analysis, out_boxes = analyse(model, example_inputs, specs, hardened)
    name = type(model._nanpass_model).__name__ if hardened else type(model).__name__
    return Certificate(
        model=("nanpass.harden(" + name + ")") if hardened else name,
        ranges=[_describe_range(x, s) for x, s in zip(example_inputs, specs, strict=True)],
        verdicts=list(analysis.sites.values()),
        outputs=[b.summary() for b in out_boxes],
        outputs_finite=all(b.finite() for b in out_boxes),
        nodes=analysis.nodes,
        unmodelled=dict(analysis.unmodelled),
        seconds=time.perf_counter() - start,
    )


