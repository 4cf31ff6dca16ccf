"""The validation score's release (`dataset.validation_fraction` > 0): the one figure a run reports
about its held-out part of the private training data, computed once, on the final model."""

from __future__ import annotations

import torch

from dpbench.privacy.plan import COUNT_SENSITIVITY, PrivacyPlan
from dpbench.privacy.release import ReleasePart, gaussian_release
from dpbench.runtime import distributed


def validation_score(task, model, plan: PrivacyPlan | None, charge, observer, device) -> float | None:
    """The sum of the per-example scores in [0, 1] (`Task.validation_scores`) plus N(0, sigma_v^2)
    for a private run (`plan`), through the one release function, charged (`charge`: the run's
    ledger) as one more mechanism, the plan's final release, which calibration composed; divided
    by the public size n f. None: no validation split."""
    if task.split is None:
        return None
    # in [0, 1] whatever the model outputs: a non-finite score counts 0, so no record can make the
    # count non-finite and halt the release (its sensitivity stays 1)
    scores = torch.nan_to_num(task.validation_scores(model).detach().float(), nan=0.0, posinf=1.0, neginf=0.0).clamp(0, 1)
    if plan is None:
        return float(scores.sum()) / task.split.planned_validation_size
    relation = plan.setup.neighboring
    # under torchrun the release sums its part over the ranks: each rank contributes a shard
    count = scores[distributed.rank()::distributed.world_size()].sum().reshape(1).to(device)
    part = ReleasePart([count], COUNT_SENSITIVITY[relation], plan.validation_noise_multiplier)
    (noisy,), mechanism = gaussian_release("validation score", [part], noise=plan.setup.noise, sample_rate=1.0,
                                           neighboring=relation, charge=charge,
                                           observer=observer)  # dpbench-audit sees it too
    plan.check_final_release(mechanism)
    return float(noisy[0]) / task.split.planned_validation_size
