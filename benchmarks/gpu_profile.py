"""Where a hardened GPT-2 step spends its extra GPU time and memory, under autocast (one short
run on a lent GPU): the kernels by CUDA time, plain and hardened, and the peak after forward.

    PYTHONPATH=. python benchmarks/gpu_profile.py
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import nanpass
from benchmarks.gpu_check import DEV, _step, gpt2


def main():
    model = gpt2()
    safe = nanpass.harden(model)
    ids = torch.randint(0, 50257, (8, 512), device=DEV)
    for dtype in (torch.bfloat16, torch.float16):
        for label, m in (("plain", model), ("nanpass", safe)):
            step = _step(m, ids, dtype)
            step()
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            with torch.autocast(DEV, dtype=dtype):
                loss = m(input_ids=ids, labels=ids).loss
            fwd_peak = torch.cuda.max_memory_allocated() / 2**20
            loss.backward()
            torch.cuda.synchronize()
            print(f"== {dtype} {label}: peak after forward {fwd_peak:.0f} MiB, after backward "
                  f"{torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", flush=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="self_cuda_time_total", row_limit=int(sys.argv[1]) if len(sys.argv) > 1 else 22,
                                         max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
