"""The private hyperparameter study: K random trials, only the best released, with the study's epsilon.

    accounting.py  the study's privacy: a trial's event, the repeat-and-select bound, budget calibration
    trials.py      K and its distribution (from OS entropy), a trial's outcome, the selection
    space.py       the search space and a sweep's several studies
    planner.py     a trial's planned ledger, as its run will plan it
    sweep.py       a study run through a Hydra launcher (the private_search sweeper hands over to it)
    publish.py     what a study writes: study.json and selected_trial/, the private area apart

`dpbench.study.<name>` keeps naming the accounting's and the trials' functions.
"""

from dpbench.study.accounting import (  # noqa: F401
    ParallelEvent, as_ledger, grid_selection_epsilon, ledger_dp_event, ledger_within, naive_epsilon,
    parallel_trial_event, per_trial_noise_multiplier_for_budget, rdp_curve, rdp_epsilon, same_ledger,
    score_noise_multiplier_for_share, study_epsilon, trial_event,
)
from dpbench.study.trials import (  # noqa: F401
    TrialOutcome, draw_trial_count, entropy_rng, parse_shape, selected_trial, tnb_gamma, trial_count_pmf,
)
