"""The graph diff report: every op nanpass looked at, with the user's module path and source line.

Output is deterministic (same model, same report, byte for byte) so it can be stored and diffed:
source paths under the working directory are shown relative to it, library paths from their
package down (``transformers/models/llama/modeling_llama.py:66``, wherever the environment is),
and nothing time- or address-dependent is included.

The same call in repeated layers (``model.layers.0.self_attn`` ... ``model.layers.31.self_attn``)
is one row of the text, markdown and HTML (``model.layers.{0..31}.self_attn``, with its count);
the JSON keeps every change and adds the groups.
"""

from __future__ import annotations

import html
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ._errors import NanpassError, NanpassTypeError
from ._rewrite import Change, GraphRecord, summary
from ._source import _rel

SCHEMA = "nanpass.report/1"


class ReportError(NanpassError):
    """No report can be made for the object given."""


def _fmt(v: float) -> str:
    return f"{v:.6g}"


# -- grouping ------------------------------------------------------------------------------------
_INDEX_PART = re.compile(r"0|[1-9][0-9]*")  # a layer index in a module path, as ModuleList names it


@dataclass(frozen=True)
class Group:
    """One row of the grouped report: the same call (op, spelling, action, guard, source line,
    module class, dtype and constants) in modules whose paths differ only by layer indices —
    ``model.layers.0.self_attn`` ... ``model.layers.31.self_attn`` — or a single change."""

    changes: tuple[Change, ...]  # in the order the model ran them
    indices: tuple[int, ...]  # their positions in the graph's ``changes``
    module: str  # "model.layers.{0..31}.self_attn"; a single change's own path
    exact: bool = True  # whether ``module`` names exactly these modules (false: it has a ``*``)

    @property
    def first(self) -> Change:
        return self.changes[0]

    @property
    def modules(self) -> list[str]:
        """The module paths, each once, in the order the model ran them."""
        return list(dict.fromkeys(c.module for c in self.changes))

    @property
    def count_text(self) -> str:
        """``"32 modules"``; ``"64 calls in 32 modules"`` when a module made the call twice; ``""``
        for one change."""
        n, m = len(self.changes), len(self.modules)
        if n == 1:
            return ""
        return f"{m} modules" if n == m else f"{n} calls in {m} module{'s' if m != 1 else ''}"


def _key(c: Change, i: int) -> tuple:
    parts = tuple(None if _INDEX_PART.fullmatch(p) else p for p in c.module.split("."))
    if None not in parts:  # no layer index: a row of its own
        return ("single", i)
    return (c.action, c.op, c.spelling, c.module_type, c.source, c.code, c.guard, c.reason,
            c.dtype, c.constants, c.after_stable, parts)


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 3, 5, 7, 8, 9]`` -> ``"{0..3,5,7..9}"``."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    text = ",".join(str(a) if a == b else f"{a},{b}" if b == a + 1 else f"{a}..{b}" for a, b in runs)
    return "{" + text + "}"


def _label(modules: list[str]) -> tuple[str, bool]:
    """One name for module paths that differ only by their numeric parts, and whether it is
    exact: each part that varies written as the set of its values,
    ``model.layers.{0..31}.self_attn``; when several parts vary and the paths are not every
    combination of their values, ``*`` stands for each (not exact)."""
    split = [m.split(".") for m in modules]
    if len(split) == 1:
        return modules[0], True
    values = [sorted({int(parts[k]) for parts in split}) for k in range(len(split[0]))
              if _INDEX_PART.fullmatch(split[0][k])]
    varying = [v for v in values if len(v) > 1]
    product = 1
    for v in varying:
        product *= len(v)
    exact = product == len(modules)
    out, numeric = [], iter(values)
    for part in split[0]:
        if not _INDEX_PART.fullmatch(part):
            out.append(part)
            continue
        v = next(numeric)
        out.append(str(v[0]) if len(v) == 1 else _ranges(v) if exact else "*")
    return ".".join(out), exact


def group_changes(changes: list[Change]) -> list[Group]:
    """The rows of a grouped report, in the order the model first made each call."""
    keyed: dict[tuple, list[int]] = {}
    for i, c in enumerate(changes):
        keyed.setdefault(_key(c, i), []).append(i)
    groups = []
    for idx in keyed.values():  # dicts keep insertion order: first occurrence
        members = tuple(changes[i] for i in idx)
        label, exact = _label(list(dict.fromkeys(c.module for c in members)))
        groups.append(Group(members, tuple(idx), label, exact))
    return groups


def _counts(changes: list[Change]) -> dict:
    # counted as the summary counts: a guard on the result of a stable form is part of that
    # form, not another unsafe op (it stays in "changes", marked)
    return {
        "by_action": dict(sorted(Counter(
            c.action for c in changes if c.action == "left" or not c.after_stable).items())),
        "by_op": dict(sorted(Counter(
            c.op for c in changes if c.action != "left" and not c.after_stable).items())),
    }


class Report:
    """What nanpass did to a model, one section per captured graph.

    ``to_text``, ``to_markdown`` and ``to_html`` show the same call in repeated layers as one row
    (``group=False``: a row per change); ``to_json`` keeps every change and adds the groups."""

    def __init__(self, model: str, graphs: Iterable[GraphRecord], certificate=None):
        self.model = model
        self.graphs = list(graphs)
        self.certificate = certificate  # a nanpass.certify(...) result: its verdicts are shown too

    @property
    def changes(self) -> list[Change]:
        return [c for g in self.graphs for c in g.changes]

    def summary(self) -> str:
        return summary(self.changes)

    def rows(self, graph: GraphRecord, group: bool = True) -> list[Group]:
        """The rows of one graph's table: grouped by ``group_changes``, or one per change."""
        if group:
            return group_changes(graph.changes)
        return [Group((c,), (k,), c.module) for k, c in enumerate(graph.changes)]

    def _rows_line(self, group: bool) -> str | None:
        """``"162 ops looked at, shown in 7 rows: ..."`` when grouping saved rows."""
        if not group:
            return None
        total = len(self.changes)
        rows = sum(len(group_changes(g.changes)) for g in self.graphs)
        if rows == total:
            return None
        return (f"{total} ops looked at, shown in {rows} rows: the same call in repeated layers "
                f"is one row")

    # -- structured ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        changes = self.changes
        return {
            "schema": SCHEMA,
            "model": self.model,
            "summary": self.summary(),
            "counts": _counts(changes),
            "graphs": [
                {
                    "index": i,
                    "capture": g.capture,
                    "changes": [_change_dict(c) for c in g.changes],
                    "groups": [_group_dict(r) for r in group_changes(g.changes)],
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
            **({"certificate": self.certificate.to_dict()} if self.certificate is not None else {}),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    # -- text --------------------------------------------------------------------------------
    def to_text(self, color: bool | None = None, group: bool = True) -> str:
        if color is None:
            color = sys.stdout.isatty() and os.environ.get("NO_COLOR") is None
        paint = _paint if color else (lambda s, _: s)
        lines = [f"nanpass report: {self.model}", self.summary()]
        rows_line = self._rows_line(group)
        if rows_line:
            lines.append(rows_line)
        lines.append("")
        for i, g in enumerate(self.graphs):
            if len(self.graphs) > 1:
                lines.append(f"graph {i} ({g.capture} capture): {len(g.changes)} ops looked at")
            for row in self.rows(g, group):
                c = row.first
                where = row.module or "<root>"
                about = ", ".join(x for x in (c.module_type, row.count_text) if x)
                if about:
                    where += f" ({about})"
                lines.append(f"  {paint(f'{c.action:8}', c.action)} {c.op:20} {c.spelling:28} {where}")
                if not row.exact:
                    lines.append(f"      modules: {', '.join(row.modules)}")
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
        if self.certificate is not None:
            lines.append(str(self.certificate))
        return "\n".join(lines).rstrip() + "\n"

    def __str__(self) -> str:
        return self.to_text()

    def __repr__(self) -> str:
        return f"<nanpass.Report {self.model}: {self.summary()}>"

    def to_markdown(self, group: bool = True) -> str:
        """GitHub-flavoured markdown. Every user string stays text: HTML-escaped in table cells,
        or inside a code span whose backtick fence it cannot close."""
        out = [f"# nanpass report: {_md(self.model)}", "", f"**{_md(self.summary())}**", ""]
        rows_line = self._rows_line(group)
        if rows_line:
            out.extend([_md(rows_line), ""])
        for i, g in enumerate(self.graphs):
            out.append(f"## Graph {i} ({_md(g.capture)} capture)")
            out.append("")
            out.append("| action | op | spelling | module | source | guard / reason | constants |")
            out.append("|---|---|---|---|---|---|---|")
            for row in self.rows(g, group):
                c = row.first
                module = _md(row.module or "<root>")
                if len(row.changes) > 1:  # {0..31} and * are ours: * must not read as emphasis
                    module = module.replace("*", "\\*")
                about = ", ".join(x for x in (_md(c.module_type), _md(row.count_text)) if x)
                module += f" ({about})" if about else ""
                if not row.exact:
                    module += ": " + ", ".join(_md(m) for m in row.modules)
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
        cert = self.certificate
        if cert is not None:
            out += ["## Certificate", "", f"**{_md(_verdict_line(cert))}**", "",
                    "| verdict | op | module | source | operands -> result | gradient | why / fix |",
                    "|---|---|---|---|---|---|---|"]
            out += [f"| {_md(v.verdict)} | {_md(v.op)} | {_md(v.module or '<root>')} "
                    f"| {_md_code(_rel(v.source)) if v.source else ''} "
                    f"| {_md(v.operands)} -> {_md(v.result)} | {_md(v.grad)} "
                    f"| {_md(v.reason + (' — fix: ' + v.guard if v.verdict == 'unsafe' and v.guard else ''))} |"
                    for v in cert.verdicts]
            out.append("")
        return "\n".join(out)

    # -- html ----------------------------------------------------------------------------------
    def to_html(self, group: bool = True) -> str:
        """One self-contained page: no script, no external resource; every user string escaped.
        Counts first, then a table per graph in the order the model ran; the same call in
        repeated layers is one row whose module list is a ``<details>``; each row and each
        change keeps its anchor, ``#change-<graph>-<index in the graph's changes>``."""
        e = html.escape
        changes = self.changes
        counts = _counts(changes)
        left = dict(sorted(Counter(c.op for c in changes if c.action == "left").items()))
        parts = [
            "<!doctype html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            f"<title>nanpass report: {e(self.model)}</title>",
            f"<style>{_CSS}</style></head><body>",
            f"<h1>nanpass report: {e(self.model)}</h1>",
            f'<p class="summary">{e(self.summary())}</p>',
            '<div class="overview">',
            _count_table("by action", counts["by_action"]),
            _count_table("unsafe ops, by op", counts["by_op"]),
            _count_table("left alone, by op", left),
            "</div>",
        ]
        rows_line = self._rows_line(group)
        if rows_line:
            parts.append(f'<p class="rows">{e(rows_line)}</p>')
        for i, g in enumerate(self.graphs):
            parts.append(f'<section id="graph-{i}"><h2>Graph {i} <small>({e(g.capture)} capture)</small></h2>')
            parts.append('<table class="changes"><colgroup><col class="c-action"><col class="c-op">'
                         '<col class="c-module"><col class="c-source"><col class="c-guard"><col class="c-consts">'
                         "</colgroup><thead><tr><th>action</th><th>op</th><th>module</th><th>source</th>"
                         "<th>guard / reason</th><th>constants</th></tr></thead><tbody>")
            row_of: dict[int, str] = {}  # change index -> the id of the row that shows it
            for row in self.rows(g, group):
                c, rid = row.first, f"change-{i}-{row.indices[0]}"
                row_of.update((k, rid) for k in row.indices)
                module = f'<code class="module">{_breaks(row.module or "<root>", ".")}</code>'
                module += f" <small>({e(c.module_type)})</small>" if c.module_type else ""
                if len(row.changes) > 1:
                    members = "".join(_member_html(i, k, m, k == row.indices[0])
                                      for k, m in zip(row.indices, row.changes, strict=True))
                    module += (f'<details><summary>{e(row.count_text)}</summary><ol class="members">{members}'
                               "</ol></details>")
                source = (f'<code class="path">{_breaks(_rel(c.source), "/")}</code>'
                          f'<pre class="src">{e(c.code or "")}</pre>' if c.source else "")
                text = (f"{e(c.guard)}<br><small>{e(c.reason)}</small>" if c.guard else e(c.reason))
                consts = "".join(f"<br>{e(k2)}={_fmt(v)}" for k2, v in c.constants)
                consts = f"{e(c.dtype)}:{consts}" if consts else ""
                parts.append(
                    f'<tr id="{rid}" class="{e(c.action)}"><td>{e(c.action)}</td>'
                    f"<td>{_breaks(c.op, '_')}<br><code>{_breaks(c.spelling, '._')}</code></td><td>{module}</td>"
                    f"<td>{source}</td>"
                    f"<td>{text}</td><td>{consts}</td></tr>"
                )
            parts.append("</tbody></table>")
            if g.asserts:
                parts.append('<table class="changes asserts"><thead><tr><th>shape assert</th><th>enforces</th>'
                             "<th>entering</th><th>produced by</th></tr></thead><tbody>")
                parts.extend(f"<tr><td><code>{e(a.node)}</code></td><td><code>{e(a.shape_text())}</code></td>"
                             f"<td>{e(a.entering)}</td><td>{e(a.produced_by)}</td></tr>" for a in g.asserts)
                parts.append("</tbody></table>")
            # a changed line of the graph code links to the row that shows its change
            before = {c.original: (row_of[k], c.action) for k, c in enumerate(g.changes)}
            after = {c.node: (row_of[k], c.action) for k, c in enumerate(g.changes) if c.node}
            if g.code_before or g.code:  # a graph capture; interception has no code of its own
                parts.append('<div class="diff">')
                parts.append(_code_html("before", g.code_before, before, f"g{i}-before"))
                parts.append(_code_html("after", g.code, after, f"g{i}-after"))
                parts.append("</div>")
            parts.append("</section>")
        cert = self.certificate
        if cert is not None:
            parts.append(f'<section id="certificate"><h2>Certificate</h2><p class="summary">'
                         f"{e(_verdict_line(cert))}</p>")
            parts.append('<table class="changes"><thead><tr><th>verdict</th><th>op</th><th>module</th>'
                         "<th>source</th><th>operands &rarr; result</th><th>why / fix</th></tr></thead><tbody>")
            for v in cert.verdicts:
                fix = f"<br>fix: {e(v.guard)}" if v.verdict == "unsafe" and v.guard else ""
                grad = f"<br>gradient: {e(v.grad)}" if v.grad else ""
                parts.append(f'<tr class="{e(v.verdict)}"><td>{e(v.verdict)}</td><td>{e(v.op)}</td>'
                             f"<td>{e(v.module or '<root>')}</td><td><code>{e(_rel(v.source) or '')}</code></td>"
                             f"<td>{e(v.operands)} &rarr; {e(v.result)}</td><td>{e(v.reason)}{grad}{fix}</td></tr>")
            parts.append("</tbody></table></section>")
        parts.append("</body></html>")
        return "\n".join(parts) + "\n"


def _member_html(graph: int, k: int, c: Change, first: bool) -> str:
    """One change of a group, in its row's module list: the anchor ``change-<graph>-<k>`` (the
    first one's is the row itself), the module path and, for a graph capture, the node."""
    anchor = "" if first else f' id="change-{graph}-{k}"'
    node = c.node or c.original
    node = f" <small>{html.escape(node)}</small>" if node else ""
    return f"<li{anchor}><code>{html.escape(c.module or '<root>')}</code>{node}</li>"


def _breaks(text: str, after: str) -> str:
    """``text`` HTML-escaped, with a line-break opportunity (``<wbr>``) after each character of
    ``after``: a long path wraps at its dots or slashes, not in the middle of a name."""
    # not inside "..": a range such as {0..31} stays whole
    return re.sub(f"(?<!\\.)([{re.escape(after)}])(?!\\.)", r"\1<wbr>", html.escape(text))


def _count_table(title: str, counts: dict[str, int]) -> str:
    if not counts:
        return ""
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{n}</td></tr>" for k, n in counts.items())
    return f'<div class="count"><h3>{html.escape(title)}</h3><table class="counts"><tbody>{rows}</tbody></table></div>'


def _group_dict(row: Group) -> dict:
    c = row.first
    return {
        "module": row.module,  # "model.layers.{0..31}.self_attn"
        "module_type": c.module_type,
        "action": c.action,
        "op": c.op,
        "spelling": c.spelling,
        "source": _rel(c.source),
        "count": len(row.changes),
        "modules": row.modules,
        "changes": list(row.indices),  # indices into this graph's "changes"
    }


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
*,*::before,*::after{box-sizing:border-box}
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;overflow-wrap:anywhere}
code,pre{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
.summary{font-weight:600}
.overview{display:flex;flex-wrap:wrap;gap:1.5em;align-items:flex-start;margin:.5em 0}
table.counts{border-collapse:collapse;font-size:13px}
.count h3{font-size:13px;margin:0 0 2px}
table.counts th,table.counts td{border:1px solid #ccc;padding:2px 8px;text-align:left;font-weight:normal}
table.counts td{text-align:right;font-variant-numeric:tabular-nums}
.rows{color:#555}
table.changes{border-collapse:collapse;width:100%;table-layout:fixed;font-size:13px;margin-bottom:1em}
table.changes td,table.changes th{border:1px solid #ccc;padding:3px 6px;vertical-align:top;text-align:left}
col.c-action{width:6%} col.c-op{width:13%} col.c-module{width:22%} col.c-source{width:28%}
col.c-guard{width:20%} col.c-consts{width:11%}
pre.src{margin:2px 0 0;padding:2px 4px;background:#f7f7f7;white-space:pre-wrap;overflow-wrap:anywhere}
details summary{cursor:pointer;color:#555}
ol.members{margin:2px 0;padding-left:2.2em;max-height:16em;overflow-y:auto}
tr.guarded td:first-child{background:#d9f2d9} tr.stable td:first-child{background:#d9eef2}
tr.left td:first-child{background:#f7efd0}
tr:target,li:target{outline:3px solid #e07b00}
.diff{display:flex;gap:1em;margin-top:1em}
.code{flex:1;min-width:0} .code pre{overflow-x:auto;background:#f7f7f7;padding:.5em}
.line{display:block;white-space:pre}
a.changed{display:block;white-space:pre;color:inherit;text-decoration:none;background:#fff3b0}
a.changed.guarded{background:#d9f2d9} a.changed.stable{background:#d9eef2} a.changed.left{background:#f7efd0}
"""


def _verdict_line(cert) -> str:
    by = Counter(v.verdict for v in cert.verdicts)
    counts = ", ".join(f"{n} {k}" for k, n in sorted(by.items()))
    head = "proven: no NaN or Inf for any input in the ranges" if cert.proven else "not proven"
    return f"certificate: {head} ({counts or 'no unsafe op'})"


def _eager_section(changes: list[Change]) -> list[GraphRecord]:
    """The calls a compiled model made outside every graph (after a graph break, in a frame
    dynamo skipped, past its recompile limit), guarded as harden guards them: one section,
    capture "intercept", as a hardened model's."""
    return [GraphRecord("intercept", "\n", "\n", list(changes), 0.0)] if changes else []


def report(obj, certificate=None) -> Report:
    """The report of a hardened model, a ``nanpass.backend(...)``, or a model compiled with
    ``backend="nanpass"`` that has run at least once. ``certificate``: a ``nanpass.certify``
    result to show with it (its verdict per op)."""
    from ._backend import Backend, eager_changes, graphs_of
    from ._certify import Certificate
    from ._harden import Hardened

    if certificate is not None and not isinstance(certificate, Certificate):
        raise NanpassTypeError(f"nanpass: report(certificate=) takes a nanpass.certify(...) result, "
                               f"got {type(certificate).__name__}")
    if isinstance(obj, Hardened):
        if not obj.graphs:
            raise ReportError("nanpass: nothing looked at yet: the hardened model finds its call "
                              "sites as it runs; call it once first")
        return Report(type(obj.original).__name__, obj.graphs, certificate)
    if isinstance(obj, Backend):
        return Report("nanpass.backend", obj.graphs + _eager_section(obj.eager_changes), certificate)
    if isinstance(obj, torch.nn.Module):
        model = getattr(obj, "_orig_mod", obj)
        graphs = graphs_of(model) + _eager_section(eager_changes(model))
        if not graphs:
            raise ReportError(
                f"nanpass: no graph of {type(model).__name__} was compiled with the nanpass backend; "
                'run torch.compile(model, backend="nanpass") once first (for a model without '
                "parameters, pass backend=nanpass.backend() and report that object)"
            )
        return Report(type(model).__name__, graphs, certificate)
    raise NanpassTypeError(
        f"nanpass: report() takes a hardened model, a compiled model or a nanpass.backend(), "
        f"got {type(obj).__name__}"
    )
