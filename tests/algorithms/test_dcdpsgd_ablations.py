"""DC-DPSGD ablations (Tables 3-5): the paper's epsilon split eps_tr + eps_dp, and LDAM-DRW's
deferred class re-weighting on the long-tailed rows."""

from __future__ import annotations

import json
import math

import dp_accounting as dpa
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers.algorithms import tiny_model
from helpers.config import OFFLINE, compose
from helpers.cli import dpbench_in_process

from dpbench.algorithms.dcdpsgd import DCDPSGD, EpsilonSplit, gradient_mechanism, noise_multipliers
from dpbench.errors import UserError
from dpbench.privacy.accountants import build_accountant
from dpbench.privacy.plan import Calibration
from dpbench.tasks import build_task
from dpbench.tasks import image as image_task
from dpbench.tasks.image import class_balanced_weights, public_class_counts

STEPS, Q, DELTA, EPSILON = 100, 0.05, 1e-5, 8.0


def _epsilon_split_cfg(fraction: float):
    cfg = compose([*OFFLINE, "algo=dcdpsgd", "algo.budget_split=epsilon", f"algo.score_epsilon_fraction={fraction}"]).algo
    return cfg


def _dp_accounting_epsilon(sigma: float, delta: float, interval: float) -> float:
    """epsilon of STEPS Poisson-subsampled Gaussians at rate Q, by dp-accounting's PLD directly, on
    the grid the calibration settled on (`PLDAccountant.settle_for`)."""
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(Q, dpa.GaussianDpEvent(sigma)), STEPS)
    return float(dpa.pld.PLDAccountant(value_discretization_interval=interval).compose(event).get_epsilon(delta))


@pytest.mark.slow  # four PLD calibrations (the slow tier)
@pytest.mark.parametrize("fraction", [0.25, 0.75])  # the paper's 2+6 and 6+2
def test_epsilon_split_keeps_the_papers_ratio_and_meets_the_target_jointly(fraction):
    cfg = _epsilon_split_cfg(fraction)
    calibration = Calibration(build_accountant("pld"), STEPS, Q, 1.0, "add_remove")
    sigma_dp, split = DCDPSGD.calibrate_noise(cfg, calibration, EPSILON, DELTA)
    assert isinstance(split, EpsilonSplit) and split.fixed_noise_options() == {"score_noise_multiplier": split.sigma_tr}
    sigma_tr = split.sigma_tr
    assert split.delta_each == DELTA / 2 and split.sigma_dp == sigma_dp
    # the paper's ratio: each part alone calibrated to its share at delta/2 (cross-checked with
    # dp-accounting's PLD directly), then both scaled by one factor
    shares = fraction * EPSILON, (1 - fraction) * EPSILON
    alone_tr = calibration.noise_multiplier(lambda s, step: [dcdpsgd_score(s)], shares[0], DELTA / 2)
    assert _dp_accounting_epsilon(alone_tr, DELTA / 2, calibration.accountant.interval_used) <= shares[0] + 1e-6
    alone_dp = calibration.noise_multiplier(lambda s, step: [gradient_mechanism(cfg, s, Q, 1.0)], shares[1], DELTA / 2)
    assert sigma_tr / sigma_dp == pytest.approx(alone_tr / alone_dp, rel=1e-9)
    assert sigma_dp > alone_dp  # one batch: the joint mechanism needs more noise than the paper's split
    # planning reads the split as is (the config is the user's, score_noise_multiplier null): ONE
    # mechanism per step, whose epsilon at delta meets the target (within the bisection's 0.01)
    assert cfg.score_noise_multiplier is None
    (joint,) = DCDPSGD.planned_mechanisms(cfg, sigma_dp, Q, 0, 1.0, derived=split)
    grad_sigma = gradient_mechanism(cfg, sigma_dp, Q, 1.0).noise_multiplier
    assert joint.noise_multiplier == pytest.approx((sigma_tr**-2 + grad_sigma**-2) ** -0.5, rel=1e-12)
    assert EPSILON - 0.02 <= calibration.epsilon(lambda step: [joint], DELTA) <= EPSILON
    assert _dp_accounting_epsilon(joint.noise_multiplier, DELTA, calibration.accountant.interval_used) <= EPSILON + 0.01


def dcdpsgd_score(sigma):
    from dpbench.algorithms.dcdpsgd import score_mechanism
    return score_mechanism(sigma, Q)


def test_epsilon_split_refuses_incomplete_or_mixed_settings():
    cfg = _epsilon_split_cfg(0.5)
    with pytest.raises(UserError, match="score_noise_multiplier"):
        noise_multipliers(cfg, 1.3)  # given sigma_dp without sigma_tr
    assert noise_multipliers(compose([*OFFLINE, "algo=dcdpsgd", "algo.budget_split=epsilon",
                                            "algo.score_noise_multiplier=2.5"]).algo, 1.3) == (2.5, 1.3)
    with pytest.raises(UserError, match="budget_split=epsilon"):
        noise_multipliers(compose([*OFFLINE, "algo=dcdpsgd", "algo.score_noise_multiplier=2.5"]).algo, 1.3)
    with pytest.raises(UserError, match="score_epsilon_fraction"):
        noise_multipliers(_epsilon_split_cfg(1.0), 1.3)
    with pytest.raises(Exception, match="budget_split"):  # the schema refuses it at composition
        compose([*OFFLINE, "algo=dcdpsgd", "algo.budget_split=halves"])


def _cli(tmp_path, *overrides: str) -> dict:
    done = dpbench_in_process(f"hydra.run.dir={tmp_path}", *overrides, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads((tmp_path / "results.json").read_text())


# Learns to ~0.5 test accuracy in 4 epochs (0.30-0.65 over 12 runs: the noise is entropy-seeded).
TINY_DIGITS = ["algo=dcdpsgd", "dataset=digits", "model=cnn", "model.width=16", "model.groups=4", "logger=none",
               "algo.subspace_dim=50", "algo.tail_clip_ratio=1.5", "privacy.clip_norm=1", "train.batch_size=256",
               "train.epochs=4", "train.lr=2.0", "train.eval_every=0"]
LEARNED = 0.2  # 10 classes: chance is 0.1


@pytest.mark.slow  # trains end to end (the slow tier)
def test_cli_run_in_epsilon_mode_reports_both_epsilons_and_learns(tmp_path):
    split = ["algo.budget_split=epsilon", "algo.score_epsilon_fraction=0.25"]  # the paper's 2+6
    results = _cli(tmp_path, *TINY_DIGITS, *split)
    privacy, algorithm = results["privacy"], results["algorithm"]
    assert algorithm["budget_split"] == "epsilon" and algorithm["score_epsilon_fraction"] == 0.25
    assert privacy["target_epsilon"] == 8.0 and privacy["noise_multiplier"] == algorithm["sigma_dp"]
    assert 7.98 <= privacy["epsilon"] <= 8.0  # the joint mechanism meets the target
    assert any("paper's accounting, not a bound" in note for note in results["notes"])
    assert algorithm["epsilon_tr"] / algorithm["epsilon_dp"] < 1  # the 2 + 6 ratio's shape
    (joint,) = privacy["ledger"]  # one mechanism per step
    assert joint["count"] == privacy["steps"]
    assert results["config"]["algo"]["score_noise_multiplier"] is None  # the config stays as given (resume)
    assert any("budget_split=epsilon" in note for note in results["notes"])
    assert results["metrics"]["test_accuracy"] > LEARNED


# --- LDAM-DRW ---------------------------------------------------------------------------------


def _ldam_drw_reference(class_counts, beta: float) -> np.ndarray:
    """LDAM-DRW's code (kaidic/LDAM-DRW, cifar_train.py), verbatim but for names."""
    effective_num = 1.0 - np.power(beta, class_counts)
    per_cls_weights = (1.0 - beta) / np.array(effective_num)
    return per_cls_weights / np.sum(per_cls_weights) * len(class_counts)


def test_drw_weights_follow_the_effective_number_formula_on_the_public_profile():
    profile_cfg = compose([*OFFLINE, "dataset=cifar10_lt"]).dataset
    counts = public_class_counts(profile_cfg, 10, 12406)
    exact = [int(5000 * 0.01 ** (c / 9)) for c in range(10)]  # LDAM-DRW's IMBALANCECIFAR10 sizes
    assert torch.allclose(counts, torch.tensor(exact, dtype=torch.float32), rtol=6e-3)
    weights = class_balanced_weights(counts, 0.9999)
    assert np.allclose(weights.numpy(), _ldam_drw_reference(counts.double().numpy(), 0.9999), rtol=1e-6)
    assert np.allclose(weights.numpy(), _ldam_drw_reference(np.array(exact), 0.9999), rtol=1e-2)
    assert weights.sum().item() == pytest.approx(10) and bool((weights.diff() > 0).all())  # rarer: heavier
    assert torch.allclose(class_balanced_weights(counts, 0.0), torch.ones(10))  # LDAM-DRW's first stage
    balanced = compose([*OFFLINE, "dataset=digits"]).dataset
    assert torch.allclose(class_balanced_weights(public_class_counts(balanced, 10, 1437), 0.9999), torch.ones(10))


DRW_DIGITS = ["dataset=digits", "+dataset.imbalance_factor=0.1", "+dataset.drw_epoch=2", "train.batch_size=100"]


def test_drw_weights_do_not_depend_on_the_labels(monkeypatch):
    cfg = compose([*OFFLINE, *DRW_DIGITS])
    first = build_task(cfg, torch.device("cpu")).drw.class_weights
    original = image_task.load_dataset

    def relabelled(dataset_cfg, seed):
        data = original(dataset_cfg, seed)
        data.train_labels = torch.zeros_like(data.train_labels)  # one class only
        return data

    monkeypatch.setattr(image_task, "load_dataset", relabelled)
    second = build_task(cfg, torch.device("cpu"))
    assert bool((second.data.train_labels == 0).all())
    assert torch.equal(first, second.drw.class_weights)


def test_drw_changes_nothing_before_its_epoch_and_weights_each_loss_after():
    cfg = compose([*OFFLINE, *DRW_DIGITS])
    task = build_task(cfg, torch.device("cpu"))
    model = tiny_model(classes=10)
    batch = task.batch(list(range(40)))
    images, labels = batch
    plain = F.cross_entropy(model(images), labels, reduction="none")
    with pytest.raises(UserError, match="drw_epoch"):
        task.per_sample_loss(model, batch)  # the step was never told: no silent unweighted run
    boundary = math.ceil(2 * task.train_size / 100)  # first step of epoch 2: step * B >= 2 n
    for step in (0, boundary - 1):
        task.set_step(step)
        assert torch.equal(task.per_sample_loss(model, batch), plain)
    task.set_step(boundary)
    expected = plain * class_balanced_weights(public_class_counts(cfg.dataset, 10, task.train_size), 0.9999)[labels]
    assert torch.allclose(task.per_sample_loss(model, batch), expected)
    assert not torch.allclose(expected, plain)


@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
def test_drw_switches_on_in_a_run_at_its_epoch(tmp_path):
    from dpbench.logging.wandb_logger import build_logger
    from dpbench.run import fit, setup

    torch.set_num_threads(1)
    cfg = compose([*OFFLINE, *TINY_DIGITS, "+dataset.imbalance_factor=0.1", "+dataset.drw_epoch=2"])
    job = setup(cfg)
    drw, seen = job.task.drw, []
    original = drw.weights
    drw.weights = lambda labels: seen.append((drw.step, bool((original(labels) != 1).any()))) or original(labels)
    trainer, status, _ = fit(job, build_logger(cfg.logger, tmp_path, "drw", {}), False)
    assert status == "completed"
    per_epoch = job.task.train_size / 256
    assert seen and all(weighted == (step >= 2 * per_epoch) for step, weighted in seen)
    assert {weighted for _, weighted in seen} == {False, True}
    assert trainer.state.history[-1].test_accuracy > LEARNED
