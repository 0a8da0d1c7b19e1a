"""Harden's guard mode without a ``TorchFunctionMode``: while a hardened call runs on some
thread, each spelling the rule table names is swapped, where it is looked up (``torch.log``,
``F.softmax``, ``Tensor.log``, ``Tensor.__truediv__``, and the names the model's own code bound
before harden), for a small function that sends the call to the running model's guards. Every
other torch call never enters Python: a mode's handler runs for each of them (GPT-2's train
step: 913 calls, of which 99 are the table's), and on a launch-bound step that handler alone
costs more than every guard together (issue 38 item 2; docs/architecture.md, "The fast path").

What it cannot see is found before it is used: a model whose code reaches a table spelling
through something that cannot be swapped for the call (an instance attribute
``self.act = torch.tanh``, a default argument, a container) runs under the mode instead, and
says why (``Sites.fast``). What it still cannot see is in the architecture doc, measured.

The swap is process-wide while any thread runs a hardened call (counted), and each swapped
function reads a thread-local: another thread's calls, and calls made inside a guard, run as
written. On CPython 3.13 and later (``TAG_LIMITED``) the swap is not made: the mode runs.
Under dynamo the hardened call runs under the mode (traced into the graph), never through
this path.
"""

from __future__ import annotations

import dis
import functools
import sys
import threading
import types
from collections.abc import Callable

import torch

from . import _compat
from ._rules import CALLS

Tensor = torch.Tensor
_local = threading.local()
_lock = threading.Lock()


def _namespaces() -> tuple:
    return (torch, torch.nn.functional, torch.special, torch.linalg, torch.fft, Tensor)


def _key(obj):
    try:
        return obj if obj in CALLS else None
    except Exception:  # noqa: BLE001 - an unhashable attribute, or one whose __hash__ raises
        return None


def _homes() -> list[tuple[object, str, object]]:
    """(namespace, attribute, the table's callable) for each name a user looks a spelling up
    by; ``Tensor``'s own methods are inherited, so they are read with ``getattr``."""
    out = []
    for ns in _namespaces():
        names = dir(ns) if ns is Tensor else list(vars(ns))
        for name in names:
            try:
                obj = getattr(ns, name)
            except AttributeError:  # pragma: no cover - a lazy attribute that fails
                continue
            if _key(obj) is not None:
                out.append((ns, name, obj))
    return out


# the callable -> its stand-in (one per callable, made once); the stand-in -> the table's entry
_STAND_INS: dict = {}
STAND_IN_HITS: dict = {}
_ADMIT: list[Callable] = []  # the dtype filter of rules with only_dtypes (set by _intercept)


def _stand_in(orig):
    got = _STAND_INS.get(orig)
    if got is not None:
        return got
    hit = CALLS[orig]
    rule, _, swapped = hit
    only = bool(rule.only_dtypes) and not swapped
    admit = _ADMIT[0]

    def call(*args, **kwargs):
        sites = getattr(_local, "sites", None)
        if sites is None:
            return orig(*args, **kwargs)
        _local.sites = None  # the guard's own calls (a composite's too) run as written
        try:
            if only and not admit(rule, args):  # not unsafe in this dtype: as the mode leaves it
                return orig(*args, **kwargs)
            return sites.call(hit, args, kwargs or {})
        finally:
            _local.sites = sites

    call.__name__ = getattr(orig, "__name__", "call")
    call.__qualname__ = getattr(orig, "__qualname__", call.__name__)
    call.__doc__ = getattr(orig, "__doc__", None)
    call.__wrapped__ = orig
    call._nanpass_stand_in = True
    _STAND_INS[orig] = call
    STAND_IN_HITS[call] = hit
    return call


class _Swap:
    """One place a spelling is looked up: a namespace attribute, a module's global, a cell."""

    __slots__ = ("where", "name", "orig", "had", "new", "key")

    def __init__(self, where, name, orig):
        self.where, self.name, self.orig = where, name, orig
        self.key = (id(where), name)  # the where is held by the swap
        self.had = isinstance(where, type) and name in vars(where)
        self.new = _stand_in(orig)

    def current(self):
        if isinstance(self.where, dict):
            return self.where.get(self.name)
        if isinstance(self.where, types.CellType):
            try:
                return self.where.cell_contents
            except ValueError:
                return None
        return getattr(self.where, self.name, None)

    def put(self) -> bool:
        """Swap in the stand-in; False where the name no longer holds the table's callable (a
        patch made since: the call runs under the mode, which sees what that patch calls)."""
        if self.current() is not self.orig:
            return False
        new = self.new
        if isinstance(self.where, dict):
            self.where[self.name] = new
        elif isinstance(self.where, types.CellType):
            self.where.cell_contents = new
        else:
            setattr(self.where, self.name, new)
        return True

    def take(self) -> None:
        if self.current() is not self.new:
            return  # replaced during the call: the later patch stays
        if isinstance(self.where, dict):
            self.where[self.name] = self.orig
        elif isinstance(self.where, types.CellType):
            self.where.cell_contents = self.orig
        elif isinstance(self.where, type) and not self.had:
            delattr(self.where, self.name)  # an inherited method: its own again
        else:
            setattr(self.where, self.name, self.orig)


_BASE: list = []
_ON: dict = {}  # (id of the namespace, dict or cell, name) -> [_Swap, users]; held by the _Swap

# Swapping Tensor's methods sets attributes of the class, and each clears its attribute-cache
# version tag. From CPython 3.13 a class that has used 1,000 tags is never cached again, so a
# swap per call would slow every tensor attribute lookup of the process for good after a few
# dozen calls; swapping once and keeping it hides torch's own methods from dynamo's tables.
# There the model runs under the mode (``Sites.fast`` says so).
TAG_LIMITED = sys.version_info >= (3, 13)


def _base() -> list[_Swap]:
    if not _BASE:
        _BASE.extend(_Swap(ns, name, obj) for ns, name, obj in _homes())
    return _BASE


# an operator in the code (``dis``: BINARY_OP's symbol from 3.11, the opcode's name on 3.10)
# -> the Tensor names Python may call for it (``2 / x`` calls x.__rtruediv__)
_OPERATORS = {}
for _sym, _op, _names in (("/", "TRUE_DIVIDE", ("__truediv__", "__rtruediv__", "__rdiv__", "__div__")),
                          ("**", "POWER", ("__pow__", "__rpow__")),
                          ("%", "MODULO", ("__mod__", "__rmod__")),
                          ("//", "FLOOR_DIVIDE", ("__floordiv__", "__rfloordiv__")),
                          ("@", "MATRIX_MULTIPLY", ("__matmul__", "__rmatmul__"))):
    _in = tuple("__i" + n[2:] for n in _names if not n.startswith("__r"))
    _OPERATORS.update({_sym: _names, "BINARY_" + _op: _names,
                       _sym + "=": _in + _names, "INPLACE_" + _op: _in + _names})


_BINARY_OP = dis.opmap.get("BINARY_OP")  # 3.11+: the operator is its argument
_NB = {i: sym for i, (_, sym) in enumerate(getattr(dis, "_nb_ops", ()))}
_OPCODES = {code: name for name, code in dis.opmap.items() if name in _OPERATORS}  # 3.10


def _operators(code) -> set:
    """The Tensor names the operators in ``code`` (and its nested code) may call, read from
    the raw wordcode (``dis.get_instructions`` took a second over GPT-2's code)."""
    out = set()
    co = code.co_code
    ops = co[::2]
    if _BINARY_OP is not None:
        if _BINARY_OP in ops:
            for op, arg in zip(ops, co[1::2], strict=True):
                if op == _BINARY_OP:
                    out.update(_OPERATORS.get(_NB.get(arg), ()))
    else:
        for op in set(ops) & _OPCODES.keys():
            out.update(_OPERATORS[_OPCODES[op]])
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _operators(c)
    return out


def _needed(names: set) -> list[_Swap]:
    """The swaps a model needs: each name its code looks up and each operator its bytecode
    uses (``x / y`` names nothing). All 312 names cost 0.27 ms a call on this CPU, a small
    model's whole forward; a name the scan did not see is found by the survey."""
    return [s for s in _base() if s.name in names]


def enter(sites, swaps: tuple):
    """Start a hardened call on this thread: what ``leave`` restores, or ``MISSED`` where a
    name could not be swapped (nothing is changed then)."""
    with _lock:
        if not _ON:
            _compat.build_dynamo_tables()
        fresh = []
        for s in swaps:
            got = _ON.get(s.key)
            if got is None:
                if not s.put():
                    for k in reversed(fresh):
                        _ON.pop(k)[0].take()
                    return MISSED
                _ON[s.key] = got = [s, 0]
                fresh.append(s.key)
            got[1] += 1
    prev = getattr(_local, "sites", None)
    _local.sites = sites
    return prev


MISSED = object()


def leave(prev, swaps: tuple) -> None:
    _local.sites = prev
    with _lock:
        for s in reversed(swaps):
            got = _ON[s.key]
            got[1] -= 1
            if got[1] == 0:
                got[0].take()
                del _ON[s.key]


def active() -> bool:
    """Whether this thread is in a hardened call's fast path, outside any guard."""
    return getattr(_local, "sites", None) is not None


def paused():
    """The running fast path off for this thread (checkpoint's own code, a custom backward);
    returns what ``resume`` puts back."""
    prev = getattr(_local, "sites", None)
    _local.sites = None
    return prev


def resume(prev) -> None:
    _local.sites = prev


# -- what the model's code binds ------------------------------------------------------------
def _ours(module_name: str | None) -> bool:
    return bool(module_name) and (module_name == "torch" or module_name.startswith(("torch.", "nanpass.")))


# bumped whenever a module anywhere gets a submodule (``model.block = Other()``): a hardened
# model then looks at its module classes again before its next call, and scans the new code
EPOCH = [0]


def _registered(module, name, submodule) -> None:
    EPOCH[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_registered)


def scan(model: torch.nn.Module, learned: set = frozenset()) -> tuple[tuple, str | None]:
    """What a call of the model swaps: each name its code (its classes' methods, the
    functions and classes they reach through their globals and the modules those name, their
    closures) looks up that the table holds, and each name it bound to a table spelling; and
    the first reason the fast path cannot be used (a binding it cannot swap)."""
    found: dict = {}
    used: set = set(learned)
    todo: list = []
    seen: set = set()
    for name, m in model.named_modules():
        if type(m).__module__ == "torch._dynamo.eval_frame":  # OptimizedModule, without importing dynamo
            return (), (f"{name or 'the model'} is torch.compile'd: dynamo may first build its tables "
                        f"of torch's callables while the names are swapped")
        for k, v in vars(m).items():
            if isinstance(v, functools.partial):
                v = v.func
            if _key(v) is not None:
                return (), f"{type(m).__name__}.{k} holds {_name(v)}"
            if isinstance(v, types.FunctionType):
                todo.append(v)
        todo.append(type(m))
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            if obj in (object, torch.nn.Module):
                continue
            if _ours(obj.__module__):  # torch's own module: the names its code looks up
                for v in vars(obj).values():
                    v = getattr(v, "__func__", getattr(v, "fget", v))
                    if isinstance(v, types.FunctionType):
                        used |= _names(v.__code__) | _operators(v.__code__)
                todo.extend(obj.__mro__[1:])
                continue
            for v in vars(obj).values():
                v = getattr(v, "__func__", v)  # staticmethod, classmethod
                if isinstance(v, property):
                    todo.extend(f for f in (v.fget, v.fset) if f is not None)
                elif _key(v) is not None:
                    return (), f"class attribute of {obj.__qualname__} holds {_name(v)}"
                elif isinstance(v, (types.FunctionType, type)):
                    todo.append(v)
            todo.extend(obj.__mro__[1:])
            continue
        if not isinstance(obj, types.FunctionType) or _ours(obj.__module__):
            continue
        where = f"{obj.__code__.co_filename}:{obj.__code__.co_firstlineno}"
        for v in (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()):
            if _key(v) is not None:
                return (), f"a default argument of {obj.__qualname__} ({where}) is {_name(v)}"
        g = obj.__globals__
        names = _names(obj.__code__)
        used |= names | _operators(obj.__code__)
        for name in names:
            v = g.get(name)
            if v is None:
                continue
            if isinstance(v, types.ModuleType) and not _ours(v.__name__):  # utils.helper(x)
                d = vars(v)  # (not getattr: a module's lazy __getattr__ may import or warn)
                todo.extend(a for a in (d.get(n) for n in names)
                            if isinstance(a, (types.FunctionType, type)))
                continue
            if _key(v) is not None:
                found.setdefault((id(g), name), _Swap(g, name, v))  # from torch import log
            elif _compat.compiled_function(v):
                return (), (f"{name} ({where}) is torch.compile'd: dynamo may first build its tables "
                            f"of torch's callables while the names are swapped")
            elif isinstance(v, (types.FunctionType, type)):
                todo.append(v)
            elif isinstance(v, (dict, list, tuple)) and any(_key(x) is not None for x in
                                                            (v.values() if isinstance(v, dict) else v)):
                return (), f"{name} (a container used by {obj.__qualname__}, {where}) holds a table spelling"
        for cell in obj.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _key(v) is not None:
                found.setdefault((id(cell), ""), _Swap(cell, "", v))
            elif isinstance(v, (types.FunctionType, type)):
                todo.append(v)
    return (*_needed(used), *found.values()), None


def _names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def homes_of(orig) -> list[_Swap]:
    """Each namespace name the table's callable ``orig`` is looked up by."""
    return [s for s in _base() if s.orig is orig]


def _name(v) -> str:
    return CALLS[v][1].name

