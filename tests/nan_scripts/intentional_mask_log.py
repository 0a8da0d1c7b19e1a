"""Choosing among a variable number of candidates with AllenNLP's masked_log_softmax: the mask's
log (0 or -inf) is added to the logits, and every row keeps at least one candidate."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


def masked_log_softmax(vector, mask, dim=-1):
    vector = vector + mask.float().log()
    return F.log_softmax(vector, dim=dim)


class Pointer(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.score = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, candidates, mask):
        return masked_log_softmax(self.score(candidates).squeeze(-1), mask)


model = Pointer()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
for step in range(6):
    candidates = torch.randn(4, 6, 8)
    counts = torch.randint(1, 7, (4,))
    mask = torch.arange(6) < counts[:, None]
    target = torch.remainder(torch.randint(0, 6, (4,)), counts)  # always a real candidate
    loss = F.nll_loss(model(candidates, mask), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
