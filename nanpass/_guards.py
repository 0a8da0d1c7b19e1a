"""Guard implementations: the safe forms the rewrite swaps in.

Every guard is ``impl(fn, args, kwargs, consts, fence)``: ``fn`` is the op as the user spelled it
(``torch.log``, ``Tensor.log``, an ``nn.Softmax`` instance, ...), so the user's own argument
order and keywords pass through untouched and the same kernel runs. A guard only changes the
operands outside the op's safe domain, with three building blocks:

* ``clip`` (``torch.clamp``'s value) into a closed domain where the op and its derivative are
  finite: identity inside (value and gradient bitwise, the bounds included), zero gradient
  outside;
* ``finite``: +-inf to +-sat, identity on finite values; a NaN stays NaN, or, where the op
  can make one of its own, becomes 0 unless an operand brought one (``nan_in``); its gradient
  passes straight through (nothing saved, no backward kernel);
* ``fence``: identity forward; in backward, a gradient that is not finite becomes 0 unless
  the gradient that reached the guard's result was already non-finite, or a NaN came in with
  an operand (``Fences``: a token tied to the result carries that verdict through autograd
  itself). This is what defeats the double-where trap: the op never sees an unsafe operand,
  and a derivative that is infinite at the boundary (sqrt at 0, acos at 1) cannot leak NaN.

A NaN from upstream stays NaN (issue 44, item 2): a guard changes only what its own op makes
non-finite from finite or infinite operands. A NaN operand (a NaN parameter, a NaN in the data)
gives NaN wherever the plain op gives NaN, in the value (elementwise, at the same positions; a
reduction or loss over it whole) and in the gradient, so the user, GradScaler, StepGuard and
check mode still see it.

Every guard is an ordinary tensor program: its custom Functions (the fence, the straight-through
saturations) read no Python state and hand no view to the user, so in-place writes on a guard's
result, dynamo (``fullgraph=True``), ``torch.func`` and ``torch.export`` see plain ops. The one
exception is eager-only: the hooks ``Hooked`` puts on a C++ composite's own nodes, which a traced
region or a functorch transform never takes (``finite_call``'s fence there).

Constants come from ``consts(dtype)``: ``torch.finfo`` of the operand, tightened by the user's
per-op overrides.
"""

from __future__ import annotations

import contextvars
import math
import numbers
import types
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from ._compat import (
    CLAMP_GRAD_AT_BOUNDS,  # noqa: F401 - named in clip's docstring; tests set it
    constant_result,
    eager_handler,
    entered,
    function_apply,
    functorch_active,
    node_sequence_nr,
    sequence_nr,
    view_base,
)
from ._constants import PowDomain, bounds, memo, pow_domain
from ._rule import empty_operand

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


# False while certify analyses a hardened model: a guard's read of a value is control flow there
HOST_READS: contextvars.ContextVar = contextvars.ContextVar("nanpass_host_reads", default=True)


def _all_finite_on_host(t) -> bool:
    """Whether ``t`` is finite everywhere, asked only where the answer is a read of host memory:
    a plain CPU tensor, in eager, outside a functorch transform and certify's analysis. Then a
    guard whose value and local derivative are finite wherever its result is may return the
    op's own result, with the original's graph node for node (a GPU read would be a sync)."""
    # an inf or NaN element makes the sum one (2 us against isfinite(t).all()'s 8 on a small
    # tensor); a finite sum that overflows only sends the call the guard's way
    return (type(t) is Tensor and t.device.type == "cpu" and t.layout == torch.strided
            and not torch.compiler.is_compiling() and not functorch_active() and HOST_READS.get()
            and math.isfinite(t.sum().item()))


_NAN = float("nan")


def _saturate(t: Tensor, nan: Tensor | float | None = None) -> Tensor:
    """+-inf to +-sat (the stand-in for an infinity: headroom for the next op, and for a product
    of two); finite values as they are; a NaN as it is, or ``nan`` where given (``nan_in``'s: 0
    for the op's own NaN, NaN for one an operand brought). Under torch.compile, written with
    where: inductor's CPU code generator scalarises nan_to_num (isnan) and that costs more than
    the op it guards."""
    b = bounds(t.dtype)
    if torch.compiler.is_compiling():
        s = torch.where(t > b.max, b.sat, torch.where(t < -b.max, -b.sat, t))  # NaN compares False
        if nan is None:
            return s
        return torch.where(t != t, nan if not isinstance(nan, Tensor) else nan.to(t.dtype), s)
    if not isinstance(nan, Tensor):  # None or a number: one pass
        return torch.nan_to_num(t, nan=_NAN if nan is None else nan, posinf=b.sat, neginf=-b.sat)
    # (written so that certify's intervals see the finite result where no operand is NaN: the
    # test t != t is false there, and nan's box [0, 0])
    s = torch.nan_to_num(t, nan=0.0, posinf=b.sat, neginf=-b.sat)
    return torch.where(t != t, nan if nan.dtype == t.dtype else nan.to(t.dtype), s)


def _floating(tensors) -> list[Tensor]:
    """The floating tensors among ``tensors`` whose elements can be read (a dim of static size 0
    has none: dynamo specialises 0 and 1, so a symbolic size is taken as non-empty)."""
    return [a for a in tensors if isinstance(a, Tensor) and a.is_floating_point()
            and a.layout == torch.strided and not a.is_nested
            and not any(isinstance(n, int) and n == 0 for n in a.shape)]


def call_operands(fn, args: tuple, kwargs: dict) -> list:
    """Every tensor a call reads: its arguments, and a module's own parameters and buffers (an
    fx capture keeps ``nn.LayerNorm`` whole: its weight is no argument)."""
    ops = [*args, *kwargs.values()]
    if isinstance(fn, torch.nn.Module):
        ops += [*fn.parameters(), *fn.buffers()]
    return ops


def nan_in(operands) -> Tensor | float:
    """What a NaN in the op's result becomes, for ``finite(out, nan)``: NaN where a floating
    operand holds a NaN (it came from upstream; the result is the plain op's, NaN included), 0
    where none does (the NaN is the op's own, made from finite or infinite operands: 0/0,
    inf - inf, every target ignored). A 0-d tensor from one read of each operand (its amax: a
    NaN propagates, an infinity does not), no copy; the number 0.0 where no operand has an
    element to read. For an op that is not elementwise (a norm, a loss, a factorisation), where
    a NaN operand reaches results that no per-element mask could name; an elementwise guard
    keeps NaN by position (``finite_by_position``)."""
    top = None
    for a in _floating(operands):
        m = a.detach().amax()
        top = m if top is None else torch.maximum(top, m)
    # NaN stays NaN, every other value (+-inf too) becomes 0
    return 0.0 if top is None else top.clamp(0, 0)


def _fence_grad(grad: Tensor, token_grad: Tensor) -> Tensor:
    """``grad`` with its non-finite elements zeroed, or as it came when the gradient that
    reached the guard's result was non-finite (``token_grad`` NaN). A fresh tensor (grad may
    be an expanded view, or another node's), and in eager one float tensor of grad's size in
    two passes: a loss's logits are a step's largest tensor."""
    if torch.compiler.is_compiling():  # inductor fuses it; its CPU code scalarises isfinite
        return torch.where((grad.abs() <= bounds(grad.dtype).max) | (token_grad != 0), grad, 0.0)
    zeroed = torch.nan_to_num(grad, nan=0.0, posinf=0.0, neginf=0.0)
    if grad.requires_grad or functorch_active():  # no out= there
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
        # a read that makes no gradient (the shape ``expand_as`` takes) adds nothing, not 0
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, grad, token_grad):
        if grad is None:
            return None
        if token_grad is None:
            token_grad = torch.zeros((), dtype=grad.dtype, device=grad.device)
        return _fence_grad(grad, token_grad)


class _FenceJvp(_Fence):
    """Eager: with forward mode (jacfwd, hessian). Dynamo refuses a custom ``jvp``, so a
    region dynamo traces (and an export) takes ``_Fence``; a graph the backend rewrote is
    traced by aot_autograd, which runs the forward AD of ``torch.func.hessian`` inside it
    with this jvp (``_dynamo_traced``)."""

    @staticmethod
    def jvp(ctx, tangent):  # the identity's tangent
        return tangent.view_as(tangent), torch.zeros((), dtype=tangent.dtype, device=tangent.device)


class _Finite(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, nan):
        return _saturate(x, nan)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        # straight through: nothing saved, no backward kernel; the guarded op's own
        # gradient is finite at +-max, and a fence sits before any op whose is not
        return grad, None


class _FiniteJvp(_Finite):
    @staticmethod
    def jvp(ctx, tangent, _):
        return tangent


def _dynamo_traced() -> bool:
    """Whether dynamo (or export) traces this call: it refuses a Function with a custom
    ``jvp``. Anything else (eager, and aot_autograd tracing the backend's rewritten graph,
    where forward AD may run inside the graph) takes the Functions with their jvp."""
    return torch.compiler.is_dynamo_compiling() or torch.compiler.is_exporting()


# eager: the C apply (the Python wrapper binds each call's arguments with inspect.signature)
_FENCE_EAGER = function_apply(_FenceJvp)
_FINITE_EAGER = function_apply(_FiniteJvp)


def _tie(y, token: Tensor, nan=None):
    """``y`` (bit for bit: y + (-0.0)), a fresh tensor whose backward sends sum(grad * z) to
    the token, z the 0-d ``_upstream_nan``: with z 0, 0 for a finite gradient and NaN for one
    with an inf or NaN (no overflow of a sum of large finite gradients, as a plain sum would
    have); with z 1 (a NaN came in with an operand), -sum(grad), not 0 but for a gradient that
    sums to exactly 0: the fences then pass the op's gradient as it is, NaN included, as the
    plain op's."""
    if not isinstance(y, Tensor) or not y.requires_grad or not y.is_floating_point():
        return y
    return torch.addcmul(y, token.to(y.dtype), _upstream_nan(y, nan), value=-1)


def _upstream_nan(y: Tensor, nan) -> Tensor:
    """0-d in y's dtype: 1 where a NaN came in with an operand, else 0. ``nan`` is the guard's
    ``nan_in`` where it read its operands (NaN: one did); otherwise the result tells, as only a
    NaN operand makes a guard's result NaN (one read of it, its amax)."""
    if isinstance(nan, Tensor):
        return torch.isnan(nan).to(y.dtype)
    if nan is not None or not _floating([y]):
        return torch.zeros((), dtype=y.dtype, device=y.device)
    return torch.isnan(y.detach().amax()).to(y.dtype)


def _no_fence(x):
    return x


class Fences:
    """The fences of one guard call: ``fence(x)`` on each operand whose derivative may be
    singular, then ``tie(out)`` on the result. Local to the call: nothing a transform sees.
    ``nan``: the guard's ``nan_in`` where it read its operands for one (``upstream``)."""

    __slots__ = ("tokens", "nan")

    def __init__(self):
        self.tokens = []
        self.nan = None

    def __call__(self, x):
        if isinstance(x, Tensor) and x.requires_grad and x.is_floating_point():
            x, token = _Fence.apply(x) if _dynamo_traced() else _FENCE_EAGER(x)
            self.tokens.append(token)
        return x

    def tie(self, out):
        if not self.tokens:
            return out
        token = self.tokens[0]
        for t in self.tokens[1:]:
            token = token + t.to(token.dtype)
        return _each(out, lambda o: _tie(o, token, self.nan))


def upstream(fence, nan) -> None:
    """Tell a guard call's fences (``Fences`` or ``Hooked``) whether a NaN came in with an
    operand (``nan_in``'s value), so that they need not read the result for it."""
    if isinstance(fence, (Fences, Hooked)):
        fence.nan = nan


def _each(out, f):
    """``f`` on a result or on each item of a tuple result, keeping the tuple's type
    (torch.return_types: eigh's ``.eigenvalues``, svd's ``.U``; namedtuples)."""
    if not isinstance(out, tuple):
        return f(out)
    items = [f(o) for o in out]
    if type(out) is tuple:
        return tuple(items)
    if type(out).__module__ == "torch.return_types":  # a structseq: one sequence argument
        return type(out)(items)  # (asked first: dynamo 2.11 gives a structseq ``_fields``)
    return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)


class Hooked:
    """Fences with no node of their own, for a torch composite written in C++ that reads an
    operand twice (``poisson_nll_loss``: ``exp(x) - t * x``), where no mode sees the reads
    (``_EachRead`` does for Python composites): one fence node before it would make autograd add its two
    contributions first and the operand's other uses' after, where the original adds them in
    the order its nodes run, and the gradient's last bit differs (issue 28, item 3). The op
    reads its operands as they are; ``tie`` walks back from the result over the nodes this call
    made (sequence numbers from ``floor`` on) to those that read a fenced operand, and a post
    hook there fences that contribution, with the verdict a pre hook on the result's node takes
    from the gradient arriving there. In a create_graph backward the nodes a reader's backward
    made are hooked the same way. Only for such composites: an op's own contributions are then
    summed at the operand past any check, where a fence node checks their sum (div's second
    derivative at huge operands; docs/architecture.md). Eager only: hooks are Python state."""

    __slots__ = ("edges", "floor", "nan")

    def __init__(self):
        self.edges = {}
        self.floor = sequence_nr()
        self.nan = None  # as Fences.nan

    def __call__(self, x):
        if isinstance(x, Tensor) and x.requires_grad and x.is_floating_point():
            node = x.grad_fn
            if node is None:  # a leaf: its accumulator, kept alive by the op's edge to it
                node = torch.autograd.graph.get_gradient_edge(x).node
            self.edges[(id(node), x.output_nr if x.grad_fn is not None else 0)] = node
        return x

    def tie(self, out):
        if self.edges:
            _hook_fences(out, self.edges, self.floor, self.nan)
        return out


def _hook_fences(out, edges: dict, floor: int, nan=None) -> None:
    """``nan``: as ``_tie``'s; a create_graph backward's own hooks (a gradient as the result)
    take none (0)."""
    roots, upstream_nan = {}, {}
    for o in out if isinstance(out, tuple) else (out,):
        node = getattr(o, "grad_fn", None) if isinstance(o, Tensor) else None
        if node is not None and node_sequence_nr(node) >= floor:
            roots[id(node)] = node
            if nan is not False and o.is_floating_point():
                upstream_nan[id(node)] = _upstream_nan(o, nan)
    if not roots:
        return
    # the walk holds every node wrapper it has met (``seen`` maps id to the node): torch <= 2.12
    # frees a node's Python wrapper once nothing refers to it, and a later wrapper could take
    # the freed address and pass for a node already walked (its readers never hooked)
    readers, seen, stack = [], dict(roots), list(roots.values())
    while stack:
        node = stack.pop()
        at = []
        for i, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            if (id(nxt), nr) in edges:
                at.append(i)
            elif id(nxt) not in seen and floor <= node_sequence_nr(nxt) and nxt.next_functions:
                seen[id(nxt)] = nxt
                stack.append(nxt)
        if at:
            readers.append((node, frozenset(at)))
    if not readers:
        return
    verdict: dict = {}
    start = [floor]  # where this call's backward began making nodes (a create_graph backward)
    for key, node in roots.items():
        node.register_prehook(_take_verdict(verdict, key, start, upstream_nan.get(key)))
    for node, at in readers:
        node.register_hook(_fence_reads(verdict, at, edges, start))


def _take_verdict(verdict: dict, key: int, start: list, upstream_nan: Tensor | None):
    """The verdict (0: the op's own non-finite gradients are zeroed) from the gradient arriving
    at the result (NaN where it is not finite) plus ``upstream_nan`` (1 where a NaN came in
    with an operand)."""

    def pre(grad_outputs):
        tokens = [(g.detach() * 0).sum() for g in grad_outputs if g is not None]
        if tokens and upstream_nan is not None:
            tokens.append(upstream_nan.to(tokens[0].dtype))
        verdict[key] = sum(tokens[1:], tokens[0]) if tokens else None
        start[0] = sequence_nr()

    return pre


def _fence_reads(verdict: dict, at: frozenset, edges: dict, start: list):
    """The reader's gradient into a fenced operand, fenced; in a create_graph backward the
    nodes this call's backward made (from its result's node on) and that read the operand again
    are hooked the same way, with that gradient as the next order's result (a gradient
    penalty, forces trained on)."""

    def post(grad_inputs, grad_outputs):
        tokens = [t for t in verdict.values() if t is not None]
        token = sum(tokens[1:], tokens[0]) if tokens else None
        out = list(grad_inputs)
        for i in at:
            if out[i] is not None:
                out[i] = _fence_read(out[i], token)
                if out[i].requires_grad:
                    _hook_fences(out[i], edges, start[0], False)
        return tuple(out)

    return post


def _fence_read(g: Tensor, token: Tensor | None) -> Tensor:
    if g.requires_grad and bool(torch.isfinite(g).all()):
        # a create_graph backward: a node here would be one the original's second-order graph
        # lacks (its sums run in another order); a finite gradient needs none. One read back,
        # only where a gradient of a gradient is being built
        return g
    if token is None:  # no gradient reached the result's node: nothing came from upstream
        return torch.nan_to_num(g, nan=0.0, posinf=0.0, neginf=0.0)
    return _fence_grad(g, token.to(g.dtype))


def fenced(impl, fn, args, kwargs, consts):
    """Run a guard: its fences learn from a tie on its result whether the gradient that
    arrives there is finite (exact backward: zero only the op's own singular derivative)."""
    if not torch.is_grad_enabled():
        return impl(fn, args, kwargs, consts, _no_fence)
    fences = Fences()
    return fences.tie(impl(fn, args, kwargs, consts, fences))


def finite(x, nan: Tensor | float | None = None):
    """+-inf to +-sat, identity on finite values; a NaN stays NaN (an operand's, from upstream),
    or becomes ``nan`` where given (``nan_in``'s: 0 where the op made it, NaN where an operand
    brought one). The gradient passes straight through."""
    if not isinstance(x, Tensor) or not x.is_floating_point():
        return x
    if x.is_nested:  # the encoder's inference fast path (padding dropped): each sequence's own
        return torch.nested.as_nested_tensor([finite(t, nan) for t in x.unbind()])
    _count(lambda: _changed(x, nan))
    if not x.requires_grad:
        return _saturate(x, nan)
    return _Finite.apply(x, nan) if _dynamo_traced() else _FINITE_EAGER(x, nan)


def _changed(x: Tensor, nan) -> Tensor:
    """The elements ``finite(x, nan)`` changes: the infinities, and a NaN that becomes 0."""
    if nan is None or not isinstance(nan, Tensor) and nan != 0:
        return torch.isinf(x)
    return torch.isinf(x) | torch.isnan(x) & (nan == 0)


def finite_all(out, nan: Tensor | float | None = None):
    return _each(out, lambda o: finite(o, nan))


def finite_by_position(y, *operands, always: bool = False):
    """``finite(y)`` for an elementwise op that can make a NaN of its own (0 / 0, inf / inf,
    (-2) ** 0.5, xlogy(inf, 1)): its NaN becomes 0, and a NaN where an operand (broadcast) is
    NaN stays, as the plain op's (``always``: the op is NaN wherever an operand is, as a
    division, so y is not read for it). Where no operand is NaN, the test is false: certify's
    intervals see ``finite(y, 0.0)``."""
    s = finite(y, 0.0)
    if not isinstance(s, Tensor) or not s.is_floating_point():
        return s
    upstream = None
    for a in operands:
        if isinstance(a, Tensor) and a.is_floating_point():
            a = a.detach()
            upstream = a != a if upstream is None else upstream | (a != a)
    if upstream is None:
        return s
    if not always:
        yd = y.detach()
        upstream = upstream & (yd != yd)
    return torch.where(upstream, _NAN, s)


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


def clip(x: Tensor, lo: float | None, hi: float | None) -> Tensor:
    """``torch.clamp(x, lo, hi)``, with gradient 1 on the closed ``[lo, hi]`` and at a NaN: the
    original's gradient at a bound (log at max, exp at log(max)), and a NaN operand's, NaN as
    the plain op's. clamp's own gradient is 0 at a NaN (and, from torch 2.14, at a bound:
    ``CLAMP_GRAD_AT_BOUNDS``), so where a gradient is taken the clip is written with ``where``
    (NaN stays NaN, as in clamp)."""
    if not x.requires_grad:
        return torch.clamp(x, lo, hi)
    if lo is not None:
        x = torch.where(x < lo, lo, x)
    if hi is not None:
        x = torch.where(x > hi, hi, x)
    return x


def clamped(lo: str | None, hi: str | None, open_at: float | None = None,
            singular: Callable | None = None, pole: str | None = None) -> Callable:
    """fn(clamp(x, lo, hi)) with a finite-gradient fence between clamp and fn (the exp family,
    whose derivatives are finite on the clamped domain, needs none: ``overflowing``).

    ``open_at``: the op is finite on the whole open interval above it (log of a subnormal is
    -103, not -inf), so while ``lo`` is the dtype's tiny (no tighter bound asked for) only
    operands at or below ``open_at`` are moved to ``lo``, and a subnormal keeps the original's
    value; its infinite derivative is the fence's.

    ``singular(xs)``: (where the derivative is infinite, a safe operand, the op's value there)
    for an op whose only infinite derivative sits at known points of the clamped domain (sqrt
    at 0, acos at +-1). There the op runs on the safe operand and the result is its exact
    value with derivative 0 (the double-where form): no derivative of any order is infinite,
    so second derivatives through a composite (forces from sqrt(sum(d ** 2)) at d = 0, then a
    loss on the forces) stay finite, where a fence masks only after the first-order inf.

    ``pole``: the ``Bounds`` field that stands in for the infinity the op has at and below
    ``open_at``, in place of the op's value at tiny: ``sat`` for rsqrt (rsqrt(tiny) is 9.2e18 in
    float32, past sat: a product of two would overflow, issue 28 item 2); ``log_zero`` for log
    (-194.8 in float32, below every log of a subnormal; exp of it plus any v whose exp is finite
    is exactly 0, so ``logits + mask.log()`` gives padded entries weight exactly 0 after a
    softmax, as the original's -inf, item 4)."""

    def impl(fn, args, kwargs, consts, fence):
        x, rest, kw = _unary(args, kwargs)
        c = consts(x.dtype)
        low, top = (c[lo] if lo else None), (c[hi] if hi else None)
        if open_at is not None:
            xs = _raised(x, low, open_at)
            xs = xs if top is None else clip(xs, None, top)
        else:
            xs = clip(x, low, top)
        _count(lambda: (xs != x) & (x == x))  # (a NaN stays)
        if singular is None:
            y = fn(fence(xs), *rest, **kw)
            if pole is not None and low == bounds(x.dtype).tiny:
                y = torch.where(x <= open_at, getattr(bounds(y.dtype), pole), y)
            return y
        at, safe, value = singular(xs)
        # the fence still takes a derivative that overflows next to the point (sqrt's second
        # derivative at tiny)
        return value(at, fn(fence(torch.where(at, safe, xs)), *rest, **kw))

    return impl


def _raised(x: Tensor, low: float, open_at: float = 0.0) -> Tensor:
    """``x`` at least ``low``. While ``low`` is the dtype's tiny (no tighter bound asked for),
    only operands at or below ``open_at`` move, so a subnormal keeps its own finite value;
    written ``x <= open_at``, so a subnormal that a flush-to-zero CPU reads as 0 moves too, and
    a NaN stays NaN."""
    if low == bounds(x.dtype).tiny:
        return torch.where(x <= open_at, low, x)
    return clip(x, low, None)


@memo
def _value(op: Callable, x: float, dtype: torch.dtype) -> float:
    """The kernel's own value of ``op`` at ``x`` in ``dtype`` (acos(-1) is pi rounded)."""
    return float(op(torch.tensor(x, dtype=dtype)))


def at_zero(xs: Tensor):
    """sqrt: infinite derivative at +-0, where the value is the operand itself (sqrt(-0.0) is
    -0.0). Each ``at_*`` gives (where, a safe operand, y -> the result with the op's own value
    there): Python numbers in ``where`` keep y's dtype."""
    return xs == 0, 1.0, lambda at, y: torch.where(at, xs.detach(), y)


def at_one(xs: Tensor):
    """acosh: infinite derivative at 1, where the value is 0."""
    return xs == 1, 2.0, lambda at, y: torch.where(at, 0.0, y)


def at_unit(op: Callable) -> Callable:
    """acos, asin: infinite derivative at +-1; the value there is the kernel's own."""

    def at(xs: Tensor):
        hi, lo = _value(op, 1.0, xs.dtype), _value(op, -1.0, xs.dtype)
        return (xs.abs() == 1, 0.0,
                lambda at, y: torch.where(at & (xs > 0), hi, torch.where(at, lo, y)))

    return at


def overflowing(hi: str, own: str) -> Callable:
    """exp, exp2, expm1: the operand clamped at ``hi`` (the last value whose result is finite,
    or the user's tighter bound), and a result that would have overflowed is +sat,
    not max: headroom for the next op (exp(100) * 2 stays finite). Every finite result of the
    original below ``hi`` is its own."""

    def impl(fn, args, kwargs, consts, fence):
        x, rest, kw = _unary(args, kwargs)
        top = consts(x.dtype)[hi]
        xs = clip(x, None, top)
        _count(lambda: (xs != x) & (x == x))  # (a NaN stays)
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
    if eps is not None:
        e_lo, e_hi = _in_dtype(eps, x.dtype), _in_dtype(1 - eps, x.dtype)
        if e_lo >= lo and e_hi <= hi:
            # the op's own clip (x < eps ? eps : x > 1 - eps ? 1 - eps : x, bounds crossed
            # above eps = 0.5 included) keeps it inside the guard's: the original's bits
            return fn(fence(x), *rest, **kw)
        # respect the user's eps, but never 1 - eps == 1.0
        lo, hi = max(lo, e_lo), min(hi, e_hi)
    xs = clip(_raised(x, lo), None, hi)
    _count(lambda: (xs != x) & (x == x))
    return fn(fence(xs), *rest, **kw)


# -- division -----------------------------------------------------------------------------


def _quotient(q: Tensor, zero, *operands) -> Tensor:
    """0 where the divisor is 0 (as tf.math.divide_no_nan), +-sat where the quotient overflows,
    0 for inf / inf; NaN where an operand is NaN (NaN / 0 too), as the plain op's."""
    if isinstance(zero, Tensor):
        _count(lambda: zero)
        q = torch.where(zero, 0.0, q)
    elif zero:  # a constant 0 divisor: 0, still connected to the graph for backward
        q = torch.where(torch.ones((), dtype=torch.bool, device=q.device), 0.0, q)
    return finite_by_position(q, *operands, always=True)


def _symbolic(x) -> bool:
    """A Python number known only at run time in a traced graph (``loss.sum().item()`` with
    ``capture_scalar_outputs``): a test on it must be a tensor, never a branch."""
    return isinstance(x, (torch.SymInt, torch.SymFloat))


def div(fn, args, kwargs, consts, fence):
    (x, d), rest, kw = operands(args, kwargs, ("input", "other"))
    q = fn(fence(x), fence(d), *rest, **kw)
    if not q.is_floating_point():
        return q
    if _symbolic(d):  # float64 holds a Python number exactly: a tiny divisor is no 0
        d = torch.scalar_tensor(d, dtype=torch.float64, device=q.device)
    return _quotient(q, d == 0, x, d)


def reciprocal(fn, args, kwargs, consts, fence):
    x, rest, kw = _unary(args, kwargs)
    return _quotient(fn(fence(x), *rest, **kw), x == 0, x)


# -- pow ----------------------------------------------------------------------------------


def _away_from_zero(x: Tensor, m: float) -> Tensor:
    return torch.where(x.abs() < m, torch.full_like(x, m).copysign(x.detach()), x)


def pow_(fn, args, kwargs, consts, fence):
    (x, p), rest, kw = operands(args, kwargs, ("input", "exponent"))
    if isinstance(x, Tensor) and isinstance(p, numbers.Real) and not isinstance(p, bool):
        dom: PowDomain | None = pow_domain(float(p), x.dtype)
        if dom is None:
            return fn(x, p, *rest, **kw)
        xs = _away_from_zero(x, dom.away) if dom.away else clip(x, dom.lo, dom.hi)
        moved = (xs != x) & (x == x)  # a NaN base is no moved one: its power stays NaN
        _count(lambda: moved)
        # for p > 0 the domain keeps p * x ** (p - 1) finite, except at 0 when 0 < p < 1: there
        # the power runs on 1 and the result is 0 (+-0 ** p is +0), with derivative 0 at every
        # order (the double-where form, see clamped; GPT-2's x ** 3 pays for none of it). For
        # p < 0 the domain is where the value is finite: the original's forward there, and the
        # derivative that overflows next to it (x ** -0.5 of float16 1e-4) is the fence's
        if 0 < p < 1:
            at = xs == 0
            # +-0 ** p as the kernel computes it: (-0.0) ** 0.5 is -0.0 in float32 (sqrt), +0
            # in float16 and for other powers
            neg = fn(torch.full((), -0.0, dtype=xs.dtype, device=xs.device), p)
            zero = torch.where(xs.detach().signbit(), neg, 0.0)
            y = torch.where(at, zero, fn(fence(torch.where(at, 1.0, xs)), p, *rest, **kw))
        elif p < 0:
            y = fn(fence(xs), p, *rest, **kw)
        else:
            y = fn(xs, p, *rest, **kw)
        if p < 0 or dom.hi is not None and dom.hi < bounds(x.dtype).max:
            # a base moved in from where the power overflows: +-sat, not +-max,
            # headroom for the next op; a base moved up to 0 (x ** 0.5 of x < 0) gives 0
            y = torch.where(moved, y.sign() * bounds(y.dtype).sat, y)
        if p < 0:
            # 0 ** p (p < 0) is inf: 0, as the division guard makes 1 / 0 (divide_no_nan). What
            # a user's own handling makes of it too (GCN: d = deg ** -0.5; d[d == inf] = 0), so
            # a product with it (d[row] * w * d[col]) and its gradient stay finite. A negative
            # base of a fractional power is outside the domain (NaN): 0 too, not +-sat, so a
            # product of two guard outputs stays finite (torch_geometric#795: negative degrees);
            # (-inf) ** p is 0 plain, and stays so
            y = torch.where(x == 0 if float(p).is_integer() else x <= 0, 0.0, y)
        return y
    # a tensor exponent: any base, any exponent; saturate the value (the op's own NaN, a
    # negative base of a fractional power, to 0), fence the gradients
    return finite_by_position(fn(fence(x), fence(p), *rest, **kw), x, p)


# -- softmax family -----------------------------------------------------------------------


def finite_operand(fn, args, kwargs, consts, fence):
    """logsigmoid: -inf gives logsigmoid(-sat) (-sat) instead of -inf; +inf keeps its own
    finite -0.0, a NaN its NaN."""
    x, rest, kw = _unary(args, kwargs)
    if x.is_floating_point():
        _count(lambda: x == float("-inf"))
        x = torch.nan_to_num(x, nan=_NAN, posinf=float("inf"), neginf=-bounds(x.dtype).sat)
    return fn(x, *rest, **kw)


def _softmax_dim(fn, rest, kw, x: Tensor):
    """The dim a softmax/softmin reduces over, however it was spelled (an nn.Softmax keeps it
    on the instance; F.softmax(x) with no dim picks torch's legacy one)."""
    if isinstance(fn, torch.nn.Softmax2d):
        return -3
    if isinstance(fn, torch.nn.Module):
        dim = getattr(fn, "dim", None)
    else:
        dim = rest[0] if rest else kw.get("dim")
    if dim is None:
        dim = 0 if x.dim() in (0, 1, 3) else 1
    return dim


def masked_rows(sign: int) -> Callable:
    """softmax (``sign`` 1) and softmin (-1): NaN comes only from a row that is all masked
    (every entry -inf; +inf for softmin) or from an entry of the other infinity. Only those
    are moved (to +-sat: a fully masked row becomes uniform, the limit of equal logits); a row
    with any unmasked entry keeps its -inf entries as they are, so its softmax is the
    original's bit for bit, also next to entries as low as -max, where any finite stand-in
    for -inf would win."""
    masked = -sign * float("inf")

    def impl(fn, args, kwargs, consts, fence):
        x, rest, kw = _unary(args, kwargs)
        if not x.is_floating_point() or x.numel() == 0:  # nothing to move (amax of none raises)
            return fn(x, *rest, **kw)
        dim = _softmax_dim(fn, rest, kw, x)
        with torch.no_grad():
            top = x.amax(dim, keepdim=True) if sign > 0 else x.amin(dim, keepdim=True)
            bad = (top == masked) | (x == -masked)
        _count(lambda: bad.expand_as(x))
        return fn(torch.where(bad, sign * bounds(x.dtype).sat, x), *rest, **kw)

    return impl


class _FiniteRows(torch.autograd.Function):
    """``finite`` for the rows whose largest entry (``top``, the amax along the op's dim) is
    not finite: -inf as -max, +inf as max, a NaN kept (its row is NaN, as the plain op's);
    other rows as they are. Its gradient passes straight through, as ``finite``'s: one autograd
    node, nothing saved."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, top):
        b = bounds(x.dtype)
        return torch.where(~torch.isfinite(top), torch.nan_to_num(x, nan=_NAN, posinf=b.max, neginf=-b.max), x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _FiniteRowsJvp(_FiniteRows):
    @staticmethod
    def jvp(ctx, tangent, _):
        return tangent


_FINITE_ROWS_EAGER = function_apply(_FiniteRowsJvp)


def finite_in_out(fn, args, kwargs, consts, fence):
    """log_softmax: a row whose largest entry is not finite (all -inf, a +inf) is read with
    -inf as -max and +inf as max (the winner; an all -inf row becomes uniform), and a row with a
    NaN stays NaN, as the plain op's; every other row runs as written, so a -inf entry next to
    finite ones keeps its neighbours' bits (a finite stand-in for it could outweigh entries as
    low as -max), and its own -inf result becomes -sat, the stand-in for -inf."""
    x, rest, kw = _unary(args, kwargs)
    if not x.is_floating_point() or x.numel() == 0:
        return finite(fn(x, *rest, **kw), 0.0)
    if type(x) is Tensor and x.device.type == "cpu" and not isinstance(fn, torch.nn.Module):
        out = fn(x, *rest, **kw)  # (a module's call twice would run its hooks twice)
        if _all_finite_on_host(out):  # every row finite: nothing to move, its gradient finite
            return out
    dim = _softmax_dim(fn, rest, kw, x)
    top = x.detach().amax(dim, keepdim=True)
    _count(lambda: ~torch.isfinite(top).expand_as(x) & torch.isinf(x))
    if not x.requires_grad:
        xs = _FiniteRows.forward(x, top)
    else:
        xs = _FiniteRows.apply(x, top) if _dynamo_traced() else _FINITE_ROWS_EAGER(x, top)
    # a row's NaN is an operand's (every other row is finite now): NaN where its row holds one
    return finite(fn(xs, *rest, **kw), top.clamp(0, 0))


def logsumexp(fn, args, kwargs, consts, fence):
    """All -inf is -inf with a NaN gradient; +inf is inf. Only those move: an all -inf slice
    to -sat, +inf to +sat, and the result saturated. -inf entries next to a finite one are
    kept (logsumexp(-max, -inf) is -max, where a finite stand-in for -inf could win)."""
    x, rest, kw = _unary(args, kwargs)
    if not x.is_floating_point():
        return fn(x, *rest, **kw)
    if x.numel() == 0:  # over an empty dim: -inf, as an all -inf slice (amax of none raises)
        return finite(fn(x, *rest, **kw), 0.0)
    dim = rest[0] if rest else kw.get("dim")
    sat = bounds(x.dtype).sat
    with torch.no_grad():
        top = x.amax(dim, keepdim=True)
        empty = top == float("-inf")
    _count(lambda: empty.expand_as(x) | (x == float("inf")))
    xs = torch.where(empty, -sat, torch.where(x == float("inf"), sat, x))
    # its only NaN now are an operand's: NaN where the operand holds one
    return finite(fn(xs, *rest, **kw), top.amax().clamp(0, 0))


def finite_result(fn, args, kwargs, consts, fence):
    """std/var: NaN when there are too few elements (0 instead, unless the operand holds a
    NaN), infinite gradient at 0 spread."""
    x, rest, kw = _unary(args, kwargs)
    nan = nan_in(call_operands(fn, args, kwargs))
    upstream(fence, nan)
    return finite_all(fn(fence(x), *rest, **kw), nan)


def xlogy(fn, args, kwargs, consts, fence):
    (x, y), rest, kw = operands(args, kwargs, ("input", "other"))
    if isinstance(y, Tensor):
        # xlogy(0, y) is 0 with a finite gradient for every y: there y is the user's; elsewhere
        # y <= 0 is read as tiny (a subnormal y keeps its finite value, see clamped)
        c = consts(y.dtype)
        lo = c["lo"]
        move = y <= 0 if lo == bounds(y.dtype).tiny else y < lo
        if isinstance(x, Tensor):
            move = move & (x != 0)
        ys = y if not isinstance(x, Tensor) and x == 0 else torch.where(move, lo, y)
        ys = clip(ys, None, c["hi"])
        _count(lambda: (ys != y) & (y == y))
        y_in, y = y, fence(ys)
    else:
        y_in = y
    # xlogy(+-inf, 1) is inf * 0: the op's own NaN, 0; a NaN operand's stays
    return finite_by_position(fn(fence(x), y, *rest, **kw), x, y_in)


# -- composite calls ----------------------------------------------------------------------


class _EachRead(TorchFunctionMode):
    """A torch composite written in Python (``F.normalize``: a norm of its operand, then the
    operand divided by it) run with a fence on each read of an operand, made just before the
    call that reads it. One fence before the whole composite would make autograd add the
    composite's two contributions first and the operand's other uses' after, where the
    original adds them in the order its nodes run: the last bit of the gradient differs
    (issue 28, item 3: e3nn's ``F.normalize(vec)`` beside ``vec.norm()``)."""

    def __init__(self, fence, operands: list):
        super().__init__()
        # ids of operands the mode holds (``operands``), so no other tensor can take one
        self.fence, self.operands, self.ids = fence, operands, {id(t) for t in operands}

    def _read(self, a):
        return self.fence(a) if id(a) in self.ids else a

    @eager_handler
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        args = tuple(self._read(a) for a in args)
        kwargs = {k: self._read(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


_BODIES: dict = {}


def _no_dispatch(*args) -> bool:
    return False


def _body(fn):
    """``fn``'s own code past its ``has_torch_function*`` checks (``entered``), so the calls it
    makes reach a mode; None where it has none to skip or cannot be entered."""
    if fn not in _BODIES:
        names = {n: _no_dispatch for n in fn.__code__.co_names if n.startswith("has_torch_function")}
        try:
            _BODIES[fn] = entered(fn, **names) if names else None
        except Exception:  # noqa: BLE001 - a composite read otherwise: one fence before it
            _BODIES[fn] = None
    return _BODIES[fn]


def _each_read(fn, fence):
    """The body to run with a fence per read: eager, with gradients, ``fn`` a Python function
    (under dynamo and functorch the composite's reads are one graph's, in the compiler's order)."""
    if (fence is _no_fence or not isinstance(fn, types.FunctionType)
            or torch.compiler.is_compiling() or functorch_active()):
        return None
    return _body(fn)


def finite_call(fn, args, kwargs, consts, fence):
    """Ops whose unsafe set is no simple domain (norms at 0, repeated eigenvalues in eigh/svd
    backward, logdet of a singular matrix, lgamma's poles, overflow of cosh): the op runs on
    the user's operands; a non-finite result saturates (its own NaN to 0) and a non-finite
    gradient into any floating operand becomes 0. Identity wherever the original is finite.
    Where an operand holds a NaN, the op's result and gradients are the plain op's, NaN
    included (``nan_in``): the op is no elementwise one, and a NaN reaches a whole row, norm or
    loss."""
    nan = nan_in(call_operands(fn, args, kwargs))
    upstream(fence, nan)
    body = _each_read(fn, fence)
    if body is not None:
        operands = [a for a in (*args, *kwargs.values())
                    if isinstance(a, Tensor) and a.is_floating_point()]
        with _EachRead(fence, operands):
            out = body(*args, **kwargs)
        return finite_all(out, nan)
    fenced = tuple(fence(a) if isinstance(a, Tensor) and a.is_floating_point() else a for a in args)
    kw = {k: fence(v) if isinstance(v, Tensor) and v.is_floating_point() else v
          for k, v in kwargs.items()}
    return finite_all(fn(*fenced, **kw), nan)


def composite_call(fn, args, kwargs, consts, fence):
    """``finite_call`` for a torch composite written in C++ that reads an operand twice
    (``cosine_similarity``, ``poisson_nll_loss``'s ``exp(x) - t * x``): in eager its fences are
    ``Hooked``, so the autograd graph is the original's node for node; traced and under
    functorch, ``finite_call``'s. A NaN result (an infinite operand, float16's 0/0) is 0 unless
    an operand holds a NaN (``nan_in``)."""
    if fence is _no_fence or sequence_nr is None or torch.compiler.is_compiling() or functorch_active():
        return finite_call(fn, args, kwargs, consts, fence)
    hooked = Hooked()
    for a in (*args, *kwargs.values()):
        hooked(a)
    hooked.nan = nan = nan_in(call_operands(fn, args, kwargs))
    return hooked.tie(finite_all(fn(*args, **kwargs), nan))


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
    eps = args[7] if len(args) > 7 else kwargs.get("eps", 1e-5)
    # only where the kernel's sqrt(var + eps) is NaN or 0: a variance a rounding below 0 that
    # eps lifts is the original's
    neg = var + eps <= 0
    _count(lambda: neg)
    var = torch.where(neg, 0.0 if eps > 0 else bounds(var.dtype).tiny, var)
    if len(args) > 2:
        return fn(*args[:2], var, *args[3:], **kwargs)
    return fn(*args, **{**kwargs, "running_var": var})


_F_BATCH_NORM = torch.nn.functional.batch_norm


def finite_low_precision(fn, args, kwargs, consts, fence):
    """Products in float16 (max 65504) overflow on ordinary activations: saturate the result,
    so the next op sees +-sat, not inf (identity on finite values; straight-through gradient).
    bfloat16 has float32's range: there, as in float32/float64, the op runs as written."""
    out = fn(*args, **kwargs)
    if not isinstance(out, Tensor) or out.dtype != torch.float16:
        return out
    # a NaN out of a product is the op's own (an infinite operand: inf * 0, inf - inf), 0,
    # unless an operand holds a NaN: then the plain op's, NaN included (one read of each)
    nan = nan_in(call_operands(fn, args, kwargs))
    if torch.compiler.is_compiling() or view_base(out) is not None or "out" in kwargs:
        return finite(out, nan)
    # eager, a fresh result no one else holds yet: saturated in place, through a detached
    # alias, so autograd records nothing (the gradient passes straight through, as finite's)
    # and no second tensor is made (a product is the largest activation; autocast makes many)
    b = bounds(out.dtype)
    _count(lambda: _changed(out, nan))
    o = out.detach()
    if not isinstance(nan, Tensor):
        o.nan_to_num_(nan=nan, posinf=b.sat, neginf=-b.sat)
        return out
    made = o != o  # (as _saturate's: certify's intervals see a finite result where no operand is NaN)
    o.nan_to_num_(nan=0.0, posinf=b.sat, neginf=-b.sat)
    torch.where(made, nan.to(o.dtype), o, out=o)
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
    nan = nan_in(call_operands(fn, args, kwargs))
    upstream(fence, nan)
    return finite(fn(*args, **kwargs), nan)



def loss(fn, args, kwargs, consts, fence):
    """kl_div / binary_cross_entropy_with_logits: +-inf operands to +-sat; the loss saturated,
    its own NaN (a negative target's log) 0, a NaN operand's NaN."""
    (x, t), rest, kw = operands(args, kwargs, ("input", "target"))
    nan = nan_in(call_operands(fn, args, kwargs))
    upstream(fence, nan)
    return finite(fn(fence(finite(x)), fence(finite(t)), *rest, **kw), nan)


def logits_loss(fn, args, kwargs, consts, fence):
    """cross_entropy / nll_loss on the logits as they are: a vocabulary's logits are a step's
    largest activation, and a saturated copy would raise its peak memory by their size
    (GPT-2 under autocast: +0.8 GB). -inf logits (a masked vocabulary) keep their exact loss
    and gradient; an inf loss (a -inf target logit) saturates; a NaN one the op makes (+inf
    logits, a row of -inf, every target ignored, an empty batch) becomes 0, and the fence
    zeroes the gradient that made it, so every other row trains as without the bad one. A NaN
    in the logits (or in probability targets, or the class weights) gives a NaN loss and the
    plain op's gradient, NaN included (``nan_in``: one read of the logits, no copy)."""
    (x, t), rest, kw = operands(args, kwargs, ("input", "target"))
    if (type(x) is Tensor and x.device.type == "cpu" and not isinstance(fn, torch.nn.Module)
            and _all_finite_on_host(x)):
        out = fn(x, t, *rest, **kw)
        if _all_finite_on_host(out):  # finite logits and loss: finite targets and gradients (an
            return out  # ignored row of inf logits makes a NaN gradient beside a finite loss)
    nan = nan_in(call_operands(fn, args, kwargs))
    upstream(fence, nan)
    return finite(fn(fence(x), fence(finite(t)), *rest, **kw), nan)


# -- a mean over an empty selection ---------------------------------------------------------

# the reductions to one value: a mean divides by a count of elements (or rows: 'batchmean');
# a sum of none is 0, which multi_margin_loss's and multilabel_margin_loss's kernels do not
# write (they return memory they never wrote)
_REDUCED = ("mean", "batchmean", "sum")


@constant_result
def _parameters(fn) -> tuple[tuple[str, ...], int]:
    """A function's parameter names and how many take a position: called, not traced, by
    dynamo (which cannot add the counts of a code object)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return (), 0
    return code.co_varnames[: code.co_argcount + code.co_kwonlyargcount], code.co_argcount


def _reduction(fn, args, kwargs) -> tuple[str | None, Callable | None]:
    """The reduction a loss call asks for, however it is spelled (``reduction=``, by position,
    or the deprecated ``size_average``/``reduce``, which override it), and a function that
    gives the call's (args, kwargs) with another reduction. (None, None) where ``fn`` takes no
    reduction. Read from the function's own parameters (``_parameters``)."""
    names, positional = _parameters(fn)
    if "reduction" not in names:
        return None, None

    def given(name, default=None):
        i = names.index(name) if name in names else None
        if i is not None and i < positional and i < len(args):
            return args[i]
        return kwargs.get(name, default)

    reduction = given("reduction", "mean")
    size_average, reduce = given("size_average"), given("reduce")
    if size_average is not None or reduce is not None:  # as torch's legacy_get_string reads them
        averaged = size_average is None or size_average
        reduction = "none" if reduce is not None and not reduce else "mean" if averaged else "sum"

    def to(other: str):
        a, kw = list(args), dict(kwargs)
        for name, value in (("reduction", other), ("size_average", None), ("reduce", None)):
            if name not in names:
                continue
            i = names.index(name)
            if i < positional and i < len(a):
                a[i] = value
            elif name == "reduction" or name in kw:
                kw[name] = value
        return tuple(a), kw

    return reduction, to


def _reduced_over_none(fn, args, kwargs):
    """A loss reduced to one value over no element (an empty operand): the same loss with
    ``reduction='none'``, summed; None where the call is not reduced, or its elements are not
    empty (an empty feature dim of a non-empty batch), or ``fn`` is a module (an fx capture
    keeps ``nn.MSELoss`` whole: its reduction is its own)."""
    reduction, to = _reduction(fn, args, kwargs)
    if reduction not in _REDUCED:
        return None
    each_args, each_kwargs = to("none")
    each = fn(*each_args, **each_kwargs)
    if not isinstance(each, Tensor) or each.numel() != 0:
        return None
    _count(lambda: torch.ones((), dtype=torch.bool, device=each.device))
    return each.sum()


def _of_none(fn, args, kwargs):
    """Any other call with an empty operand. Where every result is empty (group_norm of an
    empty spatial dim, a loss with reduction='none') it has no value to guard, and the
    gradient into each operand is a sum over no element: 0, or empty. It is computed so,
    the op run without a graph (its backward averages no element: group_norm's kernel gives
    its weight a NaN gradient, and aot_autograd's decomposition raises) and each result tied
    to every operand by 0. Where a result has elements (a per-sample mean over an empty
    feature dim), a NaN in it is read as 0 unless an operand holds a NaN."""
    with torch.no_grad():
        out = fn(*args, **kwargs)
    results = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, Tensor)]
    if any(o.numel() for o in results):
        return finite_all(fn(*args, **kwargs), nan_in(call_operands(fn, args, kwargs)))
    ties = [a.sum() * 0 for a in (*args, *kwargs.values())
            if isinstance(a, Tensor) and a.requires_grad and a.is_floating_point()]
    if not ties:
        return out
    tie = sum(ties[1:], ties[0])
    return _each(out, lambda o: o + tie.to(o.dtype) if isinstance(o, Tensor) and o.is_floating_point() else o)


def mean_reduced(inner: Callable | None = None) -> Callable:
    """A loss whose reduction is a mean ('mean', the default, and kl_div's 'batchmean') over
    no element at all (a depth loss ``mse_loss(pred[valid], depth[valid])`` on a map with no
    valid pixel, pytorch#50224) is 0 / 0 = NaN. There it is the same loss with
    ``reduction='none'``, summed: 0, whose gradient into every operand is exact (an empty
    operand's is empty, a weight's or a broadcast target's 0), with no division anywhere,
    neither the kernel's nor that of aot_autograd's decomposition of its backward (mse_loss,
    smooth_l1_loss and huber_loss there compute ``2.0 / numel`` in Python and raise
    ZeroDivisionError at trace time). A 'sum' over no element is that same 0 (the kernels of
    multi_margin_loss and multilabel_margin_loss return memory they never wrote). Any other
    call with an empty operand is ``_of_none``'s. Whether an operand is empty is a shape,
    known before the call: every call without one goes to ``inner`` (the op as written where
    None), so a loss over a non-empty selection keeps the original's bits and gradient."""

    def impl(fn, args, kwargs, consts, fence):
        empty = empty_operand(args, kwargs)
        if empty:  # a dim of static size 0 (dynamo specialises 0 and 1)
            out = None if isinstance(fn, torch.nn.Module) else _reduced_over_none(fn, args, kwargs)
            return _of_none(fn, args, kwargs) if out is None else out
        written = fn(*args, **kwargs) if inner is None else inner(fn, args, kwargs, consts, fence)
        if empty is None and not isinstance(fn, torch.nn.Module):
            return _maybe_over_none(fn, args, kwargs, written)
        return written

    return impl


def _maybe_over_none(fn, args, kwargs, written):
    """A reduced loss over a selection whose size is known only at run time (an unbacked size
    in a traced graph): no branch on it can be traced, so both are computed and the count
    chooses, as a tensor: ``_reduced_over_none``'s sum where there is no element, the loss as
    written (its bits) where there are some. The written loss's NaN over no element gets a
    zero gradient from the ``where`` and is an empty gradient there."""
    reduction, to = _reduction(fn, args, kwargs)
    if reduction not in _REDUCED or not isinstance(written, Tensor):
        return written
    each_args, each_kwargs = to("none")
    each = fn(*each_args, **each_kwargs)
    if not isinstance(each, Tensor):
        return written
    none = torch.scalar_tensor(each.numel(), dtype=torch.float64, device=each.device) == 0
    return torch.where(none, each.sum().to(written.dtype), written)


def _check_key_padding_mask(mask: Tensor, src_len: int, bsz: int) -> None:
    """torch's own check, without the message closures dynamo cannot trace."""
    if mask.shape[0] != bsz:
        raise AssertionError(f"Expected key_padded_mask.shape[0] to be {bsz}, but got {mask.shape[0]}")
    if mask.shape[1] != src_len:
        raise AssertionError(f"Expected key_padded_mask.shape[1] to be {src_len}, but got {mask.shape[1]}")


_MHA = torch.nn.functional.multi_head_attention_forward
_MHA_BODY = entered(_MHA, _check_key_padding_mask=_check_key_padding_mask)

# a TorchFunctionMode under which each call the rule table names goes to its guard (or to the
# guard given for its rule's name): set by _intercept, the layer that knows the table
_GUARDED_CALLS: list[Callable] = []


def guard_calls_with(mode: Callable) -> None:
    _GUARDED_CALLS[:] = [mode]


def _scores(fn, args, kwargs, consts, fence):
    """float16 attention scores (q @ k^T, mask + q @ k^T), which only a softmax reads: +inf is
    max (the row's winner, as the true score was), -inf stays (weight 0, as in the original:
    a saturated -sat could beat finite scores below it), NaN (a masked -inf plus an overflowed
    +inf) is -inf, but where an operand (q, k, the mask) holds a NaN: then the plain scores,
    NaN included. A row left all -inf is the softmax guard's."""
    s = fn(*args, **kwargs)
    if not isinstance(s, Tensor) or s.dtype != torch.float16:
        return s
    nan = nan_in(call_operands(fn, args, kwargs))
    _count(lambda: torch.isnan(s) & ~torch.isnan(torch.as_tensor(nan)) | (s == float("inf")))
    scores = torch.nan_to_num(s, nan=float("-inf"), posinf=bounds(s.dtype).max, neginf=float("-inf"))
    if not isinstance(nan, Tensor):  # no operand with elements: every NaN is the op's own
        return scores
    return torch.where(s != s, nan.to(s.dtype) - float("inf"), scores)  # -inf, or NaN


_ATTENTION_CALLS = {"bmm": _scores, "baddbmm": _scores}


def attention(fn, args, kwargs, consts, fence):
    """nn.MultiheadAttention / F.multi_head_attention_forward: torch's own code runs with each
    call it makes guarded. A query whose every key is masked reaches the softmax guard (its row
    becomes uniform); in float16, q @ k^T past 65504 is inf and its softmax NaN (pytorch#60939):
    the projections saturate, the scores keep their order (``_scores``). Every result the
    original gets finite keeps its bits. A module (an fx capture keeps nn.MultiheadAttention
    whole) reaches the function under the same mode."""
    with _GUARDED_CALLS[0](_ATTENTION_CALLS):
        return (_MHA_BODY if fn is _MHA else fn)(*args, **kwargs)


def _bound(fn, args, kwargs, names: tuple[str, ...]) -> dict:
    """``names`` of a call, wherever it passed them (torch's keyword-only arguments arrive
    positionally in an aten call)."""
    got = dict(zip(names, args))
    got.update((k, v) for k, v in kwargs.items() if k in names)
    return got


_SEGMENT_ARGS = ("data", "reduce", "lengths", "indices", "offsets", "axis", "unsafe", "initial")


def segment_reduce(fn, args, kwargs, consts, fence):
    """An empty segment (length 0: an item with no category id, alibaba/TorchEasyRec#104) is a
    mean of nothing (0 / 0) or the identity of max/min (-+inf). It gives 0 there, as torch's
    other reductions give an empty group (scatter_reduce, index_reduce, embedding_bag), and a
    zero gradient; a finite empty segment (a sum's 0, a prod's 1, the user's ``initial``) and
    every non-empty one keep the original's bits, a NaN from the data included."""
    out = fn(*args, **kwargs)
    if not isinstance(out, Tensor) or not out.is_floating_point():
        return out
    bound = _bound(fn, args, kwargs, _SEGMENT_ARGS)
    lengths, offsets = bound.get("lengths"), bound.get("offsets")
    if isinstance(lengths, Tensor):
        empty = lengths == 0
    elif isinstance(offsets, Tensor):
        empty = offsets[..., 1:] == offsets[..., :-1]
    else:
        return out
    axis = bound.get("axis", 0)
    axis = axis + out.dim() if axis < 0 else axis
    empty = empty.reshape(empty.shape + (1,) * (out.dim() - axis - 1)).to(out.device)
    _count(lambda: empty & ~torch.isfinite(out))
    return torch.where(empty & ~torch.isfinite(out.detach()), torch.zeros((), dtype=out.dtype, device=out.device), out)
