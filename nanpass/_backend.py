"""The ``torch.compile`` backend: rewrite dynamo's graph, then hand it to an inner compiler.

Registered only through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="nanpass")`` works without ``import nanpass``; calling
``register_backend`` as well would make torch fail on a duplicate name.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import operator
import weakref
from collections.abc import Callable

import torch
import torch.fx as fx

from ._check import flagged
from ._compat import dynamo_cache_entries, inductor_with, inner_compiler
from ._config import Config, make_config
from ._errors import ConfigError
from ._rewrite import Change, GraphRecord, eagerly, rewrite_and_record, untap
from ._rules import CALLS
from ._selfcheck import refuse_broken_guards
from ._shapes import compare_shapes, graph_key, graph_shapes, insert_asserts
from ._source import module_path, user_frame
from ._watch import GraphSites, Watch
from ._watch import inplace as _inplace

OPTIONS = ("mode", "ops", "exclude_ops", "exclude", "constants", "stable", "inner",
           "shape_checks", "dynamic_dims", "count", "selfcheck")

# every graph the backend compiled, in order, and the record of each compiled callable, so
# nanpass.report(compiled_model) can find its own graphs through dynamo's cache
_COMPILED: collections.deque[GraphRecord] = collections.deque(maxlen=4096)
_BY_CALLABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_RECORD = "_nanpass_graph_record"


def _dynamo_records(model: torch.nn.Module) -> set[int]:
    """Walk dynamo's cache entries of every forward in the model (and their resume functions
    after graph breaks) to the callables this backend returned."""
    found: set[int] = set()
    seen: set = set()
    stack = [type(m).forward for m in model.modules()]
    while stack:
        fn = stack.pop()
        code = getattr(fn, "__code__", None)
        if code is None or code in seen:
            continue
        seen.add(code)
        for entry in dynamo_cache_entries(code):
            for name in entry.code.co_names:
                obj = fn.__globals__.get(name)
                if name.startswith("__resume_at"):
                    stack.append(obj)
                elif name.startswith("__compiled_fn"):
                    while obj is not None:
                        record = getattr(obj, _RECORD, None)  # functools.wraps copies it along
                        if record is None and _hashable(obj):
                            record = _BY_CALLABLE.get(obj)
                        if record is not None:
                            found.add(id(record))
                            break
                        obj = getattr(obj, "__wrapped__", None)
    return found


def _hashable(obj) -> bool:
    try:
        hash(obj)
        weakref.ref(obj)
    except TypeError:
        return False
    return True


def graphs_of(model: torch.nn.Module) -> list[GraphRecord]:
    """The graphs compiled for this model, in compile order: found through dynamo's cache, or
    (on a torch whose cache cannot be walked) by the parameters they read."""
    try:
        ids = _dynamo_records(model)
    except (ImportError, AttributeError):
        ids = set()
    if ids:
        return [r for r in _COMPILED if id(r) in ids]
    mine = {id(p) for p in model.parameters()}
    return [r for r in _COMPILED if any((p := ref()) is not None and id(p) in mine for ref in r.params)]


def _inner(name: str, gm: fx.GraphModule, example_inputs, inductor: Inductor | None = None):
    if name == "eager":
        return gm.forward
    try:
        if name == "inductor" and inductor is not None and inductor.given:
            return inductor_with(inductor.mode, inductor.options)(gm, example_inputs)
        return inner_compiler(name)(gm, example_inputs)
    except Exception as err:  # noqa: BLE001 - re-raised unless torch's tracer refused a run-time value
        return eagerly(gm, name, err)


MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclasses.dataclass(frozen=True)
class Inductor:
    """What ``torch.compile`` asks of inductor beyond the graph: its ``mode`` (CUDA graphs
    with "reduce-overhead") and the options that are inductor's own ("triton.cudagraphs")."""

    mode: str | None = None
    options: tuple = ()  # (key, value) pairs, as given

    @property
    def given(self) -> bool:
        return (self.mode not in (None, "default")) or bool(self.options)


def _inductor(mode, options: dict, inner: str) -> Inductor:
    """``mode`` and inductor's options checked here, so that none is dropped: each reaches
    inductor, or fails naming what cannot."""
    if mode is not None and mode not in MODES:
        raise ConfigError(f"nanpass: unknown torch.compile mode {mode!r}; valid modes: "
                          + ", ".join(repr(m) for m in MODES))
    wanted = Inductor(mode, tuple(options.items()))
    if not wanted.given:
        return wanted
    if inner != "inductor":
        asked = f"mode={mode!r}" if mode not in (None, "default") else \
            f"inductor option {next(iter(options))!r}"
        raise ConfigError(f"nanpass: {asked} is for inductor, and this backend's inner compiler "
                          f"is {inner!r}; use inner='inductor' (the default) or leave it out")
    try:
        inductor_with(mode, options)
    except RuntimeError as e:  # inductor's own check of each key and its type
        bad = next((k for k in options if k in str(e) or k.replace("-", "_") in str(e)), None)
        what = f"unknown backend option {bad!r}" if bad is not None else "an option inductor refuses"
        valid = ", ".join(repr(o) for o in OPTIONS)
        raise ConfigError(f"nanpass: {what}; valid options: {valid}, or an option of inductor's "
                          f"(torch._inductor.config; inductor says: "
                          f"{str(e).split(', known')[0]})") from None
    return wanted


class _WatchedGraph(fx.Interpreter):
    """A graph run node by node, each call's result checked as check mode checks an eager
    call (``_watch.py``), the node's module path and source line naming it."""

    def __init__(self, gm: fx.GraphModule, watch: Watch, sites: GraphSites):
        super().__init__(gm)
        self.watch, self.sites = watch, sites

    def run_node(self, n: fx.Node):
        if n.op not in ("call_function", "call_method"):
            return super().run_node(n)
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        func = n.target if n.op == "call_function" else getattr(type(args[0]), n.target, None)
        if func is None or n.target in _STRUCTURAL:
            return super().run_node(n)
        self.sites.at(module_path(n)[0], user_frame(n.meta.get("stack_trace")))
        hit = CALLS.get(func) if _hashable(func) else None
        return self.watch.run(func, hit, args, kwargs, _inplace(func))


_STRUCTURAL = (operator.getitem,)


def _watched_graph(gm: fx.GraphModule, warn: bool):
    sites = GraphSites()
    watch = Watch(sites, warn)

    def run(*args):
        watch.found = False
        return _WatchedGraph(gm, watch, sites).run(*args)

    return run


def compile_graph(
    gm: fx.GraphModule,
    example_inputs,
    config: Config,
    inner: str | None = None,
    keep: Callable[[GraphRecord], None] | None = None,
    first_shapes: dict | None = None,
    inductor: Inductor | None = None,
):
    """Rewrite ``gm``, record what the report needs, then compile (inductor takes ownership
    of the graph and may mutate it, so the record is taken first)."""
    inner = inner or config.inner
    checking = config.mode in ("check", "warn")
    sites = [] if checking and inner != "eager" else None
    eager = None
    if checking:  # the same graph, every node checked: to name the op that fired (or, with
        # inner="eager", to run it: every call checked as it runs, as harden's check mode)
        eager = _watched_graph(copy.deepcopy(gm), config.mode == "warn")
    record = rewrite_and_record(gm, config, "dynamo", example_inputs, sites)
    if config.shape_checks:
        record = _shape_checks(gm, record, config, {} if first_shapes is None else first_shapes)
    (keep or _COMPILED.append)(record)
    probe = None
    if gm.meta.get("nanpass_probe"):  # the graph's last input: see _check.tap
        tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
        probe = tensors[0].device if tensors else torch.device("cpu")
        example_inputs = [*example_inputs, torch.zeros((), device=probe, requires_grad=True)]
    compiled = eager if checking and inner == "eager" else _inner(inner, gm, example_inputs, inductor)
    if probe is not None:
        untap(gm)
    if sites is not None:
        compiled = flagged(compiled, sites, warn=config.mode == "warn", eager=eager, probe=probe)
    # dynamo installs torch._dynamo.disable(compiled); where compiled is itself a disable
    # wrapper (aot_eager's, inductor's), that re-wraps the original callable and drops this
    # one: the record goes on both
    for obj in (compiled, getattr(compiled, "_torchdynamo_orig_callable", None)):
        if obj is None:
            continue
        with contextlib.suppress(AttributeError, TypeError):
            setattr(obj, _RECORD, record)
        if _hashable(obj):
            _BY_CALLABLE[obj] = record
    return compiled


def _shape_checks(gm: fx.GraphModule, record: GraphRecord, config: Config,
                  first_shapes: dict) -> GraphRecord:
    """Enforce the first compile's shapes: dynamo recompiles on a new static shape, and the
    recompile is compared here (so nothing runs per call). A symbolic dim is free when its
    symbols come only from declared dynamic dims of the inputs."""
    params = [r() for r in record.params]
    key = (graph_key(gm), tuple(id(p) for p in params))
    held = first_shapes.get(key)  # (the parameters, weakly; the shapes): ids of live ones only
    if held is None or any(r() is not p for r, p in zip(held[0], params, strict=True)):
        held = first_shapes[key] = (record.params, graph_shapes(gm))
    first = held[1]
    if first is not None:
        compare_shapes(gm, first, dict(config.dynamic_dims))
    asserts = insert_asserts(gm, graph_shapes(gm))
    return dataclasses.replace(record, code=gm.code, asserts=tuple(asserts))


class Backend:
    """A configured backend: ``torch.compile(model, backend=nanpass.backend(...))``.
    ``.graphs`` holds a GraphRecord for every graph it compiled."""

    def __init__(self, config: Config, inductor: Inductor | None = None):
        self.config = config
        self.inductor = inductor or Inductor()
        self.graphs: list[GraphRecord] = []
        self._first_shapes: dict = {}  # shape_checks: the first compile's shapes, per graph

    def __call__(self, gm: fx.GraphModule, example_inputs, mode: str | None = None,
                 options: dict | None = None, **_):
        inductor = self.inductor
        if mode is not None or options:  # torch.compile(backend=nanpass.backend(), mode=...)
            inductor = _inductor(mode or inductor.mode, {**dict(inductor.options), **(options or {})},
                                 self.config.inner)
        return compile_graph(gm, example_inputs, self.config, keep=self._keep,
                             first_shapes=self._first_shapes, inductor=inductor)

    def _keep(self, record: GraphRecord) -> None:
        self.graphs.append(record)
        _COMPILED.append(record)

    @property
    def changes(self) -> list[Change]:
        return [c for g in self.graphs for c in g.changes]

    def __repr__(self) -> str:
        return f"nanpass.backend({self.config.as_options() | {'inner': self.config.inner}})"


def _config(options: dict, inductor_ok: bool = False) -> Config:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown and not inductor_ok:
        raise ConfigError(
            f"nanpass: unknown backend option {unknown[0]!r}; valid options: "
            + ", ".join(repr(o) for o in OPTIONS)
        )
    config = make_config(**{k: v for k, v in options.items() if k in OPTIONS})
    refuse_broken_guards(config)
    if config.count and config.inner != "eager":
        what = "mode='guard+check'" if config.mode == "guard+check" else "count=True"
        raise ConfigError(
            f"nanpass: {what} keeps counters on the device from eager guards and cannot be "
            f"compiled by {config.inner!r} yet; use inner='eager', or nanpass.harden(model, ...)"
        )
    return config


def backend(inner: str = "inductor", *, compile_mode: str | None = None,
            inductor_options: dict | None = None, **options) -> Backend:
    """A backend callable with these options; ``inner`` is "inductor", "aot_eager" or "eager".
    ``compile_mode`` ("reduce-overhead": CUDA graphs, "max-autotune", ...) and
    ``inductor_options`` (``{"triton.cudagraphs": True}``) are inductor's, as
    ``torch.compile``'s ``mode=`` and ``options=`` would give them."""
    config = _config({"inner": inner, **options})
    return Backend(config, _inductor(compile_mode, dict(inductor_options or {}), config.inner))


_STATE = "__nanpass_first_shapes__"


def nanpass_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None,
                    mode: str | None = None, **_):
    """The entry-point backend; ``torch.compile(..., options={...})`` arrives as ``options``,
    the same dict on every recompile of that compiled model: per-model state (the shapes
    shape_checks compares recompiles with) lives in it, never in a global two models share.
    ``torch.compile``'s ``mode`` and the options that are not nanpass's go to inductor."""
    options = options if options is not None else {}
    given = {k: v for k, v in options.items() if k != _STATE}
    config = _config(given, inductor_ok=True)
    inductor = _inductor(mode, {k: v for k, v in given.items() if k not in OPTIONS}, config.inner)
    first = options.setdefault(_STATE, {}) if config.shape_checks else None
    return compile_graph(gm, example_inputs, config, first_shapes=first, inductor=inductor)
