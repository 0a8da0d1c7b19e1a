"""Each way a script ends, after a NaN or Inf nanpass has not read yet (its verdicts stay on the
device until a backward, an optimizer step or the end): `python ends.py CASE`. Every trigger
is exact (zeros, a division by zero), never a rounding."""

import math
import os
import sys

import torch
from torch import nn

torch.manual_seed(0)
case = sys.argv[1]

if case == "assert":  # the script's own check raises first
    m = nn.Linear(4, 1)
    x = torch.zeros(3, 4)
    loss = (m(x) / x.sum()).pow(2).mean()  # nanpass-expect: travel
    assert math.isfinite(loss.item()), "loss is not finite"
elif case == "multinomial":  # torch's own error first
    logits = torch.ones(2, 5)
    probs = torch.softmax(logits / torch.zeros(()), -1) * 0  # nanpass-expect: nan
    print(torch.multinomial(probs, 1))
elif case == "os_exit":  # an evaluation under no_grad, then os._exit
    with torch.no_grad():
        x = torch.zeros(3)
        y = x / x  # nanpass-expect: nan
        print("eval", y.shape, flush=True)
    os._exit(0)
elif case == "sys_exit":
    x = torch.zeros(3)
    y = x / x  # nanpass-expect: nan
    sys.exit(0)
elif case == "autograd_grad":  # manual updates: no backward(), no optimizer step
    w = torch.zeros(3, requires_grad=True)
    for step in range(3):
        loss = (w * w).sum().sqrt()  # nanpass-expect: backward
        (g,) = torch.autograd.grad(loss, [w])
        with torch.no_grad():
            w -= 0.1 * g
        print("wrote checkpoint", step, flush=True)
elif case == "anomaly":  # torch's anomaly mode raises at the node after the one that made it
    torch.autograd.set_detect_anomaly(True)
    w = torch.zeros(3, requires_grad=True)
    h = w * 2
    loss = h.pow(2).sum().sqrt()  # nanpass-expect: backward
    loss.backward()
elif case == "custom":  # a custom Function's backward, named at its own line

    class Inverse(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g / x  # nanpass-expect: backward

    x = torch.zeros(3, requires_grad=True)
    Inverse.apply(x).sum().backward()
    print("grad", x.grad)
elif case == "spawn":  # torch.multiprocessing.spawn's workers, the usual single-node DDP launcher
    import torch.multiprocessing as mp

    def worker(rank):
        x = torch.zeros(3)
        y = x / x  # nanpass-expect: nan
        print("worker", rank, y.shape, flush=True)

    if __name__ == "__main__":
        mp.spawn(worker, nprocs=1)
        print("parent done")
elif case == "fork":  # multiprocessing's fork child ends with os._exit
    import multiprocessing as mp

    def child():
        x = torch.zeros(3)
        y = x / x  # nanpass-expect: nan
        print("child", y.shape, flush=True)

    if __name__ == "__main__":
        p = mp.get_context("fork").Process(target=child)
        p.start()
        p.join()
        print("child exit", p.exitcode, flush=True)
else:
    raise SystemExit(f"unknown case {case}")
