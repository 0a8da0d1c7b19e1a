"""docs/guards.md, generated from the rule table (a test checks the file is current).

    python -m nanpass._docs > docs/guards.md
"""

from __future__ import annotations

import torch

from ._constants import bounds
from ._rules import TABLE as RULES  # (every rule, whichever torch writes the docs)

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

HEADER = """# Guards: the contract, op by op

Generated from the rule table (`nanpass/_rules.py`) by `python -m nanpass._docs > docs/guards.md`;
`tests/test_docs.py` fails when this file is out of date.

Every guarded op keeps two promises, tested per op and per dtype (float16, bfloat16, float32,
float64) from the operands each rule carries (`Rule.sample`, `tests/test_rule_contract.py`, eager
and compiled) and property-tested with hypothesis per op family (`tests/test_contract.py`):

1. **Finite.** For operands that are finite or +-inf, the value, the gradient and (eager) the
   second derivative are finite; but for one gradient, left as it is on purpose: an overflow in
   a float16 product's own backward, where a too-large loss scale shows
   ([below](#in-backward-a-float16-products-own-overflow-stays)).
2. **The original's bits wherever it is finite.** Where the original op's value and gradient
   are finite, the guard's are the same, bit for bit, in eager mode: also at +-max, +-inf,
   subnormals, +-0 and the guard's own thresholds and their float neighbours
   (`test_the_extremal_grid_keeps_the_originals_bits`, every rule and dtype, hypothesis over that
   grid). So `x ** -0.5` at +inf is 0, `exp` keeps its own value up to its last finite operand
   (88.7228 in float32), `log` of a subnormal is its own -103, a softmax row with a -inf entry
   next to -max keeps its exact answer, and a cosine that rounding puts at 1.001 stays 1.001
   (acos guards its own operand). A guard changes only what the original makes non-finite
   from finite or infinite operands: **a NaN that arrives as an operand stays NaN** where the
   plain op gives NaN, in the value and the gradient (`tests/test_upstream_nan.py`, every rule
   and dtype, eager and compiled), so a NaN weight, a NaN in the data or one an unguarded op
   made still reaches the user, GradScaler, StepGuard and check mode.

**The model as a whole.** A guard that replaces an infinity (an overflow, an infinite operand,
a pole) does not return +-max but +-sat, the stand-in for an infinity: the largest power of two
whose square is at most max / 16 (32 in float16, 2.3e18 in float32 and bfloat16, 1.7e153 in
float64; exact), and so do the exp family past its overflow point, `pow` for a base moved in
from where the power overflows and `rsqrt(0)`. A product of two guard outputs therefore keeps
the headroom one has (torch_geometric#795: `d[row] * w * d[col]` of two saturated degrees),
and the ordinary op after a guard cannot overflow from the guard's own value: `exp(100) * 2`,
the sum of three overflowing norms, a saturated float16 linear output plus its residual all
stay finite (`tests/test_model_finite.py`, every dtype, eager and compiled;
`tests/test_rule_contract.py::test_two_stand_ins_multiplied_and_added_stay_finite`, every rule).
Every finite result of an op is its own, bit for bit (a value that overflowed has no "right"
finite value; headroom keeps the model finite after it). `log(0)` (and `log2`, `log10`) is
not -sat but `log_zero`, -194.8 in float32 (-30.5 in float16): below the log of every
subnormal, and low enough that `exp(log_zero + v)` is exactly 0 for every `v` whose `exp` is
finite, so a mask written as `logits + mask.log()` (AllenNLP's `masked_log_softmax`) gives its
padded entries weight exactly 0 after a softmax, as the original's -inf does, loss and
gradients bit for bit (`tests/test_model_finite.py::test_a_mask_made_with_log_of_zero_keeps_the_originals_bits`);
and a moderate number, so a log feature of zeros feeding a linear layer still trains, where a
stand-in of -2.3e18 blows its gradient up.

What stays the model's own arithmetic: finite values whose ordinary sum or product passes max.
In float32/float64 that needs operands near 1e38 (the census's overflow policy); in float16
(max 65504) it is the commonest NaN source, products of ordinary activations (attention scores,
a T5 feed-forward output), `x ** 3` past 40. So in float16 — also under autocast — the products
(`matmul`, `linear`, `addmm`, `bmm`) are guarded: an overflow there becomes +-sat, and the
residual add after it stays finite. bfloat16 has float32's range (max 3.4e38): there, as in
float32, products and integer powers run as written, at no cost. Not guarded: a float16 sum or
add of *finite* values past 65504 (two activations of 40000); keep such reductions in float32
(autocast does for `sum`, `mean`, `softmax`, `layer_norm`). docs/census.md lists every op and its
status.

### In backward, a float16 product's own overflow stays

The backward of a float16 product (`matmul`, `linear`, `addmm`, `bmm`, `baddbmm`: an operand's
gradient `grad_out @ B^T`, a weight's `x^T @ grad_out` summed over every token) can pass 65504
from finite operands and a finite incoming gradient. Its guard leaves that infinity exactly as
the original makes it, because it is where a too-large loss scale first overflows in a real
model: the weight gradient of a linear layer, summed over the batch. GradScaler must see it to
skip the step and lower the scale; without a scaler, StepGuard skips the step; check mode
names the product (`non-finite gradient created by the backward of torch.matmul ... from a
finite gradient`). Each product rule carries operands that do this (`Sample.backward_overflow`:
a zero row times `max`, whose gradient sums two `max`), and
`tests/test_rule_contract.py::test_a_gradient_the_ops_own_backward_overflows_is_left_for_gradscaler`
checks that the guard keeps that gradient bit for bit, infinity included, and that check mode
names the op; `tests/test_mixed_precision.py::test_a_float16_products_own_gradient_overflow_reaches_gradscaler`
that the scale backs off as without nanpass.

A fence there, as the other guards fence their own derivatives (0 where the incoming gradient
was finite), was tried and measured (issue 39 item 6): with 512 tokens at a scale of 2^16 the
plain run skips a step and halves the scale every time it grows back to 2^16, where the fenced
one took every step, on weight gradients whose overflowed entries were zeroed, and its scale
reached 2^20 in 8 steps. It also added two autograd nodes and a copy of the result to every
float16 product's forward (the guard otherwise saturates the result in place, and autograd
records nothing). The same overflow can follow a guard that zeroes its own infinite
derivative where a model sums two huge terms that cancel: xformers' FAVOR attention with a
tiny normaliser (xformers#96, `tests/test_real_bugs.py`) has the division's gradient by the
normaliser zeroed, and the numerator's product `q' @ (k'^T v)` still overflows into the query
features' gradient. The true gradient there is what is left when the two huge terms cancel
(in float64: 2e-3 for the query of that test, 2e4 for another): neither 0 nor +-65504 knows it,
and StepGuard skipping the step is the honest answer.

How: a guard changes only the operands outside the op's safe domain. It clamps them into a
closed domain on which the op and its derivative are finite (identity inside: clamp's gradient is
exactly the incoming gradient there, and zero outside), maps +-inf to +-sat with `nan_to_num`, and puts
a *finite-gradient fence* between the clamp and the op: identity forward; in backward a gradient
that is not finite (the derivative of sqrt at 0, of acos at 1) becomes 0 — unless the gradient
that arrived at the guard's result was already non-finite (a loss-scale overflow, a NaN from
further up), or a NaN came in with an operand: the fence hands out a token, a 0-d zero tied to the guard's result, whose gradient
is NaN exactly then (computed on the device, no sync, no Python state), and then the fence
passes the gradient as it came, so GradScaler and StepGuard still see it. A guard zeroes only its
own op's singular derivative (`tests/test_rule_contract.py`, `tests/test_mixed_precision.py`). The op never sees an
unsafe operand, so the double-where trap (`torch.where(d != 0, x / d, 0)` has a NaN gradient at
d = 0, because 0 * inf = NaN) cannot happen. Where the singular points are known (sqrt at 0, acos
and asin at +-1, acosh at 1, `x ** p` at 0 for 0 < p < 1), the op runs on a safe operand there and
the result is its exact value with derivative 0: no derivative of *any* order is infinite, so a
loss on forces (`autograd.grad(energy, positions, create_graph=True)` of `sqrt(sum(d ** 2))` at
zero-padded atoms) trains with finite parameter gradients, where a fence alone masks only the
first-order inf and leaves 0 * inf in the second.

A value the original makes infinite and users then handle themselves: `x ** p` (p < 0) at 0 is
0, as `1 / 0` is under the div guard (TensorFlow's `divide_no_nan`), which is what the usual
handling makes of it (`d = deg ** -0.5; d[d == inf] = 0` in GCN normalisation): the user's mask
then has nothing left to fire on, and the products after it stay finite.

Constants come from `torch.finfo` of the operand and are rounded into its dtype (a fixed `1e-8`
is 0 in float16; `1 - 1e-8` is exactly 1.0 in float32). Per-op overrides (`constants=`) may
only tighten a bound: one that would loosen it in float32 (`{"log": {"lo": 0.0}}`, a `hi` that
rounds to inf) is a `ConfigError` naming the bound, and so is a `lo` above its `hi`. In a
narrower dtype, a value that rounds past that dtype's own safe bound (`1e-8` in float16) is
replaced by it.

Integer, bool and complex operands are never touched: the original op runs.
"""


def _fmt(v: float) -> str:
    return f"{v:.6g}"


def _constants(rule) -> str:
    if not rule.constants:
        return ""
    rows = ["| constant | " + " | ".join(str(d).replace("torch.", "") for d in DTYPES) + " |",
            "|---" * (len(DTYPES) + 1) + "|"]
    for name, fn in rule.constants.items():
        rows.append(f"| `{name}` | " + " | ".join(_fmt(fn(bounds(d))) for d in DTYPES) + " |")
    return "\n".join(rows) + "\n"


def guards_markdown() -> str:
    out = [HEADER]
    guarded = [r for r in RULES if r.guarded]
    out.append("## Summary\n")
    out.append("| op | unsafe because | guard |\n|---|---|---|")
    for r in guarded:
        out.append(f"| [`{r.name}`](#{r.name}) | {r.reason} | {r.action} |")
    out.append("")
    for r in guarded:
        out.append(f"## {r.name}\n")
        out.append(f"- **Unsafe because:** {r.reason}.")
        out.append(f"- **Guard:** {r.action}.")
        if r.stable:
            out.append("- Also the result of an exact stable-form rewrite.")
        if r.only_dtypes:
            names = " and ".join(str(d).replace("torch.", "") for d in r.only_dtypes)
            out.append(f"- **Applies to:** {names} operands only (also under autocast); others are "
                       "not looked at and cost nothing.")
        if r.sample is not None and r.sample.backward_overflow is not None:
            out.append("- **Left in backward:** a gradient that the op's own backward overflows from "
                       "finite operands and a finite incoming gradient stays inf, as in the original; "
                       "check mode names it ([why](#in-backward-a-float16-products-own-overflow-stays)).")
        if r.sample is not None and not r.sample.dynamo:
            out.append("- **Under `torch.compile`:** dynamo graph-breaks on this op, so it runs outside "
                       "any graph, eagerly: `backend=\"nanpass\"` guards it there as it guards every "
                       "call dynamo leaves to eager (docs/deploy.md); `nanpass.harden` guards it.")
        elif r.sample is not None and r.sample.breaks:
            names = ", ".join(f"`{n}`" for n in r.sample.breaks)
            out.append(f"- **Under `torch.compile`:** dynamo graph-breaks on {names}, so it runs outside "
                       "any graph, eagerly: `backend=\"nanpass\"` guards it there as it guards every "
                       "call dynamo leaves to eager (docs/deploy.md); `nanpass.harden` guards it.")
        if r.sample is not None and r.sample.inlined:
            names = ", ".join(f"`{n}`" for n in r.sample.inlined)
            out.append(f"- **Under `torch.compile`:** dynamo traces into {names}; the ops inside meet "
                       "their own rules.")
        spellings = ", ".join(f"`{sp.name}`" for sp in r.spellings(removed=True))
        out.append(f"- **Spellings:** {spellings}.\n")
        table = _constants(r)
        if table:
            out.append(table)
    left = [r for r in RULES if r.safe]
    if left:
        out.append("## Recognised and left alone\n")
        for r in left:
            spellings = ", ".join(f"`{sp.name}`" for sp in r.spellings(removed=True))
            out.append(f"- **{r.name}** ({spellings}): {r.reason}.")
        out.append("")
    out.append("## Exact stable-form rewrites\n")
    out.append("Opt-in (`stable=True`, on the backend: `torch.compile(model, backend=\"nanpass\", "
               "options={\"stable\": True})`), because they change rounding on safe inputs and so "
               "break the bit-for-bit promise; the report marks each one. Applied before the guards; "
               "they give the true value where the naive form loses it (and may differ from it by "
               "rounding, never in accuracy):\n")
    from ._stable import DESCRIPTIONS

    out.extend(f"- `{d}`" for d in DESCRIPTIONS)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(guards_markdown(), end="")
