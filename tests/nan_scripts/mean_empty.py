"""Monocular depth with a scale-invariant log loss over the valid pixels (ZoeDepth's SILog):
a frame whose depth sensor returned nothing leaves no valid pixel, and the mean of none is NaN."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


def silog_loss(pred, target, valid, lam=0.85):
    g = torch.log(pred[valid]) - torch.log(target[valid])
    return (g**2).mean() - lam * g.mean() ** 2  # nanpass-expect: birth


model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 1, 3, padding=1))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(6):
    image = torch.randn(2, 3, 16, 16)
    depth = torch.rand(2, 1, 16, 16) * 10
    if step == 3:
        depth.zero_()  # the sensor dropped these frames
    valid = depth > 1e-3
    pred = F.softplus(model(image)) + 1e-3
    loss = silog_loss(pred, depth, valid)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
