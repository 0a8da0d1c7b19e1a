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
