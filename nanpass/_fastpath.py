"""Harden's guard mode without a ``TorchFunctionMode``: each spelling the rule table names
(``torch.log``, ``F.softmax``, ``Tensor.log``, ``Tensor.__truediv__``, ...) is replaced once, at
``import nanpass``, by a stand-in that reads one thread-local: outside a hardened call it calls
torch's own function; inside one it sends the call to the innermost running hardened call's
guards. Every other torch call never enters Python: a mode's handler runs for each of them
(GPT-2's train step: 913 calls, of which 99 are the table's), and on a launch-bound step that
handler alone costs more than every guard together (docs/architecture.md, "The fast path").

Nothing is written per call: a hardened call pushes its sites on this thread's stack (a local
variable of the call, restored in ``finally``) and pops them after, so threads, nesting and
exceptions need no lock and leave nothing behind. The stand-ins carry the original's
``__module__``, ``__qualname__``, ``__wrapped__`` and doc, are TorchScript builtins (or script
as the original) and dynamo polyfills (``_compat.stand_in_for_tools``), so pickle, ``inspect``,
TorchScript and ``torch.compile`` see torch's own function. References to torch's functions
taken before ``import nanpass`` are rebound where they are module globals; the rest (a
closure cell, a default, a container, a partial, an attribute) are found by the scan of the
model's code, or, where no scan reaches, by the survey, and the model runs under the mode from
then on, said (``Sites.fast``).
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable

import torch

from . import _compat, _rules
from ._rules import CALLS

Tensor = torch.Tensor


class _Local(threading.local):
    sites = None  # the running hardened call's sites on this thread; None: torch as written


_local = _Local()


def _namespaces() -> tuple:
    return (torch, torch.nn.functional, torch.special, torch.linalg, torch.fft, Tensor)


def _key(obj):
    """``obj`` if it is one of torch's own callables the table names (not a stand-in)."""
    try:
        return obj if obj in CALLS and obj not in ORIGINALS else None
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


# id of the table's callable -> its stand-in, which holds it (by id: ``torch.dsmm == torch.mm``,
# different objects that compare and hash equal)
_STAND_INS: dict = {}
ORIGINALS: dict = {}  # the stand-in -> torch's own callable
_ADMIT: list[Callable] = []  # the dtype filter of rules with only_dtypes (set by _intercept)
_NUMBER = (Tensor, int, float, bool, complex)


def _stand_in(orig, ns, name):
    got = _STAND_INS.get(id(orig))
    if got is not None:
        return got
    hit = CALLS[orig]
    rule, _, swapped = hit
    only = bool(rule.only_dtypes) and not swapped
    dunder = name.startswith("__")
    admit = _ADMIT

    def call(*args, **kwargs):
        sites = _local.sites
        if sites is None:
            return orig(*args, **kwargs)
        if dunder and len(args) > 1 and not isinstance(args[1], _NUMBER):
            return orig(*args, **kwargs)  # x / Units(): Python tries Units.__rtruediv__ next
        _local.sites = None  # the guard's own calls (a composite's too) run as written
        try:
            if only and not admit[0](rule, args):  # not unsafe in this dtype: as the mode leaves it
                return orig(*args, **kwargs)
            return sites.call(hit, args, kwargs)
        finally:
            _local.sites = sites

    call.__name__ = getattr(orig, "__name__", name)
    call.__qualname__ = f"Tensor.{name}" if ns is Tensor else name
    call.__module__ = "torch" if ns is Tensor else ns.__name__  # where pickle finds it again
    call.__doc__ = getattr(orig, "__doc__", None)
    call.__wrapped__ = orig
    call._nanpass_stand_in = True
    if not _STAND_INS:  # (one code object for all) dynamo never compiles it as a frame of its
        _compat.eager_handler(call)  # own between graphs: it traces the original in its place
    _STAND_INS[id(orig)] = call
    ORIGINALS[call] = orig
    return call


_INSTALLED: list = []


def stand_in(orig):
    """What code that names ``orig`` finds after ``import nanpass``: its stand-in, or itself."""
    new = _STAND_INS.get(id(orig))
    return new if new is not None and new.__wrapped__ is orig else orig


def install() -> None:
    """The stand-ins, once a process: each of the table's names in torch's namespaces, and
    each module global bound to one of torch's callables before now (``from torch import log``
    in a module imported before nanpass). Dynamo's and TorchScript's tables of torch's
    callables are built first, from torch's own objects."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    homes = _homes()
    made = [(ns, name, orig, _stand_in(orig, ns, name)) for ns, name, orig in homes]
    _compat.stand_ins_for_tools(list({id(new): (new, orig) for _, _, orig, new in made}.values()))
    for _, _, orig, new in made:  # a graph node calling the stand-in is its original's spelling
        got = _rules.graph_spelling(orig)
        if got is not None:
            _rules.graph_spelling(new, got)
    for _, _, orig, new in made:  # every lookup of the table finds the stand-in as its original
        CALLS[new] = CALLS[orig]
    for ns, name, _, new in made:
        setattr(ns, name, new)
    for module in list(sys.modules.values()):
        _rebind_module(module)


def _rebind_module(module) -> None:
    """A module's globals bound to one of torch's callables, now its stand-in (the same
    function outside a hardened call)."""
    name = getattr(module, "__name__", None)
    if not isinstance(module, types.ModuleType) or _ours(name):
        return
    try:
        d = vars(module)
        items = [(k, v) for k, v in list(d.items()) if _key(v) is not None]
    except Exception:  # noqa: BLE001 - a module object that is not what it says
        return
    for k, v in items:
        new = _STAND_INS.get(id(v))
        if new is not None and new.__wrapped__ is v and d.get(k) is v:
            d[k] = new


def rebind(where, name: str, orig) -> bool:
    """A binding the scan found of torch's own callable (a closure cell, a function's
    defaults), now its stand-in; False where it cannot be changed."""
    new = _STAND_INS.get(id(orig))
    if new is None or new.__wrapped__ is not orig:
        return False
    if isinstance(where, types.CellType):
        where.cell_contents = new
        return True
    if isinstance(where, dict):
        where[name] = new
        return True
    return False


def enter(sites):
    """Start a hardened call's guards on this thread: what ``leave`` restores."""
    prev = _local.sites
    _local.sites = sites
    return prev


def leave(prev) -> None:
    _local.sites = prev


def active() -> bool:
    """Whether this thread is in a hardened call's fast path, outside any guard."""
    return _local.sites is not None


def paused():
    """The running fast path off for this thread (checkpoint's own code, a custom backward, a
    hardened call under the mode); returns what ``resume`` puts back."""
    prev = _local.sites
    _local.sites = None
    return prev


def resume(prev) -> None:
    _local.sites = prev


_compat._HOOKS["pause"], _compat._HOOKS["resume"] = paused, resume


# -- what the model's code binds ------------------------------------------------------------
def _ours(module_name: str | None) -> bool:
    return bool(module_name) and (module_name == "torch" or module_name.startswith(("torch.", "nanpass.")))


# bumped whenever a module anywhere gets a submodule (``model.block = Other()``): a hardened
# model then looks at its module classes again before its next call, and scans the new code
EPOCH = [0]


def _registered(module, name, submodule) -> None:
    EPOCH[0] += 1


torch.nn.modules.module.register_module_module_registration_hook(_registered)


_UNTRACED: list = []


def scan(model: torch.nn.Module) -> str | None:
    """``_scan``, never traced: a frame dynamo runs eagerly (a graph it could not compile) has
    its callees compiled one by one, and torch 2.12's dynamo fails on ``obj in CALLS`` for a
    function object (disabled on first use: importing dynamo at nanpass's import costs seconds)."""
    if not _UNTRACED:
        _UNTRACED.append(torch.compiler.disable(_scan))
    return _UNTRACED[0](model)


def _scan(model: torch.nn.Module) -> str | None:
    """The first reason the model's code may reach one of torch's own callables past its
    stand-in (a reference taken before ``import nanpass``, held where no rebinding reaches: an
    attribute, a default argument, a container, a partial; a torch.compile'd function, whose
    graph calls torch's own), or None. Closure cells and module globals holding one are
    rebound to its stand-in."""
    todo: list = []
    seen: set = set()
    for name, m in model.named_modules():
        if type(m).__module__ == "torch._dynamo.eval_frame":  # OptimizedModule, without importing dynamo
            return (f"{name or 'the model'} is torch.compile'd: its graphs call torch's own "
                    f"functions, which only the mode guards")
        for k, v in vars(m).items():
            if isinstance(v, functools.partial):
                v = v.func
            if _key(v) is not None:
                return f"{type(m).__name__}.{k} holds {_name(v)}"
            if isinstance(v, types.FunctionType):
                todo.append(v)
        todo.append(type(m))
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, type):
            if obj in (object, torch.nn.Module) or _ours(obj.__module__):
                continue
            for v in vars(obj).values():
                v = getattr(v, "__func__", v)  # staticmethod, classmethod
                if isinstance(v, property):
                    todo.extend(f for f in (v.fget, v.fset) if f is not None)
                elif _key(v) is not None:
                    return f"class attribute of {obj.__qualname__} holds {_name(v)}"
                elif isinstance(v, (types.FunctionType, type)):
                    todo.append(v)
            todo.extend(obj.__mro__[1:])
            continue
        if not isinstance(obj, types.FunctionType) or _ours(obj.__module__):
            continue
        where = f"{obj.__code__.co_filename}:{obj.__code__.co_firstlineno}"
        for v in (*(obj.__defaults__ or ()), *(obj.__kwdefaults__ or {}).values()):
            if _key(v) is not None:
                return f"a default argument of {obj.__qualname__} ({where}) is {_name(v)}"
        g = obj.__globals__
        names = _names(obj.__code__)
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
                rebind(g, name, v)  # from torch import log, in a module nanpass has not seen
            elif _compat.compiled_function(v):
                return (f"{name} ({where}) is torch.compile'd: its graphs call torch's own "
                        f"functions, which only the mode guards")
            elif isinstance(v, (types.FunctionType, type)):
                todo.append(v)
            elif isinstance(v, functools.partial) and _key(v.func) is not None:
                return f"{name} (a partial used by {obj.__qualname__}, {where}) holds {_name(v.func)}"
            elif isinstance(v, (dict, list, tuple, set, frozenset)) and any(
                    _key(x) is not None for x in (v.values() if isinstance(v, dict) else v)):
                return f"{name} (a container used by {obj.__qualname__}, {where}) holds a table spelling"
        for cell in obj.__closure__ or ():
            try:
                v = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if _key(v) is not None:
                rebind(cell, "", v)
            elif isinstance(v, (types.FunctionType, type)):
                todo.append(v)
    return None


def _names(code) -> set:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _names(c)
    return names


def _name(v) -> str:
    return CALLS[v][1].name
