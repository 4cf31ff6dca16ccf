"""Shuffled fixed-size batches (`privacy.sampling=shuffle`): fresh-entropy orders, one batch per
example per epoch, and epsilon as the no-amplification bound, one full-batch Gaussian per epoch
under replace-one (sensitivity 2C), cross-checked against dp-accounting and the Gaussian's closed
form (Balle & Wang 2018)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.config import TINY, compose
from scipy.optimize import brentq
from scipy.stats import norm

from dpbench.algorithms import algorithm_class
from dpbench.runtime.algorithm_state import CheckpointMismatch
from dpbench.errors import UserError
from dpbench.privacy.mechanisms import (
    GaussianMechanism, SeveralMechanismsPerBatchError, ShuffledLedger, one_batch_mechanism,
)
from dpbench.privacy.plan import PlanMismatchError, plan_privacy
from dpbench.privacy.sampling import ShuffledBatches, batches_per_epoch, build_sampler
from dpbench.run import planned_steps, run_job, setup
from dpbench.runtime.trainer import Trainer, TrainerConfig

EPOCHS, DELTA = 6, 1e-5


def shuffled_plan(*extra: str, n: int = 256):
    cfg = compose(TINY + ["train.steps=null", f"train.epochs={EPOCHS}", "privacy.sampling=shuffle", *extra])
    steps = planned_steps(cfg, n)
    return cfg, steps, plan_privacy(cfg, algorithm_class(cfg.algo.name), n, steps, torch.device("cpu"))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of a Gaussian mechanism with mean shift / noise std = mu (Balle & Wang 2018, Thm 8)."""
    excess = lambda eps: norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2) - delta  # noqa: E731
    return brentq(excess, 0.0, 500.0)


def dp_accounting_epsilon(sigma: float, epochs: int, delta: float) -> float:
    """dp-accounting's PLD for `epochs` replace-one Gaussians at q = 1 (no sampling)."""
    import dp_accounting as dpa

    accountant = dpa.pld.PLDAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(sigma), epochs))
    return float(accountant.get_epsilon(delta))


@pytest.mark.parametrize("accountant", ["pld", "prv", "rdp"])
@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_epsilon_is_that_of_one_full_batch_gaussian_per_epoch(accountant, relation):
    cfg, steps, plan = shuffled_plan(f"accountant={accountant}", f"privacy.neighboring={relation}")
    per_epoch = batches_per_epoch(cfg, 256)
    assert steps == EPOCHS * per_epoch and plan.batches_per_epoch == per_epoch
    sigma = plan.setup.noise_multiplier
    ledger = plan.planned_ledger(steps)
    assert ledger.as_records() == [{"noise_multiplier": sigma, "sample_rate": 1.0, "neighboring": "replace_one", "count": EPOCHS}]
    reported = plan.epsilon(ledger)
    independent = dp_accounting_epsilon(sigma, EPOCHS, DELTA)
    exact = gaussian_epsilon(2 * math.sqrt(EPOCHS) / sigma, DELTA)  # sensitivity 2C, noise sigma C, E epochs
    assert independent == pytest.approx(exact, rel=2e-3)
    assert reported >= exact * (1 - 2e-3)  # an upper bound ...
    assert reported == pytest.approx(exact, rel=0.02 if accountant != "rdp" else 0.15)  # ... pld/prv tight, rdp loose
    assert 8.0 - 0.05 <= reported <= 8.0  # sigma is calibrated for that bound (target epsilon 8)


def test_calibrated_sigma_is_far_above_poissons_and_the_epsilon_at_poissons_sigma_is_far_above_the_target():
    """The old run reported the Poisson accountant's 8.0 for shuffled batches: at that sigma the
    bound is several times larger."""
    _, _, shuffled = shuffled_plan("accountant=pld")
    cfg = compose(TINY + ["train.steps=null", f"train.epochs={EPOCHS}", "accountant=pld"])
    poisson = plan_privacy(cfg, algorithm_class(cfg.algo.name), 256, planned_steps(cfg, 256), torch.device("cpu"))
    assert shuffled.setup.noise_multiplier > 2 * poisson.setup.noise_multiplier
    at_poisson_sigma = gaussian_epsilon(2 * math.sqrt(EPOCHS) / poisson.setup.noise_multiplier, DELTA)
    assert at_poisson_sigma > 2 * 8.0


def test_each_step_is_still_checked_against_its_plan():
    cfg, _, plan = shuffled_plan()
    (planned,) = plan.planned(0)
    assert planned.sample_rate == 32 / 256 and planned.neighboring == "add_remove"
    plan.check_step(0, [planned])
    with pytest.raises(PlanMismatchError):
        plan.check_step(0, [GaussianMechanism(planned.noise_multiplier / 2, planned.sample_rate, planned.neighboring)])


def test_an_epoch_is_charged_its_least_noisy_step_and_a_partial_epoch_its_least_noisy_so_far():
    ledger = ShuffledLedger(batches_per_epoch=3)
    one = lambda sigma: [GaussianMechanism(sigma, 0.1, "replace_one")]  # noqa: E731
    for sigma in (2.0, 1.0, 3.0, 4.0, 2.5):  # epoch 1: 2, 1, 3; epoch 2 (partial): 4, 2.5
        ledger.add_step(one(sigma))
    assert sorted((m.noise_multiplier, n) for m, n in ledger.items()) == [(1.0, 1), (2.5, 1)]
    assert all(m.sample_rate == 1.0 for m, _ in ledger.items())
    two = ShuffledLedger(batches_per_epoch=2)  # two releases of one batch: one Gaussian, (3^-2 + 4^-2)^-1/2
    two.add_step(one_batch_mechanism([GaussianMechanism(3.0, 0.5), GaussianMechanism(4.0, 0.5)]))
    ((mechanism, count),) = two.items()
    assert mechanism.noise_multiplier == pytest.approx(2.4) and count == 1
    with pytest.raises(SeveralMechanismsPerBatchError):  # a step declares one mechanism, never two
        two.add_step([GaussianMechanism(3.0, 0.5), GaussianMechanism(4.0, 0.5)])
    with pytest.raises(TypeError):
        two.extend(one(1.0))  # never a Poisson-style multiset: steps go through add_step


def test_add_remove_epochs_leave_one_example_out_and_a_batch_of_everything_is_refused():
    cfg = lambda *extra: compose(TINY + ["privacy.sampling=shuffle", *extra])  # noqa: E731
    assert batches_per_epoch(cfg(), 256) == 7  # (n - 1) // B: 32 divides 256, one batch is left out
    assert batches_per_epoch(cfg(), 257) == 8
    assert batches_per_epoch(cfg("privacy.neighboring=replace_one"), 256) == 8
    assert batches_per_epoch(compose(TINY), 256) is None  # Poisson
    with pytest.raises(UserError, match="needs train.batch_size below the 32 training examples") as refused:
        batches_per_epoch(cfg(), 32)
    assert "\n" not in str(refused.value)


def test_private_orders_come_from_fresh_entropy_and_cover_each_example_once_per_epoch():
    def epoch(sampler):
        batches = iter(sampler)
        return [next(batches) for _ in range(sampler.batches_per_epoch)]

    private = [epoch(build_sampler("shuffle", 100, 10, seed=0, private=True)) for _ in range(2)]
    assert private[0] != private[1]  # same seed, different orders (collision chance 1/100!)
    seeded = [epoch(build_sampler("shuffle", 100, 10, seed=0, private=False)) for _ in range(2)]
    assert seeded[0] == seeded[1]  # non-private runs stay reproducible
    for batches in private + seeded:
        flat = [i for batch in batches for i in batch]
        assert all(len(batch) == 10 for batch in batches) and len(set(flat)) == len(flat) == 100
    left_out = epoch(ShuffledBatches(100, 10, batches_per_epoch=9))
    assert len({i for batch in left_out for i in batch}) == 90


def test_a_resumed_epoch_finishes_its_order_before_a_new_one():
    sampler = ShuffledBatches(60, 10)  # fresh entropy
    batches = iter(sampler)
    first = [next(batches) for _ in range(4)]  # preempted after 4 of 6 batches
    saved = sampler.state_dict()
    assert saved["generator"] is None  # a private order's generator is never stored
    resumed = ShuffledBatches(60, 10)
    resumed.load_state_dict(saved)
    rest = iter(resumed)
    second = [next(rest) for _ in range(2)]
    flat = [i for batch in first + second for i in batch]
    assert sorted(flat) == list(range(60))  # the epoch holds each example exactly once
    assert resumed._next == 6 and len(next(rest)) == 10 and resumed._next == 1  # then a new order begins
    with pytest.raises(ValueError):
        ShuffledBatches(70, 10).load_state_dict(saved)


def test_a_private_shuffled_checkpoint_restores_the_epoch_in_progress():
    job = setup(compose(TINY + ["privacy.sampling=shuffle", "train.steps=5"]))
    make = lambda: Trainer(job.task, job.algorithm, ShuffledBatches(job.task.train_size, 32, batches_per_epoch=7),  # noqa: E731
                           TrainerConfig(5, eval_every=0, replay_sampler=False), job.privacy)
    trainer = make()
    trainer.config.steps = 3
    trainer.fit()
    saved = trainer.state_dict()
    assert saved["sampler"]["next"] == 3 and len(saved["rng"]) == 1  # one process: one rank's generators
    resumed = make()
    resumed.load_state_dict(saved)
    assert resumed.sampler._order is not None and torch.equal(resumed.sampler._order, trainer.sampler._order)
    assert resumed.state.ledger.as_records() == trainer.state.ledger.as_records()
    without = {**saved, "sampler": None}
    with pytest.raises(CheckpointMismatch, match="shuffled epoch"):
        make().load_state_dict(without)


@pytest.mark.slow  # seconds each: the fast tier stays under its 5 minutes
def test_a_shuffled_run_records_its_bound(tmp_path):
    results = run_job(compose(TINY + ["train.steps=null", "train.epochs=2", "privacy.sampling=shuffle", "accountant=pld"]),
                      tmp_path, show_progress=False)
    privacy = results.privacy
    assert privacy.steps == 14 and privacy.batches_per_epoch == 7
    assert privacy.bound == "full_batch_gaussian_per_epoch" and privacy.sampling == "shuffle"
    assert privacy.ledger == [{"noise_multiplier": privacy.noise_multiplier, "sample_rate": 1.0,
                               "neighboring": "replace_one", "count": 2}]
    assert privacy.epsilon == pytest.approx(dp_accounting_epsilon(privacy.noise_multiplier, 2, DELTA), rel=2e-3)
    assert any("without amplification" in note for note in results.notes)


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_a_planned_epoch_runs_the_same_whatever_the_realised_size(relation):
    """The epoch length comes from the public planning size; a realised training part smaller than
    its slots (a validation split that took more) is never refused: D and D plus one record both
    run k batches per epoch, each example at most once, over the same number of slots when the
    data is below them (the added record fills an empty slot)."""
    batch, per_epoch = 10, 4
    planned_slots = per_epoch * batch + (relation == "add_remove")
    for realised in range(planned_slots - 6, planned_slots + 3):
        sampler = build_sampler("shuffle", realised, batch, seed=0, private=True, batches_per_epoch=per_epoch,
                                relation=relation)
        assert sampler.slots == max(realised, planned_slots)
        batches = iter(sampler)
        for _ in range(3):  # three epochs
            epoch = [next(batches) for _ in range(per_epoch)]
            flat = [i for b in epoch for i in b]
            assert all(len(b) <= batch for b in epoch) and len(set(flat)) == len(flat)
            left_out = sampler.slots - per_epoch * batch  # slots past the epoch, empty or not
            assert set(flat) <= set(range(realised)) and realised - left_out <= len(flat) <= per_epoch * batch


def test_the_reviews_split_trains_on_both_neighbours(tmp_path):
    """Digits at f = 0.2 and B = 1149 plan 1150 training examples; a realised part of 1149 (D) and
    of 1150 (D plus one record) both train, where the first was refused before."""
    for realised in (1149, 1150):
        sampler = build_sampler("shuffle", realised, 1149, seed=0, private=True, batches_per_epoch=1, relation="add_remove")
        batch = next(iter(sampler))
        assert len(batch) <= 1149 and len(set(batch)) == len(batch)
