"""Padding filled with -inf for a max-pool over time, but a mixing layer sits between the fill
and the pool: the Linear sums +inf and -inf."""

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class MaxPoolEncoder(nn.Module):
    def __init__(self, d=8, hidden=16):
        super().__init__()
        self.inp = nn.Linear(d, hidden)
        self.mix = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x, pad):
        h = torch.relu(self.inp(x))
        h = h.masked_fill(pad[..., None], -math.inf)  # nanpass-expect: inf
        h = self.mix(h)  # nanpass-expect: nan
        return self.head(h.max(dim=1).values)


model = MaxPoolEncoder()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(6):
    x = torch.randn(4, 12, 8)
    lengths = torch.full((4,), 12)
    if step >= 3:
        lengths = torch.tensor([12, 5, 9, 12])  # variable-length batches from here on
    pad = torch.arange(12) >= lengths[:, None]
    y = x.sum(dim=(1, 2)).unsqueeze(-1) / 10
    loss = F.mse_loss(model(x, pad), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
