"""dpbench-report --leaderboard: dpbench's own benchmark table, figures, HTML page and W&B export,
on results.json files written through the RunResults contract (no training); and the bench_*
presets, every grid point composed (no training)."""

from __future__ import annotations

import base64
import csv
import io
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.config import compose_point
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from dpbench.logging.results import (ComputeResults, MemoryResults, MetricsResults, PrivacyResults, RunResults,
                                     ThroughputResults, write_results)
from dpbench.paths import config_dir
from dpbench.tools.report import group_runs, load_rows, main
from dpbench.tools.report.leaderboard import board_table, build_boards, fairness, pareto_front
from dpbench.run_config import validate
from dpbench.schema import algo_schemas, register

MIB = 2**20
# method -> (algo, engine, accuracy by seed, own peak MiB, samples/s, steps, lr, C); accuracies are
# binary fractions so that means and ties are exact
METHODS = {
    "adam": ("adam", None, (0.96875, 0.984375), 300.0, 900.0, 100, 0.02, None),
    "dpadam": ("dpadam", "materialize", (0.75, 0.875), 800.0, 100.0, 100, 0.02, 1.0),
    "dpadam_ghost": ("dpadam", "ghost", (0.8125, 0.8125), 350.0, 80.0, 100, 0.02, 1.0),
    "grape": ("grape", "materialize", (0.84375, 0.875), 400.0, 150.0, 100, 0.02, 1.0),
    "galore_naive": ("galore_naive", None, (0.5, 0.625), 820.0, 95.0, 100, 0.02, 1.0),
    "dpzero": ("dpzero", None, (0.25, 0.375), 50.0, 2000.0, 1000, 1e-3, 10.0),
}
SOURCES = {"dpzero": "DPZero paper: 10x the first-order steps", "grape": "DP-GRAPE Table 5"}
COST = {"dpadam_ghost": 5.0, "dpzero": 2.0}  # forward-pass equivalents per example (else 3: a forward and a backward)
EXPECT = ["grape.own_mib < dpadam.own_mib", "dpadam_ghost.own_mib < dpadam.own_mib", "adam > grape"]


def write_run(folder: Path, method: str, seed: int, epsilon: float | None, expect=EXPECT, size: str = "micro",
              warmed_up: bool | None = True, budget: float | None = None, steps: int | None = None,
              measured: bool = True) -> None:
    """One run's results.json; with `budget` (train.compute_budget) it ran `steps` steps, and without
    `measured` its compute is the plan only (log_private_stats=false)."""
    algo, engine, accuracies, own_mib, speed, default_steps, lr, clip = METHODS[method]
    steps = steps or default_steps
    cost = COST.get(method, 3.0)
    compute = ComputeResults(planned_per_example=cost, planned_forward_equivalents=cost * 256 * steps, budget=budget)
    if measured:
        compute.forward_equivalents, compute.per_example, compute.examples = cost * 256 * steps, cost, 256 * steps
    private = algo != "adam"
    accuracy = accuracies[seed] - (0.0 if epsilon is None else 0.125 / epsilon)  # less accurate at small ε
    start = 500 * MIB
    results = RunResults(
        status="completed", algo=algo, model="vit", dataset="digits", seed=seed,
        privacy=PrivacyResults(private=private, epsilon=epsilon - 0.01 if private else None,
                               target_epsilon=epsilon if private else None, delta=1e-5 if private else None,
                               steps=steps, planned_steps=steps, accountant="rdp" if private else None,
                               sampling="poisson", neighboring="add_remove"),
        metrics=MetricsResults(metric="accuracy", test_accuracy=accuracy, best_test_accuracy=accuracy + 0.01),
        memory=MemoryResults(peak_bytes=int(start + own_mib * MIB), start_bytes=start, kind="cpu_peak_rss",
                             warmed_up=warmed_up),
        throughput=ThroughputResults(samples_per_s=speed, wall_s=60.0 * (seed + 1)),  # 1 and 2 minutes
        compute=compute,
        versions={"device": "cpu"},
        config={
            "seed": seed, "name": "bench_fake",
            "algo": {"name": algo, **({"per_sample": engine} if engine else {})},
            "model": {"name": "vit", "size": size}, "dataset": {"name": "digits"},
            "privacy": {"epsilon": epsilon or 8.0, "delta": 1e-5, "clip_norm": clip or 1.0, "clipping": "flat",
                        "sampling": "poisson", "neighboring": "add_remove"},
            "train": {"batch_size": 256, "steps": steps, "lr": lr, "precision": "fp32", "compute_budget": budget},
            "paper_setting": {"source": SOURCES},
            "report": {"metric": "final", "expect": list(expect)},
        },
    )
    write_results(folder / (f"{method}-eps{epsilon}-seed{seed}" + ("" if budget is None else f"-budget{budget}")), results)


@pytest.fixture
def bench(tmp_path: Path) -> Path:
    folder = tmp_path / "bench_fake"
    for method in METHODS:
        for seed in (0, 1):
            for epsilon in ((None,) if method == "adam" else (1.0, 8.0)):
                write_run(folder, method, seed, epsilon)
    return folder


def boards_of(folder: Path):
    groups, _ = group_runs(load_rows(folder))
    return build_boards(groups, "final")


def test_methods_are_ranked_with_memory_and_speed_ratios_and_the_pareto_frontier(bench):
    boards = boards_of(bench)
    assert [(b.dataset, b.model, b.epsilon) for b in boards] == [("digits", "vit-micro", 1.0), ("digits", "vit-micro", 8.0)]
    board = boards[1]
    by = {e.method: e for e in board.entries}
    assert set(by) == set(METHODS)                                     # adam is the ceiling of every ε
    assert [e.method for e in board.entries] == ["adam", "grape", "dpadam", "dpadam_ghost", "galore_naive", "dpzero"]
    assert by["adam"].rank is None and [by[m].rank for m in ("grape", "dpadam", "dpadam_ghost", "dpzero")] == [1, 2, 2, 5]  # a tie
    grape = by["grape"]
    assert grape.accuracy == 84.375 and grape.accuracy_se == pytest.approx(1.5625)
    assert grape.memory_ratio_private == pytest.approx(400 / 800) and grape.memory_ratio_public == pytest.approx(400 / 300)
    assert grape.speed_ratio == pytest.approx(1.5) and grape.epsilon == pytest.approx(7.99)
    assert grape.wall_minutes == pytest.approx(1.5)  # the mean run's wall time, in minutes
    # not dominated in (accuracy up, memory down) among the private methods; the ceiling never counts
    assert [e.method for e in pareto_front(board)] == ["dpzero", "dpadam_ghost", "grape"]
    assert not by["dpadam"].pareto and not by["galore_naive"].pareto and not by["adam"].pareto


def test_runs_under_one_compute_budget_get_a_board_at_equal_compute_beside_the_other(bench, capsys):
    """The budget's runs (each method's steps set from its cost) form their own board, after the one of
    the runs without a budget; both show forward-pass equivalents per example and ÷ DP-Adam's."""
    for seed in (0, 1):  # 9 fwd-eq per training example of n = 2560: 23,040 / (256 x cost) steps
        for method, steps in (("adam", 30), ("dpadam", 30), ("dpadam_ghost", 18), ("dpzero", 45)):
            write_run(bench, method, seed, None if method == "adam" else 8.0, budget=9.0, steps=steps)
    boards = boards_of(bench)
    assert [(b.epsilon, b.budget) for b in boards] == [(1.0, None), (8.0, None), (8.0, 9.0)]
    examples, compute = boards[1], boards[2]
    assert compute.title == "digits · vit-micro · ε = 8 · equal compute: 9 forward-pass equivalents per training example"
    assert examples.title == "digits · vit-micro · ε = 8"  # DPZero's 1000 steps: neither examples nor compute equal
    by = {e.method: e for e in compute.entries}
    assert set(by) == {"adam", "dpadam", "dpadam_ghost", "dpzero"}
    assert [by[m].per_example for m in ("dpadam", "dpadam_ghost", "dpzero")] == [3.0, 5.0, 2.0]
    assert [by[m].compute_ratio for m in ("adam", "dpadam", "dpadam_ghost", "dpzero")] == [1.0, 1.0, 1.0, 1.0]
    assert {e.method: e.compute_ratio for e in examples.entries}["dpzero"] == pytest.approx(2 * 1000 / (3 * 100))
    assert main([str(bench), "--leaderboard", "--format", "markdown", "--no-plots"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "equal compute: 9 forward-pass equivalents per training example" in out
    assert "| fwd-eq / example | compute ÷ DP-Adam |" in out and "| 2.00 | 1.00 |" in out
    assert "wall min (info)" in out and "for information only" in captured.err.replace("\n", " ")
    # report.expect compares methods within one budget (a method under two budgets is not ambiguous)
    assert main([str(bench), "--leaderboard", "--check", "--format", "csv", "--no-plots"]) == 0
    assert "compute budget 9 ε=8" in capsys.readouterr().err


def test_a_run_that_withheld_its_count_shows_the_planned_compute_flagged(bench):
    for seed in (0, 1):
        write_run(bench, "dpzero", seed, 8.0, measured=False)
    board = boards_of(bench)[1]
    dpzero = next(e for e in board.entries if e.method == "dpzero")
    assert dpzero.compute_planned and dpzero.per_example == 2.0 and dpzero.forward_equivalents == 2.0 * 256 * 1000
    header, body = board_table(board)
    row = dict(zip(header, next(r for r in body if r[1] == "dpzero")))
    assert row["fwd-eq / example"] == "2.00" and "compute planned, not measured" in row["flags"]


def test_fairness_names_what_is_equal_what_differs_and_each_source(bench):
    (item,) = fairness(boards_of(bench))
    equal = dict(item.equal)
    assert equal["dataset"] == "digits" and equal["model"] == "vit-micro" and equal["δ"] == "1e-05"
    assert equal["accountant"] == "rdp" and equal["batch size (logical)"] == "256" and equal["seeds"] == "0, 1"
    steps = dict(item.differing)["steps"]
    assert steps == {"100": "adam, dpadam, dpadam_ghost, galore_naive, grape", "1000": "dpzero"}
    sources = {m: (lr, c, s, src) for m, lr, c, s, src in item.sources}
    assert sources["dpzero"] == ("0.001", "10", "1000", SOURCES["dpzero"])
    assert sources["dpadam"][3].startswith("not recorded")


def test_markdown_csv_and_latex_leaderboards(bench, capsys):
    assert main([str(bench), "--leaderboard", "--format", "markdown", "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "**digits · vit-micro · ε = 8" in out and "| 1 | grape | 84.4 ± 1.6 | 2 | 400.0 | 0.50 | 1.33 |" in out
    assert "| ceiling | adam |" in out and "Held equal across methods" in out and SOURCES["dpzero"] in out
    assert main([str(bench), "--leaderboard", "--format", "csv", "--no-plots"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert len(rows) == 2 * len(METHODS)
    grape = next(r for r in rows if r["method"] == "grape" and r["target ε"] == "1")
    assert grape["Pareto"] == "★" and grape["mem ÷ DP-Adam"] == "0.50" and grape["ε spent"] == "0.99"
    assert main([str(bench), "--leaderboard", "--format", "latex", "--no-plots"]) == 0
    assert capsys.readouterr().out.count(r"\begin{tabular}") == 2


def test_check_reads_method_names_with_engines(bench, tmp_path):
    assert main([str(bench), "--leaderboard", "--check", "--format", "csv", "--no-plots"]) == 0
    for method in METHODS:  # reversed memory claim: must fail
        for seed in (0, 1):
            for epsilon in ((None,) if method == "adam" else (1.0, 8.0)):
                write_run(bench, method, seed, epsilon, expect=["dpadam_ghost.own_mib > dpadam.own_mib"])
    assert main([str(bench), "--leaderboard", "--check", "--format", "csv", "--no-plots"]) == 1


FIGURES = ("accuracy_vs_memory", "accuracy_vs_epsilon", "throughput")


def test_html_page_is_self_contained_with_every_method_epsilon_and_figure(bench, tmp_path):
    out = tmp_path / "report"
    assert main([str(bench), "--leaderboard", "--format", "html", "--out", str(out)]) == 0
    text = (out / "leaderboard.html").read_text()
    for method in METHODS:
        assert f"<td>{method}</td>" in text
    assert "ε = 1</h3>" in text and "ε = 8</h3>" in text and "Held equal across methods" in text
    assert SOURCES["grape"] in text
    images = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([^"]+)"', text)
    assert sorted(alt.split(":")[0] for alt, _ in images) == sorted(f.replace("_", " ") for f in FIGURES)
    assert all(base64.b64decode(data).startswith(b"\x89PNG\r\n\x1a\n") for _, data in images)
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text) and "<link" not in text   # no network
    for figure in FIGURES:  # and the figures as files, PNG and SVG
        assert (out / f"leaderboard_digits_vit-micro_{figure}.png").stat().st_size > 10_000
        assert (out / f"leaderboard_digits_vit-micro_{figure}.svg").read_text().lstrip().startswith("<?xml")


@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
def test_figures_of_every_task_are_written_even_when_its_name_has_a_dot(bench, tmp_path):
    for seed in (0, 1):
        for method in ("adam", "grape"):
            write_run(bench, method, seed, None if method == "adam" else 8.0, size="1.3b")
    out = tmp_path / "figures"
    assert main([str(bench), "--leaderboard", "--format", "csv", "--out", str(out)]) == 0
    for task in ("digits_vit-micro", "digits_vit-1.3b"):
        for figure in FIGURES:
            assert (out / f"leaderboard_{task}_{figure}.png").is_file() and (out / f"leaderboard_{task}_{figure}.svg").is_file()


def _browser() -> str | None:
    return next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "chrome")
                 if shutil.which(name)), None)


@pytest.mark.skipif(_browser() is None, reason="no headless Chromium installed (apt-get install chromium)")
def test_html_page_renders_in_a_headless_browser(bench, tmp_path):
    import matplotlib.image

    out = tmp_path / "report"
    assert main([str(bench), "--leaderboard", "--format", "html", "--out", str(out), "--no-plots"]) == 0
    url = (out / "leaderboard.html").resolve().as_uri()
    flags = [_browser(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=10000", f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([*flags, "--dump-dom", url], capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert 'data-images-loaded="3/3"' in dom.stdout, dom.stdout[:500]       # every figure decoded
    assert "grape" in dom.stdout and "dpzero" in dom.stdout
    assert not re.search(r"Uncaught|SyntaxError|ReferenceError", dom.stderr), dom.stderr[-2000:]
    shot = tmp_path / "page.png"
    done = subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1280,1800", url], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and shot.is_file(), done.stderr[-2000:]
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.std() > 0.05 and len({tuple(p) for p in pixels[::20, ::20].reshape(-1, 3).round(2)}) > 20   # not blank


@pytest.mark.slow  # starts W&B's service
def test_wandb_logs_the_leaderboard_table_and_figures_offline(bench, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "report"
    assert main([str(bench), "--leaderboard", "--wandb", "--format", "csv", "--no-plots", "--out", str(out)]) == 0
    (run,) = out.glob("wandb/offline-run-*")
    (table_file,) = run.glob("files/media/table/leaderboard_*.table.json")
    table = json.loads(table_file.read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    grape = next(r for r in rows if r["method"] == "grape" and r["target_epsilon"] == 8.0)
    assert grape["accuracy_pct"] == 84.375 and grape["memory_vs_dpadam"] == 0.5 and grape["pareto"] is True
    assert len(rows) == 2 * len(METHODS)
    images = {p.name.rsplit("_", 2)[0] for p in run.glob("files/media/images/figures/*.png")}
    assert images == {f"digits_vit-micro_{figure}" for figure in FIGURES}


def test_html_needs_the_leaderboard(bench, capsys):
    assert main([str(bench), "--format", "html"]) == 2
    captured = capsys.readouterr()
    assert "html is for the leaderboard: add --leaderboard" in (captured.out + captured.err).replace("\n", " ")


# ---------------------------------------------------------------- the bench presets: every grid point composes
# (bench_mini: the whole product; the GPU presets: every method at every value of the other keys)

register()
EXPERIMENTS = Path(config_dir()) / "experiment"
BENCH = {  # preset -> (methods it must run, image-only methods included)
    "bench_vit": True, "bench_roberta": False, "bench_opt": False, "bench_mini": True,
}
FIRST_ORDER_PRIVATE = {"dpadam", "dpsgd", "grape", "galore_naive", "dplora"}


def header_grids(name: str) -> list[list[str]]:
    """The `dpbench -m experiment=<name> ...` commands of the preset's header, as override lists."""
    header = [line[1:].strip() for line in (EXPERIMENTS / f"{name}.yaml").read_text().splitlines()[:4] if line.startswith("#")]
    commands = [part.strip() for line in header for part in line.split("&&") if part.strip().startswith("dpbench -m")]
    return [shlex.split(command)[2:] for command in commands]


def sweep_of(overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """`dpbench -m <overrides>`: its fixed overrides and its sweep (the preset's hydra.sweeper.params;
    a command-line value of one of its keys replaces it, as in Hydra's basic sweeper)."""
    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        cfg = hydra_compose(config_name="config", overrides=[o for o in overrides if o.startswith("experiment=")],
                            return_hydra_config=True)
    sweep = {k: str(v).split(",") for k, v in (cfg.hydra.sweeper.params or {}).items()}
    command_line = {o.split("=")[0]: o.split("=", 1)[1].split(",") for o in overrides}
    fixed = [o for o in overrides if o.split("=")[0] not in sweep and "," not in o]
    sweep.update({k: v for k, v in command_line.items() if k in sweep or len(v) > 1})
    return fixed, sweep


def grid_points(overrides: list[str], product: bool) -> tuple[list[list[str]], int]:
    """The grid's jobs as override lists, and the grid's size. product=False: every method (algo and
    engine) at the first value of the other keys, then each other value of those keys once: the
    same values as the whole product (epsilon and seed enter no interpolation), a fraction of the
    compositions."""
    fixed, sweep = sweep_of(overrides)
    size = 1
    for values in sweep.values():
        size *= len(values)
    methods = [[]]
    for key in [k for k in sweep if k.startswith("algo")]:
        methods = [m + [f"{key}={v}"] for m in methods for v in sweep[key]]
    others = {k: v for k, v in sweep.items() if not k.startswith("algo")}
    if product:
        points = methods
        for key, values in others.items():
            points = [p + [f"{key}={v}"] for p in points for v in values]
    else:
        first = [f"{k}={v[0]}" for k, v in others.items()]
        points = [m + first for m in methods]
        points += [methods[0] + [f"{k}={v[0]}" for k, v in others.items() if k != key] + [f"{key}={value}"]
                   for key, values in others.items() for value in values[1:]]
    return [fixed + p for p in points], size


@pytest.mark.slow  # an end-to-end sweep: the slow tier
@pytest.mark.parametrize("name", sorted(BENCH))
def test_every_grid_point_of_the_bench_presets_composes(name):
    text = (EXPERIMENTS / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n") and f"dpbench -m experiment={name}" in text.splitlines()[2]
    grids = header_grids(name)
    assert grids[1][1:] == ["algo=dpadam", "algo.per_sample=ghost,bk"]     # DP-Adam's other engines
    if name != "bench_mini":                                                # Adam once per seed, not per ε
        assert len(grids) == 3 and grids[2][1:] == ["algo=adam", "privacy.epsilon=8"]
    sized = [grid_points(grid, product=name == "bench_mini") for grid in grids]
    jobs, points, sizes = [], [p for grid, _ in sized for p in grid], [size for _, size in sized]
    bases = {}
    for point in points:
        cfg = compose_point(point, bases)
        assert OmegaConf.get_type(cfg.algo) is algo_schemas()[cfg.algo.name]
        validate(cfg, grid=True)  # values a run would refuse (physical batch > batch, ...), before any training
        jobs.append(OmegaConf.to_container(cfg, resolve=True, enum_to_str=True))
    methods = {(j["algo"]["name"], j["algo"].get("per_sample")) for j in jobs}
    algos = {a for a, _ in methods}
    assert algos >= FIRST_ORDER_PRIVATE | {"adam", "dpzero"} | ({"dcdpsgd", "dpdr"} if BENCH[name] else set())
    assert {("dpadam", e) for e in ("materialize", "ghost", "bk")} <= methods
    first_order = [j for j in jobs if j["algo"]["name"] != "dpzero"]
    zeroth = [j for j in jobs if j["algo"]["name"] == "dpzero"]
    assert len({j["train"]["steps"] for j in first_order}) == 1, "one step budget for every first-order method"
    assert min(j["train"]["steps"] for j in zeroth) > first_order[0]["train"]["steps"], "zeroth order: the longer schedule"
    for key in ("dataset", "report"):
        assert len({json.dumps({k: v for k, v in j[key].items() if k != "data_seed"}, sort_keys=True) for j in jobs}) == 1, key
    for section, key in (("train", "batch_size"), ("privacy", "delta"), ("privacy", "neighboring"), ("privacy", "sampling")):
        assert len({j[section][key] for j in jobs}) == 1, f"{section}.{key} differs between methods"
    for j in jobs:  # each method's own hyperparameters, and where they come from
        algo = j["algo"]["name"]
        assert j["train"]["lr"] == j["paper_setting"]["lr"][algo] and j["privacy"]["clip_norm"] == j["paper_setting"]["clip_norm"][algo]
        assert j["paper_setting"]["source"][algo] and j["report"]["metric"] == "final"
    seeds, epsilons = {j["seed"] for j in jobs}, {j["privacy"]["epsilon"] for j in jobs}
    if name == "bench_mini":
        assert len(jobs) == sum(sizes) <= 40 and len(seeds) == 2 and epsilons == {3.0} and len(jobs[0]["report"]["expect"]) >= 3
    else:
        assert len(seeds) == 3 and epsilons == {1.0, 3.0, 8.0} and sizes == [9 * (len(algos) - 1), 18, 3]


def test_rankings_at_two_epsilons_are_compared_with_kendalls_tau(bench):
    from dpbench.tools.report.leaderboard import headline

    (line,) = [line for line in headline(boards_of(bench)) if "Kendall" in line]
    # every private method loses the same 0.125 / ε at ε = 1: the order (one tie included) is kept
    assert "rankings at ε = 1 and ε = 8 agree with Kendall's τ = 1.00 over 5 methods" in line


def test_the_dp_adam_reference_falls_back_to_the_engine_the_board_ran(tmp_path):
    folder = tmp_path / "bk_only"
    for method in ("adam", "dpadam_ghost", "grape"):
        write_run(folder, method, 0, None if method == "adam" else 8.0)
    (board,) = boards_of(folder)
    grape = next(e for e in board.entries if e.method == "grape")
    assert board.reference("dpadam").method == "dpadam_ghost"
    assert grape.memory_ratio_private == pytest.approx(400 / 350)


def test_the_linear_probe_is_its_own_method():
    from dpbench.tools.report.load import RunRow, method_name

    probe = RunRow(path="p", algo="dpadam", algo_config={"per_sample": "bk"}, config={"model.trained_blocks": 0})
    assert method_name(probe) == "dpadam_bk_probe"
    assert method_name(RunRow(path="q", algo="dpadam", config={"model.trained_blocks": 2})) == "dpadam"


def test_a_ranking_on_few_seeds_or_within_the_noise_gets_a_caveat(tmp_path):
    from dpbench.tools.report.leaderboard import headline

    folder = tmp_path / "close"
    for method in ("dpadam", "grape", "dpzero"):  # two seeds each; dpadam 81.25 ± 6.25 and grape 85.9 ± 1.6 overlap
        for seed in (0, 1):
            write_run(folder, method, seed, 8.0)
    lines = headline(boards_of(folder))
    (few,) = [line for line in lines if "fewer than 3 seeds" in line]
    assert "dpadam (2)" in few and "grape (2)" in few and "dpzero (2)" in few
    (close,) = [line for line in lines if "under 2 SE" in line]
    assert "grape vs dpadam" in close and "dpzero" not in close  # dpzero trails by 50 points: settled


def test_a_cpu_own_peak_metered_without_the_warm_up_is_flagged(tmp_path):
    from dpbench.tools.report.leaderboard import board_table

    folder = tmp_path / "old"
    write_run(folder, "dpadam", 0, 8.0)
    write_run(folder, "grape", 0, 8.0, warmed_up=None)  # a run from before the warm-up
    header, body = board_table(boards_of(folder)[0])
    flags = {row[1]: row[header.index("flags")] for row in body}
    assert "without the warm-up" in flags["grape"] and "warm-up" not in flags["dpadam"]
