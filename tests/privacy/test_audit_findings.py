"""Regression tests for the independent audit's findings, and the ledger of what ran."""

from __future__ import annotations

import json
import math

import dp_accounting as dpa
import pytest
import torch
from helpers.config import TINY, compose
from helpers.algorithms import build_algorithm
from torch import nn

from dpbench.algorithms import dcdpsgd
from dpbench.algorithms.base import ReleasePart
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm
from dpbench.errors import DivergedError, UserError
from dpbench.logging.results import RunResults
from dpbench.privacy.accountants import PLDAccountant, PRVAccountant, ledger_of_plan
from dpbench.privacy.clipping import per_sample_norms
from dpbench.privacy.mechanisms import GaussianMechanism
from dpbench.privacy.plan import PlanMismatchError
from dpbench.run import run_job
from dpbench.tasks.image import ImageClassificationTask, ldam_margins, public_class_profile


# --- 1. DC-DPSGD with an absolute algo.tail_clip ------------------------------------------------
def _gradient_multiplier(*overrides, clip=0.1, sigma=1.0):
    cfg = compose([f"privacy.clip_norm={clip}", "algo=dcdpsgd", "algo.tail_selection=rank", *overrides]).algo
    _, sigma_dp = dcdpsgd.noise_multipliers(cfg, sigma)
    return dcdpsgd.gradient_mechanism(cfg, sigma_dp, 0.01, clip).noise_multiplier


def test_absolute_tail_clip_is_planned_as_its_ratio_to_the_body_clip():
    # c2 = 0.1, c1 = 1.0: ratio 10, sigma_dp = sqrt(2), sensitivity 2c1 - c2 = 19 c2
    expected = math.sqrt(2) * 10 / 19  # 0.744 (the bug declared 1.414)
    assert _gradient_multiplier("algo.tail_clip=1.0") == pytest.approx(expected)
    assert _gradient_multiplier("algo.tail_clip_ratio=10") == pytest.approx(expected)


@pytest.mark.parametrize("tail_clip", ["0.1", "0.05", "0.5"])
def test_tail_clip_not_above_body_clip_is_a_user_error(tail_clip):
    clip = 0.1 if tail_clip != "0.5" else 1.0  # c1 = c2 / 2 used to divide by zero
    with pytest.raises(UserError, match="c1 <= c2"):
        _gradient_multiplier(f"algo.tail_clip={tail_clip}", clip=clip)


@pytest.mark.slow  # a run (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_absolute_tail_clip_run_reports_the_epsilon_of_its_real_ledger(tmp_path):
    cfg = compose(TINY + ["algo=dcdpsgd", "algo.tail_selection=rank", "privacy.clip_norm=0.1", "algo.tail_clip=1.0",
                          "privacy.noise_multiplier=1.0", "train.steps=5", "accountant=pld"])
    results = run_job(cfg, tmp_path, show_progress=False)
    q = results.privacy.sample_rate
    sigma_tr = sigma_dp = math.sqrt(2)
    joint = (sigma_tr**-2 + (sigma_dp * 10 / 19) ** -2) ** -0.5  # scores and gradient: one batch, one mechanism
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(joint)), 5)
    accountant = dpa.pld.PLDAccountant(value_discretization_interval=results.privacy.pld_interval)  # the run's grid
    expected = accountant.compose(event).get_epsilon(1e-5)
    assert results.privacy.epsilon == pytest.approx(expected, rel=1e-3)
    assert results.algorithm["tail_clip_c1"] == pytest.approx(1.0)


# --- 2. DC-DPSGD two-pass clipping with dropout --------------------------------------------------
def test_two_pass_dcdpsgd_clips_each_recomputed_gradient_to_its_threshold(monkeypatch):
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8", "algo.tail_selection=rank", clip=0.01)
    torch.manual_seed(0)
    algorithm.model.insert(1, nn.Dropout(0.5))  # recomputed per-sample gradients now differ
    contributions, thresholds = [], []
    original_clipped_sum, original_thresholds = dcdpsgd.clipped_sum, algorithm.clip_thresholds

    def recording_clipped_sum(per_sample, factors, **options):
        contributions.append(per_sample_norms(per_sample) * factors)
        return original_clipped_sum(per_sample, factors, **options)

    def recording_thresholds(noisy, finite=None):
        tail, limit = original_thresholds(noisy, finite)
        thresholds.append(limit)
        return tail, limit

    monkeypatch.setattr(dcdpsgd, "clipped_sum", recording_clipped_sum)
    algorithm.clip_thresholds = recording_thresholds
    images, labels = task.batch(list(range(40)))
    chunks = [(images[i : i + 8], labels[i : i + 8]) for i in range(0, 40, 8)]  # two passes
    for step in range(3):
        contributions.clear()
        algorithm.train_step(chunks, step)
        made = torch.cat(contributions)
        assert made.shape == (40,) and torch.all(made <= thresholds[-1] * (1 + 1e-5))
        assert torch.any(made >= thresholds[-1] * (1 - 1e-3))  # the bound is active


# --- 3. the gdp accountant is an approximation --------------------------------------------------
def test_gdp_underreports_and_does_not_calibrate_without_opt_in(tmp_path):
    from dpbench.privacy.accountants import GDPAccountant
    from dpbench.privacy.mechanisms import GaussianMechanism, Ledger

    ledger = Ledger()
    ledger.add(GaussianMechanism(1.1, 0.0445), 40)
    assert GDPAccountant().epsilon(ledger, 1e-5) < 0.8 * PLDAccountant().epsilon(ledger, 1e-5)
    assert not GDPAccountant.upper_bound and PLDAccountant.upper_bound
    with pytest.raises(UserError, match="allow_approximate_accountant"):
        run_job(compose(TINY + ["algo=dpsgd", "accountant=gdp"]), tmp_path, show_progress=False)
    results = run_job(compose(TINY + ["algo=dpsgd", "accountant=gdp", "privacy.noise_multiplier=1.1"]),
                      tmp_path / "fixed", show_progress=False)
    assert results.privacy.epsilon_is_upper_bound is False
    assert any("approximation, not an upper bound" in note for note in results.notes)


# --- 4. LDAM margins from the public profile ------------------------------------------------------
def test_ldam_margins_come_from_the_public_profile_not_the_labels(monkeypatch):
    cfg = compose(TINY + ["+dataset.loss=ldam", "+dataset.imbalance_factor=0.01"])
    first = ImageClassificationTask(cfg, torch.device("cpu")).margins
    import dpbench.tasks.image as image

    original = image.load_dataset

    def relabelled(dataset_cfg, seed):  # a neighbour dataset: every training label changed
        data = original(dataset_cfg, seed)
        data.train_labels = torch.zeros_like(data.train_labels)
        return data

    monkeypatch.setattr(image, "load_dataset", relabelled)
    assert torch.equal(ImageClassificationTask(cfg, torch.device("cpu")).margins, first)
    profile = public_class_profile(cfg.dataset, 4)
    assert profile.tolist() == pytest.approx([1.0, 0.01 ** (1 / 3), 0.01 ** (2 / 3), 0.01])
    assert first.tolist() == pytest.approx(ldam_margins(profile, 0.5).tolist())
    assert first[-1] == pytest.approx(0.5) and first[0] == pytest.approx(0.5 * 0.01**0.25)


# --- 5. the ledger is what ran ------------------------------------------------------------------
def test_a_step_releasing_other_than_its_plan_stops_the_run(tmp_path, monkeypatch):
    def halved_noise(self, sums):
        p = self.privacy
        (noisy,) = self.gaussian_release("gradient", ReleasePart(sums, p.clip_norm, p.noise_multiplier * p.clip_norm / 2))
        return [s / p.expected_batch_size for s in noisy]

    monkeypatch.setattr(DPFirstOrderAlgorithm, "privatize", halved_noise)
    with pytest.raises(PlanMismatchError, match="step 0 released"):
        run_job(compose(TINY + ["algo=dpsgd"]), tmp_path, show_progress=False)


@pytest.mark.slow  # a run (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_ledger_records_the_mechanisms_each_step_released(tmp_path):
    results = run_job(compose(TINY + ["algo=dpdr", "algo.decomposition_steps=3", "train.steps=4"]),
                      tmp_path, show_progress=False)
    records = results.privacy.ledger
    sigma = results.privacy.noise_multiplier
    sigma_eff = results.algorithm["sigma_eff"]
    ran = sorted((r["noise_multiplier"], r["count"]) for r in records)
    expected = sorted([(sigma, 2), (sigma_eff, 2)])  # steps 0 and 3 DP-SGD; 1 and 2 decomposed
    assert [count for _, count in ran] == [count for _, count in expected]
    assert [m for m, _ in ran] == pytest.approx([m for m, _ in expected])


# --- 6. / 7. notes and un-noised statistics ------------------------------------------------------
def test_prv_fallback_names_the_accountant_that_computed_epsilon(tmp_path, monkeypatch):
    from opacus.accountants import PRVAccountant as OpacusPRV

    def broken(self, *args, **kwargs):
        raise RuntimeError("discretisation failed")

    monkeypatch.setattr(OpacusPRV, "get_epsilon", broken)
    results = run_job(compose(TINY + ["algo=dpsgd", "accountant=prv", "privacy.noise_multiplier=1.0"]),
                      tmp_path, show_progress=False)
    assert results.privacy.accountant == "pld" and results.privacy.requested_accountant == "prv"
    assert any("computed by pld" in note for note in results.notes)
    assert PRVAccountant().name == "prv"


def test_meaning_changing_choices_are_noted_in_results(tmp_path):
    results = run_job(compose(TINY + ["algo=dcdpsgd", "algo.tail_selection=rank", "algo.gradient_sensitivity=tail_clip",
                                  "privacy.sampling=shuffle"]),
                      tmp_path, show_progress=False)
    notes = " ".join(results.notes)
    assert "tail_clip" in notes and "not a proven bound" in notes and "sampling=shuffle" in notes
    assert "log_private_stats=true" in notes


def test_private_stats_can_be_switched_off(tmp_path):
    results = run_job(compose(TINY + ["algo=dcdpsgd", "privacy.log_private_stats=false"]), tmp_path, show_progress=False)
    assert results.metrics.train_loss is None
    assert all(record.train_loss is None for record in results.history)
    assert "mean_tail_fraction" not in results.algorithm
    assert not any("log_private_stats=true" in note for note in results.notes)
    assert results.privacy.log_private_stats is False


def test_planned_ledger_and_calibration_share_one_planning_function(tmp_path):
    results = run_job(compose(TINY + ["algo=dcdpsgd", "accountant=pld"]), tmp_path, show_progress=False)
    cfg = compose(TINY + ["algo=dcdpsgd"])
    p = results.privacy
    planned = ledger_of_plan(
        lambda step: dcdpsgd.DCDPSGD.declared_mechanisms(cfg.algo, p.noise_multiplier, p.sample_rate, step,
                                                         p.clip_norm, "add_remove"),
        p.steps,
    )
    ran = p.ledger
    assert [(r["sample_rate"], r["count"]) for r in planned.as_records()] == [(r["sample_rate"], r["count"]) for r in ran]
    assert [r["noise_multiplier"] for r in planned.as_records()] == pytest.approx([r["noise_multiplier"] for r in ran], rel=1e-12)


def test_training_accuracy_is_logged_only_with_private_stats(tmp_path):
    logged = run_job(compose(TINY + ["algo=dpsgd", "train.train_eval_size=64"]), tmp_path / "on", show_progress=False)
    assert all(0 <= r.train_accuracy <= 1 for r in logged.history)
    assert logged.metrics.train_accuracy == logged.history[-1].train_accuracy
    assert any("training-set accuracy" in note for note in logged.notes)
    quiet = run_job(compose(TINY + ["algo=dpsgd", "train.train_eval_size=64", "privacy.log_private_stats=false"]),
                    tmp_path / "off", show_progress=False)
    assert all("train_accuracy" not in r.to_json() for r in quiet.history) and quiet.metrics.train_accuracy is None


# --- the step whose release halted a run is charged ----------------------------------------------
def test_a_release_that_halts_the_run_is_charged_in_the_ledger(tmp_path, monkeypatch):
    """A non-finite noisy release stops the run (status diverged, published): that step's release
    ran, so its mechanism is in the ledger and in the epsilon reported."""
    from dpbench.privacy.noise import GaussianNoise

    sample, add_noise, releases = GaussianNoise.sample, DPFirstOrderAlgorithm.add_noise, []

    def poisoned_add_noise(self, sums):
        releases.append(len(releases))
        return add_noise(self, sums)

    def poisoned_sample(self, shape, std, dtype=torch.float32):
        noise = sample(self, shape, std, dtype)
        return noise.fill_(math.inf) if len(releases) == 2 else noise  # the second step's release

    monkeypatch.setattr(DPFirstOrderAlgorithm, "add_noise", poisoned_add_noise)
    monkeypatch.setattr(GaussianNoise, "sample", poisoned_sample)
    cfg = compose(TINY + ["algo=dpsgd", "privacy.noise_multiplier=1.0", "train.steps=5"])
    with pytest.raises(DivergedError):
        run_job(cfg, tmp_path, show_progress=False)
    results = RunResults.from_json(json.loads((tmp_path / "results.json").read_text()))
    assert results.status == "diverged" and len(releases) == 2
    (entry,) = results.privacy.ledger
    assert entry["count"] == 2 and results.privacy.steps == 2  # the halted step is charged
    one_step = PLDAccountant().epsilon(ledger_of_plan(lambda step: [GaussianMechanism(1.0, results.privacy.sample_rate)], 1), 1e-5)
    assert results.privacy.epsilon > one_step


# --- no figure depends on realised batch sizes unless log_private_stats -------------------------
def test_without_private_stats_no_figure_or_checkpoint_depends_on_realised_batches(tmp_path, monkeypatch):
    import dpbench.runtime.checkpoint as checkpoint_module
    from dpbench.privacy.plan import PRIVATE_STATISTIC_FIGURES

    cfg = compose(TINY + ["algo=dcdpsgd", "algo.subspace_dim=8", "privacy.noise_multiplier=1.0",
                          "privacy.log_private_stats=false", "train.steps=4", "train.checkpoint_every=1"])
    stored, write = {}, checkpoint_module.write_checkpoint

    def keep(run_dir, state):
        stored["state"] = state
        return write(run_dir, state)

    monkeypatch.setattr(checkpoint_module, "write_checkpoint", keep)
    results = run_job(cfg, tmp_path, show_progress=False)
    for section, keys in PRIVATE_STATISTIC_FIGURES.items():
        for key in keys:
            assert getattr(getattr(results, section), key, None) is None, f"{section}.{key}"
    assert results.memory.optimizer_state_bytes is not None and results.memory.parameter_bytes is not None
    assert any("withheld" in note for note in results.notes)
    assert "mean_tail_fraction" not in results.algorithm
    trainer_state = stored["state"]["trainer"]
    assert trainer_state["throughput"] is None
    attributes = trainer_state["algorithm"]["attributes"]
    assert attributes["engine.peak_bytes"] is None and attributes["tail_fraction_seen"] is None


def test_with_private_stats_the_figures_are_reported(tmp_path):
    cfg = compose(TINY + ["algo=dpsgd", "privacy.noise_multiplier=1.0", "privacy.log_private_stats=true"])
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.memory.peak_bytes and results.throughput.wall_s and results.memory.per_sample_grad_bytes


def test_a_fresh_start_in_a_used_folder_says_the_earlier_attempt_is_outside_epsilon(tmp_path):
    (tmp_path / "error.txt").write_text("an earlier attempt failed\n")
    cfg = compose(TINY + ["algo=dpsgd", "privacy.noise_multiplier=1.0"])
    results = run_job(cfg, tmp_path, show_progress=False)
    assert any("earlier attempt" in note and "error.txt" in note for note in results.notes)
    fresh = run_job(compose(TINY + ["algo=dpsgd", "privacy.noise_multiplier=1.0"]), tmp_path / "new", show_progress=False)
    assert not any("earlier attempt" in note for note in fresh.notes)


def test_a_poisson_ledger_refuses_a_step_of_several_mechanisms():
    from dpbench.privacy.mechanisms import Ledger, SeveralMechanismsPerBatchError, one_batch_mechanism

    ledger = Ledger()
    with pytest.raises(SeveralMechanismsPerBatchError):
        ledger.add_step([GaussianMechanism(1.0, 0.01), GaussianMechanism(2.0, 0.01)])
    (joint,) = one_batch_mechanism([GaussianMechanism(1.0, 0.01), GaussianMechanism(2.0, 0.01)])
    assert joint.noise_multiplier == pytest.approx((1 + 0.25) ** -0.5) and joint.sample_rate == 0.01
    with pytest.raises(ValueError):  # releases of one step read one batch: one sample rate
        one_batch_mechanism([GaussianMechanism(1.0, 0.01), GaussianMechanism(2.0, 0.02)])
