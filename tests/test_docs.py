"""The docs that are derived from code stay in step with it."""

from __future__ import annotations

import importlib.util
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import nanpass
from nanpass import _compat
from nanpass._docs import guards_markdown
from nanpass._rules import GUARDED

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _load(path: pathlib.Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def test_the_home_page_plot_is_the_examples_run():
    """docs/hooks/home_plot.py, which the docs build runs, draws the two losses of a fresh run
    of examples/empty_sequence.py: the plain one turns NaN, the hardened one stays finite."""
    plot = _load(ROOT / "docs" / "hooks" / "home_plot.py", "home_plot")
    plain, hardened = plot.loss_curves()
    bad = plot.BAD
    assert len(plain) == len(hardened) == plot.STEPS
    assert all(map(math.isfinite, plain[:bad])) and all(map(math.isnan, plain[bad:]))
    assert all(map(math.isfinite, hardened)) and hardened[-1] < hardened[0] - 0.5  # it learns
    assert plain[:bad] == hardened[:bad]  # bit for bit, as the caption says
    svg = plot.loss_svg(plain, hardened)
    drawn = [[tuple(map(float, p.split(","))) for p in pts.split()]
             for pts in re.findall(r'<polyline [^>]*points="([^"]*)"', svg)]
    assert [len(d) for d in drawn] == [bad, len(hardened)]
    assert drawn[0] == drawn[1][:bad]
    # every point is its step and its loss under one affine map each: the picture is this run
    (x0, y0), (x1, y1) = drawn[1][0], drawn[1][-1]
    for i, ((x, y), v) in enumerate(zip(drawn[1], hardened, strict=True)):
        assert x == pytest.approx(x0 + (x1 - x0) * i / (len(hardened) - 1), abs=0.01)
        assert y == pytest.approx(y0 + (y1 - y0) * (v - hardened[0]) / (hardened[-1] - hardened[0]),
                                  abs=0.02)
    assert f"plain: loss NaN from step {bad} on" in svg
    page = (ROOT / "docs" / "index.md").read_text()
    assert f"]({plot.IMAGE})" in page and f"at step {bad} " in page
    assert plot.EXAMPLE.relative_to(ROOT).as_posix() in (ROOT / "mkdocs.yml").read_text() + page


def test_the_home_page_install_line_and_snippets():
    page = (ROOT / "docs" / "index.md").read_text()
    name = re.search(r'^name = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), flags=re.M)[1]
    assert f"pip install {name} " in page and f"torch {_compat.TESTED[0]} to {_compat.TESTED[-1]}" in page
    # the eager snippet, on the example's model and its batch with an empty sequence
    sys.path.insert(0, str(ROOT / "examples"))  # the example imports its neighbour _common
    try:
        example = _load(ROOT / "examples" / "empty_sequence.py", "empty_sequence")
    finally:
        sys.path.remove(str(ROOT / "examples"))
    x, pad, target = list(example.batches(2, 1))[1]
    assert pad[0].all()
    (eager, compiled) = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert "nanpass.harden(model)" in eager and 'backend="nanpass"' in compiled
    scope = {"nanpass": nanpass, "torch": torch, "model": example.Pooler(), "x": x, "pad": pad,
             "target": target, "print": lambda *a: None}
    exec(eager, scope)
    scope["loss"].backward()
    assert torch.isfinite(scope["loss"]) and all(torch.isfinite(p.grad).all() for p in scope["model"].parameters())


@pytest.mark.slow
def test_the_home_pages_nanpass_run_line():
    page = (ROOT / "docs" / "index.md").read_text()
    script, line = re.search(r"^nanpass run (\S+) +# stops at its softmax, line (\d+)$", page, flags=re.M).groups()
    res = subprocess.run([sys.executable, "-m", "nanpass", "run", script, "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    assert f"NaN created by torch.softmax in <root> (Pooler) at {script}:{line}:" in res.stderr


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
@pytest.mark.skipif(importlib.util.find_spec("mkdocs") is None, reason="needs the docs extra")
def test_the_home_page_first_screen_in_a_real_browser(tmp_path):
    """The built site's home page at 1280 x 800: the install command, the plot (loaded) and
    `nanpass run` all lie in the first screen, and no code block scrolls sideways."""
    site = tmp_path / "site"
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
                         cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    probe = """<script>addEventListener("load", () => {
      const box = e => { const r = e.getBoundingClientRect(); return [r.top, r.bottom].map(Math.round); };
      const code = t => [...document.querySelectorAll("pre code")].find(c => c.textContent.includes(t));
      const img = document.querySelector('article img[src$="nan_loss.svg"]');
      const wide = [...document.querySelectorAll("pre code")].filter(c => c.scrollWidth > c.clientWidth);
      document.body.dataset.fit = [innerWidth, innerHeight, ...box(code("pip install nanpass")),
        ...box(img), img.complete, img.naturalWidth, img.naturalHeight,
        ...box(code("nanpass run train.py")), wide.length].join(" ");
    });</script></body>"""
    (site / "probe.html").write_text((site / "index.html").read_text().replace("</body>", probe))
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1280,800", "--hide-scrollbars",
           "--virtual-time-budget=5000", "--dump-dom", (site / "probe.html").as_uri()]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    m = re.search(r'data-fit="([^"]*)"', dom)
    assert m, dom[:500]
    width, _, *fit = m[1].split()
    # the layout's width is the window's; a box's place on the page does not depend on the
    # height (headless chromium's window frame takes some of it): the first screen is y < 800
    assert int(width) == 1280
    install, (img_top, img_bottom, complete, nat_w, nat_h), run, wide = (
        fit[0:2], fit[2:7], fit[7:9], int(fit[9]))
    assert complete == "true" and int(nat_w) > 0 and int(nat_h) > 0, fit
    for top, bottom in (install, (img_top, img_bottom), run):
        assert 0 < int(top) < int(bottom) <= 800, fit
    assert wide == 0, "a code block on the home page scrolls sideways at 1280 px"
