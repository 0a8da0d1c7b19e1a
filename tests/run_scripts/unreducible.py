"""Tensors a check cannot reduce and calls that are not the program's arithmetic, each of
which runs under python: inference mode, meta, sparse, jagged nested and float8 tensors,
vmap(grad(f)), torch.jit.trace, and a nested ``nanpass.enable`` (when nanpass is imported)."""

import sys
import torch
from torch import nn

torch.manual_seed(0)
lin = nn.Linear(4, 4)
x = torch.randn(3, 4)
with torch.inference_mode():
    y = lin(x).relu()
z = y * 2                          # an inference tensor read outside inference mode
with torch.device("meta"):
    m = nn.Linear(4, 4)
mz = torch.zeros(2, device="meta") + 1
adj = torch.eye(3).to_sparse()
h = torch.sparse.mm(adj, torch.randn(3, 2))
nt = torch.nested.nested_tensor([torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged)
nt2 = (nt * 2).sin()
f8 = x.to(torch.float8_e4m3fn)
back = f8.to(torch.float32) + 1
from torch.func import grad, vmap
w = torch.randn(4)
per = vmap(grad(lambda w, xi: (w * xi).sum().pow(2)), in_dims=(None, 0))(w, x)
traced = torch.jit.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), x)
traced(x)
loss = lin(x).pow(2).mean()
loss.backward()
if "nanpass" in sys.modules:
    import nanpass
    with nanpass.enable(mode="guard"):
        q = torch.log(torch.zeros(2))
    print("inner guard", bool(torch.isfinite(q).all()))
print("done", tuple(per.shape), tuple(h.shape), back.dtype, z.shape, mz.shape, nt2.is_nested)
