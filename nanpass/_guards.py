"""Guard implementations: the safe forms the rewrite swaps in.

Every guard is ``impl(fn, args, kwargs, consts)``: ``fn`` is the op as the user spelled it
(``torch.log``, ``Tensor.log``, an ``nn.Softmax`` instance, ...), so the user's own argument
order and keywords pass through untouched and the same kernel runs. A guard only changes the
operands outside the op's safe domain, with three building blocks:

* ``torch.clamp`` into a closed domain where the op and its derivative are finite: identity
  inside (value and gradient bitwise), zero gradient outside;
* ``finite``: +-inf to +-max and NaN to 0, identity on finite values; its gradient passes
  straight through (nothing saved, no backward kernel);
* ``finite_grad``: identity forward; in backward, a gradient that is not finite becomes 0.
  This is what defeats the double-where trap: the op never sees an unsafe operand, and a
  derivative that is infinite at the boundary (sqrt at 0, acos at 1) cannot leak NaN.

Constants come from ``consts(dtype)``: ``torch.finfo`` of the operand, tightened by the user's
per-op overrides.
"""

from __future__ import annotations

import contextvars
import inspect
import numbers
from collections.abc import Callable

import torch

from ._compat import graph_task_id
from ._constants import PowDomain, bounds, memo, pow_domain

Tensor = torch.Tensor

# guard statistics (harden(count=True)): the counter of the guard that is running
COUNTER: contextvars.ContextVar = contextvars.ContextVar("nanpass_counter", default=None)


def _count(changed) -> None:
    """Add the elements this guard changed to its counter, on the device: no sync."""
    counter = COUNTER.get()
    if counter is not None and isinstance(changed, Tensor):
        counter.add(changed)


def _saturate(t: Tensor) -> Tensor:
    """+-inf to +-sat (max / 16: headroom for the next op), NaN to 0; finite values as they
    are. Under torch.compile, written with where: inductor's CPU code generator scalarises
    nan_to_num (isnan) and that costs more than the op it guards."""
    b = bounds(t.dtype)
    if torch.compiler.is_compiling():
        return torch.where(t != t, 0.0, torch.where(t > b.max, b.sat, torch.where(t < -b.max, -b.sat, t)))
    return torch.nan_to_num(t, nan=0.0, posinf=b.sat, neginf=-b.sat)


def _zero_nonfinite(t: Tensor) -> Tensor:
    if torch.compiler.is_compiling():
        return torch.where(t.abs() <= bounds(t.dtype).max, t, 0.0)  # false for inf and NaN
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0)


class Upstream:
    """What one guard call's backward learns from the gradient arriving at its result: whether
    it was finite everywhere (a 0-d bool tensor on the device; no sync)."""

    __slots__ = ("ok", "used", "task")

    def __init__(self):
        self.ok = None
        self.used = False  # a fence asked: only then is the result probed
        # the backward pass that set ``ok``: in a double backward the cotangent that reaches
        # the result comes from the guard's own first-order graph (0 * inf inside svd's
        # backward), not from upstream, and must not turn the fence off
        self.task = None


# the Upstream of the guard that is running: its fences read it in backward
FENCE: contextvars.ContextVar = contextvars.ContextVar("nanpass_fence", default=None)


class _Identity(torch.autograd.Function):
    """Identity forward that keeps the guard call's Upstream for its backward."""

    @staticmethod
    def forward(x, state):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.state = inputs[1]


class _Probe(_Identity):
    """On a guard's result: in backward it records whether the arriving gradient is finite,
    before the op's own backward runs (autograd's order) and the fences read it."""

    @staticmethod
    def backward(ctx, grad):
        st = ctx.state
        if not torch.compiler.is_compiling():  # compiled: traced once, as written below
            task = graph_task_id()
            if st.task is not None and task != st.task:
                return grad, None  # a later pass (a double backward): the first pass's verdict holds
            st.task = task
        ok = torch.isfinite(grad).all()
        st.ok = ok if st.ok is None else st.ok & ok
        return grad, None


class _FiniteGrad(_Identity):
    @staticmethod
    def backward(ctx, grad):
        # a fresh tensor: never write into grad (it may be an expanded view)
        zeroed = _zero_nonfinite(grad)
        ok = ctx.state.ok if ctx.state is not None else None
        if ok is None:
            return zeroed, None
        # a non-finite gradient from upstream (a loss-scale overflow) passes as it came, for
        # GradScaler and StepGuard to see; only the op's own singular derivative is zeroed
        return torch.where(ok, zeroed, grad), None


class _Finite(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return _saturate(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        # straight through: nothing saved, no backward kernel; the guarded op's own
        # gradient is finite at +-max, and a finite-grad fence sits before any op whose is not
        return grad


# dynamo must not inline the fence and the probe: it would trace each backward on its own, at
# forward time, before the probe has seen a gradient, and bake "no verdict yet" into the fence.
# Run eagerly (a graph break under torch.compile(harden(model))), they talk to each other in
# autograd's order; the backend path is traced by aot_autograd, which keeps that order.
@torch.compiler.disable
def finite_grad(x):
    """Identity whose backward replaces a non-finite gradient by 0, unless the gradient that
    reached the running guard's result was already non-finite (then it passes unchanged)."""
    if isinstance(x, Tensor) and x.requires_grad:
        state = FENCE.get()
        if state is not None:
            state.used = True
        return _FiniteGrad.apply(x, state)
    return x


def _each(out, f):
    """``f`` on a result or on each item of a tuple result, keeping the tuple's type
    (torch.return_types: eigh's ``.eigenvalues``, svd's ``.U``; namedtuples)."""
    if not isinstance(out, tuple):
        return f(out)
    items = [f(o) for o in out]
    if type(out) is tuple:
        return tuple(items)
    return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)


@torch.compiler.disable
def _probe(x, state: Upstream):
    return _Probe.apply(x, state) if isinstance(x, Tensor) and x.requires_grad else x


def probed(out, state: Upstream):
    """``out`` with a probe on each tensor that carries a gradient."""
    return _each(out, lambda o: _probe(o, state))


def fenced(impl, fn, args, kwargs, consts):
    """Run a guard: its fences learn from a probe on its result whether the gradient that
    arrives there is finite (exact backward: zero only the op's own singular derivative)."""
    if not torch.is_grad_enabled():
        return impl(fn, args, kwargs, consts)
    state = Upstream()
    token = FENCE.set(state)
    try:
        out = impl(fn, args, kwargs, consts)
    finally:
        FENCE.reset(token)
    return probed(out, state) if state.used else out


def finite(x):
    """+-inf to +-max, NaN to 0: identity on finite values; the gradient passes straight through."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        return x
    _count(~torch.isfinite(x))
    return _Finite.apply(x) if x.requires_grad else _saturate(x)


def finite_all(out):
    return _each(out, finite)


def operands(args: tuple, kwargs: dict, names: tuple[str, ...]):
    """Split (operands, rest positional, rest keywords), reading operands positionally first."""
    ops = list(args[: len(names)])
    kw = dict(kwargs)
    for name in names[len(ops) :]:
        for alias in (name, "self") if name == "input" else (name,):
            if alias in kw:
                ops.append(kw.pop(alias))
                break
    return ops, args[len(names) :], kw


def _unary(args, kwargs):
    (x,), rest, kw = operands(args, kwargs, ("input",))
    return x, rest, kw


# -- elementwise ops with a closed safe domain ----------------------------------------------


def clamped(lo: str | None, hi: str | None) -> Callable:
    """fn(clamp(x, lo, hi)) with a finite-gradient fence between clamp and fn (the exp family,
    whose derivatives are finite on the clamped domain, needs none: ``overflowing``)."""

    def impl(fn, args, kwargs, consts):
        x, rest, kw = _unary(args, kwargs)
        c = consts(x.dtype)
        xs = torch.clamp(x, c[lo] if lo else None, c[hi] if hi else None)
        _count(xs != x)
        return fn(finite_grad(xs), *rest, **kw)

    return impl


def overflowing(hi: str, own: str) -> Callable:
    """exp, exp2, expm1: the operand clamped at ``hi`` (the last value whose result is finite,
    or the user's tighter bound), and a result that would have overflowed is +sat (max / 16),
    not max: headroom for the next op (exp(100) * 2 stays finite). Every finite result of the
    original below ``hi`` is its own."""

    def impl(fn, args, kwargs, consts):
        x, rest, kw = _unary(args, kwargs)
        top = consts(x.dtype)[hi]
        xs = torch.clamp(x, None, top)
        _count(xs != x)
        y = fn(xs, *rest, **kw)
        b = bounds(y.dtype)
        return torch.where(x > getattr(b, own), b.sat, y)

    return impl


@memo
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def logit(fn, args, kwargs, consts):
    x, rest, kw = _unary(args, kwargs)
    c = consts(x.dtype)
    eps = rest[0] if rest else kw.get("eps")
    lo, hi = c["lo"], c["hi"]
    if eps is not None:  # respect the user's eps, but never 1 - eps == 1.0
        lo, hi = max(lo, _in_dtype(eps, x.dtype)), min(hi, _in_dtype(1 - eps, x.dtype))
    xs = torch.clamp(x, lo, hi)
    _count(xs != x)
    return fn(finite_grad(xs), *rest, **kw)


# -- division -----------------------------------------------------------------------------


def _quotient(q: Tensor, zero) -> Tensor:
    """0 where the divisor is 0 (as tf.math.divide_no_nan), +-max where the quotient overflows."""
    if isinstance(zero, Tensor):
        _count(zero)
        q = torch.where(zero, 0.0, q)
    elif zero:  # a constant 0 divisor: 0, still connected to the graph for backward
        q = torch.where(torch.ones((), dtype=torch.bool, device=q.device), 0.0, q)
    return finite(q)


def div(fn, args, kwargs, consts):
    (x, d), rest, kw = operands(args, kwargs, ("input", "other"))
    q = fn(finite_grad(x), finite_grad(d), *rest, **kw)
    if not q.is_floating_point():
        return q
    return _quotient(q, d == 0)


def reciprocal(fn, args, kwargs, consts):
    x, rest, kw = _unary(args, kwargs)
    return _quotient(fn(finite_grad(x), *rest, **kw), x == 0)


# -- pow ----------------------------------------------------------------------------------


def _away_from_zero(x: Tensor, m: float) -> Tensor:
    return torch.where(x.abs() < m, torch.full_like(x, m).copysign(x.detach()), x)


def pow_(fn, args, kwargs, consts):
    (x, p), rest, kw = operands(args, kwargs, ("input", "exponent"))
    if isinstance(x, Tensor) and isinstance(p, numbers.Real) and not isinstance(p, bool):
        dom: PowDomain | None = pow_domain(float(p), x.dtype)
        if dom is None:
            return fn(x, p, *rest, **kw)
        xs = _away_from_zero(x, dom.away) if dom.away else torch.clamp(x, dom.lo, dom.hi)
        moved = xs != x
        _count(moved)
        # the domain keeps p * x ** (p - 1) finite, except at 0 when 0 < p < 1: fence only there
        # (a fence is a backward kernel of its own: GPT-2's x ** 3 pays for none)
        y = fn(finite_grad(xs) if 0 < p < 1 else xs, p, *rest, **kw)
        if p < 0 or dom.hi is not None and dom.hi < bounds(x.dtype).max:
            # a base moved in from where the power overflows: +-sat (max / 16), not +-max,
            # headroom for the next op; a base moved up to 0 (x ** 0.5 of x < 0) gives 0
            y = torch.where(moved, y.sign() * bounds(y.dtype).sat, y)
        return y
    # a tensor exponent: any base, any exponent; saturate the value, fence the gradients
    return finite(fn(finite_grad(x), finite_grad(p), *rest, **kw))


# -- softmax family -----------------------------------------------------------------------


def finite_operand(fn, args, kwargs, consts):
    """softmax: a row of -inf becomes uniform (the limit of equal logits), +inf cannot make
    NaN; logsigmoid: -inf gives -max instead of -inf."""
    x, rest, kw = _unary(args, kwargs)
    return fn(finite(x), *rest, **kw)


def finite_in_out(fn, args, kwargs, consts):
    """log_softmax, logsumexp: finite operand, and the result saturated (it can reach -inf)."""
    x, rest, kw = _unary(args, kwargs)
    return finite(fn(finite(x), *rest, **kw))


def finite_result(fn, args, kwargs, consts):
    """std/var: NaN when there are too few elements (0 instead), infinite gradient at 0 spread."""
    x, rest, kw = _unary(args, kwargs)
    return finite_all(fn(finite_grad(x), *rest, **kw))


def xlogy(fn, args, kwargs, consts):
    (x, y), rest, kw = operands(args, kwargs, ("input", "other"))
    if isinstance(y, Tensor):
        c = consts(y.dtype)
        ys = torch.clamp(y, c["lo"], c["hi"])
        _count(ys != y)
        y = finite_grad(ys)
    return finite(fn(finite_grad(x), y, *rest, **kw))


# -- composite calls ----------------------------------------------------------------------


def finite_call(fn, args, kwargs, consts):
    """Ops whose unsafe set is no simple domain (norms at 0, repeated eigenvalues in eigh/svd
    backward, logdet of a singular matrix, lgamma's poles, overflow of cosh): the op runs on
    the user's operands; a non-finite result saturates (NaN to 0) and a non-finite gradient
    into any floating operand becomes 0. Identity wherever the original is finite."""
    fenced = tuple(finite_grad(a) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)
    kw = {k: finite_grad(v) if isinstance(v, Tensor) and v.is_floating_point() else v
          for k, v in kwargs.items()}
    return finite_all(fn(*fenced, **kw))


def batch_norm(fn, args, kwargs, consts):
    """In float16 the gradient at zero variance overflows (as every normalisation's there):
    ``finite_call``. In every dtype, eval mode reads the running variance: a negative one (a
    corrupted buffer) is sqrt(< 0) = NaN for every sample; it is read as 0, a copy, so the
    buffer is untouched. Training in float32/bfloat16/float64 runs as written."""
    if fn is not _F_BATCH_NORM:  # torch.batch_norm, native_batch_norm: internals, any dtype
        return finite_call(fn, args, kwargs, consts)
    # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps),
    # read by position first: this runs on every normalisation of a CNN
    x = args[0] if args else kwargs["input"]
    if x.dtype == torch.float16:
        return finite_call(fn, args, kwargs, consts)
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    var = args[2] if len(args) > 2 else kwargs.get("running_var")
    if training or not isinstance(var, Tensor):
        return fn(*args, **kwargs)
    neg = var < 0
    _count(neg)
    var = torch.where(neg, 0.0, var)
    if len(args) > 2:
        return fn(*args[:2], var, *args[3:], **kwargs)
    return fn(*args, **{**kwargs, "running_var": var})


_F_BATCH_NORM = torch.nn.functional.batch_norm


def finite_low_precision(fn, args, kwargs, consts):
    """Products in float16 (max 65504) overflow on ordinary activations: saturate the result,
    so the next op sees +-max, not inf (identity on finite values; straight-through gradient).
    bfloat16 has float32's range: there, as in float32/float64, the op runs as written."""
    out = fn(*args, **kwargs)
    if isinstance(out, Tensor) and out.dtype == torch.float16:
        return finite(out)
    return out


def ctc(fn, args, kwargs, consts):
    """ctc_loss: an input shorter than its target has no alignment: the loss is inf and its
    gradient NaN. As torch's own ``zero_infinity=True``: that loss and its gradient become 0;
    every finite loss is unchanged. ``F.ctc_loss`` and ``torch.ctc_loss`` both take it 7th."""
    # log-probabilities past 0 (raw scores) make exp() in its gradient overflow: fenced
    args = (finite_grad(finite(args[0])), *args[1:]) if args else args
    if "log_probs" in kwargs:
        kwargs = {**kwargs, "log_probs": finite_grad(finite(kwargs["log_probs"]))}
    if len(args) >= 7:
        args = (*args[:6], True, *args[7:])
    else:
        kwargs = {**kwargs, "zero_infinity": True}
    return finite(fn(*args, **kwargs))



def loss(fn, args, kwargs, consts):
    """cross_entropy / nll_loss / kl_div: +-inf logits, 0/0 when every target is ignored."""
    (x, t), rest, kw = operands(args, kwargs, ("input", "target"))
    return finite(fn(finite_grad(finite(x)), finite_grad(finite(t)), *rest, **kw))


def cosine_similarity(fn, args, kwargs, consts):
    """Rounding can put a cosine past +-1 (acos then gives NaN): clamp it back. A zero vector
    in float16 gives 0/0 (the default eps 1e-8 is 0 there): 0, as float32 gives."""
    (a, b), rest, kw = operands(args, kwargs, ("x1", "x2"))
    out = fn(finite_grad(finite(a)), finite_grad(finite(b)), *rest, **kw)
    return torch.clamp(finite(out), -1.0, 1.0)


@memo
def _signature(kind: type | Callable) -> inspect.Signature:
    if isinstance(kind, type):
        return inspect.signature(kind.forward)
    return inspect.signature(kind)


def _finite_mask(mask, dtype: torch.dtype):
    """-inf (or a bool True) becomes a large finite negative: a fully masked row stays finite,
    and every other row gets exactly the same softmax (exp of either underflows to 0)."""
    if mask is None:
        return None
    low = bounds(dtype).mask_low
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, low)
    return torch.clamp(mask.to(dtype), min=low)


def attention(fn, args, kwargs, consts):
    """nn.MultiheadAttention / F.multi_head_attention_forward: rows whose every key is masked."""
    kind = type(fn) if isinstance(fn, torch.nn.Module) else fn
    sig = _signature(kind)
    params = list(sig.parameters)
    if params and params[0] == "self":
        params = params[1:]
    bound = dict(zip(params, args, strict=False))
    bound.update(kwargs)
    dtype = bound["query"].dtype
    if dtype.is_floating_point:
        for name in ("key_padding_mask", "attn_mask"):
            if bound.get(name) is not None:
                bound[name] = _finite_mask(bound[name], dtype)
    return fn(**bound)
