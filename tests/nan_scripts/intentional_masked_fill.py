"""Self-attention over padded sequences: padded keys are masked with -inf before the softmax,
and every sequence keeps at least one real token, so every row of scores keeps a finite entry."""

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, 1)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(pad[:, None, :], -math.inf)
        h = scores.softmax(-1) @ v
        keep = (~pad).float().unsqueeze(-1)
        return self.out((h * keep).sum(1) / keep.sum(1))


model = Attention()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(6):
    x = torch.randn(4, 10, 16)
    lengths = torch.randint(1, 11, (4,))
    pad = torch.arange(10) >= lengths[:, None]
    y = x[:, 0, :1]
    loss = F.mse_loss(model(x, pad), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
