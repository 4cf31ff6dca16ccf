"""The leaderboard as one self-contained HTML page: tables, the fairness statement and the figures
inline (PNG as base64 data URIs), no network, no external file. A few lines of script only mark
on <body> how many images decoded (data-images-loaded="n/m"), for a headless browser to read."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from dpbench.tools.report.formatting import fmt_eps
from dpbench.tools.report.leaderboard import COMPUTE_NOTE, NUMERIC, PARETO_MARK, Board, Fairness, board_table, headline
from dpbench.tools.report.load import AuditRow
from dpbench.tools.report.tables import AUDIT_NUMERIC, build_audit_table

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto; max-width: 1200px; color: #222; padding: 0 1em; }
h1 { font-size: 1.6em; } h2 { margin-top: 2em; border-bottom: 1px solid #ccc; } h3 { margin-top: 1.4em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.92em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.pareto td { background: #eef6ff; } tr.ceiling td { color: #555; font-style: italic; }
tr.failed td { background: #fdecea; }
figure { margin: 1em 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption, .meta { color: #555; font-size: 0.9em; }
"""
IMAGE_CHECK = """
window.addEventListener("load", function () {
  var images = Array.prototype.slice.call(document.images);
  var loaded = images.filter(function (i) { return i.complete && i.naturalWidth > 0; }).length;
  document.body.setAttribute("data-images-loaded", loaded + "/" + images.length);
});
"""
CAPTIONS = {
    "accuracy_vs_memory": "Accuracy against each method's own peak memory (log scale), one panel per ε; "
                          "dashed: the Pareto frontier of the private methods; hollow: non-private.",
    "accuracy_vs_epsilon": "Accuracy against the target ε (mean ± SE over seeds); dashed lines: non-private.",
    "throughput": "Training throughput (samples/s), averaged over the ε of the task.",
}


def _e(value) -> str:
    return html.escape(str(value))


def _table(board: Board) -> str:
    header, body = board_table(board)
    out = ["<table>", "<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr></thead>", "<tbody>"]
    for entry, row in zip(board.entries, body):
        css = "ceiling" if not entry.private else ("pareto" if entry.pareto else "")
        cells = "".join(f'<td class="num">{_e(c)}</td>' if h in NUMERIC else f"<td>{_e(c)}</td>" for h, c in zip(header, row))
        out.append(f'<tr class="{css}">{cells}</tr>')
    return "\n".join(out + ["</tbody>", "</table>"])


def _fairness(item: Fairness) -> str:
    out = ["<h3>Fairness: what is equal, where each method's values come from</h3>",
           "<p>Held equal across methods: " + "; ".join(f"<b>{_e(what)}</b> {_e(value)}" for what, value in item.equal) + ".</p>"]
    if item.differing:
        out.append("<p>Differs between methods (by design; the sources below say why):</p><ul>")
        out += [f"<li><b>{_e(what)}</b>: " + "; ".join(f"{_e(value)} ({_e(methods)})" for value, methods in sides.items()) + "</li>"
                for what, sides in item.differing]
        out.append("</ul>")
    out.append("<table><thead><tr><th>method</th><th>lr</th><th>C</th><th>steps</th><th>hyperparameters from</th></tr></thead><tbody>")
    out += [f"<tr><td>{_e(m)}</td><td class='num'>{_e(lr)}</td><td class='num'>{_e(c)}</td><td class='num'>{_e(s)}</td><td>{_e(src)}</td></tr>"
            for m, lr, c, s, src in item.sources]
    out.append("</tbody></table>")
    return "\n".join(out)


def _audits(audits: list[AuditRow]) -> str:
    """The Privacy audits section: each audit.json's claimed ε beside its lower bound and ceiling."""
    header, body = build_audit_table(audits)
    out = ['<h2 id="audits">Privacy audits</h2>',
           '<p class="meta">dpbench-audit: the ε the accountant claims beside the one-run audit\'s empirical lower '
           "bound (a bound above the claim fails the audit; the ceiling is the most that audit could certify), and "
           "each self-audit's verdict with the names of its failed checks.</p>",
           "<table>", "<thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in header) + "</tr></thead>", "<tbody>"]
    for audit, row in zip(audits, body):
        cells = "".join(f'<td class="num">{_e(c)}</td>' if h in AUDIT_NUMERIC else f"<td>{_e(c)}</td>" for h, c in zip(header, row))
        out.append(f'<tr class="{"" if audit.passed else "failed"}">{cells}</tr>')
    return "\n".join(out + ["</tbody>", "</table>"])


def _figure(name: str, task: str, png: bytes) -> str:
    data = base64.b64encode(png).decode("ascii")
    return (f'<figure id="{_e(name)}"><img alt="{_e(name.replace("_", " "))}: {_e(task)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(CAPTIONS.get(name, name))}</figcaption></figure>")


def page(boards: list[Board], fairness: list[Fairness], figures: dict[str, dict[str, dict[str, bytes]]], title: str,
         audits: list[AuditRow] = ()) -> str:
    """The whole page. `figures`: {task: {figure name: {'png': bytes, ...}}} (plots.leaderboard_figures);
    `audits`: the audit.json files of the folder (a Privacy audits section when there are any)."""
    tasks = list(dict.fromkeys(b.task for b in boards))
    fair = {item.task: item for item in fairness}
    out = ["<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{_e(title)}</title>", f"<style>{CSS}</style>", "</head>", "<body>",
           f"<h1>{_e(title)}</h1>",
           f'<p class="meta">Ranked by {_e(boards[0].metric)} test {_e(boards[0].metric_name)} among the private methods '
           f"(mean ± SE over seeds); non-private runs are the ceiling. Memory: {_e(boards[0].memory_kind)}. "
           f"Ratios: to DP-Adam materialising per-example gradients (dpadam) and to non-private Adam at the same ε. "
           f"{PARETO_MARK} and shaded rows: on the accuracy-vs-memory Pareto frontier of the private methods. "
           f"{_e(COMPUTE_NOTE[0].upper() + COMPUTE_NOTE[1:])}.</p>",
           "<ul>" + "".join(f"<li>{_e(line)}</li>" for line in headline(boards)) + "</ul>"]
    for task in tasks:
        out.append(f"<h2>{_e(task)}</h2>")
        task_figures = figures.get(task, {})
        if "accuracy_vs_memory" in task_figures:
            out.append(_figure("accuracy_vs_memory", task, task_figures["accuracy_vs_memory"]["png"]))
        for board in (b for b in boards if b.task == task):
            out += [f'<h3 id="eps-{_e(fmt_eps(board.epsilon))}">ε = {_e(fmt_eps(board.epsilon))}</h3>', _table(board)]
        for name, kinds in task_figures.items():
            if name != "accuracy_vs_memory":
                out.append(_figure(name, task, kinds["png"]))
        if task in fair:
            out.append(_fairness(fair[task]))
    if audits:
        out.append(_audits(list(audits)))
    out += [f"<script>{IMAGE_CHECK}</script>", "</body>", "</html>"]
    return "\n".join(out) + "\n"


def write_page(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path
