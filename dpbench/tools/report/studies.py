"""`dpbench-report DIR --leaderboard` over private studies: methods ranked by their TUNED models.

A folder holding study.json files (hydra/sweeper=private_search; a tuned preset such as
bench_mini_tuned runs S studies per method) gets this board instead of the per-run one. Each study
released one model, its selected trial's, evaluated on the test set once; a method's accuracy is
the mean ± SE of those test accuracies over its studies. Beside it: the ε of one study (what each
study was charged), the ε of the method's S studies composed (they read the same data), the mean
number of trials every method was given, and the method's rank under its paper hyperparameters
(`report.compare_with` or --compare-with: that benchmark's multirun folder) with the change.
It reads study.json and the selected trial's folder beside it (the publishable files) only: the
realised numbers of trials K and the other trials' outcomes are outside each study's epsilon
(dpbench/study/publish.py) and never read or shown.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dpbench.logging.console import console
from dpbench.study.publish import PRIVATE_DIR
from dpbench.tools.report.agreement import kendall
from dpbench.tools.report.formatting import fmt, fmt_any, fmt_eps
from dpbench.tools.report.load import RunRow, load_rows, method_name

STUDY_FILE = "study.json"
HEADER = ["rank", "method", "test accuracy % (mean ± SE)", "studies", "ε per study", "ε all studies",
          "mean trials", "noisy validation %", "paper-hyperparameter rank", "change"]
NUMERIC = ("studies", "mean trials")


@dataclass
class StudyRow:
    """One study.json, with its selected trial's run (None when the study selected nothing)."""

    path: str
    method: str | None
    dataset: str | None
    model: str | None
    budget_epsilon: float | None
    epsilon_study: float
    delta: float
    mean_trials: float
    shape: float | str
    test_accuracy: float | None     # %, the selected model's, evaluated once
    validation: float | None        # %, the selected trial's noisy score
    ledger: list = field(default_factory=list)  # the selected trial's recorded ledger (its noisy score included)
    score_noise_multiplier: float | None = None
    parallel: bool = False  # privacy.validation_composition=parallel: the score composes in parallel with training


def _selected_run(study_dir: Path, data: dict) -> tuple[RunRow | None, dict]:
    """The selected trial's run row and its results.json privacy section (None, {}: the study
    selected nothing)."""
    chosen = data.get("selected") or {}
    run_dir = chosen.get("run_dir")
    if not run_dir:
        return None, {}
    # selected_trial/ beside study.json; a study of an earlier dpbench: its trial folder (or one moved beside it)
    for folder in (study_dir / run_dir, Path(run_dir), study_dir / Path(run_dir).name):
        if (folder / "results.json").is_file():
            privacy = json.loads((folder / "results.json").read_text()).get("privacy") or {}
            rows = load_rows(folder)
            return (rows[0] if rows else None), privacy
    return None, {}


def load_studies(folder: Path) -> list[StudyRow]:
    """One StudyRow per study.json under `folder` (unreadable files are reported and skipped)."""
    studies = []
    for path in sorted(Path(folder).rglob(STUDY_FILE)):
        if PRIVATE_DIR in path.relative_to(folder).parts:  # outside epsilon: never read
            continue
        try:
            data = json.loads(path.read_text())
            run, privacy = _selected_run(path.parent, data)
            chosen = data.get("selected") or {}
            test = chosen.get("test") or {}
            accuracy = test.get(test.get("metric") or "accuracy")
            score = chosen.get("validation_score")
            studies.append(StudyRow(
                path=str(path.parent.relative_to(folder)) or ".",
                method=method_name(run) if run is not None else _algo_of(data),
                dataset=run.dataset if run is not None else (data.get("task") or {}).get("dataset"),
                model=run.model if run is not None else (data.get("task") or {}).get("model"),
                budget_epsilon=data.get("budget_epsilon"),
                epsilon_study=float(data["epsilon_study"]), delta=float(data["delta"]),
                mean_trials=float(data["mean_trials"]), shape=data.get("shape"),
                test_accuracy=None if accuracy is None else 100 * float(accuracy),
                validation=None if score is None else 100 * float(score),
                ledger=privacy.get("ledger") or [], score_noise_multiplier=privacy.get("validation_noise_multiplier"),
                parallel=privacy.get("validation_composition") == "parallel"))
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            console.print(f"[yellow]warning:[/] skipping {path}: {error}")
    return studies


def _algo_of(data: dict) -> str | None:
    """A study that selected nothing: its algorithm from study.json itself (the publishable file
    alone: the private state, K and outcomes are never read)."""
    fixed = data.get("fixed_overrides") or []
    return (data.get("task") or {}).get("algo") or next((o.split("=", 1)[1] for o in fixed if o.startswith("algo=")), None)


@dataclass
class StudyEntry:
    method: str
    studies: list[StudyRow]
    rank: int | None = None
    paper_rank: int | None = None
    paper_accuracy: float | None = None  # %, mean over seeds at the paper hyperparameters (compare_with)

    def _values(self, name: str) -> list[float]:
        return [getattr(s, name) for s in self.studies if getattr(s, name) is not None]

    @property
    def accuracy(self) -> float | None:
        values = self._values("test_accuracy")
        return statistics.fmean(values) if values else None

    @property
    def accuracy_se(self) -> float | None:
        values = self._values("test_accuracy")
        return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None

    @property
    def validation(self) -> float | None:
        values = self._values("validation")
        return statistics.fmean(values) if values else None

    @property
    def epsilon_study(self) -> float:
        return max(s.epsilon_study for s in self.studies)

    @property
    def epsilon_all(self) -> float | None:
        """The method's S studies composed (RDP, dp-accounting): they read the same training data."""
        from dpbench import study

        first = self.studies[0]
        if not first.ledger or len(self.studies) == 1:
            return self.epsilon_study if len(self.studies) == 1 else None
        event = study.trial_event(first.ledger)  # the recorded ledger holds the noisy validation score
        if first.parallel and first.score_noise_multiplier:  # training and the score on disjoint parts
            from dpbench.privacy.mechanisms import GaussianMechanism, Ledger, split_off

            score = GaussianMechanism(float(first.score_noise_multiplier), 1.0, "add_remove")
            training, taken = split_off(Ledger.from_records(first.ledger), [score])
            if taken:
                event = study.parallel_trial_event(training, score.noise_multiplier)
        return study.study_epsilon(event, first.mean_trials, first.shape, first.delta, studies=len(self.studies))


@dataclass
class StudyBoard:
    dataset: str | None
    model: str | None
    epsilon: float | None
    entries: list[StudyEntry]

    @property
    def title(self) -> str:
        return f"{self.dataset} · {self.model} · ε = {fmt_eps(self.epsilon)} per study (tuned privately)"


def build_study_boards(studies: list[StudyRow], compare_with: Path | None = None, metric: str = "final") -> list[StudyBoard]:
    """One board per task and study budget; each method's rank, and its rank on the paper-hyperparameter
    leaderboard of `compare_with` (same task and ε) when given."""
    by_board: dict[tuple, dict[str, list[StudyRow]]] = defaultdict(lambda: defaultdict(list))
    tasks = {(s.dataset, s.model) for s in studies if s.dataset is not None}
    for s in studies:
        if s.dataset is None and len(tasks) == 1:  # a study that selected nothing: the one task of the folder
            s.dataset, s.model = next(iter(tasks))
        by_board[(s.dataset, s.model, s.budget_epsilon)][str(s.method)].append(s)
    paper = _paper_ranks(compare_with, metric) if compare_with is not None else {}
    boards = []
    for (dataset, model, eps), methods in sorted(by_board.items(), key=lambda kv: tuple(map(str, kv[0]))):
        entries = [StudyEntry(m, rows) for m, rows in methods.items()]
        entries.sort(key=lambda e: (e.accuracy is None, -(e.accuracy or 0.0), e.method))
        previous, rank = None, 0
        for position, e in enumerate(entries, start=1):
            if e.accuracy is not None:
                rank = rank if previous is not None and e.accuracy == previous else position
                e.rank, previous = rank, e.accuracy
        accuracies = paper.get((dataset, model, eps), {})
        ranks = _rerank(accuracies, [e.method for e in entries])
        for e in entries:
            e.paper_rank, e.paper_accuracy = ranks.get(e.method), accuracies.get(e.method)
        boards.append(StudyBoard(dataset, model, eps, entries))
    return boards


def _paper_ranks(folder: Path, metric: str) -> dict[tuple, dict[str, float]]:
    """{(dataset, model, target ε): {method: mean accuracy}} of the per-run leaderboard in `folder`."""
    from dpbench.tools.report.groups import group_runs
    from dpbench.tools.report.leaderboard import build_boards

    if not Path(folder).is_dir():
        console.print(f"[yellow]note:[/] {folder} does not exist: no paper-hyperparameter ranks to compare with")
        return {}
    groups, _ = group_runs(load_rows(Path(folder)))
    out: dict[tuple, dict[str, float]] = {}
    for board in build_boards(groups, metric):
        if board.budget is not None:  # a board at equal compute (train.compute_budget): not the runs' own steps
            continue
        out[(board.dataset, board.model, board.epsilon)] = {e.method: e.accuracy for e in board.entries
                                                            if e.private and e.accuracy is not None}
    return out


def _rerank(accuracies: dict[str, float], methods: list[str]) -> dict[str, int]:
    """Ranks among the tuned board's methods only (the paper board may hold more, e.g. engines)."""
    shown = sorted((m for m in methods if m in accuracies), key=lambda m: -accuracies[m])
    ranks, previous, rank = {}, None, 0
    for position, m in enumerate(shown, start=1):
        rank = rank if previous is not None and accuracies[m] == previous else position
        ranks[m], previous = rank, accuracies[m]
    return ranks


def _change(e: StudyEntry) -> str:
    if e.rank is None or e.paper_rank is None:
        return "—"
    moved = e.paper_rank - e.rank
    return "=" if moved == 0 else (f"↑{moved}" if moved > 0 else f"↓{-moved}")


def study_board_table(board: StudyBoard) -> tuple[list[str], list[list[str]]]:
    body = []
    for e in board.entries:
        accuracy = fmt(e.accuracy, ".1f") + ("" if e.accuracy_se is None else f" ± {e.accuracy_se:.1f}")
        body.append([fmt_any(e.rank), e.method, accuracy, str(len(e.studies)), fmt(e.epsilon_study, ".2f"),
                     fmt(e.epsilon_all, ".2f"), fmt_any(e.studies[0].mean_trials), fmt(e.validation, ".1f"),
                     fmt_any(e.paper_rank), _change(e)])
    return list(HEADER), body


def study_notes(boards: list[StudyBoard]) -> list[str]:
    lines = []
    for b in boards:
        shapes = {str(s.shape) for e in b.entries for s in e.studies}
        means = {s.mean_trials for e in b.entries for s in e.studies}
        lines.append(
            f"{b.title}: every method had the same tuning budget (mean trials {', '.join(fmt_any(m) for m in sorted(means))}, "
            f"K's shape {', '.join(sorted(shapes))}); each study's ε covers its selected trial only (hyperparameters, model, "
            "noisy validation score); a method's studies read the same data, so together they cost 'ε all studies'; "
            "the test records are treated as public; the realised numbers of trials are not shown (publishing them "
            "weakens the bound)")
        untuned = {e.method: e.paper_accuracy for e in b.entries if e.paper_accuracy is not None}
        agreement = kendall({e.method: e.accuracy for e in b.entries if e.accuracy is not None}, untuned)
        if agreement is not None:
            lines.append(f"{b.title}: the tuned and the paper-hyperparameter rankings agree with {agreement.describe()}")
        empty = [s.path for e in b.entries for s in e.studies if s.test_accuracy is None]
        if empty:
            lines.append(f"{b.title}: {len(empty)} studies released no model (K = 0, or every trial failed), left out "
                         f"of the means: {', '.join(empty)}")
    return lines


def plot_tuned_vs_paper(board: StudyBoard, path: Path) -> Path | None:
    """Per method, test accuracy at its paper hyperparameters beside its privately tuned accuracy
    (mean ± SE): where tuning moved each method. None without a paper-hyperparameter board."""
    from dpbench.tools.report.plots import pyplot

    shown = [e for e in board.entries if e.accuracy is not None]
    if not any(e.paper_accuracy is not None for e in shown):
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(shown) + 1.6))
    ys = range(len(shown))
    ax.barh([y + 0.2 for y in ys], [e.paper_accuracy or 0 for e in shown], height=0.4, color="#bbbbbb",
            label="untuned: the benchmark preset's hyperparameters (one run's ε)")
    ax.barh([y - 0.2 for y in ys], [e.accuracy for e in shown], height=0.4, xerr=[e.accuracy_se or 0 for e in shown],
            color="#3b75af", label="tuned privately (the study's ε)")
    ax.set_yticks(list(ys), [e.method for e in shown])
    ax.invert_yaxis()
    ax.set_xlabel("test accuracy %")
    ax.set_title(board.title, fontsize=9)
    # below the axes: inside, it hides the shortest bars
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14 - 0.6 / len(shown)), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
