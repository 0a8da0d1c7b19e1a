"""Shared test helpers: run a module forward and backward, collect what must be finite."""

from __future__ import annotations

import torch


def flat_tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in flat_tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in flat_tensors(o)]
    if hasattr(out, "to_tuple"):
        return flat_tensors(out.to_tuple())
    return []


def forward_backward(module, args, kwargs=None):
    """(outputs, grads of every float input that requires grad) after backward of the sum."""
    kwargs = kwargs or {}
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    for a in leaves:
        a.grad = None
    out = module(*args, **kwargs)
    outs = [o for o in flat_tensors(out) if o.is_floating_point()]
    loss = sum(o.float().sum() for o in outs if o.requires_grad)
    if isinstance(loss, torch.Tensor):
        loss.backward()
    return outs, [a.grad for a in leaves if a.grad is not None]


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit pattern, so -0.0 and 0.0 (and every rounding) are told apart."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().contiguous().view(ints[t.element_size()])


def run_two_ranks(worker, out_dir, mode: str, timeout: float = 240) -> None:
    """Spawn ``worker(rank, 2, port, out_dir, mode)`` on two processes (gloo on a free local
    port) and assert both finished cleanly: a hung rank is a deadlock."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, 2, port, str(out_dir), mode)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung: deadlock"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


class SigmoidSpike(torch.autograd.Function):
    """snnTorch's sigmoid surrogate gradient (snntorch.surrogate.sigmoid, slope 100): a 0/1
    spike forward; in backward exp overflows for a steep slope, and inf / inf is NaN."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x > 0).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        e = torch.exp(-100 * x)
        return g * 100 * e / (1 + e) ** 2


class Spiking(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x):
        return SigmoidSpike.apply(self.l(x)).sum()
