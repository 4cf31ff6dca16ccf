"""What a private study publishes, and what it keeps outside epsilon.

`epsilon_study` (dpbench/study/accounting.py, Papernot & Steinke's repeat-and-select bound) covers releasing
the selected trial only: its hyperparameters, model and noisy validation score (its one test
evaluation is post-processing of the released model). The realised number of trials K is what the
bound hides, and the other trials' outcomes are not released by it. So a study folder holds

    study.json                the publishable record (PUBLISHABLE_KEYS, nothing else)
    selected_trial/           the selected trial's run: its model and results.json (trials run with
                              privacy.log_private_stats=false: no un-noised statistic)
    private_outside_epsilon/  while the study runs: study_state.json (K, the draws, every outcome:
                              resuming needs them) and every trial's folder; removed when the study
                              ends unless hydra.sweeper.keep_private=true. Its name and every file's
                              first key ("outside_epsilon") say that epsilon_study does not cover it.

A folder name or a trial number would leak K (trial_7 exists, so K >= 8): the selected run is
renamed to selected_trial/ and study.json names no trial index. Times would too: the trials run one
after another, so the selected trial's files' times against the sweep's start and study.json's
count the trials before and after it. Every published file and folder of a sweep folder gets one
time, the folder's stamp (`sweep_stamp`: the first sweep's start there, taken before any K is drawn).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Callable

from dpbench.study import accounting
from dpbench.study.trials import TrialOutcome, parse_shape, selected_trial
from dpbench.errors import UserError

STUDY_FILE, STATE_FILE = "study.json", "study_state.json"
SWEEP_CONFIG, INDEX_FILE = "multirun.yaml", "studies.json"  # the sweep folder's own published files
PRIVATE_DIR, SELECTED_DIR = "private_outside_epsilon", "selected_trial"
STATE_FORMAT = 2  # 1: study_state.json beside study.json (dpbench before the private area)
STUDY_SCHEMA = "dpbench.study/2"  # 1 (no `schema` key): study.json held K and every outcome
OUTSIDE_EPSILON = ("NOT covered by epsilon_study: the realised number of trials, the draws and every trial's outcome; "
                   "publishing any of it weakens or voids the study's privacy bound (keep it private)")
COVERS = ("epsilon_study covers publishing this file and the selected trial's folder: the selected trial's "
          "hyperparameters, model and noisy validation score (its test metrics are post-processing of the released "
          "model; the test records are treated as public). Not covered: the realised number of trials and every other "
          "trial's result, model, log or folder (hydra.sweeper.keep_private, print_private)")
# study.json's keys: config-derived facts (search space, K's distribution, budget and noise) and the selection
PUBLISHABLE_KEYS = ("schema", "publishable", "study_id", "task", "search_space", "fixed_overrides", "mean_trials",
                    "shape", "score_share", "budget_epsilon", "noise_multiplier", "score_noise_multiplier", "epsilon_trial", "epsilon_study",
                    "delta", "accountant", "optimize", "selected", "covers", "notes")


def write_json(path: Path, data: dict) -> None:
    """Whole or not at all: an interrupted write leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def write_private(path: Path, data: dict) -> None:
    """A file of the private area: its first key says it is outside epsilon."""
    write_json(path, {"outside_epsilon": OUTSIDE_EPSILON, **{k: v for k, v in data.items() if k != "outside_epsilon"}})


def private_dir(study_dir: Path) -> Path:
    return Path(study_dir) / PRIVATE_DIR


def trial_dir(study_dir: Path, index: int) -> Path:
    return private_dir(study_dir) / f"trial_{index}"


def trial_subdir(folder: str, index: int) -> str:
    """hydra.sweep.subdir of trial `index` of the study in `folder` (below the sweep folder)."""
    return f"{folder + '/' if folder else ''}{PRIVATE_DIR}/trial_{index}"


def read_state(study_dir: Path) -> dict | None:
    """The study's private state (K, draws, outcomes); None for a study not begun."""
    if (Path(study_dir) / STATE_FILE).exists():
        raise UserError(f"{Path(study_dir) / STATE_FILE} is a study of an earlier dpbench, which kept K beside study.json; "
                        "finish it with that version, or start a new study (another name=)")
    path = private_dir(study_dir) / STATE_FILE
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"{path} is unreadable ({error}); the study's K and draws are lost: start a new study "
                        "(another name=), the trials that ran count against the data's privacy") from error
    if state.get("format") != STATE_FORMAT:
        raise UserError(f"{path} is of another format ({state.get('format')}); start a new study (another name=)")
    return state


def read_published(study_dir: Path) -> dict | None:
    path = Path(study_dir) / STUDY_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def settings_of(published: dict) -> dict:
    """The settings a finished study ran with (the sweeper's `settings`), from its study.json."""
    return {"mean_trials": published["mean_trials"], "shape": published["shape"], "score_share": published["score_share"],
            "fixed_overrides": published["fixed_overrides"], "space": published["search_space"]}


def publishable(state: dict, settings: dict, task: dict, event, delta: float, chosen: TrialOutcome | None, test: dict | None, notes: list[str]) -> dict:
    """study.json: only what epsilon_study covers, and config-derived facts (no K, no other trial)."""
    parallel = isinstance(event, accounting.ParallelEvent)
    summary = {
        "schema": STUDY_SCHEMA, "publishable": True, "study_id": state["study_id"], "task": task,
        "search_space": settings["space"], "fixed_overrides": settings["fixed_overrides"],
        "mean_trials": settings["mean_trials"], "shape": settings["shape"], "score_share": settings["score_share"],
        "budget_epsilon": state["budget_epsilon"], "noise_multiplier": state["noise_multiplier"],
        "score_noise_multiplier": state["score_noise_multiplier"],
        "epsilon_trial": accounting.rdp_epsilon(event, delta),
        "epsilon_study": accounting.study_epsilon(event, settings["mean_trials"], parse_shape(settings["shape"]), delta),
        "delta": delta,
        "accountant": "dp-accounting RDP (RepeatAndSelectDpEvent; replace-one through the add/remove sigma/2 reduction)"
                      + ("; the score composed in parallel with training (pointwise maximum of the RDP curves)"
                         if parallel else ""),
        "optimize": "validation_score",
        "selected": None if chosen is None else {"overrides": chosen.overrides, "validation_score": chosen.score,
                                                 "test": test, "run_dir": SELECTED_DIR},
        "covers": COVERS,
        "notes": notes,
    }
    assert tuple(summary) == PUBLISHABLE_KEYS
    return summary


def finish(study_dir: Path, state: dict, outcomes: list[TrialOutcome], planned, build: Callable[..., dict],
           evaluate: Callable[[str], dict], keep_private: bool) -> dict:
    """Select, evaluate the selected model once, publish study.json and selected_trial/, and remove
    the private area (unless `keep_private`). Each stage is recorded first in the private state, so
    an interrupted end resumes where it stopped. `build(chosen, test, notes)` is `publishable`'s."""
    from dpbench.logging.results import read_results

    private, selected = private_dir(study_dir), Path(study_dir) / SELECTED_DIR
    if "published" not in state:
        notes = []
        # a trial that released more than the plan voids the study's bound (a dpbench bug): said without its index
        if any((recorded := (read_results(o.run_dir) or {}).get("privacy", {}).get("ledger")) is not None
               and not accounting.ledger_within(recorded, planned) for o in outcomes):
            notes.append("a trial recorded more than the study's planned ledger: epsilon_study does not cover this study")
        chosen, test = selected_trial(outcomes), None
        if "selected_index" not in state:
            state["selected_index"] = None if chosen is None else chosen.index
            write_private(private / STATE_FILE, state)
        if chosen is not None:  # renamed before anything names it; then the selected model alone meets the test set, once
            source = trial_dir(study_dir, chosen.index)
            if source.is_dir() and not selected.exists():
                os.replace(source, selected)
            try:
                test = evaluate(str(selected))
            except Exception as error:  # noqa: BLE001 - the study is still reported
                notes.append(f"the selected trial's saved model could not be evaluated on the test set: {error}")
        state["published"] = build(chosen, test, notes)
        write_private(private / STATE_FILE, state)
    summary = state["published"]
    write_json(Path(study_dir) / STUDY_FILE, summary)
    if not keep_private:
        shutil.rmtree(private, ignore_errors=True)
    return summary


def sweep_stamp(sweep_dir: Path) -> int:
    """The one time (ns, whole seconds) every published file of `sweep_dir` carries: its multirun.yaml's
    (stamped so by the first sweep there, written at that sweep's start), else now, at this sweep's
    start. Read before multirun.yaml is written again: a resumed or later sweep keeps the first one's,
    so no two published times span a study's trials."""
    config = Path(sweep_dir) / SWEEP_CONFIG
    seconds = config.stat().st_mtime_ns // 10**9 if config.is_file() else int(time.time())
    return seconds * 10**9


def published_paths(sweep_dir: Path) -> list[Path]:
    """What a sweep folder publishes: multirun.yaml, studies.json, and each study's study.json and
    selected_trial/ (every file and folder in it), with the folders that lead to them. Private areas and
    what else the folder holds (a launcher's records, e.g. .submitit/) are not published."""
    root = Path(sweep_dir)
    paths = [root / SWEEP_CONFIG, root / INDEX_FILE]
    for study_file in root.rglob(STUDY_FILE):
        study = study_file.parent
        if PRIVATE_DIR in study.relative_to(root).parts:
            continue
        paths += [study_file, study / SELECTED_DIR, *(study / SELECTED_DIR).rglob("*")]
        paths += [study, *(folder for folder in study.parents if root in folder.parents)]
    return list(dict.fromkeys(p for p in [root, *paths] if p.exists() or p.is_symlink()))


def stamp_published(sweep_dir: Path, stamp_ns: int) -> None:
    """Every published file and folder of `sweep_dir` gets the time `stamp_ns` (modification and access):
    none then depends on how long any study ran, i.e. on its K."""
    for path in published_paths(sweep_dir):
        os.utime(path, ns=(stamp_ns, stamp_ns), follow_symlinks=False)


# ---------------------------------------------------------------------------------------------
# The console
# ---------------------------------------------------------------------------------------------


def print_published(summary: dict, study_dir: Path) -> None:
    """The selected trial and the study's epsilon: what may be published."""
    from dpbench.logging.console import console

    chosen = summary.get("selected")
    console.print(f"[bold]dpbench private search · study {summary['study_id']}[/] · ε study {summary['epsilon_study']:.3f} "
                  f"(mean trials {summary['mean_trials']:g}, shape {summary['shape']}) · δ {summary['delta']:g}",
                  soft_wrap=True)
    if chosen is None:
        console.print("selected: none (no trial has a score: nothing is released)", soft_wrap=True)
    else:
        test = chosen.get("test") or {}
        metric = test.get("metric") or "accuracy"
        figure = f" · test {metric} {test[metric]:.4f}" if test.get(metric) is not None else ""
        console.print(f"selected: {' '.join(chosen['overrides']) or '(no swept key)'} · noisy validation score "
                      f"{chosen['validation_score']:.4f}{figure}", soft_wrap=True)
    for note in summary.get("notes") or []:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    console.print(f"[dim]study: {Path(study_dir) / STUDY_FILE} and {Path(study_dir) / SELECTED_DIR} (publishable)[/]",
                  soft_wrap=True)


def print_private(state: dict, outcomes: list[TrialOutcome], keys: list[str], naive: float) -> None:
    """hydra.sweeper.print_private: every trial, headed as outside epsilon."""
    from rich.table import Table

    from dpbench.logging.console import console

    table = Table(title=f"OUTSIDE ε (not covered by ε study; do not publish) · K = {state['trials']} · "
                        f"{state['trials']} trials composed ε {naive:.3f}")
    table.add_column("trial", justify="right")
    for key in keys:
        table.add_column(key.lstrip("+~"), justify="right")
    table.add_column("score (validation_score)", justify="right")
    table.add_column("status")
    for o in outcomes:
        values = [_short(v.split("=", 1)[1]) for v in o.overrides]
        mark = " ★" if o.index == state.get("selected_index") else ""
        table.add_row(f"{o.index}{mark}", *values, f"{o.score:.4f}" if math.isfinite(o.score) else "-inf", o.status)
    console.print(table)


def _short(text: str) -> str:
    try:
        return f"{float(text):.4g}"
    except ValueError:
        return text
