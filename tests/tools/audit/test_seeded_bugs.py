"""dpbench-audit's seeded bugs (dpbench/tools/audit/seeded_bugs.py): each broken mechanism is caught by
the check it names, the sound variant passes every check, and a clean run passes the new checks
(release → update on the optimizer's input and on the model's buffers, sampler, noise across runs,
total noise over >= 4 physical chunks)."""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

import pytest
import torch
from helpers.cli import console_script_in_process
from helpers.config import compose

from dpbench.algorithms import ALGORITHMS
from dpbench.errors import UserError
from dpbench.tools.audit.runner import run_audit
from dpbench.tools.audit.sampler import sampler_check
from dpbench.tools.audit.report import CHECK_ORDER, UPDATE
from dpbench.tools.audit.seeded_bugs import CATALOGUE, CATALOGUE_DEFAULTS, bug_config, run_bug

# the fast tier (about a second an audit): DPZero's quadratic (a 64-vector model), 2 noise steps and
# one neighbour pair (the bugs below are not about sensitivity)
QUICK = CATALOGUE_DEFAULTS + ["dataset=quadratic", "model=quadratic", "dataset.dimension=64", "dataset.train_size=512",
                              "dataset.test_size=64", "audit.noise_steps=2", "audit.trials=1", "audit.sensitivity_steps=1",
                              "train.steps=2"]


# the BatchNorm bugs swap the GroupNorm of a narrow cnn on the synthetic data (a few seconds an audit)
BATCHNORM = CATALOGUE_DEFAULTS + ["model=cnn", "model.width=8", "audit.noise_steps=2", "audit.trials=1",
                                  "audit.sensitivity_steps=1", "train.steps=2"]


def rows(report, name: str, release: str | None = None) -> list:
    return [c for c in report.checks if c.name == name and (release is None or c.release == release)]


def test_unnoised_update_is_caught_by_release_to_update(tmp_path):
    report, result = run_bug(compose(QUICK), "unnoised_update", tmp_path)
    (update,) = rows(report, UPDATE, "optimizer input")
    assert result.caught and result.ok and not update.passed
    assert update.measured > 0.1 and update.bound == pytest.approx(1e-4)
    assert all(c.passed for c in rows(report, "noise") + rows(report, "sampler"))


def test_the_sound_chunk_noise_passes_and_clean_checks_hold(tmp_path):
    """std sigma C / sqrt(k) in each of k >= 4 chunks: the step's total noise is the planned one,
    and every check (the new ones included) holds."""
    report, result = run_bug(compose(QUICK), "chunk_noise_over_sqrt_chunks", tmp_path)
    assert result.sound and result.ok and report.passed, [c for c in report.checks if not c.passed]
    assert set(CHECK_ORDER) == {c.name for c in report.checks}
    (noise,) = rows(report, "noise")
    assert "total noise" in noise.detail and "4..5 physical chunks" in noise.detail
    (update,) = rows(report, UPDATE, "optimizer input")
    assert update.measured < 1e-5 and "parameter change" in update.detail
    (buffers,) = rows(report, UPDATE, "buffers")
    assert buffers.passed and "no buffers" in buffers.detail


def test_shuffled_batches_accounted_as_poisson_fail_the_sampler_check():
    cfg = compose(QUICK)
    from dpbench.run import setup

    job = setup(cfg)
    clean = sampler_check(cfg, job)
    assert all(c.passed for c in clean), clean
    with CATALOGUE["shuffle_as_poisson"].patch(cfg):
        broken = sampler_check(cfg, job)
    sizes = next(c for c in broken if c.release.startswith("batch sizes"))
    assert not sizes.passed and sizes.measured == 0.0


@pytest.mark.slow  # the fast tier's budget; test_every_seeded_bug_is_caught_by_its_check runs it too
@pytest.mark.parametrize("engine", ["ghost", "bk"])
def test_batchnorm_in_train_mode_is_caught_by_sensitivity(engine, tmp_path):
    """Batch statistics mix the examples: one added example moves the others' clipped gradients, so
    the sum moves by more than C; the running statistics change too (the buffers row)."""
    bug = CATALOGUE["batchnorm_train"]
    assert "algo.per_sample=ghost" in bug.overrides
    variant = dataclasses.replace(bug, overrides=("model=cnn", f"algo.per_sample={engine}"))
    with mock.patch.dict(CATALOGUE, {bug.name: variant}):
        report, result = run_bug(compose(BATCHNORM), bug.name, tmp_path)
    assert result.caught and result.ok and result.check == "sensitivity"
    (gradient,) = rows(report, "sensitivity", "gradient")
    assert gradient.measured > 1.5, gradient
    (buffers,) = rows(report, UPDATE, "buffers")
    assert not buffers.passed and "running_mean" in buffers.detail
    assert all(c.passed for c in rows(report, "noise") + rows(report, UPDATE, "optimizer input"))


@pytest.mark.slow  # the fast tier's budget; test_every_seeded_bug_is_caught_by_its_check runs it too
@pytest.mark.parametrize("name", ["batchnorm_train_materialize", "batchnorm_running_stats"])
def test_batchnorm_running_statistics_are_caught_on_the_buffers(name, tmp_path):
    """Under materialize the running statistics, written from each batch's un-noised statistics,
    fail release → update on the buffers; normalising with earlier batches' statistics keeps the
    clipping sound, so there nothing else fails."""
    assert "algo.per_sample=materialize" in CATALOGUE[name].overrides
    report, result = run_bug(compose(BATCHNORM), name, tmp_path)
    assert result.caught and result.ok and result.check == UPDATE and result.figure.startswith("buffers")
    (buffers,) = rows(report, UPDATE, "buffers")
    assert not buffers.passed and buffers.bound == 0 and "running_mean" in buffers.detail
    (update,) = rows(report, UPDATE, "optimizer input")
    assert update.passed  # the optimizer still reads the noisy release
    if name == "batchnorm_running_stats":
        assert result.also_failed == [], [c for c in report.checks if not c.passed]


# DC-DPSGD on DPZero's quadratic (per-example gradients of a 64-vector): seconds an audit
DCDPSGD = QUICK + ["algo=dcdpsgd"]


# Power: step 0 has no threshold yet (tau_0 = inf: every example is body, p = 0), so its gradient noise is
# sigma c2 = sigma c1 / 10; a later step's is sqrt(p^2 + (1 - p)^2 / 100) <= 1 of the planned std whatever the
# tail fraction p (at 64 dimensions and a 200-dim subspace every score is 1 and p = 1: the old test's size, whose
# 256 draws left chi-square p near alpha). At 256 dimensions x 3 steps x 2 jobs = 1,536 draws the mean squared
# ratio is at most (0.01 + 1 + 1) / 3 = 0.67, a chi-square z below -9 (p < 1e-18) against the level
# 1e-6 / k: the failure rate is far below 1 in 1,000 (measured: 40 of 40 runs alone caught it).
MIXTURE = QUICK + ["dataset.dimension=256", "audit.noise_steps=3", "train.steps=3"]


@pytest.mark.slow  # the fast tier's budget; test_every_seeded_bug_is_caught_by_its_check runs it too
def test_dcdpsgd_mixture_noise_is_caught_by_the_noise_check(tmp_path):
    report, result = run_bug(compose(MIXTURE), "dcdpsgd_mixture_noise", tmp_path)  # its row sets algo=dcdpsgd
    assert report.algo == "dcdpsgd" and result.caught and result.ok
    (gradient,) = rows(report, "noise", "scores_and_gradient[1]")
    assert not gradient.passed and gradient.measured < 0.82, gradient  # at most sqrt(0.67) of the planned std (above)
    (scores,) = rows(report, "noise", "scores_and_gradient[0]")
    assert scores.passed  # the scores' noise is the code's own
    assert result.also_failed == [], [c for c in report.checks if not c.passed]


@pytest.mark.slow  # the fast tier's budget
def test_clean_dcdpsgd_passes_the_extended_checks(tmp_path):
    report = run_audit(compose(DCDPSGD), tmp_path)
    assert report.passed, [c for c in report.checks if not c.passed]
    (buffers,) = rows(report, UPDATE, "buffers")
    assert buffers.passed


class _Constants(torch.nn.Module):
    """A layer holding a buffer that no step writes (as a fixed normalisation would)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(3))

    def forward(self, x):
        return x


def test_buffers_a_step_leaves_alone_pass(tmp_path):
    """No false alarm: a model whose buffers no step writes passes the buffers row (and every check)."""
    import dpbench.models as models

    build = models.build_model
    with mock.patch.object(models, "build_model", lambda cfg, spec: build(cfg, spec).append(_Constants())):
        report = run_audit(compose(BATCHNORM), tmp_path)
    assert report.passed, [c for c in report.checks if not c.passed]
    (buffers,) = rows(report, UPDATE, "buffers")
    assert "none of the model's 1 buffers changed" in buffers.detail


def test_a_bugs_overrides_apply_on_top():
    """A row's overrides win over the command line's, but keep its keys under a group it chose already."""
    cnn = compose(CATALOGUE_DEFAULTS + ["model=cnn", "model.width=8", "algo.per_sample=bk"])
    batchnorm = bug_config(cnn, CATALOGUE["batchnorm_train"])
    assert batchnorm.model.width == 8 and batchnorm.algo.per_sample == "ghost" and cnn.algo.per_sample == "bk"
    dcdpsgd = bug_config(compose(CATALOGUE_DEFAULTS), CATALOGUE["dcdpsgd_mixture_noise"])
    assert dcdpsgd.algo.name == "dcdpsgd" and "tail_fraction" in dcdpsgd.algo


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_a_class_runs_the_stock_phases_iff_it_overrides_none(name):
    """`runs_stock_phases` (what the seeded bugs and the release -> update row ask) is read off the class."""
    from dpbench.algorithms.first_order import DPFirstOrderAlgorithm

    algo_cls = ALGORITHMS.get(name)
    overrides = [phase for phase in DPFirstOrderAlgorithm.STOCK_PHASES
                 if getattr(algo_cls, phase, None) is not getattr(DPFirstOrderAlgorithm, phase)]
    assert algo_cls.runs_stock_phases() == (issubclass(algo_cls, DPFirstOrderAlgorithm) and not overrides)


def test_every_bug_applies_to_a_registered_algorithm_and_refuses_the_others():
    applying = {name: CATALOGUE[name].algorithms() for name in CATALOGUE}
    assert len(applying) == len(CATALOGUE) >= 10 and all(applying.values())
    assert {"dpsgd", "dpadam"} <= set(applying["noise_half"]) and "dpzero" not in applying["noise_half"]
    with pytest.raises(UserError, match="audit.seeded_bug=noise_half patches the code of algo="):
        run_bug(compose(CATALOGUE_DEFAULTS + ["algo=dpzero"]), "noise_half", None)


def test_the_realised_batch_divisor_says_where_it_is_unsound():
    why = CATALOGUE["realised_batch_divisor"].why
    assert "unsound under add/remove" in why and "harmless under replace-one" in why


@pytest.mark.slow  # one audit per bug (a few minutes in all)
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_every_seeded_bug_is_caught_by_its_check(name, tmp_path):
    report, result = run_bug(compose(CATALOGUE_DEFAULTS), name, tmp_path)
    assert result.ok, (result, [c for c in report.checks if not c.passed])
    if CATALOGUE[name].sound:
        assert report.passed
    else:
        assert any(not c.passed for c in rows(report, CATALOGUE[name].check))


@pytest.mark.slow  # two audits (about a minute)
@pytest.mark.parametrize("algo", ["dpbitfit", "dpsgd"])
def test_clipping_the_sum_is_caught_on_a_small_release_too(algo, tmp_path):
    """DP-BiTFiT releases the biases and the head only: the outweighing record copied from the batch's first
    example pointed nearly against the batch's sum there, and clipping the sum moved the release by 0.54 C
    (missed). With the worst-fit example, against its own loss and with it, one of the two moves it by at
    least sqrt(2) C whatever the angle."""
    report, result = run_bug(compose([*CATALOGUE_DEFAULTS, f"algo={algo}"]), "clip_after_sum", tmp_path)
    sensitivity = [c for c in rows(report, "sensitivity") if c.release == "gradient"]
    assert result.ok and sensitivity and sensitivity[0].measured > 2 ** 0.5 * 0.99, sensitivity


@pytest.mark.slow
def test_a_clean_run_passes_the_new_checks(tmp_path):
    report = run_audit(compose(CATALOGUE_DEFAULTS), tmp_path)
    assert report.passed, [c for c in report.checks if not c.passed]
    assert {c.name for c in report.checks} == set(CHECK_ORDER)


@pytest.mark.slow
def test_the_console_script_runs_the_catalogue(tmp_path):
    from dpbench.tools.audit.cli import main

    def audit(*args):
        return console_script_in_process(main, "dpbench-audit", f"hydra.run.dir={tmp_path / 'run'}", *args, cwd=tmp_path)

    one = audit("audit.seeded_bug=noise_half", "audit.trials=1", "audit.sensitivity_steps=1")
    assert one.returncode == 1, one.stderr[-2000:]  # one bug: the audit's verdict, which it fails
    assert "caught" in one.stderr and "every seeded bug is caught" in one.stderr
    unknown = audit("audit.seeded_bug=no_such_bug")
    assert unknown.returncode == 2 and "is not known" in unknown.stderr
    every = audit("audit.seeded_bug=all", "audit.trials=1")
    assert every.returncode == 0, every.stderr[-3000:]
    stored = json.loads((tmp_path / "run" / "seeded_bugs.json").read_text())
    assert [r["bug"] for r in stored] == list(CATALOGUE) and all(r["ok"] for r in stored)


# ----------------------------------------------------------------- the three bugs of the review (issue: an audit that sees)


BF16_SIZES = ["dataset.dimension=1024", "dataset.spectrum=d", "privacy.noise_multiplier=0.1"]


@pytest.mark.slow  # the fast tier's budget; test_every_seeded_bug_is_caught_by_its_check runs it too
def test_bf16_rounded_noise_is_caught_by_the_precision_row(tmp_path):
    """Noise of the right std, rounded to bf16: every other check passes, the precision row does not.
    1,024 dimensions (A = I, so every coordinate's gradient counts) x 2 steps x 2 jobs at sigma 0.1: about a
    quarter of the 4,096 residuals are informative (1,052 once), 86% of those on bf16's grid against at most
    1%; a miss needs over 99% of ~1,000 residuals off a grid that holds each with probability ~0.8 (never)."""
    report, result = run_bug(compose(QUICK + BF16_SIZES), "noise_bf16_rounded", tmp_path)
    assert result.caught and result.ok and result.also_failed == [], [c for c in report.checks if not c.passed]
    (row,) = rows(report, "noise precision", "gradient")
    assert row.measured > 0.5 and row.bound == 0.01, row
    (noise,) = rows(report, "noise", "gradient")
    assert noise.passed  # its std is right: only its precision is wrong


@pytest.mark.slow  # an audit (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_fp32_noise_passes_the_precision_row(tmp_path):
    """The same sizes without the bug: 0 of ~1,000 informative residuals on the grid (each with
    probability about 2^-11: above 1% has probability below 1e-9)."""
    report = run_audit(compose(QUICK + BF16_SIZES), tmp_path)
    (row,) = rows(report, "noise precision", "gradient")
    assert row.passed and row.measured < 0.01 and "too few" not in row.detail, row


VALIDATION = CATALOGUE_DEFAULTS + ["model=cnn", "model.width=8", "audit.noise_steps=2", "audit.trials=1",
                                   "audit.sensitivity_steps=1", "train.steps=2", "dataset.validation_fraction=0.2",
                                   "privacy.validation_composition=parallel"]


@pytest.mark.slow  # the fast tier's budget; test_every_seeded_bug_is_caught_by_its_check runs it too
def test_validation_score_on_training_records_is_caught(tmp_path):
    report, result = run_bug(compose(VALIDATION), "validation_on_training", tmp_path)
    assert result.caught and result.ok, [c for c in report.checks if not c.passed]
    (count,) = rows(report, "validation score", "count: a training record")
    assert not count.passed and count.measured >= 1 and count.bound == 0, count
    (noise,) = rows(report, "validation score", "noise")
    assert noise.passed  # the score is still noised as planned


@pytest.mark.slow  # an audit (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_a_clean_validation_score_passes_its_rows(tmp_path):
    report = run_audit(compose(VALIDATION), tmp_path)
    assert report.passed, [c for c in report.checks if not c.passed]
    assert {c.release for c in rows(report, "validation score")} == {
        "count: a training record", "count: a validation record", "noise"}
    assert set(CHECK_ORDER) == {c.name for c in report.checks}


THRESHOLD = QUICK + ["algo=dcdpsgd", "dataset.dimension=256", "audit.sensitivity_steps=1", "audit.trials=3"]


@pytest.mark.slow  # the fast tier's budget; test_every_seeded_bug_is_caught_by_its_check runs it too
def test_dcdpsgd_unnoised_threshold_is_caught_by_the_two_step_row(tmp_path):
    """The one-step sensitivity check holds the threshold fixed and passes; the two-step row does not."""
    report, result = run_bug(compose(THRESHOLD), "dcdpsgd_threshold_unnoised", tmp_path)
    assert result.caught and result.ok, [c for c in report.checks if not c.passed]
    assert all(c.passed for c in rows(report, "sensitivity")), rows(report, "sensitivity")
    assert any(not c.passed and c.measured > 0.01 for c in rows(report, "two-step sensitivity"))


@pytest.mark.slow  # a DPDR, a DC-DPSGD, a DIFF and a DIFF2 audit of the two-step row
@pytest.mark.parametrize("algo", ["dcdpsgd", "dpdr", "diff", "diff2"])
def test_stateful_algorithms_pass_the_two_step_row(algo, tmp_path):
    report = run_audit(compose(THRESHOLD + [f"algo={algo}", "audit.sensitivity_steps=2"]), tmp_path)
    two_step = rows(report, "two-step sensitivity")
    assert two_step and all(c.passed and "not applicable" not in c.detail for c in two_step), two_step
    assert report.passed, [c for c in report.checks if not c.passed]



# ----------------------------------------------------------------- the audit's blind spots (the pooled rows)


@pytest.mark.slow  # one catalogue audit each (10-60 s on two shared cores); test_every_seeded_bug_is_caught_by_its_check too
def test_noise_skipped_on_small_tensors_is_caught_per_tensor_not_by_the_pooled_std(tmp_path):
    """The head's bias (4 entries) released exactly: every residual of it is exactly 0, which no fp32
    draw gives; the 'noise per tensor' row names it (a deterministic row)."""
    report, result = run_bug(compose(CATALOGUE_DEFAULTS), "noise_skipped_small_tensors", tmp_path)
    assert result.caught and result.ok, [c for c in report.checks if not c.passed]
    (row,) = [c for c in rows(report, "noise per tensor") if not c.passed]
    assert "[4]: 24 of 24 residuals exactly 0" in row.detail and row.p_value is None, row


@pytest.mark.slow
def test_a_bf16_normal_scaled_in_fp32_is_caught_on_residual_over_std(tmp_path):
    """sigma 3.4218: sigma C's bits do not put the residuals themselves on bf16's grid; residual / std is."""
    report, result = run_bug(compose(CATALOGUE_DEFAULTS + ["privacy.noise_multiplier=3.4218"]), "normal_bf16_scaled",
                             tmp_path)
    assert result.caught and result.ok, [c for c in report.checks if not c.passed]
    (row,) = rows(report, "noise precision", "gradient")
    assert row.measured > 0.9 and "of bf16's grid" in row.detail, row
    assert all(c.passed for c in rows(report, "noise"))  # its std is right


@pytest.mark.slow
def test_the_validation_noise_seeded_by_seed_is_caught_across_runs(tmp_path):
    report, result = run_bug(compose(CATALOGUE_DEFAULTS), "validation_noise_seeded", tmp_path)
    assert result.caught and result.ok and result.also_failed == [], [c for c in report.checks if not c.passed]
    (row,) = rows(report, "noise across runs", "validation score")
    assert not row.passed and row.measured > 0.99, row
    assert all(c.passed for c in rows(report, "validation score"))  # its std and what it reads are right


@pytest.mark.slow
def test_diffs_unnoised_previous_gradient_is_caught_by_the_two_step_row(tmp_path):
    """DIFF declares release_carries_state, so the two-step row runs: the one-step sensitivity row holds
    the previous gradient fixed and passes."""
    report, result = run_bug(compose(CATALOGUE_DEFAULTS), "diff_previous_unnoised", tmp_path)
    assert report.algo == "diff" and result.caught and result.ok, [c for c in report.checks if not c.passed]
    assert all(c.passed for c in rows(report, "sensitivity")), rows(report, "sensitivity")
