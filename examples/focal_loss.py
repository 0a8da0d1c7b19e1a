"""A focal loss written from the paper, -(1 - p)^gamma * log(p), with gamma < 1: at a
confident prediction (p == 1) the gradient of (1 - p)^gamma is infinite, and at p == 0 the log
is -inf. Both give NaN gradients.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from _common import before_after, quick_flag


class Focal(nn.Module):
    def __init__(self, gamma: float = 0.5):
        super().__init__()
        self.gamma = gamma

    def forward(self, logits, target):
        p = torch.softmax(logits, -1).gather(1, target[:, None]).squeeze(1)
        return (-(1 - p) ** self.gamma * torch.log(p)).mean()


def main():
    quick_flag(__doc__)
    logits = torch.tensor([[40.0, -40.0], [0.3, -0.2], [-120.0, 120.0]], requires_grad=True)
    before_after(Focal(), logits, torch.tensor([0, 1, 0]))


if __name__ == "__main__":
    main()
