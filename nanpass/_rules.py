"""The rule table: the one place where an op's spellings are named, with its guard and the
operands its tests use. Rewrite, interception, report, docs and tests read this table; adding an
op is one ``Rule`` (plus, where needed, one guard in ``_guards.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from . import _guards as g
from ._rule import (
    TINY_MAX,
    Rule,
    Spelling,
    _divisor_safe,
    _exponent_safe,
    _resolve,
    operands,
    tensor,
)
from ._rule import Sample as Sample

Tensor = torch.Tensor

INF = float("inf")
_ROWS = tensor(-INF, -INF, -INF, 1.0, 2.0, -INF, shape=(2, 3))  # a fully masked row
_GOOD_ROWS = tensor(-1.0, 0.5, 2.0, 1.0, -INF, 3.0, shape=(2, 3))  # a partly masked row is fine
_FINITE_ROWS = tensor(-1.0, 0.5, 2.0, 1.0, -3.0, 3.0, shape=(2, 3))
_LOGITS = tensor(0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, 1.0, -2.0, 3.0, 0.0, 0.5, shape=(3, 4))


def _mha(masked: bool):
    """Self-attention over (L=3, N=2, E=8); ``masked``: the first sequence has no real key."""

    def make(dt):
        q = torch.linspace(-1, 1, 48, dtype=torch.float64).reshape(3, 2, 8).to(dt).requires_grad_()
        pad = torch.tensor([[True, True, True], [False, True, False]] if masked
                           else [[False, True, False], [False, False, True]])
        return (q, q, q), {"key_padding_mask": pad, "need_weights": True}

    return make


RULES: tuple[Rule, ...] = (
    # -- guarded ----------------------------------------------------------------------------
    Rule(
        "div", g.div,
        reason="divisor can be 0, or the quotient can overflow",
        action="0 where the divisor is 0, +-max where the quotient overflows; non-finite gradients become 0",
        functions=("torch.div", "torch.divide", "torch.true_divide"),
        operators=("operator.truediv",),
        inplace_operators=(("operator.itruediv", "operator.truediv"),),
        methods=("div", "divide", "true_divide"), inplace=True,
        safe_if=_divisor_safe,
        sample=Sample(operands(tensor(1.0, 0.0, 2.0), tensor(0.0, 0.0, 1.0)), operands(tensor(1.0, -3.0, 2.0), tensor(0.5, 2.0, -4.0))),
    ),
    Rule(
        "reciprocal", g.reciprocal,
        reason="1/0 is inf",
        action="0 where the operand is 0, +-max on overflow; non-finite gradients become 0",
        functions=("torch.reciprocal",), methods=("reciprocal",), inplace=True,
        sample=Sample(operands(tensor(0.0, 2.0)), operands(tensor(0.5, -2.0, 3.0))),
    ),
    Rule(
        "log", g.clamped("lo", "hi"),
        reason="log of 0 is -inf, of a negative number NaN",
        action="operand clamped to [tiny, max]",
        functions=("torch.log",), methods=("log",), inplace=True, constants=TINY_MAX,
        sample=Sample(operands(tensor(0.0, -1.0, 2.0)), operands(tensor(0.5, 1.0, 3.0))),
    ),
    Rule(
        "log2", g.clamped("lo", "hi"),
        reason="log2 of 0 is -inf, of a negative number NaN",
        action="operand clamped to [tiny, max]",
        functions=("torch.log2",), methods=("log2",), inplace=True, constants=TINY_MAX,
        sample=Sample(operands(tensor(0.0, -1.0, 2.0)), operands(tensor(0.5, 1.0, 3.0))),
    ),
    Rule(
        "log10", g.clamped("lo", "hi"),
        reason="log10 of 0 is -inf, of a negative number NaN",
        action="operand clamped to [tiny, max]",
        functions=("torch.log10",), methods=("log10",), inplace=True, constants=TINY_MAX,
        sample=Sample(operands(tensor(0.0, -1.0, 2.0)), operands(tensor(0.5, 1.0, 3.0))),
    ),
    Rule(
        "log1p", g.clamped("lo", "hi"),
        reason="log1p of -1 is -inf, below -1 NaN",
        action="operand clamped to [next float above -1, max]",
        functions=("torch.log1p", "torch.special.log1p"), methods=("log1p",), inplace=True,
        constants={"lo": lambda b: b.above_minus_one, "hi": lambda b: b.max},
        sample=Sample(operands(tensor(-1.0, -2.0, 2.0)), operands(tensor(-0.5, 0.0, 3.0))),
    ),
    Rule(
        "sqrt", g.clamped("lo", "hi"),
        reason="sqrt of a negative number is NaN; its gradient at 0 is inf",
        action="operand clamped to [0, max]; the infinite gradient at 0 becomes 0",
        functions=("torch.sqrt",), methods=("sqrt",), inplace=True,
        constants={"lo": lambda b: 0.0, "hi": lambda b: b.max},
        sample=Sample(operands(tensor(0.0, -1.0, 4.0)), operands(tensor(0.25, 1.0, 4.0))),
    ),
    Rule(
        "rsqrt", g.clamped("lo", "hi"),
        reason="rsqrt of 0 is inf, of a negative number NaN",
        action="operand clamped to [tiny, max]",
        functions=("torch.rsqrt",), methods=("rsqrt",), inplace=True, constants=TINY_MAX,
        sample=Sample(operands(tensor(0.0, -1.0, 4.0)), operands(tensor(0.25, 1.0, 4.0))),
    ),
    Rule(
        "pow", g.pow_,
        reason="fractional power of a negative base is NaN, a negative power of 0 inf, "
        "x**g with g < 1 has an infinite gradient at 0, and large powers overflow",
        action="base clamped into the exponent's finite domain (pushed away from 0 for negative "
        "integer powers); a tensor exponent saturates the result; non-finite gradients become 0",
        functions=("torch.pow", "torch.float_power"),
        operators=("operator.pow",),
        inplace_operators=(("operator.ipow", "operator.pow"),),
        methods=("pow", "float_power"), inplace=True, safe_if=_exponent_safe,
        sample=Sample(operands(tensor(0.0, -1.0, 4.0), 0.5), operands(tensor(0.25, 1.0, 4.0), 0.5)),
    ),
    Rule(
        "exp", g.clamped(None, "hi"),
        reason="exp overflows to inf",
        action="operand clamped to at most log(max)",
        functions=("torch.exp",), methods=("exp",), inplace=True,
        constants={"hi": lambda b: b.exp_hi},
        sample=Sample(operands(tensor(100000.0, 1.0)), operands(tensor(-3.0, 0.0, 2.0))),
    ),
    Rule(
        "exp2", g.clamped(None, "hi"),
        reason="exp2 overflows to inf",
        action="operand clamped to at most log2(max)",
        functions=("torch.exp2", "torch.special.exp2"), methods=("exp2",), inplace=True,
        constants={"hi": lambda b: b.exp2_hi},
        sample=Sample(operands(tensor(200000.0, 1.0)), operands(tensor(-3.0, 0.0, 2.0))),
    ),
    Rule(
        "expm1", g.clamped(None, "hi"),
        reason="expm1 overflows to inf",
        action="operand clamped to at most log(max)",
        functions=("torch.expm1", "torch.special.expm1"), methods=("expm1",), inplace=True,
        constants={"hi": lambda b: b.exp_hi},
        sample=Sample(operands(tensor(100000.0, 1.0)), operands(tensor(-3.0, 0.0, 2.0))),
    ),
    Rule(
        "softmax", g.finite_operand,
        reason="a row of all -inf gives NaN, so does +inf",
        action="+-inf operands to +-max: a fully masked row becomes uniform",
        functions=("torch.softmax", "F.softmax", "torch.special.softmax"),
        methods=("softmax",), modules=("nn.Softmax", "nn.Softmax2d"),
        sample=Sample(operands(_ROWS, dim=-1), operands(_GOOD_ROWS, dim=-1),
               ctor={"nn.Softmax": (-1,), "nn.Softmax2d": ()}),
    ),
    Rule(
        "softmin", g.finite_operand,
        reason="a row of all +inf gives NaN",
        action="+-inf operands to +-max: a fully masked row becomes uniform",
        functions=("F.softmin",), modules=("nn.Softmin",),
        sample=Sample(operands(tensor(INF, INF, 1.0, 2.0, shape=(2, 2)), dim=-1), operands(_FINITE_ROWS, dim=-1),
               ctor={"nn.Softmin": (-1,)}),
    ),
    Rule(
        "log_softmax", g.finite_in_out,
        reason="a row of all -inf gives NaN; a -inf entry gives -inf",
        action="+-inf operands to +-max and the result saturated at -max",
        functions=("torch.log_softmax", "F.log_softmax", "torch.special.log_softmax"),
        methods=("log_softmax",), modules=("nn.LogSoftmax",),
        sample=Sample(operands(_ROWS, dim=-1), operands(_FINITE_ROWS, dim=-1), ctor={"nn.LogSoftmax": (-1,)}),
    ),
    Rule(
        "logsigmoid", g.finite_operand, stable=True,
        reason="logsigmoid(-inf) is -inf",
        action="+-inf operands to +-max",
        functions=("F.logsigmoid",), modules=("nn.LogSigmoid",),
        sample=Sample(operands(tensor(-INF, 1.0)), operands(tensor(-3.0, 0.0, 2.0)), ctor={"nn.LogSigmoid": ()}),
    ),
    Rule(
        "logsumexp", g.finite_in_out,
        reason="all -inf gives -inf with a NaN gradient; large inputs overflow",
        action="+-inf operands to +-max and the result saturated",
        functions=("torch.logsumexp", "torch.special.logsumexp"), methods=("logsumexp",),
        sample=Sample(operands(_ROWS, dim=-1), operands(_GOOD_ROWS, dim=-1)),
    ),
    Rule(
        "acos", g.clamped("lo", "hi"),
        reason="acos outside [-1, 1] is NaN; its gradient at +-1 is infinite",
        action="operand clamped to [-1, 1]; the infinite gradient at +-1 becomes 0",
        functions=("torch.acos", "torch.arccos"), methods=("acos", "arccos"), inplace=True,
        constants={"lo": lambda b: -1.0, "hi": lambda b: 1.0},
        sample=Sample(operands(tensor(1.0, 2.0, 0.5)), operands(tensor(-0.5, 0.0, 0.75))),
    ),
    Rule(
        "asin", g.clamped("lo", "hi"),
        reason="asin outside [-1, 1] is NaN; its gradient at +-1 is infinite",
        action="operand clamped to [-1, 1]; the infinite gradient at +-1 becomes 0",
        functions=("torch.asin", "torch.arcsin"), methods=("asin", "arcsin"), inplace=True,
        constants={"lo": lambda b: -1.0, "hi": lambda b: 1.0},
        sample=Sample(operands(tensor(1.0, -2.0, 0.5)), operands(tensor(-0.5, 0.0, 0.75))),
    ),
    Rule(
        "atanh", g.clamped("lo", "hi"),
        reason="atanh of +-1 is +-inf, outside [-1, 1] NaN",
        action="operand clamped to the floats strictly inside (-1, 1)",
        functions=("torch.atanh", "torch.arctanh"), methods=("atanh", "arctanh"), inplace=True,
        constants={"lo": lambda b: b.above_minus_one, "hi": lambda b: b.below_one},
        sample=Sample(operands(tensor(1.0, -1.0, 0.5)), operands(tensor(-0.5, 0.0, 0.75))),
    ),
    Rule(
        "logit", g.logit,
        reason="logit of 0 or 1 is infinite (and 1 - 1e-8 == 1 in float32)",
        action="operand clamped to [tiny, next float below 1] (or the user's eps, if tighter)",
        functions=("torch.logit", "torch.special.logit"), methods=("logit",), inplace=True,
        constants={"lo": lambda b: b.tiny, "hi": lambda b: b.below_one},
        sample=Sample(operands(tensor(0.0, 1.0, 0.5)), operands(tensor(0.25, 0.5, 0.75))),
    ),
    Rule(
        "std", g.finite_result,
        reason="NaN with too few elements; overflow; infinite gradient at zero spread",
        action="a NaN result becomes 0 and overflow saturates; non-finite gradients become 0",
        functions=("torch.std", "torch.std_mean"), methods=("std",),
        sample=Sample(operands(tensor(1.0)), operands(tensor(1.0, 2.0, 4.0))),
    ),
    Rule(
        "var", g.finite_result,
        reason="NaN with too few elements; overflow",
        action="a NaN result becomes 0 and overflow saturates; non-finite gradients become 0",
        functions=("torch.var", "torch.var_mean"), methods=("var",),
        sample=Sample(operands(tensor(1.0)), operands(tensor(1.0, 2.0, 4.0))),
    ),
    Rule(
        "xlogy", g.xlogy, stable=True,
        reason="xlogy(x, 0) is -inf for x != 0",
        action="second operand clamped to [tiny, max]; the result saturated",
        functions=("torch.xlogy", "torch.special.xlogy"), methods=("xlogy",), inplace=True,
        constants=TINY_MAX,
        sample=Sample(operands(tensor(1.0, 0.0), tensor(0.0, 0.0)), operands(tensor(1.0, 2.0), tensor(0.5, 3.0))),
    ),
    Rule(
        "cross_entropy", g.loss,
        reason="0/0 in the mean when every target is ignored; +-inf logits give NaN",
        action="+-inf logits to +-max; a NaN loss becomes 0 with zero gradient",
        functions=("F.cross_entropy",), modules=("nn.CrossEntropyLoss",),
        sample=Sample(operands(_LOGITS, tensor(-100, -100, -100, dtype=torch.int64)),
               operands(_LOGITS, tensor(0, 3, 1, dtype=torch.int64)), ctor={"nn.CrossEntropyLoss": ()}),
    ),
    Rule(
        "nll_loss", g.loss,
        reason="0/0 in the mean when every target is ignored",
        action="+-inf inputs to +-max; a NaN loss becomes 0 with zero gradient",
        functions=("F.nll_loss",), modules=("nn.NLLLoss",),
        sample=Sample(operands(_LOGITS, tensor(-100, -100, -100, dtype=torch.int64)),
               operands(_LOGITS, tensor(0, 3, 1, dtype=torch.int64)), ctor={"nn.NLLLoss": ()}),
    ),
    Rule(
        "kl_div", g.loss,
        reason="-inf log-probabilities against a zero target give 0 * inf = NaN",
        action="+-inf operands to +-max; the result saturated; non-finite gradients become 0",
        functions=("F.kl_div",), modules=("nn.KLDivLoss",),
        sample=Sample(operands(tensor(0.0, -INF, shape=(1, 2)), tensor(1.0, 0.0, grad=False, shape=(1, 2)), reduction="sum"),
               operands(tensor(-1.0, -0.5, shape=(1, 2)), tensor(0.5, 0.5, grad=False, shape=(1, 2)), reduction="sum"),
               ctor={"nn.KLDivLoss": ()}),
    ),
    Rule(
        "cosine_similarity", g.cosine_similarity,
        reason="rounding can put the cosine past +-1, where acos/asin give NaN",
        action="result clamped to [-1, 1]; +-inf operands to +-max",
        functions=("F.cosine_similarity", "torch.cosine_similarity"),
        modules=("nn.CosineSimilarity",),
        sample=Sample(operands(tensor(INF, 1.0, shape=(1, 2)), tensor(1.0, 1.0, grad=False, shape=(1, 2))),
               operands(tensor(2.0, 1.0, shape=(1, 2)), tensor(1.0, 3.0, grad=False, shape=(1, 2))),
               ctor={"nn.CosineSimilarity": ()}),
    ),
    Rule(
        "multi_head_attention", g.attention,
        reason="a query whose every key is masked gives NaN (need_weights=True path)",
        action="-inf / True mask entries become finfo.min/4: fully masked rows stay finite, "
        "all other rows are unchanged",
        functions=("F.multi_head_attention_forward",), modules=("nn.MultiheadAttention",),
        sample=Sample(_mha(masked=True), _mha(masked=False), ctor={"nn.MultiheadAttention": (8, 2)},
               dtypes=(torch.bfloat16, torch.float32, torch.float64)),
    ),
    Rule(
        "mha_fast_path", g.finite_result,
        reason="nn.MultiheadAttention's inference fast path (eval, no grad): a query whose every "
        "key is masked gives NaN, whatever the mask values",
        action="a NaN result becomes 0 (what scaled_dot_product_attention gives such a row)",
        functions=("torch._native_multi_head_attention",),
    ),
    Rule(
        "encoder_layer_fast_path", g.finite_result,
        reason="nn.TransformerEncoderLayer's inference fast path (eval, no grad): a fully padded "
        "sequence gives NaN, whatever the mask values",
        action="a NaN result becomes 0 (what scaled_dot_product_attention gives such a row)",
        functions=("torch._transformer_encoder_layer_fwd",),
    ),
    # -- recognised and left alone, with the reason shown in the report -------------------------
    Rule(
        "scaled_dot_product_attention", None, safe=True,
        reason="torch returns 0 for a query with no unmasked key, with finite gradients",
        functions=("F.scaled_dot_product_attention",),
    ),
    # -- building blocks of the stable-form patterns (never rewritten themselves) ----------------
    Rule("sigmoid", None, functions=("torch.sigmoid", "F.sigmoid", "torch.special.expit"),
         methods=("sigmoid",), modules=("nn.Sigmoid",)),
    Rule("tanh", None, functions=("torch.tanh", "F.tanh"), methods=("tanh",), modules=("nn.Tanh",)),
    Rule("gelu", None, stable=True, functions=("F.gelu",), modules=("nn.GELU",)),
    Rule("sum", None, functions=("torch.sum",), methods=("sum",)),
    Rule("add", None, functions=("torch.add",), operators=("operator.add",), methods=("add",)),
    Rule("sub", None, functions=("torch.sub", "torch.subtract"), operators=("operator.sub",),
         methods=("sub", "subtract")),
    Rule("rsub", None, functions=("torch.rsub",)),
    Rule("mul", None, functions=("torch.mul", "torch.multiply"), operators=("operator.mul",),
         methods=("mul", "multiply")),
    Rule("neg", None, functions=("torch.neg", "torch.negative"), operators=("operator.neg",),
         methods=("neg", "negative")),
)

BY_NAME: dict[str, Rule] = {r.name: r for r in RULES}
GUARDED: tuple[str, ...] = tuple(r.name for r in RULES if r.guarded)


def _index() -> tuple[dict, dict]:
    by_target: dict[tuple[str, object], tuple[Rule, Spelling]] = {}
    by_module: dict[type, tuple[Rule, Spelling]] = {}
    for rule in RULES:
        for sp in rule.spellings():
            if sp.kind == "module":
                by_module[sp.target] = (rule, sp)
                continue
            op = "call_method" if sp.kind == "method" else "call_function"
            by_target.setdefault((op, sp.target), (rule, sp))
        for attr, _, sp, swapped in _operator_calls(rule):  # dynamo writes x.__itruediv__(y)
            if not swapped:
                by_target.setdefault(("call_method", attr), (rule, sp))
    return by_target, by_module




def match(node, root: torch.nn.Module | None = None) -> tuple[Rule, Spelling] | None:
    """The rule and spelling an fx node is written with, or None."""
    if node.op in ("call_function", "call_method"):
        try:
            return _BY_TARGET.get((node.op, node.target))
        except TypeError:  # an unhashable target
            return None
    if node.op == "call_module" and root is not None:
        return module_rule(root.get_submodule(node.target))
    return None


def _operator_calls(rule: Rule) -> Iterator[tuple[str, object, Spelling, bool]]:
    """Python operators as a TorchFunctionMode sees them: ``x / y`` arrives as a dunder
    (``Tensor.__truediv__``, or ``Tensor.__rtruediv__`` for ``2 / x``, operands swapped)."""
    for name in rule.operators:
        op = _resolve(name)
        dunder = op.__name__.strip("_")
        for attr, swapped in ((f"__{dunder}__", False), (f"__r{dunder}__", True)):
            fn = getattr(Tensor, attr, None)
            if fn is not None:
                yield attr, fn, Spelling("operator", name, fn, op if swapped else fn), swapped
    for ip, op in rule.inplace_operators:
        attr = f"__{_resolve(ip).__name__.strip('_')}__"
        fn = getattr(Tensor, attr, None)
        if fn is not None:
            yield attr, fn, Spelling("operator", ip, fn, fn, _resolve(op)), False


def _call_index() -> dict:
    """func -> (Rule, Spelling, swapped): every callable a TorchFunctionMode can be handed
    for a rule (functions, ``Tensor`` methods, operator dunders). Modules need no entry: their
    forward calls one of these, which the mode sees."""
    index: dict = {}
    for rule in RULES:
        if not (rule.guarded or rule.safe):
            continue
        for sp in rule.spellings():
            if sp.kind == "function" and sp.name.startswith("torch.Tensor."):
                continue  # the same object as the method spelling, named as users write it
            if sp.kind in ("function", "method"):
                index.setdefault(sp.call, (rule, sp, False))
        for _, fn, sp, swapped in _operator_calls(rule):
            index.setdefault(fn, (rule, sp, swapped))
    return index


CALLS: dict = _call_index()
_BY_TARGET, _BY_MODULE = _index()


def module_rule(module: torch.nn.Module) -> tuple[Rule, Spelling] | None:
    for cls in type(module).__mro__:
        hit = _BY_MODULE.get(cls)
        if hit is not None:
            return hit
    return None


def canonical(name: str) -> Callable:
    """The first function spelling of a rule: what stable-form rewrites call."""
    for sp in BY_NAME[name].spellings():
        if sp.kind == "function":
            return sp.call
    raise KeyError(name)  # pragma: no cover


def operator_of(name: str) -> Callable:
    return _resolve(BY_NAME[name].operators[0])


