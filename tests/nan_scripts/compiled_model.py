"""A compiled regressor that standardizes each sample's features itself: a dead sensor sends a
constant row, its std is 0, and (x - mean) / std is 0 / 0 inside the compiled graph."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class Regressor(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x):
        x = (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)  # nanpass-expect: birth
        return self.net(x)


model = Regressor()
compiled = torch.compile(model, backend="aot_eager")
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(6):
    x = torch.randn(8, 16) * 3 + 1
    if step == 3:
        x[5] = 0.0  # a dead sensor
    y = x[:, :1]
    loss = F.mse_loss(compiled(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
