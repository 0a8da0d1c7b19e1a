"""A triplet loss on embeddings that collide: the distance is written sqrt(sum((a - b)^2)),
whose gradient at 0 is inf — and 0 * inf is NaN in every weight behind it.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from _common import quick_flag, state

import nanpass


class Triplet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 4)

    def forward(self, anchor, positive, negative):
        a, p, n = self.embed(anchor), self.embed(positive), self.embed(negative)
        d_pos = torch.sqrt(((a - p) ** 2).sum(-1))
        d_neg = torch.sqrt(((a - n) ** 2).sum(-1))
        return torch.relu(d_pos - d_neg + 1.0).mean()


def main():
    steps = 3 if quick_flag(__doc__) else 50
    torch.manual_seed(0)
    plain = Triplet()
    twin = copy.deepcopy(plain)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        anchor = torch.randn(16, 8, generator=g)
        positive = anchor.clone()  # duplicates: the distance is exactly 0
        positive[8:] += 0.1 * torch.randn(8, 8, generator=g)
        batches.append((anchor, positive, torch.randn(16, 8, generator=g)))
    for model, params, label in ((plain, plain.parameters(), "before"),
                                 (nanpass.harden(twin), twin.parameters(), "after")):
        opt = torch.optim.SGD(params, lr=0.1)
        for batch in batches:
            opt.zero_grad()
            loss = model(*batch)
            loss.backward()
            opt.step()
        weights = plain if label == "before" else twin
        print(f"{label}: loss {loss.item():.4g}, weights {state(*weights.parameters())}")
    print(model.summary())


if __name__ == "__main__":
    main()
