"""What nanpass needs from torch beyond its public API, in one place.

``torch.utils.checkpoint`` recomputes a region in backward, outside the hardened call, so the
recomputation would run unguarded (and differ from the forward where a guard fired). Both
implementations look their worker up at call time, so wrapping it here makes the region's
function re-enter the hardened call's guards on recompute; with no hardened call active
nothing changes.
"""

from __future__ import annotations

import functools

import torch.utils.checkpoint as _cp


def _bind_active(fn):
    from ._intercept import ACTIVE, run_guarded

    mode = ACTIVE.get()
    if mode is None:
        return fn
    sites = mode.sites

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return run_guarded(sites, fn, args, kwargs)

    return run


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


_patch_checkpoint()
