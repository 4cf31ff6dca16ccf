"""`dpbench-report DIR`: the runs under DIR as a paper-style table (mean ± SE over seeds, the paper's
number beside ours), the ordering check of a mini table, and plots.

    dpbench-report outputs/multirun/dpgrape_t6_mini                      # paper/table from the preset
    dpbench-report outputs/multirun/x --paper dpgrape:T6 --metric best --format markdown
    dpbench-report outputs/multirun/dpgrape_t6_mini --check               # exit 1 if report.expect fails
    dpbench-report outputs/multirun/bench_mini --leaderboard --format html   # dpbench's own benchmark
    dpbench-report outputs/multirun/bench_mini_tuned --leaderboard          # methods tuned by private studies
    dpbench-report outputs/runs/RUN --recheck          # epsilon recomputed from results.json by dp-accounting

Runs are averaged only when their resolved configs differ in nothing but the seed (`seed`,
`dataset.data_seed`) and ran the same number of steps; otherwise they stay separate rows and a
note names the key that differs.

A folder with an audit.json (`dpbench-audit`) adds the audit: a run's row gains the one-run
audit's lower bound on ε and its ceiling ("audit ε≥", "ceiling"), and a "Privacy audits" table
lists every audit (claimed ε, lower bound, ceiling, canaries, correct/guesses, verdict), those
without a results.json included.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dpbench.errors import UserError
from dpbench.logging.console import console
from dpbench.logging.results import RESULTS_FILE
from dpbench.tools.report.expect import check
from dpbench.tools.report.formatting import fmt
from dpbench.tools.report.groups import group_runs, ratios
from dpbench.tools.report.html import page, write_page
from dpbench.tools.report.leaderboard import COMPUTE_NOTE, NUMERIC, board_table, build_boards, csv_table, fairness, fairness_markdown, headline
from dpbench.tools.report.load import AUDIT_FILE, AuditRow, load_report
from dpbench.tools.report.paper import caption, paper_ref
from dpbench.tools.report.studies import NUMERIC as STUDY_NUMERIC
from dpbench.tools.report.studies import build_study_boards, load_studies, plot_tuned_vs_paper, study_board_table, study_notes
from dpbench.tools.report.plots import leaderboard_figures, plot_accuracy_vs_epsilon, plot_memory, plot_throughput, task_slug
from dpbench.tools.report.tables import (
    AUDIT_NUMERIC,
    AUDIT_TITLE,
    FORMATS,
    build_audit_table,
    build_table,
    choose_metric,
    render,
)
from dpbench.tools.report.wandb_export import log_leaderboard


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpbench-report", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="folder searched recursively for results.json (and audit.json)")
    parser.add_argument("--paper", default=None, help="paper table to put beside ours, e.g. dpgrape:T6 (default: the preset's report.paper/table)")
    parser.add_argument("--metric", choices=("final", "best"), default=None, help="final or best test accuracy (default: the preset's report.metric, else final)")
    parser.add_argument("--format", choices=FORMATS + ("html",), default="rich",
                        help="html (with --leaderboard): a self-contained page, leaderboard.html in --out")
    parser.add_argument("--leaderboard", action="store_true",
                        help="per task and ε, methods ranked by accuracy with memory and speed beside DP-Adam's and Adam's, "
                             "the Pareto frontier, the fairness statement; figures as PNG and SVG")
    parser.add_argument("--wandb", action="store_true", help="with --leaderboard: log it as a W&B Table plus its figures (offline unless WANDB_MODE says otherwise)")
    parser.add_argument("--recheck", action="store_true",
                        help="recompute each run's epsilon from its results.json (privacy.dp_events) with dp-accounting "
                             "and print its lower and upper bounds beside the recorded one; exit 1 if one is below")
    parser.add_argument("--check", action="store_true", help="exit 1 unless every ordering in report.expect holds")
    parser.add_argument("--compare-with", type=Path, default=None,
                        help="with --leaderboard over private studies: the paper-hyperparameter benchmark's folder whose "
                             "ranks are shown beside the tuned ones (default: the preset's report.compare_with)")
    parser.add_argument("--out", type=Path, default=None, help="where the figures (and leaderboard.html) go (default: the folder)")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--predict-gpu", action="store_true",
                        help="add each group's predicted GPU peak: its first run's step traced on fake tensors "
                             "(docs/memory-prediction.md; seconds per small run, a minute for a large model)")
    parser.exit_on_error = False  # a bad flag or value: one line, not the usage block

    def one_line(message: str):  # argparse's own error() prints the usage block (a missing folder)
        raise argparse.ArgumentError(None, message)

    parser.error = one_line
    try:
        args = parser.parse_args(argv)
    except argparse.ArgumentError as error:
        console.print(f"[bold red]error:[/] {error} (dpbench-report --help lists the options)", soft_wrap=True)
        return 2
    try:
        return _report(args)
    except UserError as error:
        console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
        return 2


def _report(args) -> int:
    if not args.folder.is_dir():
        raise UserError(f"{args.folder} is not a folder; pass the multirun folder, e.g. outputs/multirun/<name>")
    if args.recheck:
        from dpbench.tools.report.recheck import recheck

        return recheck(args.folder)
    if args.leaderboard and (studies := load_studies(args.folder)):  # a tuned benchmark: private studies
        return _study_leaderboard(args, studies)
    rows, audits = load_report(args.folder)
    if not rows and not audits:
        raise UserError(f"no {RESULTS_FILE} (nor {AUDIT_FILE}) under {args.folder}; run `dpbench -m ...` first")
    if not rows:  # audits only (dpbench-audit's run folders): their table is the report
        if args.format == "html" or args.wandb:
            raise UserError(f"no {RESULTS_FILE} under {args.folder}: the leaderboard needs runs; "
                            f"its {len(audits)} {AUDIT_FILE} print without --format html / --wandb")
        _print_audits(audits, args.format)
        return 0
    groups, notes = group_runs(rows)
    metric = choose_metric(groups, args.metric)
    if args.leaderboard and args.predict_gpu:
        raise UserError("--predict-gpu adds a column to the run table, not to the leaderboard: drop one of them")
    if args.leaderboard:
        return _leaderboard(args, groups, metric, audits)
    if args.format == "html" or args.wandb:
        raise UserError(f"--{'format html' if args.format == 'html' else 'wandb'} is for the leaderboard: add --leaderboard")
    ref = paper_ref(groups, args.paper)
    title = f"dpbench results ({metric} test accuracy)"
    if ref is not None:
        title += f" beside {ref.paper} {ref.table}" + (f" column {ref.column}" if ref.column else "")
        title += f": {caption(ref)}"
    predicted = None
    if args.predict_gpu:
        from dpbench.tools.report.predicted import predicted_gpu_mib

        note = lambda text: console.print(f"[yellow]note:[/] {text}", soft_wrap=True)  # noqa: E731
        predicted = [predicted_gpu_mib(args.folder / g.first.path, note) for g in groups]
    header, body = build_table(groups, metric, ref, predicted)
    rendered = render(header, body, args.format, title)
    if args.format == "rich":
        console.print(rendered)
    else:
        print(rendered)
    _print_audits(audits, args.format)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    for r in ratios(rows):
        console.print(
            f"grape/dpadam at batch {r.batch_size}: peak memory {fmt(r.peak_mib, '.3f')} "
            f"(run's own {fmt(r.run_mib, '.3f')}), "
            f"per-sample grads {fmt(r.per_sample_grad_bytes, '.3f')}, throughput {fmt(r.samples_per_s, '.3f')}",
            soft_wrap=True,
        )
    if not args.no_plots:
        out = args.out or args.folder
        out.mkdir(parents=True, exist_ok=True)
        for made in (plot_memory(groups, out / "memory_vs_batch.png"), plot_throughput(groups, out / "throughput_vs_batch.png"),
                     plot_accuracy_vs_epsilon(groups, metric, out / "accuracy_vs_epsilon.png")):
            if made is not None:
                console.print(f"[dim]plot: {made}[/]")
    if args.check:
        return _check(groups, metric)
    return 0


def _leaderboard(args, groups, metric: str, audits: list[AuditRow]) -> int:
    boards = build_boards(groups, metric)
    fair = fairness(boards)
    out = args.out or args.folder
    figures = leaderboard_figures(boards) if (not args.no_plots or args.format == "html" or args.wandb) else {}
    if args.format in ("rich", "markdown", "latex"):
        for board in boards:
            header, body = board_table(board)
            if args.format == "rich":  # the terminal is narrow: leave out columns with nothing in them
                keep = [i for i, _ in enumerate(header) if any(row[i] for row in body)]
                header, body = [header[i] for i in keep], [[row[i] for i in keep] for row in body]
            rendered = render(header, body, args.format, f"{board.title} ({board.memory_kind})", numeric=NUMERIC,
                              narrow=True)
            if args.format == "rich":
                console.print(rendered)
            else:
                print(rendered + "\n")
        console.print(COMPUTE_NOTE, soft_wrap=True, markup=False)
    elif args.format == "csv":
        print(render(*csv_table(boards), "csv", ""))
    if args.format != "html":
        _print_audits(audits, args.format)
    if args.format in ("rich", "markdown"):
        text = fairness_markdown(fair)
        if args.format == "rich":
            console.print(text, soft_wrap=True, markup=False)
        else:
            print(text)
    for line in headline(boards):
        console.print(line, soft_wrap=True, markup=False)
    if figures and not args.no_plots:
        _write_figures(figures, out)
    if args.format == "html":
        title = f"dpbench leaderboard: {args.folder.resolve().name}"
        made = write_page(out / "leaderboard.html", page(boards, fair, figures, title, audits))
        console.print(f"page: {made}", soft_wrap=True)
    if args.wandb:
        sync = log_leaderboard(boards, figures, out, args.folder.resolve().name)
        console.print(f"W&B: the leaderboard is logged{f'; upload it with: {sync}' if sync else ''}", soft_wrap=True)
    if args.check:
        return _check(groups, metric)
    return 0


def _study_leaderboard(args, studies) -> int:
    """The leaderboard of methods tuned by private studies (dpbench/tools/report/studies.py)."""
    if args.format == "html" or args.wandb or args.check:
        raise UserError("a leaderboard of private studies prints as rich, markdown, csv or latex; "
                        "drop --format html / --wandb / --check")
    compare = args.compare_with
    if compare is None:  # the preset's report.compare_with, read from a selected trial's config
        compare = next((Path(c) for c in (_compare_with_of(args.folder),) if c), None)
    boards = build_study_boards(studies, compare, args.metric or "final")
    for board in boards:
        header, body = study_board_table(board)
        rendered = render(header, body, args.format, board.title, numeric=STUDY_NUMERIC, narrow=True)
        if args.format == "rich":
            console.print(rendered)
        else:
            print(rendered + "\n")
    for line in study_notes(boards):
        console.print(line, soft_wrap=True, markup=False)
    if compare is not None and compare.is_dir():
        console.print(f"paper-hyperparameter ranks from {compare} (among the methods shown)", soft_wrap=True, markup=False)
    if not args.no_plots:
        for board in boards:
            made = plot_tuned_vs_paper(board, (args.out or args.folder) / f"tuned_vs_paper_{task_slug(f'{board.dataset} · {board.model}')}.png")
            if made is not None:
                console.print(f"[dim]plot: {made}[/]", soft_wrap=True)
    return 0


def _compare_with_of(folder: Path) -> str | None:
    for row in load_report(folder)[0]:
        if row.report.get("compare_with"):
            return str(row.report["compare_with"])
    return None


def _print_audits(audits: list[AuditRow], kind: str) -> None:
    """The Privacy audits table (nothing when no folder holds an audit.json)."""
    if not audits:
        return
    rendered = render(*build_audit_table(audits), kind, AUDIT_TITLE, numeric=AUDIT_NUMERIC)
    if kind == "rich":
        console.print(rendered)
    else:
        print("\n" + rendered)


def _write_figures(figures: dict, out: Path) -> None:
    """leaderboard_<task>_<figure>.png and .svg in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for task, named in figures.items():
        for name, kinds in named.items():
            stem = out / f"leaderboard_{task_slug(task)}_{name}"
            for kind, data in kinds.items():
                Path(f"{stem}.{kind}").write_bytes(data)  # not with_suffix: 'opt-1.3b' has a dot
            console.print(f"[dim]plot: {stem}.png|svg[/]", soft_wrap=True)


def _check(groups, metric: str) -> int:
    passed, lines = check(groups, metric)
    console.print("ordering check:" if passed else "[bold red]ordering check failed:[/]")
    for line in lines:
        console.print(line, soft_wrap=True, markup=False)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
