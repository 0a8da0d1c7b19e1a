"""float16 autocast with a GradScaler, as users train: `python amp_scaler.py CASE [OUT]`.

overflow: the gradient reaching the float16 output is 4 x the scale: inf in float16 at the
scales 65536 down to 16384 (and the bias's sum of 4 rows at 8192 and 4096), so the scaler
skips five steps and backs off to 2048, where every gradient is finite. That is its design.
nan_grad: xlogy(h, h) at h = 0 has a 0/0 gradient (h / h): a NaN the scale did not cause.
collapse: sqrt(|w|) at w = 0 has an infinite gradient at any scale: the scaler skips every
step and its scale falls below 1. forward_nan: 0/0 in the forward."""

import sys

import torch
from torch import nn

torch.manual_seed(0)
case = sys.argv[1]
model = nn.Linear(4, 4)
w = torch.zeros(4, requires_grad=True)
opt = torch.optim.SGD([*model.parameters(), w], lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=4.0 if case == "collapse" else 65536.0)
x = torch.full((4, 4), 2.0 ** -10)
for step in range(6):
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = (out.float() * 4).sum()
    if case == "nan_grad" and step == 5:
        h = out.float() * 0
        loss = loss + torch.xlogy(h, h).sum()  # nanpass-expect: backward
    if case == "collapse":
        loss = out.float().sum() * 0 + w.abs().sqrt().sum()  # nanpass-expect: backward
    if case == "forward_nan" and step == 5:
        loss = loss * (x.sum() * 0 / (x.sum() * 0))  # nanpass-expect: nan
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    print("step", step, "scale", scaler.get_scale(), flush=True)
torch.save(model.state_dict(), sys.argv[2] if len(sys.argv) > 2 else "/dev/null")
