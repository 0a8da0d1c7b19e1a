"""`nanpass run` on any script (issue 46): each script in tests/run_scripts/ runs under
`python -m nanpass run` beside plain `python`, in a subprocess, as a user would run it.

A line marked ``# nanpass-expect: KIND`` inside a case's block (``case == "NAME"``) is the
line the finding must name. Every trigger is exact (zeros, a division by zero, a float16
limit), never a rounding.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

import nanpass

pytestmark = pytest.mark.slow  # a subprocess each (torch and nanpass imported: 3-8 s)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "run_scripts"
# the child imports the nanpass this test imports (a worktree, a clean clone, an install)
PACKAGE_ROOT = str(pathlib.Path(nanpass.__file__).resolve().parent.parent)
MARKER = re.compile(r"#\s*nanpass-expect:\s*(\w+)\s*$")


def run(script: str, *args: str, mode: str | None = None, nanpass_run: bool = True,
        cwd: pathlib.Path | None = None, report: str | None = None, timeout: int = 120):
    cmd = [sys.executable]
    if nanpass_run:
        cmd += ["-m", "nanpass", "run", *(["--mode", mode] if mode else []),
                *(["--report", report] if report else [])]
    cmd += [str(SCRIPTS / script), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (PACKAGE_ROOT, os.environ.get("PYTHONPATH")) if p)}
    env.pop(  # (the test process's own; a child of nanpass run sets its own)
        "NANPASS_RUN_CHILD", None)
    return subprocess.run(cmd, cwd=cwd or SCRIPTS, capture_output=True, text=True,
                          timeout=timeout, env=env)


def marked(script: str, case: str) -> int:
    """The line marked in ``case``'s block (the first case test above it names it)."""
    current = None
    for lineno, line in enumerate((SCRIPTS / script).read_text().splitlines(), 1):
        m = re.search(r'case == "(\w+)"', line)
        if m:
            current = m.group(1)
        if MARKER.search(line) and current == case:
            return lineno
    raise AssertionError(f"{script}: no marker in case {case!r}")


def names(stderr: str, script: str, line: int) -> int:
    """Where stderr names ``script:line`` in a nanpass finding (-1: it does not)."""
    m = re.search(rf"nanpass: [^\n]*{re.escape(script)}:{line}\b", stderr)
    return m.start() if m else -1


# -- 1. every finding named, whatever ends the run -----------------------------------------------


@pytest.mark.parametrize("case", ["assert", "multinomial"])
def test_a_finding_is_named_before_the_scripts_own_error(case):
    plain = run("ends.py", case, nanpass_run=False)
    assert plain.returncode == 1 and "nanpass:" not in plain.stderr
    error = plain.stderr.strip().splitlines()[-1]  # AssertionError / RuntimeError, as python says
    res = run("ends.py", case)
    assert res.returncode == 1, res.stderr[-3000:]
    at = names(res.stderr, "ends.py", marked("ends.py", case))
    assert at >= 0, res.stderr[-3000:]
    tb = res.stderr.find("Traceback (most recent call last)")
    assert 0 <= at < tb, f"the finding is not before the script's traceback:\n{res.stderr[-3000:]}"
    assert res.stderr.strip().splitlines()[-1] == error
    # the script's traceback is python's: from the script's own frame, no nanpass frame in it
    assert "nanpass/" not in res.stderr[tb:] and "runpy" not in res.stderr[tb:], res.stderr[tb:]


@pytest.mark.parametrize("case", ["os_exit", "sys_exit", "autograd_grad", "anomaly", "custom"])
def test_a_finding_is_named_whatever_ends_the_script(case):
    res = run("ends.py", case)
    assert res.returncode == 1, res.stderr[-3000:]
    assert names(res.stderr, "ends.py", marked("ends.py", case)) >= 0, res.stderr[-3000:]
    if case == "autograd_grad":  # read once torch.autograd.grad returns: before the update
        assert "wrote checkpoint" not in res.stdout, res.stdout
    if case == "anomaly":  # nanpass's finding, not torch's anomaly error on the next node
        assert "PowBackward0" not in res.stderr.split("nanpass:", 1)[1], res.stderr[-3000:]
    if case == "custom":
        assert "@staticmethod" not in res.stderr


@pytest.mark.parametrize("case", ["spawn", "fork"])
def test_multiprocessing_children_are_watched(case):
    plain = run("ends.py", case, nanpass_run=False)
    assert plain.returncode == 0 and "nanpass:" not in plain.stderr, plain.stderr
    res = run("ends.py", case, timeout=180)
    assert names(res.stderr, "ends.py", marked("ends.py", case)) >= 0, res.stderr[-3000:]
    if case == "spawn":  # the worker's status 1 fails mp.spawn, as any error of a worker does
        assert res.returncode == 1 and "ProcessExitedException" in res.stderr, res.stderr[-3000:]
    else:
        assert "child exit 1" in res.stdout, res.stdout


# -- 2. nothing that runs under python fails under nanpass run -------------------------------------


def test_unreducible_tensors_and_transforms_run_as_under_python():
    plain = run("unreducible.py", nanpass_run=False)
    assert plain.returncode == 0, plain.stderr[-3000:]
    for mode in ("check", "warn", "guard", "count"):
        res = run("unreducible.py", mode=mode)
        assert res.returncode == 0, (mode, res.stderr[-3000:])
        out = [line for line in res.stdout.splitlines() if not line.startswith("inner guard")]
        assert out == plain.stdout.splitlines(), (mode, res.stdout)
        # the nested enable(mode="guard") took over: its log(0) guarded
        assert "inner guard True" in res.stdout, (mode, res.stdout)
        if mode in ("check", "warn"):
            said = [line for line in res.stderr.splitlines() if "not watched" in line]
            assert len(said) == 1, (mode, res.stderr[-3000:])
            for kind in ("meta", "sparse", "nested", "float8_e4m3fn"):
                assert kind in said[0], (mode, said)
            assert "NaN" not in res.stderr and "Traceback" not in res.stderr, (mode, res.stderr[-3000:])


# -- 3. GradScaler ---------------------------------------------------------------------------


def test_gradscaler_overflow_is_the_scalers_not_a_stop(tmp_path):
    plain = run("amp_scaler.py", "overflow", nanpass_run=False)
    assert plain.returncode == 0, plain.stderr[-3000:]
    check = run("amp_scaler.py", "overflow", mode="check")
    assert check.returncode == 0 and "nanpass:" not in check.stderr, check.stderr[-3000:]
    assert check.stdout == plain.stdout
    count = run("amp_scaler.py", "overflow", mode="count")
    assert count.returncode == 0, count.stderr[-3000:]
    assert "GradScaler skipped 5 steps" in count.stderr, count.stderr[-3000:]
    assert "65536 -> 32768 -> 16384 -> 8192 -> 4096" in count.stderr, count.stderr[-3000:]


@pytest.mark.parametrize("case", ["nan_grad", "collapse", "forward_nan"])
def test_gradscaler_does_not_hide_a_nan_or_a_collapsing_scale(case):
    res = run("amp_scaler.py", case, mode="check")
    assert res.returncode == 1, res.stderr[-3000:]
    assert names(res.stderr, "amp_scaler.py", marked("amp_scaler.py", case)) >= 0, res.stderr[-3000:]
    if case == "collapse":
        assert "below 1" in res.stderr, res.stderr[-3000:]


# -- 4. the script sees what python gives it ------------------------------------------------------


def _sees(res) -> tuple[list[str], list[str]]:
    warned = [line for line in res.stderr.splitlines() if "UserWarning" in line]
    return res.stdout.splitlines(), warned


def test_the_script_sees_what_python_gives_it(tmp_path):
    (tmp_path / "shadow.py").write_text("x = 1\n")  # in the caller's directory: not on the path
    args = ("--", "--lr", "1", "--fail")
    plain = run("sees.py", *args, nanpass_run=False, cwd=tmp_path)
    res = run("sees.py", *args, cwd=tmp_path)
    assert _sees(res) == _sees(plain), (res.stdout, res.stderr[-3000:])
    assert "shadow importable False" in res.stdout
    assert "argv ['--', '--lr', '1', '--fail']" in res.stdout
    warned = _sees(res)[1]
    assert warned and warned[0].startswith(f"{SCRIPTS / 'sees.py'}:{_warn_line()}:"), warned
    # sys.exit("fatal: ...") prints its message and exits 1, as python does
    assert plain.returncode == res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == "fatal: bad config", res.stderr[-3000:]


def _warn_line() -> int:
    lines = (SCRIPTS / "sees.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if "F.mse_loss(" in line)


def test_report_path_is_checked_before_the_run_and_kept_at_the_start(tmp_path):
    res = run("sees.py", cwd=tmp_path, report="missing/out.html")
    assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
    assert res.stderr.startswith("nanpass: cannot write the report to"), res.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = run("sees.py", "--chdir", str(elsewhere), cwd=tmp_path, report="out.html")
    assert res.returncode == 0, res.stderr[-3000:]
    assert (tmp_path / "out.html").is_file() and not (elsewhere / "out.html").exists()
