"""Cited real bugs that nanpass does not handle yet: the original fails on the trigger (check 1
of tests/test_real_bugs.py holds) but one of checks 2-4 fails.

Not collected by pytest (no ``test_`` names): the cases wait here, in the harness's own
``Case``/``Fn`` form, until the guards handle them; then a row moves to ``TABLE`` and its case to
``CASES`` in tests/test_real_bugs.py. ``python -m tests.real_bugs_pending`` runs every case through
the same checks (``test_real_bug``) and prints what fails.

Each ``PENDING`` row: id, report (URL), op class, trigger, and what fails (measured on torch 2.13
CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.test_real_bugs import (
    CASES,
    INF,
    Case,
    Fn,
    H,
    _f,
    _giou_loss,
    _lin,
    _one,
    _selective_scan,
    _state_A,
    leaf,
    test_real_bug,
    test_real_bug_backend,
)

# id, report (URL), op class, trigger, what fails
PENDING: list[tuple[str, str, str, str, str]] = [
    ("han_semantic_attention_empty", "https://github.com/pyg-team/pytorch_geometric/issues/4826",
     "graph: mean over an empty dimension", "HANConv group() over zero nodes",
     "[2] and [3]: q's gradient is NaN: torch.tanh(k_lin(out)).mean(1) over the empty node "
     "dimension is NaN (mean of zero elements, unguarded), and the backward of m.q * mean "
     "(MulBackward0) hands q that NaN; the output itself is empty"),
    ("scatter_logsumexp_masked_group", "https://github.com/rusty1s/pytorch_scatter/pull/369",
     "graph: scatter logsumexp", "a group whose every source is -inf (masked)",
     "[2] and [3]: output NaN for the all-masked group: src - max_per_index[index] is (-inf) - "
     "(-inf) (sub of the user's own -inf, outside the guards' finite-operand scope), then exp, "
     "index_add and log carry the NaN"),
    ("mamba_fp16_selective_scan", "https://github.com/state-spaces/mamba/issues/812",
     "SSM: delta * B * u in float16", "a float16 Mamba layer: delta B u past 65504",
     "[2] and [3]: output +inf and the gradients of delta, A_log, B, C non-finite: the float16 "
     "product delta[..., None] * B * u[..., None] = 90000 overflows 65504; elementwise mul of "
     "finite operands is left by the overflow policy (neither harden nor the backend saturates "
     "it)"),
    ("sinkhorn_kernel_underflow", "https://github.com/PythonOT/POT/issues/54",
     "OT: a / (K v), K = exp(-M / reg)", "reg = 0.01: the kernel underflows to 0",
     "[2] and [3]: the weight g's gradient is NaN: K = exp(-M g / reg) underflows to 0 in row "
     "0, the guarded a / (K @ v) returns a saturated u_0, and in the next update K.T @ u the "
     "backward to K (u outer grad) overflows there and meets K = 0 (inf * 0); anomaly mode "
     "names DivBackward0 (of -M g / reg) as the first NaN"),
    ("protenix_flat_bottom_inf_upper", "https://github.com/bytedance/Protenix/issues/336",
     "MD: where(value > upper, k (value - upper)**2, 0)", "an upper bound of +inf (clash-only pair)",
     "[2] and [3]: the value and k gradients are NaN: the user's +inf upper bound makes (value "
     "- upper) ** 2 = inf in the branch torch.where masks; its backward 2 (value - inf) times "
     "the where's 0 is -inf * 0 (issue 19 item 2, 'an infinity the user makes on purpose')"),
    ("giou_fp16_area_overflow", "https://github.com/facebookresearch/fvcore/pull/114",
     "detection fp16: GIoU areas", "float16 boxes 300 wide: the area overflows 65504",
     "[2] and [3]: output and gradients NaN: the float16 areas (x2 - x1) * (y2 - y1) = 90000 "
     "overflow 65504 in elementwise mul (left by the overflow policy, as mamba_fp16_selective_scan), "
     "and the union inf + inf - inf is NaN before the guarded division; a NaN operand stays NaN "
     "through a guard (issue 44 item 2), where the division's guard used to read it as 0"),
]


def _sinkhorn(m, a, b, M, reg, iters=5):
    K = torch.exp(-M * m.g / reg)
    u = torch.ones_like(a) / a.shape[0]
    v = torch.ones_like(b) / b.shape[0]
    for _ in range(iters):
        u = a / (K @ v)
        v = b / (K.T @ u)
    P = u[:, None] * K * v[None, :]
    return (P * M).sum()




def _ot_M_apart(n=4):
    x = torch.linspace(0, 1.5, n)
    return (x[:, None] - (x[None, :] + 1.2)) ** 2








def _flat_bottom(m, value, lower, upper):
    # Protenix _flat_bottom_parabolic: +inf upper bound for clash-only pairs, squared before the
    # where that masks it
    k = m.k
    below = k * (value - lower) ** 2
    above = k * (value - upper) ** 2
    return torch.where(value < lower, below, torch.where(value > upper, above, torch.zeros_like(value)))


def _han_group(m, out):
    # HANConv group(): out = stack(xs) of shape (edge types, nodes, dim)
    attn_score = (m.q * torch.tanh(m.k_lin(out)).mean(1)).sum(-1)
    attn = F.softmax(attn_score, dim=0)
    return torch.sum(attn.view(out.shape[0], 1, -1) * out, dim=0)


def _scatter_logsumexp(m, src, index):
    # torch_scatter.scatter_logsumexp before #369
    n = 3
    src = src + m.b
    max_per_index = torch.full((n,), -INF).scatter_reduce(0, index, src, "amax", include_self=True)
    recentered = src - max_per_index[index]
    sum_per_index = torch.zeros(n).index_add(0, index, recentered.exp())
    return sum_per_index.log() + max_per_index


PENDING_CASES: dict[str, Case] = {
    "han_semantic_attention_empty": Case(
        lambda: Fn(_han_group, params={"q": _f(1, 4, seed=2)}, mods={"k_lin": _lin(4, 4)}),
        lambda: (leaf(torch.zeros(2, 0, 4)),),
        lambda: (leaf(_f(2, 3, 4)),)),
    "scatter_logsumexp_masked_group": Case(
        lambda: Fn(_scatter_logsumexp, params={"b": torch.zeros(5)}),
        lambda: (leaf(torch.tensor([0.5, 1.0, -INF, -INF, 2.0])), torch.tensor([0, 0, 1, 1, 2])),
        lambda: (leaf(torch.tensor([0.5, 1.0, -3.0, -4.0, 2.0])), torch.tensor([0, 0, 1, 1, 2]))),
    "mamba_fp16_selective_scan": Case(
        lambda: Fn(_selective_scan, params={"A_log": _state_A().half(), "B": torch.ones(2, dtype=H),
                                            "C": torch.ones(2, dtype=H)}),
        lambda: (leaf(torch.tensor([[300.0, 1.0], [1.0, 1.0]], dtype=H)),
                 leaf(torch.tensor([[300.0, 0.3], [0.1, 0.1]], dtype=H))),
        lambda: (leaf(torch.tensor([[3.0, 1.0], [1.0, 1.0]], dtype=H)),
                 leaf(torch.tensor([[0.5, 0.3], [0.1, 0.1]], dtype=H)))),
    "sinkhorn_kernel_underflow": Case(
        lambda: Fn(_sinkhorn, params=_one()),
        lambda: (leaf(torch.full((4,), 0.25)), torch.tensor([0.1, 0.2, 0.3, 0.4]), _ot_M_apart(), 0.01),
        lambda: (leaf(torch.full((4,), 0.25)), torch.tensor([0.1, 0.2, 0.3, 0.4]), _ot_M_apart(), 0.5)),
    "protenix_flat_bottom_inf_upper": Case(
        lambda: Fn(_flat_bottom, params={"k": torch.ones(())}),
        lambda: (leaf(torch.tensor([0.5, 3.0])), torch.tensor([2.0, 2.0]), torch.tensor([INF, 4.0])),
        lambda: (leaf(torch.tensor([0.5, 3.0])), torch.tensor([2.0, 2.0]), torch.tensor([5.0, 4.0]))),
    "giou_fp16_area_overflow": Case(
        lambda: Fn(_giou_loss, params=_one(H)),
        lambda: (leaf(torch.tensor([[0.0, 0.0, 300.0, 300.0]], dtype=H)), torch.tensor([[10.0, 10.0, 320.0, 310.0]], dtype=H)),
        lambda: (leaf(torch.tensor([[0.0, 0.0, 30.0, 30.0]], dtype=H)), torch.tensor([[1.0, 1.0, 32.0, 31.0]], dtype=H)),
        graph_break="aot_autograd cannot trace the boolean-mask assignment (aten.nonzero): the frame runs eagerly"),
}


def run(bug_id: str) -> str:
    """The checks of tests/test_real_bugs.py on one pending case: '' when all pass, else the
    assertion message."""
    row = next(r for r in PENDING if r[0] == bug_id)
    CASES[bug_id] = PENDING_CASES[bug_id]
    found = []
    try:
        for check in (test_real_bug, test_real_bug_backend):
            torch._dynamo.reset()
            try:
                check(*row[:4])
            except AssertionError as e:
                found.append(str(e))
        return "\n".join(found)
    finally:
        del CASES[bug_id]


if __name__ == "__main__":
    assert [r[0] for r in PENDING] == list(PENDING_CASES)
    for row in PENDING:
        print(run(row[0]) or f"{row[0]}: passes every check: move it to tests/test_real_bugs.py")
