"""The docs that are derived from code stay in step with it."""

from __future__ import annotations

import pathlib
import re

import pytest

from nanpass import _compat
from nanpass._docs import guards_markdown
from nanpass._rules import GUARDED

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_guards_md_is_generated_from_the_table():
    text = (ROOT / "docs" / "guards.md").read_text()
    assert text == guards_markdown(), "run: python -m nanpass._docs > docs/guards.md"
    for name in GUARDED:
        assert f"## {name}\n" in text


def test_readme_has_exactly_two_setup_commands():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, flags=re.S)
    commands = [line for b in blocks for line in b.strip().splitlines() if line.strip()]
    assert len(commands) == 2, commands
    assert "examples/quickstart.py" in commands[0]
    assert "pytest" in commands[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci, "CI must run the README's test command"
    assert "torch==2.13.0" in commands[0] and "venv .venv 2.13.0" in ci


@pytest.mark.parametrize("release", _compat.TESTED)
def test_ci_runs_the_readme_tests_on_every_supported_torch(release):
    readme = (ROOT / "README.md").read_text()
    command = re.findall(r"```(?:bash|sh)\n(.*?)```", readme, flags=re.S)[1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    (venv,) = re.findall(rf"^venv (\S+) {re.escape(release)}\.\d+$", ci, flags=re.M)
    assert command.replace(".venv/", f"{venv}/") in ci.splitlines()
