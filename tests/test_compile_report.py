"""torch.compile(..., backend=nanpass): calls dynamo runs outside every graph are guarded, and
the report lists what each model runs (issue 45).

Each case's trigger values are the ones that break the plain compiled model: zeros, an empty
selection, dynamo's recompile limit (8)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanpass
from tests.helpers import all_finite


def _backend(**options):
    return nanpass.backend(inner="aot_eager", **options)


def _eager_rows(report) -> list[tuple[str, str, str]]:
    return [(c.action, c.op, c.module) for g in report.graphs if g.capture == "intercept" for c in g.changes]


# -- calls outside every graph ----------------------------------------------------------------


def _ctc(lp, t, il, tl):
    return F.ctc_loss(lp, t, il, tl)  # tensor lengths: dynamo leaves the call to eager


def _ctc_inputs():
    lp = torch.randn(3, 1, 5).log_softmax(-1).requires_grad_()
    # 4 labels in 3 frames: no alignment, loss inf
    return lp, torch.tensor([[1, 1, 1, 1]]), torch.tensor([3]), torch.tensor([4])


def test_a_call_dynamo_leaves_to_eager_after_a_graph_break_is_guarded():
    plain = torch.compile(_ctc, backend="aot_eager")(*_ctc_inputs())
    assert torch.isinf(plain)
    torch._dynamo.reset()
    be = _backend()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # guarded: no warning, and none per call
        out = [torch.compile(_ctc, backend=be)(*_ctc_inputs()) for _ in range(3)]
    assert all_finite(out)
    out[0].backward()
    assert ("guarded", "ctc_loss", "") in _eager_rows(nanpass.report(be))
    assert len(be.eager_changes) == 1  # one site, recorded once


def test_a_loss_over_an_empty_selection_outside_the_graph_is_guarded():
    def f(m, v, t, sel):
        return F.gaussian_nll_loss(m[sel], t[sel], v[sel])

    m = torch.randn(4, requires_grad=True)
    sel = torch.zeros(4, dtype=torch.bool)
    assert torch.isnan(torch.compile(f, backend="aot_eager")(m, torch.ones(4), torch.randn(4), sel))
    torch._dynamo.reset()
    out = torch.compile(f, backend=_backend())(m, torch.ones(4), torch.randn(4), sel)
    out.backward()
    assert all_finite([out, m.grad])


def test_every_call_in_a_frame_dynamo_skips_is_guarded():
    lstm = nn.LSTM(4, 4, batch_first=True)
    with torch.no_grad():
        for p in lstm.parameters():
            p.zero_()

    def f(x):
        e = lstm(x)[0][:, -1]  # zero input and weights: e = 0
        return e / torch.norm(e)

    def grads(backend):
        torch._dynamo.reset()
        x = torch.zeros(1, 3, 4, requires_grad=True)
        o = torch.compile(f, backend=backend)(x)
        o.sum().backward()
        return o, x.grad

    assert not all_finite(grads("aot_eager"))
    assert all_finite(grads(_backend()))


class Scaled(nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.k = k  # an int attribute: dynamo guards its value, one graph per instance

    def forward(self, x):
        return torch.log(x) * self.k


def test_instances_past_the_recompile_limit_run_guarded_and_their_report_says_so():
    be = _backend()
    models = [Scaled(k + 1) for k in range(10)]
    compiled = [torch.compile(m, backend=be) for m in models]
    outs = [c(torch.zeros(2)) for c in compiled]  # the 9th and 10th run eagerly (limit 8)
    assert all_finite(outs)
    first, ninth = nanpass.report(compiled[0]), nanpass.report(compiled[8])
    assert [g.capture for g in first.graphs] == ["dynamo"]
    assert [g.capture for g in ninth.graphs] == ["intercept"]  # no graph claimed for it
    assert _eager_rows(ninth) == [("guarded", "log", "")]
    assert len(be.graphs) == 8


# -- the report of one instance -------------------------------------------------------------


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_the_report_of_an_instance_lists_only_the_graphs_it_ran():
    be = _backend()
    a, b = Log(), Log()
    torch.compile(a, backend=be)(torch.ones(2))
    torch.compile(b, backend=be)(torch.ones(2, 3))  # another shape: a graph of b's own
    assert len(be.graphs) == 2
    assert len(nanpass.report(a).graphs) == 1
    assert len(nanpass.report(b).graphs) == 1
    assert "[2, 3]" not in nanpass.report(a).graphs[0].code_before


def test_the_report_of_an_instance_compiled_with_module_compile_lists_only_its_graphs():
    be = _backend()
    a, b, c = Log(), Log(), Log()
    a.compile(backend=be)
    b.compile(backend=be)
    a(torch.ones(2))
    b(torch.ones(2, 3))
    assert len(nanpass.report(a).graphs) == 1
    assert len(nanpass.report(b).graphs) == 1
    with pytest.raises(nanpass.NanpassError, match="^nanpass: no graph of Log"):
        nanpass.report(c)


# -- module paths in the model a step reaches -------------------------------------------------


class Enc(nn.Module):
    def forward(self, x):
        return torch.log(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = Enc()

    def forward(self, x):
        return self.enc(x) + torch.log(x + 1)


GLOBAL_MODEL = Net()


class Trainer:
    def __init__(self):
        self.model = Net()

    def step(self, x):
        return self.model(x)


def _closure_step():
    model = Net()
    return lambda x: model(x)


@pytest.mark.parametrize("reach", ["global", "closure", "trainer"])
def test_exclude_names_paths_in_the_model_a_compiled_step_reaches(reach):
    step = {"global": lambda x: GLOBAL_MODEL(x), "closure": _closure_step(),
            "trainer": Trainer().step}[reach]
    be = _backend(exclude=["enc"])
    out = torch.compile(step, backend=be)(torch.zeros(2))
    assert torch.isneginf(out).all()  # enc's log(0) left as written: excluded
    rows = {(c.module, c.action) for c in be.changes if c.op == "log"}
    assert rows == {("enc", "left"), ("", "guarded")}


def test_paths_of_a_compiled_module_are_its_named_modules():
    be = _backend(exclude=["enc"])
    out = torch.compile(Net(), backend=be)(torch.zeros(2))
    assert torch.isneginf(out).all()
    assert {(c.module, c.action) for c in be.changes if c.op == "log"} == {("enc", "left"), ("", "guarded")}


def test_a_backend_survives_a_deep_copy_of_the_compile_arguments():
    """Lightning Fabric wraps torch.compile and deep-copies its keyword arguments."""
    import copy

    be = nanpass.backend(inner="aot_eager")
    assert copy.deepcopy({"backend": be})["backend"] is be


def test_a_torch_without_the_compile_hook_is_told_once_that_eager_calls_run_unguarded(monkeypatch):
    from nanpass import _backend, _compat

    monkeypatch.setitem(_compat.MISSING, "compile_context", "AttributeError: (simulated)")
    monkeypatch.setattr(_backend, "_SAID", [])
    torch._dynamo.reset()
    with pytest.warns(nanpass.GuardWarning, match=r"^nanpass: torch .* run unguarded; "
                      r"torch\.compile\(nanpass\.harden\(model\)\) guards them") as seen:
        f = torch.compile(lambda x: torch.log(x) + 1, backend=nanpass.backend(inner="aot_eager"))
        f(torch.ones(2))
        f(torch.ones(3, 2))  # a second graph: no second warning
    assert sum("run unguarded" in str(w.message) for w in seen) == 1


def test_a_backend_made_per_compile_leaves_no_eager_sites_behind():
    import gc

    from nanpass import _backend

    gc.collect()
    before = sum(r() is not None for r in _backend._EAGER)
    for _ in range(5):
        nanpass.backend(inner="aot_eager")
    gc.collect()
    assert sum(r() is not None for r in _backend._EAGER) == before
