"""`nanpass run SCRIPT`: unmodified training scripts (tests/nan_scripts/) run under nanpass, in a
subprocess, as a user would run them.

Each script marks the line where its NaN or Inf is born with ``# nanpass-expect: birth``; where an
infinity made on purpose turns into NaN later, it marks the NaN's line ``# nanpass-expect: nan``
and the infinity's ``# nanpass-expect: inf``, and the error names both. A script with no marker
only makes infinities that die (a -inf mask before a softmax) and must run silently.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import nanpass

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "nan_scripts"
NAMES = sorted(p.name for p in SCRIPTS.glob("*.py"))
MARKER = re.compile(r"#\s*nanpass-expect:\s*(\w+)\s*$")
NEEDS = re.compile(r"^(?:from|import) (transformers|lightning)\b", re.M)  # optional test extras
DDP = ("ddp_two_ranks.py", "ddp_inner_nan.py")  # run by torchrun on two ranks
# the child imports the nanpass this test imports (a worktree, a clean clone, an install)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    p for p in (str(pathlib.Path(nanpass.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")) if p)}


def expected(name: str) -> dict[str, int]:
    """{"birth": line} or {"inf": line, "nan": line} from the script's markers; {} if silent."""
    marks = {}
    for lineno, line in enumerate((SCRIPTS / name).read_text().splitlines(), 1):
        m = MARKER.search(line)
        if m:
            assert m.group(1) not in marks, f"{name}: two '{m.group(1)}' markers"
            marks[m.group(1)] = lineno
    return marks


NANS = [n for n in NAMES if expected(n)]
SILENT = [n for n in NAMES if not expected(n)]


def needs(name: str) -> list[str]:
    return NEEDS.findall((SCRIPTS / name).read_text())


def skip_unless_runnable(name: str) -> None:
    for package in needs(name):
        pytest.importorskip(package, exc_type=ImportError)
    if name in DDP and not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")


def run(name: str, mode: str, cwd: pathlib.Path):
    """Run the script under `nanpass run --mode MODE`, saving its weights to cwd/out.pt."""
    nanpass = ["-m", "nanpass", "run", "--mode", mode, str(SCRIPTS / name), str(cwd / "out.pt")]
    if name in DDP:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        cmd = [sys.executable, *launcher, *nanpass]
    else:
        cmd = [sys.executable, *nanpass]
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True,
                         timeout=180 if name in DDP else 120, env=ENV)
    return res


def messages(stderr: str, name: str) -> str:
    """stderr less Python's warning lines (``/path/name.py:LINE: ...``), which name a line of
    the script without nanpass: torch's own std() warning names the Lightning script's birth."""
    warning = re.compile(rf"\S*{re.escape(name)}:\d+: ")
    return "\n".join(line for line in stderr.splitlines() if not warning.match(line))


def assert_finite_weights(path: pathlib.Path) -> None:
    state = torch.load(path)
    floats = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    assert floats, f"no floating tensors saved in {path}"
    bad = [k for k, v in floats.items() if not torch.isfinite(v).all()]
    assert not bad, f"non-finite weights: {bad}"


def test_corpus_is_well_formed():
    assert len(NANS) >= 10 and len(SILENT) >= 2, (NANS, SILENT)
    for name in NAMES:
        marks = expected(name)
        assert set(marks) in ({"birth"}, {"inf", "nan"}, set()), (name, marks)
        lines = (SCRIPTS / name).read_text().splitlines()
        for kind, lineno in marks.items():
            code = lines[lineno - 1].split("#")[0].strip()
            assert code, f"{name}:{lineno}: the '{kind}' marker is on a line with no code"
    assert needs("hf_trainer.py") == ["transformers"]
    assert needs("lightning_script.py") == ["lightning"]


@pytest.mark.parametrize("name,package", [("hf_trainer.py", "transformers"),
                                          ("lightning_script.py", "lightning")])
def test_a_script_whose_package_is_missing_skips(monkeypatch, name, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import package` raises ImportError
    with pytest.raises(pytest.skip.Exception, match=package):
        skip_unless_runnable(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", NANS, ids=[n.removesuffix(".py") for n in NANS])
def test_check_stops_at_the_birth(tmp_path, name):
    skip_unless_runnable(name)
    res = run(name, "check", tmp_path)
    assert res.returncode != 0, f"the run did not stop:\n{res.stderr[-3000:]}"
    for kind, line in expected(name).items():
        assert f"{name}:{line}" in messages(res.stderr, name), (
            f"the error does not name the {kind} line {name}:{line}:\n{res.stderr[-3000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("name", SILENT, ids=[n.removesuffix(".py") for n in SILENT])
def test_check_is_silent_on_infinities_that_die(tmp_path, name):
    skip_unless_runnable(name)
    res = run(name, "check", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "nanpass:" not in res.stderr, res.stderr[-3000:]
    assert_finite_weights(tmp_path / "out.pt")


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES, ids=[n.removesuffix(".py") for n in NAMES])
def test_guard_trains_to_finite_weights(tmp_path, name):
    skip_unless_runnable(name)
    res = run(name, "guard", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert_finite_weights(tmp_path / "out.pt")


@pytest.mark.slow
def test_count_names_the_guard_that_fired(tmp_path):
    where = f"log_zero.py:{expected('log_zero.py')['inf']}"
    res = run("log_zero.py", "count", tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    located = re.compile(rf"\S*{re.escape(where)}\b")  # the path may hold digits
    rows = [located.sub("", line) for line in res.stderr.splitlines() if where in line]
    assert any(re.search(r"\b[1-9]\d*\b", row) for row in rows), (
        f"no count for the log guard at {where}:\n{res.stderr[-3000:]}")


@pytest.mark.slow
def test_run_help():
    res = subprocess.run([sys.executable, "-m", "nanpass", "run", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--mode" in res.stdout


def test_nanpass_run_ends_after_what_still_holds_its_mode(tmp_path, capsys):
    """A gloo collective's work keeps a copy of the thread's state, the program's mode
    included, and its worker thread drops it just after the script's last ``dist.barrier()``
    returns; a process that is finalizing by then aborts that rank ("terminate called without
    an active exception", 3 of 36 DDP runs under load; tests/nan_scripts/ddp_inner_nan.py).
    `nanpass run` ends the script only once nothing holds the mode: here a thread stands in
    for the worker, holding the mode for a moment after the script's last line."""
    from nanpass._cli import main as cli

    script = tmp_path / "holder.py"
    script.write_text(
        "import threading, time, torch\n"
        "from nanpass._compat import function_mode_stack\n"
        "import holder_state\n"
        "holder_state.held = list(function_mode_stack())  # what a collective's work copies\n"
        "def drop():\n"
        "    time.sleep(0.2)\n"
        "    holder_state.held.clear()\n"
        "    holder_state.dropped = True\n"
        "threading.Thread(target=drop, daemon=True).start()\n")
    (tmp_path / "holder_state.py").write_text("held = []\ndropped = False\n")
    try:
        assert cli(["run", "--mode", "guard", str(script)]) == 0, capsys.readouterr().err
        import holder_state

        assert holder_state.dropped and not holder_state.held
    finally:
        sys.modules.pop("holder_state", None)
