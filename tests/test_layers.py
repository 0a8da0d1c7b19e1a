"""The package's import graph has no circle, counting imports inside functions: ``_compat`` is
the bottom layer (it imports no nanpass module but the errors; the layer above registers what it
calls back)."""

from __future__ import annotations

import ast
import pathlib

import nanpass

ROOT = pathlib.Path(nanpass.__file__).parent


def _imports() -> dict[str, set[str]]:
    names = {p.stem for p in ROOT.glob("*.py")}
    graph = {}
    for path in ROOT.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[path.stem] = deps & names
    return graph


def _circles(graph) -> list[list[str]]:
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    assert _circles(_imports()) == []


def test_compat_is_the_bottom_layer():
    """It imports only the errors, which import nothing."""
    graph = _imports()
    assert graph["_compat"] <= {"_errors"} and graph["_errors"] == set()
