"""The rule table: the one place where an op's spellings are named, with its guard and the
operands its tests use. Rewrite, interception, report, docs and tests read this table; adding an
op is one ``Rule`` (plus, where needed, one guard in ``_guards.py``).
"""

from __future__ import annotations

import dis
from collections.abc import Callable, Iterator

import torch

from . import _guards as g
from ._rule import (
    TINY_MAX,
    Rule,
    Spelling,
    _divisor_safe,
    _exponent_safe,
    _nonempty_mean,
    _nonzero_divisor,
    _resolve,
    nonempty_operands,
    operands,
    tensor,
)
from ._rule import Sample as Sample

Tensor = torch.Tensor

INF = float("inf")
_ROWS = tensor(-INF, -INF, -INF, 1.0, 2.0, -INF, shape=(2, 3))  # a fully masked row
_GOOD_ROWS = tensor(-1.0, 0.5, 2.0, 1.0, -INF, 3.0, shape=(2, 3))  # a partly masked row is fine
_FINITE_ROWS = tensor(-1.0, 0.5, 2.0, 1.0, -3.0, 3.0, shape=(2, 3))
# matrices for the linear-algebra rules
_TINY_PIVOT = tensor("tiny", 0.0, 0.0, 1.0, shape=(2, 2))  # invertible, the inverse near max
_SMALL_PIVOT = tensor(1e-30, 0.0, 0.0, 1.0, shape=(2, 2))  # LAPACK's solvers call a tiny pivot singular
_NEAR_SINGULAR = tensor(1.0, 0.0, 0.0, "tiny", shape=(2, 2))
_NEAR_SINGULAR_5 = tensor(*[1.0, 0.0, 0.0, 0.0, 0.0, 0.0] * 4, "tiny", shape=(5, 5))
_HALVES_5 = tensor(*[0.5] * 25, shape=(5, 5))
_ZEROS = tensor(0.0, 0.0, 0.0, 0.0, shape=(2, 2))
_COLUMN = tensor(1.0, 1.0, shape=(2, 1))
_PIVOTS = tensor(1, 2, dtype=torch.int32)
_LOGITS = tensor(0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, 1.0, -2.0, 3.0, 0.0, 0.5, shape=(3, 4))
# a float16 product whose backward overflows from finite operands and a finite upstream gradient:
# the value is 0, and grad_A = grad_out @ B^T sums two max-sized terms (max + max is inf in any
# order of summation): what a too-large loss scale does to a linear's gradient
_ZERO_ROW, _ZERO_ROWS = tensor(0.0, 0.0, shape=(1, 2)), tensor(0.0, 0.0, shape=(1, 1, 2))
_MAXES, _MAXES_BATCH = tensor(*["max"] * 4, shape=(2, 2)), tensor(*["max"] * 4, shape=(1, 2, 2))
_BACKWARD = "; an overflow of its own gradient in backward stays inf, for GradScaler and StepGuard to see"


def _mha(masked: bool):
    """Self-attention over (L=3, N=2, E=8); ``masked``: the first sequence has no real key."""

    def make(dt):
        q = torch.linspace(-1, 1, 48, dtype=torch.float64).reshape(3, 2, 8).to(dt).requires_grad_()
        pad = torch.tensor([[True, True, True], [False, True, False]] if masked
                           else [[False, True, False], [False, False, True]])
        return (q, q, q), {"key_padding_mask": pad, "need_weights": True}

    return make


TABLE: tuple[Rule, ...] = (
    # -- guarded ----------------------------------------------------------------------------
    Rule(
        "div", g.div,
        poles=(0.0,), pole_operand=1,
        reason="divisor can be 0, or the quotient can overflow",
        action="0 where the divisor is 0, +-sat where the quotient overflows; non-finite gradients become 0",
        functions=("torch.div", "torch.divide", "torch.true_divide"),
        operators=("operator.truediv",),
        inplace_operators=(("operator.itruediv", "operator.truediv"),),
        dunder_aliases=(("__div__", "__truediv__"), ("__rdiv__", "__rtruediv__"), ("__idiv__", "__itruediv__")),
        methods=("div", "divide", "true_divide"), inplace=True,
        safe_if=_divisor_safe,
        sample=Sample(operands(tensor(1.0, 0.0, 2.0), tensor(0.0, 0.0, 1.0)), operands(tensor(1.0, -3.0, 2.0), tensor(0.5, 2.0, -4.0))),
    ),
    Rule(
        "reciprocal", g.reciprocal,
        poles=(0.0,),
        reason="1/0 is inf",
        action="0 where the operand is 0, +-sat on overflow; non-finite gradients become 0",
        functions=("torch.reciprocal",), methods=("reciprocal",), inplace=True,
        sample=Sample(operands(tensor(0.0, 2.0)), operands(tensor(0.5, -2.0, 3.0))),
    ),
    Rule(
        "log", g.clamped("lo", "hi", open_at=0.0, pole="log_zero"),
        poles=(0.0,),
        reason="log of 0 is -inf, of a negative number NaN",
        action="an operand <= 0 gives log_zero (below the log of every subnormal; exp of it plus any v "
        "with a finite exp is 0), +inf is read as max (a subnormal keeps its own finite log)",
        functions=("torch.log",), methods=("log",), inplace=True, constants=TINY_MAX,
        sample=Sample(operands(tensor(0.0, -1.0, 2.0)), operands(tensor(0.5, 1.0, 3.0))),
    ),
    Rule(
        "log2", g.clamped("lo", "hi", open_at=0.0, pole="log2_zero"),
        poles=(0.0,),
        reason="log2 of 0 is -inf, of a negative number NaN",
        action="an operand <= 0 gives log2_zero (below the log2 of every subnormal; exp of it plus any v "
        "with a finite exp is 0), +inf is read as max (a subnormal keeps its own finite log2)",
        functions=("torch.log2",), methods=("log2",), inplace=True, constants=TINY_MAX,
        sample=Sample(operands(tensor(0.0, -1.0, 2.0)), operands(tensor(0.5, 1.0, 3.0))),
    ),
    Rule(
        "log10", g.clamped("lo", "hi", open_at=0.0, pole="log10_zero"),
        poles=(0.0,),
        reason="log10 of 0 is -inf, of a negative number NaN",
        action="an operand <= 0 gives log10_zero (below the log10 of every subnormal; exp of it plus any v "
        "with a finite exp is 0), +inf is read as max (a subnormal keeps its own finite log10)",
        functions=("torch.log10",), methods=("log10",), inplace=True, constants=TINY_MAX,
        sample=Sample(operands(tensor(0.0, -1.0, 2.0)), operands(tensor(0.5, 1.0, 3.0))),
    ),
    Rule(
        "log1p", g.clamped("lo", "hi"),
        poles=(-1.0,),
        reason="log1p of -1 is -inf, below -1 NaN",
        action="operand clamped to [next float above -1, max]",
        functions=("torch.log1p", "torch.special.log1p"), methods=("log1p",), inplace=True,
        constants={"lo": lambda b: b.above_minus_one, "hi": lambda b: b.max},
        sample=Sample(operands(tensor(-1.0, -2.0, 2.0)), operands(tensor(-0.5, 0.0, 3.0))),
    ),
    Rule(
        "sqrt", g.clamped("lo", "hi", singular=g.at_zero),
        reason="sqrt of a negative number is NaN; its gradient at 0 is inf",
        action="operand clamped to [0, max]; the infinite gradient at 0 becomes 0",
        functions=("torch.sqrt",), methods=("sqrt",), inplace=True,
        constants={"lo": lambda b: 0.0, "hi": lambda b: b.max},
        sample=Sample(operands(tensor(0.0, -1.0, 4.0)), operands(tensor(0.25, 1.0, 4.0))),
    ),
    Rule(
        "rsqrt", g.clamped("lo", None, open_at=0.0, pole="sat"),
        poles=(0.0,),
        reason="rsqrt of 0 is inf, of a negative number NaN",
        action="an operand <= 0 gives sat (the stand-in for inf; rsqrt(+inf) = 0 and a subnormal's finite rsqrt are the original's)",
        functions=("torch.rsqrt",), methods=("rsqrt",), inplace=True,
        constants={"lo": lambda b: b.tiny},
        sample=Sample(operands(tensor(0.0, -1.0, 4.0)), operands(tensor(0.25, 1.0, 4.0))),
    ),
    Rule(
        "pow", g.pow_,
        poles=(0.0,),
        reason="fractional power of a negative base is NaN, a negative power of 0 inf, "
        "x**g with g < 1 has an infinite gradient at 0, and large powers overflow",
        action="base clamped into the exponent's finite domain (for a negative power: where the "
        "value is finite, pushed away from 0 for an integer one, the derivative that overflows "
        "there fenced), a result that would overflow +-sat; a negative power of 0, or of a "
        "negative base when fractional, is 0 (as 1 / 0 under div); a tensor exponent saturates "
        "the result; non-finite gradients become 0",
        functions=("torch.pow", "torch.float_power"),
        operators=("operator.pow",),
        inplace_operators=(("operator.ipow", "operator.pow"),),
        methods=("pow", "float_power"), inplace=True, safe_if=_exponent_safe, autocast_float32=True,
        sample=Sample(operands(tensor(0.0, -1.0, 4.0), 0.5), operands(tensor(0.25, 1.0, 4.0), 0.5)),
    ),
    Rule(
        "exp", g.overflowing("hi", "exp_hi"),
        reason="exp overflows to inf",
        action="operand clamped to at most log(max); a result that would overflow is sat (the stand-in for inf)",
        functions=("torch.exp",), methods=("exp",), inplace=True,
        constants={"hi": lambda b: b.exp_hi},
        sample=Sample(operands(tensor(100000.0, 1.0)), operands(tensor(-3.0, 0.0, 2.0))),
    ),
    Rule(
        "exp2", g.overflowing("hi", "exp2_hi"),
        reason="exp2 overflows to inf",
        action="operand clamped to at most log2(max); a result that would overflow is sat (the stand-in for inf)",
        functions=("torch.exp2", "torch.special.exp2"), methods=("exp2",), inplace=True,
        constants={"hi": lambda b: b.exp2_hi},
        sample=Sample(operands(tensor(200000.0, 1.0)), operands(tensor(-3.0, 0.0, 2.0))),
    ),
    Rule(
        "expm1", g.overflowing("hi", "exp_hi"),
        reason="expm1 overflows to inf",
        action="operand clamped to at most log(max); a result that would overflow is sat (the stand-in for inf)",
        functions=("torch.expm1", "torch.special.expm1"), methods=("expm1",), inplace=True,
        constants={"hi": lambda b: b.exp_hi},
        sample=Sample(operands(tensor(100000.0, 1.0)), operands(tensor(-3.0, 0.0, 2.0))),
    ),
    Rule(
        "softmax", g.masked_rows(1),
        reason="a row of all -inf gives NaN, so does +inf",
        action="a fully masked (all -inf) row becomes uniform, +inf becomes sat; -inf entries of "
        "any other row are kept",
        functions=("torch.softmax", "F.softmax", "torch.special.softmax"),
        methods=("softmax",), modules=("nn.Softmax", "nn.Softmax2d"),
        sample=Sample(operands(_ROWS, dim=-1), operands(_GOOD_ROWS, dim=-1),
               ctor={"nn.Softmax": (-1,), "nn.Softmax2d": ()}),
    ),
    Rule(
        "softmin", g.masked_rows(-1),
        reason="a row of all +inf gives NaN, so does -inf",
        action="a fully masked (all +inf) row becomes uniform, -inf becomes -sat; +inf entries of "
        "any other row are kept",
        functions=("F.softmin",), modules=("nn.Softmin",),
        sample=Sample(operands(tensor(INF, INF, 1.0, 2.0, shape=(2, 2)), dim=-1), operands(_FINITE_ROWS, dim=-1),
               ctor={"nn.Softmin": (-1,)}),
    ),
    Rule(
        "log_softmax", g.finite_in_out,
        reason="a row of all -inf gives NaN; a -inf entry gives -inf",
        action="+-inf operands to +-sat and the result saturated at -sat",
        functions=("torch.log_softmax", "F.log_softmax", "torch.special.log_softmax"),
        methods=("log_softmax",), modules=("nn.LogSoftmax",),
        sample=Sample(operands(_ROWS, dim=-1), operands(_FINITE_ROWS, dim=-1), ctor={"nn.LogSoftmax": (-1,)}),
    ),
    Rule(
        "logsigmoid", g.finite_operand, stable=True,
        reason="logsigmoid(-inf) is -inf",
        action="+-inf operands to +-sat",
        functions=("F.logsigmoid",), modules=("nn.LogSigmoid",),
        sample=Sample(operands(tensor(-INF, 1.0)), operands(tensor(-3.0, 0.0, 2.0)), ctor={"nn.LogSigmoid": ()}),
    ),
    Rule(
        "logsumexp", g.logsumexp,
        reason="all -inf gives -inf with a NaN gradient; large inputs overflow",
        action="an all -inf slice read as -sat, +inf as sat, the result saturated; -inf entries "
        "next to a finite one are kept",
        functions=("torch.logsumexp", "torch.special.logsumexp"), methods=("logsumexp",),
        sample=Sample(operands(_ROWS, dim=-1), operands(_GOOD_ROWS, dim=-1)),
    ),
    Rule(
        "acos", g.clamped("lo", "hi", singular=g.at_unit(torch.acos)),
        reason="acos outside [-1, 1] is NaN; its gradient at +-1 is infinite",
        action="operand clamped to [-1, 1]; the infinite gradient at +-1 becomes 0",
        functions=("torch.acos", "torch.arccos"), methods=("acos", "arccos"), inplace=True,
        constants={"lo": lambda b: -1.0, "hi": lambda b: 1.0},
        sample=Sample(operands(tensor(1.0, 2.0, 0.5)), operands(tensor(-0.5, 0.0, 0.75))),
    ),
    Rule(
        "asin", g.clamped("lo", "hi", singular=g.at_unit(torch.asin)),
        reason="asin outside [-1, 1] is NaN; its gradient at +-1 is infinite",
        action="operand clamped to [-1, 1]; the infinite gradient at +-1 becomes 0",
        functions=("torch.asin", "torch.arcsin"), methods=("asin", "arcsin"), inplace=True,
        constants={"lo": lambda b: -1.0, "hi": lambda b: 1.0},
        sample=Sample(operands(tensor(1.0, -2.0, 0.5)), operands(tensor(-0.5, 0.0, 0.75))),
    ),
    Rule(
        "atanh", g.clamped("lo", "hi"),
        poles=(-1.0, 1.0),
        reason="atanh of +-1 is +-inf, outside [-1, 1] NaN",
        action="operand clamped to the floats strictly inside (-1, 1)",
        functions=("torch.atanh", "torch.arctanh"), methods=("atanh", "arctanh"), inplace=True,
        constants={"lo": lambda b: b.above_minus_one, "hi": lambda b: b.below_one},
        sample=Sample(operands(tensor(1.0, -1.0, 0.5)), operands(tensor(-0.5, 0.0, 0.75))),
    ),
    Rule(
        "logit", g.logit,
        poles=(0.0, 1.0),
        reason="logit of 0 or 1 is infinite (and 1 - 1e-8 == 1 in float32)",
        action="an operand <= 0 read as tiny, >= 1 as the next float below 1 (or the user's eps, if tighter)",
        functions=("torch.logit", "torch.special.logit"), methods=("logit",), inplace=True,
        constants={"lo": lambda b: b.tiny, "hi": lambda b: b.below_one},
        sample=Sample(operands(tensor(0.0, 1.0, 0.5)), operands(tensor(0.25, 0.5, 0.75))),
    ),
    Rule(
        "std", g.finite_result,
        reason="NaN with too few elements; overflow; infinite gradient at zero spread",
        action="a NaN result becomes 0 unless an operand holds a NaN, and overflow saturates; "
        "non-finite gradients become 0",
        functions=("torch.std", "torch.std_mean"), methods=("std",),
        sample=Sample(operands(tensor(1.0)), operands(tensor(1.0, 2.0, 4.0))),
    ),
    Rule(
        "var", g.finite_result,
        reason="NaN with too few elements; overflow",
        action="a NaN result becomes 0 unless an operand holds a NaN, and overflow saturates; "
        "non-finite gradients become 0",
        functions=("torch.var", "torch.var_mean"), methods=("var",),
        sample=Sample(operands(tensor(1.0)), operands(tensor(1.0, 2.0, 4.0))),
    ),
    Rule(
        "mean", g.finite_result,
        reason="over an empty selection it is 0 / 0 = NaN (a masked loss with no valid element: "
        "ZoeDepth's SILog loss on a depth map with no valid pixel); so is a median of no element "
        "(median scaling of a depth map with no valid pixel)",
        action="a NaN result becomes 0 unless an operand holds a NaN; a mean over a non-empty "
        "selection is left as written",
        functions=("torch.mean", "torch.nanmean", "torch.median", "torch.nanmedian"),
        methods=("mean", "nanmean", "median", "nanmedian"), inplace=False,
        safe_if=_nonempty_mean,
        sample=Sample(operands(tensor()), operands(tensor(1.0, 2.0, 4.0))),
    ),
    Rule(
        "segment_reduce", g.segment_reduce,
        reason="an empty segment (length 0) is a mean of nothing, 0 / 0 = NaN, or the identity "
        "of max/min, -+inf (alibaba/TorchEasyRec#104: an item with no category id)",
        action="an empty segment whose value is not finite gives 0 with a zero gradient, as torch's "
        "other reductions give an empty group; a sum's 0, a prod's 1, an initial= value and every "
        "non-empty segment are left as written",
        functions=("torch.segment_reduce",), methods=(), inplace=False,
        sample=Sample(operands(tensor(1.0, 2.0, 3.0), "mean", lengths=tensor(3, 0, dtype=torch.int64)),
                      operands(tensor(1.0, 2.0, 3.0), "mean", lengths=tensor(2, 1, dtype=torch.int64)),
                      second_order=False),  # torch has no double backward of segment_reduce
    ),
    Rule(
        "xlogy", g.xlogy, stable=True,
        poles=(0.0,), pole_operand=1,
        reason="xlogy(x, 0) is -inf for x != 0",
        action="where the first operand is not 0, a second operand <= 0 read as tiny and +inf as max; "
        "the result saturated",
        functions=("torch.xlogy", "torch.special.xlogy"), methods=("xlogy",), inplace=True,
        constants=TINY_MAX,
        sample=Sample(operands(tensor(1.0, 0.0), tensor(0.0, 0.0)), operands(tensor(1.0, 2.0), tensor(0.5, 3.0))),
    ),
    Rule(
        "cross_entropy", g.logits_loss,
        reason="0/0 in the mean when every target is ignored; +inf logits, or a row of -inf, give NaN",
        action="the loss saturated; a NaN loss the op makes (+inf logits, a row of -inf, every "
        "target ignored) becomes 0, a NaN in the logits stays NaN; non-finite gradients become 0 "
        "(the logits are read, not copied; -inf logits keep their exact loss and gradient)",
        functions=("F.cross_entropy",), modules=("nn.CrossEntropyLoss",),
        sample=Sample(operands(_LOGITS, tensor(-100, -100, -100, dtype=torch.int64)),
               operands(_LOGITS, tensor(0, 3, 1, dtype=torch.int64)), ctor={"nn.CrossEntropyLoss": ()}),
    ),
    Rule(
        "nll_loss", g.logits_loss,
        reason="0/0 in the mean when every target is ignored",
        action="the loss saturated, a NaN loss becomes 0 unless an operand holds a NaN; "
        "non-finite gradients become 0 (the input is read, not copied)",
        functions=("F.nll_loss",), modules=("nn.NLLLoss",),
        sample=Sample(operands(_LOGITS, tensor(-100, -100, -100, dtype=torch.int64)),
               operands(_LOGITS, tensor(0, 3, 1, dtype=torch.int64)), ctor={"nn.NLLLoss": ()}),
    ),
    Rule(
        "mse_loss", g.mean_reduced(),
        reason="the default reduction, a mean, over an empty selection is 0 / 0 = NaN (a depth loss "
        "mse_loss(pred[valid], depth[valid]) on a map with no valid pixel, pytorch#50224); "
        "aot_autograd's decomposition of the backward of mse_loss, smooth_l1_loss and huber_loss "
        "raises ZeroDivisionError there, and that of multi_margin_loss and multilabel_margin_loss "
        "is NaN where the eager kernel is not",
        action="a mean over no element is the loss with reduction='none', summed: 0 with exact zero "
        "gradients, no division in the kernel or in a decomposition; a loss over a non-empty "
        "selection is left as written",
        functions=("F.mse_loss", "F.l1_loss", "F.smooth_l1_loss", "F.huber_loss", "F.margin_ranking_loss",
                   "F.hinge_embedding_loss", "F.multilabel_soft_margin_loss", "F.multi_margin_loss",
                   "F.multilabel_margin_loss"),
        modules=("nn.MSELoss", "nn.L1Loss", "nn.SmoothL1Loss", "nn.HuberLoss", "nn.MarginRankingLoss",
                 "nn.HingeEmbeddingLoss", "nn.MultiLabelSoftMarginLoss", "nn.MultiMarginLoss",
                 "nn.MultiLabelMarginLoss"),
        safe_if=nonempty_operands(),
        sample=Sample(operands(tensor(), tensor(grad=False)),
                      operands(tensor(1.0, -2.0, 0.5), tensor(0.5, 0.0, 1.0, grad=False)),
                      ctor=dict.fromkeys(("nn.MSELoss", "nn.L1Loss", "nn.SmoothL1Loss", "nn.HuberLoss",
                                          "nn.MarginRankingLoss", "nn.HingeEmbeddingLoss",
                                          "nn.MultiLabelSoftMarginLoss", "nn.MultiMarginLoss",
                                          "nn.MultiLabelMarginLoss"), ()),
                      spellings={
                          **dict.fromkeys(("F.margin_ranking_loss", "nn.MarginRankingLoss"),
                                          operands(tensor(), tensor(), tensor(grad=False))),
                          **dict.fromkeys(("F.multilabel_soft_margin_loss", "nn.MultiLabelSoftMarginLoss"),
                                          operands(tensor(shape=(0, 3)), tensor(shape=(0, 3), grad=False))),
                          **dict.fromkeys(("F.multi_margin_loss", "nn.MultiMarginLoss"),
                                          operands(tensor(shape=(0, 3)), tensor(dtype=torch.int64))),
                          **dict.fromkeys(("F.multilabel_margin_loss", "nn.MultiLabelMarginLoss"),
                                          operands(tensor(shape=(0, 3)), tensor(shape=(0, 3), dtype=torch.int64))),
                      },
                      # the eager kernel gives 0 (multilabel_margin_loss: memory it never wrote);
                      # aot_autograd's decomposition gives 0 / 0 = NaN
                      compiled=("F.multi_margin_loss", "nn.MultiMarginLoss", "F.multilabel_margin_loss",
                                "nn.MultiLabelMarginLoss")),
    ),
    Rule(
        "linear_cross_entropy", g.mean_reduced(g.finite_call),
        reason="a linear, then cross_entropy, fused (torch 2.13): every target ignored is 0 / 0 = NaN in "
        "the mean, as cross_entropy's (pytorch#70348; the chunked form divides by NaN on purpose "
        "there), and so is a mean over no row",
        action="a NaN loss the op makes (every target ignored) becomes 0 and its non-finite gradients "
        "0, a NaN in an operand stays NaN; a mean over no row is the loss with reduction='none', "
        "summed: 0",
        functions=("F.linear_cross_entropy",), methods=(), inplace=False,
        sample=Sample(operands(tensor(0.5, -1.0, 2.0, 0.0, 1.5, -0.5, shape=(2, 3)), tensor(*[0.5] * 12, shape=(4, 3)),
                               tensor(-100, -100, dtype=torch.int64)),
                      operands(tensor(0.5, -1.0, 2.0, 0.0, 1.5, -0.5, shape=(2, 3)), tensor(*[0.5] * 12, shape=(4, 3)),
                               tensor(1, 3, dtype=torch.int64)),
                      inlined=("F.linear_cross_entropy",)),  # F.linear, then F.cross_entropy
    ),
    Rule(
        "kl_div", g.loss,
        reason="-inf log-probabilities against a zero target give 0 * inf = NaN",
        action="+-inf operands to +-sat; the result saturated; non-finite gradients become 0",
        functions=("F.kl_div",), modules=("nn.KLDivLoss",),
        sample=Sample(operands(tensor(0.0, -INF, shape=(1, 2)), tensor(1.0, 0.0, grad=False, shape=(1, 2)), reduction="sum"),
               operands(tensor(-1.0, -0.5, shape=(1, 2)), tensor(0.5, 0.5, grad=False, shape=(1, 2)), reduction="sum"),
               ctor={"nn.KLDivLoss": ()}),
    ),
    Rule(
        "cosine_similarity", g.composite_call,
        reason="+-inf operands give NaN; in float16 a zero vector gives 0/0 (eps 1e-8 is 0 there)",
        action="a NaN result (an infinite operand, float16's 0/0) becomes 0 unless an operand "
        "holds a NaN, non-finite gradients 0 (a cosine rounded past +-1 is the original's: "
        "acos/asin guard their operands)",
        functions=("F.cosine_similarity", "torch.cosine_similarity"),
        modules=("nn.CosineSimilarity",),
        sample=Sample(operands(tensor(INF, 1.0, shape=(1, 2)), tensor(1.0, 1.0, grad=False, shape=(1, 2))),
               operands(tensor(2.0, 1.0, shape=(1, 2)), tensor(1.0, 3.0, grad=False, shape=(1, 2))),
               ctor={"nn.CosineSimilarity": ()}),
    ),
    Rule(
        "multi_head_attention", g.attention,
        reason="a query whose every key is masked gives NaN (need_weights=True path); in "
        "float16, q @ k^T past 65504 is inf and its softmax NaN (pytorch#60939)",
        action="torch's own code runs with each call inside it guarded: a fully masked row's "
        "softmax becomes uniform; in float16 the projections saturate and an overflowed score "
        "keeps its order (+inf to max, -inf kept); every finite result keeps its bits",
        functions=("F.multi_head_attention_forward",), modules=("nn.MultiheadAttention",),
        sample=Sample(_mha(masked=True), _mha(masked=False), ctor={"nn.MultiheadAttention": (8, 2)},
               dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64)),
    ),
    Rule(
        "mha_fast_path", g.finite_result,
        reason="nn.MultiheadAttention's inference fast path (eval, no grad): a query whose every "
        "key is masked gives NaN, whatever the mask values; so does, in float16, a token whose "
        "projection or scores overflow inside the fused kernel",
        action="a NaN result becomes 0 unless an operand holds a NaN (what "
        "scaled_dot_product_attention gives a fully masked row); the fused kernel's insides "
        "cannot be guarded: a float16 model that overflows there gets the training path's "
        "saturated answer only with grad enabled",
        functions=("torch._native_multi_head_attention",),
    ),
    Rule(
        "encoder_layer_fast_path", g.finite_result,
        reason="nn.TransformerEncoderLayer's inference fast path (eval, no grad): a fully padded "
        "sequence gives NaN, whatever the mask values",
        action="a NaN result becomes 0 unless an operand holds a NaN (what "
        "scaled_dot_product_attention gives such a row)",
        functions=("torch._transformer_encoder_layer_fwd",),
    ),
    # -- ops whose unsafe set is no simple domain: saturate the result, fence the gradients ------
    Rule(
        "binary_cross_entropy_with_logits", g.loss,
        reason="a -inf logit against a positive target (or +inf against 0) gives inf, 0 * inf = NaN",
        action="+-inf logits to +-sat (the loss and its gradient are then exact and finite)",
        functions=("F.binary_cross_entropy_with_logits",), modules=("nn.BCEWithLogitsLoss",),
        sample=Sample(operands(tensor(-INF, 1.0), tensor(1.0, 0.0, grad=False)),
                      operands(tensor(-2.0, 1.0), tensor(1.0, 0.0, grad=False)),
                      ctor={"nn.BCEWithLogitsLoss": ()}),
    ),
    Rule(
        "ctc_loss", g.ctc,
        reason="an input shorter than its target has no alignment: inf loss, NaN gradient",
        action="zero_infinity=True: such a loss and its gradient become 0; +-inf log-probs to +-sat",
        functions=("F.ctc_loss", "torch.ctc_loss"), modules=("nn.CTCLoss",),
        sample=Sample(
            operands(tensor(-1.0986, -1.0986, -1.0986, shape=(1, 1, 3)), tensor(1, 2, dtype=torch.int64, shape=(1, 2)),
                     tensor(1, dtype=torch.int64), tensor(2, dtype=torch.int64)),
            operands(tensor(*[-1.0986] * 12, shape=(4, 1, 3)), tensor(1, 2, dtype=torch.int64, shape=(1, 2)),
                     tensor(4, dtype=torch.int64), tensor(2, dtype=torch.int64)),
            ctor={"nn.CTCLoss": ()}, dtypes=(torch.float32, torch.float64), second_order=False,
            dynamo=False),
    ),
    Rule(
        "layer_norm", g.finite_call,
        reason="a constant row has zero variance: with an eps the dtype rounds to 0 (1e-12 in "
        "float16), 0/0 in value and gradient",
        action="a non-finite result saturates (NaN to 0 unless an operand holds a NaN); "
        "non-finite gradients become 0",
        functions=("F.layer_norm", "torch.layer_norm", "torch.native_layer_norm"),
        sample=Sample(operands(tensor(0.0, 0.0, shape=(1, 2)), (2,), None, None, 1e-12),
                      operands(tensor(1.0, 3.0, shape=(1, 2)), (2,)), dtypes=(torch.float16,)),
        only_dtypes=(torch.float16,),  # an eps such as 1e-12 is 0 only in float16
        autocast_float32=True,
    ),
    Rule(
        "norm", g.composite_call,
        reason="at 0 its second derivative is NaN (a gradient penalty on a zero vector), and with "
        "ord > 2 a tiny vector's gradient is 0/0; in float16 a product of ordinary values overflows",
        action="the result saturated; non-finite gradients become 0",
        functions=("torch.linalg.vector_norm", "torch.norm", "torch.linalg.norm", "torch.linalg.matrix_norm"),
        methods=("norm",), inplace=False,
        sample=Sample(operands(tensor("max", "max", shape=(1, 2))), operands(tensor(3.0, 4.0, shape=(1, 2)))),
    ),
    Rule(
        "normalize", g.composite_call,
        reason="x / max(||x||, eps): the default eps 1e-12 is 0 in float16, so a zero vector gives 0/0; "
        "in every dtype its second derivative is NaN",
        action="a NaN result becomes 0 unless an operand holds a NaN; "
        "non-finite gradients become 0",
        functions=("F.normalize",),
        # float32 too: a zero vector's second derivative is NaN (the census's probe)
        sample=Sample(operands(tensor(0.0, 0.0, shape=(1, 2))), operands(tensor(3.0, 4.0, shape=(1, 2))),
                      dtypes=(torch.float16,)),
    ),
    Rule(
        "weight_norm", g.finite_call,
        reason="v * g / ||v|| is 0/0 for a zero weight",
        action="a NaN result becomes 0 unless an operand holds a NaN; "
        "non-finite gradients become 0",
        functions=("torch._weight_norm",), methods=(),
        sample=Sample(operands(tensor(0.0, 0.0, 0.0, 0.0, shape=(2, 2)), tensor(1.0, 1.0, shape=(2, 1)), 0),
                      operands(tensor(1.0, 2.0, 3.0, 4.0, shape=(2, 2)), tensor(1.0, 2.0, shape=(2, 1)), 0)),
    ),
    Rule(
        "eigh", g.finite_call,
        reason="the backward divides by the gaps between eigenvalues: repeated ones give inf/NaN",
        action="non-finite gradients become 0 (the values are exact)",
        functions=("torch.linalg.eigh", "torch.linalg.svd", "torch.svd"), methods=(),
        sample=Sample(operands(tensor(1.0, 0.0, 0.0, 1.0, shape=(2, 2))),
                      operands(tensor(2.0, 0.5, 0.5, 1.0, shape=(2, 2))), dtypes=(torch.float32, torch.float64)),
    ),
    Rule(
        "logdet", g.finite_call,
        reason="a singular matrix has log|det| = -inf, with an infinite gradient",
        action="the result saturated at -sat; non-finite gradients become 0",
        functions=("torch.logdet", "torch.linalg.slogdet", "torch.slogdet"),
        sample=Sample(operands(tensor(1.0, 1.0, 1.0, 1.0, shape=(2, 2))),
                      operands(tensor(2.0, 1.0, 1.0, 2.0, shape=(2, 2))), dtypes=(torch.float32, torch.float64),
                      second_order=False),  # torch raises (a singular solve) in logdet's double backward
    ),
    Rule(
        "erfinv", g.clamped("lo", "hi"),
        poles=(-1.0, 1.0),
        reason="erfinv of +-1 is +-inf, outside [-1, 1] NaN",
        action="operand clamped to the floats strictly inside (-1, 1)",
        constants={"lo": lambda b: b.above_minus_one, "hi": lambda b: b.below_one},
        sample=Sample(operands(tensor(1.0, -2.0, 0.5)), operands(tensor(-0.5, 0.0, 0.75)),
                      dtypes=(torch.float32, torch.float64)),
    ),
    Rule(
        "acosh", g.clamped("lo", "hi", singular=g.at_one),
        reason="acosh below 1 is NaN; its gradient at 1 is infinite",
        action="operand clamped to [1, max]; the infinite gradient at 1 becomes 0",
        functions=("torch.acosh", "torch.arccosh"), methods=("acosh", "arccosh"),
        constants={"lo": lambda b: 1.0, "hi": lambda b: b.max},
        sample=Sample(operands(tensor(1.0, 0.5, 2.0)), operands(tensor(1.5, 2.0, 3.0))),
    ),
    Rule(
        "logaddexp", g.finite_call,
        reason="logaddexp(-inf, -inf) is -inf with a NaN gradient; +inf gives NaN gradients",
        action="the result saturated; non-finite gradients become 0",
        functions=("torch.logaddexp", "torch.logaddexp2"), methods=("logaddexp", "logaddexp2"),
        sample=Sample(operands(tensor(-INF, 1.0), tensor(-INF, 2.0)), operands(tensor(-1.0, 2.0), tensor(0.5, 1.0))),
    ),
    Rule(
        "cosh", g.finite_call,
        reason="cosh and sinh overflow to inf past log(2 max)",
        action="the result saturated at +-sat; non-finite gradients become 0",
        functions=("torch.cosh", "torch.sinh"), methods=("cosh", "sinh"),
        sample=Sample(operands(tensor(1000.0, 1.0)), operands(tensor(-1.0, 0.0, 2.0))),
    ),
    Rule(
        "lgamma", g.finite_call,
        poles=(0.0,),
        reason="lgamma, digamma and polygamma have poles at 0, -1, -2, ... (mvlgamma at (p - 1) / 2 "
        "and below): inf values, inf/NaN gradients",
        action="the result saturated; non-finite gradients become 0",
        functions=("torch.lgamma", "torch.special.gammaln", "torch.digamma", "torch.special.digamma",
                   "torch.special.psi", "torch.polygamma", "torch.special.polygamma", "torch.mvlgamma",
                   "torch.special.multigammaln"),
        methods=("lgamma", "digamma", "polygamma", "mvlgamma"),
        sample=Sample(operands(tensor(0.0, -1.0, 2.0)), operands(tensor(0.5, 1.5, 3.0)),
                      dtypes=(torch.float32, torch.float64),
                      spellings={"torch.polygamma": operands(1, tensor(0.0, -1.0, 2.0)),
                                 "torch.special.polygamma": operands(1, tensor(0.0, -1.0, 2.0)),
                                 "Tensor.polygamma": operands(tensor(0.0, -1.0, 2.0), 1),
                                 **dict.fromkeys(("torch.mvlgamma", "torch.special.multigammaln", "Tensor.mvlgamma"),
                                                 operands(tensor(0.0, 2.0), 1))}),
    ),
    Rule(
        "poisson_nll_loss", g.composite_call,
        reason="with log_input=True the loss computes exp(input), which overflows",
        action="the result saturated; non-finite gradients become 0",
        functions=("F.poisson_nll_loss",), modules=("nn.PoissonNLLLoss",),
        sample=Sample(operands(tensor(1000.0, 1.0), tensor(1.0, 2.0, grad=False)),
                      operands(tensor(0.5, -1.0), tensor(1.0, 2.0, grad=False)), ctor={"nn.PoissonNLLLoss": ()}),
    ),
    Rule(
        "atan2", g.finite_call,
        reason="with infinite operands the gradient is inf/inf = NaN",
        action="non-finite gradients become 0",
        functions=("torch.atan2", "torch.arctan2"), methods=("atan2", "arctan2"),
        sample=Sample(operands(tensor(INF, 1.0), tensor(INF, 0.0)), operands(tensor(1.0, -1.0), tensor(2.0, 3.0))),
    ),
    Rule(
        "gumbel_softmax", g.finite_call,
        reason="a temperature of 0 divides by 0; log of a zero exponential sample is -inf",
        action="a NaN result becomes 0 unless an operand holds a NaN; "
        "non-finite gradients become 0",
        functions=("F.gumbel_softmax",),
        sample=Sample(operands(tensor(1.0, 2.0, 0.5, shape=(1, 3)), tau=0.0),
                      operands(tensor(1.0, 2.0, 0.5, shape=(1, 3)), tau=0.5)),
    ),
    Rule(
        "remainder", g.finite_call,
        reason="remainder/fmod by 0 is NaN, floor_divide by 0 +-inf; the gradient in the divisor "
        "(-floor(x / y)) overflows for a tiny divisor",
        action="NaN (a zero divisor) becomes 0 unless an operand holds a NaN, +-inf +-sat; "
        "non-finite gradients become 0",
        functions=("torch.remainder", "torch.fmod", "torch.floor_divide"),
        operators=("operator.mod", "operator.floordiv"),
        inplace_operators=(("operator.imod", "operator.mod"), ("operator.ifloordiv", "operator.floordiv")),
        methods=("remainder", "fmod", "floor_divide"), inplace=True,
        safe_if=_nonzero_divisor,
        sample=Sample(operands(tensor(1.0, 0.0, 2.0), tensor(0.0, 0.0, 1.0)),
                      operands(tensor(5.0, -3.0, 2.5), tensor(2.0, 2.0, -1.5)),
                      # floor_divide has no derivative: its operands never carry a gradient
                      spellings=dict.fromkeys(
                          ("torch.floor_divide", "Tensor.floor_divide", "operator.floordiv", "operator.ifloordiv"),
                          operands(tensor(1.0, 0.0, 2.0, grad=False), tensor(0.0, 0.0, 1.0, grad=False)))),
    ),
    Rule(
        "hypot", g.finite_call,
        reason="the gradient x / hypot(x, y) is 0/0 at (0, 0)",
        action="the result saturated; non-finite gradients become 0",
        sample=Sample(operands(tensor(0.0, 3.0), tensor(0.0, 4.0)), operands(tensor(3.0, 1.0), tensor(4.0, 2.0))),
    ),
    Rule(
        "addcdiv", g.finite_call,
        reason="x + v * t1 / t2 divides by t2: 0/0 is NaN, t1/0 inf",
        action="a NaN result becomes 0 unless an operand holds a NaN, +-inf +-sat; non-finite "
        "gradients become 0",
        sample=Sample(operands(tensor(1.0, 1.0), tensor(0.0, 1.0), tensor(0.0, 0.0)),
                      operands(tensor(1.0, 2.0), tensor(3.0, -4.0), tensor(2.0, 4.0))),
    ),
    Rule(
        "copysign", g.finite_call,
        reason="the second derivative at a zero magnitude is NaN",
        action="non-finite gradients become 0",
        sample=Sample(operands(tensor(0.0, 1.0), tensor(0.0, -2.0)), operands(tensor(1.5, -2.0), tensor(-1.0, 3.0))),
    ),
    Rule(
        "sinc", g.finite_call,
        reason="sin(pi x) / (pi x): the second derivative at 0 is NaN",
        action="non-finite gradients become 0 (the values are exact)",
        sample=Sample(operands(tensor(0.0, 0.5)), operands(tensor(0.25, 1.5, -2.5))),
    ),
    Rule(
        "igamma", g.finite_call,
        reason="the regularised incomplete gamma functions are 0/0 at a = 0, x = 0",
        action="a NaN result becomes 0 unless an operand holds a NaN; "
        "non-finite gradients become 0",
        functions=("torch.igamma", "torch.igammac", "torch.special.gammainc", "torch.special.gammaincc"),
        methods=("igamma", "igammac"),
        sample=Sample(operands(tensor(0.0, 1.0, grad=False), tensor(0.0, 2.0)),
                      operands(tensor(0.5, 1.0, grad=False), tensor(1.0, 2.0))),
    ),
    Rule(
        "ndtri", g.finite_call,
        poles=(0.0, 1.0),
        reason="the inverse normal CDF is -inf at 0 and +inf at 1, NaN outside [0, 1]",
        action="the result saturated at +-sat (NaN to 0 unless an operand holds a NaN); "
        "non-finite gradients become 0",
        functions=("torch.special.ndtri",),
        sample=Sample(operands(tensor(0.0, 1.0, 0.5)), operands(tensor(0.25, 0.5, 0.75)),
                      dtypes=(torch.float32, torch.float64)),
    ),
    Rule(
        "entr", g.finite_call,
        reason="-x log x is -inf for x < 0 by definition; its gradient at 0 is infinite",
        action="the result saturated at -sat; non-finite gradients become 0",
        functions=("torch.special.entr",),
        sample=Sample(operands(tensor(-0.5, 0.0, 0.5)), operands(tensor(0.25, 0.5, 2.0))),
    ),
    Rule(
        "xlog1py", g.finite_call,
        poles=(-1.0,), pole_operand=1,
        reason="x * log1p(y) is -inf at y = -1, NaN below",
        action="the result saturated; non-finite gradients become 0",
        functions=("torch.special.xlog1py",),
        sample=Sample(operands(tensor(1.0, 2.0), tensor(-1.0, -2.0)), operands(tensor(1.0, 2.0), tensor(0.5, 3.0))),
    ),
    Rule(
        "mish", g.finite_call,
        reason="x tanh(softplus(x)): the second derivative is NaN once exp(x) overflows",
        action="non-finite gradients become 0 (the values are exact)",
        functions=("F.mish",),
        sample=Sample(operands(tensor(1000.0, 1.0)), operands(tensor(-1.0, 0.5, 3.0))),
    ),
    Rule(
        "soft_margin_loss", g.finite_call,
        reason="log(1 + exp(-y x)) overflows once -y x passes log(max)",
        action="the result saturated; non-finite gradients become 0",
        functions=("F.soft_margin_loss",),
        sample=Sample(operands(tensor(-1000.0, 1.0), tensor(1.0, 1.0, grad=False)),
                      operands(tensor(0.5, -1.0), tensor(1.0, -1.0, grad=False))),
    ),
    Rule(
        "binary_cross_entropy", g.finite_call,
        reason="at p = 0 or 1 the gradient in the target, log(1 - p) - log(p), is infinite, and in "
        "float16 (its eps 1e-12 is 0 there) so is (p - y) / (p (1 - p))",
        action="the result saturated; non-finite gradients become 0",
        functions=("F.binary_cross_entropy",),
        # a learned (soft) target's gradient log(1 - p) - log(p) is infinite at p = 0 or 1
        sample=Sample(operands(tensor(0.0, 1.0), tensor(0.0, 1.0)),
                      operands(tensor(0.25, 0.5), tensor(1.0, 0.0))),
    ),
    Rule(
        "gaussian_nll_loss", g.mean_reduced(g.finite_call),
        reason="float16: 0.5 (log var + (x - mu)^2 / var) with its eps (1e-6) overflows, and its "
        "gradients at a zero variance are inf/NaN; in every dtype its default reduction, a mean, "
        "over an empty selection is 0 / 0 = NaN",
        action="float16: the result saturated, non-finite gradients become 0; in every dtype a mean "
        "over no element is the loss with reduction='none', summed (0, zero gradients)",
        safe_if=nonempty_operands((torch.float16,)),
        functions=("F.gaussian_nll_loss",),
        sample=Sample(operands(tensor(1.0, 1.0), tensor(0.0, 0.0), tensor(0.0, 1.0)),
                      operands(tensor(0.5, 1.0), tensor(0.0, 1.5), tensor(1.0, 2.0)), dtypes=(torch.float16,),
                      dynamo=False),  # torch.any(var < 0) in its body: a graph break
    ),
    Rule(
        "cosine_embedding_loss", g.mean_reduced(g.composite_call),
        reason="float16: the cosine of a zero vector is 0/0 (its eps is 0 there); in every dtype its "
        "default reduction, a mean, over an empty selection is 0 / 0 = NaN",
        action="float16: a NaN result becomes 0 unless an operand holds a NaN, non-finite "
        "gradients become 0; in every dtype a mean over no element is the loss with "
        "reduction='none', summed (0, zero gradients)",
        safe_if=nonempty_operands((torch.float16,), autocast_float32=True),
        functions=("F.cosine_embedding_loss",),
        sample=Sample(operands(tensor(0.0, 0.0, shape=(1, 2)), tensor(0.0, 0.0, shape=(1, 2)),
                               tensor(1.0, grad=False)),
                      operands(tensor(1.0, 2.0, shape=(1, 2)), tensor(2.0, 1.0, shape=(1, 2)),
                               tensor(1.0, grad=False)), dtypes=(torch.float16,)),
    ),
    Rule(
        "pairwise_distance", g.finite_call,
        reason="||x - y|| has a 0/0 gradient at x = y (its eps is 0 in float16) and a NaN second "
        "derivative; it overflows past max",
        action="the result saturated; non-finite gradients become 0",
        functions=("F.pairwise_distance", "torch.pairwise_distance", "torch.dist"), methods=("dist",),
        sample=Sample(operands(tensor(1.0, 2.0, shape=(1, 2)), tensor(1.0, 2.0, shape=(1, 2)), 2.0, 0.0),
                      operands(tensor(1.0, 2.0, shape=(1, 2)), tensor(4.0, -2.0, shape=(1, 2))),
                      spellings=dict.fromkeys(("torch.dist", "Tensor.dist"), operands(
                          tensor(1.0, 2.0, shape=(1, 2)), tensor(1.0, 2.0, shape=(1, 2)), 2.0))),
    ),
    Rule(
        "triplet_margin_loss", g.composite_call,
        reason="distances of equal points have 0/0 gradients (pairwise_distance); overflow past max",
        action="the result saturated; non-finite gradients become 0",
        functions=("F.triplet_margin_loss", "F.triplet_margin_with_distance_loss"),
        sample=Sample(operands(tensor("max", "max", shape=(1, 2)), tensor("-max", "-max", shape=(1, 2)),
                               tensor(0.0, 0.0, shape=(1, 2))),
                      operands(tensor(1.0, 2.0, shape=(1, 2)), tensor(1.5, 2.0, shape=(1, 2)),
                               tensor(-1.0, 0.0, shape=(1, 2))),
                      inlined=("F.triplet_margin_with_distance_loss",)),
    ),
    Rule(
        "renorm", g.finite_call,
        reason="x * maxnorm / ||x||: the second derivative of a zero slice's norm is NaN",
        action="non-finite gradients become 0",
        sample=Sample(operands(tensor(0.0, 0.0, 0.0, 0.0, shape=(2, 2)), 2, 0, 0.5),
                      operands(tensor(1.0, 2.0, 3.0, 4.0, shape=(2, 2)), 2, 0, 0.5)),
    ),
    Rule(
        "cov", g.finite_call,
        reason="corrcoef divides by the standard deviations (0 for a constant variable); cov "
        "divides by its degrees of freedom, which weights can make 0",
        action="a NaN result becomes 0 unless an operand holds a NaN; "
        "non-finite gradients become 0",
        functions=("torch.cov", "torch.corrcoef"), methods=("cov", "corrcoef"),
        sample=Sample(operands(tensor(1.0, 1.0, 2.0, 3.0, shape=(2, 2)), correction=2),
                      operands(tensor(1.0, 2.0, 2.0, 5.0, shape=(2, 2))),
                      # a constant variable (the first row) has no spread
                      spellings=dict.fromkeys(("torch.corrcoef", "Tensor.corrcoef"),
                                              operands(tensor(1.0, 1.0, 2.0, 3.0, shape=(2, 2)))),
                      dynamo=False),  # aten.equal on the data: a graph break
    ),
    Rule(
        "batch_norm", g.batch_norm,
        reason="eval mode: a negative running variance (a corrupted buffer) is sqrt(< 0) = NaN; "
        "float16: the gradient at zero variance overflows",
        action="a running variance below -eps read as 0 (a copy); float16: the result saturated, "
        "non-finite gradients become 0",
        functions=("F.batch_norm", "torch.batch_norm", "torch.native_batch_norm",
                   "torch._native_batch_norm_legit", "torch._batch_norm_with_update"),
        sample=Sample(operands(tensor(1.0, 2.0, 3.0, 4.0, shape=(2, 2)), tensor(0.0, 0.0, grad=False),
                               tensor(-1.0, 1.0, grad=False)),
                      operands(tensor(1.0, 2.0, 3.0, 4.0, shape=(2, 2)), tensor(0.5, 0.0, grad=False),
                               tensor(2.0, 1.0, grad=False)),
                      # torch.batch_norm and the native forms: (input, weight, bias, mean, var, training, ...)
                      spellings={
                          "torch.batch_norm": operands(tensor(1.0, 2.0, 3.0, 4.0, shape=(2, 2)), None, None,
                                                       tensor(0.0, 0.0, grad=False), tensor(-1.0, 1.0, grad=False),
                                                       False, 0.1, 1e-5, False),
                          **dict.fromkeys(("torch.native_batch_norm", "torch._native_batch_norm_legit"), operands(
                              tensor(1.0, 2.0, 3.0, 4.0, shape=(2, 2)), None, None, tensor(0.0, 0.0, grad=False),
                              tensor(-1.0, 1.0, grad=False), False, 0.1, 1e-5))}),
    ),
    Rule(
        "group_norm", g.mean_reduced(g.finite_call),
        reason="float16: at zero variance the gradient overflows (1/sqrt(eps) cubed) to inf/NaN; in "
        "every dtype, over an empty spatial dim each group's statistics average no element and "
        "its kernel gives the weight a NaN gradient",
        action="float16: the result saturated, non-finite gradients become 0; in every dtype an empty "
        "input's (empty) result has zero gradients into the weight and bias",
        safe_if=nonempty_operands((torch.float16,), autocast_float32=True),
        functions=("F.group_norm", "torch.group_norm", "torch.native_group_norm"),
        sample=Sample(operands(tensor(0.0, 0.0, 0.0, 0.0, shape=(1, 4)), 1),
                      operands(tensor(1.0, 2.0, 0.0, -1.0, shape=(1, 4)), 1), dtypes=(torch.float16,),
                      spellings={"torch.native_group_norm": operands(  # (x, weight, bias, N, C, HxW, groups, eps)
                          tensor(0.0, 0.0, 0.0, 0.0, shape=(1, 4)), None, None, 1, 4, 1, 1, 1e-5)}),
    ),
    Rule(
        "instance_norm", g.finite_call,
        reason="float16: at zero variance the second derivative overflows to inf/NaN",
        action="float16 only: the result saturated; non-finite gradients become 0",
        functions=("F.instance_norm", "torch.instance_norm"),
        sample=Sample(operands(tensor(0.0, 0.0, 0.0, 0.0, shape=(1, 1, 4))),
                      operands(tensor(1.0, 2.0, 0.0, -1.0, shape=(1, 1, 4))), dtypes=(torch.float16,),
                      spellings={"torch.instance_norm": operands(tensor(0.0, 0.0, 0.0, 0.0, shape=(1, 1, 4)), None, None,
                                                                 None, None, True, 0.1, 1e-5, False)}),
        only_dtypes=(torch.float16,),
    ),
    Rule(
        "rms_norm", g.finite_call,
        reason="float16: near zero the gradient of x / rms(x) overflows to inf",
        action="float16 only: the result saturated; non-finite gradients become 0",
        functions=("F.rms_norm", "torch.rms_norm"),
        sample=Sample(operands(tensor("tiny", shape=(1, 1)), (1,), tensor(1.0, shape=(1,))),
                      operands(tensor(1.0, 2.0, shape=(1, 2)), (2,)), dtypes=(torch.float16,)),
        only_dtypes=(torch.float16,),
    ),
    Rule(
        "inv", g.finite_call,
        reason="a singular (or near-singular) matrix: its inverse, solution, determinant "
        "gradient or condition number is inf/NaN",
        action="the result saturated; non-finite gradients become 0",
        functions=("torch.linalg.inv", "torch.linalg.inv_ex", "torch.inverse", "torch.linalg.pinv",
                   "torch.pinverse", "torch.linalg.solve", "torch.linalg.solve_ex", "torch.linalg.det",
                   "torch.det", "torch.linalg.matrix_power", "torch.linalg.cond", "torch.cholesky_solve",
                   "torch.cholesky_inverse", "torch.linalg.lu_solve", "torch.lu_solve",
                   "torch.linalg.solve_triangular", "torch.triangular_solve", "torch.linalg.ldl_solve",
                   "torch.linalg.lstsq", "torch.linalg.matrix_exp", "torch.matrix_exp"),
        methods=("inverse", "pinverse", "det", "matrix_power", "cholesky_solve", "cholesky_inverse",
                 "lu_solve", "triangular_solve", "matrix_exp"), inplace=False,
        sample=Sample(operands(_TINY_PIVOT), operands(tensor(2.0, 1.0, 1.0, 3.0, shape=(2, 2))),
                      dtypes=(torch.float32, torch.float64),
                      spellings={
                          "torch.linalg.pinv": operands(_TINY_PIVOT, rtol=0.0),
                          **dict.fromkeys(("torch.pinverse", "Tensor.pinverse"), operands(_TINY_PIVOT, rcond=0.0)),
                          **dict.fromkeys(("torch.linalg.solve", "torch.linalg.solve_ex"), operands(_SMALL_PIVOT, _COLUMN)),
                          "torch.linalg.lstsq": operands(tensor(*["tiny"] * 4, shape=(2, 2)), tensor("tiny", "tiny", shape=(2, 1))),
                          **dict.fromkeys(("torch.linalg.det", "torch.det", "Tensor.det", "torch.linalg.cond"),
                                          operands(_ZEROS)),  # singular: 0/0 in the gradients
                          **dict.fromkeys(("torch.linalg.matrix_power", "Tensor.matrix_power"),
                                          operands(_TINY_PIVOT, -2)),
                          **dict.fromkeys(("torch.cholesky_solve", "Tensor.cholesky_solve"),
                                          operands(_COLUMN, _TINY_PIVOT)),
                          **dict.fromkeys(("torch.lu_solve", "Tensor.lu_solve"),
                                          operands(_COLUMN, _TINY_PIVOT, _PIVOTS)),
                          "torch.linalg.lu_solve": operands(_TINY_PIVOT, _PIVOTS, _COLUMN),
                          "torch.linalg.solve_triangular": operands(_TINY_PIVOT, _COLUMN, upper=True),
                          **dict.fromkeys(("torch.triangular_solve", "Tensor.triangular_solve"),
                                          operands(_COLUMN, _TINY_PIVOT)),
                          "torch.linalg.ldl_solve": operands(tensor(0.0, 0.0, 0.0, 0.0, shape=(2, 2), grad=False),
                                                             _PIVOTS, tensor(1.0, 1.0, shape=(2, 1), grad=False)),
                          **dict.fromkeys(("torch.linalg.matrix_exp", "torch.matrix_exp", "Tensor.matrix_exp"),
                                          operands(tensor(1000.0, 0.0, 0.0, 1000.0, shape=(2, 2)))),
                      },
                      breaks=("torch.linalg.lstsq",)),  # its output shape depends on the data
    ),
    Rule(
        "qr", g.finite_call,
        reason="the backward of a matrix decomposition divides by pivots, diagonals or the gaps "
        "between eigen-/singular values: singular or repeated ones give inf/NaN",
        action="non-finite gradients become 0; a non-finite result saturates",
        functions=("torch.linalg.qr", "torch.qr", "torch.linalg.lu", "torch.lu", "torch.linalg.lu_factor",
                   "torch.linalg.lu_factor_ex", "torch.linalg.eig", "torch.linalg.eigvals",
                   "torch.linalg.eigvalsh", "torch.linalg.svdvals", "torch.cholesky", "torch.linalg.cholesky",
                   "torch.linalg.cholesky_ex", "torch.linalg.householder_product", "torch.orgqr",
                   "torch.ormqr", "torch._lu_with_info"),  # Tensor.lu, in Python, calls the last
        methods=("qr", "lu", "cholesky", "orgqr", "ormqr"), inplace=False,
        sample=Sample(operands(_ZEROS), operands(tensor(2.0, 1.0, 1.0, 3.0, shape=(2, 2))),
                      dtypes=(torch.float32, torch.float64),
                      spellings={
                          **dict.fromkeys(("torch.cholesky", "torch.linalg.cholesky", "Tensor.cholesky"),
                                          operands(_NEAR_SINGULAR)),
                          **dict.fromkeys(("torch.linalg.lu_factor", "torch.linalg.lu_factor_ex"),
                                          operands(_NEAR_SINGULAR_5)),
                          "torch.linalg.cholesky_ex": operands(tensor("tiny", "tiny", "tiny", "tiny", shape=(2, 2))),
                          **dict.fromkeys(("torch.linalg.householder_product", "torch.orgqr", "Tensor.orgqr"),
                                          operands(_HALVES_5, tensor(*[0.5] * 5))),
                          **dict.fromkeys(("torch.ormqr", "Tensor.ormqr"),
                                          operands(_HALVES_5, tensor(*[0.5] * 5), _HALVES_5)),
                      }),
    ),
    Rule(
        "matmul", g.finite_low_precision,
        reason="in float16 (max 65504) a product of ordinary activations overflows to inf (a T5 "
        "feed-forward output), and everything after it is inf or NaN",
        action="float16 only: the result saturated at +-sat (identity on finite values); bfloat16, "
        "float32 and float64 (max >= 3.4e38) run as written" + _BACKWARD,
        functions=("torch.matmul", "torch.mm"), operators=("operator.matmul",), methods=("matmul", "mm"),
        inplace=False,
        sample=Sample(operands(tensor(300.0, 300.0, shape=(1, 2)), tensor(300.0, 300.0, shape=(2, 1))),
                      operands(tensor(3.0, 2.0, shape=(1, 2)), tensor(1.0, 4.0, shape=(2, 1))),
                      dtypes=(torch.float16,), backward_overflow=operands(_ZERO_ROW, _MAXES)),
        only_dtypes=(torch.float16,),
    ),
    Rule(
        "linear", g.finite_low_precision,
        reason="nn.Linear in float16: the output overflows to inf on ordinary activations",
        action="float16 only: the result saturated at +-sat; other dtypes run as written" + _BACKWARD,
        functions=("F.linear",),
        sample=Sample(operands(tensor(300.0, 300.0, shape=(1, 2)), tensor(300.0, 300.0, shape=(1, 2))),
                      operands(tensor(3.0, 2.0, shape=(1, 2)), tensor(1.0, 4.0, shape=(1, 2))),
                      dtypes=(torch.float16,), backward_overflow=operands(_ZERO_ROW, _MAXES)),
        only_dtypes=(torch.float16,),
    ),
    Rule(
        "addmm", g.finite_low_precision,
        reason="bias + x @ W in float16 (Hugging Face's Conv1D): overflows to inf",
        action="float16 only: the result saturated at +-sat; other dtypes run as written" + _BACKWARD,
        functions=("torch.addmm",), methods=("addmm",), inplace=False,
        sample=Sample(operands(tensor(0.0, shape=(1, 1)), tensor(300.0, 300.0, shape=(1, 2)),
                               tensor(300.0, 300.0, shape=(2, 1))),
                      operands(tensor(1.0, shape=(1, 1)), tensor(3.0, 2.0, shape=(1, 2)),
                               tensor(1.0, 4.0, shape=(2, 1))), dtypes=(torch.float16,),
                      backward_overflow=operands(tensor(0.0, shape=(1, 1)), _ZERO_ROW, _MAXES)),
        only_dtypes=(torch.float16,),
    ),
    Rule(
        "bmm", g.finite_low_precision,
        reason="batched products (attention scores q @ k^T) in float16 overflow to inf",
        action="float16 only: the result saturated at +-sat; other dtypes run as written" + _BACKWARD,
        functions=("torch.bmm",), methods=("bmm",), inplace=False,
        sample=Sample(operands(tensor(300.0, 300.0, shape=(1, 1, 2)), tensor(300.0, 300.0, shape=(1, 2, 1))),
                      operands(tensor(3.0, 2.0, shape=(1, 1, 2)), tensor(1.0, 4.0, shape=(1, 2, 1))),
                      dtypes=(torch.float16,), backward_overflow=operands(_ZERO_ROWS, _MAXES_BATCH)),
        only_dtypes=(torch.float16,),
    ),
    Rule(
        "baddbmm", g.finite_low_precision,
        reason="masked attention scores (mask + q @ k^T, as nn.MultiheadAttention computes them) "
        "in float16 overflow to inf",
        action="float16 only: the result saturated at +-sat; other dtypes run as written" + _BACKWARD,
        functions=("torch.baddbmm",), methods=("baddbmm",), inplace=False,
        sample=Sample(operands(tensor(0.0, shape=(1, 1, 1)), tensor(300.0, 300.0, shape=(1, 1, 2)),
                               tensor(300.0, 300.0, shape=(1, 2, 1))),
                      operands(tensor(1.0, shape=(1, 1, 1)), tensor(3.0, 2.0, shape=(1, 1, 2)),
                               tensor(1.0, 4.0, shape=(1, 2, 1))), dtypes=(torch.float16,),
                      backward_overflow=operands(tensor(0.0, shape=(1, 1, 1)), _ZERO_ROWS, _MAXES_BATCH)),
        only_dtypes=(torch.float16,),
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

# the rules the running torch has a spelling of (F.linear_cross_entropy is new in 2.13): what
# is guarded, looked up and tested; the docs list the whole table
RULES: tuple[Rule, ...] = tuple(r for r in TABLE if any(True for _ in r.spellings()))
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
        aliases = {alias for alias, _ in rule.dunder_aliases}
        for attr, _, sp, swapped in _operator_calls(rule):  # dynamo writes x.__itruediv__(y)
            if swapped or attr in aliases:  # written out by the user: x.__rtruediv__(2.0)
                sp = sp._replace(name=f"Tensor.{attr}", reflected=swapped)
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


def graph_spelling(target, same_as=None):
    """The (rule, spelling) of a ``call_function`` node calling ``target``; with ``same_as``,
    ``target`` (a stand-in of ``_fastpath``) is made to mean that one."""
    if same_as is not None:
        _BY_TARGET[("call_function", target)] = same_as
    return _BY_TARGET.get(("call_function", target))


def _reflected(dunder: Callable) -> Callable:
    """``a op b`` for a non-tensor ``a``, as torch computes it: ``b.__rop__(a)``, with the
    operands in the order a guard reads them. ``2 / x`` is ``x.reciprocal() * 2``, not a true
    division (other bits), and a reflected dunder may be handed a tensor ``a`` as well."""

    def call(a, b, *rest, **kwargs):
        return dunder(b, a, *rest, **kwargs)

    return call


def _operator_calls(rule: Rule) -> Iterator[tuple[str, object, Spelling, bool]]:
    """Python operators as a TorchFunctionMode sees them: ``x / y`` arrives as a dunder
    (``Tensor.__truediv__``, or ``Tensor.__rtruediv__`` for ``2 / x``, operands swapped)."""
    named = {}
    for name in rule.operators:
        op = _resolve(name)
        dunder = op.__name__.strip("_")
        for attr, swapped in ((f"__{dunder}__", False), (f"__r{dunder}__", True)):
            fn = getattr(Tensor, attr, None)
            if fn is not None:
                named[attr] = (name, None, swapped)
                yield attr, fn, Spelling("operator", name, fn, _reflected(fn) if swapped else fn), swapped
    for ip, op in rule.inplace_operators:
        attr = f"__{_resolve(ip).__name__.strip('_')}__"
        fn = getattr(Tensor, attr, None)
        if fn is not None:
            named[attr] = (ip, _resolve(op), False)
            yield attr, fn, Spelling("operator", ip, fn, fn, _resolve(op)), False
    for alias, of in rule.dunder_aliases:  # the same operator under another dunder name
        fn = getattr(Tensor, alias, None)
        if fn is not None and of in named:
            name, outplace, swapped = named[of]
            yield alias, fn, Spelling("operator", name, fn, _reflected(fn) if swapped else fn, outplace), swapped


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
        # strict torch.export: dynamo hands a mode the operator itself (operator.truediv)
        for name in rule.operators:
            op = _resolve(name)
            index.setdefault(op, (rule, Spelling("operator", name, op, op), False))
        for ip, op in rule.inplace_operators:
            fn = _resolve(ip)
            index.setdefault(fn, (rule, Spelling("operator", ip, fn, fn, _resolve(op)), False))
    return index


CALLS: dict = _call_index()


# A Python operator as the instruction that runs it names it: BINARY_OP's argument from 3.11
# (``dis._nb_ops``: "/", "/="), the opcode's own name on 3.10 (BINARY_TRUE_DIVIDE,
# INPLACE_TRUE_DIVIDE).
_SYMBOL = {"truediv": "/", "floordiv": "//", "mod": "%", "pow": "**", "matmul": "@",
           "add": "+", "sub": "-", "mul": "*"}  # operator.<name> -> its symbol
_OPNAME = {"TRUE_DIVIDE": "/", "FLOOR_DIVIDE": "//", "MODULO": "%", "POWER": "**",
           "MATRIX_MULTIPLY": "@", "ADD": "+", "SUBTRACT": "-", "MULTIPLY": "*"}
_BINARY_OP = dis.opmap.get("BINARY_OP")
_NB = {i: sym for i, (_, sym) in enumerate(getattr(dis, "_nb_ops", ()))}
_OPCODE = {code: _OPNAME[name.partition("_")[2]] + ("=" if name.startswith("INPLACE_") else "")
           for name, code in dis.opmap.items()
           if name.startswith(("BINARY_", "INPLACE_")) and name.partition("_")[2] in _OPNAME}


def _symbol(attr: str) -> str | None:
    """"__truediv__" -> "/", "__itruediv__" -> "/="."""
    name = attr.strip("_")
    if name in _SYMBOL:
        return _SYMBOL[name]
    return _SYMBOL[name[1:]] + "=" if name[:1] == "i" and name[1:] in _SYMBOL else None


def _operator_hits() -> dict:
    """(rule name, symbol) -> the entry of the dunder Python calls for it: ``x / y`` ->
    ``CALLS[Tensor.__truediv__]``, ``z /= y`` -> ``CALLS[Tensor.__itruediv__]``."""
    out: dict = {}
    for rule in RULES:
        if not (rule.guarded or rule.safe):
            continue
        for attr, fn, _, swapped in _operator_calls(rule):
            sym = _symbol(attr)
            hit = CALLS.get(fn)
            if not swapped and sym is not None and hit is not None and hit[0] is rule:
                out.setdefault((rule.name, sym), hit)
                if not sym.endswith("=") and not hasattr(Tensor, f"__i{attr[2:]}"):
                    out.setdefault((rule.name, sym + "="), hit)  # z @= y: Python calls __matmul__
    return out


_OPERATOR_HITS: dict = _operator_hits()
_OPERATOR_RULES = frozenset(name for name, _ in _OPERATOR_HITS)


def operator_at(code, lasti: int) -> str | None:
    """The symbol of the binary operator that instruction ``lasti`` of ``code`` runs ("/",
    "/="), or None: a call, or anything else."""
    co = code.co_code
    if not 0 <= lasti < len(co):
        return None
    op = co[lasti]
    if _BINARY_OP is not None:
        return _NB.get(co[lasti + 1]) if op == _BINARY_OP else None
    return _OPCODE.get(op)


def as_written(hit: tuple[Rule, Spelling, bool], frame) -> tuple[Rule, Spelling, bool]:
    """The table's entry for a call as the user's ``frame`` wrote it. A TorchFunctionMode is
    handed ``Tensor.div`` for ``x / y`` and ``Tensor.div_`` for ``z /= y`` (torch's C dunder
    names its parser's function; ``Tensor.remainder`` for ``x % y``, ``Tensor.matmul`` for
    ``x @ y``), the same on CPython 3.10 to 3.13, while a stand-in on ``Tensor.__truediv__``
    and every fx capture see the operator: where the frame's current instruction is the rule's
    operator, the entry of the dunder Python called for it (``operator.truediv``), so that a
    report names ``x / y`` alike whichever way the call was intercepted. Any other entry, or a
    frame that is not running one of the rule's operators, is returned as it is."""
    rule, sp, swapped = hit
    if swapped or sp.kind != "method" or rule.name not in _OPERATOR_RULES or frame is None:
        return hit
    sym = operator_at(frame.f_code, frame.f_lasti)
    return hit if sym is None else _OPERATOR_HITS.get((rule.name, sym), hit)


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


