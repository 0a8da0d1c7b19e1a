"""Check mode sees every call: a NaN or an overflow born in any op, forward or backward, is
named with the user's line; an infinity made on purpose is quiet until it matters; and a
non-finite result is never passed in silence (issue 29). ``nanpass.enable`` and
``nanpass run`` do the same for a whole program."""

from __future__ import annotations

import inspect
import math
import os
import re
import warnings

import pytest
import torch
import torch.nn as nn

import nanpass
from nanpass._cli import main as cli
from tests.helpers import SigmoidSpike, Spiking

HERE = __file__


def line_of(fn, text: str) -> str:
    """``file.py:N`` of the line in ``fn``'s source that contains ``text``."""
    lines, first = inspect.getsourcelines(fn)
    name = os.path.basename(inspect.getsourcefile(fn))
    for i, line in enumerate(lines):
        if text in line:
            return f"{name}:{first + i}"
    raise AssertionError(f"{text!r} not in {fn.__qualname__}")


# -- the three snippets of the issue ------------------------------------------------------------


class MaskedEntropy(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x, mask):
        h = self.l(x).masked_fill(mask, -math.inf)  # a padding mask
        z = h - h.logsumexp(-1, keepdim=True)
        return -(z * z.softmax(-1)).sum(-1)  # -inf * 0 -> NaN


def _masked_inputs():
    torch.manual_seed(0)
    x = torch.randn(2, 4)
    mask = torch.zeros(2, 4, dtype=torch.bool)
    mask[0, 1:] = True  # row 0 keeps one entry: -inf * 0 in the product
    return x, mask


def test_an_infinity_made_on_purpose_that_turns_into_nan_names_both_lines():
    x, mask = _masked_inputs()
    assert torch.isnan(MaskedEntropy()(x, mask)).any()  # the plain model is NaN, silently
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: NaN created by Tensor.mul ") as e:
        nanpass.harden(MaskedEntropy(), mode="check")(x, mask)
    msg = str(e.value)
    assert line_of(MaskedEntropy.forward, "z * z.softmax") in msg.splitlines()[0]
    assert "made on purpose" in msg and line_of(MaskedEntropy.forward, "masked_fill") in msg


def test_locate_names_a_nan_outside_the_rule_table():
    x, mask = _masked_inputs()
    found = nanpass.locate(MaskedEntropy(), x, mask, loss_fn=lambda o: o.sum())
    assert found.forward is not None and found.forward.kind == "NaN"
    assert line_of(MaskedEntropy.forward, "z * z.softmax") in found.forward.site.source.replace(HERE, "test_watch.py")
    assert "nothing to fix" not in str(found)


class Overflow(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        return self.l(x * 1e30) * 1e10


def test_an_overflow_in_ordinary_arithmetic_is_named_at_once():
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: Inf created by Tensor.mul ") as e:
        nanpass.harden(Overflow(), mode="check")(torch.randn(2, 4))
    assert line_of(Overflow.forward, "1e10") in str(e.value)
    assert "overflow past the float32 maximum" in str(e.value)


# -- every kind of op, forward -------------------------------------------------------------------


def _f16_product(x):
    return (x.half() * 300) * (x.half() * 300)


def _f16_sum(x):
    return (x.half() * 1.5e4).sum()


def _matmul(x):
    return (x * 1e20) @ (x * 1e20).T


def _empty_mean(x):
    return x[x > 100].mean()


def _inf_plus_inf_linear(x):
    lin = nn.Linear(4, 2)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]]))
    return lin(x.masked_fill(torch.tensor([True, True, False, False]), math.inf))


def _scatter(x):
    return torch.zeros(2).index_add(0, torch.tensor([0, 0, 0, 0]), x * 8e37)


def _exp(x):
    return torch.exp(x * 100)


BIRTHS = [  # (forward, the op named, NaN or Inf)
    (_f16_product, r"(Tensor.mul|\*)", "Inf"),
    (_f16_sum, "Tensor.sum", "Inf"),
    (_matmul, r"(Tensor.matmul|operator.matmul)", "Inf"),
    (_empty_mean, "Tensor.mean", "NaN"),
    (_inf_plus_inf_linear, "F.linear", "NaN"),
    (_scatter, "Tensor.index_add", "Inf"),
    (_exp, "torch.exp", "Inf"),
]


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("fn,op,kind", BIRTHS, ids=[b[0].__name__.strip("_") for b in BIRTHS])
@pytest.mark.parametrize("capture", ["harden", "aot_eager", "eager"])
def test_every_kind_of_op_is_named_where_it_makes_the_nan(fn, op, kind, capture):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    if capture == "harden":
        model = nanpass.harden(Fn(fn), mode="check")
    else:  # the backend: a compiled graph re-run on a hit, or (eager) run, node by node
        model = torch.compile(Fn(fn), backend=nanpass.backend(inner=capture, mode="check"))
    with pytest.raises(nanpass.NonFiniteError, match=rf"^nanpass: {kind} created by {op} ") as e:
        model(x)
    src = inspect.getsource(fn).strip().splitlines()[-1].strip()
    assert src in str(e.value)  # the user's line, from the frame or the graph's stack trace


# -- backward -------------------------------------------------------------------------------------


def test_a_custom_function_backward_is_checked_to_its_line():
    m = nanpass.harden(Spiking(), mode="check")
    loss = m(torch.randn(8, 4) * 100)
    with pytest.raises(nanpass.NonFiniteError, match=r"^nanpass: Inf created by torch.exp ") as e:
        loss.backward()
    assert line_of(SigmoidSpike.backward, "torch.exp") in str(e.value)


class MaskedSqrt(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(4, 4)

    def forward(self, x):
        h = self.l(x) * 0  # exactly 0
        return torch.relu(torch.sqrt(h) - 1).sum()  # relu drops the NaN gradient of sqrt(0)


@pytest.mark.parametrize("mode", ["check", "locate"])
def test_a_backward_nan_a_later_op_masks_is_named(mode):
    x = torch.randn(2, 4)
    if mode == "locate":
        found = nanpass.locate(MaskedSqrt(), x, loss_fn=lambda o: o)
        assert found.backward is not None and "torch.sqrt" in found.backward.message
        return
    loss = nanpass.harden(MaskedSqrt(), mode="check")(x)
    with pytest.raises(nanpass.NonFiniteError,
                       match=r"^nanpass: non-finite gradient created by the backward of torch.sqrt ") as e:
        loss.backward()
    assert line_of(MaskedSqrt.forward, "torch.sqrt") in str(e.value)


def test_a_non_finite_gradient_from_the_loss_is_named_at_the_output():
    m = nanpass.harden(nn.Linear(4, 2), mode="check")
    out = m(torch.randn(3, 4))
    with pytest.raises(nanpass.NonFiniteError, match="^nanpass: non-finite gradient reaches the model's output"):
        (out * torch.tensor(math.inf)).sum().backward()


# -- infinities on purpose ----------------------------------------------------------------------


class Intentional(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.l, self.how = nn.Linear(4, 4), how

    def forward(self, x, mask):
        h = self.l(x)
        if self.how == "masked_fill":
            return torch.softmax(h.masked_fill(mask, -math.inf), -1)
        if self.how == "mask_log":  # AllenNLP's masked_log_softmax
            return torch.log_softmax(h + (~mask).float().log(), -1).logsumexp(-1)
        return h.masked_fill(mask, -math.inf).amax(-1)  # a -inf fill before amax


@pytest.mark.parametrize("how", ["masked_fill", "mask_log", "amax"])
def test_infinities_made_on_purpose_that_die_are_quiet(how):
    x, mask = _masked_inputs()
    out = nanpass.harden(Intentional(how), mode="check")(x, mask)
    out.sum().backward()
    assert torch.isfinite(out).all()


def test_an_infinity_that_reaches_the_output_names_its_birth():
    class Escapes(nn.Module):
        def forward(self, x, mask):
            return x.masked_fill(mask, -math.inf)

    x, mask = _masked_inputs()
    with pytest.raises(nanpass.NonFiniteError, match="^nanpass: an infinity reaches the output") as e:
        nanpass.harden(Escapes(), mode="check")(x, mask)
    assert "made on purpose" in str(e.value) and "masked_fill" in str(e.value)


def test_a_pole_is_quiet_and_an_overflow_through_the_same_op_is_not():
    class Div(nn.Module):
        def forward(self, x, d):
            return torch.softmax(x / d, -1)  # x / 0 = inf on purpose... then softmax of +inf

    x = torch.tensor([[1.0, 2.0]])
    with pytest.raises(nanpass.NonFiniteError, match="^nanpass: Inf created by operator.truediv "):
        nanpass.harden(Div(), mode="check", ops=[])(x * 1e38, torch.tensor([[1e-3, 1.0]]))
    with pytest.raises(nanpass.NonFiniteError, match=r"(?s)^nanpass: NaN created by torch.softmax.*pole of div"):
        nanpass.harden(Div(), mode="check", ops=[])(x, torch.tensor([[0.0, 1.0]]))


# -- never silent ---------------------------------------------------------------------------------


def test_a_nan_no_watched_op_made_is_still_named_at_the_output():
    class Aten(nn.Module):
        def forward(self, x):
            y = torch.ops.aten.sqrt.default(x)  # an aten op called directly: not looked into
            return y + 1

    with pytest.raises(nanpass.NonFiniteError, match="^nanpass: NaN in the output of Aten") as e:
        nanpass.harden(Aten(), mode="check")(torch.tensor([-1.0, 4.0]))
    assert "first seen in an operand of Tensor.add" in str(e.value)
    found = nanpass.locate(Aten(), torch.tensor([-1.0, 4.0]))
    assert found.forward is not None and "nothing to fix" not in str(found)


# -- nanpass.enable and nanpass run ----------------------------------------------------------------


def _program(x):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    loss = model(x).sum() / (x.sum() - x.sum())  # loss code outside any model
    return loss


def test_enable_checks_the_loss_code_too_and_switches_off():
    x = torch.randn(2, 4)
    with pytest.raises(nanpass.NonFiniteError) as e, nanpass.enable(mode="check"):
        _program(x).backward()
    assert line_of(_program, "x.sum() - x.sum()") in str(e.value)
    assert torch.isinf(_program(x)) or torch.isnan(_program(x))  # off again: plain, no error


def test_enable_rejects_a_bad_mode_and_a_nested_enable_takes_over():
    with pytest.raises(nanpass.ConfigError, match="^nanpass: unknown mode 'fix'.*'check', 'warn', 'guard', 'count'"):
        nanpass.enable(mode="fix")
    with pytest.raises(nanpass.NonFiniteError), nanpass.enable(mode="check") as outer:
        with nanpass.enable(mode="guard") as inner:
            y = torch.log(torch.zeros(2))  # the inner one guards: finite, and no check of it
            with pytest.raises(nanpass.NanpassError, match="^nanpass: disable\\(\\) the enable started inside"):
                outer.disable()
        assert torch.isfinite(y).all() and not inner._on
        z = torch.zeros(2, requires_grad=True)
        (z / z).sum().backward()  # the outer one checks again


def test_enable_names_a_finding_before_the_programs_own_error(capsys):
    """The program raises before any read point: the verdicts are read at the exit of the
    ``with``, the finding is said first, and the program's error propagates as it was."""
    x = torch.zeros(3)
    with pytest.raises(AssertionError, match="not finite"), nanpass.enable(mode="check"):
        y = x / x
        assert bool(torch.isfinite(y).all()), "not finite"
    err = capsys.readouterr().err
    assert err.startswith("nanpass: NaN created by operator.truediv"), err
    assert "the program then raised AssertionError" in err


def test_enable_reads_at_autograd_grad_under_anomaly_and_at_a_custom_functions_line():
    w = torch.zeros(3, requires_grad=True)
    with pytest.raises(nanpass.NonFiniteError, match="backward of Tensor.sqrt") as e, nanpass.enable(mode="check"):
        torch.autograd.grad((w * w).sum().sqrt(), [w])  # read as it returns
        raise AssertionError("not read at torch.autograd.grad")
    with pytest.raises(nanpass.NonFiniteError, match="backward of Tensor.sqrt"), nanpass.enable(mode="check"), \
            torch.autograd.detect_anomaly(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (w * 2).pow(2).sum().sqrt().backward()  # torch's error would name PowBackward0

    class Inverse(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g / x

    with pytest.raises(nanpass.NonFiniteError) as e, nanpass.enable(mode="check"):
        Inverse.apply(w).sum().backward()
    assert "return g / x" in str(e.value) and "@staticmethod" not in str(e.value)


@pytest.mark.parametrize("mode", ["check", "guard"])
def test_enable_runs_what_a_check_cannot_reduce(mode, capsys):
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4)
    with nanpass.enable(mode=mode) as on:
        with torch.inference_mode():
            y = lin(x).relu()
        z = (y * 2).sum()
        with torch.device("meta"):
            nn.Linear(4, 4)(torch.zeros(2, 4))
        torch.sparse.mm(torch.eye(3).to_sparse(), torch.randn(3, 2))
        (x.to(torch.float8_e4m3fn).float() + 1).sum()
        per = torch.func.vmap(torch.func.grad(lambda w, xi: (w * xi).sum().pow(2)), in_dims=(None, 0))(x[0], x)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (torch.jit.trace, from 2.13)
            torch.jit.trace(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), x)(x)
        lin(x).pow(2).mean().backward()
    assert per.shape == (3, 4) and torch.isfinite(z)
    if mode == "check":
        assert on._watch.unwatched and "meta" in on._watch.unwatched_summary()
        assert "not watched" in capsys.readouterr().err


def test_enable_guard_skips_a_non_finite_step_and_leaves_the_optimizer_alone():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 2), nn.Linear(4, 2)
    b.load_state_dict(a.state_dict())
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (a, b)]
    x = torch.randn(8, 4)
    with nanpass.enable(mode="guard") as on:
        for step in range(3):
            opts[0].zero_grad()
            loss = a(x).pow(2).mean() * (math.inf if step == 1 else 1.0)
            loss.backward()
            opts[0].step()
    for step in range(3):  # plain, with the bad step left out by hand
        if step == 1:
            continue
        opts[1].zero_grad()
        b(x).pow(2).mean().backward()
        opts[1].step()
    assert on.skipped == 1
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


TRAIN = (
    "import torch\n"
    "model = torch.nn.Linear(3, 1)\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
    "for step in range(3):\n"
    "    x = torch.ones(4, 3) * step\n"
    "    loss = (model(x) / x.sum()).mean()\n"
    "    opt.zero_grad()\n"
    "    loss.backward()\n"
    "    opt.step()\n"
    "print('finished', bool(torch.isfinite(model.weight).all()))\n")


def test_nanpass_run_names_the_line_and_count_prints_the_guards(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    assert cli(["run", str(script)]) == 1
    err = capsys.readouterr().err
    # step 0 divides by 0 (a pole, quiet) and the mean carries -inf into the loss
    assert re.search(r"^nanpass: an infinity reaches the loss", err, re.M)
    assert re.search(r"made at a pole of div by operator.truediv .*train.py:6", err)
    assert cli(["run", "--mode", "count", str(script)]) == 0
    out, err = capsys.readouterr()
    assert "finished True" in out and "train.py:6" in err and "1 of 1 guards changed values" in err


def test_nanpass_run_warn_goes_on_and_report_names_the_line(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    with pytest.warns(nanpass.NonFiniteWarning) as caught:
        assert cli(["run", "--mode", "warn", str(script)]) == 0
    assert "finished False" in capsys.readouterr().out  # warn watches; it does not guard
    assert all(w.filename == str(script) for w in caught), [(w.filename, str(w.message)[:80]) for w in caught]  # the user's line, not nanpass's
    report = tmp_path / "r.html"
    assert cli(["run", "--mode", "guard", "--report", str(report), str(script)]) == 0
    assert "finished True" in capsys.readouterr().out
    assert "train.py:6" in report.read_text()


def test_enable_guard_decides_after_a_steps_closure():
    """Lightning calls optimizer.step(closure): forward and backward run inside the step, so
    the skip is decided after the closure, and the closure's calls are watched."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure():
        opt.zero_grad()
        loss = model(torch.randn(8, 4)).sum() * math.inf
        loss.backward()
        return loss

    with nanpass.enable(mode="guard") as on:
        opt.step(closure)
    assert on.skipped == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    with pytest.raises(nanpass.NonFiniteError, match="^nanpass: an infinity reaches the loss"), \
            nanpass.enable(mode="check"):
        opt.step(closure)


class ZeroOverZero(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x / x.sum(-1, keepdim=True)  # a row of zeros: 0 / 0

    @staticmethod
    def backward(ctx, g):
        return g


def test_a_custom_function_forward_is_checked_to_its_line():
    class M(nn.Module):
        def forward(self, x):
            return ZeroOverZero.apply(x)

    with pytest.raises(nanpass.NonFiniteError, match="^nanpass: NaN created by ") as e:
        nanpass.harden(M(), mode="check")(torch.zeros(2, 3, requires_grad=True))
    assert line_of(ZeroOverZero.forward, "0 / 0") in str(e.value)


def test_enable_puts_nanpass_around_torch_compile_in_the_program(capsys):
    def f(x):
        return torch.log(x)

    with nanpass.enable(mode="guard"):
        guarded = torch.compile(f, backend="eager")(torch.zeros(2))
        torch.compile(f, backend="inductor", mode="reduce-overhead")  # as asked, and said so
    assert torch.isfinite(guarded).all()
    assert "runs as asked, unwatched" in capsys.readouterr().err
    assert torch.compile is not None and torch.isinf(torch.compile(f, backend="eager")(torch.zeros(2))).all()


def test_an_infinity_written_by_index_is_named_as_made_on_purpose():
    class Written(nn.Module):
        def forward(self, x, mask):
            h = x.clone()
            h[mask] = -math.inf
            return h * 0

    x, mask = _masked_inputs()
    with pytest.raises(nanpass.NonFiniteError, match="^nanpass: NaN created by Tensor.mul") as e:
        nanpass.harden(Written(), mode="check")(x, mask)
    assert line_of(Written.forward, "h[mask] = -math.inf") in str(e.value)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "mixtral", "vit"])
def test_check_mode_is_silent_on_hugging_face_models_that_train_finite(name):
    """Their attention masks are -inf or finfo.min fills that die in a softmax: a training
    step in check mode, and under nanpass.enable with the loss code, says nothing."""
    pytest.importorskip("transformers")
    from tests.hf_models import build

    model, batch = build(name)
    out = nanpass.harden(model, mode="check")(**batch)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    model.zero_grad()
    with nanpass.enable(mode="check"):
        model(**batch).loss.backward()


class _BetaZeroScores(nn.Module):
    """diffusers' AttnProcessor: ``baddbmm(torch.empty(...), q, k^T, beta=0)``; here the
    ignored input is filled with a NaN or an infinity on purpose, not left to chance."""

    def __init__(self, fill, spelling):
        super().__init__()
        self.fill, self.spelling = fill, spelling

    def forward(self, q, k):
        ignored = torch.full((q.shape[0], q.shape[1], k.shape[1]), self.fill, dtype=q.dtype)
        if self.spelling == "method":
            return ignored.baddbmm(q, k.transpose(-1, -2), beta=0, alpha=1.0)
        return torch.baddbmm(ignored, q, k.transpose(-1, -2), beta=0, alpha=1.0)


@pytest.mark.parametrize("spelling", ["function", "method"])
@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("stop_at_op", [False, True])
def test_an_operand_the_op_does_not_read_is_never_blamed(stop_at_op, fill, spelling):
    """With beta=0 baddbmm ignores its input (torch: its NaN and inf are not propagated): a
    float16 product past the largest float16 is baddbmm's own overflow, named as such, and
    the same finding every run."""
    big = torch.finfo(torch.float16).max
    q = torch.full((1, 2, 2), big, dtype=torch.float16)
    k = torch.full((1, 3, 2), 2.0, dtype=torch.float16)  # each score: 2 * 2 * 65504 -> inf
    safe = nanpass.harden(_BetaZeroScores(fill, spelling), mode="check", stop_at_op=stop_at_op)
    found = []
    for _ in range(2):
        with pytest.raises(nanpass.NonFiniteError) as e:
            safe(q, k)
        found.append(str(e.value))
    assert found[0].startswith("nanpass: Inf created by "), found[0]
    assert "baddbmm" in found[0].split("\n")[0]
    assert "an overflow past the float16 maximum" in found[0]
    assert found[0] == found[1]


@pytest.mark.parametrize("case,stops", [("overflow", False), ("nan_grad", True), ("collapse", True),
                                        ("forward_nan", True)])
def test_enable_leaves_a_gradscalers_back_off_to_it_and_names_what_it_did_not_cause(case, stops, monkeypatch):
    """Issue 46 item 3, in process (tests/test_run_any_script.py runs the script under
    `nanpass run`): the scaler's own overflow is no stop; a NaN it did not cause, a scale
    that collapses and a NaN in the forward are."""
    import contextlib
    import pathlib
    import runpy
    import sys

    script = pathlib.Path(__file__).resolve().parent / "run_scripts" / "amp_scaler.py"
    monkeypatch.setattr(sys, "argv", [str(script), case])
    state = torch.random.get_rng_state()
    expect = (pytest.raises(nanpass.NonFiniteError, match="^nanpass:") if stops
              else contextlib.nullcontext())
    try:
        with expect, nanpass.enable("check"):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.random.set_rng_state(state)
