"""Everything nanpass needs from torch beyond its public API, in one place: each use is a named
``Entry`` that says what it reads from torch, which releases CI checks it on, and how its
presence is detected (by looking for the object, not by reading the version string).
``tests/test_compat.py`` lists the entries and checks each on the running torch.

Supported: the current torch release and the four before it (``TESTED``). On another torch
``import nanpass`` still works and warns once, naming that range; an entry whose object is
missing there is recorded, and the feature that needs it raises ``CompatError`` naming it
(``require``), never running unguarded in silence. Each patch changes nothing unless a
hardened call is running.

- ``checkpoint_recompute``: ``torch.utils.checkpoint`` recomputes a region in backward, outside
  the hardened call, so the recomputation would run unguarded (and differ from the forward
  where a guard fired). Both implementations look their worker up at call time, so wrapping
  it here makes the region's function re-enter the hardened call's guards on recompute.
- ``fast_path_check``: ``nn.MultiheadAttention`` and ``nn.TransformerEncoder(Layer)`` take their
  fused inference fast path only when ``torch.overrides.has_torch_function(args)`` is False,
  which any active TorchFunctionMode makes True: hardened, they would run the slow path and
  round differently. Asked while nanpass's own mode is the innermost one, the question is
  answered as without it, so the model takes the path it takes plain, and the fast-path
  kernels (``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd``)
  reach their rules.
- ``dynamo_overridable``: two tables dynamo keeps of its own (see ``_teach_dynamo``).
- ``eager_handler``: dynamo's per-code frame strategy, so that it never compiles a mode's
  ``__torch_function__`` (or what it calls) as a frame of its own where it runs eagerly.
- ``graph_mode_stack``: the graphs dynamo compiles with a nanpass mode on the stack run with
  it popped (they hold its guards already); the torch-function stack's C accessors.
- ``constant_result``: a lookup in the rule table that dynamo calls rather than traces (a
  traced dict lookup guards each key it passes, re-checked on every call of the frame).
- ``dynamo_cache_entries``: dynamo's compiled entries of a code object, so that
  ``nanpass.report(compiled)`` finds every graph of a model, after graph breaks too.
- ``inner_compiler``: the aot_eager and inductor compilers the backend hands its graph to.
- ``inductor_wrapper``: inductor as ``torch.compile(mode=..., options=...)`` runs it, so the
  backend hands ``mode="reduce-overhead"`` (CUDA graphs), max-autotune and inductor's options on.
- ``fake_mode``: a ``FakeTensorMode`` (shape checks run the model on fake tensors), quiet.
- ``sym_expr``: what a symbolic dim (``SymInt``) is built from.
- ``foreach``: the fused per-list kernels StepGuard and check mode use.
- ``function_apply``: ``autograd.Function.apply`` without its Python wrapper, which binds
  every call's arguments with ``inspect.signature``: 68 us per apply against 20 us on CPU,
  and a guard applies one per operand.
- ``functorch_active``: whether a ``torch.func`` transform is running (no ``out=`` there).
- ``entered``: a torch composite's own code past its torch-function dispatch.
- ``removed_ops``: torch keeps a raising stub for each op it removed (``torch.qr``,
  ``torch.cholesky`` since 2.14): a spelling bound to one is no spelling.
- ``function_mode_stack``: the active TorchFunctionModes, innermost last.
- ``dynamo_compile``: dynamo compiles a frame with the stand-ins paused (torch 2.11 traced a
  stand-in's body inside eager ``torch.cond``'s branches and guarded on a hardened call's sites).
- ``tracing_context`` / ``higher_order_op``: a hardened call traced by dynamo notes its frame,
  so that the bodies of the frame graph's higher-order ops (traced with the mode popped) get
  the backend's rewrite before a compiler sees them (``_bodies``).
- ``jit_builtins`` / ``dynamo_import`` / ``expanded_weights``: what the stand-ins of
  ``_fastpath`` (installed once at import) need to look like torch's own functions to
  TorchScript, to dynamo (its tables built first, a polyfill per stand-in) and to
  ExpandedWeight's table of the functions it handles.
- ``queue_callback``: check mode reads its backward verdicts once, when the backward ends.
- ``dispatch_mode`` / ``pytree`` / ``op_schema``: what certify's interval analysis reads of each
  aten call (the mode class, flattening of nested outputs, the schema's write annotations).
- ``grad_scaler``: a GradScaler's scale and growth tracker as device tensors (its
  ``state_dict()`` would read the scale back: a host sync at every SpikeGuard snapshot), and
  the per-optimizer unscale record a rewind forgets.
- ``dynamo_source``: aot_autograd asks each placeholder of a dynamo graph for its source.
- ``compile_context``: ``torch.compile`` wraps a backend in ``_TorchCompileWrapper``, which
  drops the backend's ``backend_ctx_ctor`` (the context dynamo enters around each call of the
  compiled callable): handed on for nanpass's backends, so the calls dynamo runs outside the
  graphs (graph breaks, skipped frames, past the recompile limit) are guarded.
- ``compiling_frame``: the locals of the frame dynamo is compiling, read by the backend (its
  ``self``: the instance a graph is for, and the model module paths are taken in).
- ``module_call_impl``: ``nn.Module._call_impl``, the frame ``model.compile()`` compiles.
- ``tracing_context``: whether dynamo, AOTAutograd or inductor is tracing (fake tensors reach
  the stand-ins then; they run torch's own function).
- ``clamp_grad_at_bounds``: not an internal but a public behaviour that changed: up to 2.13
  ``clamp``'s gradient is 1 at a bound, from 2.14 it is 0 (0.5 with tensor bounds). A guard's
  clamp must pass the gradient on the closed safe domain, so the guard takes ``clamp`` where
  it does and a ``where`` form where it does not (``clip`` in ``_guards``).
"""

from __future__ import annotations

import contextlib
import dis
import functools
import logging
import sys
import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint as _cp
from torch import Tensor

from ._errors import NanpassError

# the releases CI runs the fast tier on: the current one and the four before it (GPU images and
# users stay a year behind); pyproject's torch range is this one
TESTED = ("2.11", "2.12", "2.13", "2.14", "2.15")


class CompatError(NanpassError, RuntimeError):
    """A feature needs a torch internal the running torch lacks: the message names it."""


@dataclass(frozen=True)
class Entry:
    """One use of a torch internal: ``needs`` names what it reads, ``probe()`` returns the
    object(s) it uses on the running torch (raising ``AttributeError`` / ``ImportError``
    where they are missing)."""

    name: str
    needs: str
    probe: Callable[[], object]
    # probed at import; False: the probe imports dynamo or inductor (seconds), so it runs
    # where the feature is first used, and in the tests
    at_import: bool = True
    tested: tuple[str, ...] = TESTED


ENTRIES: dict[str, Entry] = {}
# entries whose probe failed on the running torch, with the reason
MISSING: dict[str, str] = {}


def entry(name: str, needs: str, at_import: bool = True):
    """Register ``probe`` as the entry ``name``."""

    def register(probe):
        ENTRIES[name] = Entry(name, needs, probe, at_import)
        return probe

    return register


def require(name: str, feature: str) -> None:
    """Raise ``CompatError`` if entry ``name`` is missing on the running torch."""
    if name not in MISSING and not ENTRIES[name].at_import:
        try:
            ENTRIES[name].probe()
        except (ImportError, AttributeError) as err:
            MISSING[name] = f"{type(err).__name__}: {err}"
    if name in MISSING:
        e = ENTRIES[name]
        raise CompatError(
            f"nanpass: {feature} needs {e.needs}, which torch {torch.__version__} lacks "
            f"({MISSING[name]}); nanpass is tested on torch {', '.join(TESTED)}")


def torch_release(version: str = torch.__version__) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _warn_untested() -> None:
    tested = [torch_release(v) for v in TESTED]
    if not tested[0] <= torch_release() <= tested[-1]:
        warnings.warn(
            f"nanpass: torch {torch.__version__} is untested; nanpass is tested on torch "
            f"{TESTED[0]} to {TESTED[-1]} (a feature whose torch internal is missing raises "
            f"nanpass.CompatError naming it)", UserWarning, stacklevel=3)


# what the layer above registers (``on_guarded_call``): this module imports nothing of nanpass
# but its errors
_HOOKS: dict = {"bind": None, "guarding": None, "bodies": None, "pause": None, "resume": None}
# C functions a TorchFunctionMode sees in eager that dynamo would not offer to a traced mode
_OFFERED: set = set()


def on_guarded_call(bind, guarding, bodies) -> None:
    """``bind(fn)``: ``fn`` made to re-enter the running hardened call's guards (or ``fn``
    itself outside one); ``guarding()``: whether nanpass's own mode is the innermost one;
    ``bodies(gm, notes, modes)``: a graph dynamo traced, before it is compiled, with the notes
    its frame's hardened calls made (``traced_with``) and the nanpass modes it was entered
    under."""
    _HOOKS["bind"], _HOOKS["guarding"], _HOOKS["bodies"] = bind, guarding, bodies


def offer_to_traced_modes(fns) -> None:
    """Dynamo hands a call to a traced TorchFunctionMode only when ``torch.overrides`` lists it
    as overridable, a list built from public names. A mode sees the private C spellings
    (``torch._weight_norm``, ``torch._lu_with_info``) in eager: dynamo must offer them too, or
    a compiled hardened model runs them unguarded."""
    _OFFERED.update(fns)


@entry("eager_handler", "torch._C._dynamo.eval_frame.set_code_exec_strategy, "
       "_FrameExecStrategy and _FrameAction.SKIP")
def _frame_exec_strategy():
    from torch._C._dynamo import eval_frame

    return eval_frame.set_code_exec_strategy, eval_frame._FrameExecStrategy, eval_frame._FrameAction.SKIP


def eager_handler(fn):
    """A mode's ``__torch_function__``, never compiled as a frame of its own. Dynamo traces it
    into each frame it compiles; but where a frame graph-breaks, the handler runs eagerly under
    dynamo's frame callback, and dynamo then compiled it (and every function it calls, the
    guards) as frames whose guards leave out ``func``: a later call with the same operands ran
    the first call's code (``x.is_complex()`` returned a tensor). SKIP, for it and the frames
    it calls: where it runs eagerly, it runs as written, as it does outside torch.compile."""
    if "eager_handler" not in MISSING:
        set_strategy, strategy, skip = _frame_exec_strategy()
        set_strategy(fn.__code__, strategy(skip, skip))
    return fn


# modes whose every effect a compiled graph already holds (dynamo traced them into it)
_TRACED_MODES: set[type] = set()


def graphs_run_outside(mode_type: type) -> None:
    """Compiled graphs that dynamo traced with a ``mode_type`` mode on the stack run with it
    popped. Where a model graph-breaks, dynamo runs each later frame with the mode entered, and
    the graph's own runtime calls (AOTAutograd's ``_is_view`` on each saved tensor, inductor's
    ``addmm(out=)``) then went through the mode's Python handler: 141 calls a GPT-2 forward,
    0.6 ms. The graph holds the guards already; the unsupported calls between graphs still run
    under the mode."""
    _TRACED_MODES.add(mode_type)


@entry("graph_mode_stack", "torch._dynamo.output_graph.OutputGraph.call_user_compiler and its "
       "torch_function_mode_stack; torch._C._len_torch_function_stack, _get_function_stack_at, "
       "_pop_torch_function_stack, _push_on_torch_function_stack", at_import=False)
def _graph_mode_stack():
    from torch._dynamo.output_graph import OutputGraph

    # an OutputGraph without torch_function_mode_stack: its graphs keep the mode, as before
    return (OutputGraph.call_user_compiler, torch._C._len_torch_function_stack,
            torch._C._get_function_stack_at, torch._C._pop_torch_function_stack,
            torch._C._push_on_torch_function_stack)


def _outside_traced_modes(fn):
    length, at, pop, push = (torch._C._len_torch_function_stack, torch._C._get_function_stack_at,
                             torch._C._pop_torch_function_stack, torch._C._push_on_torch_function_stack)

    @functools.wraps(fn)
    def run(*args, **kwargs):
        n = length()
        top = at(n - 1) if n else None
        if type(top) not in _TRACED_MODES:
            return fn(*args, **kwargs)
        pop()
        try:
            return fn(*args, **kwargs)
        finally:
            push(top)

    return run


def _patch_graph_calls(module) -> None:
    cls = module.OutputGraph
    compile_graph = cls.call_user_compiler

    @functools.wraps(compile_graph)
    def call_user_compiler(self, gm, example_inputs):
        stack = getattr(self, "torch_function_mode_stack", None) or ()
        bodies = _HOOKS["bodies"]
        if bodies is not None:  # before any compiler sees the graph
            context = _tracing_context()()
            noted = _NOTED.pop(context, ()) if context is not None else ()
            bodies(gm, noted, [m for m in stack if type(m) in _TRACED_MODES])
        fn = compile_graph(self, gm, example_inputs)
        if self.export or not any(type(m) in _TRACED_MODES for m in stack):
            return fn
        return _outside_traced_modes(fn)

    cls.call_user_compiler = call_user_compiler


@entry("higher_order_op", "torch._ops.HigherOrderOperator (the class of torch.cond, while_loop, "
       "checkpoint's tag_activation_checkpoint, invoke_subgraph, flex_attention in a graph)")
def higher_order_op() -> type:
    return torch._ops.HigherOrderOperator


# the frame dynamo is tracing -> what the hardened calls traced in it noted (see traced_with)
_NOTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def traced_with(note: int):
    """A function of no arguments that dynamo calls, not traces, where a hardened call enters
    its mode in a traced frame: the frame's graph then reaches the ``bodies`` hook with
    ``note``. The bodies of its higher-order ops (checkpoint, cond, while_loop, ...) were traced
    with the mode popped, as a TorchFunctionMode's handler runs the op it is handed."""

    def traced() -> None:
        if "tracing_context" in MISSING:
            return
        try:
            context = _tracing_context()()
        except (ImportError, AttributeError) as err:
            MISSING["tracing_context"] = f"{type(err).__name__}: {err}"
            return
        if context is not None:
            _NOTED.setdefault(context, []).append(note)

    traced.note = note
    setattr(traced, _CONSTANT_MARK, True)
    return traced


@entry("dynamo_compile", "torch._dynamo.convert_frame._compile (dynamo's compile of one frame, "
       "looked up by name when a frame is converted)", at_import=False)
def _dynamo_compile():
    from torch._dynamo import convert_frame

    return convert_frame, convert_frame._compile


def _patch_dynamo_compile(module) -> None:
    """Dynamo compiles a frame with the stand-ins off (``_HOOKS["pause"]``): what it traces is
    torch's own function either way (a polyfill per stand-in), but torch 2.11 traces a
    stand-in's body inside a higher-order op (eager ``torch.cond`` compiles its branches) and
    guarded on the hardened call's sites it read there."""
    try:
        _, original = _dynamo_compile()
    except (ImportError, AttributeError) as err:
        MISSING["dynamo_compile"] = f"{type(err).__name__}: {err}"
        return
    if getattr(original, "_nanpass_patched", False):
        return

    @functools.wraps(original)
    def _compile(*args, **kwargs):
        pause = _HOOKS["pause"]
        if pause is None:
            return original(*args, **kwargs)
        prev = pause()
        try:
            return original(*args, **kwargs)
        finally:
            _HOOKS["resume"](prev)

    _compile._nanpass_patched = True
    module._compile = _compile


def _bind_active(fn):
    bind = _HOOKS["bind"]
    return fn if bind is None else bind(fn)


# -- checkpoint_recompute -----------------------------------------------------------------


@entry("checkpoint_recompute",
       "torch.utils.checkpoint._checkpoint_without_reentrant_generator_impl (2.14+; "
       "_checkpoint_without_reentrant_generator before) and CheckpointFunction.forward")
def _checkpoint_workers():
    # the worker checkpoint() calls: the _impl where torch has it (its older name is a shim
    # that calls the _impl, so wrapping both would bind twice)
    name = ("_checkpoint_without_reentrant_generator_impl"
            if hasattr(_cp, "_checkpoint_without_reentrant_generator_impl")
            else "_checkpoint_without_reentrant_generator")
    return name, getattr(_cp, name), _cp.CheckpointFunction.forward


def _patch_checkpoint() -> None:
    if getattr(_cp, "_nanpass_patched", False):
        return
    name, without, reentrant = _checkpoint_workers()

    @functools.wraps(without)
    def without_reentrant(fn, *args, **kwargs):
        return without(_bind_active(fn), *args, **kwargs)

    setattr(_cp, name, without_reentrant)

    @functools.wraps(reentrant)
    def forward(ctx, run_function, preserve_rng_state, *args):
        return reentrant(ctx, _bind_active(run_function), preserve_rng_state, *args)

    _cp.CheckpointFunction.forward = staticmethod(forward)
    _cp._nanpass_patched = True


# -- fast_path_check ----------------------------------------------------------------------


@entry("fast_path_check", "torch.overrides.has_torch_function and _pop_mode_temporarily")
def _fast_path_hooks():
    import torch.overrides as ov

    return ov.has_torch_function, ov._pop_mode_temporarily


def _patch_fast_path_check() -> None:
    import torch.overrides as ov

    if getattr(ov, "_nanpass_patched", False):
        return
    original, pop_mode = _fast_path_hooks()

    def has_torch_function(args):
        guarding = _HOOKS["guarding"]
        if guarding is not None and guarding():
            with pop_mode():
                return original(args)
        return original(args)

    has_torch_function.__doc__ = original.__doc__
    ov.has_torch_function = has_torch_function
    # dynamo traces it as torch's own (a polyfill, registered once dynamo is imported)
    _TRACED_AS_ORIGINAL.append((has_torch_function, original))
    ov._nanpass_patched = True
    _after_import("torch._dynamo.variables.torch", _teach_dynamo)


@entry("dynamo_overridable",
       "torch._dynamo.variables.torch.TorchInGraphFunctionVariable._get_handlers and "
       "get_overridable_functions", at_import=False)
def _dynamo_tables():
    import torch._dynamo.variables.torch as module

    return module.TorchInGraphFunctionVariable._get_handlers, module.get_overridable_functions


def _teach_dynamo(module) -> None:
    """Two things dynamo decides from tables of its own. It answers ``has_torch_function``
    itself, from a table keyed by the function object it found in ``torch.overrides`` when it
    built the table. Modules that imported the C function by name (``torch._tensor``'s
    reflected operators: ``1 - x``) call the other object: without both keys, dynamo
    graph-breaks there whenever a TorchFunctionMode is traced. And it offers a traced mode
    only the calls it lists as overridable (``offer_to_traced_modes``)."""
    import torch.overrides as ov

    try:
        build, listed = module.TorchInGraphFunctionVariable._get_handlers, module.get_overridable_functions
    except AttributeError as e:  # dynamo is being imported: warn, never break torch.compile
        MISSING["dynamo_overridable"] = f"AttributeError: {e}"
        warnings.warn(
            f"nanpass: torch {torch.__version__} lacks {ENTRIES['dynamo_overridable'].needs}: "
            "torch.compile of a hardened model may graph-break at reflected operators and run "
            "torch's private spellings (torch._weight_norm) unguarded; nanpass is tested on "
            f"torch {', '.join(TESTED)}", UserWarning, stacklevel=2)
        return
    cls = module.TorchInGraphFunctionVariable

    def handlers():
        table = build()
        for key in (torch._C._has_torch_function, ov.has_torch_function):
            if key not in table:
                table[key] = table.get(torch._C._has_torch_function) or table[ov.has_torch_function]
        return table

    cls._get_handlers = staticmethod(handlers)

    @functools.cache
    def overridable():
        return listed() | _OFFERED

    module.get_overridable_functions = overridable


def _after_import(name: str, patch) -> None:
    """``patch(module)`` once ``name`` is imported (now, if it is already): dynamo is imported
    lazily by the first ``torch.compile``, and importing it here would cost seconds."""
    import importlib.abc
    import importlib.util

    if name in sys.modules:
        patch(sys.modules[name])
        return

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


# -- compiled paths -----------------------------------------------------------------------


@entry("constant_result", "the mark torch.compiler.assume_constant_result puts on a function "
       "(its _dynamo_marked_constant attribute), set without importing dynamo", at_import=False)
def _constant_result_probe():
    def probe():
        return 0

    torch.compiler.assume_constant_result(probe)
    if getattr(probe, _CONSTANT_MARK, False) is not True:
        raise AttributeError(f"assume_constant_result no longer sets {_CONSTANT_MARK}")
    return probe


_CONSTANT_MARK = "_dynamo_marked_constant"


def constant_result(fn):
    """``fn`` called, not traced, by dynamo: its result is a constant of the graph. The public
    decorator imports dynamo (seconds at ``import nanpass``); a torch that reads another mark
    traces ``fn`` instead, which is slower, never wrong."""
    setattr(fn, _CONSTANT_MARK, True)
    return fn


@entry("dynamo_cache_entries", "torch._dynamo.eval_frame._debug_get_cache_entry_list",
       at_import=False)
def _cache_entry_list():
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return _debug_get_cache_entry_list


def dynamo_cache_entries(code) -> list:
    """Dynamo's cache entries for a code object (each has ``.code``, the transformed code)."""
    require("dynamo_cache_entries", "nanpass.report of a compiled model")
    return _cache_entry_list()(code)


@entry("inner_compiler",
       "torch._dynamo.backends.debugging.aot_eager and torch._inductor.compile_fx.compile_fx",
       at_import=False)
def _inner_compilers():
    from torch._dynamo.backends.debugging import aot_eager
    from torch._inductor.compile_fx import compile_fx

    return {"aot_eager": aot_eager, "inductor": compile_fx}


@entry("inductor_wrapper", "torch._TorchCompileInductorWrapper(mode, options, dynamic): inductor "
       "with torch.compile's mode and options applied, validated and its CUDA-graph setup done",
       at_import=False)
def _inductor_wrapper():
    return torch._TorchCompileInductorWrapper


def inductor_with(mode: str | None, options: dict | None):
    """Inductor as ``torch.compile(mode=mode, options=options)`` would run it; raises
    ``RuntimeError`` naming an option inductor does not have."""
    require("inductor_wrapper", "the nanpass backend's mode= and inductor options")
    return _inductor_wrapper()(mode, dict(options or {}), None)


def inner_compiler(name: str):
    """``aot_eager`` or inductor's ``compile_fx``: ``(gm, example_inputs) -> callable``."""
    require("inner_compiler", "the nanpass backend")
    compilers = _inner_compilers()
    return compilers["aot_eager" if name == "aot_eager" else "inductor"]


@entry("fake_mode", "torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True)",
       at_import=False)
def _fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode


@contextlib.contextmanager
def fake_mode():
    """A FakeTensorMode that accepts real tensors, with its per-kernel error log silenced
    (a shape error is what the caller expects, and it raises its own)."""
    require("fake_mode", "nanpass.check_shapes")
    mode = _fake_tensor_mode()
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        yield mode(allow_non_fake_inputs=True)
    finally:
        quiet.setLevel(level)


@entry("sym_expr", "torch.fx.experimental.sym_node.SymNode.expr (a SymInt's sympy expression)",
       at_import=False)
def _sym_expr():
    from torch.fx.experimental.sym_node import SymNode

    return SymNode.expr


def sym_free_symbols(d) -> set:
    """The free symbols of a symbolic dim (empty for a constant one)."""
    return set(d.node.expr.free_symbols)


def sym_constant(d) -> int:
    return int(d.node.expr)


# -- eager hot path -----------------------------------------------------------------------


@entry("function_apply",
       "torch._C._FunctionBase.apply, torch._C._are_functorch_transforms_active and "
       "torch._C._functorch.is_functorch_wrapped_tensor")
def _apply_parts():
    return (torch._C._FunctionBase.__dict__["apply"], torch._C._are_functorch_transforms_active,
            torch._C._functorch.is_functorch_wrapped_tensor)


def function_apply(cls):
    """``x, *rest -> cls.apply(x, *rest)`` (one tensor, then non-tensors): the C apply (which runs forward and setup_context
    itself) unless a functorch transform is active or ``x`` is a functorch wrapper, where the
    Python wrapper's dispatch is needed. Where torch lacks the C apply, the Python one."""
    slow = cls.apply
    if "function_apply" in MISSING:
        return slow
    c_apply, active, wrapped = _apply_parts()
    fast = c_apply.__get__(None, cls)

    def apply(x, *rest):
        if active() or wrapped(x):
            return slow(x, *rest)
        return fast(x, *rest)

    return apply


@entry("functorch_active", "torch._C._are_functorch_transforms_active")
def _functorch_active():
    return torch._C._are_functorch_transforms_active


try:  # read once: the fence's backward asks on every call
    functorch_active = _functorch_active()
except AttributeError:  # recorded in MISSING; without torch.func there is no transform
    def functorch_active() -> bool:
        return False


def _no_torch_function(relevant_args) -> bool:
    return False


@entry("entered", "a torch composite's module global has_torch_function, read as LOAD_GLOBAL")
def _entered_probe():
    import torch.nn.functional as F

    return entered(F.multi_head_attention_forward)


def entered(fn, **names):
    """``fn``'s own code, past its torch-function dispatch: run under a mode, each call it makes
    reaches the mode (its dispatch would hand the mode the whole call as one, and the mode is
    off while it handles a call). Its global ``has_torch_function`` (and each of ``names``) is
    read under an alias that nanpass adds to ``fn``'s own module; every other global is
    ``fn``'s module's, looked up live (a later patch of ``F.scaled_dot_product_attention`` is
    seen), and dynamo guards it like any other function's there."""
    module = sys.modules[fn.__module__]
    aliases = {}
    for name, value in {"has_torch_function": _no_torch_function, **names}.items():
        aliases[name] = f"_nanpass_{name}"
        setattr(module, aliases[name], value)
    for ins in dis.get_instructions(fn):  # co_names also names attributes: only globals may move
        if ins.argval in aliases and ins.opname != "LOAD_GLOBAL":
            raise CompatError(f"nanpass: {fn.__qualname__} reads {ins.argval} as {ins.opname}")
    code = fn.__code__.replace(co_names=tuple(aliases.get(n, n) for n in fn.__code__.co_names))
    body = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    body.__kwdefaults__ = fn.__kwdefaults__
    return body


@entry("foreach", "torch._foreach_norm and torch._foreach_mul_")
def _foreach():
    return torch._foreach_norm, torch._foreach_mul_


def foreach_norm(tensors, ord: float = 2.0, dtype: torch.dtype | None = None):
    if dtype is None:
        return torch._foreach_norm(tensors, ord)
    return torch._foreach_norm(tensors, ord, dtype=dtype)


def foreach_mul_(tensors, scalar) -> None:
    torch._foreach_mul_(tensors, scalar)


@entry("dynamo_tables", "torch._dynamo.trace_rules.get_tensor_method and get_torch_obj_rule_map "
       "(dynamo's tables of torch's callables, each built once from torch's attributes) and "
       "the _torchdynamo_orig_callable of a torch.compile'd function", at_import=False)
def _dynamo_tables():
    from torch._dynamo import trace_rules

    return trace_rules.get_tensor_method, trace_rules.get_torch_obj_rule_map


def build_dynamo_tables() -> None:
    """Dynamo's tables of torch's callables, built now if dynamo is imported: built while the
    fast path has torch's names swapped, they would list the stand-ins and not torch's own."""
    if "torch._dynamo.trace_rules" not in sys.modules or "dynamo_tables" in MISSING:
        return
    try:
        for build in _dynamo_tables():
            build()
    except (ImportError, AttributeError) as err:  # pragma: no cover - a torch without them
        MISSING["dynamo_tables"] = f"{type(err).__name__}: {err}"


@entry("jit_builtins", "torch.jit._builtins._find_builtin and _register_builtin (TorchScript's "
       "table of the Python callables it compiles as an aten op)")
def _jit_builtins():
    from torch.jit import _builtins

    return _builtins._find_builtin, _builtins._register_builtin


@entry("dynamo_import", "torch._dynamo (imported before the stand-ins, so that its tables of "
       "torch's callables list torch's own)", at_import=False)
def _dynamo_module():
    import torch._dynamo

    return torch._dynamo


def stand_ins_for_tools(pairs) -> None:
    """Each ``(stand_in, original)``, before the stand-in replaces the original anywhere:
    TorchScript compiles a call of the stand-in as one of the original (its aten builtin, or
    the original's own source), and dynamo traces the original in its place (a polyfill), its
    tables built first from torch's own objects. Missing hooks are recorded; the stand-ins
    still call the original outside a hardened call."""
    builtin = register = None
    if "jit_builtins" not in MISSING:
        try:
            builtin, register = _jit_builtins()
            names = [builtin(orig) for _, orig in pairs]  # (builds its table now, from torch's own)
        except Exception as err:  # noqa: BLE001 - recorded; TorchScript of a stand-in then fails
            MISSING["jit_builtins"] = f"{type(err).__name__}: {err}"
            builtin = None
    for k, (new, orig) in enumerate(pairs):
        if builtin is not None and names[k] is not None:
            register(new, names[k])
        elif isinstance(orig, types.FunctionType):
            new.__prepare_scriptable__ = functools.partial(_itself, orig)
    # a traced mode is offered a call of either (torch.overrides lists them by name, maybe
    # after the stand-ins replaced torch's own)
    _OFFERED.update(f for pair in pairs for f in pair)
    listed = getattr(sys.modules.get("torch._dynamo.variables.torch"), "get_overridable_functions", None)
    if hasattr(listed, "cache_clear"):
        listed.cache_clear()
    try:
        _dynamo_module()
        build_dynamo_tables()
    except Exception as err:  # noqa: BLE001 - recorded; torch.compile warns where it needs it
        MISSING["dynamo_import"] = f"{type(err).__name__}: {err}"
        return
    failed = []
    for new, orig in pairs:
        try:
            torch.compiler.substitute_in_graph(new, skip_signature_check=True)(_polyfill(orig))
        except Exception as err:  # noqa: BLE001 - recorded, named below
            failed.append(f"{new.__qualname__} ({type(err).__name__}: {err})")
    for new, orig in _TRACED_AS_ORIGINAL:
        try:
            torch.compiler.substitute_in_graph(new, skip_signature_check=True)(_polyfill(orig))
        except Exception as err:  # noqa: BLE001 - recorded, named below
            failed.append(f"{new.__module__}.{new.__qualname__} ({type(err).__name__}: {err})")
    if failed:
        MISSING["dynamo_import"] = "substitute_in_graph failed for " + "; ".join(failed)
    key_tables_by_stand_ins(pairs)


@entry("expanded_weights", "torch.nn.utils._expanded_weights.expanded_weights_impl.HANDLED_FUNCTIONS "
       "(ExpandedWeight's table of the functions it computes per-sample gradients for, keyed by "
       "the function objects; Opacus's grad_sample_mode='ew')", at_import=False)
def _expanded_weights_table():
    from torch.nn.utils._expanded_weights import expanded_weights_impl

    return expanded_weights_impl.HANDLED_FUNCTIONS


def key_tables_by_stand_ins(pairs) -> None:
    """torch's own tables keyed by its functions, built before the stand-ins (dynamo imports
    ExpandedWeights): each stand-in keys what its original keys, since torch now hands
    ``__torch_function__`` the stand-in where it looks a function up by name (``F.group_norm``'s
    own dispatch)."""
    try:
        table = _expanded_weights_table()
    except (ImportError, AttributeError) as err:
        MISSING["expanded_weights"] = f"{type(err).__name__}: {err}"
        return
    for new, orig in pairs:
        got = table.get(orig)
        if got is not None and any(k is orig for k in table):
            table[new] = got


def _itself(fn):
    return fn


# functions of nanpass's that replace torch's for good, traced by dynamo as the original
_TRACED_AS_ORIGINAL: list = []


def _polyfill(orig):
    def polyfill(*args, **kwargs):
        return orig(*args, **kwargs)

    return polyfill


def compiled_function(obj) -> bool:
    """Whether ``obj`` is a function ``torch.compile`` wrapped."""
    return callable(obj) and getattr(obj, "_torchdynamo_orig_callable", None) is not None


@entry("function_mode_stack", "torch.overrides._get_current_function_mode_stack")
def _mode_stack():
    import torch.overrides as ov

    return ov._get_current_function_mode_stack


def function_mode_stack() -> list:
    return _mode_stack()()


@entry("tensor_base", "Tensor._base (the tensor a view was taken of) and Tensor._is_view")
def _tensor_base():
    return Tensor._base, Tensor._is_view


def view_base(t):
    return t._base


def is_view(t) -> bool:
    return t._is_view()


@entry("tensor_version", "Tensor._version (a tensor's version counter, bumped by each in-place write)")
def _tensor_version():
    return Tensor._version


def version(t) -> int:
    try:
        return t._version
    except RuntimeError:  # an inference tensor has no version counter (and is not written to
        return -1  # outside inference mode): one version for its life


# -- the every-op check ----------------------------------------------------------------------


@entry("custom_function_node", "a custom autograd.Function's backward node: ._forward_cls "
       "(the Function class; the node is the ctx its backward takes)")
def _custom_function_node():
    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            return g

    node = _Probe.apply(torch.ones(1, requires_grad=True)).grad_fn
    assert node._forward_cls is _Probe
    return node


def custom_function(node):
    """The Function class whose backward ``node`` runs, or None for a built-in node."""
    return getattr(node, "_forward_cls", None)


@entry("sequence_nr", "torch._C._autograd._get_sequence_nr and autograd Node._sequence_nr (the "
       "thread's count of autograd nodes made: which nodes a call made)")
def _sequence_nr():
    peek = torch._C._autograd._get_sequence_nr
    before = peek()
    node = (torch.ones(1, requires_grad=True) * 2).grad_fn
    assert node._sequence_nr() >= before
    return peek


try:  # read on every hooked guard call
    sequence_nr = _sequence_nr()
except (AttributeError, AssertionError):  # recorded in MISSING: such guards fence with a node
    sequence_nr = None


def node_sequence_nr(node) -> int:
    return node._sequence_nr()


@entry("weak_id_dict", "torch.utils.weak.WeakIdKeyDictionary (tensors as weak keys, by identity)")
def _weak_id_dict():
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary


def weak_id_dict():
    return _weak_id_dict()()


@entry("queue_callback", "torch.autograd.Variable._execution_engine.queue_callback (a callback "
       "at the end of the running backward, as DDP's)")
def _queue_callback():
    from torch.autograd import Variable

    return Variable._execution_engine.queue_callback


def at_backward_end(fn) -> None:
    """Run ``fn`` once the backward that is running now has finished (called from a hook)."""
    _queue_callback()(fn)


@entry("graph_task_id", "torch._C._current_graph_task_id (which backward a hook runs in, as "
       "torch's multi-grad hooks tell theirs apart)")
def _graph_task_id():
    return torch._C._current_graph_task_id


def graph_task_id() -> int:
    """The backward running now (-1 outside one): its hooks, on whichever thread, and its end
    callbacks see the same number."""
    return _graph_task_id()()


@entry("op_overload", "torch._ops.OpOverload and OpOverloadPacket (aten ops a tracer runs "
       "through the function-mode stack)")
def _op_overload():
    return torch._ops.OpOverload, torch._ops.OpOverloadPacket


try:  # the global mode passes these through on every call: bound once
    ATEN_OPS = _op_overload()
except AttributeError:
    ATEN_OPS = ()


# -- certify, SpikeGuard, the compiled check --------------------------------------------


@entry("dispatch_mode", "torch.utils._python_dispatch.TorchDispatchMode")
def _dispatch_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


try:  # a base class at import: where torch lacks it, certify raises CompatError (require)
    TorchDispatchMode = _dispatch_mode()
except ImportError:
    TorchDispatchMode = object


@entry("pytree", "torch.utils._pytree.tree_flatten and tree_unflatten")
def _pytree():
    from torch.utils._pytree import tree_flatten, tree_unflatten

    return tree_flatten, tree_unflatten


try:  # SpikeGuard flattens every step's batch: bound once
    tree_flatten, tree_unflatten = _pytree()
except ImportError:  # recorded in MISSING: SpikeGuard raises naming it
    def tree_flatten(*args):
        require("pytree", "SpikeGuard")

    tree_unflatten = tree_flatten


@entry("op_schema", "OpOverload._schema (arguments' alias_info) and ._overloadname")
def _op_schema():
    op = torch.ops.aten.add_.Tensor
    return op._schema.arguments[0].alias_info.is_write, op._overloadname


def op_arguments(func):
    """An aten overload's schema arguments (``alias_info.is_write`` marks a mutated one)."""
    return func._schema.arguments


def op_overload_name(func) -> str:
    return func._overloadname


@entry("grad_scaler",
       "GradScaler._scale, ._growth_tracker, ._lazy_init_scale_growth_tracker, "
       "._per_optimizer_states and torch.amp.grad_scaler._refresh_per_optimizer_state")
def _grad_scaler():
    from torch.amp.grad_scaler import GradScaler, _refresh_per_optimizer_state

    scaler = GradScaler("cpu")
    return (scaler._scale, scaler._growth_tracker, scaler._per_optimizer_states,
            GradScaler._lazy_init_scale_growth_tracker, _refresh_per_optimizer_state)


def scaler_state(scaler) -> dict | None:
    """The scale and growth tracker as device tensors (None before the first scale)."""
    if scaler._scale is None:
        return None
    return {"scale": scaler._scale.clone(), "growth_tracker": scaler._growth_tracker.clone()}


def set_scaler_state(scaler, state: dict) -> None:
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(state["scale"].device)
    scaler._scale.copy_(state["scale"])
    scaler._growth_tracker.copy_(state["growth_tracker"])


def forget_unscale(scaler) -> None:
    """The scaler forgets which optimizers it unscaled this step (a re-run or a rewind)."""
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


@entry("dynamo_source", "aot_autograd reading fx.Node._dynamo_source of a dynamo graph's inputs",
       at_import=False)
def _dynamo_source_probe():
    import inspect

    from torch._functorch._aot_autograd import frontend_utils

    if "_dynamo_source" not in inspect.getsource(frontend_utils):
        raise AttributeError("aot_autograd no longer reads _dynamo_source")
    return frontend_utils


def no_dynamo_source(node) -> None:
    """A placeholder nanpass adds to a dynamo graph has no source (aot_autograd asks each)."""
    node._dynamo_source = None


# -- what changed in public behaviour -----------------------------------------------------


@entry("removed_ops", "torch._linalg_utils, where torch keeps a raising stub of each removed op")
def _removed_module():
    return "torch._linalg_utils"


def removed_op(obj) -> bool:
    """Whether ``obj`` is torch's stub of an op it removed (calling it raises "...is now
    removed"): ``torch.qr`` and ``torch.cholesky`` from 2.14, ``torch.solve`` long before; or
    a Tensor method that only calls one (``Tensor.qr`` from 2.14)."""
    stubs = _removed_module()
    if getattr(obj, "__module__", None) == stubs:
        return not isinstance(obj, type)
    code = getattr(obj, "__code__", None)
    leaf = stubs.rpartition(".")[2]
    return (code is not None and any(n.rpartition(".")[2] == leaf for n in code.co_names)
            and removed_op(getattr(sys.modules.get(stubs), obj.__name__, None)))


@entry("clamp_grad_at_bounds", "torch.clamp's gradient at a bound (public behaviour, probed)")
def _clamp_grad_at_bounds() -> bool:
    """Whether ``clamp``'s gradient is 1 at its bounds (torch up to 2.13) rather than 0."""
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    (g,) = torch.autograd.grad(torch.clamp(x, 1.0, 2.0).sum(), x)
    return bool((g == 1).all())


# a constant, read by guards that dynamo traces
CLAMP_GRAD_AT_BOUNDS: bool = _clamp_grad_at_bounds()


def _patch_graph_calls_if_present(module) -> None:
    try:
        _graph_mode_stack()
    except (ImportError, AttributeError) as err:  # a compiled hardened model runs as before
        MISSING["graph_mode_stack"] = f"{type(err).__name__}: {err}"
        return
    _patch_graph_calls(module)


# -- issue 45: report and eager fallback --------------------------------------------------


@entry("compile_context", "torch._TorchCompileWrapper (what torch.compile hands dynamo for a "
       "backend other than inductor: compiler_fn, kwargs) and dynamo entering a backend's "
       "backend_ctx_ctor around each call of the compiled callable")
def _compile_wrapper():
    wrapper = torch._TorchCompileWrapper
    init = wrapper.__init__
    if "backend" not in init.__code__.co_varnames:
        raise AttributeError("_TorchCompileWrapper.__init__ no longer takes the backend")
    return wrapper


_CONTEXT_MARK = "_nanpass_compile_context"


def compile_context(make):
    """``make(**torch_compile_kwargs)``: the context each call of a function or model
    ``torch.compile`` compiled with this backend runs in (dynamo enters a backend's
    ``backend_ctx_ctor`` around the call, where frames run eagerly too: after a graph break, a
    frame dynamo skips, past the recompile limit). ``torch.compile`` wraps a backend in a
    ``_TorchCompileWrapper`` that drops the attribute: it is handed on here, with the
    ``mode=``/``options=`` that call was given, for the backends marked so only."""
    setattr(make, _CONTEXT_MARK, True)
    return make


def _patch_compile_wrapper() -> None:
    cls = _compile_wrapper()
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, backend, *args, **kwargs):
        init(self, backend, *args, **kwargs)
        make = getattr(getattr(self, "compiler_fn", None), "backend_ctx_ctor", None)
        if make is not None and getattr(make, _CONTEXT_MARK, False):
            self.backend_ctx_ctor = functools.partial(make, **getattr(self, "kwargs", {}))

    cls.__init__ = __init__


@entry("compiling_frame", "torch._dynamo.symbolic_convert.InstructionTranslator.current_tx() "
       "and its f_locals (the frame dynamo is compiling, read while a backend compiles it)",
       at_import=False)
def _current_tx():
    from torch._dynamo.symbolic_convert import InstructionTranslator

    return InstructionTranslator.current_tx


def compiling_frame_locals() -> dict:
    """The locals of the frame dynamo is compiling now ({} where none is known)."""
    try:
        tx = _current_tx()()
    except Exception:  # noqa: BLE001 - none compiling, or a torch without it: owner unknown
        return {}
    while getattr(tx, "parent", None) is not None:  # (an inlined call's translator)
        tx = tx.parent
    got = getattr(tx, "f_locals", None)
    return got if isinstance(got, dict) else {}


@entry("module_call_impl", "torch.nn.Module._call_impl (the frame nn.Module.compile() compiles)")
def _module_call_impl():
    return torch.nn.Module._call_impl


def module_call_impl():
    """The function whose frames ``model.compile()`` compiles (every module's)."""
    return _module_call_impl() if "module_call_impl" not in MISSING else None


def compiled_module(obj) -> bool:
    """Whether ``obj`` is the wrapper ``torch.compile`` returns for a module (OptimizedModule;
    told without importing dynamo)."""
    return type(obj).__module__ == "torch._dynamo.eval_frame" and hasattr(obj, "_orig_mod")


@entry("tracing_context", "torch._guards.TracingContext.try_get (set while dynamo, AOTAutograd "
       "or inductor trace; fake tensors flow through torch's functions then; one per frame dynamo "
       "compiles, so a traced hardened call's note reaches that frame's graph only)")
def _tracing_context():
    return torch._guards.TracingContext.try_get


def tracing() -> bool:
    """Whether dynamo, AOTAutograd or inductor is tracing on this thread now."""
    return _tracing_context()() is not None


# -- issue 45: backend rewrite ------------------------------------------------------------


@entry("autocast_nodes", "torch.amp.autocast_mode._enter_autocast and _exit_autocast (the nodes "
       "dynamo puts around an autocast region) and torch._higher_order_ops.wrap.wrap_with_autocast "
       "(the region as a body of its own)", at_import=False)
def _autocast_nodes():
    from torch._higher_order_ops.wrap import wrap_with_autocast
    from torch.amp.autocast_mode import _enter_autocast, _exit_autocast

    return _enter_autocast, _exit_autocast, wrap_with_autocast


@functools.cache
def autocast_targets() -> tuple[frozenset, frozenset, frozenset]:
    """(enter, exit, wrap): the fx targets that open and close an autocast region in a dynamo
    graph, and the higher-order op whose body runs in one. A form the running torch lacks
    cannot appear in its graphs: its set is empty."""
    try:
        enter, leave, wrap = _autocast_nodes()
    except (ImportError, AttributeError) as err:
        MISSING["autocast_nodes"] = f"{type(err).__name__}: {err}"
        return frozenset(), frozenset(), frozenset()
    return frozenset((enter,)), frozenset((leave,)), frozenset((wrap,))


@entry("known_nonzero", "torch.fx.experimental.symbolic_shapes.statically_known_true (whether a "
       "symbolic size is non-zero, decided without a guard on it)", at_import=False)
def _statically_known_true():
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true


def known_true(expr) -> bool:
    """``statically_known_true(expr)``, fetched outside any trace: dynamo traces a call of it
    (it decides a symbolic size without a guard, as torch's own code does), but not the import
    that finds it. False where the running torch has none."""
    if not _KNOWN:
        try:
            _KNOWN.append(_statically_known_true())
        except (ImportError, AttributeError):
            _KNOWN.append(lambda expr: False)
    return _KNOWN[0](expr)


_KNOWN: list = []


def may_be_zero(n) -> bool:
    """Whether a size may be 0: an int that is; a symbolic one not known statically to be
    non-zero (an unbacked size out of ``nonzero()``, a boolean mask's selection). No guard is
    put on the size: a data-dependent one is never asked for its value."""
    if isinstance(n, int):
        return n == 0
    try:
        known = _statically_known_true()
    except (ImportError, AttributeError):  # no symbolic sizes on this torch: may be anything
        return True
    return not known(n != 0)


@entry("fake_mode_of", "torch._subclasses.fake_tensor.FakeTensor and its .fake_mode (the "
       "FakeTensorMode a dynamo example value belongs to)", at_import=False)
def _fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor


def fake_mode_of(values):
    """The FakeTensorMode of the first fake tensor among ``values``, or None."""
    try:
        fake = _fake_tensor()
    except (ImportError, AttributeError):
        return None
    for v in values:
        if isinstance(v, fake):
            return v.fake_mode
    return None


@entry("data_dependent_errors", "torch._subclasses.fake_tensor.DataDependentOutputException and "
       "torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode (a tracer asked for a "
       "value known only at run time)", at_import=False)
def _data_dependent_errors():
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return DataDependentOutputException, GuardOnDataDependentSymNode


def data_dependent(err: BaseException) -> bool:
    """Whether ``err`` (or what it was raised from) is a tracer's refusal to read a value known
    only at run time (torch's own ``while_loop`` backward calls ``.item()``)."""
    try:
        kinds = _data_dependent_errors()
    except (ImportError, AttributeError):
        return False
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, kinds):
            return True
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return False


# -- issue 47: screen then run again --------------------------------------------------------


@entry("engine_executes", "torch._C._will_engine_execute_node (whether the running backward "
       "runs a node; on a leaf's AccumulateGrad it refuses inside torch.autograd.grad) and "
       "torch.autograd.graph.get_gradient_edge")
def _engine_executes():
    from torch.autograd.graph import get_gradient_edge

    return torch._C._will_engine_execute_node, get_gradient_edge


def backward_accumulates(leaf: torch.Tensor) -> bool:
    """Called from a hook of the running backward: whether it accumulates into the leaves'
    ``.grad`` (``loss.backward()``, ``torch.autograd.backward``, with or without ``inputs=``)
    rather than returning the gradients (``torch.autograd.grad``, where torch refuses to say
    for a leaf). False where the running torch cannot tell: the caller then hooks each leaf,
    which sees every kind of backward."""
    try:
        will, edge = _engine_executes()
        will(edge(leaf).node)
    except (RuntimeError, AttributeError, ImportError):
        return False
    return True


def _install() -> None:
    """Probe every entry once and apply the patches whose hooks exist."""
    for name, e in ENTRIES.items():
        if not e.at_import:
            continue
        try:
            e.probe()
        except Exception as err:  # noqa: BLE001 - recorded; the feature raises on use
            MISSING[name] = f"{type(err).__name__}: {err}"
    if "checkpoint_recompute" not in MISSING:
        _patch_checkpoint()
    if "fast_path_check" not in MISSING:
        _patch_fast_path_check()
    if "compile_context" not in MISSING:
        _patch_compile_wrapper()
    _after_import("torch._dynamo.output_graph", _patch_graph_calls_if_present)
    _after_import("torch._dynamo.convert_frame", _patch_dynamo_compile)
    if "eager_handler" in MISSING:
        warnings.warn(
            f"nanpass: torch {torch.__version__} lacks {ENTRIES['eager_handler'].needs}: where "
            "torch.compile of a hardened model graph-breaks inside a guard, dynamo may run a "
            f"later call as an earlier one; nanpass is tested on torch {', '.join(TESTED)}",
            UserWarning, stacklevel=2)
    _warn_untested()


_install()
