"""Data-parallel regression on two CPU ranks (gloo), run with
`torchrun --nproc-per-node 2 ddp_two_ranks.py OUT`: the loss averages over the weighted samples,
and a batch whose every sample has weight 0 divides 0 by 0."""

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def weighted_mse(pred, target, weight):
    return (weight * (pred - target).pow(2).sum(-1)).sum() / weight.sum()  # nanpass-expect: birth


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
torch.manual_seed(1 + rank)
for step in range(5):
    x, y = torch.randn(16, 8), torch.randn(16, 2)
    weight = (torch.rand(16) > 0.3).float()
    if step == 2:
        weight.zero_()  # every sample of this batch was filtered out
    loss = weighted_mse(model(x), y, weight)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}")

if rank == 0:
    torch.save(model.module.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
dist.barrier()
dist.destroy_process_group()
