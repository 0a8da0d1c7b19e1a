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

import os
import sys
import threading
import time
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.optim.optimizer as optim_hooks

from ._check import COLLECT, NonFiniteError
from ._compat import eager_handler, foreach_norm, function_mode_stack, functorch_active, graphs_run_outside
from ._config import _choices, make_config
from ._errors import ConfigError, NanpassError
from ._intercept import GuardMode, Sites
from ._screen import ProgramScreen
from ._selfcheck import refuse_broken_guards
from ._stats import StatRow, Stats
from ._train import _local

RUN_MODES = ("check", "warn", "guard", "count")
_BACKENDS = ("inductor", "aot_eager", "eager")
_LOCK = threading.Lock()
_ACTIVE: list[Enabled] = []  # the enables on now, the innermost last (it alone watches)
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
# a spawned child (multiprocessing's "spawn", torch.multiprocessing.spawn) runs nanpass as its
# parent does: the mode it is to run in (set while an enable is on; see _child_command)
CHILD_ENV = "NANPASS_RUN_CHILD"


class _ProgramMode(GuardMode):
    """GuardMode over a whole program: paused while an optimizer steps."""

    def __init__(self, sites: Sites):
        super().__init__(sites)
        self.paused = 0
        self.watching = sites.checker is not None

    @eager_handler
    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # a compiled region is the backend's to guard or check (torch.compile is wrapped), and
        # so is its eager re-run that names an op (COLLECT is set while it runs)
        # functorch transforms (vmap, grad) and tracers (torch.jit.trace) are left to
        # themselves in check mode: a value under vmap cannot be read, and a tracer records
        # every call the mode makes (guard mode's guards are ordinary ops to both)
        if (self.paused or torch.compiler.is_compiling() or COLLECT.get() is not None
                or (self.watching and (functorch_active() or torch.jit.is_tracing()))):
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
        self._options = options
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
        # the screen (issue 47): each outermost module call runs as written, screened, and
        # runs again at each op on a hit; every_op=True keeps the check at every call
        self._screen = (ProgramScreen(self) if self._watch is not None and not config.stop_at_op
                        and not config.every_op else None)
        self.skipped = 0
        self._mode = _ProgramMode(self.sites)
        self._handles: list = []
        self._compile = None
        self._on = False
        self.stopped: str | None = None  # said after a finding read at os._exit (nanpass run)
        self._outer: Enabled | None = None  # the enable this one took over from, till it ends
        self._saved: dict = {}  # what _start replaced, put back by _off
        self._scaler = _ScalerLog()
        self._stepped = False
        # the modes below the program's, while it is off the stack from an optimizer step to the
        # next module call (``_lift``); None: on the stack
        self._lifted: tuple | None = None
        self._refs = 0  # references to the mode before it went on the stack (``settle``)

    # -- on and off ----------------------------------------------------------------------------
    def _start(self) -> Enabled:
        with _LOCK:
            outer = _ACTIVE[-1] if _ACTIVE else None
            _ACTIVE.append(self)
        if outer is not None:
            # an enable inside another (a script that uses enable under `nanpass run`): the
            # inner one takes over (what the outer one holds is read first) and the outer one
            # is back when the inner one ends
            try:
                outer.flush()
            except BaseException:
                with _LOCK:
                    _ACTIVE.remove(self)
                raise
            outer._mode.paused += 1
            self._outer = outer
        opt = optim_hooks
        self._handles = [opt.register_optimizer_step_pre_hook(self._before_step),
                         opt.register_optimizer_step_post_hook(self._after_step)]
        self._compile = torch.compile if outer is None else outer._compile
        torch.compile = self._compiled
        self._saved = {"exit": os._exit, "showwarning": warnings.showwarning,
                       "env": os.environ.get(CHILD_ENV)}
        os._exit = self._os_exit
        warnings.showwarning = self._showwarning
        # (a child runs in the mode, and every_op; other options are not passed on)
        every = self._options == {"every_op": True}
        os.environ[CHILD_ENV] = (self.mode + (",every_op" if every else "")) if not self._options or every else ""
        _patch_spawn(True)
        _ScalerLog.install()
        self._refs = self._held()
        self._mode.__enter__()
        if self._screen is not None:
            self._screen.start()
        self._on = True
        return self

    def disable(self, failing: bool = False) -> None:
        """Switch nanpass off, after reading the verdicts still on the device (a NaN made
        since the last optimizer step or backward is reported here). ``failing``: the program
        is raising (``flush``)."""
        if not self._on:
            return
        try:
            self.flush(failing)
        finally:
            self._off()

    def flush(self, failing: bool = False) -> None:
        """Read the verdicts still on the device now: report a NaN/Inf made since the last
        optimizer step or backward (check and warn modes; nothing to do in the others).
        ``failing``: the program is raising: an infinity made on purpose (a pole, a constant)
        that went on through later calls instead of dying is named too."""
        if self._watch is not None and self._watch.program:
            self._mode.paused += 1  # (its own reads are not the program's calls)
            try:
                self._watch.flush(failing=failing)
            finally:
                self._mode.paused -= 1

    def _off(self) -> None:
        if not self._on:
            return
        with _LOCK:
            if _ACTIVE[-1] is not self:
                raise NanpassError("nanpass: disable() the enable started inside this one first "
                                   "(enables end in the reverse order they started)")
        self._on = False
        if self._screen is not None:
            self._screen.stop()
        if self._lifted is None:
            self._mode.__exit__(None, None, None)
        self._lifted = None
        torch.compile = self._compile if self._outer is None else self._outer._compiled
        for h in self._handles:
            h.remove()
        if os._exit == self._os_exit:
            os._exit = self._saved["exit"]
        if warnings.showwarning == self._showwarning:
            warnings.showwarning = self._saved["showwarning"]
        if self._saved["env"] is None:
            os.environ.pop(CHILD_ENV, None)
        else:
            os.environ[CHILD_ENV] = self._saved["env"]
        with _LOCK:
            _ACTIVE.remove(self)
            last = not _ACTIVE
        if last:
            _patch_spawn(False)
            _ScalerLog.uninstall()
        if self._outer is not None:
            self._outer._mode.paused -= 1
        self._finish()

    def _held(self) -> int:
        return sys.getrefcount(self._mode)

    def settle(self, timeout: float = 2.0) -> None:
        """After ``disable``: wait, the GIL released, until no C++ object still holds the
        program's mode. A collective's work captures the mode stack (``at::ThreadLocalState``)
        and a gloo worker drops it just after the script's last barrier returns; when Python is
        already finalizing, that drop takes the GIL from a thread that must exit and the
        process aborts ("terminate called without an active exception": torch's
        ``PyInterpreter`` decref, every release). ``nanpass run`` calls this as the script
        ends; free when nothing holds the mode, bounded when something does."""
        deadline = time.monotonic() + timeout
        while self._held() > self._refs and time.monotonic() < deadline:
            time.sleep(0.001)

    def __enter__(self) -> Enabled:
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.disable()
            return
        # already failing: the verdicts still on the device are read first, and a NaN/Inf they
        # hold is said before the program's own error surfaces (which then propagates as is)
        if issubclass(exc[0], NonFiniteError):  # the finding itself: what follows is its
            try:  # consequence
                self.disable()
            except NonFiniteError:
                pass
            return
        try:
            self.disable(failing=True)
        except NonFiniteError as e:
            print(f"{e}\nnanpass: the program then raised {exc[0].__name__} (below)", file=sys.stderr)

    # -- what ends a program ---------------------------------------------------------------------
    def _os_exit(self, status: int) -> None:
        """``os._exit`` (no ``finally``, no atexit) while enabled: the verdicts still on the
        device are read first; a finding is said, and the status is 1."""
        try:
            if self._on and threading.current_thread() is threading.main_thread():
                self.flush()
        except NonFiniteError as e:
            print(f"{e}" + (f"\n{self.stopped}" if self.stopped else ""), file=sys.stderr)
            status = 1
        except BaseException as e:  # noqa: BLE001 - the process ends here whatever happens
            print(f"nanpass: reading the verdicts at os._exit raised {type(e).__name__}: {e}",
                  file=sys.stderr)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        self._saved["exit"](status)

    def _show(self, message, category, filename, lineno, file, line) -> None:
        """As python would have shown it: the showwarning in place before enable, or where that
        was python's own, python's display (which ``catch_warnings(record=True)`` records)."""
        prev = self._saved["showwarning"]
        impl = getattr(warnings, "_showwarnmsg_impl", None)
        if prev is getattr(warnings, "_showwarning_orig", None) and impl is not None:
            impl(warnings.WarningMessage(message, category, filename, lineno, file, line))
        else:
            prev(message, category, filename, lineno, file, line)

    def _showwarning(self, message, category, filename, lineno, file=None, line=None):
        """A warning torch raises inside a call nanpass watches is attributed, by the stack
        level torch gives, to a frame of nanpass's detour (its handler, and torch's own
        ``handle_torch_function`` and the function's first entry that led there): it is
        warned again at the frame python would have named without the detour, under the
        filters of that frame's module."""
        f = sys._getframe(1)
        while f is not None and f.f_globals.get("__name__") == "warnings":
            f = f.f_back
        frames = []
        while f is not None:
            frames.append(f)
            f = f.f_back
        at = next((i for i, f in enumerate(frames)
                   if f.f_code.co_filename == filename and f.f_lineno == lineno), None)
        detour = _detour(frames) if at is not None else set()
        if at is None or at not in detour:  # (a stack level that already named a frame past it)
            self._show(message, category, filename, lineno, file, line)
            return
        real = [f for i, f in enumerate(frames) if i not in detour]
        if at >= len(real):
            self._show(message, category, filename, lineno, file, line)
            return
        f = real[at]
        registry = frames[at].f_globals.get("__warningregistry__")
        if isinstance(registry, dict):  # (the detour's line must not hide the next warning)
            registry.clear()
        g = f.f_globals
        warnings.warn_explicit(message, category, f.f_code.co_filename, f.f_lineno,
                               module=g.get("__name__"), registry=g.setdefault("__warningregistry__", {}),
                               module_globals=g)

    # -- the optimizer ---------------------------------------------------------------------------
    def _before_step(self, optimizer, args, kwargs):
        if _ACTIVE and _ACTIVE[-1] is not self:
            return None  # an enable inside this one watches now
        self._stepped = True
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
        if self._screen is not None and self._screen.called:
            self._lift()
        return None

    def _lift(self) -> None:
        """The screen's program: its mode off the stack from an optimizer step (whose every
        attribute read would enter it) to the next module call (``land``), which puts it back;
        ``zero_grad`` and the data's preparation in between run as written. Only where the
        program calls modules (a module call since the last step), so that one that does not
        stays watched."""
        self._screen.called = False
        stack = function_mode_stack()
        if stack and stack[-1] is self._mode:
            self._mode.__exit__(None, None, None)
            self._lifted = tuple(stack[:-1])

    def land(self) -> None:
        """The program's mode back on the stack, where the stack is as ``_lift`` left it (a
        mode the program entered since, ``with torch.device(...)``, is left on top: the mode
        waits for the next module call outside it)."""
        if self._lifted is not None and tuple(function_mode_stack()) == self._lifted:
            self._mode.__enter__()
            self._lifted = None

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
        if _ACTIVE and _ACTIVE[-1] is not self:
            return
        self._mode.paused = max(0, self._mode.paused - 1)

    # -- GradScaler ------------------------------------------------------------------------------
    def _scaler_step(self, step, scaler, optimizer, args, kwargs):
        """``scaler.step(optimizer)``: where the scaler skips the step (its gradients were not
        finite at its scale), the overflow of that backward is the scaler's design, not a
        finding: it is counted with the scale (count mode's summary). A NaN the backward made
        from finite gradients is still named, and so is an overflow once the scale has
        collapsed below 1 (the gradient is not finite at any scale)."""
        self._stepped = False
        out = step(scaler, optimizer, *args, **kwargs)
        if self._stepped or not scaler.is_enabled():
            self._scaler.in_a_row = 0
            return out
        scale = scaler.get_scale()  # (the scaler has read its verdict already: no new wait)
        log = self._scaler
        log.seen(scaler, scale)
        if self._watch is not None and self._watch.program:
            self._mode.paused += 1
            try:
                self._watch.flush(absorb=log if scale >= 1.0 else None,
                                  note=None if scale >= 1.0 else log.collapse(scale))
            finally:
                self._mode.paused -= 1
        return out

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
        if self.mode == "count" and self._scaler.scales:
            print(self._scaler.summary(), file=sys.stderr)
        if self._watch is not None and self._watch.unwatched:
            print(self._watch.unwatched_summary(), file=sys.stderr)
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


_OVERRIDES = os.path.join(os.path.dirname(torch.__file__), "overrides.py")


def _detour(frames: list) -> set[int]:
    """The frames (innermost first) a call took through nanpass and not through plain torch:
    nanpass's own, and above a run of them torch's ``handle_torch_function`` with the entry of
    the Python function that handed the call to the mode (its code runs again below)."""
    out: set[int] = set()
    n = len(frames)
    i = 0
    while i < n:
        if not frames[i].f_code.co_filename.startswith(_HERE):
            i += 1
            continue
        while i < n and frames[i].f_code.co_filename.startswith(_HERE):
            out.add(i)
            i += 1
        j = i
        while j < n and frames[j].f_code.co_filename == _OVERRIDES:
            out.add(j)
            j += 1
        if j > i and j < n and any(frames[j].f_code is frames[m].f_code for m in range(j)):
            out.add(j)
            j += 1
        i = j
    return out


class _ScalerLog:
    """The steps a GradScaler skipped while enabled: the scale at each (its trajectory), and
    the overflows its skips took (which check mode does not stop at)."""

    _step = None  # GradScaler.step as torch defines it, while an enable is on

    def __init__(self):
        self.scales: list[float] = []  # the scale each skipped step ran at
        self.in_a_row = 0
        self.absorbed: list[str] = []  # where the backward overflowed, first few
        self.overflows = 0
        self._scaler = None

    def seen(self, scaler, scale: float) -> None:
        self.scales.append(scale)
        self.in_a_row += 1
        self._scaler = weakref.ref(scaler)

    def take(self, where: str) -> None:
        """An overflow in a backward whose step the scaler skipped."""
        self.overflows += 1
        if len(self.absorbed) < 3 and where not in self.absorbed:
            self.absorbed.append(where)

    def collapse(self, scale: float) -> str:
        return (f"  the GradScaler skipped {self.in_a_row} steps in a row and its scale is now "
                f"{scale:g} (below 1): the gradient is not finite at any scale")

    def summary(self) -> str:
        scaler = self._scaler() if self._scaler is not None else None
        now = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
        path = " -> ".join(f"{s:g}" for s in self.scales) + (f" -> {now:g} now" if now is not None else "")
        text = (f"nanpass: GradScaler skipped {len(self.scales)} steps for gradients not finite at "
                f"its scale (its own back-off, not a finding); scale {path}")
        if self.absorbed:
            text += "\n  the overflows it skipped: " + "; ".join(self.absorbed)
        return text

    @classmethod
    def install(cls) -> None:
        from torch.amp import GradScaler

        if cls._step is None:
            cls._step = GradScaler.step
            GradScaler.step = _scaler_step

    @classmethod
    def uninstall(cls) -> None:
        from torch.amp import GradScaler

        if cls._step is not None:
            if GradScaler.step is _scaler_step:
                GradScaler.step = cls._step
            cls._step = None


def _scaler_step(scaler, optimizer, *args, **kwargs):
    step = _ScalerLog._step
    on = _ACTIVE[-1] if _ACTIVE else None
    if on is None or step is None or threading.current_thread() is not threading.main_thread():
        return (step or type(scaler).step)(scaler, optimizer, *args, **kwargs)
    return on._scaler_step(step, scaler, optimizer, args, kwargs)


# -- spawned children ---------------------------------------------------------------------------
_SPAWN: dict = {}


def _patch_spawn(on: bool) -> None:
    """While enabled, a child multiprocessing starts with "spawn" (torch.multiprocessing.spawn,
    ``mp.get_context("spawn")``) imports nanpass first and runs enabled as its parent does
    (``_child``; the mode travels in the environment, CHILD_ENV). A "fork" child inherits the
    enable, and its verdicts are read at its ``os._exit``. A "forkserver" child is not watched."""
    import multiprocessing.spawn as mp_spawn

    if on and not _SPAWN:
        _SPAWN["get_command_line"] = orig = mp_spawn.get_command_line

        def get_command_line(**kwds):
            cmd = orig(**kwds)
            if "-c" in cmd[:-1] and os.environ.get(CHILD_ENV):
                i = cmd.index("-c") + 1
                root = os.path.dirname(_HERE.rstrip(os.sep))
                cmd = [*cmd[:i], f"import sys; sys.path.append({root!r}); "
                       f"from nanpass._enable import _child; _child({cmd[i]!r})", *cmd[i + 1:]]
            return cmd

        mp_spawn.get_command_line = get_command_line
    elif not on and _SPAWN:
        mp_spawn.get_command_line = _SPAWN.pop("get_command_line")


def _child(prog: str) -> None:
    """A spawned child's program (``spawn_main``), run enabled in its parent's mode; the
    verdicts still on the device are read when it ends, and a finding makes its status 1."""
    mode = os.environ.get(CHILD_ENV)
    if not mode:
        exec(prog, {"__name__": "__main__"})  # noqa: S102 - multiprocessing's own program
        return
    mode, _, every = mode.partition(",")
    on = enable(mode, **({"every_op": True} if every == "every_op" else {}))
    on.stopped = f"nanpass: stopped the spawned process {os.getpid()} at the first NaN/Inf it made"
    code = 0
    try:
        exec(prog, {"__name__": "__main__"})  # noqa: S102 - it ends with sys.exit(its status)
    except SystemExit as e:
        code = e.code
    try:
        on.disable()
    except NonFiniteError as e:
        print(f"{e}\n{on.stopped}", file=sys.stderr)
        code = 1
    on.settle()  # (a DDP child's gloo worker may still hold the mode)
    sys.exit(code)


def enable(mode: str = "check", *, report: str | None = None, **options) -> Enabled:
    """Switch nanpass on for the whole program (this process's main thread): every model and
    the loss code, in ``mode`` "check" (raise at the first NaN/Inf born, naming your line),
    "warn", "guard" (guard the unsafe ops, skip non-finite optimizer steps) or "count" (guard,
    and print at the end which guards changed values). Use it as a context manager, or call
    ``disable()`` on what it returns. ``options`` are harden's (``ops=``, ``exclude_ops=``,
    ``constants=``)."""
    return Enabled(mode, report, options)._start()


__all__ = ["Enabled", "NonFiniteError", "enable"]
