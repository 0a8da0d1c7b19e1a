"""Sharpening a policy over variable-length candidate lists: the entropy term multiplies the
-inf log-probability of a padded candidate by its 0 probability."""

import math
import sys

import torch
from torch import nn

torch.manual_seed(0)


class Scorer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.lin = nn.Linear(d, 1)

    def forward(self, x, mask):
        h = self.lin(x).squeeze(-1).masked_fill(mask, -math.inf)  # nanpass-expect: inf
        return h - h.logsumexp(-1, keepdim=True)


model = Scorer()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(6):
    x = torch.randn(4, 10, 8)
    lengths = torch.full((4,), 10)
    if step >= 3:
        lengths = torch.tensor([10, 7, 4, 9])  # the first batch with short lists
    mask = torch.arange(10) >= lengths[:, None]
    z = model(x, mask)
    loss = -(z * z.softmax(-1)).sum(-1).mean()  # nanpass-expect: nan
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
