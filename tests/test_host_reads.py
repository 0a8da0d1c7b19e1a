"""Host reads per training step (issue 38, item 1). On a GPU each read of a device value into
Python (``.item()``, ``bool(t)``, ``if t.any()``) waits for every kernel queued before it: a
check that reads at every op serialises the step. Counted on the CPU with a dispatch mode over
the ops that read a value back: check mode reads at most twice a step (once after the
forward, once after the backward) beyond what the plain step reads."""

from __future__ import annotations

import warnings

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

    def __enter__(self):  # (also a copy of a whole tensor to a Python list, which no aten op makes)
        self._tolist = _count_tolist(self)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def _count_tolist(counter):
    plain = torch.Tensor.tolist
    inside = []

    def tolist(t):
        if inside:  # (a mode handed the call on: torch looks the method up again by name)
            return plain(t)
        counter.n += 1
        counter.ops.append("tolist")
        inside.append(True)
        try:
            return plain(t)
        finally:
            inside.pop()

    torch.Tensor.tolist = tolist
    return plain


class _CompiledReads:
    """The same count where a dispatch mode cannot be used (torch.compile runs a frame
    eagerly under one): the profiler's record of the aten ops that read a value back."""

    _NAMES = {f"aten::{f._schema.name.split('::')[1]}" for f in _READS}

    def __enter__(self):
        self.n, self.ops = 0, []
        self._tolist = _count_tolist(self)
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        self._prof.__enter__()
        return self

    def _inside_read(self, e) -> bool:  # (bool(t) is is_nonzero, which reads through item)
        p = e.cpu_parent
        while p is not None and p.name not in self._NAMES:
            p = p.cpu_parent
        return p is not None

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        self._prof.__exit__(*exc)
        reads = [e.name for e in self._prof.events() if e.name in self._NAMES and not self._inside_read(e)]
        self.n += len(reads)
        self.ops += reads


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


def _reads(model, batch, counter=_Reads) -> int:
    _step(model, batch)  # the first call records each site (and its constants)
    model.zero_grad(set_to_none=True)
    with counter() as r:
        _step(model, batch)
    return r.n


@pytest.mark.parametrize("mode", ["check", "warn", "guard+check", "guard"])
@pytest.mark.parametrize("name", ["mlp", "encoder", "gpt2"])
def test_check_mode_reads_the_host_at_most_twice_a_step(name, mode):
    model, batch = _model(name)
    plain = _reads(model, batch)
    checked = _reads(nanpass.harden(model, mode=mode, watch=None), batch)
    assert checked <= plain + 2, f"{name}, mode={mode}: {checked} host reads a step, plain {plain}"


@pytest.mark.parametrize(("name", "mode"), [
    pytest.param(n, m, marks=pytest.mark.slow if n != "mlp" else ())  # (gpt2: 13-27 s each)
    for n in ("mlp", "encoder", "gpt2") for m in ("check", "warn")])
def test_compiled_check_mode_reads_the_host_at_most_twice_a_step(name, mode):
    """torch.compile(harden(m, mode="check")): the compiled forward keeps a scalar per new
    value on the device and reads them once after the graph; the backward reads one fused
    check of the gradients."""
    model, batch = _model(name)
    plain = _reads(torch.compile(model, backend="aot_eager"), batch, _CompiledReads)
    safe = torch.compile(nanpass.harden(model, mode=mode, watch=None), backend="aot_eager")
    _step(safe, batch)  # (compiles; the steps counted run the compiled graphs)
    checked = _reads(safe, batch, _CompiledReads)
    torch._dynamo.reset()
    assert checked <= plain + 2, f"{name}, compiled mode={mode}: {checked} host reads a step, plain {plain}"


def test_stop_at_op_reads_at_every_op_as_a_debugger_wants():
    """The explicit option keeps the check at the op itself (one read a call)."""
    model, batch = _mlp()
    assert _reads(nanpass.harden(model, mode="check", stop_at_op=True, watch=None), batch) > 10


class _MaskedAttention(nn.Module):
    """An infinity made on purpose every step: a causal mask of -inf, then a softmax."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x):
        s = self.q(x) @ x.transpose(-1, -2)
        mask = torch.triu(torch.full((x.shape[1], x.shape[1]), float("-inf")), 1)
        return torch.softmax(s + mask, -1) @ x


def test_an_infinity_made_on_purpose_costs_no_second_run():
    """The verdict is classified on the host as the per-op check would: a -inf mask that a
    softmax lets die is quiet, so the step reads once and never runs the forward again."""
    torch.manual_seed(0)
    model, x = _MaskedAttention(), torch.randn(2, 5, 8)
    safe = nanpass.harden(model, mode="check", watch=None)
    runs = []
    model.register_forward_hook(lambda *a: runs.append(1))
    batch = {"x": x}
    assert _reads(safe, batch) <= 2
    runs.clear()
    safe(x)
    assert len(runs) == 1


class _Bad(nn.Module):
    def __init__(self, where):
        super().__init__()
        self.fc, self.bn, self.where = nn.Linear(4, 4), nn.BatchNorm1d(4), where

    def forward(self, x):
        h = self.bn(self.fc(x))
        if self.where == "forward-nan":
            return torch.log(h - h.max() - 1.0)  # every operand finite: NaN made here
        if self.where == "forward-overflow":
            return torch.exp(h * 1e4)  # an overflow from finite operands
        if self.where == "mask-then-nan":
            m = h.masked_fill(torch.ones_like(h, dtype=torch.bool), float("-inf"))  # on purpose
            return m - m  # ... until -inf - -inf
        return torch.sqrt(h - h)  # backward: d sqrt at 0 is infinite, from a finite gradient


def _finding(where, mode, stop_at_op, compiled=False):
    """The first error or NonFiniteWarning of one step of ``_Bad(where)``, and the running
    statistics after it."""
    import warnings

    torch.manual_seed(0)
    m = _Bad(where)
    safe = nanpass.harden(m, mode=mode, stop_at_op=stop_at_op, watch=None)
    if compiled:
        safe = torch.compile(safe, backend="aot_eager")
    x = torch.randn(6, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            safe(x).sum().backward()
        except nanpass.NonFiniteError as e:
            return str(e), m.bn.running_mean.clone()
        finally:
            torch._dynamo.reset()
    found = [str(w.message) for w in caught if issubclass(w.category, nanpass.NonFiniteWarning)]
    return found[0] if found else None, m.bn.running_mean.clone()


@pytest.mark.parametrize("where", ["forward-nan", "forward-overflow", "mask-then-nan", "backward"])
@pytest.mark.parametrize("mode", ["check", "warn"])
def test_the_finding_is_the_one_the_check_at_each_op_makes(where, mode):
    """One read a step, and the same finding as ``stop_at_op=True``: the op, its module, the
    user's line, and (forward) its operands."""
    got, stats = _finding(where, mode, False)
    want, want_stats = _finding(where, mode, True)
    assert got is not None and want is not None
    if where == "backward":  # named at the same node and line; the values are read once
        assert got.split("\n")[:2] == want.split("\n")[:2]
        assert "autograd node SqrtBackward0; the gradient it gave: shape (6, 4) float32" in got
    else:
        assert got == want
    # the second run (forward findings) leaves the running statistics as one forward does
    assert torch.equal(stats, want_stats)


@pytest.mark.parametrize("where", ["forward-nan", "forward-overflow", "mask-then-nan", "backward"])
@pytest.mark.parametrize("mode", ["check", "warn"])
def test_compiled_check_names_what_eager_check_names(where, mode):
    """torch.compile(harden(m, mode="check")): two reads a step, and on a finding the step runs
    again eagerly with the check at each op, which names the op, its module, the user's line,
    its operands, and where an infinity made on purpose was born; in backward, the node."""
    got, stats = _finding(where, mode, False, compiled=True)
    want, want_stats = _finding(where, mode, True)
    assert got is not None and want is not None
    if where == "backward":
        assert got.split("\n")[:2] == want.split("\n")[:2]
        assert "autograd node SqrtBackward0" in got
    else:
        assert got == want
    assert torch.equal(stats, want_stats)  # the run again leaves the statistics as one forward


@torch.compiler.disable
def _eager(t):
    return t


class _Breaks(nn.Module):
    """Two graphs: the gradient turns infinite in the first one's backward (d sqrt at 0)."""

    def __init__(self, at_input=False):
        super().__init__()
        self.fc, self.at_input = nn.Linear(4, 4), at_input

    def forward(self, x):
        h = self.fc(x)
        y = torch.sqrt(h - h + x) if self.at_input else torch.sqrt(h - h)  # (h - h is 0 exactly)
        return _eager(y) * 2


def _both_name(make) -> str:
    """A backward's finding, compiled (aot_eager) and eager with ``stop_at_op=True``, from
    ``make()``'s (model, input): the same two first lines; the compiled one returned."""
    def step(wrap):
        torch.manual_seed(0)
        m, x = make()
        with pytest.raises(nanpass.NonFiniteError) as e:
            wrap(m)(x).sum().backward()
        return str(e.value)

    eager = step(lambda m: nanpass.harden(m, mode="check", stop_at_op=True))
    try:
        compiled = step(lambda m: torch.compile(nanpass.harden(m, mode="check"), backend="aot_eager"))
    finally:
        torch._dynamo.reset()
    assert compiled.split("\n")[:2] == eager.split("\n")[:2]
    return compiled


def test_compiled_check_sees_a_gradient_made_in_an_earlier_graph():
    """A model that graph-breaks: its output comes from the last graph, whose backward node
    gives no parameter's gradient; the check looks at every parameter's."""
    assert "SqrtBackward0" in _both_name(lambda: (_Breaks(), torch.randn(3, 4)))


class _ReadTwice(nn.Module):
    """A weight read in two graphs: its gradient is the sum of what each graph's node gives,
    and the second's is NaN (d sqrt at 0 times 0)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = _eager(self.fc(x))
        return torch.sqrt(y - y + self.fc.weight.sum() * 0)


def test_compiled_check_sees_a_gradient_of_a_weight_two_graphs_read():
    assert "torch.sqrt" in _both_name(lambda: (_ReadTwice(), torch.randn(3, 4)))


def test_compiled_check_names_a_nan_parameter():
    """A NaN already in a parameter (a checkpoint, an earlier step) is seen in what the op that
    reads it makes, and named as the parameter's, as eager check mode names it."""
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        m[2].weight[0, 1] = float("nan")
    safe = torch.compile(nanpass.harden(m, mode="check"), backend="aot_eager")
    try:
        with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: NaN in the parameter '2.weight' \(Linear\) before the model ran"):
            safe(torch.randn(3, 4))
    finally:
        torch._dynamo.reset()


def test_compiled_check_checks_each_backward_of_interleaved_forwards():
    """Two forwards, then their two backwards: each backward's check is its own forward's (a
    hook on the parameters fires in the first backward that reaches them, whichever it is)."""
    torch.manual_seed(0)
    m = _Breaks(at_input=True)
    safe = torch.compile(nanpass.harden(m, mode="check"), backend="aot_eager")
    try:
        good = safe(torch.full((3, 4), 4.0))  # d sqrt at 4: finite
        bad = safe(torch.zeros(3, 4))  # d sqrt at 0: infinite
        good.sum().backward()
        with pytest.raises(nanpass.NonFiniteError, match=r"SqrtBackward0"):
            bad.sum().backward()
    finally:
        torch._dynamo.reset()


def test_compiled_check_under_autograd_grad():
    """torch.autograd.grad (a gradient penalty's first step, functional training loops): the
    backward check runs there too, and a finite one is left alone."""
    torch.manual_seed(0)
    m = _Breaks(at_input=True)
    safe = torch.compile(nanpass.harden(m, mode="check"), backend="aot_eager")
    try:
        (g,) = torch.autograd.grad(safe(torch.full((3, 4), 4.0)).sum(), [m.fc.weight])
        assert torch.isfinite(g).all() and m.fc.weight.grad is None
        with pytest.raises(nanpass.NonFiniteError, match=r"SqrtBackward0"):
            torch.autograd.grad(safe(torch.zeros(3, 4)).sum(), [m.fc.weight])
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_compiled_check_says_when_the_eager_run_does_not_reproduce(where, monkeypatch):
    """A compiled step whose finding the eager run again does not make (a random draw the
    graph makes differently, inductor's rounding; here: a run again that runs nothing) is
    reported as not reproduced, never dropped, and never remembered as quiet."""
    monkeypatch.setattr(nanpass.Hardened, "_check_again", lambda *a, **k: None)
    if where == "forward":  # infinities only: a pattern that may be made on purpose
        model, args = _Ratio(), (torch.full((4,), 1e10), torch.tensor([0.0, 1.0, 2.0, 4.0]))
    else:
        model, args = _Breaks(), (torch.randn(3, 4),)
    safe = torch.compile(nanpass.harden(model, mode="check", watch=None), backend="aot_eager")
    try:
        for _ in range(2):
            with pytest.raises(nanpass.NonFiniteError, match=rf"^nanpass: an? .* in the {where} of the "
                               rf"compiled {type(model).__name__}, which its run again eagerly"):
                safe(*args).sum().backward()
    finally:
        torch._dynamo.reset()


def test_enable_warns_once_for_a_nan_its_backward_carries():
    """nanpass.enable in warn mode: a NaN made in the forward is named once; the backward that
    only carries it is not named again as its own."""
    import warnings

    m = nn.Linear(4, 4)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanpass.enable(mode="warn"):
            m(torch.sqrt(-torch.ones(3, 4))).sum().backward()
            opt.step()
    found = [str(w.message) for w in caught if issubclass(w.category, nanpass.NonFiniteWarning)]
    assert len(found) == 1 and found[0].startswith("nanpass: NaN created by torch.sqrt"), found


class _Ratio(nn.Module):
    def forward(self, x, d):
        return torch.exp(-(x / d))  # x / 0 is +inf at a pole, and exp(-inf) is 0: quiet


def test_compiled_check_runs_a_quiet_pattern_once_and_still_names_an_overflow(monkeypatch):
    """An infinity made on purpose every step (a division at its pole) is checked by running
    the step again once; the same pattern is then known quiet. A later infinity of the same
    op from an overflow is another pattern (no infinity at the pole): it is named."""
    runs = []
    again = nanpass.Hardened._check_again
    monkeypatch.setattr(nanpass.Hardened, "_check_again", lambda *a, **k: (runs.append(1), again(*a, **k))[1])
    safe = torch.compile(nanpass.harden(_Ratio(), mode="check", watch=None), backend="aot_eager")
    x = torch.full((4,), 1e10)
    pole = torch.tensor([0.0, 1.0, 2.0, 4.0])
    try:
        for _ in range(3):
            assert torch.equal(safe(x, pole), torch.exp(-(x / pole)))
        assert len(runs) == 1  # the first step only
        tiny = torch.full((4,), torch.finfo(torch.float32).tiny)  # 1e10 / tiny overflows
        with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: Inf created by operator.truediv .*\n  an overflow"):
            safe(x, tiny)
    finally:
        torch._dynamo.reset()


class _Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, bad: bool = False):
        super().__init__()
        self.a, self.b, self.reentrant, self.bad = nn.Linear(8, 8), nn.Linear(8, 8), reentrant, bad

    def block(self, x):
        h = torch.tanh(self.a(x)).exp() * self.b(x)
        return torch.sqrt(h - h) if self.bad else h  # bad: d sqrt at 0 is infinite

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, x, use_reentrant=self.reentrant).sum()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_checkpointed_region_is_not_read_again_in_its_recompute(reentrant):
    """The recompute in backward makes the forward's values again: they were checked in the
    forward and are not read at each op; its nodes' backward is still checked (a reentrant
    checkpoint's backward runs through the recompute's graph), named as stop_at_op names it."""
    torch.manual_seed(0)
    x = torch.randn(4, 8, requires_grad=reentrant)  # (reentrant: an input that needs a gradient)
    model = _Checkpointed(reentrant)
    plain = _reads(model, {"x": x}, _Reads)
    assert _reads(nanpass.harden(model, mode="check", watch=None), {"x": x}, _Reads) <= plain + 2
    model.bad = True
    with pytest.raises(nanpass.NonFiniteError) as got:
        nanpass.harden(model, mode="check", watch=None)(x).backward()
    with pytest.raises(nanpass.NonFiniteError) as want:
        nanpass.harden(model, mode="check", stop_at_op=True, watch=None)(x).backward()
    assert str(got.value).split("\n")[:2] == str(want.value).split("\n")[:2]
    assert "SqrtBackward0" in str(got.value)


def test_threads_keep_their_own_verdicts():
    """Two threads through one hardened model: each forward's verdicts are its own thread's,
    so the thread whose input makes a NaN gets the error and the other none."""
    import threading

    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4))
    safe = nanpass.harden(m, mode="check", watch=None)
    errors: dict = {}

    def work(name, x):
        try:
            for _ in range(20):
                torch.log(safe(x) - safe(x).max() - 1.0) if name == "bad" else safe(x)
                if name == "bad":
                    with torch.no_grad():
                        safe(x.log())  # the log is outside: a NaN input, named as the data's
        except nanpass.NonFiniteError as e:
            errors[name] = str(e)

    good, bad = torch.randn(3, 4), -torch.ones(3, 4)
    threads = [threading.Thread(target=work, args=(n, x)) for n, x in (("good", good), ("bad", bad))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "good" not in errors
    assert errors["bad"].startswith("nanpass: NaN in the input")


# -- nanpass.enable / nanpass run: no forward to run again -----------------------------------------


def _train_step(model, batch, opt):
    _step(model, batch)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # loss code between backward and step
    opt.step()
    opt.zero_grad(set_to_none=True)


def _program_reads(model, batch, mode) -> int:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanpass.enable(mode):
        _train_step(model, batch, opt)  # the first step records each site
        with _Reads() as r:
            _train_step(model, batch, opt)
    return r.n


@pytest.mark.parametrize("mode", ["check", "warn"])
@pytest.mark.parametrize("name", ["mlp", "encoder", "gpt2"])
def test_enable_reads_the_host_at_most_twice_a_step(name, mode):
    """A whole program under nanpass.enable (the forward, the loss code, the backward, the
    clipping before the optimizer step): its verdicts are read when the backward starts and
    when it ends, not at each call."""
    model, batch = _model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    _train_step(model, batch, opt)
    with _Reads() as r:
        _train_step(model, batch, opt)
    plain = r.n
    checked = _program_reads(model, batch, mode)
    assert checked <= plain + 2, f"{name}, enable({mode!r}): {checked} host reads a step, plain {plain}"


_FREED = "freed (or written over) before nanpass read the step's verdicts"


def _program_finding(where, mode, stop_at_op, no_grad=False):
    import warnings

    torch.manual_seed(0)
    m = _Bad(where)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(6, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with nanpass.enable(mode, stop_at_op=stop_at_op):
                if no_grad:
                    with torch.no_grad():
                        m(x)
                else:
                    m(x).sum().backward()
                    opt.step()
        except nanpass.NonFiniteError as e:
            return str(e)
    found = [str(w.message) for w in caught if issubclass(w.category, nanpass.NonFiniteWarning)]
    return found[0] if found else None


def _same_finding(got: str, want: str) -> None:
    """The same op, line, reason and origin; each operand described as at the op, or said to
    be freed where autograd did not keep it (the note then says how to stop at the op)."""
    got_lines, want_lines = got.split("\n"), want.split("\n")
    if _FREED in got:
        assert got_lines[-1].startswith("  (nanpass.enable reads its verdicts once a step")
        got_lines = got_lines[:-1]
    assert len(got_lines) == len(want_lines), (got, want)
    for g, w in zip(got_lines, want_lines, strict=True):
        assert g == w or (g.endswith(_FREED) and g.split(":")[0] == w.split(":")[0]), (got, want)


@pytest.mark.parametrize("where", ["forward-nan", "forward-overflow", "mask-then-nan", "backward"])
@pytest.mark.parametrize("mode", ["check", "warn"])
def test_enable_names_what_the_check_at_each_op_names(where, mode):
    """nanpass.enable cannot run the forward again: its records name the op, the user's line,
    the reason and where an infinity made on purpose was born, as ``stop_at_op=True`` does at
    the op; the operands autograd keeps are described as there."""
    got, want = _program_finding(where, mode, False), _program_finding(where, mode, True)
    assert got is not None and want is not None
    if where == "backward":  # named at the same node and line; the values are read once
        assert got.split("\n")[:2] == want.split("\n")[:2]
    else:
        _same_finding(got, want)
    if where == "forward-nan":  # log keeps its operand for its backward: described in full
        assert got == want


@pytest.mark.parametrize("where", ["forward-nan", "forward-overflow", "mask-then-nan"])
def test_enable_reads_a_forward_with_no_backward_at_the_end(where):
    """An evaluation (no backward, no optimizer step): the verdicts are read when enable
    ends, with the same op and line."""
    got = _program_finding(where, "check", False, no_grad=True)
    want = _program_finding(where, "check", True, no_grad=True)
    assert got is not None and want is not None
    _same_finding(got, want)


class _Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.full((3, 4), 2.0))
        self.b = nn.Parameter(torch.ones(3, 4))

    def forward(self, x):
        return torch.tanh(x * self.w + self.b)


def _given_then_kept(model, run) -> list[bool]:
    """Whether each parameter's .grad after ``run(model)`` is the very tensor the node before
    it gave (AccumulateGrad keeps it when nothing else holds it, and copies it otherwise)."""
    given: set = set()
    params = {id(p) for p in model.parameters()}

    def giving(out):
        todo, seen = [out.grad_fn], set()
        while todo:
            n = todo.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            places = [k for k, (c, _) in enumerate(n.next_functions)
                      if type(c).__name__ == "AccumulateGrad" and id(c.variable) in params]
            if places:
                n.register_hook(lambda gi, go, places=places: given.update(gi[k].data_ptr() for k in places))
            todo.extend(c for c, _ in n.next_functions if c is not None)

    run(model, giving)
    return [p.grad.data_ptr() in given for p in model.parameters()]


@pytest.mark.parametrize("how", ["compile(harden(check))", "backend(check)", "harden(check)"])
def test_check_mode_keeps_each_gradient_as_the_plain_model_does(how):
    """A check that held the backward's gradients until it ends made AccumulateGrad copy each
    one into .grad (a copy of every gradient, each step); the check holds scalars only, so
    .grad is the gradient given wherever the plain model's is (``+ b`` passes one gradient on
    to two places: autograd copies that one for both)."""
    compiled = how != "harden(check)"

    def kept(wrap):
        torch.manual_seed(0)
        model = _Scale()
        safe = wrap(model)

        def run(m, giving):
            out = safe(torch.randn(3, 4))
            giving(out)
            out.sum().backward()

        try:
            return _given_then_kept(model, run)
        finally:
            torch._dynamo.reset()

    plain = kept(lambda m: torch.compile(m, backend="aot_eager") if compiled else m)
    assert plain == ([True, True] if compiled else [True, False])  # (a graph gives its own)
    if how == "compile(harden(check))":
        got = kept(lambda m: torch.compile(nanpass.harden(m, mode="check"), backend="aot_eager"))
    elif how == "backend(check)":
        got = kept(lambda m: torch.compile(m, backend=nanpass.backend(inner="aot_eager", mode="check")))
    else:
        got = kept(lambda m: nanpass.harden(m, mode="check"))
    assert got == plain


class _Huge(nn.Module):
    """d/dw = 1e30 * x: finite in float32; the squares a 2-norm sums are not."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return x * self.w * 1e30


@pytest.mark.parametrize("how", ["compile(harden(check))", "backend(check)", "harden(check)"])
def test_a_huge_finite_gradient_is_not_called_non_finite(how):
    model = _Huge()
    if how == "compile(harden(check))":
        safe = torch.compile(nanpass.harden(model, mode="check"), backend="aot_eager")
    elif how == "backend(check)":
        safe = torch.compile(model, backend=nanpass.backend(inner="aot_eager", mode="check"))
    else:
        safe = nanpass.harden(model, mode="check")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", nanpass.NonFiniteWarning)
            for _ in range(2):  # the second step adds into the .grad the first left
                safe(torch.ones(8)).sum().backward()
    finally:
        torch._dynamo.reset()
    assert torch.equal(model.w.grad, torch.full((8,), 2e30))


class _AfterUpstream(nn.Module):
    """Its input is an upstream model's output, not a leaf: the NaN gradient it gives that
    input (d sqrt at 0 times 0) dies in the upstream ReLU before any leaf."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return torch.sqrt(x - x) * self.w


class _Reentrant(nn.Module):
    """A reentrant checkpoint: its backward runs a backward of its own, which gives the weight
    inside it its (NaN) gradient."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(lambda x: x + torch.sqrt(self.w - self.w), x,
                                                 use_reentrant=True)


@pytest.mark.parametrize("case", ["an input that is not a leaf", "a reentrant checkpoint"])
def test_compiled_check_names_a_gradient_no_walk_to_the_parameters_sees(case):
    def make():
        if case == "an input that is not a leaf":
            return _AfterUpstream(), torch.relu(torch.full((4,), -1.0, requires_grad=True))
        return _Reentrant(), torch.ones(4, requires_grad=True)

    assert "torch.sqrt" in _both_name(make).split("\n")[0]


def _reads_in_a_loop(model, batch, steps: int = 3, counter=_Reads) -> int:
    for _ in range(steps - 1):
        _step(model, batch)
        model.zero_grad(set_to_none=True)
    with counter() as r:
        _step(model, batch)
    return r.n


@pytest.mark.parametrize("mode", ["check", "warn"])
@pytest.mark.parametrize("name", ["mlp", "encoder", "gpt2"])
def test_the_screen_reads_the_host_once_a_training_step(name, mode):
    """In a training loop (the model's last forward was reached by a backward) the screen
    reads its forward's scalars with its backward's, when the backward ends: one read a step
    beyond the plain step's (on a GPU each read waits for every queued kernel)."""
    model, batch = _model(name)
    plain = _reads_in_a_loop(model, batch)
    checked = _reads_in_a_loop(nanpass.harden(model, mode=mode, watch=None), batch)
    assert checked <= plain + 1, f"{name}, mode={mode}: {checked} host reads a step, plain {plain}"


@pytest.mark.parametrize("mode", ["check", "warn"])
def test_enable_reads_once_a_step_where_the_model_makes_its_loss(mode):
    """A Hugging Face model given its labels makes its loss inside the outermost module call:
    no call runs between module calls whose findings would need the values the backward frees,
    so the forward's screen is read with the backward's, before the optimizer step."""
    model, batch = _model("gpt2")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def step():
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with _Reads() as r:
        step()
    plain = r.n
    with nanpass.enable(mode):
        for _ in range(2):
            step()
        with _Reads() as r:
            step()
    assert r.n <= plain + 1, f"enable({mode!r}): {r.n} host reads a step, plain {plain}"


class _Broken(nn.Module):
    """An MLP that graph-breaks in the middle: two graphs a step, each with its backward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, input):
        h = torch.relu(self.a(input))
        torch._dynamo.graph_break()
        return torch.log_softmax(self.b(h), -1)


def _compiled(how: str, model, mode: str):
    if how == "backend":
        return torch.compile(model, backend=nanpass.backend(inner="aot_eager", mode=mode))
    return torch.compile(nanpass.harden(model, mode=mode, watch=None), backend="aot_eager")


@pytest.mark.parametrize(("name", "how", "mode"), [
    pytest.param(n, h, m, marks=pytest.mark.slow if n == "encoder" or m == "warn" else ())
    for n in ("mlp", "encoder", "graph break") for h in ("backend", "compile(harden)")
    for m in ("check", "warn")])  # (1-3 s each: the fast tier keeps check mode's mlp and break)
def test_compiled_check_reads_the_host_once_a_training_step(name, how, mode):
    """In a training loop (a backward reached the graph's last forward) a compiled graph's
    check is read with its backward's, and the backward's with every other graph's it ran
    through, as it ends: one read a step beyond the plain compiled step's, however many graphs."""
    model, batch = (_Broken(), {"input": torch.randn(4, 8)}) if name == "graph break" else _model(name)
    plain = _reads_in_a_loop(torch.compile(model, backend="aot_eager"), batch, counter=_CompiledReads)
    checked = _reads_in_a_loop(_compiled(how, model, mode), batch, counter=_CompiledReads)
    torch._dynamo.reset()
    assert checked <= plain + 1, f"{name}, {how}, mode={mode}: {checked} host reads a step, plain {plain}"


@pytest.mark.parametrize("how", ["backend", "compile(harden)"])
def test_a_compiled_forward_no_backward_reaches_is_read_at_the_next_forward(how):
    """After training steps, a forward with grad on and no backward (an evaluation) keeps its
    check unread till the graph's next forward on the thread, which reads it first."""
    model = _compiled(how, _Broken(), "check")
    x = torch.randn(4, 8)
    for _ in range(2):
        model(x).sum().backward()
    bad = x.clone()
    bad[0, 0] = float("nan")  # NaN in the data: made NaN by the first graph's linear
    model(bad)  # no backward
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: NaN"):
        model(x)
    torch._dynamo.reset()


class _Root(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.lin = nn.Linear(n_in, n_out)

    def forward(self, x):
        return torch.sqrt(self.lin(x))


def _pair(mode: str):
    torch.manual_seed(0)
    first, second = _Root(8, 8), _Root(8, 2)
    for m in (first, second):  # every value positive: finite steps
        nn.init.uniform_(m.lin.weight, 0.0, 0.1)
        nn.init.constant_(m.lin.bias, 1.0)
    return first, nanpass.harden(first, mode=mode, watch=None), nanpass.harden(second, mode=mode, watch=None)


@pytest.mark.parametrize("mode", ["check", "warn"])
def test_two_screened_models_read_the_host_once_a_training_step(mode):
    """Two hardened models in one step (an encoder and its head, a GAN's pair): each one's
    screen is read with the other's, as their backward ends, in one copy."""
    _, safe_first, safe_second = _pair(mode)
    x = torch.rand(4, 8)

    def step():
        safe_second(safe_first(x)).mean().backward()

    for _ in range(2):
        step()
    with _Reads() as r:
        step()
    assert r.n <= 1, f"mode={mode}: {r.n} host reads a step for two hardened models"


def test_two_screened_models_name_the_first_birth_of_the_step():
    """Read together, the forwards are judged in the order they ran: the NaN born in the
    first model is named where it is born, not as NaN passing through the second."""
    first, safe_first, safe_second = _pair("check")
    x = torch.rand(4, 8)
    for _ in range(2):
        safe_second(safe_first(x)).mean().backward()
    with torch.no_grad():
        first.lin.weight.zero_()
        first.lin.bias.fill_(-1.0)  # lin(x) is -1 exactly: sqrt makes NaN
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: NaN created by torch.sqrt"):
        safe_second(safe_first(x)).mean().backward()


def test_a_backward_that_raises_leaves_no_verdicts_behind():
    """A hook that raises ends the backward before its end callback, which would have read the
    verdicts joined so far: those are dropped past a bound, never kept for the process's life
    (each holds the gradients its outputs got)."""
    from nanpass import _check

    model = torch.compile(nn.Linear(4, 4), backend=nanpass.backend(inner="aot_eager", mode="check"))
    x = torch.ones(2, 4, requires_grad=True)

    def refuse(g):
        raise RuntimeError("the user's hook")

    x.register_hook(refuse)
    for _ in range(3 * _check._JOINED_MAX):
        with pytest.raises(RuntimeError, match="the user's hook"):
            model(x).sum().backward()
    assert len(_check._JOINED) <= _check._JOINED_MAX
    torch._dynamo.reset()
