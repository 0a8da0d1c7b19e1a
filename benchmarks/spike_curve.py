"""The loss curve of a tiny GPT-2 with one spiking batch, with and without nanpass.SpikeGuard,
written as an SVG (no matplotlib needed) for docs/training.md.

    python benchmarks/spike_curve.py [--out docs/img/spike_loss.svg] [--steps 160] [--spike 95]

Batch ``--spike`` has its loss scaled by 1e3 (finite everywhere). The curve is the unscaled
training loss of every batch the loop saw, smoothed over 5 steps; the guarded run's rewound
steps are drawn where they happened.
"""

from __future__ import annotations

import argparse
import json

import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

import nanpass


def run(steps: int, spike: int, guarded: bool) -> tuple[list[float], list[dict]]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=512, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    # a learnable stream: 32 fixed random sequences, cycled (the model memorises them)
    tokens = torch.randint(0, 512, (32, 32), generator=g).repeat(steps * 4 // 32 + 1, 1)[:steps * 4]
    weight = torch.ones(steps * 4)
    weight[spike * 4:(spike + 1) * 4] = 1e3
    ds = TensorDataset(torch.arange(steps * 4), tokens, weight)
    order = BatchSampler(SequentialSampler(ds), 4, False)
    guard = None
    if guarded:
        guard = nanpass.SpikeGuard(opt, model, every=10, keep=2, window=16)
        order = nanpass.SkipSampler(order, guard)
    losses = []
    torch.manual_seed(1)
    for idx, ids, w in DataLoader(ds, batch_sampler=order):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        (loss * w.mean()).backward()
        losses.append(float(loss.detach()))
        if guard is None:
            opt.step()
        else:
            guard.step(loss=loss * w.mean(), batch=idx)
    return losses, (guard.events if guard else [])


def smooth(xs: list[float], k: int = 5) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def svg(curves: dict[str, tuple[list[float], str]], spike: int, title: str) -> str:
    w, h, left, right, top, bottom = 640, 300, 56, 16, 28, 40
    n = max(len(c) for c, _ in curves.values())
    ymax = max(max(c) for c, _ in curves.values()) * 1.05
    ymin = 0.0

    def x(i):
        return left + (w - left - right) * i / max(n - 1, 1)

    def y(v):
        return top + (h - top - bottom) * (1 - (v - ymin) / (ymax - ymin))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" '
           'font-family="sans-serif" font-size="11">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{w / 2}" y="16" text-anchor="middle" font-size="12">{title}</text>',
           f'<line x1="{left}" y1="{y(ymin)}" x2="{w - right}" y2="{y(ymin)}" stroke="black"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{y(ymin)}" stroke="black"/>']
    for k in range(6):
        v = ymin + (ymax - ymin) * k / 5
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>')
        out.append(f'<line x1="{left}" y1="{y(v):.1f}" x2="{w - right}" y2="{y(v):.1f}" stroke="#ddd"/>')
    for k in range(0, n, 20):
        out.append(f'<text x="{x(k):.1f}" y="{h - bottom + 14}" text-anchor="middle">{k}</text>')
    out.append(f'<text x="{w / 2}" y="{h - 8}" text-anchor="middle">step (batches seen)</text>')
    out.append(f'<text x="14" y="{h / 2}" text-anchor="middle" transform="rotate(-90 14 {h / 2})">'
               'training loss (5-step mean)</text>')
    out.append(f'<line x1="{x(spike):.1f}" y1="{top}" x2="{x(spike):.1f}" y2="{y(ymin)}" stroke="#999" '
               'stroke-dasharray="4 3"/>')
    out.append(f'<text x="{x(spike) + 4:.1f}" y="{top + 10}" fill="#666">spiking batch (loss x1e3)</text>')
    for i, (label, (c, color)) in enumerate(curves.items()):
        pts = " ".join(f"{x(j):.1f},{y(v):.1f}" for j, v in enumerate(c))
        out.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{pts}"/>')
        ly = top + 28 + 16 * i
        out.append(f'<line x1="{w - 230}" y1="{ly}" x2="{w - 210}" y2="{ly}" stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{w - 205}" y="{ly + 4}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/img/spike_loss.svg")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--spike", type=int, default=95)
    args = ap.parse_args()
    plain, _ = run(args.steps, args.spike, guarded=False)
    guarded, events = run(args.steps, args.spike, guarded=True)
    print(json.dumps({"plain_last10": sum(plain[-10:]) / 10, "guarded_last10": sum(guarded[-10:]) / 10,
                      "plain_spike_loss": plain[args.spike], "events": events}, default=str, indent=1))
    text = svg({"plain AdamW": (smooth(plain), "#d62728"),
                "nanpass.SpikeGuard": (smooth(guarded), "#1f77b4")}, args.spike,
               "tiny GPT-2, one batch's loss scaled by 1e3")
    with open(args.out, "w") as f:
        f.write(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
