"""A VAE whose variance collapses: KL = 0.5 * (var + mu^2 - 1 - log(var)) with var from a ReLU.

When a variance unit dies (ReLU gives 0), log(var) is -inf and the KL term, and every gradient
behind it, turns NaN. nanpass clamps the log's operand into [tiny, max]: finite, and unchanged
wherever var was already positive.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from _common import quick_flag, state

import nanpass


class VAE(nn.Module):
    def __init__(self, d: int = 16, z: int = 4):
        super().__init__()
        self.enc = nn.Linear(d, 2 * z)
        self.dec = nn.Linear(z, d)

    def forward(self, x):
        mu, raw = self.enc(x).chunk(2, dim=-1)
        var = torch.relu(raw)  # a dead unit gives exactly 0
        zs = mu + torch.sqrt(var) * torch.randn_like(mu)
        recon = ((self.dec(zs) - x) ** 2).mean()
        kl = 0.5 * (var + mu**2 - 1 - torch.log(var)).sum(-1).mean()
        return recon + kl


def run(model, params, steps):
    opt = torch.optim.SGD(params, lr=0.01)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        opt.zero_grad()
        loss = model(x)
        loss.backward()
        opt.step()
    return loss


def main():
    steps = 5 if quick_flag(__doc__) else 200
    torch.manual_seed(0)
    plain = VAE()
    with torch.no_grad():
        plain.enc.bias[4:] = -5.0  # variance units start dead
    twin = copy.deepcopy(plain)
    print(f"before: loss {run(plain, plain.parameters(), steps).item():.4g}, "
          f"weights {state(*plain.parameters())}")
    safe = nanpass.harden(twin)
    print(f"after:  loss {run(safe, twin.parameters(), steps).item():.4g}, "
          f"weights {state(*twin.parameters())}")
    print(safe.summary())


if __name__ == "__main__":
    main()
