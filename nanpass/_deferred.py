"""Check mode's verdicts kept on the device, read once after the forward and once after the
backward (issue 38): on a GPU every read of a device value stalls the host until every kernel
queued before it has run, so a check that reads at each op serialises the step.

Forward: each watched call adds one device scalar per new floating result (its sum, taken in
float64 where the device has it, so a finite tensor's sum is finite and a NaN or an infinity
is seen) and a record on the host of which earlier values its operands were. After the
forward the scalars are read in one copy, and the records are classified as the per-op check
classifies a call (``Watch._nonfinite``): an infinity made on purpose (a constant, a pole) or
passed on stays quiet. Only where something is to be reported does the hardened call run the
forward again with the check at each op, from the same random state, and that run names the
op, its line and its operands exactly as ``stop_at_op=True`` would.

Backward: each hooked node adds a scalar for the gradients it gave and one for those it
received; once the backward has finished (``_compat.at_backward_end``) they are read in one
copy and the first node that made a finite gradient non-finite is named, with its forward
site.
"""

from __future__ import annotations

from weakref import ref

import torch

from ._compat import at_backward_end, is_view, view_base

Tensor = torch.Tensor
FINITE, INF, NAN = 0, 1, 2


def scalar(t: Tensor) -> Tensor:
    """One reduction: finite iff every element is (NaN iff a NaN, or both infinities). Taken
    in float64 (float32 on MPS, which has no float64): a sum of finite float32 values cannot
    overflow there."""
    if t.requires_grad:
        t = t.detach()
    return t.sum(dtype=torch.float32 if t.is_mps else torch.float64)


def _state(v: float) -> int:
    return FINITE if v - v == 0 else (NAN if v != v else INF)


def read(scalars: list[Tensor]) -> list[int]:
    """Every scalar's state (FINITE, INF, NAN), in one copy to the host per device."""
    if not scalars:
        return []
    try:  # the one read: a copy of every scalar
        return [_state(v) for v in torch.stack(scalars).tolist()]
    except RuntimeError:  # several devices (a model split over GPUs): one copy each
        pass
    by_device: dict = {}
    for k, s in enumerate(scalars):
        by_device.setdefault(s.device, []).append(k)
    states = [FINITE] * len(scalars)
    for ks in by_device.values():
        vals = torch.stack([scalars[k].to(torch.float64) for k in ks]).tolist()
        for k, v in zip(ks, vals, strict=True):
            states[k] = _state(v)
    return states


class Record:
    """One watched call: the slots of its new values, and of the values its operands were
    (``view`` where an operand is a view of that value: it holds some of its elements)."""

    __slots__ = ("outs", "operands", "constant", "pole", "made", "inplace")

    def __init__(self, outs, operands, constant, pole, made, inplace=False):
        self.outs, self.operands, self.constant, self.pole = outs, operands, constant, pole
        self.made, self.inplace = made, inplace  # inplace: operands[0] is what it overwrote


class Forward:
    """The scalars and records of one hardened forward."""

    __slots__ = ("scalars", "slots", "records", "reasons", "nan_reasons")

    def __init__(self):
        self.scalars: list[Tensor] = []
        # id(tensor) -> (a weak reference to it, the slot of the value it holds now); an entry
        # counts only while its reference still gives that tensor (an id outlives its object)
        self.slots: dict[int, tuple] = {}
        self.records: list[Record] = []
        self.reasons: list[int] = []  # slots reported if not finite (the state, the output)
        self.nan_reasons: list[int] = []  # slots reported if NaN (an input)

    def add(self, t: Tensor, value: Tensor | None = None) -> int:
        self.scalars.append(scalar(t) if value is None else value)
        k = len(self.scalars) - 1
        if value is None:
            self.slots[id(t)] = (ref(t), k)
        return k

    def name(self, t: Tensor, k: int) -> None:
        """``t`` holds the value of slot ``k`` (a parameter: the state's)."""
        self.slots[id(t)] = (ref(t), k)

    def get(self, t: Tensor) -> int | None:
        e = self.slots.get(id(t))
        return e[1] if e is not None and e[0]() is t else None

    def slot_of(self, t: Tensor) -> tuple[int, bool]:
        """The slot of the value ``t`` holds, and whether ``t`` is a view of it."""
        k = self.get(t)
        if k is not None:
            return k, False
        if is_view(t):
            b = self.get(view_base(t))
            if b is not None:
                return b, True
        return self.add(t), False  # a tensor made outside the watch: its own scalar

    def verdict(self) -> str | None:
        """None: nothing to report. "definite": the per-op check would report (or an input,
        the state or the output is not finite). "maybe": a view of a non-finite value was
        read, whose own elements only the per-op check can tell."""
        st = read(self.scalars)
        if any(st[k] != FINITE for k in self.reasons) or any(st[k] == NAN for k in self.nan_reasons):
            return "definite"
        maybe = False
        for r in self.records:
            bad = [st[k] for k in r.outs if st[k] != FINITE]
            if not bad:
                continue
            if r.made is not None:
                r.made.nonfinite = True
            ops = [st[k] for k, _ in r.operands]
            if any(view and st[k] != FINITE for k, view in r.operands):
                maybe = True
                continue
            before = ops.pop(0) if r.inplace and ops else FINITE
            in_nan, in_inf = NAN in ops, INF in ops
            for state in bad:
                nan = state == NAN
                if before != FINITE:  # the in-place operand was already non-finite
                    in_inf, in_nan = True, in_nan or nan
                if nan and not in_nan:
                    if r.constant:
                        continue  # a NaN constant, on purpose
                    return "definite"
                if nan or in_nan or in_inf:
                    continue  # a NaN or an infinity passed on
                if r.constant or (r.pole is not None and st[r.pole] != FINITE):
                    continue  # an infinity made on purpose
                return "definite"  # an overflow from finite operands
        return "maybe" if maybe else None


def pole_flag(o: Tensor, x: Tensor, poles: tuple, cache: dict) -> Tensor:
    """A float64 scalar, non-finite where an infinity of ``o`` sits at a pole of ``x``."""
    key = (poles, x.dtype, x.device)
    at = cache.get(key)
    if at is None:  # made once: a host-to-device copy per call would wait for the queue
        at = cache[key] = torch.tensor(poles, dtype=x.dtype, device=x.device)
    hit = (torch.isinf(o.detach()) & torch.isin(x.detach(), at)).any()
    return torch.where(hit, float("inf"), 0.0).to(torch.float64)


class Backward:
    """The scalars of one backward: per hooked node, what it gave and what it received."""

    __slots__ = ("scalars", "records")

    def __init__(self):
        self.scalars: list[Tensor] = []
        self.records: list[tuple] = []

    def add_all(self, grads: list[Tensor]) -> int | None:
        if not grads:
            return None
        s = scalar(grads[0])
        for g in grads[1:]:
            s = s + scalar(g).to(s.device)
        self.scalars.append(s)
        return len(self.scalars) - 1


def start_backward(watch) -> Backward:
    """The running backward's record, made at its first hook; read when it ends."""
    bw = watch.pending_backward
    if bw is None:
        bw = watch.pending_backward = Backward()

        def end():
            watch.pending_backward = None
            watch.backward_verdicts(bw)

        at_backward_end(end)
    return bw
