"""The ``torch.compile`` backend: rewrite dynamo's graph, then hand it to an inner compiler.

Registered only through the ``torch_dynamo_backends`` entry point (pyproject.toml), so
``torch.compile(model, backend="nanpass")`` works without ``import nanpass``; calling
``register_backend`` as well would make torch fail on a duplicate name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx

from ._config import Config, make_config
from ._errors import ConfigError
from ._rewrite import Change, rewrite

OPTIONS = ("mode", "ops", "exclude_ops", "exclude", "constants", "stable", "inner")


@dataclass(frozen=True)
class GraphRecord:
    """What the rewrite did to one captured graph, kept before any inner compiler mutates it."""

    code: str  # the rewritten graph as Python
    changes: list[Change]
    rewrite_s: float  # wall time of the rewrite pass


def _inner(name: str, gm: fx.GraphModule, example_inputs):
    if name == "eager":
        return gm.forward
    if name == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)


def compile_graph(
    gm: fx.GraphModule,
    example_inputs,
    config: Config,
    inner: str | None = None,
    keep: Callable[[GraphRecord], None] | None = None,
):
    """Rewrite ``gm``, record what the report needs, then compile (inductor takes ownership
    of the graph and may mutate it, so the record is taken first)."""
    t = time.perf_counter()
    changes = rewrite(gm, config)
    if keep is not None:
        keep(GraphRecord(gm.code, changes, time.perf_counter() - t))
    return _inner(inner or config.inner, gm, example_inputs)


class Backend:
    """A configured backend: ``torch.compile(model, backend=nanpass.backend(...))``.
    ``.graphs`` holds a GraphRecord for every graph it compiled."""

    def __init__(self, config: Config):
        self.config = config
        self.graphs: list[GraphRecord] = []

    def __call__(self, gm: fx.GraphModule, example_inputs, **_):
        return compile_graph(gm, example_inputs, self.config, keep=self.graphs.append)

    @property
    def changes(self) -> list[Change]:
        return [c for g in self.graphs for c in g.changes]

    def __repr__(self) -> str:
        return f"nanpass.backend({self.config.as_options() | {'inner': self.config.inner}})"


def _config(options: dict) -> Config:
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(
            f"nanpass: unknown backend option {unknown[0]!r}; valid options: "
            + ", ".join(repr(o) for o in OPTIONS)
        )
    return make_config(**options)


def backend(inner: str = "inductor", **options) -> Backend:
    """A backend callable with these options; ``inner`` is "inductor", "aot_eager" or "eager"."""
    return Backend(_config({"inner": inner, **options}))


def nanpass_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **_):
    """The entry-point backend; ``torch.compile(..., options={...})`` arrives as ``options``."""
    return compile_graph(gm, example_inputs, _config(dict(options or {})))
