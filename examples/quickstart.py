"""nanpass quickstart: a small model that goes NaN, and the same model hardened.

The model has three classic NaN sources: a masked attention row where every key is padding
(softmax of all -inf), a normalisation by a sum that can be 0, and a log of a probability
that can reach 0. Run it:  python examples/quickstart.py
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn

import nanpass


class TinyAttentionClassifier(nn.Module):
    def __init__(self, d: int = 16, classes: int = 4):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, pad, target):
        scores = self.q(x) @ self.k(x).transpose(1, 2) / x.shape[-1] ** 0.5
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))  # padded keys
        attn = torch.softmax(scores, dim=-1)  # all -inf row -> NaN
        h = (attn @ x).mean(1)
        w = torch.relu(self.head(h))
        probs = w / w.sum(-1, keepdim=True)  # 0 / 0 when every logit is negative
        return -torch.log(probs.gather(1, target[:, None])).mean()  # log(0) = -inf


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 5, 16, generator=g)
    pad = torch.zeros(8, 5, dtype=torch.bool)
    pad[0] = True  # one sequence is all padding
    target = torch.randint(0, 4, (8,), generator=g)
    return x, pad, target


def train(model, params, steps=10):
    opt = torch.optim.SGD(params, lr=0.1)
    for step in range(steps):
        x, pad, target = batch(step)
        opt.zero_grad()
        loss = model(x, pad, target)
        loss.backward()
        opt.step()
        if not torch.isfinite(loss):
            return step, loss.item()
    return steps, loss.item()


def main():
    torch.manual_seed(0)
    plain = TinyAttentionClassifier()
    twin = copy.deepcopy(plain)

    step, loss = train(plain, plain.parameters())
    print(f"plain model:    loss {loss} at step {step}")

    safe = nanpass.harden(twin)
    step, loss = train(safe, twin.parameters())
    finite = all(torch.isfinite(p).all() for p in twin.parameters())
    print(f"hardened model: loss {loss:.4f} after {step} steps, weights finite: {finite}")

    print()
    print(safe.summary())
    for c in safe.changes:
        where = f"{os.path.relpath(c.source)}  {c.code}" if c.source else c.module or "<root>"
        print(f"  {c.action:8} {c.spelling:22} {where}")


if __name__ == "__main__":
    main()
