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


def test_importing_nanpass_leaves_torchs_own_modules_compiling_to_the_same_graphs():
    without, with_ = _graphs("without"), _graphs("with")
    headers = [line for line in without.splitlines() if line.startswith("==")]
    assert len(headers) == 12 and all(": 1 graph(s)" in h for h in headers), headers
    assert with_ == without
