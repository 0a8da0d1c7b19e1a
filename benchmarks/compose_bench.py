"""The composable paths side by side in one process (issue 18): GPT-2 (4 layers, 128 wide,
batch 4x64) train step under inductor alone, ``torch.compile(nanpass.harden(model))`` and
``backend="nanpass"``; eager GPT-2 and the small MLP, hardened vs plain; saved-for-backward.
Interleaved medians: ``python benchmarks/compose_bench.py [--repeats N]``."""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import run  # noqa: E402

import nanpass  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = run.gpt2(4)
    ids = torch.randint(0, 1024, (4, 64))
    batch = {"input_ids": ids, "labels": ids}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    ind = torch.compile(model, backend="inductor")
    hard = torch.compile(nanpass.harden(model), backend="inductor")
    npb = torch.compile(model, backend=nanpass.backend())
    fns = {k: run.train_step(m, batch) for k, m in (("inductor", ind), ("compile(harden)", hard),
                                                    ("backend=nanpass", npb))}
    t = run.interleaved(fns, args.repeats)
    for k, v in t.items():
        print(f"gpt2-4L train step  {k:16} {v * 1e3:8.2f} ms  {t.ratio(k, 'inductor'):.3f}x inductor")
    for name, (m, b) in (("gpt2-4L", (model, batch)), ("mlp", run.MODELS["mlp"]())):
        safe = nanpass.harden(m)
        t = run.interleaved({"plain": run.train_step(m, b), "harden": run.train_step(safe, b)}, args.repeats)
        saved = run.saved_numel(run.train_step(safe, b)) / run.saved_numel(run.train_step(m, b))
        print(f"{name:8} eager train step plain {t['plain'] * 1e3:8.2f} ms  harden {t['harden'] * 1e3:8.2f} ms"
              f"  {t.ratio('harden', 'plain'):.3f}x; saved for backward {saved:.3f}x")


if __name__ == "__main__":
    main()
