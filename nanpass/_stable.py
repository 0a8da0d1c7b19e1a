"""Exact stable-form rewrites: patterns whose stable form gives the true value, not a clamped one.

Patterns name ops by rule name only; spellings are the rule table's business.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch.fx as fx

from ._rules import canonical, match, operator_of


def _arg(node: fx.Node, i: int, name: str, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _rule(x, root) -> str | None:
    if not isinstance(x, fx.Node):
        return None
    hit = match(x, root)
    if hit is None or hit[1].inplace:
        return None
    return hit[0].name


def _is_one(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == 1


def _input(node: fx.Node):
    return _arg(node, 0, "input")


def _binary(node: fx.Node):
    """(a, b) of add/sub/mul, or None when an alpha keyword changes the meaning."""
    if "alpha" in node.kwargs or len(node.args) > 2:
        return None
    a = _arg(node, 0, "input")
    b = _arg(node, 1, "other")
    return a, b


def _softmax_dim(node: fx.Node, root):
    if node.op == "call_module":
        mod = root.get_submodule(node.target)
        return getattr(mod, "dim", None), None
    if len(node.args) > 2:  # a positional dtype / _stacklevel: leave it
        return None, None
    return _arg(node, 1, "dim"), node.kwargs.get("dtype")


# Each pattern: (outer rule, description, builder). A builder returns a list of
# (target, args, kwargs) calls to emit, the last one replacing the outer node, or None.
def _log_of(node, root):
    inner = _input(node)
    kind = _rule(inner, root)
    if kind == "softmax":
        dim, dtype = _softmax_dim(inner, root)
        if dim is None:
            return None
        kw = {"dim": dim} | ({"dtype": dtype} if dtype is not None else {})
        return "log(softmax(x)) -> log_softmax(x)", [(canonical("log_softmax"), (_input(inner),), kw)]
    if kind == "sigmoid":
        return "log(sigmoid(x)) -> logsigmoid(x)", [(canonical("logsigmoid"), (_input(inner),), {})]
    if kind in ("sub", "rsub"):
        ab = _binary(inner)
        if ab is None:
            return None
        one, s = ab if kind == "sub" else ab[::-1]
        if _is_one(one) and _rule(s, root) == "sigmoid":
            return "log(1 - sigmoid(x)) -> logsigmoid(-x)", [
                (operator_of("neg"), (_input(s),), {}),
                (canonical("logsigmoid"), ("$0",), {}),
            ]
    if kind == "add":
        ab = _binary(inner)
        if ab is None:
            return None
        a, b = ab
        y = b if _is_one(a) else a if _is_one(b) else None
        if isinstance(y, fx.Node):
            return "log(1 + x) -> log1p(x)", [(canonical("log1p"), (y,), {})]
    if kind == "sum" and _rule(_input(inner), root) == "exp" and "dtype" not in inner.kwargs:
        dim = _arg(inner, 1, "dim")
        if dim is None or len(inner.args) > 3:
            return None
        keepdim = _arg(inner, 2, "keepdim", False)
        x = _input(_input(inner))
        return "log(sum(exp(x))) -> logsumexp(x)", [
            (canonical("logsumexp"), (x,), {"dim": dim, "keepdim": keepdim})
        ]
    return None


def _sub_of(node, root):
    ab = _binary(node)
    if ab is None:
        return None
    e, one = ab
    if _is_one(one) and _rule(e, root) == "exp":
        return "exp(x) - 1 -> expm1(x)", [(canonical("expm1"), (_input(e),), {})]
    return None


def _scaled(node, root, value: float):
    """x when ``node`` is ``value * x`` or ``x * value``, else None."""
    if _rule(node, root) != "mul":
        return None
    ab = _binary(node)
    if ab is None:
        return None
    for c, x in (ab, ab[::-1]):
        if isinstance(c, (int, float)) and not isinstance(c, bool) and abs(c - value) < 1e-6 * abs(value):
            return x
    return None


def _plus(node, root, value):
    """x when ``node`` is ``x + value`` or ``value + x`` (value a number or a node)."""
    if _rule(node, root) != "add":
        return None
    ab = _binary(node)
    if ab is None:
        return None
    for c, x in (ab, ab[::-1]):
        if c is value or (isinstance(value, float) and _is_one(c)):
            return x
    return None


def _cube_of(node, root):
    if _rule(node, root) == "pow" and _arg(node, 1, "exponent") in (3, 3.0):
        return _input(node)
    return None


def _tanh_gelu(node, root):
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))), as GPT-2's gelu_new writes it:
    x**3 overflows long before the GELU does; F.gelu(approximate="tanh") is the same formula,
    computed in one kernel (in float32 for float16/bfloat16)."""
    ab = _binary(node)
    if ab is None:
        return None
    for half, rest in (ab, ab[::-1]):
        x = _scaled(half, root, 0.5)
        t = _plus(rest, root, 1.0)
        if x is None or _rule(t, root) != "tanh":
            continue
        inner = _scaled(_input(t), root, math.sqrt(2.0 / math.pi))
        cube = _plus(inner, root, x) if inner is not None else None
        p = _scaled(cube, root, 0.044715) if cube is not None else None
        if p is not None and _cube_of(p, root) is x:
            return "0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))) -> gelu(x, 'tanh')", [
                (canonical("gelu"), (x,), {"approximate": "tanh"})
            ]
    return None


def _mul_of(node, root):
    gelu = _tanh_gelu(node, root)
    if gelu is not None:
        return gelu
    ab = _binary(node)
    if ab is None:
        return None
    a, b = ab
    for t, lg in ((a, b), (b, a)):
        plain_log = _rule(lg, root) == "log" and len(lg.args) == 1 and not lg.kwargs
        if plain_log and isinstance(t, (fx.Node, int, float)):
            return "t * log(p) -> xlogy(t, p)", [(canonical("xlogy"), (t, _input(lg)), {})]
    return None


PATTERNS: dict[str, Callable] = {"log": _log_of, "sub": _sub_of, "mul": _mul_of}
DESCRIPTIONS = (
    "log(softmax(x)) -> log_softmax(x)",
    "log(sigmoid(x)) -> logsigmoid(x)",
    "log(1 - sigmoid(x)) -> logsigmoid(-x)",
    "log(1 + x) -> log1p(x)",
    "log(sum(exp(x))) -> logsumexp(x)",
    "exp(x) - 1 -> expm1(x)",
    "t * log(p) -> xlogy(t, p)",
    "0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))) -> gelu(x, 'tanh')",
)


def apply(gm: fx.GraphModule, root, record: Callable) -> None:
    """Rewrite every matching pattern in place; ``record(new node, old name, description)``."""
    graph = gm.graph
    for node in list(graph.nodes):
        kind = _rule(node, root)
        if kind not in PATTERNS:
            continue
        found = PATTERNS[kind](node, root)
        if found is None:
            continue
        description, calls = found
        old_inputs = [n for n in node.all_input_nodes]
        made: list[fx.Node] = []
        with graph.inserting_before(node):
            for target, args, kwargs in calls:
                args = tuple(made[int(a[1:])] if isinstance(a, str) and a.startswith("$") else a for a in args)
                new = graph.call_function(target, args, kwargs)
                new.meta = dict(node.meta)
                made.append(new)
        original = node.name
        node.replace_all_uses_with(made[-1])
        graph.erase_node(node)
        record(made[-1], original, description)
        _erase_dead(graph, old_inputs, root)


def _erase_dead(graph: fx.Graph, nodes: list[fx.Node], root) -> None:
    """Remove pattern intermediates (softmax, exp, ...) that nothing uses any more; only
    ops the table knows to be pure, so no dropout or in-place op is ever dropped."""
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n.users or _rule(n, root) is None:
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        stack.extend(inputs)
