"""The `private_search` sweeper: K random trials, only the best released, with the study's epsilon.

    dpbench -m hydra/sweeper=private_search hydra.sweeper.mean_trials=10 hydra.sweeper.shape=1 \
        'train.lr=tag(log, interval(0.003, 0.1))' 'privacy.clip_norm=interval(0.3, 2)' privacy.epsilon=3

What it does, in order (dpbench/study.py holds the privacy arithmetic and says why it holds):
  1. Reads the sweep overrides with Hydra's parser: `choice(...)`, a plain list `a,b,c`, `range(...)`
     (each a choice), `interval(a, b)` (uniform) and `tag(log, interval(a, b))` (log-uniform) are
     the search space; every other override is fixed for all trials. Keys that change a trial's
     privacy event (its ledger: batch size, steps, epochs, privacy.* but clip_norm, the dataset)
     are refused, and every trial's planned ledger is checked against the study's before any runs.
  2. Budget mode (privacy.epsilon set, privacy.noise_multiplier null): finds the per-trial sigma
     whose STUDY epsilon meets privacy.epsilon and passes privacy.noise_multiplier=<sigma> to every
     trial. With privacy.noise_multiplier set, the study's epsilon is computed instead.
  3. Draws K and every trial's values from OS entropy (never from `seed`) and writes them to
     <sweep dir>/private_outside_epsilon/study_state.json BEFORE the first trial: a rerun of the
     same command resumes the study without drawing again, and skips trials that already have an
     outcome (a trial that failed or diverged counts as score -inf and is never rerun).
  4. Launches the trials (in private_outside_epsilon/trial_<i>), independently of each other's
     results, quietly (no bar, no table, no W&B run, privacy.log_private_stats=false),
     `max_batch_size` per launcher call; a trial's score is what the job returns
     (dpbench.cli.objective: the metric `optimize` names).
  5. Selects the best and publishes only it (dpbench/study_publish.py): study.json and
     selected_trial/; the private area is removed unless keep_private (print_private: its table).

A benchmark runs many studies in one sweep: `hydra.sweeper.grid` ({key: "a,b"}, e.g. algo and
seed) fixes each combination for one study, `hydra.sweeper.studies` repeats each; every study has
its own K, draws, state and study.json in <sweep dir>/<key-value_...>/[study_<s>], and
<sweep dir>/studies.json indexes them. A config's `search_space` ({key: spec}, e.g. a tuned
preset's per-algo table: `search_space: ${paper_setting.tuned_space.${algo.name}}`) joins the
command line's space, read per combination.

The objective is each trial's noisy validation score (dataset.validation_fraction > 0 is required;
a test metric is never a private search's objective): every trial trains on the training part,
releases its score once on its final model (noise std privacy.validation_noise_multiplier, part
of the trial's own ledger), and reads no test example (train.evaluate_test=false). After
selection only the selected trial's saved model is evaluated on the test set, once.

score_share (budget mode only; default 0: sigma_v is privacy.validation_noise_multiplier): the
share of privacy.epsilon the noisy score would cost ALONE over the study; its sigma_v follows
from that (dpbench.study.score_noise_multiplier_for_share), and training gets the rest through
RDP composition.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module without
# registering it in sys.modules, and dataclasses then cannot resolve string annotations.
import contextlib
import json
import logging
import math
import os
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from dpbench import study
from dpbench import study_publish as publish
from dpbench.errors import UserError

STUDY_FILE = publish.STUDY_FILE


@dataclass
class PrivateSearchConf:
    _target_: str = "hydra_plugins.dpbench_private_search.private_search.PrivateSearchSweeper"
    mean_trials: float = 10.0  # E[K]; dp-accounting needs >= 1
    shape: Any = 1.0  # K's distribution: 0 logarithmic, 1 geometric, eta > 0 truncated neg. binomial, .inf Poisson
    score_share: float = 0.0  # share of privacy.epsilon a noisy validation score would cost alone (budget mode)
    max_batch_size: Optional[int] = None  # trials per launcher call (None: all at once)
    params: Optional[Dict[str, str]] = None  # search space from a config file: {key: "interval(0.1, 1)"}
    grid: Optional[Dict[str, str]] = None  # fixed axes, {key: "a,b"}: one study per combination (a benchmark)
    studies: int = 1  # independent studies per combination, each with its own K and draws
    keep_private: bool = False  # keep private_outside_epsilon/ (K, every trial) after the study
    print_private: bool = False  # also print every trial's outcome, headed as outside epsilon


ConfigStore.instance().store(group="hydra/sweeper", name="private_search", node=PrivateSearchConf, provider="dpbench")


# ---------------------------------------------------------------------------------------------
# The search space
# ---------------------------------------------------------------------------------------------

# Swept keys that would change a trial's privacy event; the bound assumes every trial is the same
# mechanism. privacy.clip_norm only scales the clipped sum and its noise together: the ledger
# (noise multiplier, sample rate, steps) stays the same.
EVENT_KEYS = ("train.batch_size", "train.steps", "train.epochs")
EVENT_SECTIONS = ("privacy", "dataset", "experiment")  # the group or any of its keys
EVENT_FREE_KEYS = ("privacy.clip_norm",)
# results.json metrics computed from the private training data without noise: a study selecting
# on them releases more than the bound covers


def changes_event(key: str) -> bool:
    key = key.lstrip("+~").split("@")[0]
    if key in EVENT_FREE_KEYS:
        return False
    return key in EVENT_KEYS or any(key == s or key.startswith(s + ".") for s in EVENT_SECTIONS)


@dataclass(frozen=True)
class Dimension:
    """One swept key: `choice` over value strings, or `uniform`/`log_uniform` on [low, high)."""

    key: str  # as written, with its +/~ prefix: the override is "<key>=<value>"
    kind: str
    choices: tuple[str, ...] = ()
    low: float = 0.0
    high: float = 0.0

    def draw(self, rng) -> str:
        if self.kind == "choice":
            return f"{self.key}={self.choices[int(rng.integers(len(self.choices)))]}"
        if self.kind == "log_uniform":
            value = math.exp(rng.uniform(math.log(self.low), math.log(self.high)))
        else:
            value = rng.uniform(self.low, self.high)
        return f"{self.key}={min(max(value, self.low), self.high)!r}"

    def describe(self) -> str:
        if self.kind == "choice":
            return f"choice({', '.join(self.choices)})"
        return f"{'log-' if self.kind == 'log_uniform' else ''}uniform[{self.low!r}, {self.high!r})"


def _dimension(override: Override) -> Dimension:
    key = override.get_key_element()
    if override.is_discrete_sweep():  # choice(...), a,b,c, range(...)
        return Dimension(key, "choice", tuple(override.sweep_string_iterator()))
    value = override.value()
    if isinstance(value, IntervalSweep):
        low, high = float(value.start), float(value.end)
        log = "log" in value.tags
        if not low < high or (log and low <= 0):
            raise UserError(f"{override.input_line}: an interval needs low < high{' and low > 0 (log)' if log else ''}")
        return Dimension(key, "log_uniform" if log else "uniform", low=low, high=high)
    raise UserError(f"private_search cannot draw from {override.input_line}: use choice(...), a,b,c, range(...), "
                    "interval(a, b) or tag(log, interval(a, b))")


def parse_search_space(arguments: Sequence[str]) -> tuple[list[str], list[Dimension]]:
    """(fixed overrides, swept dimensions) of the sweep's arguments, by Hydra's override parser;
    a swept key that changes the privacy event is refused (one-line UserError)."""
    fixed, dimensions = [], []
    for override in OverridesParser.create().parse_overrides(list(arguments)):
        if not override.is_sweep_override():
            fixed.append(f"{override.get_key_element()}={override.get_value_element_as_str()}")
            continue
        if changes_event(override.key_or_group):
            raise UserError(
                f"private_search cannot sweep {override.key_or_group}: it changes each trial's privacy event, and the "
                "study's epsilon assumes every trial releases the same; fix it for the whole study "
                "(train.lr, privacy.clip_norm, model or algo options that leave the ledger alone may vary)")
        dimensions.append(_dimension(override))
    return fixed, dimensions


def draw_values(dimensions: Sequence[Dimension], rng) -> list[str]:
    """One trial's overrides: every dimension drawn once (from entropy: rng = study.entropy_rng())."""
    return [d.draw(rng) for d in dimensions]


# ---------------------------------------------------------------------------------------------
# A trial's planned ledger, as the trial will plan it
# ---------------------------------------------------------------------------------------------


class TrialPlanner:
    """Plans a trial's privacy the way dpbench.run.setup does (train size, steps, plan_privacy),
    without building its model: the ledger its run will record, at a given noise multiplier."""

    def __init__(self, base: DictConfig) -> None:
        import torch

        from dpbench.algorithms import algorithm_class
        from dpbench.run_config import validate
        from dpbench.tasks import build_task

        validate(base)  # the job's own input checks, one line each
        if not algorithm_class(base.algo.name).private:
            raise UserError(f"private_search studies private training; algo={base.algo.name} is not private")
        if not float(base.dataset.get("validation_fraction", 0) or 0) > 0:
            raise UserError("private_search selects trials by their noisy validation score: set "
                            "dataset.validation_fraction (e.g. 0.2); the test set is never a search's objective")
        # the public planning size n(1 - f) sets the sample rate (q = B / n(1 - f)); dataset keys
        # are never swept, so it is one for all trials
        self.train_size = build_task(base, torch.device("cpu")).planning_size

    def _plan(self, cfg: DictConfig, noise_multiplier: float, score_noise_multiplier: float | None = None):
        import torch

        from dpbench.algorithms import algorithm_class
        from dpbench.privacy.plan import plan_privacy
        from dpbench.run import planned_steps

        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.privacy.noise_multiplier = float(noise_multiplier)
            if score_noise_multiplier is not None:
                cfg.privacy.validation_noise_multiplier = float(score_noise_multiplier)
        steps = planned_steps(cfg, self.train_size)
        return plan_privacy(cfg, algorithm_class(cfg.algo.name), self.train_size, steps, torch.device("cpu")), steps

    def ledger(self, cfg: DictConfig, noise_multiplier: float, score_noise_multiplier: float | None = None):
        plan, steps = self._plan(cfg, noise_multiplier, score_noise_multiplier)
        return plan.planned_ledger(steps, final=True)  # training, then the noisy validation score

    def event(self, cfg: DictConfig, noise_multiplier: float, score_noise_multiplier: float | None = None):
        """The trial's privacy event: training and its noisy validation score, composed as the run
        composes them (privacy.validation_composition: sequential, or parallel: study.ParallelEvent)."""
        plan, steps = self._plan(cfg, noise_multiplier, score_noise_multiplier)
        if plan.parallel_final:
            return study.parallel_trial_event(plan.planned_ledger(steps), plan.validation_noise_multiplier)
        return study.trial_event(plan.planned_ledger(steps, final=True))


# ---------------------------------------------------------------------------------------------
# The state file and the outcome of a trial
# ---------------------------------------------------------------------------------------------


def _json_shape(shape: float) -> float | str:
    return "inf" if shape == math.inf else shape  # JSON has no infinity


def trial_outcome(index: int, overrides: list[str], run_dir: Path, returned=None) -> study.TrialOutcome:
    """A trial's outcome from what its job returned (None: not launched, e.g. a failed trial found
    on resume) and its folder: no results.json, a status other than completed, or no finite
    return value all score -inf."""
    from dpbench.logging.results import read_results

    score = math.nan
    if returned is not None:
        try:
            score = float(returned.return_value)  # raises the job's exception when it failed
        except Exception:  # noqa: BLE001 - a trial that raised scores -inf, like one that diverged
            score = math.nan
    results = read_results(run_dir)
    if results is None:
        return study.TrialOutcome(index, overrides, -math.inf, "failed", str(run_dir))
    status = str(results.get("status") or "failed")  # a diverged trial wrote results.json, and returned nan
    if status != "completed" or not math.isfinite(score):
        return study.TrialOutcome(index, overrides, -math.inf, status if status != "completed" else "failed", str(run_dir))
    return study.TrialOutcome(index, overrides, score, status, str(run_dir))


# ---------------------------------------------------------------------------------------------
# Several studies in one sweep: a benchmark's grid of methods, S studies each
# ---------------------------------------------------------------------------------------------

INDEX_FILE = "studies.json"
STUDIES_NOTE = ("each study is charged its own epsilon_study; S studies on the same data together cost their "
                "composition (at most S x epsilon_study): publish one per method, or state the total")


def study_folders(grid: Dict[str, str], studies: int) -> list[tuple[str, list[str]]]:
    """(folder, fixed overrides) of every study of a sweep: the product of the grid's values (Hydra's
    `a,b` grammar), `studies` repetitions each. No grid and one study: [("", [])], the sweep folder."""
    import itertools

    axes = []
    for key, values in grid.items():
        override = OverridesParser.create().parse_overrides([f"{key}={values}"])[0]
        choices = list(override.sweep_string_iterator()) if override.is_sweep_override() else [override.get_value_element_as_str()]
        axes.append([f"{override.get_key_element()}={value}" for value in choices])
    if not axes and studies == 1:
        return [("", [])]
    plan = []
    for combination in itertools.product(*axes):
        # a folder name Hydra's override grammar reads unquoted (no '=' or ','): algo-grape_seed-0
        label = "_".join(f"{o.lstrip('+~').split('=', 1)[0].rsplit('.', 1)[-1]}-{o.split('=', 1)[1]}" for o in combination)
        for s in range(studies):
            plan.append(("/".join(p for p in (label, f"study_{s}" if studies > 1 else "") if p) or f"study_{s}", list(combination)))
    return plan


def with_config_space(space, fixed: list[str], dimensions: list[Dimension]) -> tuple[list[str], list[Dimension]]:
    """The search space a config declares (`search_space`: {key: spec}, e.g. a tuned preset's per-algo
    table), added to the sweep's: its sweeps are drawn, its plain values fixed. A key declared twice is
    refused: which one holds would be a guess."""
    if not space:
        return fixed, dimensions
    entries = space.items() if hasattr(space, "items") else []
    more_fixed, more = parse_search_space([f"{k}={v}" for k, v in entries])
    named = {o.split("=", 1)[0].lstrip("+~") for o in fixed} | {d.key.lstrip("+~") for d in dimensions}
    for key in [o.split("=", 1)[0].lstrip("+~") for o in more_fixed] + [d.key.lstrip("+~") for d in more]:
        if key in named:
            raise UserError(f"{key} is in the config's search_space and on the command line (or the sweeper's params): "
                            "name it once")
    return [*fixed, *more_fixed], [*dimensions, *more]


# ---------------------------------------------------------------------------------------------
# The sweeper
# ---------------------------------------------------------------------------------------------


class PrivateSearchSweeper(Sweeper):
    """Hydra sweeper for dpbench/study.py's private random search (see the module docstring)."""

    def __init__(self, mean_trials: float = 10.0, shape: Any = 1.0, score_share: float = 0.0,
                 max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None,
                 grid: Optional[Dict[str, str]] = None, studies: int = 1, keep_private: bool = False,
                 print_private: bool = False) -> None:
        super().__init__()
        self.mean_trials = float(mean_trials)
        self.shape = study.parse_shape(shape)
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
        study._check_distribution(self.mean_trials, self.shape)
        if self.studies < 1:
            raise UserError(f"hydra.sweeper.studies must be at least 1, got {self.studies}")
        fixed, dimensions = parse_search_space([f"{k}={v}" for k, v in self.params.items()] + list(arguments))
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        plan = study_folders(self.grid, self.studies)
        if plan == [("", [])]:
            return self._study(sweep_dir, "", fixed, dimensions)
        index = []
        for folder, combination in plan:
            summary = self._study(sweep_dir / folder, folder, [*fixed, *combination], dimensions)
            index.append({"folder": folder, "overrides": combination, "study_id": summary["study_id"],
                          "epsilon_study": summary["epsilon_study"]})
            publish.write_json(sweep_dir / INDEX_FILE, {"mean_trials": self.mean_trials, "shape": _json_shape(self.shape),
                                               "studies_per_combination": self.studies, "grid": self.grid,
                                               "studies": index, "note": STUDIES_NOTE})
        return index

    def _study(self, sweep_dir: Path, folder: str, fixed: list[str], dimensions: list[Dimension]) -> dict:
        """One study: K trials of `fixed` overrides and `dimensions` drawn, in `sweep_dir` (`folder`
        below the sweep folder); publishes only the selected trial (dpbench/study_publish.py)."""
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

        outcomes = [study.TrialOutcome.from_json(state["outcomes"][str(t["index"])]) for t in trials]
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
                                  study.naive_epsilon(event, int(state["trials"]), delta))
        return summary

    def _new_state(self, base, planner, fixed, dimensions, settings, budget) -> dict:
        from dpbench.options import target_epsilon

        score_sigma = None
        if budget:
            target, delta = target_epsilon(base), float(base.privacy.delta)  # privacy.epsilon, or the default target
            score_sigma = study.score_noise_multiplier_for_share(self.score_share, target, delta, self.mean_trials, self.shape)
            sigma = study.per_trial_noise_multiplier_for_budget(
                lambda s: planner.event(base, s, score_sigma), target, delta, self.mean_trials, self.shape,
                score_alone=score_sigma if score_sigma is not None else float(base.privacy.validation_noise_multiplier))
        else:
            if self.score_share:
                raise UserError("score_share splits a budget: set privacy.epsilon and leave privacy.noise_multiplier "
                                "null, or set score_share=0")
            sigma = float(base.privacy.noise_multiplier)
        # K and every value from OS entropy: a seeded draw could be predicted and re-drawn (dpbench/study.py)
        rng = study.entropy_rng()
        k = study.draw_trial_count(self.mean_trials, self.shape, rng)
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
            if not study.same_ledger(ledger, planned):
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
                state["outcomes"][key] = trial_outcome(trial["index"], trial["values"], run_dir).to_json()
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
                state["outcomes"][str(trial["index"])] = trial_outcome(trial["index"], trial["values"], run_dir,
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

