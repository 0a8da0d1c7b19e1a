"""Models for the report's golden files: their source lines appear in the reports, so edit
with care and regenerate with NANPASS_UPDATE_GOLDEN=1."""

from __future__ import annotations

import torch
import torch.nn as nn


class Broken(nn.Module):
    """Two graphs under dynamo: a graph break between a log and a log_softmax."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.LogSoftmax(dim=-1)

    def forward(self, x):
        h = torch.log(self.fc(x)) / 2.0
        h = h / x.sum()
        torch._dynamo.graph_break()
        return self.norm(h) + torch.sqrt(h.abs())


class Odd(nn.Module):
    """A module whose name is an HTML script tag: the HTML report must show it as text."""

    def __init__(self):
        super().__init__()
        self.add_module("<script>alert(1)</script>", nn.Softmax(dim=-1))

    def forward(self, x):
        return getattr(self, "<script>alert(1)</script>")(x) / x.sum()


class Branchy(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it, dynamo captures it."""

    def forward(self, x):
        if x.sum() > 0:
            return torch.log(x)
        return torch.sqrt(x)


class Block(nn.Module):
    """One layer of ``Stack``: a softmax and a division, the same source lines in every layer."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x):
        h = self.softmax(self.proj(x))
        return h / h.sum(-1, keepdim=True)


class Stack(nn.Module):
    """``layers`` repeated blocks and a log at the root: the grouped report has three rows."""

    def __init__(self, layers: int = 32, d: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return torch.log(x)
