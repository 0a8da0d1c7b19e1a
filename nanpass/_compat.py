"""What nanpass needs from torch beyond its public API, in one place. Each patch changes
nothing unless a hardened call is running.

- ``torch.utils.checkpoint`` recomputes a region in backward, outside the hardened call, so the
  recomputation would run unguarded (and differ from the forward where a guard fired). Both
  implementations look their worker up at call time, so wrapping it here makes the region's
  function re-enter the hardened call's guards on recompute.
- ``dynamo_cache_entries``: dynamo's compiled entries of a code object, so that
  ``nanpass.report(compiled)`` finds every graph of a model, after graph breaks too.
- ``inner_compiler``: the aot_eager and inductor compilers the backend hands its graph to.
- ``fake_mode``: a ``FakeTensorMode`` (shape checks run the model on fake tensors), quiet.
- ``sym_free_symbols`` / ``sym_constant``: what a symbolic dim (``SymInt``) is built from.
- ``foreach_norm`` / ``foreach_mul_``: the fused per-list kernels StepGuard and check mode use.
- ``function_apply``: ``autograd.Function.apply`` without its Python wrapper, which binds
  every call's arguments with ``inspect.signature``: 68 us per apply against 20 us on CPU,
  and a guard applies one per operand.
- ``nn.MultiheadAttention`` and ``nn.TransformerEncoder(Layer)`` take their fused inference
  fast path only when ``torch.overrides.has_torch_function(args)`` is False, which any active
  TorchFunctionMode makes True: hardened, they would run the slow path and round differently.
  Asked while nanpass's own mode is the innermost one, the question is answered as without it,
  so the model takes the path it takes plain, and the fast-path kernels
  (``torch._native_multi_head_attention``, ``torch._transformer_encoder_layer_fwd``) reach
  their rules.
"""

from __future__ import annotations

import contextlib
import dis
import functools
import logging
import sys
import types

import torch
import torch.utils.checkpoint as _cp


# what the layer above registers (``on_guarded_call``): this module imports nothing of nanpass
_HOOKS: dict = {"bind": None, "guarding": None}
# C functions a TorchFunctionMode sees in eager that dynamo would not offer to a traced mode
_OFFERED: set = set()


def on_guarded_call(bind, guarding) -> None:
    """``bind(fn)``: ``fn`` made to re-enter the running hardened call's guards (or ``fn``
    itself outside one); ``guarding()``: whether nanpass's own mode is the innermost one."""
    _HOOKS["bind"], _HOOKS["guarding"] = bind, guarding


def offer_to_traced_modes(fns) -> None:
    """Dynamo hands a call to a traced TorchFunctionMode only when ``torch.overrides`` lists it
    as overridable, a list built from public names. A mode sees the private C spellings
    (``torch._weight_norm``, ``torch._lu_with_info``) in eager: dynamo must offer them too, or
    a compiled hardened model runs them unguarded."""
    _OFFERED.update(fns)


def _bind_active(fn):
    bind = _HOOKS["bind"]
    return fn if bind is None else bind(fn)


def _patch_checkpoint() -> None:
    if getattr(_cp, "_nanpass_patched", False):
        return
    without = _cp._checkpoint_without_reentrant_generator

    @functools.wraps(without)
    def without_reentrant(fn, *args, **kwargs):
        return without(_bind_active(fn), *args, **kwargs)

    _cp._checkpoint_without_reentrant_generator = without_reentrant
    reentrant = _cp.CheckpointFunction.forward

    @functools.wraps(reentrant)
    def forward(ctx, run_function, preserve_rng_state, *args):
        return reentrant(ctx, _bind_active(run_function), preserve_rng_state, *args)

    _cp.CheckpointFunction.forward = staticmethod(forward)
    _cp._nanpass_patched = True


def _patch_fast_path_check() -> None:
    import torch.overrides as ov

    if getattr(ov, "_nanpass_patched", False):
        return
    original = ov.has_torch_function

    def has_torch_function(args):
        guarding = _HOOKS["guarding"]
        if guarding is not None and guarding():
            with ov._pop_mode_temporarily():
                return original(args)
        return original(args)

    has_torch_function.__doc__ = original.__doc__
    ov.has_torch_function = has_torch_function
    ov._nanpass_patched = True
    _after_import("torch._dynamo.variables.torch", _teach_dynamo)


def _teach_dynamo(module) -> None:
    """Two things dynamo decides from tables of its own. It answers ``has_torch_function`` itself, from a table keyed by the function object
    it found in ``torch.overrides`` when it built the table. Modules that imported the C
    function by name (``torch._tensor``'s reflected operators: ``1 - x``) call the other object:
    without both keys, dynamo graph-breaks there whenever a TorchFunctionMode is traced. And
    it offers a traced mode only the calls it lists as overridable (``offer_to_traced_modes``)."""
    import torch.overrides as ov

    cls = module.TorchInGraphFunctionVariable
    build = cls._get_handlers

    def handlers():
        table = build()
        for key in (torch._C._has_torch_function, ov.has_torch_function):
            if key not in table:
                table[key] = table.get(torch._C._has_torch_function) or table[ov.has_torch_function]
        return table

    cls._get_handlers = staticmethod(handlers)

    listed = module.get_overridable_functions

    @functools.cache
    def overridable():
        return listed() | _OFFERED

    module.get_overridable_functions = overridable


def _after_import(name: str, patch) -> None:
    """``patch(module)`` once ``name`` is imported (now, if it is already): dynamo is imported
    lazily by the first ``torch.compile``, and importing it here would cost seconds."""
    import importlib.abc
    import importlib.util
    import sys

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


def dynamo_cache_entries(code) -> list:
    """Dynamo's cache entries for a code object (each has ``.code``, the transformed code)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return _debug_get_cache_entry_list(code)


def inner_compiler(name: str):
    """``aot_eager`` or inductor's ``compile_fx``: ``(gm, example_inputs) -> callable``."""
    if name == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager
    from torch._inductor.compile_fx import compile_fx

    return compile_fx


@contextlib.contextmanager
def fake_mode():
    """A FakeTensorMode that accepts real tensors, with its per-kernel error log silenced
    (a shape error is what the caller expects, and it raises its own)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        yield FakeTensorMode(allow_non_fake_inputs=True)
    finally:
        quiet.setLevel(level)


def sym_free_symbols(d) -> set:
    """The free symbols of a symbolic dim (empty for a constant one)."""
    return set(d.node.expr.free_symbols)


def sym_constant(d) -> int:
    return int(d.node.expr)


_C_APPLY = torch._C._FunctionBase.__dict__["apply"]


def _no_torch_function(relevant_args) -> bool:
    return False


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
            raise RuntimeError(f"nanpass: {fn.__qualname__} reads {ins.argval} as {ins.opname}")
    code = fn.__code__.replace(co_names=tuple(aliases.get(n, n) for n in fn.__code__.co_names))
    body = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    body.__kwdefaults__ = fn.__kwdefaults__
    return body


def function_apply(cls):
    """``x -> cls.apply(x)`` for one tensor: the C apply (which runs forward and setup_context
    itself) unless a functorch transform is active or ``x`` is a functorch wrapper, where the
    Python wrapper's dispatch is needed."""
    fast = _C_APPLY.__get__(None, cls)
    slow = cls.apply
    active = torch._C._are_functorch_transforms_active
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor

    def apply(x):
        if active() or wrapped(x):
            return slow(x)
        return fast(x)

    return apply


def foreach_norm(tensors, ord: float = 2.0):
    return torch._foreach_norm(tensors, ord)


def foreach_mul_(tensors, scalar) -> None:
    torch._foreach_mul_(tensors, scalar)


_patch_checkpoint()
_patch_fast_path_check()
