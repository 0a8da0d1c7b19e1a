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

from ._compat import at_backward_end, is_view, version, view_base

Tensor = torch.Tensor
FINITE, INF, NAN = 0, 1, 2




_SMALL = 1 << 16  # elements: a scalar of a tensor this small is one reduction in float64


def scalar(t: Tensor) -> Tensor:
    """One float64 scalar (float32 on MPS), finite exactly when every element of ``t`` is, NaN
    exactly when one is NaN: the magnitudes of its least and its largest element, added in
    float64, which no finite tensor can overflow (two infinities of either sign add to an
    infinity, never a NaN). ``aminmax`` reads the tensor once and copies none of it: a sum of
    magnitudes in float64 first copies the whole tensor to float64, twice a float32 output's
    size at the forward's peak (a GPT-2 head's logits), so only a small tensor gets one (the
    sum of all its magnitudes, which cannot overflow float64 either: one op, not three)."""
    if t.requires_grad:
        t = t.detach()
    if t.is_mps:  # (no float64 there: the largest magnitude, in the tensor's own float)
        return torch.linalg.vector_norm(t, float("inf"))
    if torch.compiler.is_compiling():  # (a graph's reduction copies nothing: one op, no branch)
        return torch.linalg.vector_norm(t, float("inf")).to(torch.float64)
    if t.numel() <= _SMALL:  # (one op: the copy is small, and each op is a launch)
        return torch.linalg.vector_norm(t, 1, dtype=torch.float64)
    low, high = torch.aminmax(t)
    return torch.linalg.vector_norm(torch.stack((low, high)), 1, dtype=torch.float64)


def state_of(v: float) -> int:
    return FINITE if v - v == 0 else (NAN if v != v else INF)


def read_values(tensors: list[Tensor]) -> list[float]:
    """Every element of ``tensors`` (flags, scalars, vectors of any dtype), in order, in one
    copy to the host per device."""
    if not tensors:
        return []
    flat = [t.reshape(-1) for t in tensors]
    try:  # the one read (cat promotes: a flag is 0.0 or 1.0)
        return torch.cat(flat).tolist()
    except RuntimeError:  # several devices: one copy each
        pass
    by_device: dict = {}
    for k, t in enumerate(flat):
        by_device.setdefault(t.device, []).append(k)
    parts: list = [None] * len(flat)
    for ks in by_device.values():
        vals = torch.cat([flat[k].to(torch.float64) for k in ks]).tolist()
        at = 0
        for k in ks:
            n = flat[k].numel()
            parts[k], at = vals[at:at + n], at + n
    return [v for part in parts for v in part]


def read(scalars: list[Tensor]) -> list[int]:
    """Every scalar's state (FINITE, INF, NAN), in one copy to the host per device."""
    if not scalars:
        return []
    try:  # the one read: a copy of every scalar
        return [state_of(v) for v in torch.stack(scalars).tolist()]
    except RuntimeError:  # several devices (a model split over GPUs): one copy each
        pass
    by_device: dict = {}
    for k, s in enumerate(scalars):
        by_device.setdefault(s.device, []).append(k)
    states = [FINITE] * len(scalars)
    for ks in by_device.values():
        vals = torch.stack([scalars[k].to(torch.float64) for k in ks]).tolist()
        for k, v in zip(ks, vals, strict=True):
            states[k] = state_of(v)
    return states


class Record:
    """One watched call: the slots of its new values, and of the values its operands were
    (``view`` where an operand is a view of that value: it holds some of its elements)."""

    __slots__ = ("outs", "operands", "constant", "pole", "made", "inplace", "call")

    def __init__(self, outs, operands, constant, pole, made, inplace=False, call=None):
        self.outs, self.operands, self.constant, self.pole = outs, operands, constant, pole
        self.made, self.inplace = made, inplace  # inplace: operands[0] is what it overwrote
        # nanpass.enable (no forward to run again): (rule hit, results and operands as
        # ``Ref``s, the in-place operand's slot or -1 for ``x[i] = v``, its site), for the
        # per-op check to be made on the host from the states once they are read
        self.call = call


class Ref:
    """A tensor held weakly with the version it had: the value is the call's only while the
    tensor lives (autograd keeps what it saved) and no in-place write has changed it."""

    __slots__ = ("ref", "version", "dtype")

    def __init__(self, t: Tensor):
        self.ref, self.version, self.dtype = ref(t), version(t), t.dtype

    def get(self) -> Tensor | None:
        t = self.ref()
        return t if t is not None and version(t) == self.version else None


class Forward:
    """The scalars and records of one hardened forward."""

    __slots__ = ("scalars", "slots", "records", "reasons", "nan_reasons", "escapes")

    def __init__(self):
        self.scalars: list[Tensor] = []
        # id(tensor) -> (a weak reference to it, the slot of the value it holds now); an entry
        # counts only while its reference still gives that tensor (an id outlives its object)
        self.slots: dict[int, tuple] = {}
        self.records: list[Record] = []
        self.reasons: list[int] = []  # slots reported if not finite (the state, the output)
        self.nan_reasons: list[int] = []  # slots reported if NaN (an input)
        self.escapes: list[tuple] = []  # (a tensor, what it is): the loss, named if not finite

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

    def verdict(self, st: list[int] | None = None) -> str | None:
        """None: nothing to report. "definite": the per-op check would report (or an input,
        the state or the output is not finite). "maybe": a view of a non-finite value was
        read, whose own elements only the per-op check can tell. ``st``: the states, where
        they were read already (with a backward's, in one copy)."""
        st = read(self.scalars) if st is None else st
        for r in self.records:  # a backward whose forward value was not finite says so
            if r.made is not None and any(st[k] != FINITE for k in r.outs):
                r.made.nonfinite = True
        if any(st[k] != FINITE for k in self.reasons) or any(st[k] == NAN for k in self.nan_reasons):
            return "definite"
        maybe = False
        for r in self.records:
            found = self.classify(r, st)
            if found == "definite":
                return found
            maybe = maybe or found == "maybe"
        return "maybe" if maybe else None

    def classify(self, r: Record, st: list[int]) -> str | None:
        """One record as the per-op check classifies its call: "definite" where it reports."""
        bad = [st[k] for k in r.outs if st[k] != FINITE]
        if not bad:
            return None
        ops = [st[k] for k, _ in r.operands]
        if any(view and st[k] != FINITE for k, view in r.operands):
            return "maybe"
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
            if self._sum_overflowed(r):
                break  # finite values whose sum passed the largest float
            return "definite"  # an overflow from finite operands
        return None

    def _sum_overflowed(self, r: Record) -> bool:
        """Every value of the record's results still held is finite: only their sum was not
        (a tensor already freed cannot be looked at again: the second run decides)."""
        live = [e[0]() for e in self.slots.values() if e[1] in r.outs]
        live = [t for t in live if t is not None]
        return len(live) == len(r.outs) and all(bool(torch.isfinite(t).all()) for t in live)


def pole_flag(o: Tensor, x: Tensor, poles: tuple, cache: dict) -> Tensor:
    """A float64 scalar, non-finite where an infinity of ``o`` sits at a pole of ``x``."""
    key = (poles, x.dtype, x.device)
    at = cache.get(key)
    if at is None:  # made once: a host-to-device copy per call would wait for the queue
        at = cache[key] = torch.tensor(poles, dtype=x.dtype, device=x.device)
    hit = (torch.isinf(o.detach()) & torch.isin(x.detach(), at)).any()
    return torch.where(hit, float("inf"), 0.0)


class Backward:
    """The scalars of one backward: per hooked node, the slots of the gradients it gave and of
    those it received. A gradient a node receives is most often the very tensor the node
    before it gave (autograd sums only where several contributions meet): its slot is found
    by identity, and only a gradient not seen yet costs a reduction."""

    __slots__ = ("scalars", "records", "slots", "explained")

    def __init__(self):
        self.explained = False  # something was reported before it ended (nanpass.enable)
        self.scalars: list[Tensor] = []
        self.records: list[tuple] = []
        self.slots: dict[int, tuple] = {}  # id(gradient) -> (a weak reference, its slot)

    def slots_of(self, grads: list[Tensor]) -> list[int]:
        out = []
        for g in grads:
            e = self.slots.get(id(g))
            if e is not None and e[0]() is g:
                out.append(e[1])
                continue
            self.scalars.append(scalar(g))
            k = len(self.scalars) - 1
            self.slots[id(g)] = (ref(g), k)
            out.append(k)
        return out


def start_backward(watch) -> Backward:
    """The running backward's record, made at its first hook; read when it ends."""
    bw = watch.pending_backward
    if bw is None:
        bw = Backward()

        def end():
            watch.pending_backward = None
            watch.backward_ended(bw)

        at_backward_end(end)  # (raises outside a backward: then nothing is left pending)
        watch.pending_backward = bw
    return bw
