"""The validation-score checks of `dpbench-audit` (dpbench/tools/audit/runner.py): the final model's noisy
validation score (dataset.validation_fraction > 0, `dpbench.privacy.validation.validation_score`), a release of its
own, made once after training.

  what it reads  jobs that differ in their loaded training set (one record, or half of the training
                 part, left out of the training part; one record left out of the validation part)
                 release the score's count, noiseless, for one and the same model. Under
                 privacy.validation_composition=parallel the reported epsilon is max(training's, the
                 score's): sound only if the count reads the validation part alone, so a training
                 record must leave it exactly where it was (bound 0); under sequential composition,
                 and for a validation record, it moves by at most the count's sensitivity (1).
  noise          VALIDATION_DRAWS releases of the count: their noise (noisy - noiseless, through the
                 release observer) has the std the plan declares for it (its final release's noise
                 multiplier x the stated sensitivity; two-sided chi-square), and keeps fp32's precision
                 (a "noise precision" row, audit/precision.py).

A training record changes the model too; parallel composition covers that through the training
mechanism, so every neighbouring data set (its task rebuilt without the records) is scored by one
and the same model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from unittest import mock

import torch

from dpbench.tasks import build_task
from dpbench.tools.audit.harness import audited_job, chi_square_p_value
from dpbench.tools.audit.noise import _independence_check, pooled_correlation
from dpbench.tools.audit.precision import null_checks, precision_checks
from dpbench.tools.audit.report import VALIDATION, Check

VALIDATION_DRAWS = 1000  # noisy validation releases for the std and precision tests (a forward over the validation part each)


@contextlib.contextmanager
def _left_out(train: set[int], validation: set[int]):
    """Every task module's `split_training_set` (dpbench/data/validation.py) with these loaded
    records dropped from the part they fall in: the loaded set without them (the split is a
    per-record function, so no other record moves between the parts)."""
    from dpbench.data import validation as module

    original = module.split_training_set

    def split(dataset_cfg, contents):
        out = original(dataset_cfg, contents)
        return out if out is None else dataclasses.replace(
            out, train_indices=[i for i in out.train_indices if i not in train],
            validation_indices=[i for i in out.validation_indices if i not in validation])

    with contextlib.ExitStack() as stack:
        for name, loaded in list(sys.modules.items()):
            if name.startswith("dpbench.tasks") and getattr(loaded, "split_training_set", None) is original:
                stack.enter_context(mock.patch.object(loaded, "split_training_set", split))
        yield


def _released(job, recorder) -> tuple[float, float, float, float]:
    """(noiseless count, noisy count, stated noise std, stated sensitivity) of one validation release of `job`."""
    from dpbench.privacy.validation import validation_score

    recorder.releases.clear()
    ledger = job.privacy.new_ledger()  # a throwaway ledger
    validation_score(job.task, job.model, job.privacy, ledger.add_release, job.algorithm.release_observer, job.device)
    (release,) = [r for r in recorder.releases if r.name == "validation score"]
    part = release.parts[0]
    return float(release.noiseless[0][0].sum()), float(release.noisy[0][0].sum()), part.noise_std, part.sensitivity


def validation_checks(cfg) -> list[Check]:
    from dpbench.privacy.plan import COUNT_SENSITIVITY, has_validation_split

    if not has_validation_split(cfg):
        return [Check(VALIDATION, "validation score", 0.0, 0.0, True,
                      "not applicable: no validation split (dataset.validation_fraction=0), no validation release")]
    job, recorder = audited_job(cfg, zero_noise=False)
    (planned,) = job.privacy.final_releases
    draws = [_noise_draws(job, recorder, planned)]  # first: from the generator's first draw
    second, second_recorder = audited_job(cfg, zero_noise=False)  # a fresh job of the same config and seed
    draws.append(_noise_draws(second, second_recorder, planned))
    split = job.task.split
    parallel = bool(job.privacy.parallel_final)
    sensitivity = COUNT_SENSITIVITY["add_remove"]  # the count's, under add/remove-one (replace-one: 2 x its part's)
    count = _released(job, recorder)[0]
    generator = torch.Generator().manual_seed(2)
    train, held = list(split.train_indices), list(split.validation_indices)
    picks = [train[int(i)] for i in torch.randperm(len(train), generator=generator)[: int(cfg.audit.trials)]]
    neighbours = [(f"training record {i} left out", {i}, set(), True) for i in picks]
    if parallel:  # the count must not read the training part at all: half of it changes nothing either
        half = {train[int(i)] for i in torch.randperm(len(train), generator=generator)[: len(train) // 2]}
        neighbours.append((f"half of the training part ({len(half)} records) left out", half, set(), True))
    neighbours.append((f"validation record {held[0]} left out", set(), {held[0]}, False))
    worst = {True: (0.0, ""), False: (0.0, "")}  # training / validation neighbours: (largest |change|, which)
    task = job.task
    for what, drop_train, drop_validation, training in neighbours:
        with _left_out(drop_train, drop_validation):
            job.task = build_task(cfg, job.device)  # the neighbouring data set, scored by the same model
        change = abs(_released(job, recorder)[0] - count)
        if change >= worst[training][0]:
            worst[training] = (change, what)
    job.task = task
    tolerance = 1e-6 * max(1.0, abs(count))  # float32 rounding of one and the same sum
    train_bound = 0.0 if parallel else sensitivity
    composition = "parallel" if parallel else "sequential"
    (train_change, train_what), (val_change, val_what) = worst[True], worst[False]
    checks = [
        Check(VALIDATION, "count: a training record", train_change, train_bound, train_change <= train_bound + tolerance,
              f"largest change of the noiseless count {train_change:.4g} ({train_what}; {len(neighbours) - 1} training "
              f"neighbours, one model) against {train_bound:g}: under {composition} composition "
              + ("the score must read the validation part alone (epsilon is max(training's, the score's))" if parallel
                 else "any record moves it by at most its sensitivity 1")),
        Check(VALIDATION, "count: a validation record", val_change, sensitivity, val_change <= sensitivity + tolerance,
              f"change of the noiseless count {val_change:.4g} ({val_what}) against its sensitivity {sensitivity:g} "
              "(per-example scores in [0, 1])"),
    ]
    noise, stds, stated = draws[0]
    squares = float(sum((n / std) ** 2 for n, std in zip(noise, stds)))
    p_value = chi_square_p_value(squares, VALIDATION_DRAWS)
    ratio = math.sqrt(squares / VALIDATION_DRAWS)
    checks.append(Check(
        VALIDATION, "noise", ratio, 1.0, p_value > float(cfg.audit.alpha),
        f"the noise of {VALIDATION_DRAWS} validation releases (noisy - noiseless): std / planned std = {ratio:.4f}; planned "
        f"std (the plan's final release's noise multiplier x the stated sensitivity) {min(stds):.4g}, the release stated "
        f"{stated:.4g}; chi-square p = {p_value:.3g}", p_value=p_value))
    pairs = [(torch.tensor(draws[0][0], dtype=torch.float64), torch.tensor(draws[1][0], dtype=torch.float64))]
    across = _independence_check("validation score", "jobs", [(
        f"of {VALIDATION_DRAWS} score releases in each of two fresh jobs (same config, same seed), draw by draw",
        *pooled_correlation(pairs))], float(cfg.audit.alpha), name="noise across runs")
    # its noise keeps fp32's precision, and every draw carries noise (the rows of the noise check)
    return checks + [across] + precision_checks(recorder.precision) + null_checks(recorder.nulls)


def _noise_draws(job, recorder, planned) -> tuple[list[float], list[float], float]:
    """VALIDATION_DRAWS releases of `job`'s count by one model: (their noise, the planned std of each,
    the std the release stated)."""
    noise, stds, stated = [], [], 0.0
    scores = job.task.validation_scores(job.model)  # one model, one count: the draws differ in their noise only
    with mock.patch.object(job.task, "validation_scores", lambda model: scores):
        for _ in range(VALIDATION_DRAWS):
            noiseless, noisy, stated, part_sensitivity = _released(job, recorder)
            stds.append(planned.noise_multiplier * part_sensitivity)  # what the plan (and so epsilon) assumes
            noise.append(noisy - noiseless)
    return noise, stds, stated

