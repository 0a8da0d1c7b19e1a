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
