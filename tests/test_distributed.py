"""StepGuard under DDP on CPU (gloo, two processes): one rank's poisoned batch makes every
rank skip, the weights stay bit-identical, and nothing deadlocks."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import nanpass
from tests.helpers import run_two_ranks

pytestmark = pytest.mark.slow  # the slow tier: two spawned gloo processes per test


def _worker(rank: int, world: int, port: int, out_dir: str, mode: str):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        if mode == "ddp":
            ddp = nn.parallel.DistributedDataParallel(nanpass.harden(model))
        elif mode == "compiled":  # DDP's graph splitting with the nanpass backend
            ddp = torch.compile(nn.parallel.DistributedDataParallel(model),
                                backend=nanpass.backend(inner="aot_eager"))
        else:  # FSDP2: the gradients are DTensor shards
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            ddp = model
        guard = nanpass.StepGuard(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
        g = torch.Generator().manual_seed(100 + rank)
        taken = []
        for step in range(6):
            x = torch.randn(8, 4, generator=g)
            if step == 3 and rank == 1:
                x[0, 0] = float("nan")  # only rank 1 sees the bad batch
            guard.optimizer.zero_grad()
            ddp(x).pow(2).mean().backward()
            taken.append(guard.step())
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
        torch.save({"taken": taken, "state": state}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # both ranks are done communicating before either tears down
    finally:
        dist.destroy_process_group()
    # gloo's background threads can abort at interpreter teardown under load ("terminate
    # called without an active exception", exit -6) after the work is saved: leave directly
    os._exit(0)


def _run(tmp_path, mode: str):
    run_two_ranks(_worker, tmp_path, mode)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert results[0]["taken"] == results[1]["taken"] == [True, True, True, False, True, True]
    for k, v in results[0]["state"].items():
        assert torch.equal(v, results[1]["state"][k]), k  # bit-identical across ranks
        assert torch.isfinite(v).all()


def test_ddp_every_rank_skips_together(tmp_path):
    _run(tmp_path, "ddp")


def test_ddp_with_the_nanpass_backend(tmp_path):
    _run(tmp_path, "compiled")


def test_fsdp2_every_rank_skips_together(tmp_path):
    _run(tmp_path, "fsdp2")
