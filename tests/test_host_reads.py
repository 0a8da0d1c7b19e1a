"""Host reads per training step (issue 38, item 1). On a GPU each read of a device value into
Python (``.item()``, ``bool(t)``, ``if t.any()``) waits for every kernel queued before it: a
check that reads at every op serialises the step. Counted on the CPU with a dispatch mode over
the ops that read a value back: check mode reads at most twice a step (once after the
forward, once after the backward) beyond what the plain step reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import nanpass
from tests import hf_models

_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
          torch.ops.aten.equal.default, torch.ops.aten.nonzero.default,
          torch.ops.aten.masked_select.default}


class _Reads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n, self.ops = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _READS:
            self.n += 1
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _mlp():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.LayerNorm(16),
                      nn.Linear(16, 4), nn.LogSoftmax(-1))
    return m, {"input": torch.randn(4, 8)}


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), {"src": torch.randn(2, 5, 16)}


def _model(name):
    if name == "mlp":
        return _mlp()
    if name == "encoder":
        return _encoder()
    return hf_models.build(name)


def _step(model, batch):
    out = model(**batch)
    loss = out.loss if hasattr(out, "loss") else out.float().pow(2).mean()
    loss.backward()


def _reads(model, batch) -> int:
    _step(model, batch)  # the first call records each site (and its constants)
    model.zero_grad(set_to_none=True)
    with _Reads() as r:
        _step(model, batch)
    return r.n


@pytest.mark.parametrize("mode", ["check", "warn"])
@pytest.mark.parametrize("name", ["mlp", "encoder", "gpt2"])
def test_check_mode_reads_the_host_at_most_twice_a_step(name, mode):
    model, batch = _model(name)
    plain = _reads(model, batch)
    checked = _reads(nanpass.harden(model, mode=mode, watch=None), batch)
    assert checked <= plain + 2, f"{name}, mode={mode}: {checked} host reads a step, plain {plain}"


def test_stop_at_op_reads_at_every_op_as_a_debugger_wants():
    """The explicit option keeps the check at the op itself (one read a call)."""
    model, batch = _mlp()
    assert _reads(nanpass.harden(model, mode="check", stop_at_op=True, watch=None), batch) > 10
