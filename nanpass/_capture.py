"""Capture: torch.fx symbolic tracing first, dynamo where fx cannot trace.

fx gives a graph at ``harden()`` time with no per-call overhead, but bakes Python values in; so
each fx graph is keyed by the training flag and the non-tensor arguments it was traced with,
and a call with a new key traces again. Anything fx cannot trace (data-dependent control flow,
``nn.TransformerEncoderLayer``, Hugging Face models) goes to dynamo, which guards and
recompiles on its own.
"""

from __future__ import annotations

import inspect
import re

import torch
import torch.fx as fx

from ._rules import module_rule

Tensor = torch.Tensor
_TENSOR = "<tensor>"


class _Tracer(fx.Tracer):
    """Modules the table guards stay leaves (``call_module``); a torch.nn module that contains
    one (``nn.TransformerEncoderLayer`` holds ``nn.MultiheadAttention``) is traced through."""

    def __init__(self):
        super().__init__()
        self.record_stack_traces = True

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if module_rule(m) is not None:
            return True
        if super().is_leaf_module(m, qualname):
            return not any(module_rule(s) is not None for s in m.modules())
        return False


class Unkeyable(Exception):
    """A call whose arguments fx cannot key a graph by (containers, unhashable objects)."""


def call_key(sig: inspect.Signature, training: bool, args: tuple, kwargs: dict):
    """(key, bound arguments): tensors are graph inputs, every other value is baked in."""
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    parts = []
    for name, value in bound.arguments.items():
        kind = sig.parameters[name].kind
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise Unkeyable(f"*{name} arguments")
        if isinstance(value, Tensor):
            parts.append((name, _TENSOR))
        elif value is None or isinstance(value, (bool, int, float, str)):
            parts.append((name, value))
        else:
            raise Unkeyable(f"argument {name!r} of type {type(value).__name__}")
    return (training, tuple(parts)), bound


def default_key(sig: inspect.Signature, training: bool):
    """The key of the most likely call: required arguments are tensors, the rest defaults."""
    parts = []
    for name, p in sig.parameters.items():
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise Unkeyable(f"*{name} arguments")
        if p.default is inspect.Parameter.empty or isinstance(p.default, Tensor):
            parts.append((name, _TENSOR))
        elif p.default is None or isinstance(p.default, (bool, int, float, str)):
            parts.append((name, p.default))
        else:
            raise Unkeyable(f"default of {name!r}")
    return (training, tuple(parts))


class _Live:
    """``self`` for generated code: the user's live module first, then the graph's own
    constants, so reassigned buffers and parameters are always the current ones."""

    __slots__ = ("_model", "_gm")

    def __init__(self, model, gm):
        object.__setattr__(self, "_model", model)
        object.__setattr__(self, "_gm", gm)

    def __getattr__(self, name):
        try:
            return getattr(self._model, name)
        except AttributeError:
            return getattr(self._gm, name)


def fx_trace(model: torch.nn.Module, key) -> fx.GraphModule:
    """Trace ``model.forward`` with the non-tensor values of ``key`` baked in."""
    _, parts = key
    concrete = {name: v for name, v in parts if v != _TENSOR}
    tracer = _Tracer()
    was = model.training
    try:
        model.train(key[0])
        graph = tracer.trace(model, concrete_args=concrete or None)
    finally:
        model.train(was)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _param(target: str, params: list[str]) -> str:
    """fx renames a concrete argument's placeholder ("mask" -> "mask_1")."""
    if target in params:
        return target
    base = re.sub(r"_\d+$", "", target)
    return base if base in params else target


def runner(model: torch.nn.Module, gm: fx.GraphModule):
    """Call the rewritten graph with the user's model as ``self``."""
    fwd = type(gm).forward
    own = {n.target.split(".")[0] for n in gm.graph.nodes if n.op == "get_attr"}
    needs_gm = any(not hasattr(model, name) for name in own)
    # fx drops or renames some parameters (keyword-only, concrete ones): pass by placeholder
    params = list(inspect.signature(type(model).forward).parameters)[1:]
    names = [_param(str(n.target), params) for n in gm.graph.nodes if n.op == "placeholder"]

    def run(bound: inspect.BoundArguments):
        this = _Live(model, gm) if needs_gm else model
        values = bound.arguments
        return fwd(this, *[values[name] for name in names])

    return run
