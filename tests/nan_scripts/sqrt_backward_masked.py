"""A siamese embedding net with a contrastive loss on the Euclidean distance: when a pair holds
the same sample twice the distance is exactly 0, finite, but the backward of its sqrt is not."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)

model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(6):
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    same = torch.randint(0, 2, (8,)).float()
    if step == 3:
        b[0], same[0] = a[0], 0.0  # the sampler drew one image twice, as a negative pair
    d = (model(a) - model(b)).pow(2).sum(-1).sqrt()  # nanpass-expect: birth
    loss = (same * d**2 + (1 - same) * F.relu(1.0 - d) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
