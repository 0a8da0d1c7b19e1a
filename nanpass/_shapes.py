"""Shape checks whose messages name the layer: a static check on fake tensors; the inputs'
shapes recorded from examples and checked on every hardened call; and, under the backend,
asserts in dynamo's graphs with every recompile compared to the first compile's shapes.

torch says ``mat1 and mat2 shapes cannot be multiplied (1x20 and 30x10)`` from deep inside
``F.linear``; nanpass says ``shape mismatch entering fc2 (Linear, model.py:14): expected
(*, 30), got (1, 20) — produced by fc1 (model.py:13)``.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ._compat import eager_handler, fake_mode, sym_constant, sym_free_symbols
from ._errors import CaptureError, NanpassError
from ._source import input_name, is_user_file

Tensor = torch.Tensor


class ShapeError(NanpassError, ValueError):
    """A tensor of the wrong shape; the message names the layer it entered and who made it."""


# what a layer expects of its first input, by class: the one place layer shapes are described
EXPECTED: dict[type, Callable[[nn.Module], str]] = {
    nn.Linear: lambda m: f"(*, {m.in_features})",
    nn.Bilinear: lambda m: f"(*, {m.in1_features})",
    nn.Conv1d: lambda m: f"(N, {m.in_channels}, L) or ({m.in_channels}, L)",
    nn.Conv2d: lambda m: f"(N, {m.in_channels}, H, W) or ({m.in_channels}, H, W)",
    nn.Conv3d: lambda m: f"(N, {m.in_channels}, D, H, W) or ({m.in_channels}, D, H, W)",
    nn.BatchNorm1d: lambda m: f"(N, {m.num_features}) or (N, {m.num_features}, L)",
    nn.BatchNorm2d: lambda m: f"(N, {m.num_features}, H, W)",
    nn.LayerNorm: lambda m: "(*, " + ", ".join(map(str, m.normalized_shape)) + ")",
    nn.Embedding: lambda m: f"integer indices in [0, {m.num_embeddings})",
    nn.MultiheadAttention: lambda m: (
        f"(N, L, {m.embed_dim})" if m.batch_first else f"(L, N, {m.embed_dim})"),
}


def _expected(module: nn.Module) -> str | None:
    for cls in type(module).__mro__:
        if cls in EXPECTED:
            return EXPECTED[cls](module)
    return None


def _shape(t) -> str:
    if isinstance(t, Tensor):
        return "(" + ", ".join(str(int(s)) if isinstance(s, int) else str(s) for s in t.shape) + ")"
    return type(t).__name__


def _caller() -> str | None:
    """file:line of the innermost user frame on the current stack."""
    for fr in reversed(traceback.extract_stack()):
        if is_user_file(fr.filename):
            return f"{fr.filename}:{fr.lineno}"
    return None


@dataclass
class ShapeRow:
    module: str
    kind: str
    source: str | None
    inputs: list[str]
    outputs: list[str]


class ShapeTable:
    """Per-module input and output shapes, as check_shapes saw them."""

    def __init__(self, rows: list[ShapeRow]):
        self.rows = rows

    def __str__(self) -> str:
        head = ("module", "type", "inputs", "outputs", "source")
        body = [(r.module or "<root>", r.kind, " ".join(r.inputs), " ".join(r.outputs), r.source or "")
                for r in self.rows]
        widths = [max(len(x[i]) for x in [head, *body]) for i in range(5)]
        fmt = "  ".join(f"{{:{w}}}" for w in widths)
        return "\n".join(fmt.format(*x).rstrip() for x in [head, *body]) + "\n"

    def __repr__(self) -> str:
        return f"<nanpass.ShapeTable {len(self.rows)} module calls>"


class _Producers(TorchFunctionMode):
    """Remembers which op (and source line) made each tensor, for 'produced by ...'."""

    def __init__(self, tracker):
        super().__init__()
        self.tracker = tracker

    @eager_handler
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        try:
            out = func(*args, **(kwargs or {}))
        except Exception:
            if self.tracker.failed is None:  # the innermost op that raised
                self.tracker.failed = (name, next(iter(_tensors((args, kwargs))), None), _caller())
            raise
        made_by = self.tracker.made_by
        for t in _tensors(out):
            if id(t) not in made_by:
                made_by[id(t)] = (f"{name} in {self.tracker.current() or '<root>'}", _caller())
                self.tracker.keep.append(t)  # held, so its id stays its own
        return out


def _tensors(x):
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class _Tracker:
    def __init__(self, model: nn.Module):
        self.names = {m: n for n, m in model.named_modules()}
        self.stack: list[tuple[nn.Module, str | None, tuple, int]] = []
        self.rows: list[tuple[int, ShapeRow]] = []
        self.calls = 0
        self.made_by: dict[int, tuple[str, str | None]] = {}
        self.keep: list = []  # keep tensors alive so their ids stay unique
        self.failed: tuple[str, Tensor | None, str | None] | None = None  # op, operand, line

    def current(self) -> str | None:
        return self.names.get(self.stack[-1][0]) if self.stack else None

    def pre(self, module, args, kwargs):
        self.calls += 1
        self.stack.append((module, _caller(), tuple(_tensors((args, kwargs))), self.calls))

    def post(self, module, args, kwargs, out):
        _, source, inputs, order = self.stack.pop()
        name = self.names.get(module, "?")
        self.rows.append((order, ShapeRow(name, type(module).__name__, source,
                                          [_shape(t) for t in inputs], [_shape(t) for t in _tensors(out)])))
        for t in _tensors(out):
            self.made_by[id(t)] = (f"{name or '<root>'}", source)
            self.keep.append(t)

    def error(self, exc: Exception) -> ShapeError:
        module, source, inputs, _ = self.stack[-1]
        name = self.names.get(module, "?") or "<root>"
        where = f"{name} ({type(module).__name__}{', ' + _short(source) if source else ''})"
        got = inputs[0] if inputs else None
        produced = ""
        if got is not None and id(got) in self.made_by:
            who, line = self.made_by[id(got)]
            produced = f" \u2014 produced by {who}{' (' + _short(line) + ')' if line else ''}"
        expected = _expected(module)
        torch_says = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if expected is not None and got is not None:
            return ShapeError(f"nanpass: shape mismatch entering {where}: expected {expected}, got "
                              f"{_shape(got)}{produced} (torch: {torch_says})")
        op, operand, op_line = self.failed or (None, got, _raising_line(exc))
        produced = ""
        if operand is not None and id(operand) in self.made_by:
            who, line = self.made_by[id(operand)]
            produced = f" produced by {who}{' (' + _short(line) + ')' if line else ''}"
        at = f" at {_short(op_line)}" if op_line else ""
        return ShapeError(f"nanpass: shape mismatch in {where}{at}{' (' + op + ')' if op else ''}: "
                          f"{torch_says}; its input {_shape(operand)}{produced}")


def _short(path: str | None) -> str:
    if path is None:
        return ""
    file, _, line = path.rpartition(":")
    return f"{os.path.basename(file)}:{line}"


def _raising_line(exc: Exception) -> str | None:
    found = None
    for fr in traceback.extract_tb(exc.__traceback__):
        if is_user_file(fr.filename):
            found = f"{fr.filename}:{fr.lineno}"
    return found


def check_shapes(model: nn.Module, *example_inputs, **example_kwargs) -> ShapeTable:
    """Run ``model`` on fake tensors (shapes and dtypes only, no real compute) and return the
    per-module shapes, or raise ShapeError naming the layer where a shape first goes wrong.

    >>> import torch, nanpass
    >>> m = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.Linear(30, 10))
    >>> nanpass.check_shapes(m, torch.randn(1, 10))
    Traceback (most recent call last):
    ...
    nanpass._shapes.ShapeError: nanpass: shape mismatch entering 1 (Linear): expected (*, 30), got (1, 20) — produced by 0 (torch: mat1 and mat2 shapes cannot be multiplied (1x20 and 30x10))
    """
    tracker = _Tracker(model)
    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(tracker.pre, with_kwargs=True))
        handles.append(m.register_forward_hook(tracker.post, with_kwargs=True))
    try:
        with fake_mode() as mode:  # it logs every failing meta kernel; we raise our own
            with mode:
                fake_args = [mode.from_tensor(a) if isinstance(a, Tensor) else a for a in example_inputs]
                fake_kwargs = {k: mode.from_tensor(v) if isinstance(v, Tensor) else v
                               for k, v in example_kwargs.items()}
            with mode, _Producers(tracker):
                model(*fake_args, **fake_kwargs)
    except (RuntimeError, ValueError, IndexError, AssertionError) as e:
        if isinstance(e, NanpassError) or not tracker.stack:
            raise
        if "data-dependent" in str(e) or "DataDependent" in type(e).__name__:
            raise CaptureError(
                f"nanpass: check_shapes cannot follow data-dependent control flow in "
                f"{tracker.current() or type(model).__name__} ({e.__class__.__name__}); "
                "run the model on real inputs instead"
            ) from e
        raise tracker.error(e) from e
    finally:
        for h in handles:
            h.remove()
    return ShapeTable([row for _, row in sorted(tracker.rows, key=lambda r: r[0])])



# -- recorded shapes and the asserts that enforce them ------------------------------------


@dataclass(frozen=True)
class ShapeAssert:
    """One assert inserted into a graph: the value it checks and the shape it enforces."""

    node: str  # the checked value's node
    shape: tuple  # ints are enforced; names ("batch") and None ("*") are free
    entering: str  # the consumer, for the message: "fc2 (Linear, model.py:14)"
    produced_by: str  # "fc1 (model.py:13)" or "input x"

    def shape_text(self) -> str:
        return "(" + ", ".join("*" if d is None else str(d) for d in self.shape) + ")"


def _format_expected(shape: tuple) -> str:
    return "(" + ", ".join("*" if d is None else str(d) for d in shape) + ")"


def check_shape(t, expected: tuple, entering: str, produced_by: str) -> None:
    """The inserted assert. Under torch.compile with static shapes it is decided while tracing
    and leaves nothing in the compiled graph."""
    if not isinstance(t, Tensor):
        return
    shape = t.shape
    ok = len(shape) == len(expected) and all(
        not isinstance(e, int) or s == e for s, e in zip(shape, expected, strict=False))
    if not ok:
        raise ShapeError(f"nanpass: shape mismatch entering {entering}: expected "
                         f"{_format_expected(expected)}, got {_shape(t)} \u2014 produced by {produced_by}")


check_shape.__module__ = "nanpass"


def _describe(node, gm) -> str:
    from ._source import module_path, user_frame

    path, cls = module_path(node)
    if node.op == "call_module":
        cls = type(gm.get_submodule(path)).__name__
    frame = user_frame(node.meta.get("stack_trace"))
    line = _short(frame[0]) if frame else None
    if node.op == "call_module" or path:
        return f"{path or '<root>'} ({', '.join(x for x in (cls, line) if x)})"
    op = getattr(node.target, "__name__", str(node.target))
    return f"{op}{' (' + line + ')' if line else ''}"


def _merge(shapes: list[tuple]) -> tuple | None:
    if len({len(s) for s in shapes}) != 1:
        return None
    return tuple(s[0] if all(x == s[0] for x in s) else None for s in zip(*shapes, strict=True))


def insert_asserts(gm, expected: dict[str, tuple]) -> list[ShapeAssert]:
    """One assert per graph input, before anything uses it, naming the first layer it enters.
    Every other shape in the graph follows from the inputs' (the graph bakes in the rest), so
    asserting each input dim once per graph is enough, and costs almost nothing per call."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    inputs = [n for n in nodes if n.op == "placeholder"]
    asserts = []
    for node in inputs:
        shape = expected.get(node.name)
        if shape is None or not node.users or all(d is None for d in shape):
            continue
        entering = _describe(min(node.users, key=order.get), gm)
        produced = f"input {input_name(node)}"
        with graph.inserting_after(inputs[-1]):
            check = graph.call_function(check_shape, (node, shape, entering, produced))
        check.meta = {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")}
        asserts.append(ShapeAssert(node.name, shape, entering, produced))
    graph.lint()
    gm.recompile()
    return asserts


def graph_shapes(gm) -> dict[str, tuple]:
    """Shapes dynamo recorded on each node (``example_value``); a symbolic dim is free (None)."""
    shapes = {}
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if isinstance(v, Tensor):
            shapes[n.name] = tuple(d if isinstance(d, int) else None for d in v.shape)
    return shapes


def graph_key(gm) -> tuple:
    """Which frame a dynamo graph came from, stable across recompiles: its tensor inputs."""
    return tuple(sorted(n.name for n in gm.graph.nodes
                        if n.op == "placeholder" and isinstance(n.meta.get("example_value"), Tensor)))


def _free_symbols(gm, dynamic: dict[int, str]) -> set:
    """Symbols of the graph inputs' declared dynamic dims: dims built from them may vary."""
    free = set()
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        if n.op == "placeholder" and isinstance(v, Tensor):
            for i, d in enumerate(v.shape):
                if i in dynamic and not isinstance(d, int):
                    free |= sym_free_symbols(d)
    return free


def _same_dim(got, want, free) -> bool:
    if not isinstance(want, int):
        return True
    if not isinstance(got, int):
        symbols = sym_free_symbols(got)
        if symbols:
            return free is not None and symbols <= free
        got = sym_constant(got)  # a symbolic int that is a constant
    return got == want


def compare_shapes(gm, expected: dict[str, tuple], dynamic: dict[int, str] | None = None) -> None:
    """Raise ShapeError at the first value whose recorded static shape no longer holds (dynamo
    recompiles on a new static shape, and marks a dim that keeps changing dynamic). With
    ``dynamic``, a symbolic dim built only from declared dynamic input dims is allowed."""
    free = _free_symbols(gm, dynamic) if dynamic is not None else None
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        want = expected.get(n.name)
        if want is None or not isinstance(v, Tensor) or not n.users:
            continue
        got = tuple(v.shape)
        bad = len(got) != len(want) or not all(
            _same_dim(g, w, free) for g, w in zip(got, want, strict=False))
        if bad:
            user = min(n.users, key=list(gm.graph.nodes).index)
            if n.op == "placeholder":  # show the declared dims by name
                produced = f"input {input_name(n)}"
                want = tuple((dynamic or {}).get(i, d) for i, d in enumerate(want))
            else:
                produced = _describe(n, gm)
            raise ShapeError(
                f"nanpass: shape mismatch entering {_describe(user, gm)}: expected "
                f"{_format_expected(want)}, got {_shape(v)} \u2014 produced by {produced}")


# -- harden(shape_checks=True): the inputs' shapes, checked on every call --------------------


class _FirstUse(TorchFunctionMode):
    """The first op that reads one tensor, for 'entering ...'."""

    def __init__(self, target, found: list):
        super().__init__()
        self.target, self.found = target, found

    @eager_handler
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.found and any(t is self.target for t in _tensors((args, kwargs))):
            line = _caller()
            name = getattr(func, "__name__", str(func))
            self.found.append(f"{name}{' (' + _short(line) + ')' if line else ''}")
        return func(*args, **(kwargs or {}))


def first_use(model: nn.Module, args: tuple, kwargs: dict, target: Tensor) -> str:
    """The layer or op a call's input first enters, found on fake tensors (no real compute)."""
    names = {m: n for n, m in model.named_modules()}
    found: list[str] = []

    def pre(module, a, k):
        if not found and any(t is fake_target for t in _tensors((a, k))) and module is not model:
            line = _caller()
            found.append(f"{names.get(module) or '<root>'} "
                         f"({type(module).__name__}{', ' + _short(line) if line else ''})")

    with fake_mode() as mode:
        with mode:
            fakes = {id(a): mode.from_tensor(a) for a in _tensors((args, kwargs))}
        fake_target = fakes[id(target)]

        def fake(x):
            return fakes.get(id(x), x) if isinstance(x, Tensor) else x

        handle = nn.modules.module.register_module_forward_pre_hook(lambda m, a: pre(m, a, {}))
        try:
            with mode, _FirstUse(fake_target, found):
                model(*[fake(a) for a in args], **{k: fake(v) for k, v in kwargs.items()})
        except Exception:  # noqa: S110 - a shape error after the first use is what we expect
            pass
        finally:
            handle.remove()
    return found[0] if found else type(model).__name__


class InputShapes:
    """The shapes of a model's tensor arguments over the examples; a dim that differs between
    examples or is declared dynamic is free. Every other shape follows from the inputs, so
    checking them on each call is enough; a mismatch names what the input enters first."""

    def __init__(self, sig, examples: list[tuple], dynamic: dict[int, str]):
        self.sig = sig
        seen: dict[str, list[tuple]] = {}
        for ex in examples:
            bound = sig.bind(*ex)
            for name, v in bound.arguments.items():
                if isinstance(v, Tensor):
                    seen.setdefault(name, []).append(tuple(int(s) for s in v.shape))
        self.expected: dict[str, tuple] = {}
        for name, shapes in seen.items():
            merged = _merge(shapes) or tuple(None for _ in shapes[0])
            self.expected[name] = tuple(None if i in dynamic else d for i, d in enumerate(merged))

    def asserts(self) -> tuple[ShapeAssert, ...]:
        return tuple(ShapeAssert(name, shape, "", f"input {name}") for name, shape in self.expected.items())

    def check(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        bound = self.sig.bind(*args, **kwargs)
        for name, want in self.expected.items():
            t = bound.arguments.get(name)
            if not isinstance(t, Tensor):
                continue
            if len(t.shape) == len(want) and all(w is None or s == w for s, w in zip(t.shape, want, strict=True)):
                continue
            entering = first_use(model, args, kwargs, t)
            raise ShapeError(f"nanpass: shape mismatch entering {entering}: expected "
                             f"{_format_expected(want)}, got {_shape(t)} \u2014 produced by input {name}")
