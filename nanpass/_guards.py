"""Guard implementations: the safe forms the rewrite swaps in.

Every guard is ``impl(fn, args, kwargs, consts, fence)``: ``fn`` is the op as the user spelled it
(``torch.log``, ``Tensor.log``, an ``nn.Softmax`` instance, ...), so the user's own argument
order and keywords pass through untouched and the same kernel runs. A guard only changes the
operands outside the op's safe domain, with three building blocks:

* ``torch.clamp`` into a closed domain where the op and its derivative are finite: identity
  inside (value and gradient bitwise), zero gradient outside;
* ``finite``: +-inf to +-max and NaN to 0, identity on finite values; its gradient passes
  straight through (nothing saved, no backward kernel);
* ``fence``: identity forward; in backward, a gradient that is not finite becomes 0 unless
  the gradient that reached the guard's result was already non-finite (``Fences``: a token
  tied to the result carries that verdict through autograd itself). This is what defeats the
  double-where trap: the op never sees an unsafe operand, and a derivative that is infinite
  at the boundary (sqrt at 0, acos at 1) cannot leak NaN.

Every guard is an ordinary tensor program: its one custom Function (the fence) reads no
Python state and hands no view to the user, so in-place writes on a guard's result,
dynamo (``fullgraph=True``), ``torch.func`` and ``torch.export`` see plain ops.

Constants come from ``consts(dtype)``: ``torch.finfo`` of the operand, tightened by the user's
per-op overrides.
"""

from __future__ import annotations

import contextvars
import inspect
import numbers
from collections.abc import Callable

import torch

from ._compat import function_apply
from ._constants import PowDomain, bounds, memo, pow_domain

Tensor = torch.Tensor

# guard statistics (harden(count=True)): the counter of the guard that is running
COUNTER: contextvars.ContextVar = contextvars.ContextVar("nanpass_counter", default=None)


def _count(changed: Callable[[], Tensor]) -> None:
    """Add the elements this guard changed (``changed()``, only computed while counting) to its
    counter, on the device: no sync."""
    if torch.compiler.is_compiling():  # counting is eager's (no ContextVar in a traced region)
        return
    counter = COUNTER.get()
    if counter is not None:
        counter.add(changed())


def _saturate(t: Tensor) -> Tensor:
    """+-inf to +-sat (max / 16: headroom for the next op), NaN to 0; finite values as they
    are. Under torch.compile, written with where: inductor's CPU code generator scalarises
    nan_to_num (isnan) and that costs more than the op it guards."""
    b = bounds(t.dtype)
    if torch.compiler.is_compiling():
        return torch.where(t != t, 0.0, torch.where(t > b.max, b.sat, torch.where(t < -b.max, -b.sat, t)))
    return torch.nan_to_num(t, nan=0.0, posinf=b.sat, neginf=-b.sat)


def _fence_grad(grad: Tensor, token_grad: Tensor) -> Tensor:
    """``grad`` with its non-finite elements zeroed, or as it came when the gradient that
    reached the guard's result was non-finite (``token_grad`` NaN). A fresh tensor (grad may
    be an expanded view, or another node's), and in eager one float tensor of grad's size in
    two passes: a loss's logits are a step's largest tensor."""
    if torch.compiler.is_compiling():  # inductor fuses it; its CPU code scalarises isfinite
        return torch.where((grad.abs() <= bounds(grad.dtype).max) | (token_grad != 0), grad, 0.0)
    zeroed = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
    if grad.requires_grad or torch._C._are_functorch_transforms_active():  # no out= there
        return torch.where(token_grad == 0, zeroed, grad)
    return torch.where(token_grad == 0, zeroed, grad, out=zeroed)


class _Fence(torch.autograd.Function):
    """On an operand: identity forward, plus a token (a 0-d zero) that the guard ties to its
    result (``_tie``). In backward the token's gradient is 0 when the gradient that reached the
    guard's result was finite everywhere and NaN otherwise, so the fence knows, with no Python
    state, whether a non-finite gradient is the op's own (zeroed) or came from upstream (passed
    as it came: a loss-scale overflow stays visible to GradScaler and StepGuard)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.view_as(x), torch.zeros((), dtype=x.dtype, device=x.device)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad, token_grad):
        return _fence_grad(grad, token_grad)


class _FenceJvp(_Fence):
    """Eager: with forward mode (jacfwd, hessian). Dynamo refuses a custom ``jvp``, so a
    traced region takes ``_Fence``."""

    @staticmethod
    def jvp(ctx, tangent):  # the identity's tangent
        return tangent.view_as(tangent), torch.zeros((), dtype=tangent.dtype, device=tangent.device)


class _Finite(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return _saturate(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        # straight through: nothing saved, no backward kernel; the guarded op's own
        # gradient is finite at +-max, and a fence sits before any op whose is not
        return grad


class _FiniteJvp(_Finite):
    @staticmethod
    def jvp(ctx, tangent):
        return tangent


# eager: the C apply (the Python wrapper binds each call's arguments with inspect.signature)
_FENCE_EAGER = function_apply(_FenceJvp)
_FINITE_EAGER = function_apply(_FiniteJvp)


def _tie(y, token: Tensor):
    """``y`` (bit for bit: y + (-0.0)), a fresh tensor whose backward sends sum(grad * 0) to
    the token: 0 for a finite gradient, NaN for one with an inf or NaN (no overflow of a sum of
    large finite gradients, as a plain sum would have)."""
    if not isinstance(y, Tensor) or not y.requires_grad or not y.is_floating_point():
        return y
    return torch.addcmul(y, token.to(y.dtype), torch.zeros((), dtype=y.dtype, device=y.device), value=-1)


def _no_fence(x):
    return x


class Fences:
    """The fences of one guard call: ``fence(x)`` on each operand whose derivative may be
    singular, then ``tie(out)`` on the result. Local to the call: nothing a transform sees."""

    __slots__ = ("tokens",)

    def __init__(self):
        self.tokens = []

    def __call__(self, x):
        if isinstance(x, Tensor) and x.requires_grad and x.is_floating_point():
            x, token = _Fence.apply(x) if torch.compiler.is_compiling() else _FENCE_EAGER(x)
            self.tokens.append(token)
        return x

    def tie(self, out):
        if not self.tokens:
            return out
        token = self.tokens[0]
        for t in self.tokens[1:]:
            token = token + t.to(token.dtype)
        return _each(out, lambda o: _tie(o, token))


def _each(out, f):
    """``f`` on a result or on each item of a tuple result, keeping the tuple's type
    (torch.return_types: eigh's ``.eigenvalues``, svd's ``.U``; namedtuples)."""
    if not isinstance(out, tuple):
        return f(out)
    items = [f(o) for o in out]
    if type(out) is tuple:
        return tuple(items)
    return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)


def fenced(impl, fn, args, kwargs, consts):
    """Run a guard: its fences learn from a tie on its result whether the gradient that
    arrives there is finite (exact backward: zero only the op's own singular derivative)."""
    if not torch.is_grad_enabled():
        return impl(fn, args, kwargs, consts, _no_fence)
    fences = Fences()
    return fences.tie(impl(fn, args, kwargs, consts, fences))


def finite(x):
    """+-inf to +-max, NaN to 0: identity on finite values; the gradient passes straight through."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        return x
    _count(lambda: ~torch.isfinite(x))
    if not x.requires_grad:
        return _saturate(x)
    return _Finite.apply(x) if torch.compiler.is_compiling() else _FINITE_EAGER(x)


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

    def impl(fn, args, kwargs, consts, fence):
        x, rest, kw = _unary(args, kwargs)
        c = consts(x.dtype)
        xs = torch.clamp(x, c[lo] if lo else None, c[hi] if hi else None)
        _count(lambda: xs != x)
        return fn(fence(xs), *rest, **kw)

    return impl


def overflowing(hi: str, own: str) -> Callable:
    """exp, exp2, expm1: the operand clamped at ``hi`` (the last value whose result is finite,
    or the user's tighter bound), and a result that would have overflowed is +sat (max / 16),
    not max: headroom for the next op (exp(100) * 2 stays finite). Every finite result of the
    original below ``hi`` is its own."""

    def impl(fn, args, kwargs, consts, fence):
        x, rest, kw = _unary(args, kwargs)
        top = consts(x.dtype)[hi]
        xs = torch.clamp(x, None, top)
        _count(lambda: xs != x)
        y = fn(xs, *rest, **kw)
        b = bounds(y.dtype)
        return torch.where(x > getattr(b, own), b.sat, y)

    return impl


@memo
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype))


def logit(fn, args, kwargs, consts, fence):
    x, rest, kw = _unary(args, kwargs)
    c = consts(x.dtype)
    eps = rest[0] if rest else kw.get("eps")
    lo, hi = c["lo"], c["hi"]
    if eps is not None:  # respect the user's eps, but never 1 - eps == 1.0
        lo, hi = max(lo, _in_dtype(eps, x.dtype)), min(hi, _in_dtype(1 - eps, x.dtype))
    xs = torch.clamp(x, lo, hi)
    _count(lambda: xs != x)
    return fn(fence(xs), *rest, **kw)


# -- division -----------------------------------------------------------------------------


def _quotient(q: Tensor, zero) -> Tensor:
    """0 where the divisor is 0 (as tf.math.divide_no_nan), +-max where the quotient overflows."""
    if isinstance(zero, Tensor):
        _count(lambda: zero)
        q = torch.where(zero, 0.0, q)
    elif zero:  # a constant 0 divisor: 0, still connected to the graph for backward
        q = torch.where(torch.ones((), dtype=torch.bool, device=q.device), 0.0, q)
    return finite(q)


def div(fn, args, kwargs, consts, fence):
    (x, d), rest, kw = operands(args, kwargs, ("input", "other"))
    q = fn(fence(x), fence(d), *rest, **kw)
    if not q.is_floating_point():
        return q
    return _quotient(q, d == 0)


def reciprocal(fn, args, kwargs, consts, fence):
    x, rest, kw = _unary(args, kwargs)
    return _quotient(fn(fence(x), *rest, **kw), x == 0)


# -- pow ----------------------------------------------------------------------------------


def _away_from_zero(x: Tensor, m: float) -> Tensor:
    return torch.where(x.abs() < m, torch.full_like(x, m).copysign(x.detach()), x)


def pow_(fn, args, kwargs, consts, fence):
    (x, p), rest, kw = operands(args, kwargs, ("input", "exponent"))
    if isinstance(x, Tensor) and isinstance(p, numbers.Real) and not isinstance(p, bool):
        dom: PowDomain | None = pow_domain(float(p), x.dtype)
        if dom is None:
            return fn(x, p, *rest, **kw)
        xs = _away_from_zero(x, dom.away) if dom.away else torch.clamp(x, dom.lo, dom.hi)
        moved = xs != x
        _count(lambda: moved)
        # the domain keeps p * x ** (p - 1) finite, except at 0 when 0 < p < 1: fence only there
        # (a fence is a backward kernel of its own: GPT-2's x ** 3 pays for none)
        y = fn(fence(xs) if 0 < p < 1 else xs, p, *rest, **kw)
        if p < 0 or dom.hi is not None and dom.hi < bounds(x.dtype).max:
            # a base moved in from where the power overflows: +-sat (max / 16), not +-max,
            # headroom for the next op; a base moved up to 0 (x ** 0.5 of x < 0) gives 0
            y = torch.where(moved, y.sign() * bounds(y.dtype).sat, y)
        return y
    # a tensor exponent: any base, any exponent; saturate the value, fence the gradients
    return finite(fn(fence(x), fence(p), *rest, **kw))


# -- softmax family -----------------------------------------------------------------------


def finite_operand(fn, args, kwargs, consts, fence):
    """softmax: a row of -inf becomes uniform (the limit of equal logits), +inf cannot make
    NaN; logsigmoid: -inf gives -max instead of -inf."""
    x, rest, kw = _unary(args, kwargs)
    return fn(finite(x), *rest, **kw)


def finite_in_out(fn, args, kwargs, consts, fence):
    """log_softmax, logsumexp: finite operand, and the result saturated (it can reach -inf)."""
    x, rest, kw = _unary(args, kwargs)
    return finite(fn(finite(x), *rest, **kw))


def finite_result(fn, args, kwargs, consts, fence):
    """std/var: NaN when there are too few elements (0 instead), infinite gradient at 0 spread."""
    x, rest, kw = _unary(args, kwargs)
    return finite_all(fn(fence(x), *rest, **kw))


def xlogy(fn, args, kwargs, consts, fence):
    (x, y), rest, kw = operands(args, kwargs, ("input", "other"))
    if isinstance(y, Tensor):
        c = consts(y.dtype)
        ys = torch.clamp(y, c["lo"], c["hi"])
        _count(lambda: ys != y)
        y = fence(ys)
    return finite(fn(fence(x), y, *rest, **kw))


# -- composite calls ----------------------------------------------------------------------


def finite_call(fn, args, kwargs, consts, fence):
    """Ops whose unsafe set is no simple domain (norms at 0, repeated eigenvalues in eigh/svd
    backward, logdet of a singular matrix, lgamma's poles, overflow of cosh): the op runs on
    the user's operands; a non-finite result saturates (NaN to 0) and a non-finite gradient
    into any floating operand becomes 0. Identity wherever the original is finite."""
    fenced = tuple(fence(a) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)
    kw = {k: fence(v) if isinstance(v, Tensor) and v.is_floating_point() else v
          for k, v in kwargs.items()}
    return finite_all(fn(*fenced, **kw))


def batch_norm(fn, args, kwargs, consts, fence):
    """In float16 the gradient at zero variance overflows (as every normalisation's there):
    ``finite_call``. In every dtype, eval mode reads the running variance: a negative one (a
    corrupted buffer) is sqrt(< 0) = NaN for every sample; it is read as 0, a copy, so the
    buffer is untouched. Training in float32/bfloat16/float64 runs as written."""
    if fn is not _F_BATCH_NORM:  # torch.batch_norm, native_batch_norm: internals, any dtype
        return finite_call(fn, args, kwargs, consts, fence)
    # F.batch_norm(input, running_mean, running_var, weight, bias, training, momentum, eps),
    # read by position first: this runs on every normalisation of a CNN
    x = args[0] if args else kwargs["input"]
    if x.dtype == torch.float16:
        return finite_call(fn, args, kwargs, consts, fence)
    training = args[5] if len(args) > 5 else kwargs.get("training", False)
    var = args[2] if len(args) > 2 else kwargs.get("running_var")
    if training or not isinstance(var, Tensor):
        return fn(*args, **kwargs)
    neg = var < 0
    _count(lambda: neg)
    var = torch.where(neg, 0.0, var)
    if len(args) > 2:
        return fn(*args[:2], var, *args[3:], **kwargs)
    return fn(*args, **{**kwargs, "running_var": var})


_F_BATCH_NORM = torch.nn.functional.batch_norm


def finite_low_precision(fn, args, kwargs, consts, fence):
    """Products in float16 (max 65504) overflow on ordinary activations: saturate the result,
    so the next op sees +-max, not inf (identity on finite values; straight-through gradient).
    bfloat16 has float32's range: there, as in float32/float64, the op runs as written."""
    out = fn(*args, **kwargs)
    if not isinstance(out, Tensor) or out.dtype != torch.float16:
        return out
    if torch.compiler.is_compiling() or out._base is not None or "out" in kwargs:
        return finite(out)
    # eager, a fresh result no one else holds yet: saturated in place, through a detached
    # alias, so autograd records nothing (the gradient passes straight through, as finite's)
    # and no second tensor is made (a product is the largest activation; autocast makes many)
    b = bounds(out.dtype)
    _count(lambda: ~torch.isfinite(out))
    out.detach().nan_to_num_(nan=0.0, posinf=b.sat, neginf=-b.sat)
    return out


def ctc(fn, args, kwargs, consts, fence):
    """ctc_loss: an input shorter than its target has no alignment: the loss is inf and its
    gradient NaN. As torch's own ``zero_infinity=True``: that loss and its gradient become 0;
    every finite loss is unchanged. ``F.ctc_loss`` and ``torch.ctc_loss`` both take it 7th."""
    # log-probabilities past 0 (raw scores) make exp() in its gradient overflow: fenced
    args = (fence(finite(args[0])), *args[1:]) if args else args
    if "log_probs" in kwargs:
        kwargs = {**kwargs, "log_probs": fence(finite(kwargs["log_probs"]))}
    if len(args) >= 7:
        args = (*args[:6], True, *args[7:])
    else:
        kwargs = {**kwargs, "zero_infinity": True}
    return finite(fn(*args, **kwargs))



def loss(fn, args, kwargs, consts, fence):
    """cross_entropy / nll_loss / kl_div: +-inf logits, 0/0 when every target is ignored."""
    (x, t), rest, kw = operands(args, kwargs, ("input", "target"))
    return finite(fn(fence(finite(x)), fence(finite(t)), *rest, **kw))


def logits_loss(fn, args, kwargs, consts, fence):
    """cross_entropy / nll_loss on the logits as they are: a vocabulary's logits are a step's
    largest activation, and a saturated copy would raise its peak memory by their size
    (GPT-2 under autocast: +0.8 GB). -inf logits (a masked vocabulary) keep their exact loss
    and gradient; an inf loss (a -inf target logit) saturates; a NaN one (+inf or NaN logits, a
    row of -inf, every target ignored) becomes 0, and the fence zeroes the gradient that made
    it, so every other row trains as without the bad one."""
    (x, t), rest, kw = operands(args, kwargs, ("input", "target"))
    return finite(fn(fence(x), fence(finite(t)), *rest, **kw))


def cosine_similarity(fn, args, kwargs, consts, fence):
    """Rounding can put a cosine past +-1 (acos then gives NaN): clamp it back. A zero vector
    in float16 gives 0/0 (the default eps 1e-8 is 0 there): 0, as float32 gives."""
    (a, b), rest, kw = operands(args, kwargs, ("x1", "x2"))
    out = fn(fence(finite(a)), fence(finite(b)), *rest, **kw)
    return torch.clamp(finite(out), -1.0, 1.0)


@memo
def _params(fn) -> tuple[str, ...]:
    return tuple(p for p in inspect.signature(fn).parameters if p != "self")


# read once at import: inside a region dynamo traces, inspect.signature and a cache keyed on
# the function are Python state it misreads (the arguments came out bound to the wrong names)
_MHA_PARAMS = {"module": _params(torch.nn.MultiheadAttention.forward),
               "function": _params(torch.nn.functional.multi_head_attention_forward)}


def _finite_mask(mask, dtype: torch.dtype):
    """-inf (or a bool True) becomes a large finite negative: a fully masked row stays finite,
    and every other row gets exactly the same softmax (exp of either underflows to 0)."""
    if mask is None:
        return None
    low = bounds(dtype).mask_low
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, low)
    return torch.clamp(mask.to(dtype), min=low)


def attention(fn, args, kwargs, consts, fence):
    """nn.MultiheadAttention / F.multi_head_attention_forward: rows whose every key is masked."""
    module = isinstance(fn, torch.nn.Module)
    if torch.compiler.is_compiling():
        params = _MHA_PARAMS["module" if module else "function"]
    else:  # a subclass may take other arguments
        params = _params(type(fn).forward if module else fn)
    bound = dict(zip(params, args, strict=False))
    bound.update(kwargs)
    dtype = bound["query"].dtype
    if dtype.is_floating_point:
        for name in ("key_padding_mask", "attn_mask"):
            if bound.get(name) is not None:
                bound[name] = _finite_mask(bound[name], dtype)
    return fn(**bound)
