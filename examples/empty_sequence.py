"""A run that goes NaN halfway: at step 60 one sequence in the batch is all padding. Its masked
softmax is over nothing but -inf, which is NaN, and the loss, every gradient and, after the
step, every weight are NaN from then on. Hardened, the run has the same losses bit for bit up
to that step and trains on through it. The docs' home page plots these two runs.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from _common import quick_flag

import nanpass


class Pooler(nn.Module):
    """Attention pooling over the tokens that are not padding, then a linear classifier."""

    def __init__(self, d: int = 16, classes: int = 4):
        super().__init__()
        self.score = nn.Linear(d, 1)
        self.head = nn.Linear(d, classes)

    def forward(self, x, pad, target):
        scores = self.score(x).squeeze(-1).masked_fill(pad, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # a row that is all padding -> NaN
        return F.cross_entropy(self.head((weights[..., None] * x).sum(1)), target)


def batches(steps: int, bad: int):
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 4, generator=g)
    for step in range(steps):
        x = torch.randn(64, 12, 16, generator=g)
        pad = torch.arange(12) >= torch.randint(1, 13, (64, 1), generator=g)  # random lengths
        if step == bad:
            pad[0] = True  # a sequence of length 0
        target = ((x * ~pad[..., None]).sum(1) @ teacher).argmax(-1)
        yield x, pad, target


def train(model, params, steps: int, bad: int) -> list[float]:
    """The loss at every step (a NaN stays in the list)."""
    opt = torch.optim.Adam(params, lr=3e-2)
    losses = []
    for x, pad, target in batches(steps, bad):
        opt.zero_grad()
        loss = model(x, pad, target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def runs(steps: int = 100, bad: int = 60):
    """The plain model's losses, the hardened twin's losses, and the hardened model."""
    torch.manual_seed(0)
    plain = Pooler()
    twin = copy.deepcopy(plain)
    safe = nanpass.harden(twin)
    return train(plain, plain.parameters(), steps, bad), train(safe, twin.parameters(), steps, bad), safe


def main():
    steps, bad = (8, 4) if quick_flag(__doc__) else (100, 60)
    plain, hardened, safe = runs(steps, bad)
    print(f"before: loss {plain[bad - 1]:.4f} at step {bad - 1}, {plain[bad]} at step {bad}, "
          f"{plain[-1]} at step {steps - 1}")
    print(f"after:  loss {hardened[bad]:.4f} at step {bad}, {hardened[-1]:.4f} at step {steps - 1}")
    print(safe.summary())


if __name__ == "__main__":
    main()
