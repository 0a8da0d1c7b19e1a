"""What a rule is: an op's spellings, derived from its name as OpInfo derives variants, its
guard, and the operands its tests use. The table itself is ``_rules.py``.

A spelling is how an op can appear: a function (``torch.div``), a Python operator
(``operator.truediv``), a tensor method (``"div"``), an in-place method or operator (``"div_"``,
``operator.itruediv``), or a module class (``nn.Softmax``). Unless a rule lists them, its
functions are ``torch.<name>``, ``torch.special.<name>`` and ``F.<name>`` where torch has them,
its method ``Tensor.<name>``, and its in-place method ``Tensor.<name>_``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ._compat import known_true, may_be_zero, removed_op
from ._constants import Bounds

Tensor = torch.Tensor

# constants a rule's guard reads; "lo*" overrides may only be raised, the others only lowered
TINY_MAX = {"lo": lambda b: b.tiny, "hi": lambda b: b.max}


class Spelling(NamedTuple):
    """One way a user writes an op. A named tuple, not a frozen dataclass: dynamo 2.11 cannot
    call a callable read from a frozen dataclass's field (``sp.call(...)`` in a traced guard)."""

    kind: str  # function | operator | method | module
    name: str  # as a user would write it: "torch.div", "operator.truediv", "Tensor.div_", "nn.Softmax"
    target: object  # the fx node target: a callable, a method name, or a module class
    call: Callable | None  # the op as written (None for modules: the instance is the callable)
    outplace: Callable | None = None  # for in-place spellings: the out-of-place op to guard
    # a reflected dunder written as a method call (``x.__rtruediv__(2.0)`` is 2 / x): its node
    # holds the right operand first, and ``call`` takes the operands in the op's own order
    reflected: bool = False

    @property
    def inplace(self) -> bool:
        return self.outplace is not None


Operands = Callable[[torch.dtype], tuple[tuple, dict]]


def tensor(*values, grad: bool = True, shape=None, dtype=None) -> Callable[[torch.dtype], Tensor]:
    """A test operand in the dtype under test (or a fixed ``dtype``, e.g. integer targets)."""

    def make(dt: torch.dtype) -> Tensor:
        fi = torch.finfo(dt) if dt.is_floating_point else None
        vals = [(-1 if v[0] == "-" else 1) * float(getattr(fi, v.lstrip("-"))) if isinstance(v, str) else v
                for v in values]  # "max", "-max", "tiny": the dtype's own
        t = torch.tensor(vals, dtype=torch.float64 if dtype is None else dtype)
        t = t.to(dt) if dtype is None else t
        if shape is not None:
            t = t.reshape(shape)
        return t.requires_grad_(grad and t.is_floating_point())

    return make


def operands(*args, **kwargs) -> Operands:
    """(args, kwargs) for a dtype: each ``tensor(...)`` is made in it, other values pass."""

    def make(dt: torch.dtype):
        def one(a):
            return a(dt) if callable(a) and not isinstance(a, type) else a

        return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}

    return make


@dataclass(frozen=True)
class Sample:
    """The operands an op's tests use, carried on its rule: ``bad`` makes the unguarded op's
    value or gradient non-finite; ``good`` lies inside the safe domain, where the guard must
    return the original's bits. ``ctor`` gives constructor arguments of module spellings."""

    bad: Operands
    good: Operands
    ctor: dict[str, tuple] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    second_order: bool = True  # False where torch itself has no double backward (ctc_loss)
    # False where dynamo graph-breaks on the op: under torch.compile it runs outside any graph,
    # eagerly (the backend guards it there as every eager call; nanpass.harden guards it)
    dynamo: bool = True
    # spellings written in Python whose body dynamo traces through: under torch.compile the
    # ops inside meet their own rules (nanpass.harden guards the call as one)
    inlined: tuple[str, ...] = ()
    breaks: tuple[str, ...] = ()  # spellings dynamo graph-breaks on, where the rule's others it captures
    # spellings whose bad operands break the op only as aot_autograd decomposes it (the eager
    # kernel is finite there): under torch.compile the unguarded op is not finite
    compiled: tuple[str, ...] = ()
    # bad operands of the spellings that take other arguments (a rule that names a family:
    # torch.linalg.solve(A, B) next to torch.linalg.inv(A)); keyed by spelling name, in-place
    # and torch.Tensor.* forms folded into "Tensor.<method>"
    spellings: dict[str, Operands] = field(default_factory=dict)
    # finite operands whose value is finite but whose backward overflows from a finite upstream
    # gradient (a float16 product: grad_out @ B^T past max): the one non-finite gradient a guard
    # leaves as the original's, where a too-large loss scale first shows (docs/guards.md)
    backward_overflow: Operands | None = None

    def captured(self, spelling: str) -> bool:
        """Whether dynamo puts this spelling into a graph (False: a graph break, run eagerly)."""
        return self.dynamo and spelling not in self.breaks

    def bad_for(self, spelling: str) -> Operands:
        key = spelling.replace("torch.Tensor.", "Tensor.")
        if key.startswith("Tensor.") and key.endswith("_") and key.rstrip("_") in self.spellings:
            key = key.rstrip("_")
        return self.spellings.get(key, self.bad)


def _derived_functions(name: str) -> tuple[str, ...]:
    return tuple(f for f in (f"torch.{name}", f"torch.special.{name}", f"F.{name}")
                 if _resolve(f) is not None)


@dataclass(frozen=True, eq=False)
class Rule:
    name: str
    guard: Callable | None  # _guards impl; None: recognised but never rewritten
    reason: str = ""  # why the op is unsafe (or, with guard None and safe=True, why it is not)
    action: str = ""  # what the guard does, one line
    functions: tuple[str, ...] | None = None  # None: derived from the name
    operators: tuple[str, ...] = ()  # in-place operator spellings go in inplace_operators
    inplace_operators: tuple[tuple[str, str], ...] = ()  # (in-place, out-of-place)
    # other names of the operators' Tensor dunders, (alias, the dunder it stands for): Python 2's
    # ``__div__``, ``__rdiv__``, ``__idiv__``, which Tensor still has and a user can call
    dunder_aliases: tuple[tuple[str, str], ...] = ()
    methods: tuple[str, ...] | None = None  # None: Tensor.<name> where it exists
    inplace: bool | None = None  # derive "name_" in-place methods (None: where torch has them)
    modules: tuple[str, ...] = ()
    constants: dict[str, Callable[[Bounds], float]] = field(default_factory=dict)
    safe_if: Callable | None = None  # (args, kwargs) -> reason the call is statically safe
    safe: bool = False  # guard None and reported as looked at and left alone
    stable: bool = False  # produced by a stable-form rewrite
    sample: Sample | None = None  # the operands its tests use (every guarded rule has one)
    # the op is unsafe only for operands of these dtypes (a product overflows float16, not
    # float32): other calls are not looked at, cost nothing and are not reported
    only_dtypes: tuple[torch.dtype, ...] = ()
    # CUDA autocast runs the op in float32 (torch's amp lists: layer_norm, pow, ...): under it
    # a float16 operand is not computed in float16, and the dtype's hazard is not there
    autocast_float32: bool = False
    # operand values where the op is infinite on purpose (log(0), x / 0): check mode reads an
    # Inf made there as a pole, quiet until it turns into NaN or escapes, and any other Inf
    # from finite operands as an overflow, named at once
    poles: tuple[float, ...] = ()
    pole_operand: int = 0  # which operand the poles are values of (1: the divisor)

    @property
    def guarded(self) -> bool:
        return self.guard is not None

    def spellings(self, removed: bool = False) -> Iterator[Spelling]:
        """``removed``: also the spellings the running torch keeps only as a stub that says the
        op was removed (``torch.qr`` from 2.14), or lacks (``F.linear_cross_entropy`` before
        2.13; its target None): docs/guards.md lists what the table names."""
        functions = _derived_functions(self.name) if self.functions is None else self.functions
        methods = ((self.name,) if hasattr(Tensor, self.name) else ()) if self.methods is None else self.methods
        for name in functions:
            fn = _resolve(name, removed)
            if fn is not None or removed and self.functions is not None:
                yield Spelling("function", name, fn, fn)
        for name in self.operators:
            fn = _resolve(name)
            yield Spelling("operator", name, fn, fn)
        for ip, op in self.inplace_operators:
            yield Spelling("operator", ip, _resolve(ip), _resolve(ip), _resolve(op))
        for m in methods:
            if not hasattr(Tensor, m) or not removed and removed_op(getattr(Tensor, m)):
                continue
            fn = getattr(Tensor, m)
            yield Spelling("method", f"Tensor.{m}", m, fn)
            yield Spelling("function", f"torch.Tensor.{m}", fn, fn)
            if self.inplace is not False and hasattr(Tensor, m + "_"):
                ip = getattr(Tensor, m + "_")
                yield Spelling("method", f"Tensor.{m}_", m + "_", ip, fn)
                yield Spelling("function", f"torch.Tensor.{m}_", ip, ip, fn)
        for name in self.modules:
            cls = _resolve(name)
            if cls is not None:
                yield Spelling("module", name, cls, None)


def _resolve(name: str, removed: bool = False):
    """"torch.special.expm1" -> the object, or None where this torch lacks it (or keeps only a
    stub that says it was removed)."""
    if name.startswith("nn."):
        name = "torch." + name
    elif name.startswith("F."):
        name = "torch.nn.functional." + name[2:]
    mod, _, attr = name.rpartition(".")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError):
        return None
    if getattr(obj, "_nanpass_stand_in", False):  # (_fastpath's, installed at import) torch's own
        obj = obj.__wrapped__
    return None if not removed and removed_op(obj) else obj


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _divisor_safe(args, kwargs):
    d = args[1] if len(args) > 1 else kwargs.get("other")
    if _number(d) and abs(d) >= 1 and kwargs.get("rounding_mode") is None:
        return f"constant divisor {d!r}: |divisor| >= 1 cannot make the quotient non-finite"
    return None


def _nonzero_divisor(args, kwargs):
    d = args[1] if len(args) > 1 else kwargs.get("other")
    if _number(d) and d != 0:
        return f"nonzero constant divisor {d!r}: no division by 0"
    return None


def _value(x) -> Tensor | None:
    """A tensor operand, or a graph node's recorded value (None for anything else)."""
    if isinstance(x, Tensor):
        return x
    meta = getattr(x, "meta", None)
    v = meta.get("example_value", meta.get("val")) if isinstance(meta, dict) else None
    return v if isinstance(v, Tensor) else None


def _dtype(x) -> torch.dtype | None:
    v = _value(x)
    return None if v is None else v.dtype


def _shape(x):
    v = _value(x)
    return None if v is None else v.shape


_NONEMPTY = "a mean over a non-empty selection"


def _nonempty_mean(args, kwargs):
    """A mean is NaN only over an empty selection (0 / 0 from no operands at all): a mean
    whose reduced dims all have a (static) size above 0 is safe."""
    x = args[0] if args else kwargs.get("input", kwargs.get("self"))
    if isinstance(x, Tensor) and x.numel():  # the hot path: every dim is non-empty
        return _NONEMPTY
    shape = _shape(x)
    if shape is None:
        return None
    dim = args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else kwargs.get("dim")
    dims = range(len(shape)) if dim is None or dim == [] or dim == () else (
        dim if isinstance(dim, (tuple, list)) else (dim,))
    try:
        sizes = [shape[d] for d in dims]
    except (IndexError, TypeError):
        return None
    if all(isinstance(n, int) and n > 0 for n in sizes):
        return _NONEMPTY
    return None


def empty_operand(args, kwargs) -> bool | None:
    """Whether a floating operand has no element: True where one has a dim of size 0, None
    where one may have (a symbolic size not known statically to be non-zero: an unbacked size
    out of ``nonzero()`` or a boolean mask, known only at run time), False where none has.
    Nothing here puts a guard on a size: a backed symbolic size is known non-zero (dynamo
    specialises 0 and 1), and a data-dependent one is never asked for its value. Under
    dynamo's own trace (a hardened model compiled) a size reads as an int whatever it is, so
    each is asked only through ``statically_known_true``, which dynamo answers without a
    guard."""
    maybe = False
    tracing = torch.compiler.is_dynamo_compiling()
    for a in (*args, *kwargs.values()):
        v = _value(a)
        if v is not None and v.is_floating_point():
            for n in v.shape:
                if tracing:
                    if known_true(n == 0):
                        return True
                    maybe = maybe or not known_true(n != 0)
                elif isinstance(n, int):
                    if n == 0:
                        return True
                elif may_be_zero(n):
                    maybe = True
    return None if maybe else False


def _has_empty(args, kwargs) -> bool:
    """A floating operand with no element, or one that may have none (``empty_operand``)."""
    return empty_operand(args, kwargs) is not False


def computes_in(args, dtypes: tuple[torch.dtype, ...], autocast_float32: bool) -> bool:
    """Whether the call computes in one of ``dtypes``, as ``Rule.only_dtypes`` is read: an
    operand of that dtype (one CUDA autocast computes in float32 for an op on its float32
    list), or autocast to it."""
    first = None
    for a in args:
        v = _value(a)
        if v is None:
            continue
        if first is None:
            first = v
            if autocast_float32 and cuda_autocast(v):
                return torch.float32 in dtypes
        if v.dtype in dtypes:
            return True
    if first is None:
        return False
    device = "cuda" if first.is_cuda else "cpu"
    return torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) in dtypes


def nonempty_operands(dtypes: tuple[torch.dtype, ...] = (), autocast_float32: bool = False) -> Callable:
    """``safe_if`` of an op that may average no element (``_guards.mean_reduced``): a call
    whose every operand has elements averages some, and is left as written, at the cost of a
    look at the shapes. ``dtypes``: the op has a hazard of its own in these dtypes (float16:
    an eps that rounds to 0), guarded in them whatever the shapes; ``Rule.only_dtypes`` cannot
    say so, since a mean over nothing is NaN in every dtype."""

    def safe_if(args, kwargs):
        if _has_empty(args, kwargs):
            return None
        if dtypes and computes_in(args, dtypes, autocast_float32):
            return None
        what = "" if not dtypes else " outside " + " and ".join(str(d)[6:] for d in dtypes)
        return f"every operand has elements{what}: a mean over a non-empty selection"

    return safe_if


def cuda_autocast(x) -> bool:
    """``x`` is a CUDA tensor under CUDA autocast (an op on autocast's float32 list then
    computes in float32 whatever ``x``'s dtype)."""
    return isinstance(x, Tensor) and x.is_cuda and torch.is_autocast_enabled("cuda")


def _exponent_safe(args, kwargs):
    p = args[1] if len(args) > 1 else kwargs.get("exponent")
    if _number(p) and p in (0, 1):
        return f"exponent {p!r} is finite with a finite gradient everywhere"
    base = args[0] if args else kwargs.get("input", kwargs.get("self"))
    dtype = torch.float32 if cuda_autocast(base) else _dtype(base)  # pow is on the float32 list
    if _number(p) and float(p).is_integer() and p >= 2 and dtype in (torch.float32, torch.float64, torch.bfloat16):
        # x ** 3 is x * x * x: past max only for |x| > cbrt(max) (7e12 in float32), the
        # overflow of ordinary arithmetic (docs/census.md); bfloat16 has float32's range; in
        # float16 (past 40) it is guarded
        return (f"integer power {p!r} of a {str(dtype)[6:]} base: finite with a finite gradient "
                f"unless the base is past {torch.finfo(dtype).max ** (1 / (p)):.3g}")
    return None


