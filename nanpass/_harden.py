"""``nanpass.harden``: a module that shares the original's parameters and runs a guarded graph."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
from collections.abc import Iterable, Mapping

import torch
import torch.fx as fx

from . import _capture
from ._backend import compile_graph
from ._config import Config, dynamic_dims_of, make_config
from ._errors import CaptureError, ConfigError, NanpassError, NanpassTypeError
from ._rewrite import Change, GraphRecord, rewrite_and_record, summary
from ._shapes import (
    check_shapes,
    compare_shapes,
    graph_key,
    graph_shapes,
    grown,
    insert_asserts,
    merge_shapes,
    record_shapes,
)
from ._stats import warn_fired
from ._train import quarantine_call


class Hardened(torch.nn.Module):
    """The hardened model. Its parameters, buffers and submodules *are* the original's (the
    same registries), so ``state_dict`` keys, optimizers and ``.to()`` carry over; only the
    forward differs. Use ``nanpass.harden`` to make one."""

    def __init__(self, model: torch.nn.Module, config: Config, shapes=None):
        super().__init__()
        d = self.__dict__
        for registry in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            d[registry] = getattr(model, registry)
        d["_nanpass_model"] = model
        d["_nanpass_config"] = config
        d["_nanpass_sig"] = inspect.signature(model.forward)
        d["_nanpass_fx"] = {}  # key -> (GraphModule, runner, GraphRecord)
        d["_nanpass_fx_error"] = None  # why fx could not trace (then dynamo captures)
        d["_nanpass_dynamo"] = None
        d["_nanpass_graphs"] = []  # dynamo: a GraphRecord per captured graph
        d["_nanpass_shapes"] = shapes  # (examples, dynamic dims) when shape_checks=True
        d["_nanpass_expected"] = None  # dynamo + shape_checks: shapes per graph, by graph_key
        d["_nanpass_recording"] = False  # while the examples run
        self.training = model.training
        if shapes is not None:
            self._check_shapes_setup(*shapes)
        elif config.mode != "off":
            try:
                key = _capture.default_key(self._nanpass_sig, model.training)
            except _capture.Unkeyable as e:
                d["_nanpass_fx_error"] = str(e)
            else:  # trace the likely call now, so .code and errors show early
                self._fx_entry(key, guess=True)

    # -- capture ---------------------------------------------------------------------------
    def _fx_entry(self, key, guess: bool = False):
        entry = self._nanpass_fx.get(key)
        if entry is not None or self._nanpass_fx_error is not None:
            return entry
        try:
            gm = _capture.fx_trace(self._nanpass_model, key)
        except Exception as e:
            if not guess:  # fx cannot trace a real call: dynamo captures from now on
                self.__dict__["_nanpass_fx_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
            return None
        record = rewrite_and_record(gm, self._nanpass_config, "fx")
        entry = (gm, _capture.runner(self._nanpass_model, gm), record)
        self._nanpass_fx[key] = entry
        return entry

    def _check_shapes_setup(self, examples, dynamic):
        """Trace the examples' call now, record every value's shape, insert the asserts."""
        key, _ = _capture.call_key(self._nanpass_sig, self.training, examples[0], {})
        entry = self._fx_entry(key)
        if entry is None:  # dynamo: record shapes from the examples' own compiles
            self.__dict__["_nanpass_expected"] = {}
            self.__dict__["_nanpass_recording"] = True
            try:
                with torch.no_grad():
                    for ex in examples:
                        self._dynamo_call(ex, {})
                        if dynamic:  # again with every declared dim one larger: what varies is free
                            with contextlib.suppress(Exception):  # unless the model refuses that size
                                self._dynamo_call(grown(ex, dynamic), {})
            finally:
                self.__dict__["_nanpass_recording"] = False
            return
        gm, _, record = entry
        names = list(self._nanpass_sig.parameters)
        calls = []
        for ex in examples:
            _, b = _capture.call_key(self._nanpass_sig, self.training, ex, {})
            calls.append(tuple(b.arguments[n] for n in names if n in b.arguments))
        expected = record_shapes(gm, calls, dynamic)
        asserts = insert_asserts(gm, expected)
        record = dataclasses.replace(record, code=gm.code, asserts=tuple(asserts))
        self._nanpass_fx[key] = (gm, _capture.runner(self._nanpass_model, gm), record)

    def _dynamo_backend(self, gm: fx.GraphModule, example_inputs):
        expected = self._nanpass_expected
        if expected is None:
            return compile_graph(gm, example_inputs, self._nanpass_config, "eager", self._nanpass_graphs.append)
        key, shapes = graph_key(gm), graph_shapes(gm)
        if key not in expected:
            expected[key] = shapes
        elif self._nanpass_recording:  # another example: what differs is free
            expected[key] = merge_shapes(expected[key], shapes)
        else:  # a recompile for a new static shape
            compare_shapes(gm, expected[key], self._nanpass_shapes[1])
        compiled = compile_graph(gm, example_inputs, self._nanpass_config, "eager", self._nanpass_graphs.append)
        asserts = insert_asserts(gm, graph_shapes(gm))
        self._nanpass_graphs[-1] = dataclasses.replace(self._nanpass_graphs[-1], code=gm.code,
                                                       asserts=tuple(asserts))
        return compiled

    def _dynamo_call(self, args, kwargs):
        if torch.compiler.is_compiling():
            # an outer torch.compile would inline our capture and hand the ops, unguarded,
            # to its own backend
            raise CaptureError(
                f"nanpass: torch.compile(harden(model)) cannot guard "
                f"{type(self._nanpass_model).__name__}: torch.fx cannot trace it "
                f"({self._nanpass_fx_error}), so its graph comes from dynamo; compile the "
                f"original with the nanpass backend instead: "
                f"torch.compile(model, backend=\"nanpass\")"
            )
        if self._nanpass_dynamo is None:
            self.__dict__["_nanpass_dynamo"] = torch.compile(
                self._nanpass_model, backend=self._dynamo_backend
            )
        try:
            out = self._nanpass_dynamo(*args, **kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as e:
            inner = getattr(e, "inner_exception", None)
            if isinstance(inner, NanpassError):  # ours, raised while compiling: show it plainly
                raise inner.with_traceback(None) from None
            raise
        except torch._dynamo.exc.TorchRuntimeError:
            # a shape error while dynamo traced the new shapes: name the layer, if shapes are checked
            if self._nanpass_expected is not None:
                check_shapes(self._nanpass_model, *args, **kwargs)
            raise
        if not self._nanpass_graphs:
            fn = type(self._nanpass_model).forward
            code = getattr(fn, "__code__", None)
            where = f" ({code.co_filename}:{code.co_firstlineno})" if code else ""
            raise CaptureError(
                f"nanpass: could not capture {type(self._nanpass_model).__name__}.forward{where}: "
                f"torch.fx failed ({self._nanpass_fx_error}) and dynamo captured no graph, "
                "so its ops would run unguarded"
            )
        return out

    def forward(self, *args, **kwargs):
        model = self._nanpass_model
        mode = self._nanpass_config.mode
        if mode == "off":
            return model(*args, **kwargs)
        if self._nanpass_config.quarantine:
            return quarantine_call(self._forward_mode, args, kwargs)
        return self._forward_mode(*args, **kwargs)

    def _forward_mode(self, *args, **kwargs):
        mode = self._nanpass_config.mode
        if mode == "guard+check":
            counters = [c for g in self.graphs for c in g.counters]
            before = [c.calls for c in counters]
            out = self._forward(args, kwargs)
            counters_now = [c for g in self.graphs for c in g.counters]  # a first call captures
            before += [0] * (len(counters_now) - len(counters))
            warn_fired(counters_now, before)
            return out
        return self._forward(args, kwargs)

    def _forward(self, args, kwargs):
        if self._nanpass_fx_error is None:
            try:
                key, bound = _capture.call_key(self._nanpass_sig, self.training, args, kwargs)
            except _capture.Unkeyable as e:
                self.__dict__["_nanpass_fx_error"] = str(e)
            else:
                entry = self._fx_entry(key)
                if entry is not None:
                    return entry[1](bound)
        return self._dynamo_call(args, kwargs)

    # -- module behaviour -------------------------------------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        self._nanpass_model.train(mode)
        return self

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_nanpass_model"], name)

    def __deepcopy__(self, memo):
        return Hardened(copy.deepcopy(self._nanpass_model, memo), self._nanpass_config,
                        self._nanpass_shapes)

    def __repr__(self) -> str:
        return f"nanpass.{super().__repr__()}\n\n# rewritten forward\n{self.code}"

    # -- what was done ----------------------------------------------------------------------
    @property
    def original(self) -> torch.nn.Module:
        return self._nanpass_model

    @property
    def config(self) -> Config:
        return self._nanpass_config

    @property
    def capture(self) -> str:
        """"fx", "dynamo", or "pending" (nothing captured until the first call)."""
        if self._nanpass_fx_error is None and self._nanpass_fx:
            return "fx"
        return "dynamo" if self._nanpass_graphs else "pending"

    @property
    def graphs(self) -> list[GraphRecord]:
        """One record per captured graph (fx: one per training mode and argument key)."""
        if self._nanpass_fx_error is None:
            return [record for _, _, record in self._nanpass_fx.values()]
        return list(self._nanpass_graphs)

    @property
    def code(self) -> str:
        """The rewritten graph(s) as Python."""
        codes = [g.code.strip() for g in self.graphs]
        return "\n\n".join(codes) if codes else "# (captured on the first call)"

    @property
    def changes(self) -> list[Change]:
        """Every op looked at, once per distinct graph node."""
        seen, out = set(), []
        for group in (g.changes for g in self.graphs):
            for c in group:
                k = (c.op, c.spelling, c.module, c.source, c.node, c.action)
                if k not in seen:
                    seen.add(k)
                    out.append(c)
        return out

    def summary(self) -> str:
        return summary(self.changes)


def harden(
    model: torch.nn.Module,
    *,
    mode: str = "guard",
    ops: Iterable[str] | None = None,
    exclude_ops: Iterable[str] = (),
    exclude: Iterable[str] = (),
    constants: Mapping[str, Mapping[str, float]] | None = None,
    stable: bool = True,
    example_inputs=None,
    shape_checks: bool = False,
    dynamic_dims: Mapping[int, str] | None = None,
    count: bool = False,
    quarantine: bool = False,
) -> Hardened:
    """Return ``model`` with every numerically unsafe op guarded, forward and backward.

    >>> import torch, nanpass
    >>> m = nanpass.harden(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LogSoftmax(-1)))
    >>> bool(m(torch.full((1, 4), float("-inf"))).isfinite().all())
    True

    ``ops`` / ``exclude_ops`` pick guarded ops by rule name (``nanpass.RULES``); ``exclude``
    leaves modules alone by path (``"encoder.layers.0"``); ``constants`` tightens a guard's
    bounds (``{"log": {"lo": 1e-6}}``); ``mode="off"`` runs the original forward, ``"check"`` /
    ``"warn"`` name the op where a NaN is born instead of guarding, ``"guard+check"`` guards
    and warns once per call with the guards that fired.

    ``shape_checks=True`` records the shape of every intermediate value from
    ``example_inputs`` (the positional arguments of one call, or a list of such tuples) and
    inserts asserts that name the layer a wrongly shaped tensor enters. Dims that differ between
    examples, or that ``dynamic_dims`` declares on the inputs (default ``{0: "batch"}``), are free.

    ``quarantine=True`` replaces every batch row with a NaN/Inf in an input by zeros before the
    model and marks that row NaN in the outputs, for ``nanpass.finite_mean`` to drop.

    ``count=True`` keeps, per guard, how many elements it changed (on the device, no sync per
    op): ``nanpass.stats(model)``.
    """
    if isinstance(model, Hardened):
        model = model.original
    if not isinstance(model, torch.nn.Module):
        raise NanpassTypeError(
            f"nanpass: harden() takes a torch.nn.Module, got {type(model).__name__} {model!r:.60}"
        )
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise NanpassTypeError(
            "nanpass: harden() got a torch.compile'd module; harden the original "
            "(model._orig_mod), or compile with the nanpass backend: "
            'torch.compile(model, backend="nanpass")'
        )
    config = make_config(
        mode=mode, ops=ops, exclude_ops=exclude_ops, exclude=exclude, constants=constants,
        stable=stable, count=count, quarantine=quarantine, module_paths=[name for name, _ in model.named_modules()],
    )
    shapes = None
    if shape_checks:
        shapes = (_examples(example_inputs), dynamic_dims_of(dynamic_dims))
    elif example_inputs is not None or dynamic_dims is not None:
        raise ConfigError("nanpass: example_inputs and dynamic_dims are for shape_checks=True; "
                          "pass shape_checks=True, or leave them out")
    return Hardened(model, config, shapes)


def _examples(example_inputs) -> list[tuple]:
    if example_inputs is None:
        raise ConfigError("nanpass: shape_checks=True needs example_inputs: the positional "
                          "arguments of one call, e.g. example_inputs=(x,), or a list of them")
    if isinstance(example_inputs, torch.Tensor):
        return [(example_inputs,)]
    if isinstance(example_inputs, list) and all(isinstance(e, tuple) for e in example_inputs):
        return list(example_inputs)
    if isinstance(example_inputs, tuple):
        return [example_inputs]
    raise ConfigError(f"nanpass: example_inputs must be a tensor, a tuple of arguments or a list "
                      f"of tuples, got {type(example_inputs).__name__}")
