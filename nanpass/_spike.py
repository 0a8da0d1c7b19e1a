"""Loss spikes: detect, rewind in memory, skip the batch, and optionally tell a reproducible fault
from a transient one (issue 22).

``SpikeGuard`` is a sibling of ``StepGuard`` that owns one, not a subclass: StepGuard's contract
(its ``state_dict`` keys, its no-sync fused path, its return values) stays as it is, and the
spike flags join StepGuard's device-side flag tensor, so a step still costs one all-reduce and
one host read. Nothing else is read back unless something fired.

Design constraints, in order:

* The statistic is the **median** of the last ``window`` taken-step losses, kept on the device
  in a ring buffer. A median is not moved by the spike it must catch, nor by earlier outliers
  (a running max is: one tolerated spike raises the bar for the next hundred steps), and it
  follows a loss that falls during training. ``factor x median`` is scale-free; a MAD band is
  not (a very flat loss has a MAD near 0 and fires on noise).
* A spike is seen *before* its update is applied (the loss and the gradients of this step are
  checked before ``optimizer.step()``), so the spiking batch itself never touches the weights.
  The rewind is for what came before it: the snapshot is restored and the batches since then
  are replayed (``skip="batch"``) or skipped too (``skip="window"``, PaLM's recipe). Replayed
  on CPU, deterministically, the result is bitwise the run that never saw the spiking batch.
* Snapshots go through ``torch.distributed.checkpoint.state_dict``'s helpers (FQN-keyed, DDP and
  FSDP2 aware), into buffers allocated once and refilled with ``copy_(non_blocking=True)``.
"""

from __future__ import annotations

import copy
import json
import math
import numbers
import os
import random
import sys

import torch
import torch.distributed as dist

from ._compat import forget_unscale, scaler_state, set_scaler_state, tree_flatten, tree_unflatten
from ._errors import ConfigError, NanpassError, NanpassTypeError
from ._train import StepGuard

Tensor = torch.Tensor

SKIP_MODES = ("batch", "window")


class SpikeError(NanpassError, RuntimeError):
    """Spikes came back after rewinding to every kept snapshot: the loss level itself moved."""


def _identity(batch):
    """A batch's identity, hashable: sample indices (tensor, list) become a tuple of ints."""
    if batch is None or isinstance(batch, (int, str)):
        return batch
    if isinstance(batch, Tensor):
        return tuple(int(i) for i in batch.detach().cpu().reshape(-1).tolist())
    if isinstance(batch, (list, tuple)):
        return tuple(_identity(b) if isinstance(b, Tensor) else b for b in batch)
    return batch


def _json(value):
    return list(value) if isinstance(value, tuple) else str(value)


def _option(name: str, value, valid: str, ok, integral: bool = False):
    if isinstance(value, (bool, str)) or not isinstance(value, numbers.Integral if integral else numbers.Real):
        raise NanpassTypeError(f"nanpass: SpikeGuard {name}={value!r} is not "
                               f"{'an int' if integral else 'a number'}; valid: {valid}")
    if not ok(value):
        raise ConfigError(f"nanpass: SpikeGuard {name}={value!r} is not valid; valid: {valid}")
    return int(value) if integral else float(value)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        state["numpy"] = np.random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and sys.modules.get("numpy") is not None:
        sys.modules["numpy"].random.set_state(state["numpy"])


def _scaler_state(scaler) -> dict | None:
    """The GradScaler's scale and growth tracker as device tensors (its ``state_dict()`` would
    read the scale back: a host sync at every snapshot)."""
    if scaler is None or not scaler.is_enabled():
        return None
    return scaler_state(scaler)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _Slot:
    """One kept snapshot: buffers allocated on first use and refilled in place after that."""

    def __init__(self):
        self.spec = None
        self.meta: list = []  # per leaf: None (plain value) or (shape, dtype, dtensor recipe)
        self.leaves: list = []
        self.event = None
        self.position = -1
        self.rest: dict = {}  # schedulers, scaler, rng, statistics: small Python values

    def fill(self, tree, device) -> None:
        leaves, spec = tree_flatten(tree)
        meta = []
        for v in leaves:
            if isinstance(v, Tensor):
                local = _local(v)
                recipe = (v.device_mesh, v.placements, v.shape, v.stride()) if hasattr(v, "to_local") else None
                meta.append((tuple(local.shape), local.dtype, recipe))
            else:
                meta.append(None)
        if spec != self.spec or meta != self.meta:  # first use, or the state's layout changed
            bufs = []
            for v in leaves:
                if isinstance(v, Tensor):
                    local = _local(v)
                    dev = local.device if device is None else torch.device(device)
                    pin = dev.type == "cpu" and local.device.type == "cuda"
                    bufs.append(torch.empty(local.shape, dtype=local.dtype, device=dev, pin_memory=pin))
                else:
                    bufs.append(None)
            self.leaves, self.spec, self.meta = bufs, spec, meta
        cuda = False
        for i, v in enumerate(leaves):
            if isinstance(v, Tensor):
                local = _local(v).detach()
                cuda = cuda or local.device.type == "cuda"
                self.leaves[i].copy_(local, non_blocking=True)
            else:
                self.leaves[i] = copy.deepcopy(v)
        self.event = None
        if cuda:  # the step does not wait; a restore or an export waits on this event
            self.event = torch.cuda.Event()
            self.event.record()

    def tree(self, clone: bool = False):
        if self.event is not None:
            self.event.synchronize()
        out = []
        for buf, m in zip(self.leaves, self.meta, strict=True):
            if m is None:
                out.append(copy.deepcopy(buf))
                continue
            t = buf.clone() if clone else buf
            recipe = m[2]
            if recipe is not None:
                from torch.distributed.tensor import DTensor

                mesh, placements, shape, stride = recipe
                t = DTensor.from_local(t, mesh, placements, shape=shape, stride=stride, run_check=False)
            out.append(t)
        return tree_unflatten(out, self.spec)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.leaves if isinstance(b, Tensor))


class SpikeGuard:
    """``StepGuard`` plus loss-spike detection, in-memory rewind, data skipping and (optionally)
    a re-run that classifies the fault. Call ``guard.step(loss=loss, batch=indices)`` where you
    would call ``optimizer.step()``, after ``loss.backward()``; it returns whether the step was
    taken.

    * **Detect:** a non-finite loss or gradient (skipped, as StepGuard does); a loss above
      ``factor`` x the median of the last ``window`` taken-step losses (once ``warmup`` of them
      are in); with ``grad_factor``, a gradient norm above ``grad_factor`` x the median of the
      recent norms. One host read per step, none extra unless something fired.
    * **Rewind:** every ``every`` taken steps the model's parameters and buffers, the optimizer
      state, the schedulers, the GradScaler, the RNG states and the statistics are copied into
      ``keep`` preallocated snapshots (``snapshot_device``: ``"cpu"``, pinned when the model is on
      CUDA, or ``None`` for the model's device). On a spike the newest snapshot is restored.
    * **Skip:** the spiking batch is skipped; with ``skip="batch"`` the batches applied since the
      snapshot are queued in ``guard.replay`` (``SkipSampler`` feeds them again), with
      ``skip="window"`` they are skipped too. A second spike before the run passes a newer
      snapshot skips the whole window; a third drops that snapshot for an older one, and
      ``SpikeError`` says when none is left. Every skipped batch is in ``guard.events`` (and
      the JSON-lines file ``log``), and in ``guard.skip_batches``.
    * **Classify** (``rerun=True``, ``step(..., closure=fn)`` where ``fn()`` redoes the forward
      and backward of the same batch and returns the loss): the step is re-run once from the
      same weights and RNG state; firing again is *reproducible* (the batch is quarantined), not
      firing is *transient* (a possible hardware fault; the re-run's step is taken, the batch kept).

    Under ``torch.distributed`` the verdict is all-reduced with StepGuard's flags, so every rank
    rewinds, skips and replays together. Other keyword options are StepGuard's.
    """

    def __init__(self, optimizer, model: torch.nn.Module, factor: float = 4.0, window: int = 64,
                 warmup: int | None = None, every: int = 100, keep: int = 2,
                 grad_factor: float | None = None, skip: str = "batch", rerun: bool = False,
                 snapshot_device: str | torch.device | None = "cpu", log: str | os.PathLike | None = None,
                 **step_options):
        if not isinstance(model, torch.nn.Module):
            raise NanpassTypeError(f"nanpass: SpikeGuard model={model!r} is not a torch.nn.Module; "
                                   "valid: the model being trained (its state is what a rewind restores)")
        self.factor = _option("factor", factor, "a finite number > 1 (4.0: four times the median "
                              "of recent losses)", lambda v: math.isfinite(v) and v > 1)
        self.window = _option("window", window, "an int >= 2 (losses in the running median)",
                              lambda v: v >= 2, integral=True)
        if warmup is None:
            warmup = min(self.window, 10)
        self.warmup = _option("warmup", warmup, f"an int with 1 <= warmup <= window={self.window} "
                              "(the statistic's windows must grow: warmup losses seen before the "
                              "first check, at most window kept)", lambda v: 1 <= v <= self.window,
                              integral=True)
        self.every = _option("every", every, "an int >= 1 (taken steps between snapshots)",
                             lambda v: v >= 1, integral=True)
        self.keep = _option("keep", keep, "an int >= 1 (snapshots kept)", lambda v: v >= 1, integral=True)
        self.grad_factor = None if grad_factor is None else _option(
            "grad_factor", grad_factor, "a finite number > 1, or None for no gradient-norm check",
            lambda v: math.isfinite(v) and v > 1)
        if skip not in SKIP_MODES:
            raise ConfigError(f"nanpass: SpikeGuard skip={skip!r} is not valid; valid: "
                              f"{', '.join(map(repr, SKIP_MODES))}")
        if not isinstance(rerun, bool):
            raise NanpassTypeError(f"nanpass: SpikeGuard rerun={rerun!r} is not valid; use True or False")
        self.skip, self.rerun = skip, rerun
        if snapshot_device is not None:
            try:
                torch.device(snapshot_device)
            except (RuntimeError, TypeError):
                raise ConfigError(f"nanpass: SpikeGuard snapshot_device={snapshot_device!r} is not valid; "
                                  "valid: 'cpu' (pinned when the model is on CUDA), a torch.device, or "
                                  "None for the model's own device") from None
        self.snapshot_device = snapshot_device
        self.log = None if log is None else os.fspath(log)
        self.step_guard = StepGuard(optimizer, model=model, **step_options)
        self.model = model
        self.optimizers = self.step_guard.optimizers
        self.optimizer = self.step_guard.optimizer
        self.schedulers: list = list(self.step_guard.schedulers)
        self.scaler = self.step_guard.scaler
        self.events: list[dict] = []
        self.skip_batches: list = []
        self._skip_set: set = set()
        self.replay: list = []  # identities to feed again, oldest first (SkipSampler drains it)
        self.position = 0  # updates in the current weights' history (rewound with them)
        self.rewinds = 0
        self._calls = 0
        self._slots: list[_Slot] = []  # oldest first
        self._restores: dict[int, int] = {}  # snapshot position -> rewinds to it
        self._trail: dict[int, object] = {}  # position -> the batch applied to leave it
        self._hist: Tensor | None = None  # recent losses (device ring buffer)
        self._ghist: Tensor | None = None  # recent gradient norms
        self._n = 0
        self._gn = 0
        self._rng_before = _rng_state() if rerun else None

    # --- counters (StepGuard's) ---
    @property
    def taken(self) -> int:
        return self.step_guard.taken

    @property
    def skipped(self) -> int:
        return self.step_guard.skipped

    @property
    def last_skip_reason(self) -> str | None:
        return self.step_guard.last_skip_reason

    @property
    def last_norm(self) -> float | None:
        return self.step_guard.last_norm

    @property
    def consecutive(self) -> int:
        return self.step_guard.consecutive

    def state_dict(self) -> dict:
        """StepGuard's counters and policy (``StepGuard.state_dict``); a snapshot is saved with
        ``snapshot_state_dict()``."""
        return self.step_guard.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.step_guard.load_state_dict(state_dict)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes held by one snapshot's tensors (parameters, buffers, optimizer state)."""
        return self._slots[-1].nbytes() if self._slots else 0

    def track(self, scheduler) -> None:
        """Snapshot and rewind this scheduler too (``GuardedOptimizer.gate`` calls it)."""
        if not any(scheduler is s for s in self.schedulers):
            self.schedulers.append(scheduler)

    def _scheduler_stepped(self) -> None:
        """A framework steps its (gated) scheduler after ``optimizer.step()``, so after the
        snapshot of that position: refresh the snapshot's schedules."""
        if self._slots and self._slots[-1].position == self.position:
            self._slots[-1].rest["schedulers"] = [copy.deepcopy(s.state_dict()) for s in self.schedulers]

    # --- the step ---
    def step(self, loss=None, batch=None, closure=None) -> bool:
        """Check, then take the step, skip it, or rewind; return whether it was taken."""
        if self.rerun and closure is None:
            raise ConfigError("nanpass: SpikeGuard(rerun=True).step() needs closure=fn, where fn() "
                              "redoes the forward and backward of the same batch and returns the "
                              "loss; valid: pass closure=, or build the guard with rerun=False")
        self._calls += 1
        if not self._slots:
            self._snapshot()  # position 0: the state before the first update
        verdict = self._verdict(loss)
        fired = verdict["bad"] or verdict["spike"]
        classification = None
        if fired and self.rerun:
            first = verdict
            self._zero_grad()
            if self.step_guard._scaling():  # let the scaler unscale the re-run's gradients
                forget_unscale(self.scaler)
            _set_rng_state(self._rng_before)
            with torch.enable_grad():
                again = closure()
            verdict = self._verdict(again)
            classification = "reproducible" if verdict["bad"] or verdict["spike"] else "transient"
            if classification == "transient":
                self._event(batch, "kept", f"transient: {self._why(first)}, but the re-run from "
                            "the same weights and RNG state did not fire (a possible hardware "
                            "fault or silent data corruption); the re-run's step is taken",
                            classification)
        taken = self._act(verdict, batch, classification)
        if self.rerun:
            self._rng_before = _rng_state()
        return taken

    def _zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def _verdict(self, loss) -> dict:
        sg = self.step_guard
        measured = sg._measure()
        loss_t = None
        if loss is not None:
            loss_t = (loss.detach() if isinstance(loss, Tensor) else torch.tensor(float(loss))).float().mean()
        if measured is None:
            pairs = grads = norms = total = None
            device = loss_t.device if loss_t is not None else torch.device("cpu")
            flags = torch.zeros(2, device=device)
        else:
            pairs, grads, norms, total, flags = measured
            device = flags.device
        zero = torch.zeros((), device=device)
        extra = [zero, zero, zero]  # non-finite loss, loss spike, gradient-norm spike
        if loss_t is not None:
            loss_t = loss_t.to(device)
            extra[0] = ~torch.isfinite(loss_t)
            if self._n >= self.warmup:
                extra[1] = loss_t > self.factor * self._median(self._hist, self._n)
        if self.grad_factor is not None and total is not None and self._gn >= self.warmup:
            extra[2] = total > self.grad_factor * self._median(self._ghist, self._gn)
        flags = torch.cat([flags, torch.stack([e.to(torch.float32) for e in extra])])
        if sg._distributed():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the one collective: every rank agrees
        if grads is not None:
            sg._clip(grads, total)
        bad, zero_only, loss_bad, lspike, gspike = (bool(v) for v in flags.tolist())  # the one read
        return {"bad": bad or loss_bad, "grad_bad": bad, "zero": zero_only, "loss_spike": lspike,
                "grad_spike": gspike, "spike": lspike or gspike, "loss": loss_t, "total": total,
                "pairs": pairs, "norms": norms}

    def _median(self, hist: Tensor, n: int) -> Tensor:
        return hist[:min(n, self.window)].median()

    def _why(self, v: dict) -> str:
        """The reason in words (reads values back: only called when something fired)."""
        parts = []
        if v["bad"]:
            if v["loss"] is not None and not bool(torch.isfinite(v["loss"])):
                parts.append(f"non-finite loss ({float(v['loss'])})")
            elif v["grad_bad"] and v["pairs"] is not None:
                parts.append(self.step_guard._reason(v["pairs"], v["norms"], zero_only=False))
            else:
                parts.append("another rank had a non-finite loss or gradient")
        if v["loss_spike"]:
            here = v["loss"] is not None and self._n >= self.warmup
            if here:
                loss, med = float(v["loss"]), float(self._median(self._hist, self._n))
                here = loss > self.factor * med
            parts.append(f"loss spike: {loss:.6g} > {self.factor:g} x median {med:.6g} of the last "
                         f"{min(self._n, self.window)} losses" if here else "loss spike on another rank")
        if v["grad_spike"]:
            here = v["total"] is not None and self._gn >= self.warmup
            if here:
                norm, med = float(v["total"]), float(self._median(self._ghist, self._gn))
                here = norm > self.grad_factor * med
            parts.append(f"gradient-norm spike: {norm:.6g} > {self.grad_factor:g} x median {med:.6g}"
                         if here else "gradient-norm spike on another rank")
        return "; ".join(parts)

    def _act(self, v: dict, batch, classification) -> bool:
        sg = self.step_guard
        if v["bad"]:
            reason = self._why(v)
            if classification == "reproducible":
                reason = f"reproducible: {reason}, again on a re-run; batch quarantined"
            self._quarantine(batch, reason, classification)
            return sg._skip(v["pairs"] or [], v["norms"] or [], zero_only=False, reason=reason)
        if v["spike"]:
            reason = self._why(v)
            if classification == "reproducible":
                reason = f"reproducible: {reason}, again on a re-run; batch quarantined"
            self._rewind(batch, reason, classification)
            return False
        if v["zero"]:
            self._event(batch, "skipped", "every gradient is exactly 0 (skip_zero=True)", None)
            return sg._skip(v["pairs"], v["norms"], zero_only=True)
        taken = sg._decide(False, False, v["pairs"], v["norms"], v["total"], None) \
            if v["pairs"] is not None else sg._take(None)
        self._after_take(v["loss"], v["total"], batch)
        return taken

    def _after_take(self, loss_t, total, batch) -> None:
        if loss_t is not None:
            if self._hist is None:
                self._hist = torch.zeros(self.window, device=loss_t.device)
            self._hist[self._n % self.window].copy_(loss_t)  # on the device: no read
            self._n += 1
        if self.grad_factor is not None and total is not None:
            if self._ghist is None:
                self._ghist = torch.zeros(self.window, device=total.device)
            self._ghist[self._gn % self.window].copy_(total.float())
            self._gn += 1
        self._trail[self.position] = batch
        self.position += 1
        if self.position % self.every == 0:
            self._snapshot()

    # --- snapshots ---
    def _state_tree(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        return {"model": get_model_state_dict(self.model),
                "optim": get_optimizer_state_dict(self.model, list(self.optimizers))}

    def _small_state(self) -> dict:
        return {"schedulers": [copy.deepcopy(s.state_dict()) for s in self.schedulers],
                "scaler": _scaler_state(self.scaler),
                "rng": _rng_state(), "n": self._n, "gn": self._gn,
                "hist": None if self._hist is None else self._hist.clone(),
                "ghist": None if self._ghist is None else self._ghist.clone()}

    def _snapshot(self) -> None:
        if self._slots and self._slots[-1].position == self.position:
            return  # already kept (a rewind landed here)
        slot = self._slots.pop(0) if len(self._slots) >= self.keep else _Slot()
        slot.fill(self._state_tree(), self.snapshot_device)
        slot.position, slot.rest = self.position, self._small_state()
        self._slots.append(slot)
        oldest = self._slots[0].position
        for p in [p for p in self._trail if p < oldest]:
            del self._trail[p]
        for p in [p for p in self._restores if p < oldest]:
            del self._restores[p]  # a snapshot re-taken at a position keeps its rewind count

    def snapshot_state_dict(self, index: int = -1) -> dict:
        """A kept snapshot (newest by default) as a checkpoint: ``"model"`` and ``"optim"`` in the
        form of ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` /
        ``get_optimizer_state_dict`` (so ``torch.distributed.checkpoint.save`` or ``torch.save``
        takes it, and ``set_model_state_dict`` loads it), plus schedulers, scaler, RNG states and
        ``position``. ``load_snapshot`` restores it."""
        if not self._slots:
            raise ConfigError("nanpass: SpikeGuard.snapshot_state_dict: no snapshot yet (the first is "
                              "taken on the first step()); valid: call it after a step")
        slot = self._slots[index]
        return {**slot.tree(clone=True), **copy.deepcopy(slot.rest), "position": slot.position}

    def load_snapshot(self, state: dict) -> None:
        """Restore the model, optimizer, schedulers, scaler and RNG from ``snapshot_state_dict()``
        (for example after ``torch.load``); the guard's own snapshots and queues are cleared."""
        slot = _Slot()
        slot.fill({"model": state["model"], "optim": state["optim"]}, self.snapshot_device)
        slot.position = int(state["position"])
        slot.rest = {k: state[k] for k in ("schedulers", "scaler", "rng", "n", "gn", "hist", "ghist")}
        self._restore(slot)
        self._slots, self._trail, self.replay, self._restores = [slot], {}, [], {}

    def _restore(self, slot: _Slot) -> None:
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        tree = slot.tree(clone=True)  # clones: the optimizer must not alias the snapshot's buffers
        set_model_state_dict(self.model, tree["model"])
        set_optimizer_state_dict(self.model, list(self.optimizers), tree["optim"])
        rest = slot.rest
        for s, sd in zip(self.schedulers, rest["schedulers"], strict=False):
            s.load_state_dict(copy.deepcopy(sd))
            last = getattr(s, "_last_lr", None)
            groups = getattr(getattr(s, "optimizer", None), "param_groups", None)
            if last is not None and groups is not None:
                # the snapshot's param_groups may predate the scheduler's step (a framework steps
                # it after optimizer.step()): the learning rate is the restored schedule's
                for g, lr in zip(groups, last, strict=False):
                    if isinstance(g["lr"], Tensor):
                        g["lr"].fill_(lr)
                    else:
                        g["lr"] = lr
        if self.scaler is not None:
            # this step's unscale_ is abandoned with it: the next step unscales afresh
            forget_unscale(self.scaler)
            if rest["scaler"] is not None:
                set_scaler_state(self.scaler, rest["scaler"])
        _set_rng_state(rest["rng"])
        self._n, self._gn = rest["n"], rest["gn"]
        if rest["hist"] is not None:
            self._hist = rest["hist"].clone()
        if rest["ghist"] is not None:
            self._ghist = rest["ghist"].clone()
        self.position = slot.position
        self._zero_grad()

    def _rewind(self, batch, reason: str, classification) -> None:
        escalated = False
        while True:
            if not self._slots:
                raise SpikeError(f"nanpass: {reason}, and spikes came back after rewinding to every "
                                 f"kept snapshot (keep={self.keep}); the loss level itself has "
                                 "moved: raise factor, or lower the learning rate")
            slot = self._slots[-1]
            if self._restores.get(slot.position, 0) < 2:
                break
            self._slots.pop()  # a third spike on the same snapshot: go further back
            escalated = True
        n = self._restores.get(slot.position, 0)
        self._restores[slot.position] = n + 1
        # the first rewind to a snapshot honours skip=; a spike that comes back (or a rewind past
        # a snapshot that did not help) suspects every batch since: skip the window
        mode = self.skip if n == 0 and not escalated else "window"
        frm = self.position
        window = [self._trail.pop(p) for p in sorted(self._trail) if p >= slot.position]
        self._restore(slot)
        self.rewinds += 1
        self.step_guard._skipped += 1
        self.step_guard.last_skip_reason = reason
        self._event(None, "rewound", f"{reason}; restored the snapshot at position {slot.position} "
                    f"(from {frm}); {len(window)} applied batch(es) since then are "
                    f"{'replayed' if mode == 'batch' else 'skipped'}", classification,
                    position=frm, to=slot.position)
        self._quarantine(batch, reason, classification)
        if mode == "batch":
            self.replay[:0] = [_identity(b) for b in window if b is not None]
        else:
            why = (f"applied between the snapshot at position {slot.position} and the spike at "
                   f"{frm}" + (" (the spikes came back after a rewind)" if self.skip == "batch" else ""))
            for b in window:
                self._quarantine(b, why, None)
        unknown = sum(b is None for b in window)
        if unknown and mode == "batch":
            self._event(None, "lost", f"{unknown} batch(es) applied since the snapshot cannot be "
                        "replayed: step() was not given batch=", None)

    def _quarantine(self, batch, reason: str, classification) -> None:
        ident = _identity(batch)
        if ident is not None and ident not in self._skip_set:
            self._skip_set.add(ident)
            self.skip_batches.append(ident)
        self._event(batch, "skipped", reason, classification)

    def _event(self, batch, action: str, reason: str, classification, **extra) -> None:
        ev = {"step": self._calls - 1, "position": self.position, "batch": _identity(batch),
              "action": action, "reason": reason, "classification": classification, **extra}
        if self.step_guard._distributed():
            ev["rank"] = dist.get_rank()
        self.events.append(ev)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(json.dumps(ev, default=_json) + "\n")

    def __repr__(self) -> str:
        return (f"nanpass.SpikeGuard(taken={self.taken}, skipped={self.skipped}, "
                f"rewinds={self.rewinds}, position={self.position})")


class SkipSampler:
    """Wrap a batch sampler (``DataLoader(ds, batch_sampler=SkipSampler(sampler, guard))``) so
    that the guard's rewinds take effect in the data: it first yields the batches a rewind queued
    for replay (``guard.replay``), then the wrapped sampler's, leaving out every batch in
    ``guard.skip_batches`` (recorded in ``guard.events``). The batch identity the loop passes to
    ``guard.step(batch=...)`` is the batch's list of sample indices (have the dataset return its
    index). With ``num_workers > 0`` (or a framework that fetches ahead) the loader has fetched a
    few batches ahead: replayed batches come after those, so the data is the same but not in the
    same order.

    A replay makes an epoch longer than ``len(sampler)``. A loop that ends the epoch by count
    (Lightning, the HF Trainer) would never reach its last batches: they are recorded in
    ``guard.events`` as "not reached" when the next epoch starts. ``sized=False`` gives the
    sampler no length, so such a framework runs each epoch until the sampler is exhausted.
    """

    def __init__(self, batch_sampler, guard, sized: bool = True):
        inner = getattr(guard, "guard", guard)  # a GuardedOptimizer: its SpikeGuard
        if not isinstance(inner, SpikeGuard):
            raise NanpassTypeError(f"nanpass: SkipSampler guard={guard!r} is not a nanpass.SpikeGuard "
                                   "(or a GuardedOptimizer built with spike=...); valid: the guard "
                                   "whose rewinds the loader must follow")
        if not isinstance(sized, bool):
            raise NanpassTypeError(f"nanpass: SkipSampler sized={sized!r} is not valid; use True or False")
        self.batch_sampler = batch_sampler
        self.guard = inner
        self.sized = sized
        self._open = None  # the wrapped sampler's iterator of the epoch in progress

    def __len__(self) -> int:
        if not self.sized:
            raise NanpassTypeError("nanpass: SkipSampler(sized=False) has no length: an epoch lasts "
                                   "until the sampler is exhausted, replays included")
        return len(self.batch_sampler)

    def __iter__(self):
        g = self.guard
        if self._open is not None:  # the last epoch was ended before the sampler was exhausted
            left = list(self._open)
            for b in left:
                g._event(b, "not reached", "the loop ended the epoch before this batch (an epoch "
                         "of len(sampler) batches, made longer by a replay); SkipSampler(sized=False) "
                         "runs the epoch to its end", None)
        it = self._open = iter(self.batch_sampler)
        while True:
            if g.replay:
                yield list(g.replay.pop(0))
                continue
            try:
                b = next(it)
            except StopIteration:
                self._open = None
                return
            ident = _identity(b)
            if ident in g._skip_set:
                g._event(b, "skipped", "skipped earlier by the guard (in guard.skip_batches)", None)
                continue
            yield b
