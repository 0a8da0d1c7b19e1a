"""A small model with the usual NaN sources, for the report and the command line:

    nanpass report examples/report_demo.py:Model --input-shape 4,8 --format html -o report.html
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Attention(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.qk = nn.Linear(d, 2 * d)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        q, k = self.qk(x).chunk(2, dim=-1)
        scores = q @ k.transpose(0, 1) / x.shape[-1] ** 0.5
        return self.softmax(scores) @ x


class Model(nn.Module):
    def __init__(self, d: int = 8, classes: int = 3):
        super().__init__()
        self.attn = Attention(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        h = self.attn(x)
        spread = torch.sqrt(((h - h.mean(0)) ** 2).mean(0))
        h = (h - h.mean(0)) / spread
        logits = self.head(h)
        return torch.log(torch.softmax(logits, dim=-1))


def build():
    torch.manual_seed(0)
    return Model()
