"""``nanpass.harden``: a module that shares the original's parameters and runs a guarded graph."""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import sys
import threading
import types
from collections.abc import Iterable, Mapping

import torch

from ._check import (
    Ahead,
    COLLECT,
    check_input,
    check_state,
    state_scalar,
    state_tensors,
    watch_backward,
)
from ._compat import functorch_active, require
from ._config import Config, dynamic_dims_of, make_config
from ._deferred import FINITE, NAN, Forward, scalar, state_of
from ._errors import ConfigError, NanpassTypeError
from ._intercept import GuardMode, Sites, run_guarded
from ._rewrite import Change, GraphRecord, summary
from ._selfcheck import refuse_broken_guards
from ._shapes import InputShapes
from ._stats import warn_fired
from ._train import quarantine_call
from ._watch import leaves
from . import _screen


class Hardened(torch.nn.Module):
    """The hardened model. Its parameters, buffers and submodules *are* the original's (the
    same registries), so ``state_dict`` keys, optimizers, ``.to()`` and module swaps carry
    over; a call runs the original's own ``__call__`` (hooks, grad mode, autocast, checkpoint,
    train/eval, side effects: all as written) with the rule table's calls guarded. Methods of
    the model's class reached through it (``generate``, ``predict``, ...) run guarded too.
    Use ``nanpass.harden`` to make one."""

    def __init__(self, model: torch.nn.Module, config: Config, shapes=None):
        super().__init__()
        d = self.__dict__
        for registry in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            d[registry] = getattr(model, registry)
        d["_nanpass_model"] = model
        d["_nanpass_config"] = config
        # the watch samples plain guard mode; count=True and the check modes say more already
        watch = config.watch if config.mode == "guard" and not config.count else None
        d["_nanpass_sites"] = Sites(model, config, watch)
        if config.mode in ("check", "warn") and "torch._dynamo" in sys.modules:
            _eagerly(_begin), _eagerly(_settle)  # (made before a trace: no graph break at them)
        d["_nanpass_shapes"] = shapes  # (examples, dynamic dims) when shape_checks=True
        d["_nanpass_inputs"] = None
        if shapes is not None:
            d["_nanpass_inputs"] = InputShapes(inspect.signature(model.forward), *shapes)
        d["forward"] = _signed(self, model)

    def forward(self, *args, **kwargs):
        model = self._nanpass_model
        config = self._nanpass_config
        if torch.jit.is_tracing():
            raise _torchscript("torch.jit.trace")
        if config.mode == "off":
            return model(*args, **kwargs)
        if self._nanpass_inputs is not None:
            self._nanpass_inputs.check(model, args, kwargs)
        if config.quarantine:
            return quarantine_call(self._forward_mode, args, kwargs)
        return self._forward_mode(*args, **kwargs)

    # hooks registered on the hardened module itself run inside the hardened call: the user
    # registered them on the model they train (wrapped here, not in _call_impl: a frame of
    # nanpass's around every call would be one more for dynamo to split at a graph break)
    def register_forward_pre_hook(self, hook, *args, **kwargs):
        return super().register_forward_pre_hook(self._guarded_hook(hook), *args, **kwargs)

    def register_forward_hook(self, hook, *args, **kwargs):
        return super().register_forward_hook(self._guarded_hook(hook), *args, **kwargs)

    def register_full_backward_pre_hook(self, hook, *args, **kwargs):
        return super().register_full_backward_pre_hook(self._guarded_hook(hook), *args, **kwargs)

    def register_full_backward_hook(self, hook, *args, **kwargs):
        return super().register_full_backward_hook(self._guarded_hook(hook), *args, **kwargs)

    def _guarded_hook(self, hook):
        if self._nanpass_config.mode not in ("guard", "guard+check"):
            return hook
        return _guarded_method(self._nanpass_sites, hook)

    def _forward_mode(self, *args, **kwargs):
        sites = self._nanpass_sites
        mode = self._nanpass_config.mode
        watch = sites.checker
        if torch.compiler.is_compiling():  # (first: a traced ContextVar read graph-breaks)
            if watch is not None and watch.deferring:  # (a plain attribute: dynamo reads it)
                return self._compiled_once(args, kwargs)
        elif watch is not None and watch.deferred and watch.pending is None and COLLECT.get() is None \
                and not functorch_active():
            if watch.later:
                _screen.drop_later(watch)
            if watch.screening and sites.calls:  # (the first call at every op: it records the
                return _screen.forward(self, args, kwargs)  # call sites the report lists)
            return self._checked_once(args, kwargs)
        if mode in ("check", "warn"):
            sites.checker.found = False
            check_state(self._nanpass_model, mode == "warn")
            names = list(inspect.signature(self._nanpass_model.forward).parameters)
            for i, a in enumerate(args):
                check_input(a, names[i] if i < len(names) else f"args[{i}]", mode == "warn")
            for k, v in kwargs.items():
                check_input(v, k, mode == "warn")
        if mode == "guard+check":
            before = [c.calls for c in sites.counters]
            out = run_guarded(sites, self._nanpass_model, args, kwargs)
            counters = list(sites.counters)  # a first call adds sites
            warn_fired(counters, before + [0] * (len(counters) - len(before)))
            return out
        out = run_guarded(sites, self._nanpass_model, args, kwargs)
        if sites.checker is not None and not torch.compiler.is_compiling():
            # never silent: a NaN or Inf that reaches the output is named, made where it may
            outs = leaves(out)
            sites.checker.escaped(outs, f"the output of {type(self._nanpass_model).__name__}")
            if torch.is_grad_enabled():
                sites.checker.watch_output_grads(outs, "the model's output")
        return out

    def _checked_once(self, args, kwargs):
        """Check mode with its verdicts on the device (``_deferred.py``): one read after the
        forward; only where it finds something to report, the forward runs again from the same
        random state with the check at each op, which names it as ``stop_at_op=True`` does."""
        sites, model = self._nanpass_sites, self._nanpass_model
        watch = sites.checker
        watch.found = False
        rng = _rng_state()
        step = Forward()
        state = state_tensors(model)
        if state:
            k = step.add(state[0], state_scalar(state))
            step.reasons.append(k)
            for t in state:  # an operand that is a parameter or buffer: the state's slot
                step.name(t, k)
        for t in leaves((args, kwargs)):
            if _float_value(t):
                step.nan_reasons.append(step.add(t))  # a NaN in the data is the data's
        watch.pending = step
        try:
            out = run_guarded(sites, model, args, kwargs)
        finally:
            watch.pending = None
        outs = leaves(out)
        for o in outs:
            if _float_value(o):
                k = step.get(o)
                step.reasons.append(k if k is not None else step.add(o))
        verdict = step.verdict()  # the one read
        if verdict is not None:
            self._check_again(args, kwargs, rng, verdict)
        if torch.is_grad_enabled():
            watch.watch_output_grads(outs, "the model's output")
        return out

    def _compiled_once(self, args, kwargs):
        """``torch.compile(harden(m, mode="check"))``: the compiled forward collects one scalar
        per new value (``_intercept._noted``) with the inputs' and the outputs', and hands them,
        in one tensor, to ``_settle``, which runs eagerly after the graph and reads them once.
        Two graph breaks: before the forward (its random state, for a run again) and after.
        (Eager check mode keeps a record per call and a hook per autograd node instead, which
        also see a gradient penalty's second backward; ``_deferred.py``.)"""
        rng = _eagerly(_begin)()
        sites, model = self._nanpass_sites, self._nanpass_model
        noted: list = []
        out = run_guarded(sites, model, args, kwargs, noted)
        # (no scalar of the state: a NaN already in a parameter is seen in what the ops that
        # read it make, and the run again names the parameter; one over every parameter cost
        # 13% of a compiled GPT-2 step on the CPU)
        head = [scalar(o).view(1) for o in leaves(out) if _float_value(o)]
        data = [scalar(t).view(1) for t in leaves((args, kwargs)) if _float_value(t)]
        every = [*head, *data, *noted]
        if every:  # (one device: a CPU input the model moves to the GPU itself)
            every = torch.cat([s.to(every[-1].device) for s in every])
        return _eagerly(_settle)(self, rng, every if len(every) else None, len(head), len(data), out,
                                 args, kwargs)

    def _check_again(self, args, kwargs, rng, verdict: str | None, backward=None, kept=None,
                     saw: str | None = None):
        """The forward again with the check at each op, from the first run's random state; the
        buffers it writes (a batch norm's running statistics) are put back as the first run
        left them, and the random state as it was after the first run. ``backward(out)`` runs
        its backward, checked at each node too."""
        watch, model = self._nanpass_sites.checker, self._nanpass_model
        after = _rng_state()
        _set_rng_state(rng)
        try:  # (its buffer writes go to copies: ``_screen.buffers_from``)
            with _screen.buffers_from(model, kept), watch.at_each_op():
                out = self._forward_mode(*args, **kwargs)
                if backward is not None:
                    backward(out)
        finally:
            _set_rng_state(after)
        if not watch.found and verdict == "definite" and saw is not None:
            _screen.not_reproduced(self, "forward", saw)
        elif not watch.found and verdict == "definite":
            watch._emit("forward", "NaN/Inf", None,
                        f"NaN or Inf in the forward of {type(model).__name__}, which its run again "
                        f"with a check at each op did not reproduce (a random draw nanpass does not "
                        f"replay, or state the forward changed); harden(model, mode="
                        f"{self._nanpass_config.mode!r}, stop_at_op=True) checks each op as it runs")

    # -- module behaviour -------------------------------------------------------------------
    def train(self, mode: bool = True):
        super().train(mode)
        self._nanpass_model.train(mode)
        return self

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        model = self.__dict__["_nanpass_model"]
        value = getattr(model, name)
        if (isinstance(value, types.MethodType) and value.__self__ is model
                and not hasattr(torch.nn.Module, name)):
            return _guarded_method(self.__dict__["_nanpass_sites"], value)
        return value

    def __setattr__(self, name: str, value) -> None:
        # safe.temperature = 0.5 must reach the model whose forward reads self.temperature
        model = self.__dict__.get("_nanpass_model")
        if model is None or name == "training" or name.startswith("_nanpass") or name in type(self).__dict__:
            super().__setattr__(name, value)
        else:
            setattr(model, name, value)

    def __delattr__(self, name: str) -> None:
        model = self.__dict__.get("_nanpass_model")
        if model is None or name.startswith("_nanpass") or name in self.__dict__:
            super().__delattr__(name)
        else:
            delattr(model, name)

    def __prepare_scriptable__(self):
        raise _torchscript("torch.jit.script")

    def __reduce__(self):
        return (_rebuild, (self._nanpass_model, self._nanpass_config, self._nanpass_shapes))

    def __deepcopy__(self, memo):
        return Hardened(copy.deepcopy(self._nanpass_model, memo), self._nanpass_config,
                        self._nanpass_shapes)

    def __repr__(self) -> str:
        return f"nanpass.Hardened({self._nanpass_model!r})"

    @property
    def __class__(self):
        """The model's class, so ``isinstance(safe, PreTrainedModel)`` holds as for the model
        (frameworks branch on it: the Trainer saves a checkpoint with ``save_pretrained``).
        ``type(safe)`` is still ``Hardened``, and so is ``isinstance(safe, nanpass.Hardened)``."""
        model = self.__dict__.get("_nanpass_model")
        return type(model) if model is not None else Hardened

    # -- what was done ----------------------------------------------------------------------
    @property
    def original(self) -> torch.nn.Module:
        return self._nanpass_model

    @property
    def nanpass_config(self) -> Config:
        """The options it was hardened with (``config`` stays the model's own, as HF's)."""
        return self._nanpass_config

    @property
    def training(self) -> bool:  # always the original's: model.eval() is seen here too
        model = self.__dict__.get("_nanpass_model")
        return model.training if model is not None else self.__dict__.get("_nanpass_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_nanpass_model")
        if model is None:  # nn.Module.__init__, before the model is attached
            self.__dict__["_nanpass_training"] = mode
        else:
            model.training = mode

    @property
    def capture(self) -> str:
        """"intercept": the forward runs as written, its unsafe calls swapped for guards."""
        return "intercept"

    @property
    def interception(self) -> str:
        """How the last eager call found the unsafe calls: "swap" (the table's stand-ins send
        them to the guards; every other call runs untouched) or "mode: <why>" (a
        TorchFunctionMode sees every call: check mode, ``fast=False``, or a spelling the model
        reaches through something the swap cannot change, named)."""
        sites = self._nanpass_sites
        if sites.checker is not None and sites.checker.screening:
            return (f"screen: check mode ({self._nanpass_config.mode}) runs the forward as written, "
                    f"checks its outputs and gradients on the device, and runs a step again with "
                    f"every call watched only where they are not finite (every_op=True watches "
                    f"every call of every step)")
        if sites.checker is not None:
            return f"mode: check mode looks at every call ({self._nanpass_config.mode})"
        return "swap" if sites.fast is None else f"mode: {sites.fast}"

    @property
    def graphs(self) -> list[GraphRecord]:
        """One record of every call site seen so far (empty before the first call)."""
        sites = self._nanpass_sites
        asserts = self._nanpass_inputs.asserts() if self._nanpass_inputs is not None else ()
        bodies = [GraphRecord("dynamo", "", "", list(sites.compiled_bodies), 0.0)] \
            if sites.compiled_bodies else []
        if not sites.calls and not asserts:
            return bodies
        return [GraphRecord("intercept", "", "", list(sites.changes), 0.0, asserts=asserts,
                            counters=tuple(sites.counters)), *bodies]

    @property
    def changes(self) -> list[Change]:
        """Every call site looked at so far, once per site, action and reason."""
        return list(self._nanpass_sites.changes)

    def summary(self) -> str:
        if not self._nanpass_sites.calls:
            return "nothing looked at yet: the call sites are found on the first call"
        return summary(self.changes)


def _torchscript(how: str) -> NanpassTypeError:
    return NanpassTypeError(
        f"nanpass: {how} cannot keep the guards (they are Python that runs around each unsafe "
        "call, and TorchScript records only the ops of one run or compiles a Python subset); "
        "use torch.export.export(nanpass.harden(model), args), which keeps them, with dynamic "
        "shapes and AOTInductor too (docs/deploy.md)")


def _signed(hardened: Hardened, model: torch.nn.Module):
    """``hardened.forward`` with the model's own signature: what frameworks read to pick their
    inputs (the Trainer's column filter, ``torch.export``'s ``dynamic_shapes``)."""

    sites, config = hardened._nanpass_sites, hardened._nanpass_config
    plain_guard = config.mode == "guard" and not config.quarantine and hardened._nanpass_inputs is None

    def forward(*args, **kwargs):
        if plain_guard and torch.compiler.is_compiling():
            # traced by dynamo: one frame between it and the model, as run_guarded traces. A
            # graph break in the model splits every frame on the way, each then a cache lookup
            # per call (GPT-2 with its loss: 4 frames and 2 resumes before; a small saving)
            sites.traced()
            with GuardMode(sites):
                return model(*args, **kwargs)
        return Hardened.forward(hardened, *args, **kwargs)

    with contextlib.suppress(TypeError, ValueError):  # a forward with no readable signature
        forward.__signature__ = inspect.signature(model.forward)
    forward.__doc__ = getattr(model.forward, "__doc__", None)
    return forward


def _rebuild(model, config, shapes):
    return Hardened(model, config, shapes)


def _guarded_method(sites, method):
    @functools.wraps(method)
    def guarded(*args, **kwargs):
        return run_guarded(sites, method, args, kwargs)

    return guarded


def harden(
    model: torch.nn.Module,
    *,
    mode: str = "guard",
    ops: Iterable[str] | None = None,
    exclude_ops: Iterable[str] = (),
    exclude: Iterable[str] = (),
    constants: Mapping[str, Mapping[str, float]] | None = None,
    stable: bool = False,
    example_inputs=None,
    shape_checks: bool = False,
    dynamic_dims: Mapping[int, str] | None = None,
    count: bool = False,
    quarantine: bool = False,
    watch: int | None = 100,
    selfcheck: bool | None = None,
    stop_at_op: bool = False,
    fast: bool = True,
    every_op: bool = False,
) -> Hardened:
    """Return ``model`` with every numerically unsafe op guarded, forward and backward.

    >>> import torch, nanpass
    >>> m = nanpass.harden(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LogSoftmax(-1)))
    >>> bool(m(torch.full((1, 4), float("-inf"))).isfinite().all())
    True

    ``ops`` / ``exclude_ops`` pick guarded ops by rule name (``nanpass.RULES``); ``exclude``
    leaves modules alone by path (``"encoder.layers.0"``); ``constants`` tightens a guard's
    bounds (``{"log": {"lo": 1e-6}}``); ``mode="off"`` runs the original forward, ``"check"`` /
    ``"warn"`` name the op where a NaN is born instead of guarding, ``"guard+check"`` guards
    and warns once per call with the guards that fired.

    The model's forward runs exactly as written (hooks, ``no_grad``/``autocast``/checkpoint
    regions, train/eval, side effects, module swaps); only the calls the rule table names are
    swapped for their guards, which are bitwise identity on safe inputs. Methods of the model's
    class called through the result (``safe.generate(...)``) are guarded too. ``stable=True``
    (stable-form rewrites, which change rounding) needs a graph: use the backend.

    ``shape_checks=True`` records the shapes of the tensor arguments from ``example_inputs``
    (the positional arguments of one call, or a list of such tuples) and checks them on every
    call (every other shape follows from them); a mismatch names the layer the input enters.
    Dims that differ between examples, or that ``dynamic_dims`` declares (default
    ``{0: "batch"}``), are free.

    ``quarantine=True`` replaces every batch row with a NaN/Inf in an input by zeros before the
    model and marks that row NaN in the outputs, for ``nanpass.finite_mean`` to drop.

    Check mode screens each step (issue 47): the forward runs as written, with nothing between
    its calls; its outputs (and a NaN in the data) are checked on the device and read once
    after it, the gradients the backward gives the parameters and inputs once when the
    backward ends. Only where one is not finite does the step run again, from the same inputs,
    random state and buffers (and the backward with the same upstream gradients), with a
    check at each op, which names the op where the NaN or Inf was born, as before. A NaN made
    and masked inside the step that reaches no output and no gradient is not seen:
    ``every_op=True`` watches every call of every step (keeping a verdict per call on the
    device, read once after the forward and once after the backward), and ``stop_at_op=True``
    reads at each op and stops there (a debugger's view; one host read per call).

    Guard mode calls each spelling's stand-in (installed once at ``import nanpass``: torch's own
    function outside a hardened call), so every other call costs nothing; ``fast=False`` runs it
    under a ``TorchFunctionMode`` that sees every call (``safe.interception`` says which runs,
    and why).

    ``selfcheck``: on a torch outside the tested releases the first use runs the rule table's
    own bad operands through the guards and refuses any guard that is not finite there (about a
    second, once); ``selfcheck=False`` skips it, ``True`` runs it on any torch.

    ``count=True`` keeps, per guard, how many elements it changed (on the device, no sync per
    op): ``nanpass.stats(model)``.

    ``watch`` (default 100): every ``watch``-th call counts what each guard changes, with one sync
    after it; a guard that changed values in three sampled calls in a row is named once in a
    ``nanpass.GuardWarning`` (finite numbers can hide a model stuck on a guard, e.g. a learned
    temperature at 0). ``watch=None`` turns it off.
    """
    if isinstance(model, Hardened):
        model = model.original
    if not isinstance(model, torch.nn.Module):
        raise NanpassTypeError(
            f"nanpass: harden() takes a torch.nn.Module, got {type(model).__name__} {model!r:.60}"
        )
    if type(model).__module__ == "torch._dynamo.eval_frame":  # OptimizedModule, without importing dynamo
        raise NanpassTypeError(
            "nanpass: harden() got a torch.compile'd module; harden the original "
            "(model._orig_mod), or compile with the nanpass backend: "
            'torch.compile(model, backend="nanpass")'
        )
    require("checkpoint_recompute", "harden (a checkpointed region's recompute re-enters the guards)")
    require("fast_path_check", "harden (nn.MultiheadAttention's fast path as plain)")
    if stable:
        raise ConfigError(
            "nanpass: harden() runs your forward as written and guards each unsafe call, so it "
            "cannot fuse several calls into a stable form (log(softmax(x)) -> log_softmax(x)); "
            "stable forms need a graph: torch.compile(model, backend=\"nanpass\", "
            "options={\"stable\": True}), or backend=nanpass.backend(inner=\"eager\", stable=True) "
            "to run it eagerly"
        )
    config = make_config(
        mode=mode, ops=ops, exclude_ops=exclude_ops, exclude=exclude, constants=constants,
        stable=stable, count=count, quarantine=quarantine, shape_checks=shape_checks, watch=watch,
        module_paths=[name for name, _ in model.named_modules()], selfcheck=selfcheck,
        stop_at_op=stop_at_op, fast=fast, every_op=every_op,
    )
    refuse_broken_guards(config)
    shapes = None
    if shape_checks:
        shapes = (_examples(example_inputs), dynamic_dims_of(dynamic_dims))
    elif example_inputs is not None or dynamic_dims is not None:
        raise ConfigError("nanpass: example_inputs and dynamic_dims are for shape_checks=True; "
                          "pass shape_checks=True, or leave them out")
    return Hardened(model, config, shapes)


def _begin() -> tuple:
    """A compiled check-mode forward's random state, read eagerly."""
    return _rng_state()


def _settle(safe: Hardened, rng, scalars, n_reasons: int, n_data: int, out, args, kwargs):
    """After a compiled check-mode forward, eagerly: its scalars read in one copy. A NaN or an
    infinity in the output, a NaN in the data, or a NaN anywhere, runs the forward
    again eagerly with the check at each op, which names the op as eager check mode does. An
    infinity elsewhere may be made on purpose (a mask): the run again decides, and a pattern
    of infinities it found quiet is not run again (the same ops non-finite, the same poles).
    The backward: one fused check of the parameters' and inputs' gradients, and on a hit the
    step again with the same upstream gradients, checked at each node. In a training loop (a
    backward reached this thread's last forward) the forward's scalars are read with the
    backward's, as it ends: one read a step."""
    watch = safe._nanpass_sites.checker
    watch.found = False
    tid = threading.get_ident()
    backed, unread = _compiled_steps(safe)
    stale = unread.pop(tid, None)
    if stale is not None and stale.scalars is not None:  # no backward reached that forward
        backed.pop(tid, None)
        stale.read_alone()
        watch.found = False

    def judge(values) -> bool:
        st = [state_of(v) for v in values]
        if all(s == FINITE for s in st):
            return False
        definite = (any(s != FINITE for s in st[:n_reasons]) or NAN in st[n_reasons:n_reasons + n_data]
                    or NAN in st[n_reasons + n_data:])
        key = tuple(st)
        if definite or key not in watch.quiet:
            born = watch.born
            safe._check_again(args, kwargs, rng, "definite" if definite else "maybe")
            if not watch.found and not definite:
                if watch.born == born:  # the eager run made no infinity: not reproduced
                    _not_reproduced(safe, "forward", "an infinity in the forward")
                elif len(watch.quiet) < _QUIET:  # made on purpose, as the eager run saw
                    watch.quiet.add(key)
        return watch.found

    if not torch.is_grad_enabled():
        if scalars is not None:
            judge(scalars.tolist())  # the one read
        return out
    model = safe._nanpass_model
    ahead = Ahead([scalars], judge) if scalars is not None and backed.get(tid) else None
    if ahead is None and scalars is not None:
        judge(scalars.tolist())  # the one read

    def inputs():  # (where the walk back from the outputs does not find the leaves)
        return ([p for p in model.parameters() if p.requires_grad]
                + [t for t in leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.requires_grad])

    def on_hit(upstream):
        def backward(again):
            _screen.backward_again(again, upstream, inputs)

        with torch.enable_grad():
            safe._check_again(args, kwargs, rng, None, backward)
        if not watch.found:
            _not_reproduced(safe, "backward", "a non-finite gradient in the backward")

    def reached():
        backed[tid] = True

    # (a model that graph-breaks made its output in its last graph: that graph's node
    # does not give the parameters' gradients of the graphs before it)
    nonleaf = [t for t in leaves((args, kwargs))
               if isinstance(t, torch.Tensor) and t.requires_grad and not t.is_leaf]
    if watch_backward(inputs, leaves(out), on_hit, watch.compiled_pending, one_graph=False,
                      nonleaf=nonleaf, ahead=ahead, reached=reached):
        if ahead is not None:
            unread[tid] = ahead
    elif ahead is not None:
        ahead.read_alone()
    return out


def _compiled_steps(safe: Hardened) -> tuple[dict, dict]:
    """Thread id -> whether a backward reached the last compiled forward there; thread id ->
    that forward's scalars, not read yet (kept on the instance: a copy or a pickle drops them)."""
    got = safe.__dict__.get("_nanpass_compiled_steps")
    if got is None:
        got = safe.__dict__["_nanpass_compiled_steps"] = ({}, {})
    return got


_QUIET = 64  # patterns of infinities made on purpose that a compiled check-mode model remembers


def _not_reproduced(safe: Hardened, phase: str, what: str) -> None:
    safe._nanpass_sites.checker._emit(
        phase, "NaN/Inf", None,
        f"{what} of the compiled {type(safe._nanpass_model).__name__}, which its run again eagerly "
        f"with a check at each op did not reproduce (a random draw the compiled graph makes "
        f"differently, or inductor's own rounding); harden(model, mode="
        f"{safe._nanpass_config.mode!r}) without torch.compile checks each op as it runs")


_EAGER: dict = {}


def _eagerly(fn):
    """``fn`` run eagerly from a compiled frame (a graph break): ``torch.compiler.disable``
    applied when first needed, since it imports dynamo, which ``import nanpass`` does not."""
    got = _EAGER.get(fn)
    if got is None:
        got = _EAGER[fn] = torch.compiler.disable(fn)
    return got


_float_value, _rng_state, _set_rng_state = _screen.float_value, _screen.rng_state, _screen.set_rng_state


def _examples(example_inputs) -> list[tuple]:
    if example_inputs is None:
        raise ConfigError("nanpass: shape_checks=True needs example_inputs: the positional "
                          "arguments of one call, e.g. example_inputs=(x,), or a list of them")
    if isinstance(example_inputs, torch.Tensor):
        return [(example_inputs,)]
    if isinstance(example_inputs, list) and all(isinstance(e, tuple) for e in example_inputs):
        return list(example_inputs)
    if isinstance(example_inputs, tuple):
        return [example_inputs]
    raise ConfigError(f"nanpass: example_inputs must be a tensor, a tuple of arguments or a list "
                      f"of tuples, got {type(example_inputs).__name__}")
