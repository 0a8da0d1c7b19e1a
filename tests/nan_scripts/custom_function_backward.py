"""A spiking network with snnTorch's sigmoid surrogate gradient: the forward spikes are 0/1,
but in backward exp(-k * mem) overflows for a strongly inhibited neuron and inf / inf is NaN."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


class SigmoidSpike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mem, slope):
        ctx.save_for_backward(mem)
        ctx.slope = slope
        return (mem > 0).float()

    @staticmethod
    def backward(ctx, grad_output):
        (mem,) = ctx.saved_tensors
        grad = grad_output * ctx.slope * torch.exp(-ctx.slope * mem) / ((torch.exp(-ctx.slope * mem) + 1) ** 2)  # nanpass-expect: birth
        return grad, None


class SNN(nn.Module):
    def __init__(self, d=16, hidden=32, slope=5.0, steps=5):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, 2)
        self.slope, self.steps = slope, steps

    def forward(self, x):
        mem, counts = torch.zeros(x.shape[0], self.fc1.out_features), 0
        for _ in range(self.steps):
            mem = 0.9 * mem + self.fc1(x)
            spk = SigmoidSpike.apply(mem - 1.0, self.slope)
            mem = mem - spk
            counts = counts + spk
        return self.fc2(counts / self.steps)


model = SNN()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
for step in range(6):
    x = torch.rand(8, 16)
    if step == 3:
        x = x * 20  # raw pixel intensities instead of [0, 1]
    y = torch.randint(0, 2, (8,))
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
