"""Issue 45: every compiled route guards what its eager twin guards, and importing nanpass
changes nobody else's compile."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

import nanpass
from tests.helpers import all_finite

# torch's own modules, compiled fullgraph in every mode: the graphs dynamo hands a backend,
# printed one per line (the code of each graph, after a header naming the case)
_GRAPHS = textwrap.dedent(
    """
    import sys, torch, torch.nn as nn
    if sys.argv[1] == "with":
        import nanpass
    graphs = []
    def record(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward
    torch.manual_seed(0)
    mods = {"mha": nn.MultiheadAttention(16, 2, batch_first=True),
            "encoder_layer": nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
            "encoder": nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2,
                                             enable_nested_tensor=False)}
    x = torch.randn(2, 5, 16)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    for name, m in mods.items():
        for train in (True, False):
            m.train(train)
            for grad in (True, False):
                torch._dynamo.reset()
                graphs.clear()
                if name == "mha":
                    f = lambda x, m=m: m(x, x, x, key_padding_mask=pad)[0]
                else:
                    f = lambda x, m=m: m(x, src_key_padding_mask=pad)
                try:
                    with torch.set_grad_enabled(grad):
                        torch.compile(f, backend=record, fullgraph=True)(x)
                    print(f"== {name} train={train} grad={grad}: {len(graphs)} graph(s)")
                    print("".join(graphs))
                except Exception as e:
                    print(f"== {name} train={train} grad={grad}: {type(e).__name__}: {e}")
    """
)


def _graphs(which: str) -> str:
    res = subprocess.run([sys.executable, "-c", _GRAPHS, which], capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


@pytest.mark.slow  # (two processes, 12 compiles: 9 s of the fast tier)
def test_importing_nanpass_leaves_torchs_own_modules_compiling_to_the_same_graphs():
    without, with_ = _graphs("without"), _graphs("with")
    headers = [line for line in without.splitlines() if line.startswith("==")]
    assert len(headers) == 12 and all(": 1 graph(s)" in h for h in headers), headers
    assert with_ == without


# -- higher-order-op bodies: torch.compile(nanpass.harden(model)) and the backend ---------------


class _Checkpointed(nn.Module):
    """A block under activation checkpointing whose softmax meets a fully masked row."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant

    def block(self, h, mask):
        return torch.softmax(h.masked_fill(mask, float("-inf")), -1)

    def forward(self, h, mask):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, h, mask, use_reentrant=self.reentrant)


class _Cond(nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: torch.log(x), lambda x: torch.log(-x), (x,))


class _WhileLoop(nn.Module):
    def forward(self, v):
        from torch._higher_order_ops import while_loop

        def cond(i, v):
            return i < 2

        def body(i, v):
            return i + 1, v / (v - v)  # 0 / 0

        return while_loop(cond, body, (torch.tensor(0), v))[1]


class _Region(nn.Module):
    def forward(self, x):
        @torch.compiler.nested_compile_region
        def region(x):
            return torch.log(x)

        return region(x) + region(x + 1)


class _Flex(nn.Module):
    def forward(self, q):
        from torch.nn.attention.flex_attention import flex_attention

        def score_mod(score, b, h, q_idx, kv_idx):
            d = (q_idx - kv_idx).float()
            return score + d / d  # 0 / 0 on the diagonal

        return flex_attention(q, q, q, score_mod=score_mod)


def _mask():
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[0] = True
    return mask


# (model, its inputs where the original makes NaN or an infinity, safe inputs; whether the
# inputs require grad)
_REGIONS = {
    "checkpoint": (lambda: _Checkpointed(False), lambda: (torch.randn(2, 3), _mask()),
                   lambda: (torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool)), True),
    "checkpoint_reentrant": (lambda: _Checkpointed(True), lambda: (torch.randn(2, 3), _mask()),
                             lambda: (torch.randn(2, 3), torch.zeros(2, 3, dtype=torch.bool)), True),
    "cond": (_Cond, lambda: (torch.zeros(3),), lambda: (torch.rand(3) + 0.5,), False),
    "while_loop": (_WhileLoop, lambda: (torch.ones(3),), None, False),
    "while_loop_grad": (_WhileLoop, lambda: (torch.ones(3),), None, True),
    "nested_compile_region": (_Region, lambda: (torch.zeros(3),), lambda: (torch.rand(3) + 0.5,), False),
    "flex_attention_score_mod": (_Flex, lambda: (torch.randn(1, 1, 8, 4),), None, False),
}


def _compiled(route: str, model: nn.Module):
    torch._dynamo.reset()
    if route == "harden":
        return torch.compile(nanpass.harden(model), backend="aot_eager")
    return torch.compile(model, backend=nanpass.backend(inner="aot_eager"))


@pytest.mark.parametrize("route", ["harden", "backend"])
@pytest.mark.parametrize("case", sorted(_REGIONS))
def test_a_higher_order_ops_body_is_guarded_under_both_compiled_routes(case, route):
    make, bad, safe, grad = _REGIONS[case]
    torch.manual_seed(0)
    args = bad()
    leaves = [a.requires_grad_() for a in args[:1]] if grad else []
    torch._dynamo.reset()
    plain = torch.compile(make(), backend="aot_eager")(*args)
    assert not all_finite([plain])  # the trigger breaks the original, compiled plainly
    out = _compiled(route, make())(*args)
    assert all_finite([out])
    if grad:
        leaves[0].grad = None
        out.sum().backward()
        assert all_finite([leaves[0].grad])
    if safe is not None:  # where the original is finite, the same bits
        args = safe()
        torch._dynamo.reset()
        want = torch.compile(make(), backend="aot_eager")(*args)
        got = _compiled(route, make())(*args)
        assert torch.equal(got, want)


@pytest.mark.parametrize("kw", [{}, {"fast": False}], ids=["stand_ins", "mode"])
def test_eager_harden_runs_a_model_using_torch_cond_as_plain_eager_does(kw):
    x = torch.rand(3) + 0.5
    model = _Cond()
    hardened = nanpass.harden(model, **kw)
    assert torch.equal(hardened(x), model(x))
    assert all_finite([hardened(torch.zeros(3))])
    with pytest.raises(nanpass.NonFiniteError, match="^nanpass:"):
        nanpass.harden(model, mode="check")(torch.zeros(3))


def test_the_report_of_a_compiled_hardened_model_lists_the_guards_it_put_in_a_body():
    hardened = nanpass.harden(_Checkpointed(False))
    torch._dynamo.reset()
    h = torch.randn(2, 3, requires_grad=True)
    torch.compile(hardened, backend="aot_eager")(h, _mask()).sum().backward()
    guarded = [c for c in nanpass.report(hardened).changes if c.action == "guarded"]
    assert [c.op for c in guarded] == ["softmax"]
    assert guarded[0].source.endswith(f"test_compile_routes.py:{_Checkpointed.block.__code__.co_firstlineno + 1}")


@pytest.mark.parametrize("grad", [False, True])
def test_an_eval_attention_compiles_fullgraph_under_the_backend_and_a_fully_padded_row_is_finite(grad):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(2, 3, 8)
    pad = torch.zeros(2, 3, dtype=torch.bool)
    pad[0] = True  # a sequence with no real key
    with torch.set_grad_enabled(grad):
        assert not all_finite([mha(x, x, x, key_padding_mask=pad)[0]])
        torch._dynamo.reset()
        be = nanpass.backend(inner="aot_eager")
        out = torch.compile(mha, backend=be, fullgraph=True)(x, x, x, key_padding_mask=pad)[0]
    assert all_finite([out])
    assert any(c.action == "guarded" for g in be.graphs for c in g.changes)


@pytest.mark.parametrize("loss", ["mse_loss", "l1_loss", "smooth_l1_loss"])
def test_a_loss_over_a_data_dependent_selection_is_guarded_in_a_compiled_hardened_model(loss):
    """An unbacked size (``nonzero()``) under dynamo's own trace: the guard cannot branch on it,
    so the count picks at run time; a non-empty selection keeps the loss's bits."""
    import torch.nn.functional as F

    class Masked(nn.Module):
        def forward(self, p, d):
            i = (d > 0).nonzero().squeeze(1)
            return getattr(F, loss)(p[i], d[i])

    p = torch.tensor([0.5, -1.0, 2.0, 0.25], requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(nanpass.harden(Masked()), backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out = compiled(p, torch.zeros(4))  # no valid element: 0 / 0 in the original
        out.backward()
        assert out.item() == 0.0 and torch.equal(p.grad, torch.zeros(4))
        d = torch.tensor([1.0, 0.0, 3.0, 0.0])
        assert torch.equal(compiled(p, d), Masked()(p, d))
