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
written. On CPython 3.13 and later (``TAG_LIMITED``) the swap is not made: the mode runs. Under dynamo the hardened call runs under the mode (traced into the graph), never
through this path.
"""

from __future__ import annotations

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
_users = 0


def _namespaces() -> tuple:
    return (torch, torch.nn.functional, torch.special, torch.linalg, torch.fft, Tensor)


def _key(obj):
    try:
        return obj if obj in CALLS else None
    except TypeError:  # an unhashable attribute
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

    __slots__ = ("where", "name", "orig", "had", "new")

    def __init__(self, where, name, orig):
        self.where, self.name, self.orig = where, name, orig
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


_BASE: list[_Swap] = []
_EXTRA: dict = {}  # (id of the dict or cell, name) -> [_Swap, users]; the dict or cell held by it

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


class Binding:
    """A name the model's code bound to a table spelling before harden (``from torch import
    log``): swapped with the namespaces."""

    __slots__ = ("where", "name", "orig", "found")

    def __init__(self, where, name, orig, found: str):
        self.where, self.name, self.orig, self.found = where, name, orig, found


def enter(sites, bindings: tuple = ()):
    """Start a hardened call on this thread: what ``leave`` restores, or ``MISSED`` where a
    name could not be swapped (nothing is changed then)."""
    global _users
    with _lock:
        done: list = []
        if _users == 0:
            _compat.build_dynamo_tables()
            for s in _base():
                if not s.put():
                    return _undo(done)
                done.append(s)
        fresh = []
        for b in bindings:
            k = (id(b.where), b.name)
            if k not in _EXTRA:
                swap = _Swap(b.where, b.name, b.orig)
                if not swap.put():
                    for k2 in fresh:
                        _EXTRA.pop(k2)[0].take()
                    return _undo(done)
                _EXTRA[k] = [swap, 0]
                fresh.append(k)
        for b in bindings:
            _EXTRA[(id(b.where), b.name)][1] += 1
        _users += 1
    prev = getattr(_local, "sites", None)
    _local.sites = sites
    return prev


MISSED = object()


def _undo(done) -> object:
    for s in reversed(done):
        s.take()
    return MISSED


def leave(prev, bindings: tuple = ()) -> None:
    global _users
    _local.sites = prev
    with _lock:
        for b in bindings:
            k = (id(b.where), b.name)
            got = _EXTRA[k]
            got[1] -= 1
            if got[1] == 0:
                got[0].take()
                del _EXTRA[k]
        _users -= 1
        if _users == 0:
            for s in reversed(_base()):
                s.take()


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


def scan(model: torch.nn.Module) -> tuple[tuple[Binding, ...], str | None]:
    """The names the model's code (its classes' methods, the functions and classes they
    reach through their globals, their closures) binds to a table spelling: the bindings to
    swap, and the first reason the fast path cannot be used (a binding it cannot swap)."""
    found: dict = {}
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
            if _ours(obj.__module__) or obj in (object, torch.nn.Module):
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
        for name in _names(obj.__code__):
            v = g.get(name)
            if v is None:
                continue
            if _key(v) is not None:
                found.setdefault((id(g), name), Binding(g, name, v, f"{name} in {where}"))
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
                found.setdefault((id(cell), ""), Binding(cell, "", v, f"a closure of {where}"))
            elif isinstance(v, (types.FunctionType, type)):
                todo.append(v)
    return tuple(found.values()), None


def _names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _name(v) -> str:
    return CALLS[v][1].name

