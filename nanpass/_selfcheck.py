"""The rule table's own bad operands, run through their guards on the running torch.

A guard is finite by construction only on the torch its construction was tested on: a torch
whose autograd, a composite's decomposition or a kernel's rounding differs can make a guard
quietly non-finite (issue 37: five guards gave NaN gradients on torch 2.11 with no error).
So on a torch outside ``_compat.TESTED`` (and in the test suite, on every tested one) the
first ``harden``, backend or ``enable`` use runs each rule's ``Sample.bad`` operands through
its guard, eagerly, in every dtype the sample names: finite values, finite gradients and, where
the sample asks, finite second derivatives. A rule that fails is refused with a ``nanpass:``
error naming the op and the torch, never used; ``selfcheck=False`` skips the check, and
``exclude_ops=[...]`` leaves the op alone. The verdicts are kept for the process (about a
second of work, once).
"""

from __future__ import annotations

import os
import queue
import threading
import warnings
from dataclasses import dataclass

import torch

from ._compat import TESTED, torch_release
from ._config import _consts_fn
from ._errors import NanpassError
from ._rule import Rule
from ._rules import RULES

# inference fast paths, reached only as dynamo captures nn.MultiheadAttention in eval + no_grad:
# their operands are a dozen internals (tests/test_contract.py tests them as such)
NO_SAMPLE = frozenset({"mha_fast_path", "encoder_layer_fast_path"})
ENV = "NANPASS_SELFCHECK"  # "1": check on a tested torch too (the test suite sets it)


class SelfCheckError(NanpassError, RuntimeError):
    """A guard is not finite on the running torch: the message names the op and the torch."""


@dataclass(frozen=True)
class Failure:
    rule: str
    dtype: torch.dtype
    what: str  # "value", "gradient", "second derivative" or "error: ..."

    def __str__(self) -> str:
        return f"{self.rule} ({str(self.dtype)[6:]}: non-finite {self.what})" if not \
            self.what.startswith("error") else f"{self.rule} ({str(self.dtype)[6:]}: {self.what})"


def spelling(rule: Rule):
    """The spelling a rule's sample is written for: its module for attention, else a function."""
    kind = "module" if rule.name == "multi_head_attention" else "function"
    return next(s for s in rule.spellings() if s.kind == kind)


def callables(rule: Rule, dtype: torch.dtype, consts=None):
    """(guarded, original): both take the rule's sample operands in ``dtype``."""
    from ._rewrite import guard_fn  # the layer above: the guard as a rewritten node calls it

    sp = spelling(rule)
    if consts is None and rule.constants:
        consts = _consts_fn(rule.name, ())  # the defaults, as make_config's
    g = guard_fn(rule, sp, consts)  # built afresh: the rule's guard as it is now
    if sp.kind != "module":
        return g, sp.call
    torch.manual_seed(0)
    mod = sp.target(*rule.sample.ctor[sp.name]).to(dtype)

    def guarded(*a, **k):
        return g(mod, *a, **k)

    return guarded, mod


def floats(out) -> list:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point()]


def leaves(args, kwargs) -> list:
    held, out = {}, []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.requires_grad and id(a) not in held:
            held[id(a)] = a
            out.append(a)
    return out


def grads(fn, args, kwargs, create_graph=False):
    """(float outputs, leaves, the gradient of their sum per leaf, zeros where unused)."""
    torch.manual_seed(0)  # ops that sample (gumbel_softmax) draw the same noise each run
    outs = floats(fn(*args, **kwargs))
    ls = leaves(args, kwargs)
    used = [o for o in outs if o.requires_grad]
    if not used or not ls:
        return outs, ls, [torch.zeros_like(x) for x in ls]
    loss = sum(o.float().sum() for o in used)
    gs = torch.autograd.grad(loss, ls, create_graph=create_graph, allow_unused=True)
    return outs, ls, [g if g is not None else torch.zeros_like(x) for g, x in zip(gs, ls, strict=True)]


def seconds(gs, ls) -> list:
    """The gradient of the sum of the first derivatives (those that carry a graph)."""
    carried = [g for g in gs if g.requires_grad]
    if not carried:
        return []
    hess = torch.autograd.grad(sum(g.float().sum() for g in carried), ls, allow_unused=True)
    return [h for h in hess if h is not None]


def finite(ts) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in ts)


def check_rule(rule: Rule, dtype: torch.dtype) -> Failure | None:
    """The rule's bad operands through its guard in ``dtype``: None where all is finite."""
    try:
        guarded, _ = callables(rule, dtype)
        args, kwargs = rule.sample.bad(dtype)
        second = rule.sample.second_order
        outs, ls, gs = grads(guarded, args, kwargs, create_graph=second)
        if not finite(outs):
            return Failure(rule.name, dtype, "value")
        if not finite(gs):
            return Failure(rule.name, dtype, "gradient")
        if second and not finite(seconds(gs, ls)):
            return Failure(rule.name, dtype, "second derivative")
    except Exception as e:  # a guard that raises on its own operands is refused as well
        return Failure(rule.name, dtype, f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return None


def checked_rules() -> list[Rule]:
    return [r for r in RULES if r.guarded and r.sample is not None and r.name not in NO_SAMPLE]


def run_selfcheck(rules=None) -> dict[str, list[Failure]]:
    """Every guarded rule's bad sample in each of its dtypes: rule name -> its failures."""
    failed: dict[str, list[Failure]] = {}
    with torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the samples' own (std of one value: no dof)
        for rule in checked_rules() if rules is None else rules:
            for dtype in rule.sample.dtypes:
                f = check_rule(rule, dtype)
                if f is not None:
                    failed.setdefault(rule.name, []).append(f)
    return failed


_VERDICT: dict[str, list[Failure]] | None = None
_LOCK = threading.Lock()


def wanted(option: bool | None) -> bool:
    """Whether the check runs: the option where given; by default on an untested torch, or
    where ``NANPASS_SELFCHECK=1``."""
    if option is not None:
        return option
    if os.environ.get(ENV, "") not in ("", "0"):
        return True
    return torch_release() not in [torch_release(v) for v in TESTED]


class _Worker:
    """nanpass's own thread, kept for the process, that runs the check where no mode of the
    caller's (a nanpass check already on, a user's dispatch mode) sees its calls.

    It never ends: a thread that ran a backward frees torch's thread-local Python objects as
    it ends, after ``join`` has returned, and on torch 2.12 that races the interpreter's exit
    and aborts the process ("terminate called without an active exception"; torch 2.13 erases
    the object, ``torch/autograd/graph.py``). Idle, it waits on a queue without the GIL and
    ends with the process."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def call(self, fn):
        if self._thread is None or not self._thread.is_alive():  # (first use, or a forked child)
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._serve, name="nanpass-selfcheck",
                                            daemon=True)
            self._thread.start()
        done: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs.put((fn, done))
        ok, value = done.get()
        if not ok:
            raise value
        return value

    def _serve(self):
        while True:
            fn, done = self._jobs.get()
            try:
                done.put((True, fn()))
            except BaseException as e:  # (handed to the caller, who raises it)
                done.put((False, e))


_WORKER = _Worker()


def _run_forked_rng():
    with torch.random.fork_rng(devices=[]):
        return run_selfcheck()


def failures() -> dict[str, list[Failure]]:
    """The process's verdicts, computed on first use in nanpass's own thread (``_Worker``),
    with the random state put back as it was (the samples seed it)."""
    global _VERDICT
    with _LOCK:
        if _VERDICT is None:
            try:
                _VERDICT = _WORKER.call(_run_forked_rng)
            except Exception as e:
                raise SelfCheckError("nanpass: the self-check of the guards failed to run "
                                     f"({type(e).__name__}: {e}); selfcheck=False skips it") from e
        return _VERDICT


def forget() -> None:
    """Drop the kept verdicts (a test that breaks a guard on purpose checks again)."""
    global _VERDICT
    with _LOCK:
        _VERDICT = None


GUARDING_MODES = ("guard", "guard+check")


def refuse_broken_guards(config) -> None:
    """Refuse the ops ``config`` guards whose guard is not finite on this torch."""
    if config.mode not in GUARDING_MODES or not wanted(config.selfcheck):
        return
    bad = {name: f for name, f in failures().items() if name in config.ops}
    if not bad:
        return
    names = sorted(bad)
    detail = "; ".join(", ".join(str(x) for x in bad[n]) for n in names)
    raise SelfCheckError(
        f"nanpass: on torch {torch.__version__} the guard of {', '.join(names)} is not finite on "
        f"its own bad operands ({detail}); nanpass is tested on torch {TESTED[0]} to {TESTED[-1]}. "
        f"Leave the op unguarded with exclude_ops={names!r}, or skip this check with "
        f"selfcheck=False"
    )
