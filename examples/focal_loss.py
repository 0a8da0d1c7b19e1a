"""A focal loss written from the paper, -(1 - p)^gamma * log(p), with gamma < 1: at a
confident prediction (p == 1) the gradient of (1 - p)^gamma is infinite, and at p == 0 the log
is -inf. Both give NaN gradients.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from _common import quick_flag, state

import nanpass


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
    target = torch.tensor([0, 1, 0])
    loss = Focal()(logits, target)
    loss.backward()
    print(f"before: loss {loss.item():.4g}, grad {state(logits.grad)}")
    logits.grad = None
    safe = nanpass.harden(Focal())
    loss = safe(logits, target)
    loss.backward()
    print(f"after:  loss {loss.item():.4g}, grad {state(logits.grad)}")
    print(safe.summary())


if __name__ == "__main__":
    main()
