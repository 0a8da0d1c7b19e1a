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
