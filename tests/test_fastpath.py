"""Guard mode's stand-ins (nanpass/_fastpath.py): the table's spellings replaced once, at
``import nanpass``, by functions that guard inside a hardened call and are torch's own
everywhere else. Every way a model's code can reach a spelling is guarded, whichever thread,
nesting or order of first calls, or the model runs under the mode and says why; outside a
hardened call every tool sees torch's function."""

from __future__ import annotations

import functools
import operator
import pickle
import sys
import threading
import types
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanpass
from nanpass import _fastpath

ZERO = torch.zeros(3)
# torch's own log, as a module imported before nanpass holds it (``from torch import log``)
RAW_LOG = torch.log.__wrapped__
LOG_TABLE = {"log": RAW_LOG}


class Registry:
    def __init__(self):
        self.fns = {"log": RAW_LOG}

    def get(self, name):
        return self.fns[name]


REGISTRY = Registry()


def _closure():
    op = RAW_LOG

    def run(x):
        return op(x)

    return run


class FromImport(nn.Module):
    def forward(self, x):
        return RAW_LOG(x)


class Closure(nn.Module):
    run = staticmethod(_closure())

    def forward(self, x):
        return self.run(x)


class InstanceAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.op = torch.log.__wrapped__  # (RAW_LOG itself is rebound by FromImport's scan)

    def forward(self, x):
        return self.op(x)


class Partial(nn.Module):
    def __init__(self):
        super().__init__()
        self.log = functools.partial(torch.log.__wrapped__)

    def forward(self, x):
        return self.log(x)


class DefaultArgument(nn.Module):
    def forward(self, x, op=RAW_LOG):
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


CASES = {  # model holding torch's own log (taken before import nanpass) -> how it is intercepted
    FromImport: "swap", Closure: "swap", Method: "swap",
    InstanceAttribute: "mode: InstanceAttribute.op holds torch.log",
    Partial: "mode: Partial.log holds torch.log",
    DefaultArgument: "mode: a default argument of DefaultArgument.forward",
    Container: "mode: LOG_TABLE (a container used by Container.forward",
    ThroughAnObject: "mode: torch.log at ",
}


@pytest.mark.parametrize("cls", list(CASES), ids=lambda c: c.__name__)
def test_a_reference_taken_before_import_is_guarded_or_sends_the_model_to_the_mode(cls):
    x = ZERO.clone().requires_grad_()
    safe = nanpass.harden(cls())
    out = safe(x)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(x.grad).all()
    for _ in range(3):  # unsampled calls too
        assert torch.isfinite(safe(ZERO)).all()
    assert safe.interception.startswith(CASES[cls])
    assert [c.op for c in safe.changes if c.action == "guarded"], "no guard ran"
    mode = nanpass.harden(cls(), fast=False)
    assert torch.equal(mode(ZERO), safe(ZERO))
    assert mode.interception == "mode: fast=False"


# -- the spellings a model reaches on a later, unsampled call (issue 44) ---------------------
class Switch(nn.Module):
    """Its first call is safe and plain; ``how`` then picks the construct each later call
    reaches ``log(0)`` (or ``0 / 0``) through."""

    def __init__(self):
        super().__init__()
        self.how = None

    def forward(self, x):
        return _REACH[self.how](self, x) if self.how else x + 1


_PARTIAL = functools.partial(torch.log)
_SET = {torch.log}
_helpers = types.ModuleType("nanpass_test_helpers")
_helpers.inner = types.ModuleType("nanpass_test_helpers.inner")
exec("import torch\ndef deep(x):\n    return torch.log(x)\n", _helpers.inner.__dict__)
_REACH = {
    "operator.truediv": lambda self, x: operator.truediv(x, x),
    "partial": lambda self, x: _PARTIAL(x),
    "set": lambda self, x: next(iter(_SET))(x),
    "distributions": lambda self, x: torch.distributions.Normal(x, x, validate_args=False).entropy(),
    "two packages deep": lambda self, x: _helpers.inner.deep(x),
    "attribute set later": lambda self, x: self.act(x),
    "subclass": lambda self, x: torch.log(x.as_subclass(_Sub)),
}


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize("how", list(_REACH))
def test_a_spelling_first_reached_on_an_unsampled_call_is_guarded(how):
    model = Switch()
    safe = nanpass.harden(model)
    safe(ZERO)  # the first (surveyed) call takes the plain branch
    model.how = how
    if how == "attribute set later":
        safe.act = torch.log
    plain = _REACH[how](model, ZERO.clone())
    assert not torch.isfinite(plain).all()
    for _ in range(3):  # calls 2..4: none sampled
        assert torch.isfinite(safe(ZERO)).all(), how
    assert safe.interception == "swap"


def test_hooks_and_a_replaced_forward_added_after_the_first_call_are_guarded():
    model = Switch()
    safe = nanpass.harden(model)
    safe(ZERO)
    model.register_forward_hook(lambda m, args, out: torch.log(out - out))
    assert torch.isfinite(safe(ZERO)).all()
    model.forward = types.MethodType(lambda self, x: torch.log(x), model)
    assert torch.isfinite(safe(ZERO)).all()


def test_hooks_registered_on_the_hardened_module_run_guarded():
    safe = nanpass.harden(Switch())
    seen = {}
    safe.register_forward_pre_hook(lambda m, args: seen.setdefault("pre", torch.log(args[0] * 0)))
    safe.register_forward_hook(lambda m, args, out: seen.setdefault("post", out / (out - out)))
    safe(ZERO)
    assert torch.isfinite(seen["pre"]).all() and torch.isfinite(seen["post"]).all()
    mode = nanpass.harden(Switch(), fast=False)
    mode.register_forward_hook(lambda m, args, out: torch.log(out * 0))
    assert torch.isfinite(mode(ZERO)).all()


def test_a_library_that_wraps_a_torch_function_after_import_keeps_its_wrapper_and_is_guarded(monkeypatch):
    seen = []
    own = torch.log
    monkeypatch.setattr(torch, "log", lambda x: (seen.append(1), own(x))[1])

    class UsesPatched(nn.Module):
        def forward(self, x):
            return torch.log(x)

    safe = nanpass.harden(UsesPatched())
    for _ in range(3):
        assert torch.isfinite(safe(ZERO)).all()
    assert seen == [1, 1, 1] and safe.interception == "swap"
    assert torch.log(ZERO).isinf().all()  # outside: the wrapper, then torch's log


# -- threads and nesting --------------------------------------------------------------------
class Waits(nn.Module):
    def __init__(self, barrier):
        super().__init__()
        self.barrier = barrier

    def forward(self, x):
        self.barrier.wait(10)
        return RAW_LOG(x) + torch.log(x) + x / x


def _in_threads(fns):
    got, errors = {}, []

    def run(k, fn):
        try:
            got[k] = fn()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(k, fn)) for k, fn in enumerate(fns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    return [got[k] for k in range(len(fns))]


def test_one_model_called_from_two_threads_at_once_is_guarded_on_every_call():
    barrier = threading.Barrier(2)
    safe = nanpass.harden(Waits(barrier))
    for _ in range(3):
        outs = _in_threads([lambda: safe(ZERO), lambda: safe(ZERO)])
        assert all(torch.isfinite(o).all() for o in outs)
    barrier2 = threading.Barrier(1)
    safe.original.barrier = barrier2
    assert torch.isfinite(safe(ZERO)).all()


def test_a_second_model_first_called_while_another_thread_runs_a_hardened_call():
    barrier = threading.Barrier(2)
    first, second = nanpass.harden(Waits(barrier)), nanpass.harden(Waits(barrier))
    outs = _in_threads([lambda: first(ZERO), lambda: second(ZERO)])
    assert all(torch.isfinite(o).all() for o in outs)
    second.original.barrier = first.original.barrier = threading.Barrier(1)
    assert torch.isfinite(second(ZERO)).all() and torch.isfinite(first(ZERO)).all()


def test_other_threads_run_as_written_during_a_hardened_call():
    inside, done = threading.Event(), threading.Event()
    got = {}

    class Holds(nn.Module):
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
    got["hardened"] = nanpass.harden(Holds())(ZERO)
    t.join()
    assert got["plain"].isinf().all() and torch.isfinite(got["hardened"]).all()


class Teacher(nn.Module):
    def forward(self, x):
        return RAW_LOG(x) + torch.log(x)


class Student(nn.Module):
    def __init__(self, teacher):
        super().__init__()
        self.teacher = teacher

    def forward(self, x):
        return self.teacher(x) + torch.log(x)


@pytest.mark.parametrize("fast", [True, False])
def test_a_teacher_first_called_inside_a_hardened_student_is_guarded_with_its_own_constants(fast):
    teacher = nanpass.harden(Teacher(), fast=fast, constants={"log": {"lo": 1e-3}})
    student = nanpass.harden(Student(teacher))
    want = 2 * torch.log(torch.tensor(1e-3))
    for _ in range(3):
        out = student(ZERO)
        t = teacher(ZERO)
        assert torch.isfinite(out).all()
        assert torch.allclose(t, want.expand(3))  # the teacher's own lo, not the student's
    inner = {}

    class Outer(nn.Module):
        def forward(self, x):
            inner["t"] = teacher(x)
            return torch.log(x)

    nanpass.harden(Outer())(ZERO)
    assert torch.allclose(inner["t"], want.expand(3))


# -- outside a hardened call, torch is torch ------------------------------------------------
def test_outside_a_hardened_call_the_stand_ins_are_torch_to_every_tool():
    nanpass.harden(InstanceAttribute())(ZERO)  # a model that fell back to the mode
    assert torch.log(ZERO).isinf().all() and ZERO.log().isinf().all() and (1 / ZERO).isinf().all()
    for f in (torch.log, torch.Tensor.log, F.softmax, torch.Tensor.__truediv__):
        assert pickle.loads(pickle.dumps(f)) is f
    import inspect

    assert inspect.signature(F.softmax) == inspect.signature(F.softmax.__wrapped__)

    @torch.jit.script
    def scripted(x):
        return torch.log(x) + F.softmax(x, -1) + x.log() + x / 2

    assert torch.equal(scripted(torch.ones(3)), torch.log(torch.ones(3)) + F.softmax(torch.ones(3), -1) + 0.5)


def test_a_module_that_caches_a_spelling_in_its_forward_saves_and_scripts():
    import io

    model = Caches()
    nanpass.harden(model)(ZERO)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).act is F.log_softmax

    class Scripts(nn.Module):
        def forward(self, x):
            return torch.jit.script(_scripted_log)(x)

    assert torch.isfinite(nanpass.harden(Scripts())(torch.ones(3))).all()


class Caches(nn.Module):
    def forward(self, x):
        self.act = F.log_softmax
        return self.act(x, -1)


def _scripted_log(x):
    return torch.log(x)


def test_a_patch_in_another_thread_during_a_hardened_call_is_undone_as_written():
    inside, patched, done = threading.Event(), threading.Event(), threading.Event()
    before = torch.log

    class Holds(nn.Module):
        def forward(self, x):
            inside.set()
            assert patched.wait(10)
            return torch.log(x)

    def patch():
        assert inside.wait(10)
        with mock.patch.object(torch, "log", lambda x: x):
            patched.set()
            assert done.wait(10)

    t = threading.Thread(target=patch)
    t.start()
    nanpass.harden(Holds())(ZERO)
    done.set()
    t.join()
    assert torch.log is before


def test_a_class_with_a_reflected_operator_meets_a_tensor():
    class Units:
        def __rtruediv__(self, other):
            return "units"

    class Divides(nn.Module):
        def forward(self, x):
            return x / Units()

    assert nanpass.harden(Divides())(ZERO) == "units"
    assert nanpass.harden(Divides(), fast=False)(ZERO) == "units"


@pytest.mark.parametrize("fast", [True, False])
def test_a_distribution_keeps_every_bit_on_a_safe_input(fast):
    """Kumaraswamy's log_prob runs ``1 / exponent`` and then ``exponent * y / x`` at one
    instruction of torch's transforms: the reflected and the plain division are two sites (one
    key made the second run as ``x.reciprocal() * (exponent * y)``, other bits)."""

    class Kumaraswamy(nn.Module):
        def forward(self, a, b, v):
            return torch.distributions.Kumaraswamy(a, b).log_prob(v).sum()

    torch.manual_seed(0)
    a, b = (torch.rand(64) + 0.5).requires_grad_(), (torch.rand(64) + 0.5).requires_grad_()
    v = torch.rand(64) * 0.8 + 0.1
    want = Kumaraswamy()(a, b, v)
    want_grads = torch.autograd.grad(want, (a, b))
    safe = nanpass.harden(Kumaraswamy(), fast=fast)
    for _ in range(2):
        got = safe(a, b, v)
        grads = torch.autograd.grad(got, (a, b))
        assert torch.equal(got, want)
        assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))


def test_tensors_attribute_cache_tag_never_moves_after_import():
    """From CPython 3.13 a class whose attributes change ~1,000 times is never cached again:
    hardened calls write nothing to Tensor."""
    capi = pytest.importorskip("_testcapi")
    if not hasattr(capi, "type_get_version"):
        pytest.skip("this CPython cannot read a type's version tag")
    safe = nanpass.harden(Method())
    ZERO.view(3)
    tag = capi.type_get_version(torch.Tensor)
    for _ in range(5):
        assert torch.isfinite(safe(ZERO)).all()
    ZERO.view(3)
    assert capi.type_get_version(torch.Tensor) == tag != 0
    assert safe.interception == "swap"


def test_plain_code_compiles_as_before_next_to_the_stand_ins():
    nanpass.harden(Method())(ZERO)

    def plain(x):
        return x.log() + x / x + 1 / x + x.softmax(-1) + x ** 0.5 + torch.log(x) + F.softmax(x, -1)

    torch._dynamo.reset()
    got = torch.compile(plain, backend="aot_eager", fullgraph=True)(ZERO)
    assert torch.equal(got.isnan(), plain(ZERO).isnan()) and got.isnan().all()  # unguarded, as written


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


def test_a_reference_in_an_object_no_scan_reads_is_found_by_the_first_call_and_said_later():
    """The hole the survey leaves, as documented (docs/architecture.md, "The stand-ins"): a
    reference to torch's own function taken before import nanpass, kept where no scan looks
    and first reached on an unsampled call, runs unguarded there; the next sampled call guards
    it, warns, and the model stays under the mode."""

    class Late(nn.Module):
        def forward(self, x, late=False):
            return REGISTRY.get("log")(x) if late else x.exp()

    safe = nanpass.harden(Late(), watch=3)
    safe(ZERO)
    assert safe.interception == "swap"
    assert safe(ZERO, late=True).isinf().all()  # call 2: unsampled, unguarded
    with pytest.warns(nanpass.GuardWarning, match=r"^nanpass: torch.log at .*test_fastpath.py:\d+ is reached "
                      r"through a reference to torch's own function taken before import nanpass"):
        assert torch.isfinite(safe(ZERO, late=True)).all()  # call 3: sampled
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
def test_real_models_take_the_stand_ins_and_match_the_mode_bit_for_bit(name):
    """Hugging Face's own code: no spelling reached past the stand-ins, and the same loss,
    gradients and guarded sites as under the mode."""
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


@pytest.mark.parametrize("fast", [True, False])
def test_opacus_expanded_weights_train_as_plain(fast):
    """Opacus's DP-SGD with grad_sample_mode="ew" (torch's ExpandedWeight, whose table of the
    functions it handles was built from torch's own before the stand-ins existed): the same
    loss and weights, bit for bit, as the plain model."""
    import warnings

    opacus = pytest.importorskip("opacus")

    x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1] * 4)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)

    def train(wrap):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.GroupNorm(2, 8), nn.Linear(8, 2))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private, opt, loader = opacus.PrivacyEngine().make_private(
                module=wrap(m), optimizer=opt, data_loader=data, noise_multiplier=0.0,
                max_grad_norm=1e6, grad_sample_mode="ew", poisson_sampling=False)
            for xb, yb in loader:
                opt.zero_grad()
                loss = F.cross_entropy(private(xb), yb)
                loss.backward()
                opt.step()
        return loss.detach(), [p.detach().clone() for p in m.parameters()]

    plain, hardened = train(lambda m: m), train(functools.partial(nanpass.harden, fast=fast))
    assert torch.equal(plain[0], hardened[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], hardened[1], strict=True))
