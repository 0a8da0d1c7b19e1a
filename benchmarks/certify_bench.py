"""Certify and search time: GPT-2 from random configs of growing depth and a 4-layer
TransformerEncoder; time per analysed aten op, to show it grows linearly with model size. Then
the counts docs/certify.md gives: random models of tests/test_certify_attack.py proven (the
original and nanpass.harden of it), and the 49 frozen real-bug cases proven hardened.

    python benchmarks/certify_bench.py            # all
    python benchmarks/certify_bench.py counts     # the counts only
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


def counts(n_models: int = 200, seed: int = 0):
    import random
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    from tests.test_certify_attack import CENTERS, DTYPES, OPS, SHAPE, WIDTHS, Program
    from tests.test_certify_corpus import CORPUS49, proven_hardened

    rng = random.Random(seed)
    proven = hardened = 0
    for _ in range(n_models):
        dtype = rng.choice(DTYPES)
        steps = [(rng.choice(OPS), rng.randrange(10), rng.randrange(10)) for _ in range(rng.randint(2, 8))]
        ranges = []
        for _ in range(rng.randint(1, 2)):
            c, w = rng.choice(CENTERS), rng.choice(WIDTHS)
            w = 0.0 if w == "point" else 1e-6 if w == "ulp" else w
            lo, hi = c - w, c + w
            if dtype != torch.float32:
                mx = float(torch.finfo(dtype).max) / 2
                lo, hi = min(max(lo, -mx), mx), max(min(hi, mx), -mx)
            ranges.append((lo, hi))
        model = Program(steps).to(dtype)
        xs = tuple(torch.zeros(SHAPE, dtype=dtype).clamp(lo, hi) for lo, hi in ranges)
        proven += nanpass.certify(model, *xs, ranges=ranges).proven
        hardened += nanpass.certify(nanpass.harden(model), *xs, ranges=ranges).proven
    print(f"random models (depth 2-8, float32/float16/bfloat16): original proven {proven} / {n_models}, "
          f"nanpass.harden proven {hardened} / {n_models}")
    n49 = sum(proven_hardened(b) for b in CORPUS49)
    print(f"real-bug corpus, the 49 frozen cases: nanpass.harden proven {n49} / 49")


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["counts"]:
        main()
    counts()
