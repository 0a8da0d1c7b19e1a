"""nanpass benchmarks: overhead of the guards against the unguarded model, measured in one
process, interleaved, after warm-up, median of repeats. Prints a table and writes JSON.

    python benchmarks/run.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
import torch.nn as nn

import nanpass


def gpt2(n_layer: int, n_embd: int = 128):
    import transformers

    cfg = transformers.GPT2Config(n_layer=n_layer, n_head=4, n_embd=n_embd, vocab_size=1024,
                                  n_positions=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def encoder(n_layer: int = 4, d: int = 128):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)


def interleaved(fns: dict, repeats: int, warmup: int = 2) -> dict:
    """Median seconds per call of each fn, run round-robin so drift hits all alike."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def train_step(model, batch):
    def step():
        model.zero_grad(set_to_none=True)
        out = model(**batch) if isinstance(batch, dict) else model(batch)
        loss = out.loss if hasattr(out, "loss") else out.float().pow(2).mean()
        loss.backward()

    return step


def forward_only(model, batch):
    def fwd():
        with torch.no_grad():
            model(**batch) if isinstance(batch, dict) else model(batch)

    return fwd


def bench_eager(name, model, batch, repeats):
    safe = nanpass.harden(model)
    guards_only = nanpass.harden(model, stable=False)
    res = {}
    for kind, make in (("forward", forward_only), ("train step", train_step)):
        t = interleaved({"plain": make(model, batch), "nanpass": make(safe, batch),
                         "guards": make(guards_only, batch)}, repeats)
        res[kind] = {"plain_ms": t["plain"] * 1e3, "nanpass_ms": t["nanpass"] * 1e3,
                     "ratio": t["nanpass"] / t["plain"], "guards_only_ratio": t["guards"] / t["plain"]}
    res["guarded_ops"] = sum(c.action == "guarded" for c in safe.changes)
    return res


def bench_check_mode(model, batch, repeats):
    """Check mode against torch.autograd.detect_anomaly, same model, same run."""
    checked = nanpass.harden(model, mode="check")
    plain = train_step(model, batch)

    def anomaly():
        with torch.autograd.detect_anomaly(check_nan=True):
            plain()

    t = interleaved({"plain": plain, "check": train_step(checked, batch), "anomaly": anomaly}, repeats)
    return {"plain_ms": t["plain"] * 1e3, "check_ratio": t["check"] / t["plain"],
            "detect_anomaly_ratio": t["anomaly"] / t["plain"]}


def bench_compiled(model, batch, repeats, shapes=False):
    torch._dynamo.reset()
    t0 = time.perf_counter()
    ind = torch.compile(model, backend="inductor")
    train_step(ind, batch)()
    t_ind = time.perf_counter() - t0
    t0 = time.perf_counter()
    npb = torch.compile(model, backend=nanpass.backend())
    train_step(npb, batch)()
    t_np = time.perf_counter() - t0
    fns = {"inductor": train_step(ind, batch), "nanpass": train_step(npb, batch)}
    if shapes:  # shape asserts: checked when a graph compiles, so nothing per call
        sh = torch.compile(model, backend=nanpass.backend(shape_checks=True))
        train_step(sh, batch)()
        fns["shapes"] = train_step(sh, batch)
    t = interleaved(fns, repeats)
    out = {"inductor_ms": t["inductor"] * 1e3, "nanpass_ms": t["nanpass"] * 1e3,
           "ratio": t["nanpass"] / t["inductor"], "compile_s_inductor": t_ind,
           "compile_s_nanpass": t_np, "compile_ratio": t_np / t_ind}
    if shapes:
        out["shape_checks_ratio"] = t["shapes"] / t["inductor"]
    return out


def bench_pass_time(layers):
    rows = []
    for n in layers:
        m = gpt2(n)
        batch = {"input_ids": torch.randint(0, 1024, (1, 16))}
        safe = nanpass.harden(m)
        t = time.perf_counter()
        with torch.no_grad():
            safe(**batch)  # dynamo captures and nanpass rewrites on the first call
        first = time.perf_counter() - t
        torch._dynamo.reset()
        rows.append({"layers": n, "capture_and_rewrite_s": first})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no inductor compile")
    ap.add_argument("--json", default="benchmarks/results/latest.json")
    args = ap.parse_args()
    repeats = 5 if args.quick else 15
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = {"machine": f"{platform.machine()} {platform.processor() or ''} "
                          f"{torch.get_num_threads()} threads, torch {torch.__version__}".strip()}
    ids = torch.randint(0, 1024, (4, 64))
    models = {
        "gpt2-12L": (gpt2(12), {"input_ids": ids, "labels": ids}),
        "transformer-encoder-4L": (encoder(), torch.randn(8, 64, 128)),
    }
    results["eager"] = {name: bench_eager(name, m, b, repeats) for name, (m, b) in models.items()}
    results["check_mode"] = {name: bench_check_mode(m, b, repeats) for name, (m, b) in models.items()}
    if not args.quick:
        results["compiled"] = {name: bench_compiled(m, b, repeats, shapes=name.startswith("transformer"))
                               for name, (m, b) in models.items()}
    results["pass_time"] = bench_pass_time([1, 12] if args.quick else [1, 6, 12, 24, 48])

    print(f"machine: {results['machine']}")
    print(f"{'model':26} {'what':16} {'plain ms':>10} {'nanpass ms':>11} {'ratio':>7}  notes")
    for name, r in results["eager"].items():
        for kind in ("forward", "train step"):
            x = r[kind]
            print(f"{name:26} {'eager ' + kind:16} {x['plain_ms']:10.2f} {x['nanpass_ms']:11.2f} "
                  f"{x['ratio']:7.3f}  guards only (stable=False): {x['guards_only_ratio']:.3f}")
    for name, x in results["check_mode"].items():
        print(f"{name:26} {'check mode':16} {x['plain_ms']:10.2f} {'':11} {x['check_ratio']:7.3f}"
              f"  detect_anomaly: {x['detect_anomaly_ratio']:.3f}")
    for name, x in results.get("compiled", {}).items():
        extra = f", with shape_checks {x['shape_checks_ratio']:.3f}" if "shape_checks_ratio" in x else ""
        print(f"{name:26} {'compiled step':16} {x['inductor_ms']:10.2f} {x['nanpass_ms']:11.2f} {x['ratio']:7.3f}"
              f"  vs inductor{extra}; compile {x['compile_s_inductor']:.1f}s vs {x['compile_s_nanpass']:.1f}s")
    for row in results["pass_time"]:
        print(f"harden + first call, GPT-2 {row['layers']:2d} layers: {row['capture_and_rewrite_s']:.2f} s")
    import os

    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
