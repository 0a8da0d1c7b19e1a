"""The graph diff report: every op nanpass looked at, with the user's module path and source line.

Output is deterministic (same model, same report, byte for byte) so it can be stored and diffed:
source paths under the working directory are shown relative to it, and nothing time- or
address-dependent is included.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable

import torch

from ._errors import NanpassError, NanpassTypeError
from ._rewrite import Change, GraphRecord, summary

SCHEMA = "nanpass.report/1"


class ReportError(NanpassError):
    """No report can be made for the object given."""


def _rel(path: str | None) -> str | None:
    if path is None:
        return None
    file, _, line = path.rpartition(":")
    cwd = os.getcwd() + os.sep
    if file.startswith(cwd):
        file = file[len(cwd):]
    return f"{file}:{line}"


def _fmt(v: float) -> str:
    return f"{v:.6g}"


class Report:
    """What nanpass did to a model, one section per captured graph."""

    def __init__(self, model: str, graphs: Iterable[GraphRecord]):
        self.model = model
        self.graphs = list(graphs)

    @property
    def changes(self) -> list[Change]:
        return [c for g in self.graphs for c in g.changes]

    def summary(self) -> str:
        return summary(self.changes)

    # -- structured ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        changes = self.changes
        return {
            "schema": SCHEMA,
            "model": self.model,
            "summary": self.summary(),
            "counts": {
                # counted as the summary counts: a guard on the result of a stable form is
                # part of that form, not another unsafe op (it stays in "changes", marked)
                "by_action": dict(sorted(Counter(
                    c.action for c in changes if c.action == "left" or not c.after_stable).items())),
                "by_op": dict(sorted(Counter(
                    c.op for c in changes if c.action != "left" and not c.after_stable).items())),
            },
            "graphs": [
                {
                    "index": i,
                    "capture": g.capture,
                    "changes": [_change_dict(c) for c in g.changes],
                    "asserts": [
                        {"node": a.node, "shape": [d if isinstance(d, int) else None for d in a.shape],
                         "entering": a.entering, "produced_by": a.produced_by}
                        for a in g.asserts
                    ],
                    "code_before": g.code_before.strip() + "\n",
                    "code_after": g.code.strip() + "\n",
                }
                for i, g in enumerate(self.graphs)
            ],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    # -- text --------------------------------------------------------------------------------
    def to_text(self, color: bool | None = None) -> str:
        if color is None:
            color = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None
        paint = _paint if color else (lambda s, _: s)
        lines = [f"nanpass report: {self.model}", self.summary(), ""]
        for i, g in enumerate(self.graphs):
            if len(self.graphs) > 1:
                lines.append(f"graph {i} ({g.capture} capture): {len(g.changes)} ops looked at")
            for c in g.changes:
                where = c.module or "<root>"
                if c.module_type:
                    where += f" ({c.module_type})"
                lines.append(f"  {paint(f'{c.action:8}', c.action)} {c.op:20} {c.spelling:28} {where}")
                if c.source:
                    lines.append(f"      at {_rel(c.source)}: {c.code}")
                lines.append(f"      {'why' if c.action != 'left' else 'left'}: {c.reason}")
                if c.guard:
                    lines.append(f"      {'guard' if c.action == 'guarded' else 'form'}: {c.guard}")
                if c.constants:
                    consts = ", ".join(f"{k}={_fmt(v)}" for k, v in c.constants)
                    lines.append(f"      constants ({c.dtype}): {consts}")
            if g.asserts:
                lines.append(f"  {len(g.asserts)} shape asserts:")
                lines.extend(f"    {a.node:24} {a.shape_text():20} entering {a.entering}" for a in g.asserts)
            lines.append("")
        return "\n".join(lines).rstrip() + "\n"

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<nanpass.Report {self.model}: {self.summary()}>"

    def to_markdown(self) -> str:
        """GitHub-flavoured markdown. Every user string stays text: HTML-escaped in table cells,
        or inside a code span whose backtick fence it cannot close."""
        out = [f"# nanpass report: {_md(self.model)}", "", f"**{_md(self.summary())}**", ""]
        for i, g in enumerate(self.graphs):
            out.append(f"## Graph {i} ({_md(g.capture)} capture)")
            out.append("")
            out.append("| action | op | spelling | module | source | guard / reason | constants |")
            out.append("|---|---|---|---|---|---|---|")
            for c in g.changes:
                module = _md(c.module or "<root>") + (f" ({_md(c.module_type)})" if c.module_type else "")
                source = f"{_md_code(_rel(c.source))} {_md_code(c.code)}" if c.source else ""
                text = _md(c.guard + " — " + c.reason if c.guard else c.reason)
                consts = ", ".join(f"{_md(k)}={_fmt(v)}" for k, v in c.constants)
                consts = f"{_md(c.dtype)}: {consts}" if consts else ""
                out.append(f"| {_md(c.action)} | {_md(c.op)} | {_md_code(c.spelling)} | {module} | {source} "
                           f"| {text} | {consts} |")
            out.append("")
            if g.asserts:
                out.append("| shape assert | enforces | entering | produced by |")
                out.append("|---|---|---|---|")
                out.extend(f"| {_md_code(a.node)} | {_md_code(a.shape_text())} | {_md(a.entering)} "
                           f"| {_md(a.produced_by)} |" for a in g.asserts)
                out.append("")
        return "\n".join(out)

    # -- html ----------------------------------------------------------------------------------
    def to_html(self) -> str:
        """One self-contained page: no script, no external resource; every user string escaped."""
        e = html.escape
        parts = [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            f"<title>nanpass report: {e(self.model)}</title>",
            f"<style>{_CSS}</style></head><body>",
            f"<h1>nanpass report: {e(self.model)}</h1>",
            f'<p class="summary">{e(self.summary())}</p>',
        ]
        for i, g in enumerate(self.graphs):
            parts.append(f'<section id="graph-{i}"><h2>Graph {i} <small>({e(g.capture)} capture)</small></h2>')
            parts.append('<table class="changes"><thead><tr><th>action</th><th>op</th><th>spelling</th>'
                         "<th>module</th><th>source</th><th>guard / reason</th><th>constants</th></tr></thead><tbody>")
            for k, c in enumerate(g.changes):
                cid = f"change-{i}-{k}"
                module = e(c.module or "<root>") + (f" <small>({e(c.module_type)})</small>" if c.module_type else "")
                source = (f"<code>{e(_rel(c.source))}</code><br><code>{e(c.code or '')}</code>" if c.source else "")
                text = (f"{e(c.guard)}<br><small>{e(c.reason)}</small>" if c.guard else e(c.reason))
                consts = ", ".join(f"{e(k2)}={_fmt(v)}" for k2, v in c.constants)
                consts = f"{e(c.dtype)}: {consts}" if consts else ""
                parts.append(
                    f'<tr id="{cid}" class="{e(c.action)}"><td>{e(c.action)}</td><td>{e(c.op)}</td>'
                    f"<td><code>{e(c.spelling)}</code></td><td>{module}</td><td>{source}</td>"
                    f"<td>{text}</td><td>{consts}</td></tr>"
                )
            parts.append("</tbody></table>")
            if g.asserts:
                parts.append('<table class="changes asserts"><thead><tr><th>shape assert</th><th>enforces</th>'
                             "<th>entering</th><th>produced by</th></tr></thead><tbody>")
                parts.extend(f"<tr><td><code>{e(a.node)}</code></td><td><code>{e(a.shape_text())}</code></td>"
                             f"<td>{e(a.entering)}</td><td>{e(a.produced_by)}</td></tr>" for a in g.asserts)
                parts.append("</tbody></table>")
            before = {c.original: (f"change-{i}-{k}", c.action) for k, c in enumerate(g.changes)}
            after = {c.node: (f"change-{i}-{k}", c.action) for k, c in enumerate(g.changes) if c.node}
            if g.code_before or g.code:  # a graph capture; interception has no code of its own
                parts.append('<div class="diff">')
                parts.append(_code_html("before", g.code_before, before, f"g{i}-before"))
                parts.append(_code_html("after", g.code, after, f"g{i}-after"))
                parts.append("</div>")
            parts.append("</section>")
        parts.append("</body></html>")
        return "\n".join(parts) + "\n"


def _change_dict(c: Change) -> dict:
    return {
        "action": c.action,
        "op": c.op,
        "spelling": c.spelling,
        "module": c.module,
        "module_type": c.module_type,
        "source": _rel(c.source),
        "code": c.code,
        "node": c.node or None,
        "original_node": c.original,
        "guard": c.guard or None,
        "reason": c.reason,
        "dtype": c.dtype,
        "constants": {k: v for k, v in c.constants},
        "after_stable": c.after_stable,
        "changes_rounding": c.action == "stable",  # a stable form: not bitwise on safe inputs
    }


_ASSIGN = re.compile(r"^\s+([A-Za-z_][A-Za-z0-9_]*)\s*=")


def _code_html(title: str, code: str, marks: dict, prefix: str) -> str:
    rows = []
    for line in code.strip("\n").splitlines():
        m = _ASSIGN.match(line)
        hit = marks.get(m.group(1)) if m else None
        text = html.escape(line)
        if hit is None:
            rows.append(f'<span class="line">{text}</span>')
        else:
            cid, action = hit
            rows.append(
                f'<a class="line changed {html.escape(action)}" id="{prefix}-{html.escape(m.group(1))}" '
                f'href="#{cid}">{text}</a>'
            )
    # each line is a block element: no newline between them, or every line is doubled
    return f'<div class="code"><h3>{title}</h3><pre>' + "".join(rows) + "</pre></div>"


def _md_cell(s: str | None) -> str:
    # a table cell is one line, and a | would end it (GFM reads \| as a | even in a code span)
    return " ".join((s or "").splitlines()).replace("|", "\\|")


def _md(s: str | None) -> str:
    """A user string as markdown text: ``<``, ``>`` and ``&`` escaped, so a module named
    ``<script>...</script>`` is shown, never embedded as HTML."""
    return _md_cell(html.escape(s or "", quote=False))


def _md_code(s: str | None) -> str:
    """A user string as a markdown code span (its content is literal text, HTML included): the
    fence is one backtick longer than the longest run of backticks in it, so it cannot be closed
    early and let the rest through as markdown/HTML."""
    s = _md_cell(s)
    runs = re.findall(r"`+", s)
    fence = "`" * (max(map(len, runs), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{fence}{pad}{s}{pad}{fence}"


_COLORS = {"guarded": "32", "stable": "36", "left": "33"}


def _paint(text: str, action: str) -> str:
    return f"\033[{_COLORS.get(action, '0')}m{text}\033[0m"


_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
.summary{font-weight:600}
table.changes{border-collapse:collapse;width:100%;font-size:13px}
table.changes td,table.changes th{border:1px solid #ccc;padding:3px 6px;vertical-align:top;text-align:left}
tr.guarded td:first-child{background:#d9f2d9} tr.stable td:first-child{background:#d9eef2}
tr.left td:first-child{background:#f7efd0}
tr:target{outline:3px solid #e07b00}
.diff{display:flex;gap:1em;margin-top:1em}
.code{flex:1;min-width:0} .code pre{overflow-x:auto;background:#f7f7f7;padding:.5em;font-size:12px}
.line{display:block;white-space:pre}
a.changed{display:block;white-space:pre;color:inherit;text-decoration:none;background:#fff3b0}
a.changed.guarded{background:#d9f2d9} a.changed.stable{background:#d9eef2} a.changed.left{background:#f7efd0}
"""


def report(obj) -> Report:
    """The report of a hardened model, a ``nanpass.backend(...)``, or a model compiled with
    ``backend="nanpass"`` that has run at least once."""
    from ._backend import Backend, graphs_of
    from ._harden import Hardened

    if isinstance(obj, Hardened):
        if not obj.graphs:
            raise ReportError("nanpass: nothing looked at yet: the hardened model finds its call "
                              "sites as it runs; call it once first")
        return Report(type(obj.original).__name__, obj.graphs)
    if isinstance(obj, Backend):
        return Report("nanpass.backend", obj.graphs)
    if isinstance(obj, torch.nn.Module):
        model = getattr(obj, "_orig_mod", obj)
        graphs = graphs_of(model)
        if not graphs:
            raise ReportError(
                f"nanpass: no graph of {type(model).__name__} was compiled with the nanpass backend; "
                'run torch.compile(model, backend="nanpass") once first (for a model without '
                "parameters, pass backend=nanpass.backend() and report that object)"
            )
        return Report(type(model).__name__, graphs)
    raise NanpassTypeError(
        f"nanpass: report() takes a hardened model, a compiled model or a nanpass.backend(), "
        f"got {type(obj).__name__}"
    )
