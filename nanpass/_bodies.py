"""The bodies of higher-order ops in a graph dynamo traced from a hardened call.

Dynamo hands a higher-order op (``torch.cond``, ``while_loop``, checkpoint's
``tag_activation_checkpoint``, ``nested_compile_region``'s ``invoke_subgraph``, flex
attention) to the traced TorchFunctionMode as one call, and a mode's handler runs the op it is
handed with itself popped: the bodies are traced without the guards. So before any compiler
sees such a graph, each body gets the rewrite the backend gives a graph (``_rewrite``), with
the hardened model's config: what the eager hardened call guards inside the region, the
compiled one guards too. The graph's own calls hold their guards already and are not looked
at again."""

from __future__ import annotations

import torch.fx as fx

from ._compat import higher_order_op
from ._config import Config
from ._rewrite import Change, rewrite

# higher-order ops whose subgraphs are not the model's code: a custom autograd.Function's
# forward and backward (the guards' own, under a hardened call)
_NOT_BODIES = frozenset({"autograd_function_apply"})


def _hop_name(node: fx.Node) -> str | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, higher_order_op()):
        return None
    return getattr(target, "__name__", None) or getattr(target, "_name", None)


def bodies(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The subgraphs ``gm``'s higher-order-op calls run (each once)."""
    found: list[fx.GraphModule] = []
    for node in gm.graph.nodes:
        name = _hop_name(node)
        if name is None or name in _NOT_BODIES:
            continue
        for arg in node.all_input_nodes:
            if arg.op != "get_attr":
                continue
            try:
                body = gm.get_submodule(str(arg.target))
            except AttributeError:
                continue
            if isinstance(body, fx.GraphModule) and all(body is not b for b in found):
                found.append(body)
    return found


def guard_bodies(gm: fx.GraphModule, config: Config) -> list[Change]:
    """Rewrite the bodies of ``gm``'s higher-order ops in place (guard mode only: check mode's
    compiled forward sees what reaches the region's outputs)."""
    if config.mode != "guard":
        return []
    changes: list[Change] = []
    for body in bodies(gm):
        changes.extend(rewrite(body, config))
    return changes
