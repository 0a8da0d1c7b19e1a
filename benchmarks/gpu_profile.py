"""Where a hardened GPT-2 step spends its extra GPU time and memory, under autocast (one short
run on a lent GPU): the kernels by CUDA time, plain and hardened, and the peak after forward.

    PYTHONPATH=. python benchmarks/gpu_profile.py [ROWS] [--compiled]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import nanpass
from benchmarks.gpu_check import DEV, _step, gpt2


def main():
    model = gpt2()
    ids = torch.randint(0, 50257, (8, 512), device=DEV)
    compiled = "--compiled" in sys.argv
    if compiled:  # inductor against compile(harden), bfloat16 autocast
        pairs = (("inductor", torch.compile(model)), ("compile(harden)", torch.compile(nanpass.harden(model))))
        dtypes = (torch.bfloat16,)
    else:
        pairs, dtypes = (("plain", model), ("nanpass", nanpass.harden(model))), (torch.bfloat16, torch.float16)
    rows = int(next((a for a in sys.argv[1:] if a.isdigit()), 22))
    for dtype in dtypes:
        for label, m in pairs:
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
            for key in ("self_cuda_time_total", "self_cpu_time_total"):
                print(p.key_averages().table(sort_by=key, row_limit=rows, max_name_column_width=60), flush=True)


if __name__ == "__main__":
    main()
