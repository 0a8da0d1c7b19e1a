"""float16: an eps that is 0. `x / (x.norm() + 1e-8)` is the textbook guard, but 1e-8 rounds
to 0 in float16, so a zero vector still divides by zero; `clamp(p, 1e-8, 1 - 1e-8)` fails the
same way. nanpass's constants come from torch.finfo of the operand's own dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from _common import before_after, quick_flag


class Normalise(nn.Module):
    def forward(self, x, p):
        unit = x / (x.norm(dim=-1, keepdim=True) + 1e-8)
        q = torch.clamp(p, 1e-8, 1 - 1e-8)
        return unit.sum() - torch.log(q).sum()


def main():
    quick_flag(__doc__)
    print(f"1e-8 in float16 is {torch.tensor(1e-8, dtype=torch.float16).item()}")
    x = torch.zeros(2, 4, dtype=torch.float16, requires_grad=True)
    p = torch.tensor([0.0, 0.5], dtype=torch.float16, requires_grad=True)
    before_after(Normalise(), x, p)


if __name__ == "__main__":
    main()
