"""DPZero / MeZO: the estimator against a hand-made two-point estimate, exact restore of the
weights, the sensitivity bound, a statistical noise audit, noise independent of the direction
seed, the ledger and epsilon against dp-accounting, and end-to-end runs."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.config import TINY, compose
from omegaconf import OmegaConf
from scipy import stats
from torch import nn

from dpbench.algorithms import PrivacySetup, algorithm_class
from dpbench.algorithms.dpzero import SEED_STRIDE
from dpbench.logging.results import read_results
from dpbench.privacy.accountants import build_accountant
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger
from dpbench.privacy.noise import GaussianNoise
from dpbench.run import run_job
from dpbench.tasks import Task

LAMBDA = 1e-3


class TinyTask(Task):
    """Gaussian inputs, 3 classes, an MLP; per-example cross-entropy."""

    def __init__(self, n: int = 12, features: int = 5):
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, features, generator=generator)
        self.y = torch.randint(0, 3, (n,), generator=generator)
        self.train_size = n

    def batch(self, indices):
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.x[index], self.y[index]

    def batch_size(self, batch) -> int:
        return int(batch[1].shape[0])

    def per_sample_loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y, reduction="none")

    def evaluate(self, model):
        return {"accuracy": 0.0}


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def build(name="dpzero", sigma=0.0, clip=1e9, batch=12, direction="gaussian", model=None, lr=0.1):
    task = TinyTask()
    model = model or tiny_model()
    cfg = OmegaConf.create({"name": name, "smoothing": LAMBDA, "direction": direction, "weight_decay": 0.0})
    privacy = None
    if name == "dpzero":
        privacy = PrivacySetup(
            noise_multiplier=sigma, clip_norm=clip, expected_batch_size=batch,
            sample_rate=batch / task.train_size, noise=GaussianNoise("cpu"),
        )
    return algorithm_class(name)(model, task, cfg, lr, privacy), task


def hand_direction(model, seed):
    """N(0, I) draw for `seed`, built independently: one generator per parameter, seed + i * stride."""
    return [
        torch.randn(p.shape, generator=torch.Generator().manual_seed((seed + i * SEED_STRIDE) % 2**63))
        for i, p in enumerate(model.parameters())
    ]


def peek_seed(algo) -> int:
    state = algo.seed_generator.get_state()
    seed = algo.next_seed()
    algo.seed_generator.set_state(state)
    return seed


@pytest.mark.parametrize("name,direction", [("dpzero", "gaussian"), ("dpzero", "sphere"), ("mezo", "gaussian")])
def test_update_equals_hand_two_point_estimate(name, direction):
    algo, task = build(name, sigma=0.0, clip=1e9, direction=direction, lr=0.05)
    reference = copy.deepcopy(algo.model)
    seed = peek_seed(algo)
    z = hand_direction(reference, seed)
    if direction == "sphere":  # uniform on the sphere of radius sqrt(d)
        norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in z))
        d = sum(v.numel() for v in z)
        z = [v * (math.sqrt(d) / norm) for v in z]
        assert abs(math.sqrt(sum(float(v.double().pow(2).sum()) for v in z)) - math.sqrt(d)) < 1e-3
    batch = task.batch(list(range(task.train_size)))

    def mean_loss_at(sign):
        shifted = copy.deepcopy(reference)
        with torch.no_grad():
            for p, v in zip(shifted.parameters(), z):
                p.add_(sign * LAMBDA * v)
        return task.per_sample_loss(shifted, batch).double().mean().item()

    projected = (mean_loss_at(+1) - mean_loss_at(-1)) / (2 * LAMBDA)
    assert abs(projected) > 1e-3  # the estimate is not trivially zero
    result = algo.train_step([task.batch(list(range(6))), task.batch(list(range(6, 12)))], 0)  # two physical chunks
    assert result.batch_size == 12
    for p, p0, v in zip(algo.model.parameters(), reference.parameters(), z):
        torch.testing.assert_close(p.detach(), p0.detach() - 0.05 * projected * v, rtol=1e-4, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_perturb_restore_leaves_weights_bit_identical(dtype):
    algo, task = build(model=tiny_model().to(dtype))
    before = [p.detach().clone() for p in algo.model.parameters()]
    batch = task.batch(list(range(12)))
    differences, _ = algo.finite_differences(batch, seed=123, scale=1.0)
    assert differences.abs().max() > 0  # the forwards did see perturbed weights
    for p, p0 in zip(algo.model.parameters(), before):
        assert p.dtype == dtype and torch.equal(p.detach(), p0)  # exact in every dtype: never written

    class Boom(RuntimeError):
        pass

    def failing_loss(model, batch):
        model[0](batch[0].to(dtype))
        raise Boom

    algo.task.per_sample_loss = failing_loss  # an exception mid-forward must not leave weights perturbed
    with pytest.raises(Boom):
        algo.finite_differences(batch, seed=5, scale=1.0)
    for p, p0 in zip(algo.model.parameters(), before):
        assert torch.equal(p.detach(), p0)


def test_parameters_read_outside_their_module_are_refused():
    class Leaky(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(5, 3)

        def forward(self, x):
            return F.linear(x, self.inner.weight)  # reads the weight outside inner's forward

    from dpbench.errors import UserError

    algo, task = build(model=Leaky())
    with pytest.raises(UserError, match="missed parameters"):
        algo.train_step([task.batch(list(range(4)))], 0)


def test_sensitivity_one_example_moves_the_noisy_scalar_by_at_most_c_over_b():
    clip, batch = 0.05, 12
    algo, task = build(sigma=1.0, clip=clip, batch=batch)
    seed = 77
    base = list(range(11))
    total, _, count = algo.estimate([task.batch(base)], seed, 1.0, clip)
    differences, _ = algo.finite_differences(task.batch(base), seed, 1.0)
    assert count == 11 and (differences.abs() > clip).any()  # clipping is active in this set-up
    # an adversarial extra example: a huge input, so its finite difference is far beyond C
    task.x = torch.cat([task.x, 1e4 * torch.ones(1, task.x.shape[1])])
    task.y = torch.cat([task.y, torch.tensor([2])])
    added, _, _ = algo.estimate([task.batch(base + [12])], seed, 1.0, clip)
    replaced, _, _ = algo.estimate([task.batch(base[:-1] + [12])], seed, 1.0, clip)
    assert abs(added - total) <= clip * (1 + 1e-6)  # add/remove: sensitivity C
    assert abs(replaced - total) <= 2 * clip * (1 + 1e-6)  # replace-one: 2C
    algo.privacy.noise.sample = lambda shape, std: torch.tensor(0.37)  # the same noise draw for both
    assert abs(algo.privatize(added) - algo.privatize(total)) <= clip / batch * (1 + 1e-6)


def test_noise_standard_deviation_audit():
    sigma, clip, batch, draws = 1.3, 2.0, 10, 20000
    algo, _ = build(sigma=sigma, clip=clip, batch=batch)
    values = torch.tensor([algo.privatize(0.0) for _ in range(draws)], dtype=torch.float64)
    std = sigma * clip / batch  # N(0, sigma^2 C^2) on the sum, divided by B
    statistic = (draws - 1) * values.var().item() / std**2  # ~ chi2(draws - 1)
    low, high = stats.chi2.ppf([1e-4, 1 - 1e-4], draws - 1)
    assert low < statistic < high
    assert abs(values.mean().item()) < 5 * std / math.sqrt(draws)


def test_noise_does_not_repeat_when_the_direction_seed_repeats():
    algo, task = build(sigma=50.0, clip=1.0, batch=12, lr=1e-3)  # noise std 4.2 >> clipped mean <= 1
    start = [p.detach().clone() for p in algo.model.parameters()]
    state = algo.seed_generator.get_state()
    torch.manual_seed(0)
    algo.train_step([task.batch(list(range(12)))], 0)
    first = torch.cat([(p.detach() - p0).flatten() for p, p0 in zip(algo.model.parameters(), start)])
    with torch.no_grad():
        for p, p0 in zip(algo.model.parameters(), start):
            p.copy_(p0)
    algo.seed_generator.set_state(state)  # the same direction seed again, and the same global RNG
    torch.manual_seed(0)
    algo.train_step([task.batch(list(range(12)))], 0)
    second = torch.cat([(p.detach() - p0).flatten() for p, p0 in zip(algo.model.parameters(), start)])
    cosine = torch.dot(first, second) / (first.norm() * second.norm())
    assert abs(abs(cosine.item()) - 1) < 1e-4  # same direction z ...
    assert not torch.allclose(first, second)  # ... but a fresh noise draw


def test_replace_one_reduction_is_conservative_and_pld_is_exact():
    import dp_accounting as dpa

    sigma, q, steps, delta = 1.0, 0.05, 100, 1e-5
    ledger = Ledger()
    ledger.add(GaussianMechanism(sigma, q, "replace_one"), steps)
    pld = build_accountant("pld")
    epsilon = pld.epsilon(ledger, delta)
    exact = dpa.pld.PLDAccountant(dpa.NeighboringRelation.REPLACE_ONE, value_discretization_interval=pld.interval_used)
    exact.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps))
    assert epsilon == pytest.approx(exact.get_epsilon(delta), rel=1e-6)
    add_remove = Ledger()
    add_remove.add(GaussianMechanism(sigma, q), steps)
    for name in ("rdp", "prv"):
        eps = build_accountant(name).epsilon(ledger, delta)
        assert eps >= exact.get_epsilon(delta)  # never below the exact replace-one epsilon
        assert eps > build_accountant(name).epsilon(add_remove, delta)


def run(tmp_path, *overrides) -> dict:
    """A 6-step run on the synthetic dataset, in this process; its results.json as written."""
    run_job(compose([*TINY, "train.steps=6", "train.eval_every=3", *overrides]), tmp_path, show_progress=False)
    return read_results(tmp_path)


@pytest.mark.slow  # seconds each: the fast tier stays under its 5 minutes
def test_dpzero_ledger_and_epsilon_match_dp_accounting(tmp_path):
    import dp_accounting as dpa
    from dp_accounting.pld import PLDAccountant

    results = run(tmp_path, "algo=dpzero", "privacy.epsilon=3", "privacy.clip_norm=5")
    privacy, memory = results["privacy"], results["memory"]
    assert results["status"] == "completed" and results["algo"] == "dpzero"
    assert memory["per_sample_grad_bytes"] == 0 and memory["optimizer_state_bytes"] == 0
    sigma, q = privacy["noise_multiplier"], 32 / 256
    assert privacy["neighboring"] == "add_remove"
    assert privacy["ledger"] == [{"noise_multiplier": sigma, "sample_rate": q, "neighboring": "add_remove", "count": 6}]
    assert privacy["accountant"] == "pld"  # the default: dp-accounting's PLD at the interval it settled on
    independent = PLDAccountant(value_discretization_interval=privacy["pld_interval"])
    independent.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), 6))
    assert privacy["epsilon"] == pytest.approx(independent.get_epsilon(1e-5), rel=0.01)
    assert privacy["epsilon"] <= 3.0 + 1e-9
    assert math.isfinite(results["metrics"]["train_loss"])


@pytest.mark.slow  # trains end to end (the slow tier)
def test_mezo_and_replace_one(tmp_path):
    mezo = run(tmp_path / "mezo", "algo=mezo", "train.lr=1e-3")
    assert mezo["privacy"]["epsilon"] is None and mezo["privacy"]["ledger"] == []
    assert mezo["memory"]["per_sample_grad_bytes"] == 0 and mezo["memory"]["optimizer_state_bytes"] == 0
    replace = run(tmp_path / "replace", "algo=dpzero", "privacy.neighboring=replace_one", "accountant=pld")
    privacy = replace["privacy"]
    assert privacy["neighboring"] == "replace_one"
    assert privacy["ledger"][0]["neighboring"] == "replace_one"
    assert privacy["epsilon"] <= 8.0 + 1e-9


def test_auto_mode_trains_lora_on_a_model_from_scratch_and_every_weight_of_a_checkpoint(monkeypatch):
    """A zeroth-order estimate cannot train a random-init model's every weight: algo.mode=auto
    trains LoRA adapters and the head there, and every weight of a model loaded from a checkpoint."""
    from dpbench.algorithms.dpzero import trains_lora
    from dpbench.errors import UserError
    from dpbench.models import FROM_SCRATCH_ATTRIBUTE, DataSpec, build_model

    model_cfg = compose(["model=vit"]).model
    model = build_model(model_cfg, DataSpec(num_classes=10))
    assert getattr(model, FROM_SCRATCH_ATTRIBUTE) is True
    auto = OmegaConf.create({"name": "dpzero", "smoothing": LAMBDA, "direction": "gaussian", "weight_decay": 0.0,
                             "mode": "auto", "lora_rank": 8, "lora_alpha": 16.0})
    assert trains_lora(model, auto) and not trains_lora(model, {**auto, "mode": "full"})
    assert not trains_lora(tiny_model(), auto)  # not built by dpbench: no LoRA targets known, every weight
    setattr(model, FROM_SCRATCH_ATTRIBUTE, False)  # what build_model sets for a checkpoint (model.path, ...)
    assert not trains_lora(model, auto) and trains_lora(model, {**auto, "mode": "lora"})
    setattr(model, FROM_SCRATCH_ATTRIBUTE, True)
    total = sum(p.numel() for p in model.parameters())
    algo = algorithm_class("mezo")(model, TinyTask(), auto, 0.1, None)
    head = sum(p.numel() for n, p in model.named_parameters() if n.startswith("head."))
    assert algo.mode == "lora" and head < algo.dimension < total / 10
    assert f"({algo.dimension:,} weights; the model has {total:,})" in algo.run_notes[0]
    assert {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad} == {"blocks", "head"}
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad and n.startswith("blocks"))
    monkeypatch.setattr("dpbench.runtime.sharding.is_sharded", lambda model: True)
    with pytest.raises(UserError, match="algo.mode=full"):
        algorithm_class("mezo")(build_model(model_cfg, DataSpec(num_classes=10)), TinyTask(), auto, 0.1, None)
