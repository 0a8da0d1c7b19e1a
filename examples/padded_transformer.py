"""A transformer over padded batches: a sequence that is all padding has attention rows with
no key to attend to, and nn.MultiheadAttention (need_weights=True) or a hand-written
masked softmax return NaN for them — in the forward pass and in every gradient.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from _common import quick_flag, state

import nanpass


class Classifier(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
        self.head = nn.Linear(d, 2)

    def forward(self, x, pad):
        h, weights = self.attn(x, x, x, key_padding_mask=pad, need_weights=True)
        return self.head(h.mean(1)), weights


def main():
    quick_flag(__doc__)
    torch.manual_seed(0)
    model = Classifier()
    x = torch.randn(4, 6, 32, requires_grad=True)
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[1] = True  # one sequence is entirely padding
    pad[2, 3:] = True
    logits, _ = model(x, pad)
    logits.sum().backward()
    print(f"before: logits {state(logits)}, input grad {state(x.grad)}")
    x.grad = None
    safe = nanpass.harden(model)
    logits_s, _ = safe(x, pad)
    logits_s.sum().backward()
    print(f"after:  logits {state(logits_s)}, input grad {state(x.grad)}")
    same = torch.equal(logits_s[[0, 2, 3]], logits[[0, 2, 3]])
    print(f"sequences with a real token unchanged, bit for bit: {same}")
    print(safe.summary())


if __name__ == "__main__":
    main()
