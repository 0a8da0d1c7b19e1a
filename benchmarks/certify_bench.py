"""Certify and search time: GPT-2 from random configs of growing depth and a 4-layer
TransformerEncoder; time per analysed aten op, to show it grows linearly with model size.

    python benchmarks/certify_bench.py
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

import nanpass


def gpt2(n_layer: int):
    import transformers

    cfg = transformers.GPT2Config(n_layer=n_layer, n_head=4, n_embd=128, vocab_size=1024,
                                  n_positions=128, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2Model(cfg).eval()


class Embeds(nn.Module):
    """GPT-2 on its input embeddings, so that the ranges reach every op."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(inputs_embeds=x).last_hidden_state


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main():
    torch.manual_seed(0)
    rows = []
    for n in (1, 3, 6, 12):
        model = Embeds(gpt2(n))
        x = torch.rand(1, 32, 128) * 2 - 1
        cert, s = timed(lambda: nanpass.certify(model, x, ranges=(-1, 1)))  # noqa: B023
        rows.append((f"GPT-2 {n:2d}L, 32 tokens", cert, s))
    layer = nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).eval()
    x = torch.rand(2, 32, 128) * 2 - 1
    cert, s = timed(lambda: nanpass.certify(enc, x, ranges=(-1, 1)))
    rows.append(("TransformerEncoder 4L", cert, s))
    print(f"{'model':26} {'aten ops':>9} {'seconds':>8} {'ms / op':>8}  proven")
    for name, cert, s in rows:
        n_ops = cert.nodes
        print(f"{name:26} {n_ops:9d} {s:8.2f} {s / max(n_ops, 1) * 1e3:8.2f}  {cert.proven}")

    class LogOf(nn.Module):
        def forward(self, x):  # one op per line: a finding is located by its source line
            a = torch.log(x).sum()
            b = torch.sqrt(x - 0.5).sum()
            return a + b

    x = torch.rand(4, 8)
    found, s = timed(lambda: nanpass.search(LogOf(), x, ranges=(0, 1), budget=5.0))
    print(f"search, 2 unsafe ops (log, sqrt) on [0, 1]: {len(found)} findings in {s:.2f} s")


if __name__ == "__main__":
    main()
