"""The report: golden files, determinism, HTML escaping (in a real headless browser), and
``nanpass.report`` on hardened, compiled and backend objects."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import nanpass
from tests.report_models import Broken, Odd

ROOT = pathlib.Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
UPDATE = os.environ.get("NANPASS_UPDATE_GOLDEN") == "1"


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # source paths in reports are relative to the working directory


def demo_report():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from report_demo import build
    finally:
        sys.path.pop(0)
    safe = nanpass.harden(build())
    torch.manual_seed(1)
    safe(torch.randn(4, 8))  # call sites are found as the model runs
    return nanpass.report(safe)


def broken_report():
    torch.manual_seed(0)
    model = Broken()
    compiled = torch.compile(model, backend="nanpass", options={"inner": "eager"})
    compiled(torch.rand(2, 4))
    return nanpass.report(compiled)


REPORTS = {"demo": demo_report, "broken_backend": broken_report}
FORMATS = {"txt": lambda r: r.to_text(color=False), "md": lambda r: r.to_markdown(), "json": lambda r: r.to_json()}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", list(REPORTS))
def test_golden(name, fmt):
    text = FORMATS[fmt](REPORTS[name]())
    path = GOLDEN / f"{name}.{fmt}"
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"regenerate with NANPASS_UPDATE_GOLDEN=1 if intended: {path}"


def test_deterministic():
    a, b = demo_report(), demo_report()
    assert a.to_json() == b.to_json() and a.to_html() == b.to_html() and a.to_text(False) == b.to_text(False)


def test_graph_break_gives_one_section_per_graph():
    report = broken_report()
    assert [g.capture for g in report.graphs] == ["dynamo", "dynamo"]
    assert [{c.op for c in g.changes if c.action == "guarded"} for g in report.graphs] == [
        {"log", "div"}, {"log_softmax", "sqrt"}]
    data = json.loads(report.to_json())
    assert data["schema"] == "nanpass.report/1" and len(data["graphs"]) == 2
    change = data["graphs"][0]["changes"][0]
    assert change["source"] == "tests/report_models.py:19"  # the user's line, not torch's
    assert change["module"] == "" and data["graphs"][1]["changes"][0]["module"] == "norm"
    assert change["dtype"] == "float32" and change["constants"]["lo"] == torch.finfo().tiny


def test_summary_line():
    assert demo_report().summary() == (
        "5 unsafe ops in 2 modules: 2 softmax, 1 div, 1 log, 1 sqrt \u2014 "
        "5 guarded, 0 stable forms, 2 left alone"
    )


def test_text_colour_only_when_asked():
    report = demo_report()
    assert "\033[" not in report.to_text(color=False)
    assert "\033[32m" in report.to_text(color=True)


def test_report_entry_points():
    m = Broken()
    with pytest.raises(nanpass.ReportError, match="^nanpass: no graph of Broken"):
        nanpass.report(m)
    with pytest.raises(TypeError, match="^nanpass: report\\(\\) takes"):
        nanpass.report(3)
    be = nanpass.backend(inner="eager")
    torch.compile(m, backend=be)(torch.rand(2, 4))
    assert len(nanpass.report(be).graphs) == 2


def odd_html() -> str:
    safe = nanpass.harden(Odd())
    safe(torch.rand(2, 3))
    return nanpass.report(safe).to_html()


def test_html_escapes_user_strings():
    page = odd_html()
    assert "<script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "http://" not in page and "https://" not in page and "<link" not in page  # self-contained


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def _dom(tmp_path, html: str, name: str) -> str:
    page = tmp_path / f"{name}.html"
    page.write_text(html)
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / ('profile-' + name)}", "--dump-dom", page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


def test_html_in_a_real_browser(tmp_path):
    # a hardened model: its call sites, the module named <script>alert(1)</script> as text
    dom = _dom(tmp_path, odd_html(), "hardened")
    assert "nanpass report: Odd" in dom and 'id="change-0-0"' in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom
    assert "<script" not in dom
    # a compiled model: its graph code, the changed nodes highlighted and linked to their rows
    be = nanpass.backend(inner="eager")
    torch.compile(Odd(), backend=be)(torch.rand(2, 3))
    dom = _dom(tmp_path, nanpass.report(be).to_html(), "compiled")
    assert 'class="line changed guarded" id="g0-after-guard_softmax" href="#change-0-0"' in dom
    assert 'id="change-0-0"' in dom and "<script" not in dom


def test_stable_forms_are_marked_as_changing_rounding():
    class LogSoftmax(torch.nn.Module):
        def forward(self, x):
            return torch.log(torch.softmax(x, -1)) + torch.log(x.abs() + 1)

    default, stable = nanpass.backend(inner="eager"), nanpass.backend(inner="eager", stable=True)
    x = torch.randn(3, 4)
    torch.compile(LogSoftmax(), backend=default)(x)
    torch.compile(LogSoftmax(), backend=stable)(x)
    changes = json.loads(nanpass.report(stable).to_json())["graphs"][0]["changes"]
    assert {(c["action"], c["changes_rounding"]) for c in changes} == {("stable", True), ("guarded", False)}
    assert sorted(c["guard"] for c in changes if c["changes_rounding"]) == [
        "log(1 + x) -> log1p(x)", "log(softmax(x)) -> log_softmax(x)"]
    assert not any(c["changes_rounding"] for c in json.loads(nanpass.report(default).to_json())["graphs"][0]["changes"])


def test_summary_says_op_for_one():
    safe = nanpass.harden(Backticks())
    safe(torch.rand(2))
    assert nanpass.report(safe).summary() == (
        "1 unsafe op in 1 module: 1 log \u2014 1 guarded, 0 stable forms, 0 left alone")
    checked = nanpass.harden(Backticks(), mode="check")
    checked(torch.rand(2))
    assert nanpass.report(checked).summary() == "1 unsafe op in 1 module: 1 log \u2014 1 checked for NaN/Inf"
    # one op guarded, the other left alone: "1 unsafe op", and "1 left alone" as it was
    odd = nanpass.harden(Odd(), exclude=["<script>alert(1)</script>"])
    odd(torch.rand(2, 3))
    assert nanpass.report(odd).summary() == (
        "1 unsafe op in 1 module: 1 div \u2014 1 guarded, 0 stable forms, 1 left alone")
    assert nanpass.summary([]) == "0 unsafe ops in 0 modules \u2014 0 guarded, 0 stable forms, 0 left alone"


_SUMMARY = re.compile(r"^(\d+) unsafe ops? in \d+ modules?(?:: [^\u2014]*)? \u2014 "
                      r"(\d+) guarded, (\d+) stable forms?, (\d+) left alone$")


def _summary_counts(summary: str) -> dict[str, int]:
    m = _SUMMARY.match(summary)
    assert m, summary
    total, guarded, stable, left = map(int, m.groups())
    assert total == guarded + stable
    return {k: n for k, n in (("guarded", guarded), ("left", left), ("stable", stable)) if n}


def test_json_counts_agree_with_the_summary():
    class LogSoftmax(torch.nn.Module):
        def forward(self, x):
            return torch.log(torch.softmax(x, -1))

    be = nanpass.backend(inner="eager", stable=True)
    torch.compile(LogSoftmax(), backend=be)(torch.randn(3, 4))
    report = nanpass.report(be)
    data = json.loads(report.to_json())
    # the stable form, then a guard on its result: one unsafe op, not two
    assert [(c["action"], c["after_stable"]) for c in data["graphs"][0]["changes"]] == [
        ("stable", False), ("guarded", True)]
    assert data["summary"] == "1 unsafe op in 1 module: 1 log_softmax \u2014 0 guarded, 1 stable form, 0 left alone"
    assert data["counts"] == {"by_action": {"stable": 1}, "by_op": {"log_softmax": 1}}
    assert data["counts"]["by_action"] == _summary_counts(data["summary"])
    for make in REPORTS.values():  # and where nothing is after a stable form
        data = json.loads(make().to_json())
        assert data["counts"]["by_action"] == _summary_counts(data["summary"])


def _outside_code_spans(md: str) -> str:
    # CommonMark: a run of n backticks opens a code span closed by the next run of exactly n
    out, i = [], 0
    for m in re.finditer(r"`+", md):
        if m.start() < i:
            continue
        close = re.compile(r"(?<!`)" + m.group() + r"(?!`)").search(md, m.end())
        if close is None:
            continue
        out.append(md[i:m.start()])
        i = close.end()
    return "".join(out) + md[i:]


class Backticks(torch.nn.Module):
    def forward(self, x):
        return torch.log(x)  # `<script>alert(2)</script>` `` <img src=x onerror=alert(3)> ``


def test_markdown_escapes_user_strings():
    safe = nanpass.harden(Odd())
    safe(torch.rand(2, 3))
    md = nanpass.report(safe).to_markdown()
    assert "| &lt;script&gt;alert(1)&lt;/script&gt; (Softmax) |" in md
    assert "| &lt;root&gt; (Odd) |" in md
    outside = _outside_code_spans(md)
    assert "<" not in outside and ">" not in outside  # every raw < is inside a code span
    # a source line with backticks cannot close its code span early and let HTML through
    safe = nanpass.harden(Backticks())
    safe(torch.rand(2))
    md = nanpass.report(safe).to_markdown()
    assert "``` return torch.log(x)  # `<script>alert(2)</script>` `` <img src=x onerror=alert(3)> `` ```" in md
    outside = _outside_code_spans(md)
    assert "<" not in outside and ">" not in outside


def test_markdown_renders_without_html_elements_from_user_strings():
    markdown_it = pytest.importorskip("markdown_it")
    for model in (Odd(), Backticks()):
        safe = nanpass.harden(model)
        safe(torch.rand(2, 3))
        md = nanpass.report(safe).to_markdown()
        page = markdown_it.MarkdownIt("commonmark", {"html": True}).enable("table").render(md)
        assert "<script" not in page and "<img" not in page and "<root" not in page
        assert page.count("<tr>") == 1 + len(nanpass.report(safe).changes)  # the table survives
