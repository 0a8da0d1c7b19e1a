"""A classifier that returns log(softmax(...)) and a hand-written cross-entropy: on a confident
batch a probability underflows to exactly 0, its log is -inf, and 0 * -inf is NaN."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class Classifier(nn.Module):
    def __init__(self, d=16, classes=5):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, classes))

    def forward(self, x):
        return torch.log(self.net(x).softmax(-1))  # nanpass-expect: inf


model = Classifier()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(6):
    x = torch.randn(8, 16)
    if step == 3:
        x = x * 300  # an unnormalized batch: logits hundreds apart
    y = F.one_hot(torch.randint(0, 5, (8,)), 5).float()
    loss = -(y * model(x)).sum(-1).mean()  # nanpass-expect: nan
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
