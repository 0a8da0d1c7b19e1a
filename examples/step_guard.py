"""A training loop that survives the odd bad batch: nanpass.StepGuard skips a step whose
gradients are not finite (one fused check), clips this step's gradients, and keeps counts.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from _common import quick_flag, state

import nanpass


def main():
    steps = 40 if quick_flag(__doc__) else 400
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    guarded = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(0)
    data = []
    for step in range(steps):
        x = torch.randn(32, 8, generator=g)
        y = x.sum(1, keepdim=True)
        if step % 20 == 19:
            x[0, 0] = float("nan")  # one corrupt sample every 20 batches
        data.append((x, y))
    opt = torch.optim.SGD(plain.parameters(), lr=0.01)
    guard = nanpass.StepGuard(torch.optim.SGD(guarded.parameters(), lr=0.01), max_norm=5.0, model=guarded)
    for x, y in data:
        for model, step in ((plain, opt.step), (guarded, guard.step)):
            model.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            step()
    print(f"before: weights {state(*plain.parameters())}")
    print(f"after:  weights {state(*guarded.parameters())}; {guard.taken} steps taken, "
          f"{guard.skipped} skipped; last skip: {guard.last_skip_reason}")


if __name__ == "__main__":
    main()
