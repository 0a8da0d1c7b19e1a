"""Per-rule probes for the tests: how to call each guarded op, and operands that make the
unguarded op non-finite. Keyed by rule name; test_rules.py checks every guarded rule has one."""

from __future__ import annotations

import torch
import torch.nn as nn

inf = float("inf")


def _t(*v, grad=True):
    return torch.tensor(v, dtype=torch.float32, requires_grad=grad)


class Probe:
    """``bad()`` -> (args, kwargs) on which the original op gives a non-finite value or gradient;
    ``ctor`` builds the module for module spellings; ``call_kwargs`` are passed to every spelling."""

    def __init__(self, bad, call_kwargs=None, ctor=None, module_args=None):
        self.bad = bad
        self.call_kwargs = call_kwargs or {}
        self.ctor = ctor or {}
        self.module_args = module_args


def _rows():
    x = torch.tensor([[-inf, -inf, -inf], [1.0, 2.0, -inf]], requires_grad=True)
    return (x,)


def _mha_bad():
    q = torch.randn(3, 2, 8, requires_grad=True)
    pad = torch.tensor([[True, True, True], [False, True, False]])
    return (q, q, q), {"key_padding_mask": pad, "need_weights": True}


PROBES: dict[str, Probe] = {
    "div": Probe(lambda: ((_t(1.0, 0.0, 2.0), _t(0.0, 0.0, 1.0)), {})),
    "reciprocal": Probe(lambda: ((_t(0.0, 2.0),), {})),
    "log": Probe(lambda: ((_t(0.0, -1.0, 2.0),), {})),
    "log2": Probe(lambda: ((_t(0.0, -1.0, 2.0),), {})),
    "log10": Probe(lambda: ((_t(0.0, -1.0, 2.0),), {})),
    "log1p": Probe(lambda: ((_t(-1.0, -2.0, 2.0),), {})),
    "sqrt": Probe(lambda: ((_t(0.0, -1.0, 4.0),), {})),
    "rsqrt": Probe(lambda: ((_t(0.0, -1.0, 4.0),), {})),
    "pow": Probe(lambda: ((_t(0.0, -1.0, 4.0), 0.5), {})),
    "exp": Probe(lambda: ((_t(100.0, 1.0),), {})),
    "exp2": Probe(lambda: ((_t(200.0, 1.0),), {})),
    "expm1": Probe(lambda: ((_t(100.0, 1.0),), {})),
    "softmax": Probe(lambda: (_rows(), {"dim": -1}), ctor={"nn.Softmax": (-1,), "nn.Softmax2d": ()},
                     module_args=lambda: (torch.full((1, 2, 2, 2), -inf, requires_grad=True),)),
    "softmin": Probe(lambda: ((torch.tensor([[inf, inf], [1.0, 2.0]], requires_grad=True),), {"dim": -1}),
                     ctor={"nn.Softmin": (-1,)}),
    "log_softmax": Probe(lambda: (_rows(), {"dim": -1}), ctor={"nn.LogSoftmax": (-1,)}),
    "logsigmoid": Probe(lambda: ((_t(-inf, 1.0),), {}), ctor={"nn.LogSigmoid": ()}),
    "logsumexp": Probe(lambda: (_rows(), {"dim": -1})),
    "acos": Probe(lambda: ((_t(1.0, 2.0, 0.5),), {})),
    "asin": Probe(lambda: ((_t(1.0, -2.0, 0.5),), {})),
    "atanh": Probe(lambda: ((_t(1.0, -1.0, 0.5),), {})),
    "logit": Probe(lambda: ((_t(0.0, 1.0, 0.5),), {})),
    "std": Probe(lambda: ((_t(1.0),), {})),
    "var": Probe(lambda: ((_t(1.0),), {})),
    "xlogy": Probe(lambda: ((_t(1.0, 0.0), _t(0.0, 0.0)), {})),
    "cross_entropy": Probe(
        lambda: ((torch.randn(3, 4, requires_grad=True), torch.full((3,), -100)), {}),
        ctor={"nn.CrossEntropyLoss": ()},
    ),
    "nll_loss": Probe(
        lambda: ((torch.randn(3, 4, requires_grad=True), torch.full((3,), -100)), {}),
        ctor={"nn.NLLLoss": ()},
    ),
    "kl_div": Probe(
        lambda: ((torch.tensor([[0.0, -inf]], requires_grad=True), torch.tensor([[1.0, 0.0]])),
                 {"reduction": "sum"}),
        ctor={"nn.KLDivLoss": ()},
    ),
    "cosine_similarity": Probe(
        lambda: ((torch.tensor([[inf, 1.0]], requires_grad=True), torch.tensor([[1.0, 1.0]])), {}),
        ctor={"nn.CosineSimilarity": ()},
    ),
    "multi_head_attention": Probe(None, ctor={"nn.MultiheadAttention": (8, 2)}),
}


def module_for(spelling_name: str, probe: Probe) -> nn.Module:
    return spelling_module(spelling_name, probe.ctor[spelling_name])


def spelling_module(name: str, args) -> nn.Module:
    cls = getattr(nn, name.split(".", 1)[1])
    return cls(*args)
