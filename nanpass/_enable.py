"""``nanpass.enable``: nanpass for a whole program, every model and the loss code around it,
with no change to the code (``nanpass run script.py`` is this around ``runpy``).

One mode on the function-mode stack for the process's main thread does what ``harden`` does
for one model: ``check``/``warn`` look at every call (``_watch.py``), ``guard``/``count`` swap
the rule table's calls for guards. What it leaves alone: the optimizer's own arithmetic (a
global step hook pauses the mode), and compiled regions, which ``torch.compile`` hands to
nanpass's backend wrapped around the backend the script asked for. In ``guard`` and ``count``
an optimizer step whose gradients are not finite is skipped (its gradients dropped, on every
rank alike), so the weights stay finite whatever nanpass cannot guard.
"""

from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist
import torch.optim.optimizer as optim_hooks

from ._check import COLLECT, NonFiniteError
from ._compat import eager_handler, foreach_norm, graphs_run_outside
from ._config import _choices, make_config
from ._errors import ConfigError, NanpassError
from ._intercept import GuardMode, Sites
from ._selfcheck import refuse_broken_guards
from ._stats import StatRow, Stats
from ._train import _local

RUN_MODES = ("check", "warn", "guard", "count")
_BACKENDS = ("inductor", "aot_eager", "eager")
_LOCK = threading.Lock()
_ACTIVE: list[Enabled] = []


class _ProgramMode(GuardMode):
    """GuardMode over a whole program: paused while an optimizer steps."""

    def __init__(self, sites: Sites):
        super().__init__(sites)
        self.paused = 0

    @eager_handler
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # a compiled region is the backend's to guard or check (torch.compile is wrapped), and
        # so is its eager re-run that names an op (COLLECT is set while it runs)
        if self.paused or torch.compiler.is_compiling() or COLLECT.get() is not None:
            return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types_, args, kwargs)


# a compiled graph holds the backend's guards: it runs with the mode popped
graphs_run_outside(_ProgramMode)


class Enabled:
    """What ``nanpass.enable`` switched on; ``disable()`` (or the end of a ``with``) switches
    it off. ``skipped`` counts optimizer steps dropped for non-finite gradients."""

    def __init__(self, mode: str, report: str | None, options: dict):
        if not isinstance(mode, str) or mode not in RUN_MODES:
            raise ConfigError(f"nanpass: unknown mode {mode!r} for enable/run; valid modes: "
                              f"{_choices(RUN_MODES)}")
        self.mode = mode
        self.report_path = report
        config = make_config(mode="guard" if mode == "count" else mode, count=mode == "count",
                             watch=None if mode != "guard" else 100, **options)
        refuse_broken_guards(config)
        self.config = config
        self.sites = Sites(None, config, config.watch)
        self._watch = self.sites.checker
        if self._watch is not None and not config.stop_at_op:
            # each call's verdict stays on the device; read when loss.backward() starts, before
            # an optimizer step (with the backward's) and at the end (on a GPU a read waits for
            # every queued kernel)
            self._watch.start_program()
        self.skipped = 0
        self._mode = _ProgramMode(self.sites)
        self._handles: list = []
        self._compile = None
        self._on = False

    # -- on and off ----------------------------------------------------------------------------
    def _start(self) -> Enabled:
        with _LOCK:
            if _ACTIVE:
                raise NanpassError("nanpass: enable() is already on in this process; disable() "
                                   "it first (or use it as a context manager)")
            _ACTIVE.append(self)
        opt = optim_hooks
        self._handles = [opt.register_optimizer_step_pre_hook(self._before_step),
                         opt.register_optimizer_step_post_hook(self._after_step)]
        self._compile = torch.compile
        torch.compile = self._compiled
        self._mode.__enter__()
        self._on = True
        return self

    def disable(self) -> None:
        """Switch nanpass off, after reading the verdicts still on the device (a NaN made
        since the last optimizer step or backward is reported here)."""
        if not self._on:
            return
        try:
            self.flush()
        finally:
            self._off()

    def flush(self) -> None:
        """Read the verdicts still on the device now: report a NaN/Inf made since the last
        optimizer step or backward (check and warn modes; nothing to do in the others)."""
        if self._watch is not None and self._watch.program:
            self._mode.paused += 1  # (its own reads are not the program's calls)
            try:
                self._watch.flush()
            finally:
                self._mode.paused -= 1

    def _off(self) -> None:
        if not self._on:
            return
        self._on = False
        self._mode.__exit__(None, None, None)
        torch.compile = self._compile
        for h in self._handles:
            h.remove()
        with _LOCK:
            _ACTIVE.remove(self)
        self._finish()

    def __enter__(self) -> Enabled:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.disable()
        else:  # already failing: the verdicts of the step it stopped in are dropped
            self._off()

    # -- the optimizer ---------------------------------------------------------------------------
    def _before_step(self, optimizer, args, kwargs):
        self.flush()  # what ran since the backward (clipping, the loss code): read before the step
        self._mode.paused += 1
        # args are step's own, the optimizer first: step(self, closure=None)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is not None:  # Lightning, LBFGS: forward and backward run inside the step
            wrapped = self._closure(optimizer, closure)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._skip_if_non_finite(optimizer)
        return None

    def _closure(self, optimizer, closure):
        def run():
            self._mode.paused -= 1  # the model's own forward and backward: watched
            try:
                loss = closure()
            finally:
                self._mode.paused += 1
            self._skip_if_non_finite(optimizer)
            return loss

        return run

    def _skip_if_non_finite(self, optimizer) -> None:
        if self.mode not in ("guard", "count") or _finite_grads(optimizer):
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # every torch optimizer skips a parameter with no gradient
        self.skipped += 1
        if self.skipped == 1 or self.skipped % 100 == 0:
            print(f"nanpass: skipped an optimizer step with non-finite gradients "
                  f"({self.skipped} so far)", file=sys.stderr)

    def _after_step(self, optimizer, args, kwargs):
        self._mode.paused = max(0, self._mode.paused - 1)

    # -- torch.compile inside the program ---------------------------------------------------------
    def _compiled(self, model=None, *, backend="inductor", options=None, **kwargs):
        """``torch.compile`` with nanpass's backend around the one asked for: the compiled
        region is guarded (or checked) as the eager code around it."""
        from ._backend import backend as nanpass_backend

        if isinstance(backend, str) and backend in _BACKENDS and not options and kwargs.get("mode") is None:
            mode = "guard" if self.mode == "count" else self.mode
            backend = nanpass_backend(inner=backend, mode=mode)
        elif not (isinstance(backend, str) and backend == "nanpass"):
            print(f"nanpass: torch.compile(backend={backend!r}, mode={kwargs.get('mode')!r}) runs as "
                  f"asked, unwatched: nanpass wraps {_choices(_BACKENDS)} (without options= or "
                  f"mode=)", file=sys.stderr)
        if model is None:
            return lambda m: self._compile(m, backend=backend, options=options, **kwargs)
        return self._compile(model, backend=backend, options=options, **kwargs)

    # -- at the end ----------------------------------------------------------------------------------
    def stats(self) -> Stats:
        """count mode: how often each guard changed values, by source line."""
        rows = []
        for c in self.sites.counters:
            ch = c.change
            rows.append(StatRow(ch.op, ch.spelling, ch.module, ch.source, c.calls,
                                int(c.last) if c.last is not None else 0,
                                int(c.total) if c.total is not None else 0))
        return Stats(rows)

    def _finish(self) -> None:
        if self.mode == "count":
            fired = [r for r in self.stats().rows if r.total]
            print(f"nanpass: {len(fired)} of {len(self.sites.counters)} guards changed values"
                  + (":" if fired else ""), file=sys.stderr)
            if fired:
                print(str(Stats(fired)), end="", file=sys.stderr)
        if self.skipped:
            print(f"nanpass: {self.skipped} optimizer steps skipped for non-finite gradients",
                  file=sys.stderr)
        if self.report_path:
            from ._report import Report
            from ._rewrite import GraphRecord

            record = GraphRecord("intercept", "", "", list(self.sites.changes), 0.0,
                                 counters=tuple(self.sites.counters))
            html = Report("the program (nanpass run)", [record]).to_html()
            with open(self.report_path, "w") as f:
                f.write(html)


def _finite_grads(optimizer) -> bool:
    """One fused norm over the step's gradients, agreed by every rank (a sharded gradient is
    finite on one rank and not on another: all ranks must skip together)."""
    grads = [_local(p.grad) for g in optimizer.param_groups for p in g["params"]
             if p.grad is not None and p.grad.is_floating_point()]  # a DTensor's own shard
    bad = torch.zeros((), device=grads[0].device if grads else None)
    if grads:
        by_device: dict = {}
        for t in grads:
            by_device.setdefault((t.device, t.dtype), []).append(t)
        norms = [n.float().to(bad.device) for ts in by_device.values() for n in foreach_norm(ts)]
        bad = (~torch.isfinite(torch.stack(norms).sum())).float()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad)


def enable(mode: str = "check", *, report: str | None = None, **options) -> Enabled:
    """Switch nanpass on for the whole program (this process's main thread): every model and
    the loss code, in ``mode`` "check" (raise at the first NaN/Inf born, naming your line),
    "warn", "guard" (guard the unsafe ops, skip non-finite optimizer steps) or "count" (guard,
    and print at the end which guards changed values). Use it as a context manager, or call
    ``disable()`` on what it returns. ``options`` are harden's (``ops=``, ``exclude_ops=``,
    ``constants=``)."""
    return Enabled(mode, report, options)._start()


__all__ = ["Enabled", "NonFiniteError", "enable"]
