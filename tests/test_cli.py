"""The nanpass command line, run as a user would: in a subprocess."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow  # the slow tier: subprocess CLI runs

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = pathlib.Path(sys.executable).parent / "nanpass"
DEMO = "examples/report_demo.py:Model"


def run(*args, script=False):
    cmd = [str(SCRIPT)] if script else [sys.executable, "-m", "nanpass"]
    res = subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=ROOT, timeout=300)
    return res.returncode, res.stdout, res.stderr


def test_report_text_through_the_console_script():
    code, out, err = run("report", DEMO, "--input-shape", "4,8", script=True)
    assert code == 0, err
    assert out.startswith("nanpass report: Model\n5 unsafe ops in 2 modules")
    assert "examples/report_demo.py:33: h = (h - h.mean(0)) / spread" in out


@pytest.mark.parametrize("fmt", ["json", "md", "html"])
def test_report_formats_to_a_file(tmp_path, fmt):
    out_file = tmp_path / f"report.{fmt}"
    code, out, err = run("report", DEMO, "--input-shape", "4,8", "--format", fmt, "-o", str(out_file))
    assert code == 0 and out == "", err
    text = out_file.read_text()
    if fmt == "json":
        assert json.loads(text)["schema"] == "nanpass.report/1"
    elif fmt == "html":
        assert text.startswith("<!doctype html>") and "report_demo.py:33" in text
    else:
        assert text.startswith("# nanpass report: Model")


def test_inputs_file(tmp_path):
    inputs = tmp_path / "inputs.pt"
    torch.save({"x": torch.rand(2, 4)}, inputs)
    code, out, err = run("report", "tests/report_models.py:Branchy", "--inputs", str(inputs), "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    assert [g["capture"] for g in data["graphs"]] == ["intercept"]
    assert [c["source"] for c in data["graphs"][0]["changes"]] == ["tests/report_models.py:41"]  # the branch taken


def test_scan_strict_exit_codes():
    code, out, _ = run("scan", DEMO, "--input-shape", "4,8")
    assert code == 0 and out.startswith("5 unsafe ops found in Model")
    code, _, _ = run("scan", DEMO, "--input-shape", "4,8", "--strict")
    assert code == 1
    code, out, _ = run("scan", "tests/report_models.py:Odd", "--format", "json", "--input-shape", "2,3")
    assert code == 0 and json.loads(out)["model"] == "Odd"


def _error(*args):
    code, out, err = run(*args)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one clear line, no traceback
    return lines[0]


def test_errors_are_one_line(tmp_path):
    assert _error("report", "nope.py:Model") == "nanpass: no such file: nope.py"
    assert _error("report", "examples/report_demo.py:Nope").startswith(
        "nanpass: examples/report_demo.py has no attribute 'Nope'; callables in it:")
    assert _error("report", "examples/report_demo.py") .startswith("nanpass: target must be PATH:NAME")
    bad = tmp_path / "bad.py"
    bad.write_text("def build():\n    raise RuntimeError('no weights here')\n"
                   "def thing():\n    return 3\n")
    assert _error("report", f"{bad}:build") == "nanpass: build() raised RuntimeError: no weights here"
    assert _error("report", f"{bad}:thing") == "nanpass: thing() returned int, not a torch.nn.Module"
    assert _error("report", DEMO, "--input-shape", "4,x") == (
        "nanpass: --input-shape takes comma-separated integers, got '4,x'")
    assert _error("report", DEMO, "--input-shape", "3,5").startswith("nanpass: running the model raised RuntimeError")
    assert _error("report", DEMO).startswith("nanpass: give the model's inputs with --input-shape")


@pytest.mark.parametrize("where,code", [
    ("import", "import sys\nsys.exit(0)\n"),
    ("constructor", "import sys, torch\nclass Net(torch.nn.Module):\n"
                    "    def __init__(self):\n        super().__init__()\n        raise SystemExit\n"),
    ("forward", "import torch\nclass Net(torch.nn.Module):\n"
                "    def forward(self, x):\n        exit(0)\n"),
])
def test_a_target_that_exits_is_an_error_not_a_pass(tmp_path, where, code):
    """A CI gate (scan --strict) must not pass when the model never ran: a target that calls
    sys.exit(0) at import, in its constructor or in forward is exit status 2, not 0."""
    src = tmp_path / "exits.py"
    src.write_text(code + ("class Net:\n    pass\n" if where == "import" else ""))
    line = _error("scan", f"{src}:Net", "--strict", "--input-shape", "2,3")
    assert line.startswith("nanpass: ") and "exit" in line, line


def test_a_model_dynamo_cannot_see_into(tmp_path):
    src = tmp_path / "opaque.py"
    src.write_text(
        "import torch\n"
        "class Opaque(torch.nn.Module):\n"
        "    @torch.compiler.disable\n"
        "    def forward(self, x):\n"
        "        return torch.log(x) if x.sum() > -100 else x\n"
    )
    code, out, err = run("scan", f"{src}:Opaque", "--input-shape", "3", "--format", "json")
    assert code == 0, err
    changes = json.loads(out)["graphs"][0]["changes"]
    assert [(c["op"], c["action"], c["code"]) for c in changes] == [
        ("log", "guarded", "return torch.log(x) if x.sum() > -100 else x")]


def test_help_says_it_runs_the_file():
    code, out, _ = run("report", "--help")
    assert code == 0 and "imports PATH, which runs the code in it" in out


def test_version():
    import nanpass

    for script in (True, False):  # the console script and python -m nanpass
        code, out, err = run("--version", script=script)
        assert (code, out, err) == (0, f"nanpass {nanpass.__version__}\n", "")
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'\nversion = "{nanpass.__version__}"\n' in pyproject  # one version, the package's


def test_license_file_matches_pyproject():
    assert '\nlicense = "MIT"\n' in (ROOT / "pyproject.toml").read_text()
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License\n\nCopyright (c) 2026 the nanpass developers\n")
    assert "Permission is hereby granted, free of charge, to any person obtaining a copy" in text
    assert 'THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND' in text


def test_scan_counts_one_op_in_the_singular(tmp_path):
    src = tmp_path / "one.py"
    src.write_text("import torch\nclass One(torch.nn.Module):\n"
                   "    def forward(self, x):\n        return torch.log(x)\n")
    code, out, err = run("scan", f"{src}:One", "--input-shape", "3")
    assert code == 0, err
    assert out.startswith("1 unsafe op found in One\n  log ")
    code, out, err = run("report", f"{src}:One", "--input-shape", "3")
    assert code == 0, err
    assert out.startswith("nanpass report: One\n1 unsafe op in 1 module: 1 log \u2014 1 guarded")


CERTIFY_MODEL = """
import torch


class Safe(torch.nn.Module):
    def forward(self, x):
        return torch.log(torch.relu(x) + 1)


class Unsafe(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)
"""


def test_scan_certify_exit_codes(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(CERTIFY_MODEL)
    code, out, err = run("scan", f"{path}:Safe", "--input-shape", "2,3", "--certify", "--ranges=-1,1")
    assert code == 0 and "PROVEN" in out, err
    code, out, err = run("scan", f"{path}:Unsafe", "--input-shape", "2,3", "--certify", "--ranges", "0,1")
    assert code == 1 and "unsafe" in out and "log" in out and "fix: nanpass.harden" in out, err
    code, out, err = run("scan", f"{path}:Unsafe", "--input-shape", "2,3", "--certify", "--ranges", "0,1",
                         "--hardened", "--format", "json")
    assert code == 0 and json.loads(out)["verdicts"][0]["verdict"] == "guarded", err
    code, out, err = run("scan", f"{path}:Unsafe", "--input-shape", "2,3", "--certify", "--ranges", "0")
    assert code == 2 and err.startswith("nanpass: --ranges takes LO,HI")
