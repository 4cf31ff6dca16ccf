"""dpbench-report: tables of a folder of runs beside the papers' numbers, the ordering check of the
mini presets (`report.expect`), and plots.

    load.py        results.json -> one RunRow per run (through the RunResults contract);
                   audit.json -> one AuditRow per audit (its bounds join the run's row)
    groups.py      which runs are averaged (they differ only in the seed), mean ± SE, comparison cells
    paper.py       the paper's number beside ours (dpbench/papers/)
    expect.py      report.expect: the small, safe expression evaluator behind --check
    tables.py      the paper-style table, the privacy audits' table, their renderings (rich, markdown, csv, latex)
    plots.py       matplotlib figures
    cli.py         the console script `dpbench-report` (main)
"""

from dpbench.tools.report.expect import check, evaluate
from dpbench.tools.report.groups import Group, group_runs, ratios
from dpbench.tools.report.load import AuditRow, RunRow, load_report, load_rows

__all__ = ["AuditRow", "Group", "RunRow", "check", "evaluate", "group_runs", "load_report", "load_rows", "main", "ratios"]


def main(argv: list[str] | None = None) -> int:
    """The console script `dpbench-report` (dpbench.tools.report.cli.main; imported on call, so that
    `python -m dpbench.tools.report.cli` runs the module once)."""
    from dpbench.tools.report.cli import main as cli_main

    return cli_main(argv)
