"""Guard mode's fast path (nanpass/_fastpath.py): the table's spellings swapped where they are
looked up, so that calls it does not name never enter Python; every way a model's code can
reach a spelling is still guarded, or the model runs under the mode and says why."""

from __future__ import annotations

import functools
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import log as prebound_log
from torch import nn

import nanpass
from nanpass import _fastpath

ZERO = torch.zeros(3)
LOG_TABLE = {"log": torch.log}


class Registry:
    def __init__(self):
        self.fns = {"log": torch.log}

    def get(self, name):
        return self.fns[name]


REGISTRY = Registry()


def _helper(x):
    return prebound_log(x)


def _closure():
    op = torch.log

    def run(x):
        return op(x)

    return run


class FromImport(nn.Module):
    def forward(self, x):
        return prebound_log(x)


class ThroughHelper(nn.Module):
    def forward(self, x):
        return _helper(x)


class Closure(nn.Module):
    run = staticmethod(_closure())

    def forward(self, x):
        return self.run(x)


class InstanceAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = torch.log

    def forward(self, x):
        return self.op(x)


class Partial(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = functools.partial(torch.clamp_min, min=0.0)
        self.log = functools.partial(torch.log)

    def forward(self, x):
        return self.log(self.op(x))


class ClassAttribute(nn.Module):
    op = torch.log

    def forward(self, x):
        return type(self).op(x)


class DefaultArgument(nn.Module):
    def forward(self, x, op=torch.log):
        return op(x)


class Container(nn.Module):
    def forward(self, x):
        return LOG_TABLE["log"](x)


class ThroughAnObject(nn.Module):  # nothing the scan reads: the first call's survey finds it
    def forward(self, x):
        return REGISTRY.get("log")(x)


class Method(nn.Module):
    def forward(self, x):
        return x.log() + x / x + 1 / x + F.softmax(torch.full_like(x, -float("inf")), -1)


CASES = {  # model -> how its eager calls are intercepted
    FromImport: "swap", ThroughHelper: "swap", Closure: "swap", Method: "swap",
    InstanceAttribute: "mode: InstanceAttribute.op holds torch.log",
    Partial: "mode: Partial.log holds torch.log",
    ClassAttribute: "mode: class attribute of ClassAttribute holds torch.log",
    DefaultArgument: "mode: a default argument of DefaultArgument.forward",
    Container: "mode: LOG_TABLE (a container used by Container.forward",
    ThroughAnObject: "mode: torch.log at ",
}


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_every_way_to_reach_a_spelling_is_guarded(cls):
    x = ZERO.clone().requires_grad_()
    safe = nanpass.harden(cls())
    out = safe(x)
    out.sum().backward()
    assert torch.isfinite(safe(ZERO)).all()  # a name the first call's survey learned: verified
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert safe.interception.startswith(CASES[cls])
    assert [c.op for c in safe.changes if c.action == "guarded"], "no guard ran"
    mode = nanpass.harden(cls(), fast=False)
    assert torch.equal(mode(ZERO), safe(ZERO))
    assert mode.interception == "mode: fast=False"


def _swapped_names():
    return {(id(ns), name): getattr(ns, name) for ns in _fastpath._namespaces()
            for name in (dir(ns) if ns is torch.Tensor else list(vars(ns)))
            if _fastpath._key(getattr(ns, name, None)) is not None}


def test_every_name_is_its_own_again_after_the_call_and_after_an_error():
    before, tensor_dict = _swapped_names(), dict(vars(torch.Tensor))
    globals_before = prebound_log

    class Fails(nn.Module):
        def forward(self, x):
            prebound_log(x)
            raise ValueError("boom")

    nanpass.harden(FromImport())(ZERO)
    with pytest.raises(ValueError, match="boom"):
        nanpass.harden(Fails())(ZERO)
    assert _swapped_names() == before and dict(vars(torch.Tensor)) == tensor_dict
    assert globals()["prebound_log"] is globals_before is torch.log
    assert torch.log(ZERO).isinf().all() and ZERO.log().isinf().all() and (1 / ZERO).isinf().all()


def test_where_a_class_has_a_tag_budget_tensor_is_never_modified(monkeypatch):
    """Setting a class attribute clears its attribute-cache version tag; from CPython 3.13 a
    class that used 1,000 tags is never cached again: there harden runs under the mode and
    leaves Tensor alone."""
    capi = pytest.importorskip("_testcapi")
    if not hasattr(capi, "type_get_version"):
        pytest.skip("this CPython cannot read a type's version tag")
    monkeypatch.setattr(_fastpath, "TAG_LIMITED", True)
    safe = nanpass.harden(Method())
    ZERO.view(3)  # a lookup gives Tensor a tag
    tag = capi.type_get_version(torch.Tensor)
    for _ in range(3):
        assert torch.isfinite(safe(ZERO)).all()
    ZERO.view(3)
    assert capi.type_get_version(torch.Tensor) == tag != 0
    assert safe.interception.startswith("mode: Python 3.13+ stops caching")


def test_plain_code_compiles_as_before_next_to_the_swap():
    nanpass.harden(Method())(ZERO)

    def plain(x):
        return x.log() + x / x + 1 / x + x.softmax(-1) + x ** 0.5

    torch._dynamo.reset()
    got = torch.compile(plain, backend="aot_eager", fullgraph=True)(ZERO)
    assert torch.equal(got.isnan(), plain(ZERO).isnan()) and got.isnan().all()  # unguarded, as written


def test_a_patch_made_after_import_is_kept_and_its_calls_are_guarded(monkeypatch):
    seen = []
    original = torch.log

    def traced_log(x):
        seen.append(1)
        return original(x)

    monkeypatch.setattr(torch, "log", traced_log)

    class UsesPatched(nn.Module):
        def forward(self, x):
            return torch.log(x)

    safe = nanpass.harden(UsesPatched())
    assert torch.isfinite(safe(ZERO)).all() and seen == [1]
    assert torch.log is traced_log


class Calls(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.n = n

    def forward(self, x):
        for _ in range(self.n):
            x = torch.relu(x) + 1
        return x.log()


def _nanpass_calls(model, x) -> int:
    count = [0]
    prefix = nanpass.__file__.rsplit("/", 1)[0]

    def prof(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            count[0] += 1

    model(x)  # the first call (and its survey) is over
    sys.setprofile(prof)
    try:
        model(x)
    finally:
        sys.setprofile(None)
    return count[0]


def test_calls_the_table_does_not_name_never_enter_python():
    x = torch.ones(4)
    few, many = (_nanpass_calls(nanpass.harden(Calls(n), watch=None), x) for n in (2, 50))
    assert few == many  # 144 more relu and add calls: not one more Python frame of nanpass
    mode = [_nanpass_calls(nanpass.harden(Calls(n), watch=None, fast=False), x) for n in (2, 50)]
    assert mode[1] > mode[0] + 100  # the mode runs its handler for each


def test_other_threads_run_as_written_during_a_hardened_call():
    inside, done = threading.Event(), threading.Event()
    got = {}

    class Waits(nn.Module):
        def forward(self, x):
            inside.set()
            assert done.wait(10)
            return torch.log(x)

    def plain():
        assert inside.wait(10)
        got["plain"] = torch.log(ZERO)
        done.set()

    t = threading.Thread(target=plain)
    t.start()
    got["hardened"] = nanpass.harden(Waits())(ZERO)
    t.join()
    assert got["plain"].isinf().all() and torch.isfinite(got["hardened"]).all()


def test_a_call_the_swap_missed_on_an_unsampled_call_is_found_at_the_next_sample():
    """The hole the survey leaves, as documented (docs/architecture.md, "The fast path"): a
    branch first taken on an unsampled call, reaching a spelling through an object the scan
    does not read, runs unguarded there; the next sampled call guards it, warns, and the model
    stays under the mode."""

    class Late(nn.Module):
        def forward(self, x, late=False):
            return REGISTRY.get("log")(x) if late else x.exp()

    safe = nanpass.harden(Late(), watch=3)
    safe(ZERO)
    assert safe.interception == "swap"
    assert safe(ZERO, late=True).isinf().all()  # call 2: unsampled, unguarded
    with pytest.warns(nanpass.GuardWarning, match=r"^nanpass: torch.log at .*test_fastpath.py:\d+ is called "
                      r"from code the scan of the model did not reach; the calls before this one may"):
        assert torch.isfinite(safe(ZERO, late=True)).all()  # call 3: sampled
    assert torch.isfinite(safe(ZERO, late=True)).all()  # call 4: surveyed again, the swap missed
    assert safe.interception.startswith("mode: torch.log at ")
    assert torch.isfinite(safe(ZERO, late=True)).all()


def test_fast_is_a_bool():
    with pytest.raises(nanpass.ConfigError, match=r"^nanpass: fast "):
        nanpass.harden(FromImport(), fast="yes")


def _train_step(model, batch):
    torch.manual_seed(3)
    for p in model.parameters():
        p.grad = None
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "t5", "mixtral", "vit"])
def test_real_models_take_the_swap_and_match_the_mode_bit_for_bit(name):
    """Hugging Face's own code: no spelling reached where the swap cannot see it, and the same
    loss, gradients and guarded sites as under the mode."""
    from tests import hf_models

    model, batch = hf_models.build(name)
    fast, mode = nanpass.harden(model), nanpass.harden(model, fast=False)
    got, want = _train_step(fast, batch), _train_step(mode, batch)
    assert fast.interception == "swap"
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True) if a is not None)

    def sites(h):
        return {(c.op, c.module, c.source, c.action) for c in h.changes}

    assert sites(fast) == sites(mode)


def test_a_compiled_region_inside_a_hardened_call_is_guarded():
    class Inner(nn.Module):
        def forward(self, x):
            return torch.log(x) + x / x

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.compile(Inner(), backend="aot_eager")

        def forward(self, x):
            return self.inner(x) * 2

    torch._dynamo.reset()
    x = ZERO.clone().requires_grad_()
    safe = nanpass.harden(Outer())
    out = safe(x)
    out.sum().backward()
    assert safe.interception.startswith("mode: inner is torch.compile'd")
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    assert torch.compile(lambda t: torch.log(t), backend="aot_eager", fullgraph=True)(ZERO).isinf().all()


def _rsqrt_helper(x):
    return x.rsqrt()


class _Helpers:
    def __init__(self):
        self.fns = {"f": _rsqrt_helper}


HELPERS = _Helpers()


class Learns(nn.Module):  # its Tensor method lives where the scan does not look
    def forward(self, x):
        return HELPERS.fns["f"](x)


def test_a_tensor_method_the_scan_did_not_see_is_swapped_from_the_survey_on():
    import warnings

    safe = nanpass.harden(Learns(), watch=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.isfinite(safe(ZERO)).all()  # the first call's survey guards it
        assert torch.isfinite(safe(ZERO)).all()  # then its stand-in does
    assert safe.interception == "swap"
    assert "rsqrt" in {s.name for s in safe._nanpass_sites._swaps if s.where is torch.Tensor}
