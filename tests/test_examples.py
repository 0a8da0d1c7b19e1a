"""Every example runs (with --quick) and shows its failure and its fix."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # the slow tier: the examples, each in a subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("_")
                  and p.name not in ("quickstart.py", "report_demo.py"))


@pytest.mark.parametrize("name", EXAMPLES)
def test_example(name):
    res = subprocess.run([sys.executable, f"examples/{name}", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    lines = res.stdout.splitlines()
    before = next(line for line in lines if line.startswith("before"))
    after = next(line for line in lines if line.startswith("after"))
    assert "NOT finite" in before or "nan" in before or "inf" in before, before
    assert "NOT finite" not in after and " nan" not in after and " inf" not in after, after
    assert "unsafe op" in res.stdout or "steps taken" in res.stdout


def test_quickstart_and_report_demo_run():
    res = subprocess.run([sys.executable, "examples/quickstart.py"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and "plain model:    loss nan" in res.stdout, res.stderr[-2000:]
    assert "weights finite: True" in res.stdout
    # docs/quickstart.md shows the demo's output as it is
    shown = (ROOT / "docs" / "quickstart.md").read_text().split("```text\n", 1)[1].split("```", 1)[0]
    assert shown.strip() == res.stdout.strip(), "update docs/quickstart.md from examples/quickstart.py"
