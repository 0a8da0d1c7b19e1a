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
from tests.report_models import Broken, Odd, Stack

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


class _BreakThenDivide(torch.nn.Module):
    """The second graph (after the break) reads no parameter: only dynamo's cache finds it."""

    def __init__(self):
        super().__init__()
        self.l = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = torch.log(self.l(x) ** 2)
        torch._dynamo.graph_break()
        return h / h.sum(-1, keepdim=True)


@pytest.mark.parametrize("backend", [
    "nanpass.backend(inner='aot_eager')",
    pytest.param("'nanpass'", marks=pytest.mark.inductor),  # the default inner: inductor
])
def test_report_finds_every_graph_after_a_break_whatever_the_inner_compiler(backend):
    torch._dynamo.reset()
    compiled = torch.compile(_BreakThenDivide(), backend=eval(backend))
    compiled(torch.randn(2, 4))
    report = nanpass.report(compiled)
    assert [sorted(c.op for c in g.changes if c.action == "guarded") for g in report.graphs] == [
        ["log"], ["div"]]


def test_summary_line():
    assert demo_report().summary() == (
        "5 unsafe ops in 2 modules: 2 softmax, 1 div, 1 log, 1 sqrt \u2014 "
        "5 guarded, 0 stable forms, 5 left alone"
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


def _dom(tmp_path, html: str, name: str, *flags: str) -> str:
    page = tmp_path / f"{name}.html"
    page.write_text(html)
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / ('profile-' + name)}", *flags, "--dump-dom", page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
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


# ---------------------------------------------------------------- a real, large model: grouping
LAYERS = 32
_ACTIONS = re.compile(r"^  (?:guarded|stable|left|checked) ", re.M)


@pytest.fixture(scope="module")
def llama():
    """A 32-layer Hugging Face Llama with a tiny hidden size, hardened and run once."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=32, intermediate_size=64,
                                   num_attention_heads=2, num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    safe = nanpass.harden(transformers.LlamaForCausalLM(cfg).eval())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~200 tiny matmuls: threads only add overhead (seconds on a busy machine)
    try:
        with torch.no_grad():
            safe(torch.randint(0, 128, (1, 8)))
    finally:
        torch.set_num_threads(threads)
    return nanpass.report(safe)


def _call_sites(changes) -> list[tuple]:
    """The distinct call sites, counted here without nanpass's grouping: everything but the
    layer indices in the module path."""
    return list(dict.fromkeys(
        (c.op, c.spelling, c.action, c.guard, c.source, c.module_type, re.sub(r"\.\d+(?=\.|$)", ".#", c.module))
        for c in changes))


def test_llama_report_has_a_row_per_call_site_not_per_layer(llama):
    changes = llama.changes
    sites = _call_sites(changes)
    # every layer: a pow, a mean and an rsqrt in each of two RMSNorms, one attention; then the
    # final norm
    assert len(changes) == 7 * LAYERS + 3 and len(sites) == 10
    text, flat = llama.to_text(color=False), llama.to_text(color=False, group=False)
    assert len(_ACTIONS.findall(text)) == len(sites)
    assert len(_ACTIONS.findall(flat)) == len(changes)  # group=False: a row per change, as before
    assert f"{len(changes)} ops looked at, shown in {len(sites)} rows" in text.splitlines()[2]
    rows = [line for line in text.splitlines() if _ACTIONS.match(line)]
    assert rows[1].split()[:4] == ["left", "mean", "Tensor.mean", "model.layers.{0..31}.input_layernorm"]
    assert rows[3].split() == ["left", "scaled_dot_product_attention", "F.scaled_dot_product_attention",
                               "model.layers.{0..31}.self_attn", "(LlamaAttention,", "32", "modules)"]
    assert rows[2].split()[:4] == ["guarded", "rsqrt", "torch.rsqrt", "model.layers.{0..31}.input_layernorm"]
    assert rows[2].endswith("(LlamaRMSNorm, 32 modules)")
    assert rows[9].split() == ["guarded", "rsqrt", "torch.rsqrt", "model.norm", "(LlamaRMSNorm)"]
    assert "model.layers.0." not in text and "model.layers.31." not in text
    md = llama.to_markdown()
    assert len(re.findall(r"^\| (?:guarded|left) \|", md, re.M)) == len(sites)
    assert "| model.layers.{0..31}.self_attn (LlamaAttention, 32 modules) |" in md
    assert len(re.findall(r"^\| (?:guarded|left) \|", llama.to_markdown(group=False), re.M)) == len(changes)
    page = llama.to_html()
    assert page.count("<tr id=") == len(sites)
    assert llama.to_html(group=False).count("<tr id=") == len(changes)
    assert "<summary>32 modules</summary>" in page and page.count("<details>") == 7


def _installed_line(prefix: str, rel: str, text: str) -> str:
    """``rel:N``, N the first line of the installed file that holds ``text``: line numbers move
    between releases, and pip takes an older transformers on an older Python (5.20 on 3.10)."""
    with open(os.path.join(prefix, rel), encoding="utf-8") as f:
        return f"{rel}:{next(n for n, line in enumerate(f, 1) if text in line)}"


def test_llama_report_names_library_files_from_their_package(llama):
    outputs = [llama.to_text(color=False), llama.to_markdown(), llama.to_html(), llama.to_json()]
    prefix = os.path.dirname(os.path.dirname(pytest.importorskip("transformers").__file__))  # site-packages
    for out in outputs:
        assert "site-packages" not in out and prefix not in out and str(ROOT) not in out
    sources = {c["source"] for c in json.loads(llama.to_json())["graphs"][0]["changes"]}
    norm = "transformers/models/llama/modeling_llama.py"
    rsqrt = _installed_line(prefix, norm, "hidden_states * torch.rsqrt(")
    assert sources == {_installed_line(prefix, norm, "variance = hidden_states.pow(2)"), rsqrt,
                       _installed_line(prefix, "transformers/integrations/sdpa_attention.py",
                                       "scaled_dot_product_attention(")}
    assert f"{rsqrt}: hidden_states = hidden_states * torch.rsqrt(" in outputs[0]


def test_llama_json_keeps_every_change_and_adds_the_groups(llama):
    graph = json.loads(llama.to_json())["graphs"][0]
    modules = [c["module"] for c in graph["changes"]]
    assert len(modules) == 7 * LAYERS + 3
    expected = {f"model.layers.{i}.{m}" for i in range(LAYERS)
                for m in ("input_layernorm", "self_attn", "post_attention_layernorm")} | {"model.norm"}
    assert set(modules) == expected
    groups = graph["groups"]
    assert [(g["module"], g["op"], g["count"]) for g in groups] == [
        ("model.layers.{0..31}.input_layernorm", "pow", 32), ("model.layers.{0..31}.input_layernorm", "mean", 32),
        ("model.layers.{0..31}.input_layernorm", "rsqrt", 32),
        ("model.layers.{0..31}.self_attn", "scaled_dot_product_attention", 32),
        ("model.layers.{0..31}.post_attention_layernorm", "pow", 32),
        ("model.layers.{0..31}.post_attention_layernorm", "mean", 32),
        ("model.layers.{0..31}.post_attention_layernorm", "rsqrt", 32),
        ("model.norm", "pow", 1), ("model.norm", "mean", 1), ("model.norm", "rsqrt", 1)]
    # every change is in exactly one group, and the group lists its module
    indices = sorted(k for g in groups for k in g["changes"])
    assert indices == list(range(len(modules)))
    for g in groups:
        assert g["modules"] == [modules[k] for k in g["changes"]]
        assert all(graph["changes"][k]["op"] == g["op"] for k in g["changes"])
    assert groups[3]["modules"] == [f"model.layers.{i}.self_attn" for i in range(LAYERS)]


def test_llama_html_keeps_each_module_and_anchor(llama):
    page = llama.to_html()
    for i in range(LAYERS):
        for m in ("input_layernorm", "self_attn", "post_attention_layernorm"):
            assert f"<code>model.layers.{i}.{m}</code>" in page
    # every change keeps its anchor, once: the first of a group on its row, the rest in its list
    for k in range(len(llama.changes)):
        assert page.count(f'id="change-0-{k}"') == 1, k
    assert '<tr id="change-0-3" class="left">' in page  # the attention row: the fourth change
    assert '<li id="change-0-10"><code>model.layers.1.self_attn</code></li>' in page
    # counts at the top: by action and by op
    assert "<h3>by action</h3><table class=\"counts\"><tbody><tr><th>guarded</th><td>65</td></tr>" \
           "<tr><th>left</th><td>162</td></tr>" in page
    assert "<h3>unsafe ops, by op</h3><table class=\"counts\"><tbody><tr><th>rsqrt</th><td>65</td></tr>" in page
    assert page.index('class="overview"') < page.index('<table class="changes">')
    assert "http://" not in page and "https://" not in page and "<link" not in page and "<script" not in page


def test_grouping_in_a_compiled_graph_links_code_lines_to_their_row():
    be = nanpass.backend(inner="eager")
    torch.compile(Stack(layers=6), backend=be)(torch.rand(2, 4))
    report = nanpass.report(be)
    assert len(report.changes) == 13
    text = report.to_text(color=False)
    assert "layers.{0..5}.softmax (Softmax, 6 modules)" in text and "layers.{0..5} (Block, 6 modules)" in text
    assert len(_ACTIONS.findall(text)) == 3
    page = report.to_html()
    assert page.count("<tr id=") == 3
    # the softmax of layer 3, in the graph code, links to the softmax row (the first change)
    softmax = [c.node for c in report.changes if c.op == "softmax"]
    assert f'id="g0-after-{softmax[3]}" href="#change-0-0"' in page
    assert f"<code>layers.3.softmax</code> <small>{softmax[3]}</small>" in page  # the node, in the list
    groups = json.loads(report.to_json())["graphs"][0]["groups"]
    assert [g["count"] for g in groups] == [6, 6, 1]


def _change(module: str, op: str = "div", source: str = "m.py:3") -> nanpass.Change:
    return nanpass.Change("", "", op, "torch.div", module, "Block", source, "y = a / b", "guarded", "g", "r")


def test_group_labels():
    from nanpass._report import group_changes

    def labels(mods, **kw):
        return [(g.module, g.count_text) for g in group_changes([_change(m, **kw) for m in mods])]

    assert labels([f"layers.{i}.attn" for i in (0, 1, 2, 3, 5, 7, 8, 9)]) == [
        ("layers.{0..3,5,7..9}.attn", "8 modules")]
    assert labels(["layers.0", "layers.1"]) == [("layers.{0,1}", "2 modules")]
    # two indices that vary: every combination is written as two sets, anything else with *
    assert labels([f"enc.{a}.blocks.{b}" for a in range(2) for b in range(3)]) == [
        ("enc.{0,1}.blocks.{0..2}", "6 modules")]
    star = group_changes([_change(m) for m in ("enc.0.blocks.0", "enc.1.blocks.1", "enc.1.blocks.2")])
    assert [(g.module, g.exact) for g in star] == [("enc.*.blocks.*", False)]
    assert "      modules: enc.0.blocks.0, enc.1.blocks.1, enc.1.blocks.2" in nanpass.Report(
        "M", [_graph(star[0].changes)]).to_text(color=False)
    # an index that does not vary stays as it is; a module that calls twice is counted as such
    assert labels(["enc.0.blocks.1", "enc.0.blocks.2", "enc.0.blocks.1"]) == [
        ("enc.0.blocks.{1,2}", "3 calls in 2 modules")]
    # only the layer index may differ: another source line, op or name is another row
    assert len(group_changes([_change("layers.0"), _change("layers.1", source="m.py:4")])) == 2
    assert len(group_changes([_change("layers.0"), _change("layers.1", op="log")])) == 2
    assert len(group_changes([_change("a.0.x"), _change("a.1.y")])) == 2
    assert len(group_changes([_change("layers.0"), _change("layers.00")])) == 2  # "00" is a name
    # without an index nothing is merged: the same call twice at the root is two rows, in order
    assert [g.indices for g in group_changes([_change(""), _change("norm"), _change("")])] == [(0,), (1,), (2,)]


def _graph(changes):
    from nanpass._rewrite import GraphRecord

    return GraphRecord("intercept", "", "", list(changes), 0.0)


def test_source_paths_are_shortened(monkeypatch, tmp_path):
    import sysconfig

    from nanpass._report import _rel

    assert _rel(None) is None
    assert _rel("/opt/conda/envs/x/lib/python3.12/site-packages/transformers/models/llama/modeling_llama.py:123") \
        == "transformers/models/llama/modeling_llama.py:123"
    assert _rel("/usr/lib/python3/dist-packages/numpy/core/fromnumeric.py:7") == "numpy/core/fromnumeric.py:7"
    assert _rel(r"C:\venv\Lib\site-packages\timm\models\vit.py:9") == r"timm\models\vit.py:9"
    stdlib = sysconfig.get_paths()["stdlib"]
    assert _rel(os.path.join(stdlib, "json", "decoder.py") + ":4") == os.path.join("json", "decoder.py") + ":4"
    assert _rel(str(ROOT / "examples" / "report_demo.py") + ":20") == "examples/report_demo.py:20"
    assert _rel("/elsewhere/model.py:3") == "/elsewhere/model.py:3"  # not under the cwd: as it is
    assert _rel(str(ROOT / "model.py")) == "model.py"  # no line number
    monkeypatch.chdir(tmp_path)
    assert _rel(str(tmp_path / "pkg" / "m.py") + ":5") == "pkg/m.py:5"
    # a virtual environment inside the project is still a library, not the project's code
    assert _rel(str(tmp_path / ".venv/lib/python3.11/site-packages/transformers/x.py") + ":1") == "transformers/x.py:1"


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/run installs it)")
def test_llama_html_fits_1280_px_in_a_real_browser(tmp_path, llama):
    # a copy of the page with a probe: the report itself has no script
    probe = ("<script>const d = document.documentElement; document.body.dataset.fit = [d.scrollWidth,"
             " d.clientWidth, window.innerWidth,"
             " document.querySelectorAll('table.changes > tbody > tr').length,"
             " document.querySelectorAll('ol.members > li').length].join(' ')</script></body>")
    for group, rows in ((True, 10), (False, len(llama.changes))):
        page = llama.to_html(group=group)
        assert "<script" not in page
        dom = _dom(tmp_path, page.replace("</body>", probe), f"llama-{group}", "--window-size=1280,900")
        m = re.search(r'data-fit="(\d+) (\d+) (\d+) (\d+) (\d+)"', dom)
        assert m, dom[:500]
        scroll, client, inner, shown, members = map(int, m.groups())
        # no horizontal scroll: the page is no wider than the viewport less its vertical scrollbar
        assert inner == 1280 and scroll <= client <= 1280, (group, scroll, client)
        assert shown == rows and members == (7 * LAYERS if group else 0)


def test_a_certificate_shows_its_verdict_per_op():
    """nanpass.report(model, certificate=nanpass.certify(...)): the verdicts in every format."""
    class LogModel(torch.nn.Module):
        def forward(self, x):
            return torch.log(x).sum() + torch.sqrt(x + 1).sum()

    x = torch.rand(2, 3)
    safe = nanpass.harden(LogModel())
    safe(x)
    unsafe_cert = nanpass.certify(LogModel(), x, ranges=(0, 1))  # log at 0: unsafe, unguarded
    cert = nanpass.certify(safe, x, ranges=(0, 1))
    assert not unsafe_cert.proven and cert.proven
    r = nanpass.report(safe, certificate=unsafe_cert)
    text = r.to_text(color=False)
    assert "NOT PROVEN" in text
    assert "unsafe" in text and "log" in text
    md = r.to_markdown()
    assert "## Certificate" in md and "| unsafe | log |" in md and "gives log_zero" in md
    page = r.to_html()
    assert '<section id="certificate">' in page and "gives log_zero" in page
    d = json.loads(nanpass.report(safe, certificate=cert).to_json())
    assert d["certificate"]["proven"] is True
    assert {v["verdict"] for v in d["certificate"]["verdicts"] if v["op"] == "log"} == {"guarded"}
    assert "certificate" not in json.loads(nanpass.report(safe).to_json())
    with pytest.raises(nanpass.NanpassTypeError, match="^nanpass: report\\(certificate=\\)"):
        nanpass.report(safe, certificate="proven")
