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

import torch
import torch.distributed as dist

from ._check import NonFiniteError, describe

Tensor = torch.Tensor


class StepGuard:
    """Call ``guard.step()`` where you would call ``optimizer.step()`` (after ``backward()``).

    >>> import torch, nanpass
    >>> model = torch.nn.Linear(2, 1)
    >>> guard = nanpass.StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0)
    >>> model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    >>> guard.step(), guard.skipped
    (False, 1)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, max_norm: float | None = None,
                 norm_type: float = 2.0, sync: bool = True, max_consecutive_skips: int | None = 100,
                 model: torch.nn.Module | None = None, skip_zero: bool = True,
                 scaler: torch.amp.GradScaler | None = None):
        self.optimizer = optimizer
        self.skip_zero = skip_zero
        self.scaler = scaler
        self.max_norm = max_norm
        self.norm_type = float(norm_type)
        self.sync = sync
        self.max_consecutive_skips = max_consecutive_skips
        self.names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._taken = 0
        self._skipped = 0
        self._pending: Tensor | None = None  # fused path: skips not read back yet
        self._pending_calls = 0
        self.consecutive = 0
        self.last_skip_reason: str | None = None
        self._last_norm: Tensor | None = None  # read lazily: no second sync per step
        self._last_total_zero = False

    def _grads(self) -> list[tuple[Tensor, Tensor]]:
        return [(p, p.grad) for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def step(self, closure=None) -> bool | None:
        """Check, clip and step; return whether the step was taken. With a GradScaler, the
        gradients are unscaled first and ``scaler.step``/``scaler.update`` run as usual, so
        the scale still backs off on overflow. With an optimizer that takes the verdict as a
        tensor (``fused=True``) and ``max_consecutive_skips=None``, nothing is read back: the
        step returns None and ``taken``/``skipped`` are settled when read."""
        if self.scaler is not None and self.scaler.is_enabled():
            try:
                self.scaler.unscale_(self.optimizer)
            except RuntimeError as e:  # the user unscaled already (to clip, say): fine
                if "already been called" not in str(e):
                    raise
        pairs = self._grads()
        if not pairs:
            return self._take(closure)
        # FSDP2 gradients are DTensor shards: work on the local shard, sum the norms over ranks
        sharded = any(hasattr(g, "to_local") for _, g in pairs)
        grads = [g.to_local() if hasattr(g, "to_local") else g for _, g in pairs]
        norms = torch._foreach_norm(grads, self.norm_type)  # one fused pass over every gradient
        total = torch.linalg.vector_norm(torch.stack([n.to(grads[0].device) for n in norms]),
                                         self.norm_type)
        distributed = self.sync and dist.is_available() and dist.is_initialized()
        if distributed and sharded:
            powered = total.pow(self.norm_type)
            dist.all_reduce(powered, op=dist.ReduceOp.SUM)
            total = powered.pow(1.0 / self.norm_type)
        found = ~torch.isfinite(total)
        if self.skip_zero:  # every gradient exactly 0: no finite sample in the batch
            found = found | (total == 0)
        found = found.to(torch.float32)
        if distributed:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)  # every rank skips together
        if self.max_norm is not None:
            # clip the gradients of this step; a non-finite total makes the coefficient 0 here,
            # and the step is skipped anyway
            coef = torch.where(torch.isfinite(total), self.max_norm / (total + 1e-6),
                               torch.zeros_like(total)).clamp(max=1.0)
            torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        if self._device_verdict(closure):
            # the optimizer takes the verdict as a tensor (fused Adam/SGD/Adagrad skip the update
            # on the device, as under GradScaler): no host sync at all
            self.optimizer.grad_scale, self.optimizer.found_inf = None, found
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
            self._pending = found if self._pending is None else self._pending + found
            self._pending_calls += 1
            return None
        if bool(found.item()):  # the one host sync per step
            self._last_total_zero = bool(total == 0)
            return self._skip(pairs, norms)
        self._last_norm = total
        return self._take(closure)

    def _device_verdict(self, closure) -> bool:
        return (getattr(self.optimizer, "_step_supports_amp_scaling", False) and closure is None
                and (self.scaler is None or not self.scaler.is_enabled())
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
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif closure is not None:
            self.optimizer.step(closure)
        else:
            self.optimizer.step()
        self._taken += 1
        self.consecutive = 0
        return True

    def _skip(self, pairs, norms) -> bool:
        bad = [(p, g) for (p, g), n in zip(pairs, norms, strict=True) if not bool(torch.isfinite(n))]
        bad = [(p, g.to_local() if hasattr(g, "to_local") else g) for p, g in bad]
        if bad:
            p, g = bad[0]
            name = self.names.get(id(p), f"a parameter of shape {tuple(p.shape)}")
            reason = f"non-finite gradient in {name} ({describe(g)})"
            if len(bad) > 1:
                reason += f" and {len(bad) - 1} more parameters"
        elif self._last_total_zero:
            reason = "every gradient is exactly 0 (no finite sample in the batch?)"
        else:
            reason = "another rank had a non-finite gradient"
        self._skipped += 1
        self.consecutive += 1
        self.last_skip_reason = reason
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.update()  # its found_inf from unscale_ backs the scale off
        self.optimizer.zero_grad(set_to_none=True)
        if self.max_consecutive_skips is not None and self.consecutive >= self.max_consecutive_skips:
            raise NonFiniteError(
                f"nanpass: {self.consecutive} optimizer steps skipped in a row; last: {reason}. "
                "Find the cause with nanpass.locate(model, *inputs, loss_fn=...)"
            )
        return False

    def state_dict(self) -> dict:
        return {"taken": self.taken, "skipped": self.skipped, "consecutive": self.consecutive}

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
