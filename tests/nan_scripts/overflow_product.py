"""A float16 gated MLP: the gate times the value overflows float16 (max 65504) on a loud batch."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class GatedMLP(nn.Module):
    def __init__(self, d=8, hidden=16):
        super().__init__()
        self.gate = nn.Linear(d, hidden)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, 1)

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.up(x)  # nanpass-expect: birth
        return self.down(h)


model = GatedMLP().half()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(6):
    x = torch.randn(32, 8)
    if step == 3:
        x = x * 1000  # a batch that missed its normalization
    y = x.sum(-1, keepdim=True)
    loss = F.mse_loss(model(x.half()).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
