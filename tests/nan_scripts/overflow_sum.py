"""A float16 bag-of-features model: sum pooling over a long, loud sequence overflows float16."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class SumPool(nn.Module):
    def __init__(self, d=8, hidden=16):
        super().__init__()
        self.embed = nn.Linear(d, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x):
        h = torch.relu(self.embed(x))
        pooled = h.sum(dim=1)  # nanpass-expect: birth
        return self.head(pooled / 100)


model = SumPool().half()
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(6):
    x = torch.randn(16, 256, 8)
    if step == 3:
        x = x * 1000  # raw sensor counts: someone forgot to rescale this batch
    y = x.mean(dim=(1, 2)).unsqueeze(-1)
    loss = F.mse_loss(model(x.half()).float(), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
