"""Data-parallel training on two CPU ranks (gloo), run with
`torchrun --nproc-per-node 2 ddp_inner_nan.py OUT`: a feature that is a square root of the
input, and one rank's batch at step 3 holds a negative value. The NaN is born inside the
wrapped model on that rank alone, so a check that ran the DDP forward again there (its buffer
broadcast is a collective) would hang; nanpass runs the wrapped module again instead."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Features(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.BatchNorm1d(8)  # a buffer: DDP's forward broadcasts it from rank 0
        self.lin = nn.Linear(8, 2)

    def forward(self, x):
        return self.lin(self.norm(torch.sqrt(x)))  # nanpass-expect: birth


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(Features())
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
torch.manual_seed(1 + rank)
for step in range(5):
    x, y = torch.rand(16, 8), torch.randn(16, 2)
    if step == 3 and rank == 1:
        x[0, 0] = -1.0  # one bad value in one rank's batch
    loss = (model(x) - y).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}")

if rank == 0:
    torch.save(model.module.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
dist.barrier()
dist.destroy_process_group()
