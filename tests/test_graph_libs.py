"""torch_geometric's own graph convolutions (issue 28 items 1 and 2), small random graphs:
``gcn_norm``'s ``deg.pow(-0.5)`` keeps the original's forward wherever it is finite, and a
negative degree (torch_geometric#795) gives 0, so ``d[row] * w * d[col]`` stays finite."""

from __future__ import annotations

import pytest
import torch
from torch_geometric.nn import ChebConv, GCNConv

import nanpass
from tests.helpers import all_finite

EDGES = torch.tensor([[0, 1, 1, 2, 3, 4], [1, 0, 2, 1, 4, 3]])


def _run(model, *args):
    out = model(*args)
    params = [p for p in model.parameters()]
    grads = torch.autograd.grad(out.sum(), params, allow_unused=True)
    return out, grads


@pytest.mark.parametrize("conv", [lambda: GCNConv(4, 3), lambda: ChebConv(4, 3, K=2)], ids=["GCNConv", "ChebConv"])
def test_negative_edge_weights_stay_finite(conv):
    """pyg-team/pytorch_geometric#795, as written: negative edge weights make a negative degree,
    whose ``pow(-0.5)`` is NaN; hardened, the output and gradients are finite."""
    torch.manual_seed(0)
    m, x = conv(), torch.randn(5, 4)
    w = torch.tensor([1.0, -2.0, 0.5, 0.5, -1.0, 1.0])
    out, _ = _run(m, x, EDGES, w)
    assert not all_finite([out])
    out, grads = _run(nanpass.harden(m), x, EDGES, w)
    assert all_finite([out, *[g for g in grads if g is not None]])


def test_gaussian_kernel_weights_keep_the_originals_forward():
    """Edge weights from a Gaussian kernel, exp(-d ** 2), of far-apart nodes: a degree of 1e-28,
    whose ``pow(-0.5)`` (1e14) is finite while its derivative overflows. The forward is the
    original's bit for bit (the derivative is fenced); on main it was 2.1e37 / 16."""
    torch.manual_seed(0)
    m, x = ChebConv(4, 3, K=2), torch.randn(5, 4)
    d = torch.tensor([1.0, 1.0, 8.0, 8.0, 0.5, 0.5])
    w = torch.exp(-d ** 2)
    ref = m(x, EDGES, w)
    assert all_finite([ref])
    for capture in ("harden", "no_grad"):
        if capture == "no_grad":
            with torch.no_grad():
                out = nanpass.harden(m)(x, EDGES, w)
        else:
            out, grads = _run(nanpass.harden(m), x, EDGES, w)
            assert all_finite([g for g in grads if g is not None])
        assert torch.equal(out, ref), capture


class _Forces(torch.nn.Module):
    """An e3nn interatomic potential's edge features, as force-matching models write them:
    the radial basis from ``vec.norm()``, the angular part from e3nn's spherical harmonics
    (``normalize=True`` runs ``F.normalize(vec)``), and a vector message ``w * vec`` (PaiNN),
    all of the same edge vectors."""

    def __init__(self):
        super().__init__()
        from e3nn import o3

        self.sh = o3.SphericalHarmonics([1, 2], normalize=True, normalization="component")
        self.radial = torch.nn.Linear(8, 8)

    def forward(self, pos, src, dst):
        vec = pos[dst] - pos[src]
        r = vec.norm(dim=-1, keepdim=True)
        basis = torch.sin(r * torch.arange(1, 9.0)) / r
        w = self.radial(basis)
        return (w * self.sh(vec)).sum() + (w[:, :3] * vec).sum()


def test_e3nn_forces_keep_the_originals_gradient_bits():
    """Issue 28 item 3: ``vec`` fans out into ``F.normalize`` (a norm and a division inside)
    and ``vec.norm()``; one fence before the whole ``normalize`` made autograd add its two
    contributions first, and the forces differed from the original's in the last bit. Forces
    (-dE/dpos) and the parameters' gradients of a loss on them (create_graph) are the original's
    bit for bit."""
    torch.manual_seed(0)
    model = _Forces()
    src = torch.tensor([0, 1, 2, 3, 4, 5, 0, 2, 1, 4])
    dst = torch.tensor([1, 2, 3, 4, 5, 0, 3, 5, 4, 0])

    def run(m, pos):
        m.zero_grad()
        pos = pos.clone().requires_grad_()
        energy = m(pos, src, dst)
        forces, = torch.autograd.grad(energy, pos, create_graph=True)
        (forces ** 2).sum().backward()
        return [energy.detach(), forces.detach(), *[p.grad.clone() for p in m.parameters()]]

    hardened = nanpass.harden(model)
    for seed in range(8):
        pos = torch.randn(6, 3, generator=torch.Generator().manual_seed(seed))
        want, got = run(model, pos), run(hardened, pos)
        for w, g in zip(want, got, strict=True):
            assert torch.equal(w, g), f"seed {seed}: {(w - g).abs().max()}"
