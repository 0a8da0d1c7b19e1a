"""Shared by the examples: a flag for CI, and one line that says finite or not."""

from __future__ import annotations

import argparse

import torch


def quick_flag(doc: str) -> bool:
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a shorter run (used in CI)")
    return parser.parse_args().quick


def state(*tensors) -> str:
    ok = all(bool(torch.isfinite(t).all()) for t in tensors if t is not None)
    return "finite" if ok else "NOT finite"


def before_after(model, *inputs) -> None:
    """Forward and backward through ``model``, then through ``nanpass.harden(model)``: the
    value and the gradients of every input that requires grad, and what was rewritten."""
    import nanpass

    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    for label, m in (("before", model), ("after ", nanpass.harden(model))):
        for t in leaves:
            t.grad = None
        out = m(*inputs)
        out.backward()
        print(f"{label}: value {out.item():.4g} ({state(out)}), grads {state(*[t.grad for t in leaves])}")
    print(m.summary())
