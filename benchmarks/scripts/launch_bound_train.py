"""A plain training script, as a user writes one: the launch-bound model of benchmarks/run.py
(Hugging Face GPT-2 from a random config, 12 layers, 32 wide, batch 1 x 8 with labels), AdamW,
forward / loss / backward / step. It knows nothing of nanpass: `benchmarks/run.py
--run-script-only` runs it as `python launch_bound_train.py`, `python -m nanpass run
launch_bound_train.py` and (where the CLI has it) `python -m nanpass run --every-op
launch_bound_train.py`, with OMP_NUM_THREADS=1.

It times its own steps inside the loop, after warm-up steps, so the interpreter's start-up, the
imports and the model's construction do not count, and prints one line:
``step_ms <median> <json list of each timed step in ms>``.

    OMP_NUM_THREADS=1 python benchmarks/scripts/launch_bound_train.py --steps 100 --warmup 10
"""

import argparse
import json
import statistics
import time

import torch
import transformers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100, help="timed steps")
    ap.add_argument("--warmup", type=int, default=10, help="steps run before timing")
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=12, n_head=4, n_embd=32, vocab_size=1024, n_positions=128,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.Generator().manual_seed(1)

    times = []
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, cfg.vocab_size, (1, 8), generator=data)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        if step >= args.warmup:
            times.append((time.perf_counter() - t) * 1e3)
    print(f"step_ms {statistics.median(times):.4f} {json.dumps([round(x, 4) for x in times])}")
    print(f"final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
