"""StepGuard for training frameworks that own the loop: Hugging Face ``transformers.Trainer``,
PyTorch Lightning, and anything else that takes your optimizer and LR scheduler.

Neither framework lets a callback skip the optimizer step: the Trainer calls
``self.optimizer.step()`` right after ``on_pre_optimizer_step``, and Lightning's
``on_before_optimizer_step`` runs inside the closure that ``optimizer.step(closure)`` evaluates.
Both *do* take a user optimizer and scheduler, so the guard lives there:

* ``GuardedOptimizer(optimizer, **stepguard_options)`` is a ``torch.optim.Optimizer`` whose
  ``step()`` runs a ``StepGuard``: the framework calls it once per optimizer step (after the
  last micro-batch of an accumulation window, after its own unscaling and clipping), it
  evaluates a closure first when given one (Lightning passes training_step + backward that
  way), then checks, clips and steps or skips.
* ``guarded.gate(scheduler)`` is a ``GatedScheduler``: both frameworks step the scheduler after
  every optimizer step whether or not it was applied (the Trainer holds it back only on a
  GradScaler overflow; Lightning never), so the gate passes a ``step()`` through only when the
  guarded optimizer has taken a step since the last one.

Only torch is imported here: the frameworks duck-type these objects.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from ._errors import ConfigError, NanpassTypeError
from ._spike import SpikeGuard
from ._train import StepGuard

_STATE_KEY = "nanpass_guard"  # the guard's counters, inside the optimizer's state_dict
_OPTIONS = tuple(n for n in inspect.signature(StepGuard.__init__).parameters
                 if n not in ("self", "optimizer", "scheduler", "scaler")) + ("spike",)
_SPIKE_OPTIONS = tuple(n for n in inspect.signature(SpikeGuard.__init__).parameters
                       if n not in ("self", "optimizer", "model", "step_options"))


class GuardedOptimizer(torch.optim.Optimizer):
    """An optimizer whose ``step()`` is ``StepGuard.step()``: hand it to a framework that owns
    the training loop (``Trainer(optimizers=(guarded, guarded.gate(sched)))``, or return it
    from a LightningModule's ``configure_optimizers``).

    >>> import torch, nanpass
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = nanpass.GuardedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0)
    >>> model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    >>> opt.step(), opt.skipped, opt.taken
    (None, 1, 0)

    ``options`` are StepGuard's (``max_norm``, ``norm_type``, ``sync``,
    ``max_consecutive_skips``, ``model``, ``skip_zero``), and ``spike=True`` or ``spike={...}``
    (SpikeGuard's options) makes the guard a ``SpikeGuard``: the closure's loss (or the one given to
    ``record()``) is checked for spikes, and a rewind restores the model, this optimizer and
    every gated scheduler. ``guarded.guard`` is the StepGuard (or SpikeGuard) and
    ``taken``, ``skipped``, ``consecutive``, ``last_skip_reason``, ``last_norm`` read its
    counters. ``step(closure)`` evaluates the closure once (with gradients enabled), then checks
    the gradients it left and steps the wrapped optimizer without it, and returns the closure's
    loss, as torch optimizers do; ``last_step_taken`` holds the verdict (None on the no-sync
    fused path until the counters are read). ``param_groups``, ``state``, ``defaults``,
    ``zero_grad`` and any other attribute are the wrapped optimizer's, so LR schedulers,
    ``GradScaler.unscale_``/``step`` and the frameworks' clipping work on it unchanged.

    ``state_dict()`` is the wrapped optimizer's plus the guard's counters and policy under
    ``"nanpass_guard"`` (plain Python values), so a framework checkpoint carries them and
    ``load_state_dict`` restores them; a plain optimizer state dict loads too, leaving the
    counters alone.

    Under a framework's fp16 ``GradScaler``, the scaler checks the gradients first and skips an
    overflowing step without calling ``step()``: such steps are the scaler's (its scale backs
    off) and do not count in ``skipped``, but a gated scheduler does not advance on them either.
    """

    # GradScaler must unscale for us and decide on its own found_inf: never hand a fused
    # inner optimizer's device-side skip hook through the wrapper
    _step_supports_amp_scaling = False

    def __init__(self, optimizer, **options):
        if isinstance(optimizer, GuardedOptimizer):
            raise ConfigError(f"nanpass: GuardedOptimizer({optimizer!r}) is already guarded; "
                              "valid: an unguarded torch.optim.Optimizer")
        if isinstance(optimizer, (list, tuple)):
            raise NanpassTypeError(
                f"nanpass: GuardedOptimizer got a {type(optimizer).__name__} of optimizers; valid: one "
                "torch.optim.Optimizer (frameworks step one; for several, call "
                "nanpass.StepGuard([...]).step() in your own loop)")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ConfigError("nanpass: GuardedOptimizer(LBFGS) is not valid: LBFGS re-evaluates its "
                              "closure inside step(), after the guard has checked the gradients; "
                              "valid: an optimizer that steps from the gradients it is given")
        for name in options:
            if name == "scheduler":
                raise ConfigError(
                    "nanpass: GuardedOptimizer(scheduler=...) is not valid: the framework steps the "
                    "scheduler; valid: pass guarded.gate(scheduler) to it, which steps only after "
                    "a taken step")
            if name == "scaler":
                raise ConfigError(
                    "nanpass: GuardedOptimizer(scaler=...) is not valid: the GradScaler calls "
                    "step() itself after unscaling (scaler.step(guarded)); valid: options "
                    f"{', '.join(_OPTIONS)}")
            if name not in _OPTIONS:
                raise NanpassTypeError(f"nanpass: GuardedOptimizer got an unexpected option {name!r}; "
                                       f"valid: {', '.join(_OPTIONS)}")
        spike = options.pop("spike", None)
        if spike is None or spike is False:
            self.guard = StepGuard(optimizer, **options)  # checks the optimizer and the options
        else:
            if spike is True:
                spike = {}
            if not isinstance(spike, Mapping):
                raise NanpassTypeError(f"nanpass: GuardedOptimizer spike={spike!r} is not valid; valid: "
                                       f"True, or a dict of SpikeGuard options ({', '.join(_SPIKE_OPTIONS)})")
            bad = [k for k in spike if k not in _SPIKE_OPTIONS]
            if bad:
                raise NanpassTypeError(f"nanpass: GuardedOptimizer spike= has unexpected option(s) "
                                       f"{', '.join(map(repr, bad))}; valid: {', '.join(_SPIKE_OPTIONS)}")
            if options.get("model") is None:
                raise ConfigError("nanpass: GuardedOptimizer(spike=...) needs model=: a rewind restores "
                                  "the model's state; valid: model=the module being trained")
            self.guard = SpikeGuard(optimizer, **options, **spike)
        self._loss = None  # recorded by record() for the next step()
        self._batch = None
        self.optimizer = optimizer
        self.last_step_taken: bool | None = None
        self._offset = 0  # keeps _taken_total monotonic across load_state_dict

    # --- the wrapped optimizer's state, shared (schedulers and GradScaler work on these) ---
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def __getattr__(self, name: str):
        # only reached for what this object lacks: the wrapped optimizer's own attributes
        # (schedule-free train()/eval(), hooks dicts, _opt_called, ...)
        if name.startswith("__") or name in ("optimizer", "guard"):
            raise AttributeError(name)
        inner = self.__dict__.get("optimizer")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def __getstate__(self) -> dict:
        # not the bound-method wrapper an LR scheduler may have put on this instance
        return {k: v for k, v in self.__dict__.items() if k != "step"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (f"nanpass.GuardedOptimizer({type(self.optimizer).__name__}, taken={self.taken}, "
                f"skipped={self.skipped})")

    # --- the guard's counters ---
    @property
    def taken(self) -> int:
        return self.guard.taken

    @property
    def skipped(self) -> int:
        return self.guard.skipped

    @property
    def consecutive(self) -> int:
        return self.guard.consecutive

    @property
    def last_skip_reason(self) -> str | None:
        return self.guard.last_skip_reason

    @property
    def last_norm(self) -> float | None:
        return self.guard.last_norm

    def _taken_total(self) -> int:
        """Steps taken by this object, in this process (a gated scheduler compares these)."""
        return self.guard.taken + self._offset

    # --- the optimizer API ---
    def step(self, closure=None):
        """Evaluate ``closure`` if given (forward and backward), then ``StepGuard.step()``:
        check, clip, and step the wrapped optimizer or skip. Returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if isinstance(self.guard, SpikeGuard):
            seen = self._loss if self._loss is not None else loss
            rerun = closure if self.guard.rerun else None
            self._loss = None
            batch, self._batch = self._batch, None
            self.last_step_taken = self.guard.step(loss=seen, batch=batch, closure=rerun)
        else:
            self.last_step_taken = self.guard.step()
        return loss

    def record(self, loss=None, batch=None) -> None:
        """With ``spike=``: hand the guard this step's loss and batch identity when the framework
        calls ``step()`` without a closure (the Trainer). Losses recorded for several micro-batches
        of one optimizer step are summed; the closure's loss is used when nothing was recorded."""
        if loss is not None:
            loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
            self._loss = loss if self._loss is None else self._loss + loss
        if batch is not None:
            self._batch = batch

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        """The wrapped optimizer's ``state_dict()`` plus ``"nanpass_guard"``: the guard's
        counters and policy (``StepGuard.state_dict()``)."""
        state = dict(self.optimizer.state_dict())
        state[_STATE_KEY] = self.guard.state_dict()
        return state

    def load_state_dict(self, state_dict) -> None:
        """Load the wrapped optimizer's state and, when present, the guard's; a rejected load
        changes neither."""
        if not isinstance(state_dict, Mapping):
            raise NanpassTypeError(
                f"nanpass: GuardedOptimizer.load_state_dict got a {type(state_dict).__name__}; "
                "valid: the dict from state_dict() (or a plain optimizer state dict)")
        state = dict(state_dict)
        guard_state = state.pop(_STATE_KEY, None)
        if guard_state is None:
            self.optimizer.load_state_dict(state)
            return
        before, saved = self.guard.taken, self.guard.state_dict()
        self.guard.load_state_dict(guard_state)  # validated first: rejected, nothing changed
        try:
            self.optimizer.load_state_dict(state)
        except BaseException:
            self.guard.load_state_dict(saved)
            raise
        self._offset += before - self.guard.taken

    def gate(self, scheduler) -> GatedScheduler:
        """Wrap an LR scheduler of this optimizer so that the framework's ``scheduler.step()``
        advances it only after a taken step: hand the result to the framework."""
        if isinstance(scheduler, GatedScheduler):
            if scheduler.optimizer is self:
                return scheduler
            raise ConfigError("nanpass: GuardedOptimizer.gate got a scheduler gated by another "
                              "GuardedOptimizer; valid: a scheduler of this optimizer")
        gated = GatedScheduler(scheduler, self)
        if isinstance(self.guard, SpikeGuard):
            self.guard.track(scheduler)  # a rewind restores the schedule with the weights
        return gated


class GatedScheduler(torch.optim.lr_scheduler.LRScheduler):
    """An LR scheduler whose ``step()`` advances the wrapped scheduler only when its
    ``GuardedOptimizer`` has taken a step since the last advance: a skipped step (by the guard,
    or by a GradScaler overflow) does not move the schedule, and the schedule counts updates
    actually applied. Once per optimizer step (the Trainer, Lightning's ``interval="step"``) it
    follows the guard's verdict; once per epoch (``interval="epoch"``) it advances when the
    epoch applied at least one update.

    Build it with ``guarded.gate(scheduler)``. Everything else (``get_last_lr()``,
    ``state_dict()``, ``last_epoch``, ...) is the wrapped scheduler's; ``optimizer`` is the
    guarded optimizer (frameworks check a scheduler belongs to the optimizer they were given),
    ``scheduler`` the wrapped scheduler, ``held`` the number of ``step()`` calls held back.
    It is an ``LRScheduler`` so that frameworks accept it as one.
    """

    def __init__(self, scheduler, optimizer: GuardedOptimizer):
        # no LRScheduler.__init__: the wrapped scheduler keeps its own state; this only gates
        if not isinstance(optimizer, GuardedOptimizer):
            raise NanpassTypeError(f"nanpass: GatedScheduler optimizer={optimizer!r} is not a "
                                   "nanpass.GuardedOptimizer; use guarded.gate(scheduler)")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise ConfigError(
                "nanpass: GuardedOptimizer.gate(ReduceLROnPlateau) is not valid: it steps on a "
                "metric per evaluation, not per optimizer step; give it to the framework as it is. "
                "Valid: a per-step or per-epoch LR scheduler (LambdaLR, OneCycleLR, "
                "get_linear_schedule_with_warmup(...), ...)")
        if not (callable(getattr(scheduler, "step", None)) and callable(getattr(scheduler, "state_dict", None))):
            raise NanpassTypeError(
                f"nanpass: GuardedOptimizer.gate got {scheduler!r} ({type(scheduler).__name__}), "
                "which has no step()/state_dict(); valid: a torch.optim.lr_scheduler.LRScheduler")
        own = getattr(scheduler, "optimizer", None)
        if own is not None and own is not optimizer and own is not optimizer.optimizer:
            raise ConfigError(
                f"nanpass: GuardedOptimizer.gate({type(scheduler).__name__}) schedules "
                f"{type(own).__name__} {id(own):#x}, which is neither this GuardedOptimizer nor "
                "the optimizer it wraps; valid: a scheduler built on either")
        self.__dict__.update(scheduler=scheduler, optimizer=optimizer, held=0,
                             _seen=optimizer._taken_total())

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "scheduler":
            raise AttributeError(name)
        inner = self.__dict__.get("scheduler")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    def step(self, *args, **kwargs) -> None:
        total = self.optimizer._taken_total()
        if total > self._seen:
            self._seen = total
            self.scheduler.step(*args, **kwargs)
            if isinstance(self.optimizer.guard, SpikeGuard):
                self.optimizer.guard._scheduler_stepped()
        else:
            self.held += 1

    def get_last_lr(self):
        return self.scheduler.get_last_lr()

    def get_lr(self):
        return self.scheduler.get_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getstate__(self) -> dict:
        return dict(self.__dict__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"nanpass.GatedScheduler({type(self.scheduler).__name__}, held={self.held})"
