"""One private study, or a sweep's several, run through a Hydra launcher: what the
`private_search` sweeper (hydra_plugins/dpbench_private_search) hands over to, as Hydra's optuna
sweeper hands over to its implementation. In order: the search space (space.py), budget mode's
per-trial sigma (accounting.py), K and every draw from OS entropy written to the private state
before the first trial (a rerun resumes without drawing again), every trial's planned ledger
checked against the study's (planner.py), the trials launched quietly, and only the selected one
published (publish.py)."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from dpbench.errors import UserError
from dpbench.study import accounting, publish
from dpbench.study import trials as study_trials
from dpbench.study.planner import TrialPlanner
from dpbench.study.space import Dimension, draw_values, parse_search_space, study_folders, with_config_space

INDEX_FILE = publish.INDEX_FILE
STUDIES_NOTE = ("each study is charged its own epsilon_study; S studies on the same data together cost their "
                "composition (at most S x epsilon_study): publish one per method, or state the total")


def _json_shape(shape: float) -> float | str:
    return "inf" if shape == math.inf else shape  # JSON has no infinity


def _earlier_studies(sweep_dir: Path, folders: set[str]) -> list[dict]:
    """The index entries of studies an earlier sweep left in this folder (another grid, more seeds)
    that this sweep does not redo: kept, so that studies.json lists every study the folder holds."""
    path = sweep_dir / INDEX_FILE
    if not path.is_file():
        return []
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"{path} is unreadable ({error}); move it aside and sweep again (each study's own "
                        "study.json still says what it published)") from error
    kept = [entry for entry in stored.get("studies", []) if entry.get("folder") not in folders]
    for entry in kept:  # entries written before the index kept them carry the header's options
        entry.setdefault("mean_trials", stored.get("mean_trials"))
        entry.setdefault("shape", stored.get("shape"))
    return kept


class StudySweep:
    """The private random search of the `private_search` sweeper, which hands its options,
    `setup` and `sweep` over to this (hydra_plugins/dpbench_private_search)."""

    def __init__(self, mean_trials: float = 10.0, shape: Any = 1.0, score_share: float = 0.0,
                 max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None,
                 grid: Optional[Dict[str, str]] = None, studies: int = 1, keep_private: bool = False,
                 print_private: bool = False) -> None:
        self.mean_trials = float(mean_trials)
        self.shape = study_trials.parse_shape(shape)
        self.score_share = float(score_share)
        self.max_batch_size = max_batch_size
        self.params = dict(params or {})
        self.grid = {str(k): str(v) for k, v in (grid or {}).items()}
        self.studies = int(studies)
        self.keep_private, self.print_private = bool(keep_private), bool(print_private)
        self.hydra_context: Optional[HydraContext] = None
        self.config: Optional[DictConfig] = None
        self.launcher: Optional[Launcher] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        from dpbench.logging.console import console

        try:
            return self._sweep(arguments)
        except UserError as error:  # one line and exit status 2, as dpbench's own input errors
            console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
            sys.exit(2)

    def _compose(self, overrides: list[str]) -> DictConfig:
        """A trial's job config as the launcher composes it, without the `hydra` node (as the job sees it)."""
        from omegaconf import read_write

        assert self.hydra_context is not None and self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]
        return cfg

    def _planner(self, base: DictConfig) -> TrialPlanner:
        return TrialPlanner(base)

    def _sweep(self, arguments: List[str]) -> Any:
        """One study in the sweep folder; with `grid` or `studies` > 1, one study per combination
        and repetition, each in <sweep dir>/<key-value_...>/[study_<s>], run one after another (each
        draws its own K and values; each is resumed alone), and an index, studies.json."""
        assert self.config is not None and self.launcher is not None
        study_trials._check_distribution(self.mean_trials, self.shape)
        if self.studies < 1:
            raise UserError(f"hydra.sweeper.studies must be at least 1, got {self.studies}")
        fixed, dimensions = parse_search_space([f"{k}={v}" for k, v in self.params.items()] + list(arguments))
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        stamp = publish.sweep_stamp(sweep_dir)  # before any K is drawn; a resumed sweep keeps the first one's
        OmegaConf.save(self.config, sweep_dir / publish.SWEEP_CONFIG)
        publish.stamp_published(sweep_dir, stamp)  # multirun.yaml keeps the stamp should this sweep stop
        plan = study_folders(self.grid, self.studies)
        if plan == [("", [])]:
            summary = self._study(sweep_dir, "", fixed, dimensions)
            publish.stamp_published(sweep_dir, stamp)
            return summary
        index = []
        earlier = _earlier_studies(sweep_dir, {folder for folder, _ in plan})
        for folder, combination in plan:
            summary = self._study(sweep_dir / folder, folder, [*fixed, *combination], dimensions)
            index.append({"folder": folder, "overrides": combination, "study_id": summary["study_id"],
                          "epsilon_study": summary["epsilon_study"], "mean_trials": self.mean_trials,
                          "shape": _json_shape(self.shape)})
            publish.write_json(sweep_dir / INDEX_FILE, {"mean_trials": self.mean_trials, "shape": _json_shape(self.shape),
                                               "studies_per_combination": self.studies, "grid": self.grid,
                                               "studies": earlier + index, "note": STUDIES_NOTE})
            publish.stamp_published(sweep_dir, stamp)  # after each study: a sweep stopped later leaves no time behind
        return index

    def _study(self, sweep_dir: Path, folder: str, fixed: list[str], dimensions: list[Dimension]) -> dict:
        """One study: K trials of `fixed` overrides and `dimensions` drawn, in `sweep_dir` (`folder`
        below the sweep folder); publishes only the selected trial (dpbench/study/publish.py)."""
        sweep_dir.mkdir(parents=True, exist_ok=True)
        base = self._compose(fixed)
        fixed, dimensions = with_config_space(base.get("search_space"), fixed, dimensions)
        from dpbench.run_config import DEFAULT_OPTIMIZE

        optimize = str(base.get("optimize") or DEFAULT_OPTIMIZE)
        if optimize not in (DEFAULT_OPTIMIZE, "validation_score"):
            raise UserError(f"optimize={optimize}: a private search selects by the noisy validation score; "
                            "leave optimize at its default (or set optimize=validation_score)")
        if any(o.split("=", 1)[0] == "privacy.log_private_stats" and o.split("=", 1)[1].lower() == "true" for o in fixed):
            raise UserError("a private study's trials never publish un-noised statistics: drop privacy.log_private_stats=true")
        settings = {"mean_trials": self.mean_trials, "shape": _json_shape(self.shape), "score_share": self.score_share,
                    "fixed_overrides": sorted(fixed), "space": {d.key: d.describe() for d in dimensions}}
        state, published = publish.read_state(sweep_dir), publish.read_published(sweep_dir)
        held = state["settings"] if state is not None else publish.settings_of(published) if published else None
        if held is not None and held != settings:
            raise UserError(f"{sweep_dir} holds study {(state or published)['study_id']} of other settings ({held}); "
                            "rerun its command to resume it, or start a new study with another name=")
        if state is None and published is not None:  # a finished study: shown again, never rerun
            publish.print_published(published, sweep_dir)
            return published
        planner = self._planner(base)
        delta = float(base.privacy.delta)
        budget = base.privacy.noise_multiplier is None
        if state is None:
            state = self._new_state(base, planner, fixed, dimensions, settings, budget)
        sigma, score_sigma = float(state["noise_multiplier"]), state["score_noise_multiplier"]
        trials = [dict(t) for t in state["draws"]]
        for trial in trials:
            trial["launch"] = self._trial_overrides(fixed, trial, sigma, score_sigma, budget, folder)

        planned = planner.ledger(base, sigma, score_sigma)
        if "checked" not in state:  # a new study: refused before its K and draws are stored or any trial runs
            self._check_events(planner, planned, trials, sigma)
            state["checked"] = True
            publish.write_private(publish.private_dir(sweep_dir) / publish.STATE_FILE, state)  # before any trial runs
        self._run_trials(sweep_dir, state, trials, folder)

        outcomes = [study_trials.TrialOutcome.from_json(state["outcomes"][str(t["index"])]) for t in trials]
        event = planner.event(base, sigma, score_sigma)
        task = {"algo": OmegaConf.select(base, "algo.name"), "dataset": OmegaConf.select(base, "dataset.name"),
                "model": _model_label(base)}

        def build(chosen, test, notes):
            return publish.publishable(state, settings, task, event, delta, chosen, test, notes)

        from dpbench.api import evaluate_saved

        summary = publish.finish(sweep_dir, state, outcomes, planned, build, evaluate_saved, self.keep_private)
        publish.print_published(summary, sweep_dir)
        if self.print_private:
            publish.print_private(state, outcomes, [d.key for d in dimensions],
                                  accounting.naive_epsilon(event, int(state["trials"]), delta))
        return summary

    def _new_state(self, base, planner, fixed, dimensions, settings, budget) -> dict:
        from dpbench.options import target_epsilon

        score_sigma = None
        if budget:
            target, delta = target_epsilon(base), float(base.privacy.delta)  # privacy.epsilon, or the default target
            score_sigma = accounting.score_noise_multiplier_for_share(self.score_share, target, delta, self.mean_trials, self.shape)
            sigma = accounting.per_trial_noise_multiplier_for_budget(
                lambda s: planner.event(base, s, score_sigma), target, delta, self.mean_trials, self.shape,
                score_alone=score_sigma if score_sigma is not None else float(base.privacy.validation_noise_multiplier))
        else:
            if self.score_share:
                raise UserError("score_share splits a budget: set privacy.epsilon and leave privacy.noise_multiplier "
                                "null, or set score_share=0")
            sigma = float(base.privacy.noise_multiplier)
        # K and every value from OS entropy: a seeded draw could be predicted and re-drawn (dpbench/study/trials.py)
        rng = study_trials.entropy_rng()
        k = study_trials.draw_trial_count(self.mean_trials, self.shape, rng)
        draws = [{"index": i, "values": draw_values(dimensions, rng)} for i in range(k)]
        return {"format": publish.STATE_FORMAT, "study_id": secrets.token_hex(8),
                "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "settings": settings, "trials": k,
                "budget_epsilon": target_epsilon(base) if budget else None, "noise_multiplier": sigma,
                "score_noise_multiplier": score_sigma, "draws": draws, "outcomes": {}}

    @staticmethod
    def _trial_overrides(fixed, trial, sigma, score_sigma, budget, folder: str = "") -> list[str]:
        # Each trial in its own folder: two trials that drew equal values are still two runs, and a
        # rerun finds each trial's results.json where it left it (dpbench's resume skips it).
        # No trial reads the test set: it saves its final model, and only the selected one is evaluated.
        # A trial publishes nothing of its own: no W&B run, no un-noised statistic (privacy.log_private_stats).
        # Budget mode: the study's epsilon became each trial's sigma, so the trial is given sigma alone
        # (a trial given both is refused: dpbench.run_config.check_privacy_choice).
        own = [o for o in fixed if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] != "logger"
               and o.split("=", 1)[0] != "privacy.log_private_stats"
               and not (budget and o.lstrip("+~").split("=", 1)[0] == "privacy.epsilon")]
        return [*own, *trial["values"], *([f"privacy.noise_multiplier={sigma!r}", "privacy.epsilon=null"] if budget else []),
                *([f"privacy.validation_noise_multiplier={score_sigma!r}"] if score_sigma is not None else []),
                "train.evaluate_test=false", "privacy.log_private_stats=false", "logger=none",
                f"hydra.sweep.subdir={publish.trial_subdir(folder, trial['index'])}"]

    def _check_events(self, planner, planned, trials, sigma) -> None:
        """Every trial's composed config (also the launcher's composition check) plans the
        study's ledger; otherwise the study's epsilon would not be its epsilon."""
        for trial in trials:
            ledger = planner.ledger(self._compose(trial["launch"]), sigma)
            if not accounting.same_ledger(ledger, planned):
                raise UserError(f"trial {trial['index']} ({' '.join(trial['values'])}) plans another privacy ledger than "
                                "the study's; sweep only keys that leave the ledger alone (noise, sample rate, steps)")

    def _run_trials(self, sweep_dir: Path, state: dict, trials: list[dict], folder: str = "") -> None:
        assert self.launcher is not None
        state_file = publish.private_dir(sweep_dir) / publish.STATE_FILE
        pending = []
        for trial in trials:
            key, run_dir = str(trial["index"]), publish.trial_dir(sweep_dir, trial["index"])
            if key in state["outcomes"]:
                continue
            if (run_dir / "error.txt").exists() and not (run_dir / "results.json").exists():
                # a trial that failed before the state recorded it: -inf, never rerun
                state["outcomes"][key] = study_trials.trial_outcome(trial["index"], trial["values"], run_dir).to_json()
                continue
            pending.append(trial)  # new, or interrupted: dpbench resumes its folder (results.json: skipped)
        if state["outcomes"]:
            publish.write_private(state_file, state)
        size = self.max_batch_size if self.max_batch_size and self.max_batch_size > 0 else max(1, len(pending))
        for start in range(0, len(pending), size):
            batch = pending[start:start + size]
            with quiet_launcher(self.launcher):
                returns = self.launcher.launch([t["launch"] for t in batch], initial_job_idx=batch[0]["index"])
            for trial, returned in zip(batch, returns):
                run_dir = publish.trial_dir(sweep_dir, trial["index"])
                state["outcomes"][str(trial["index"])] = study_trials.trial_outcome(trial["index"], trial["values"], run_dir,
                                                                       returned).to_json()
            publish.write_private(state_file, state)


@contextlib.contextmanager
def quiet_launcher(launcher):
    """Hydra's launchers log every job's number and overrides ("#7 : train.lr=..."), which would
    print K and the draws: their loggers stay at WARNING while the trials launch."""
    loggers = [logging.getLogger(n) for n in ("hydra", "hydra_plugins", type(launcher).__module__)]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _model_label(cfg: DictConfig) -> str:
    """The model as dpbench-report names it: 'vit-micro', 'opt-1.3b', 'cnn'."""
    name, size = OmegaConf.select(cfg, "model.name"), OmegaConf.select(cfg, "model.size")
    return f"{name}-{size}" if name and size else name
