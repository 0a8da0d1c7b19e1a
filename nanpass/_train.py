"""Training-loop safety: skip a step whose gradients are not finite, clip the norm of the
gradients of *this* step, and average a per-sample loss over its finite entries only.

The common advice gets this subtly wrong: clipping before ``loss.backward()`` clips last
step's gradients; ``torch.isnan(loss)`` misses an Inf loss and a NaN that appears only in the
gradients; ``continue`` on one rank of a DDP job desynchronises the others. ``StepGuard``
checks every gradient with one fused device-side reduction (``torch._foreach_norm``), all-reduces
the verdict so every rank skips together (as ``torch.amp.GradScaler`` does with ``found_inf``),
and reads it back once per step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ._check import NonFiniteError, describe
from ._compat import foreach_mul_, foreach_norm
from ._errors import ConfigError, NanpassTypeError

Tensor = torch.Tensor


_COUNTERS = ("taken", "skipped", "consecutive", "last_skip_reason")
_POLICY = ("max_norm", "norm_type", "max_consecutive_skips", "skip_zero")
_STATE_KEYS = _COUNTERS + _POLICY


def _real(name: str, value, valid: str) -> float:
    if isinstance(value, (bool, str)):
        raise NanpassTypeError(f"nanpass: StepGuard {name}={value!r} is a {type(value).__name__}; "
                               f"valid: {valid}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise NanpassTypeError(f"nanpass: StepGuard {name}={value!r} is not a number; "
                               f"valid: {valid}") from None


def _check_policy(max_norm, norm_type, max_consecutive_skips, skip_zero) -> tuple:
    """Validate the options a checkpoint carries; return them normalised."""
    if max_norm is not None:
        valid = "a positive finite number, or None for no clipping"
        max_norm = _real("max_norm", max_norm, valid)
        if not (math.isfinite(max_norm) and max_norm > 0):
            raise ConfigError(f"nanpass: StepGuard max_norm={max_norm!r} is not valid; use {valid}")
    valid = "a positive number (2.0 for the Euclidean norm) or float('inf')"
    norm_type = _real("norm_type", norm_type, valid)
    if not norm_type > 0:  # NaN fails too
        raise ConfigError(f"nanpass: StepGuard norm_type={norm_type!r} is not valid; use {valid}")
    if max_consecutive_skips is not None:
        valid = "an int >= 1, or None to never raise"
        if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, numbers.Integral):
            raise NanpassTypeError(f"nanpass: StepGuard max_consecutive_skips={max_consecutive_skips!r} "
                                   f"is not an int; valid: {valid}")
        max_consecutive_skips = int(max_consecutive_skips)
        if max_consecutive_skips < 1:
            raise ConfigError(f"nanpass: StepGuard max_consecutive_skips={max_consecutive_skips!r} "
                              f"is not valid; use {valid}")
    if not isinstance(skip_zero, bool):
        raise NanpassTypeError(f"nanpass: StepGuard skip_zero={skip_zero!r} is not valid; use True or False")
    return max_norm, norm_type, max_consecutive_skips, skip_zero


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _local(g: Tensor) -> Tensor:
    return g.to_local() if hasattr(g, "to_local") else g


class StepGuard:
    """Call ``guard.step()`` where you would call ``optimizer.step()`` (after ``backward()``).

    >>> import torch, nanpass
    >>> model = torch.nn.Linear(2, 1)
    >>> guard = nanpass.StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0)
    >>> model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    >>> guard.step(), guard.skipped
    (False, 1)

    ``optimizer`` is one optimizer or a list of them (``[SparseAdam(embedding), Adam(rest)]``):
    one verdict over every gradient, and every optimizer steps or none does. Sparse gradients
    (``nn.Embedding(sparse=True)``) are checked and clipped through their values.

    ``skip_zero=False`` (the default) takes a step whose gradients are all exactly 0: that is a
    legitimate state (a frozen tower, dead ReLUs, a fully masked batch), weight decay and
    momentum still apply, and a run that sees many of them in a row is healthy. Skipping them
    (the default before) dropped weight decay on those steps and, after
    ``max_consecutive_skips``, killed a healthy run with a NonFiniteError. With
    ``skip_zero=True`` they are skipped (counted in ``skipped``) but never count toward
    ``max_consecutive_skips``, which is about non-finite gradients only.

    ``scheduler`` (an LR scheduler, or a list) is stepped after each *taken* step only: a
    skipped step does not advance the schedule, and torch's "``lr_scheduler.step()`` before
    ``optimizer.step()``" warning cannot fire.

    ``state_dict()`` / ``load_state_dict()`` carry the counters and the policy (``max_norm``,
    ``norm_type``, ``max_consecutive_skips``, ``skip_zero``) across a resume; save the
    optimizer, scheduler and scaler with their own ``state_dict()`` as usual.
    """

    def __init__(self, optimizer, max_norm: float | None = None,
                 norm_type: float = 2.0, sync: bool = True, max_consecutive_skips: int | None = 100,
                 model: torch.nn.Module | None = None, skip_zero: bool = False,
                 scaler: torch.amp.GradScaler | None = None, scheduler=None):
        optimizers = _as_list(optimizer)
        if not optimizers:
            raise ConfigError("nanpass: StepGuard needs an optimizer, or a non-empty list of them; "
                              f"got {optimizer!r}")
        for opt in optimizers:
            if not (hasattr(opt, "param_groups") and callable(getattr(opt, "step", None))):
                raise NanpassTypeError(f"nanpass: StepGuard optimizer={opt!r} ({type(opt).__name__}) "
                                       "is not an optimizer; valid: a torch.optim.Optimizer "
                                       "(anything with param_groups and step()), or a list of them")
        self.optimizers: tuple = tuple(optimizers)
        # one optimizer: itself (guard.optimizer.zero_grad() keeps working); several: the tuple
        self.optimizer = optimizers[0] if len(optimizers) == 1 else self.optimizers
        schedulers = _as_list(scheduler)
        for s in schedulers:
            if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ConfigError(
                    "nanpass: StepGuard scheduler=ReduceLROnPlateau is not valid: it needs a metric "
                    "and is stepped per evaluation, not per optimizer step; step it yourself. "
                    "Valid: a per-step LR scheduler (StepLR, LambdaLR, OneCycleLR, ...), a list of "
                    "them, or None")
            if not callable(getattr(s, "step", None)):
                raise NanpassTypeError(f"nanpass: StepGuard scheduler={s!r} ({type(s).__name__}) has "
                                       "no step(); valid: a torch.optim.lr_scheduler.LRScheduler, "
                                       "a list of them, or None")
            own = getattr(s, "optimizer", None)
            if own is not None and not any(own is o for o in self.optimizers):
                raise ConfigError(f"nanpass: StepGuard scheduler={type(s).__name__} schedules "
                                  f"{type(own).__name__} {id(own):#x}, which is not the guard's "
                                  "optimizer; valid: a scheduler built on (one of) the optimizer(s) "
                                  "given to the guard")
        self.schedulers: tuple = tuple(schedulers)
        self.scheduler = scheduler
        if not isinstance(sync, bool):
            raise NanpassTypeError(f"nanpass: StepGuard sync={sync!r} is not valid; use True or False")
        (self.max_norm, self.norm_type, self.max_consecutive_skips,
         self.skip_zero) = _check_policy(max_norm, norm_type, max_consecutive_skips, skip_zero)
        self.scaler = scaler
        self.sync = sync
        self.names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._taken = 0
        self._skipped = 0
        self._pending: Tensor | None = None  # fused path: skips not read back yet
        self._pending_calls = 0
        self.consecutive = 0  # non-finite skips in a row (all-zero skips neither count nor reset)
        self.last_skip_reason: str | None = None
        self._last_norm: Tensor | None = None  # read lazily: no second sync per step

    def _grads(self) -> list[tuple[Tensor, Tensor]]:
        seen: set[int] = set()
        pairs = []
        for opt in self.optimizers:
            for g in opt.param_groups:
                for p in g["params"]:
                    if p.grad is not None and id(p) not in seen:
                        seen.add(id(p))
                        pairs.append((p, p.grad))
        return pairs

    def _scaling(self) -> bool:
        return self.scaler is not None and self.scaler.is_enabled()

    def step(self, closure=None) -> bool | None:
        """Check, clip and step; return whether the step was taken. With a GradScaler, the
        gradients are unscaled first and ``scaler.step``/``scaler.update`` run as usual, so
        the scale still backs off on overflow. With an optimizer that takes the verdict as a
        tensor (``fused=True``), ``max_consecutive_skips=None`` and no ``scheduler``, nothing is
        read back: the step returns None and ``taken``/``skipped`` are settled when read."""
        self._check_closure(closure)
        measured = self._measure()
        if measured is None:
            return self._take(closure)
        pairs, grads, norms, total, flags = measured
        if self._distributed():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every rank skips together
        self._clip(grads, total)
        if self._device_verdict(closure):
            # the optimizer takes the verdict as a tensor (fused Adam/SGD/Adagrad skip the update
            # on the device, as under GradScaler): no host sync at all
            found = flags.amax()
            for opt in self.optimizers:
                opt.grad_scale, opt.found_inf = None, found
                try:
                    opt.step()
                finally:
                    del opt.grad_scale, opt.found_inf
            self._pending = found if self._pending is None else self._pending + found
            self._pending_calls += 1
            return None
        bad_here, zero_here = (bool(v) for v in flags.tolist())  # the one host sync per step
        return self._decide(bad_here, zero_here, pairs, norms, total, closure)

    # --- the phases of step(), shared with nanpass.SpikeGuard (one read per step for both) ---
    def _check_closure(self, closure) -> None:
        if closure is not None and len(self.optimizers) > 1:
            raise ConfigError(f"nanpass: StepGuard.step(closure={closure!r}) with "
                              f"{len(self.optimizers)} optimizers is not valid (the closure would "
                              "run once per optimizer); valid: closure=None, or one optimizer")

    def _distributed(self) -> bool:
        return self.sync and dist.is_available() and dist.is_initialized()

    def _measure(self):
        """Unscale, then one fused norm pass: ``(pairs, grads, norms, total, flags)`` with
        ``flags = [non-finite, all-zero]`` as float32 on the device, not yet all-reduced;
        None when no parameter has a gradient."""
        if self._scaling():
            for opt in self.optimizers:
                try:
                    self.scaler.unscale_(opt)
                except RuntimeError as e:  # the user unscaled already (to clip, say): fine
                    if "already been called" not in str(e):
                        raise
        pairs = self._grads()
        if not pairs:
            return None
        # FSDP2 gradients are DTensor shards: work on the local shard, sum the norms over ranks
        sharded = any(hasattr(g, "to_local") for _, g in pairs)
        grads = [_local(g) for _, g in pairs]
        # a sparse gradient (nn.Embedding(sparse=True)) may repeat an index: its norm is that of
        # the coalesced values; clipping scales the stored values, which scales their sum too
        views = [g.coalesce()._values() if g.is_sparse else g for g in grads]
        norms = foreach_norm(views, self.norm_type)  # one fused pass over every gradient
        total = torch.linalg.vector_norm(torch.stack([n.to(views[0].device) for n in norms]),
                                         self.norm_type)
        if self._distributed() and sharded:
            powered = total.pow(self.norm_type)
            dist.all_reduce(powered, op=dist.ReduceOp.SUM)
            total = powered.pow(1.0 / self.norm_type)
        nonfinite = ~torch.isfinite(total)
        # every gradient exactly 0: skipped only when asked (skip_zero), and told apart from a
        # non-finite step so that it never counts toward max_consecutive_skips
        zero = (total == 0) if self.skip_zero else torch.zeros_like(nonfinite)
        flags = torch.stack([nonfinite, zero]).to(torch.float32)
        return pairs, grads, norms, total, flags

    def _clip(self, grads, total) -> None:
        if self.max_norm is not None:
            # clip the gradients of this step; a non-finite total makes the coefficient 0 here,
            # and the step is skipped anyway
            coef = torch.where(torch.isfinite(total), self.max_norm / (total + 1e-6),
                               torch.zeros_like(total)).clamp(max=1.0)
            targets = [g._values() if g.is_sparse else g for g in grads]
            foreach_mul_(targets, coef.to(targets[0].dtype))

    def _decide(self, bad: bool, zero: bool, pairs, norms, total, closure) -> bool:
        if bad or zero:
            return self._skip(pairs, norms, zero_only=not bad)
        self._last_norm = total
        return self._take(closure)

    def _device_verdict(self, closure) -> bool:
        return (all(getattr(o, "_step_supports_amp_scaling", False) for o in self.optimizers)
                and closure is None and not self._scaling() and not self.schedulers
                and self.max_consecutive_skips is None)

    def _settle(self) -> None:
        """Fold device-side verdicts into the counters (the only sync of the fused path)."""
        if self._pending is not None:
            skipped = int(self._pending.item())
            self._skipped += skipped
            self._taken += self._pending_calls - skipped
            self._pending, self._pending_calls = None, 0

    @property
    def skipped(self) -> int:
        self._settle()
        return self._skipped

    @property
    def taken(self) -> int:
        self._settle()
        return self._taken

    @property
    def last_norm(self) -> float | None:
        """The total gradient norm of the last step taken (before clipping)."""
        return None if self._last_norm is None else float(self._last_norm)

    def _take(self, closure) -> bool:
        for opt in self.optimizers:
            if self._scaling():
                self.scaler.step(opt)
            elif closure is not None:
                opt.step(closure)
            else:
                opt.step()
        if self._scaling():
            self.scaler.update()
        for s in self.schedulers:  # after optimizer.step(), only on a taken step
            s.step()
        self._taken += 1
        self.consecutive = 0
        return True

    def _skip(self, pairs, norms, zero_only: bool, reason: str | None = None) -> bool:
        if reason is None:
            reason = self._reason(pairs, norms, zero_only)
        self._skipped += 1
        if not zero_only:
            self.consecutive += 1
        self.last_skip_reason = reason
        if self._scaling():
            self.scaler.update()  # its found_inf from unscale_ backs the scale off
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        if (not zero_only and self.max_consecutive_skips is not None
                and self.consecutive >= self.max_consecutive_skips):
            raise NonFiniteError(
                f"nanpass: {self.consecutive} optimizer steps skipped in a row; last: {reason}. "
                "Find the cause with nanpass.locate(model, *inputs, loss_fn=...)"
            )
        return False

    def _reason(self, pairs, norms, zero_only: bool) -> str:
        if zero_only:
            return "every gradient is exactly 0 (no finite sample in the batch?)"
        bad = [(p, _local(g)) for (p, g), n in zip(pairs, norms, strict=True)
               if not bool(torch.isfinite(n))]
        if not bad:
            return "another rank had a non-finite gradient"
        p, g = bad[0]
        name = self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}")
        what = f"sparse, values: {describe(g.coalesce()._values())}" if g.is_sparse else describe(g)
        reason = f"non-finite gradient in {name} ({what})"
        if len(bad) > 1:
            reason += f" and {len(bad) - 1} more parameters"
        return reason

    def state_dict(self) -> dict:
        """The counters and the policy, as plain Python values (``torch.save``-able, and
        loadable with ``torch.load(weights_only=True)``)."""
        return {"taken": self.taken, "skipped": self.skipped, "consecutive": self.consecutive,
                "last_skip_reason": self.last_skip_reason, "max_norm": self.max_norm,
                "norm_type": self.norm_type, "max_consecutive_skips": self.max_consecutive_skips,
                "skip_zero": self.skip_zero}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the counters and the policy from ``state_dict()``: a resumed run carries on
        with the same ``taken``/``skipped``, the same consecutive-skip count (so the limit
        still trips where it would have) and the saved policy, which replaces the options this
        guard was built with (as ``optimizer.load_state_dict`` restores hyperparameters)."""
        if not isinstance(state_dict, Mapping):
            raise NanpassTypeError(
                f"nanpass: StepGuard.load_state_dict got a {type(state_dict).__name__}; valid: the "
                f"dict returned by StepGuard.state_dict(), with keys {', '.join(_STATE_KEYS)}")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        extra = sorted(str(k) for k in state_dict if k not in _STATE_KEYS)
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing key(s) {', '.join(map(repr, missing))}")
            if extra:
                parts.append(f"unexpected key(s) {', '.join(map(repr, extra))}")
            raise ConfigError(f"nanpass: StepGuard.load_state_dict: {'; '.join(parts)}; valid: "
                              f"the dict from StepGuard.state_dict(), with keys {', '.join(_STATE_KEYS)}")
        counts = {}
        for k in ("taken", "skipped", "consecutive"):
            v = state_dict[k]
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ConfigError(f"nanpass: StepGuard.load_state_dict: {k}={v!r} is not valid; "
                                  "valid: an int >= 0")
            counts[k] = int(v)
        reason = state_dict["last_skip_reason"]
        if reason is not None and not isinstance(reason, str):
            raise ConfigError(f"nanpass: StepGuard.load_state_dict: last_skip_reason={reason!r} is "
                              "not valid; valid: a str or None")
        policy = _check_policy(*(state_dict[k] for k in _POLICY))
        self._settle()  # nothing pending from before the load survives it
        self._taken, self._skipped, self.consecutive = counts["taken"], counts["skipped"], counts["consecutive"]
        self.last_skip_reason = reason
        self.max_norm, self.norm_type, self.max_consecutive_skips, self.skip_zero = policy

    def __repr__(self) -> str:
        return (f"nanpass.StepGuard(taken={self.taken}, skipped={self.skipped}, "
                f"last_skip_reason={self.last_skip_reason!r})")


def _finite_reduce(x: Tensor, mean: bool, return_dropped: bool):
    ok = torch.isfinite(x)
    # where before the reduction: the gradient of a dropped entry is exactly 0, never 0 * inf
    safe = torch.where(ok, x, torch.zeros((), dtype=x.dtype, device=x.device))
    total = safe.sum()
    if mean:
        total = total / ok.sum().clamp(min=1).to(x.dtype)
    if return_dropped:
        dropped = (~ok).reshape(x.shape[0], -1).any(1).nonzero().flatten() if x.dim() else (~ok).nonzero()
        return total, dropped
    return total


def finite_mean(per_sample: Tensor, return_dropped: bool = False):
    """Mean of the finite entries of a per-sample loss (0, with zero gradients, when none is
    finite); with ``return_dropped=True`` also the batch indices that were left out."""
    return _finite_reduce(per_sample, True, return_dropped)


def finite_sum(per_sample: Tensor, return_dropped: bool = False):
    """Sum of the finite entries of a per-sample loss; see ``finite_mean``."""
    return _finite_reduce(per_sample, False, return_dropped)


def _rows_bad(t: Tensor) -> Tensor:
    return ~torch.isfinite(t).reshape(t.shape[0], -1).all(1)


def quarantine_call(fn, args: tuple, kwargs: dict):
    """Run ``fn`` with every batch row that holds a NaN/Inf in any floating input replaced by
    zeros, then mark those rows of every floating output NaN: the model never computes on the
    bad data (so its gradients stay finite) and ``finite_mean`` drops the marked rows with
    exactly zero gradient."""
    floats = [a for a in (*args, *kwargs.values())
              if isinstance(a, Tensor) and a.is_floating_point() and a.dim() > 0]
    if not floats:
        return fn(*args, **kwargs)
    batch = floats[0].shape[0]
    bad = torch.zeros(batch, dtype=torch.bool, device=floats[0].device)
    for a in floats:
        if a.shape[0] == batch:
            bad = bad | _rows_bad(a)

    def clean(a):
        if isinstance(a, Tensor) and a.is_floating_point() and a.dim() > 0 and a.shape[0] == batch:
            return torch.where(bad.reshape(-1, *[1] * (a.dim() - 1)), torch.zeros((), dtype=a.dtype), a)
        return a

    out = fn(*[clean(a) for a in args], **{k: clean(v) for k, v in kwargs.items()})

    def mark(o):
        if isinstance(o, Tensor) and o.is_floating_point() and o.dim() > 0 and o.shape[0] == batch:
            return torch.where(bad.reshape(-1, *[1] * (o.dim() - 1)), torch.full((), float("nan"), dtype=o.dtype), o)
        if isinstance(o, tuple):
            return tuple(mark(x) for x in o)
        if isinstance(o, list):
            return [mark(x) for x in o]
        if isinstance(o, dict):
            return {k: mark(v) for k, v in o.items()}
        return o

    return mark(out)
