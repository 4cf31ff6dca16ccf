"""The `private_search` sweeper: K random trials, only the best released, with the study's epsilon.

    dpbench -m hydra/sweeper=private_search hydra.sweeper.mean_trials=10 hydra.sweeper.shape=1 \
        'train.lr=tag(log, interval(0.003, 0.1))' 'privacy.clip_norm=interval(0.3, 2)' privacy.epsilon=3

What it does, in order (dpbench/study/ holds the study: this module is the Hydra plugin that hands over to
dpbench.study.sweep.StudySweep, as Hydra's optuna sweeper hands over to its implementation;
dpbench/study/accounting.py holds the privacy arithmetic and says why it holds):
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
  5. Selects the best and publishes only it (dpbench/study/publish.py): study.json and
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
from that (dpbench.study.accounting.score_noise_multiplier_for_share), and training gets the rest through
RDP composition.
"""

# No `from __future__ import annotations`: Hydra's plugin scan executes this module without
# registering it in sys.modules, and dataclasses then cannot resolve string annotations.
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

# dpbench.study (torch) is imported when a sweeper is made: Hydra imports every plugin module at start-up,
# for `dpbench --help` too


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


class PrivateSearchSweeper(Sweeper):
    """Hydra's side of the private study: its options, `setup` and `sweep` go to
    dpbench.study.sweep.StudySweep."""

    def __init__(self, mean_trials: float = 10.0, shape: Any = 1.0, score_share: float = 0.0,
                 max_batch_size: Optional[int] = None, params: Optional[Dict[str, str]] = None,
                 grid: Optional[Dict[str, str]] = None, studies: int = 1, keep_private: bool = False,
                 print_private: bool = False) -> None:
        from dpbench.study.sweep import StudySweep

        super().__init__()
        self.study = StudySweep(mean_trials, shape, score_share, max_batch_size, params, grid, studies,
                                keep_private, print_private)

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.study.setup(hydra_context=hydra_context, task_function=task_function, config=config)

    def sweep(self, arguments: List[str]) -> Any:
        return self.study.sweep(arguments)
