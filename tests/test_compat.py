"""The compatibility layer: every use of a torch internal is a named entry of ``_compat``, each
checked here on the running torch (CI runs this file on every supported release), and no other
module of the package reaches into torch's private names."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest
import torch

import nanpass
from nanpass import _compat
from nanpass._guards import clip

ROOT = pathlib.Path(nanpass.__file__).parent


@pytest.mark.parametrize("name", sorted(_compat.ENTRIES))
def test_entry_holds_on_this_torch(name):
    entry = _compat.ENTRIES[name]
    assert entry.needs and entry.tested == _compat.TESTED
    assert entry.probe() is not None
    assert name not in _compat.MISSING


def test_this_torch_is_a_tested_release():
    major, minor = _compat.torch_release()
    assert f"{major}.{minor}" in _compat.TESTED, (
        f"torch {torch.__version__} is not in _compat.TESTED {_compat.TESTED}")


def test_pyproject_states_the_tested_range():
    text = (ROOT.parent / "pyproject.toml").read_text()
    (spec,) = re.findall(r'"torch(>=[^"]+)"', text)
    low, high = _compat.TESTED[0], _compat.TESTED[-1]
    major, minor = (int(p) for p in high.split("."))
    assert spec == f">={low},<{major}.{minor + 1}", spec


def _private_uses(tree: ast.AST) -> list[str]:
    """``torch.<...>._x`` attribute chains and ``from torch.<...>._x import`` statements."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            parts = node.module.split(".")
            if parts[0] == "torch" and any(p.startswith("_") for p in parts):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        if isinstance(node, ast.Attribute):
            chain, cur = [], node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch" and chain:
                chain.reverse()
                if any(p.startswith("_") and not p.startswith("__") for p in chain):
                    found.append(f"line {node.lineno}: torch.{'.'.join(chain)}")
    return found


def test_no_torch_internal_outside_compat():
    offenders = {}
    for path in sorted(ROOT.glob("*.py")):
        if path.name == "_compat.py":
            continue
        uses = _private_uses(ast.parse(path.read_text()))
        if uses:
            offenders[path.name] = uses
    assert not offenders, f"torch internals outside _compat (add an entry there): {offenders}"


def test_the_scan_finds_an_internal():
    code = "import torch\nx = torch._C._are_functorch_transforms_active()\nfrom torch.utils._pytree import tree_flatten\n"
    assert {u.split(":")[0] for u in _private_uses(ast.parse(code))} == {"line 2", "line 3"}


VALUES = [0.0, -0.0, 1.0, 2.0, 1.5, -3.0, 5.0, float("inf"), float("-inf"), float("nan")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("lo,hi", [(1.0, 2.0), (1.0, None), (None, 2.0), (0.0, 2.0)])
def test_clip_is_clamp_with_the_gradient_at_its_bounds(dtype, lo, hi):
    """A guard's clamp passes the gradient on the closed safe domain, on every torch (from 2.14
    torch.clamp's own gradient at a bound is 0)."""
    x = torch.tensor(VALUES, dtype=dtype, requires_grad=True)
    y = clip(x, lo, hi)
    ref = torch.clamp(x.detach(), lo, hi)
    assert torch.equal(y.detach().isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(y.detach()), torch.nan_to_num(ref))
    (g,) = torch.autograd.grad(y.sum(), x)
    v = x.detach()
    inside = (v >= (lo if lo is not None else -float("inf"))) & (v <= (hi if hi is not None else float("inf")))
    assert torch.equal(g[inside], torch.ones_like(g[inside]))
    assert torch.equal(g[~inside & ~v.isnan()], torch.zeros_like(g[~inside & ~v.isnan()]))


_RUN = textwrap.dedent("""
    import sys, warnings
    import torch
    import torch.utils.checkpoint as cp
    torch.__version__ = sys.argv[1]
    if sys.argv[2] == "drop-checkpoint-hook":
        for name in ("_checkpoint_without_reentrant_generator_impl", "_checkpoint_without_reentrant_generator"):
            if hasattr(cp, name):
                delattr(cp, name)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import nanpass
        import nanpass._harden
    print("WARNINGS", [str(w.message) for w in caught if "nanpass" in str(w.message)])
    try:
        nanpass.harden(torch.nn.Linear(2, 2))
        print("HARDEN ok")
    except nanpass.CompatError as e:
        print("HARDEN", type(e).__name__, e)
""")


def _run(version: str, what: str) -> str:
    out = subprocess.run([sys.executable, "-c", _RUN, version, what], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_an_untested_torch_imports_and_warns_once():
    out = _run("2.16.0", "")
    (line,) = [ln for ln in out.splitlines() if ln.startswith("WARNINGS")]
    warns = ast.literal_eval(line.removeprefix("WARNINGS "))
    assert len(warns) == 1 and warns[0].startswith("nanpass: torch 2.16.0 is untested")
    assert "2.11 to 2.15" in warns[0]
    assert "HARDEN ok" in out


def test_a_missing_hook_raises_naming_it():
    out = _run(torch.__version__, "drop-checkpoint-hook")
    assert "WARNINGS []" in out
    (line,) = [ln for ln in out.splitlines() if ln.startswith("HARDEN")]
    assert line.startswith("HARDEN CompatError nanpass: harden (a checkpointed region's recompute")
    assert "_checkpoint_without_reentrant_generator" in line and "2.11, 2.12, 2.13, 2.14, 2.15" in line
