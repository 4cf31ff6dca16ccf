"""DP-SGD / DP-Adam against Opacus, sensitivity, noise scale, accountants, Poisson sampling."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

from dpbench.algorithms import PrivacySetup, algorithm_class
from dpbench.privacy.accountants import (
    GDPAccountant,
    PLDAccountant,
    PRVAccountant,
    RDPAccountant,
    calibrate_noise_multiplier,
)
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.per_sample import PerSampleGradients
from dpbench.privacy.sampling import PoissonBatches
from dpbench.tasks.image import ImageClassificationTask


class TensorTask(ImageClassificationTask):
    """An image task over given tensors (skips dataset loading)."""

    def __init__(self, x, y):
        self.x, self.y, self.device, self.train_size = x, y, torch.device("cpu"), len(y)

    def batch(self, indices):
        index = torch.as_tensor(indices, dtype=torch.long)
        return self.x[index], self.y[index]


def small_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 8 * 8, 5)
    )


def data(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def privacy(sigma=0.0, clip=0.5, batch=12.0, n=100):
    return PrivacySetup(sigma, clip, batch, batch / n, GaussianNoise("cpu"))


class AlgoCfg(dict):
    __getattr__ = dict.get


SGD_CFG = AlgoCfg(name="dpsgd", momentum=0.0, weight_decay=0.0)
ADAM_CFG = AlgoCfg(name="dpadam", betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0)


@pytest.mark.parametrize("name,cfg", [("dpsgd", SGD_CFG), ("dpadam", ADAM_CFG)])
def test_update_matches_opacus_privacy_engine(name, cfg):
    from opacus import PrivacyEngine

    x, y = data()
    clip, lr, expected_batch = 0.5, 0.1, 12.0
    ours = small_model()
    reference = copy.deepcopy(ours)

    algo = algorithm_class(name)(ours, TensorTask(x, y), cfg, lr, privacy(0.0, clip, expected_batch))
    for step in range(2):  # two steps so Adam's moments matter
        algo.train_step([(x[:7], y[:7]), (x[7:], y[7:])], step)  # two physical batches of one logical batch

    optimizer_class = torch.optim.SGD if name == "dpsgd" else torch.optim.Adam
    optimizer = optimizer_class(reference.parameters(), lr=lr)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=12)
    engine = PrivacyEngine()
    module, dp_optimizer, _ = engine.make_private(
        module=reference, optimizer=optimizer, data_loader=loader,
        noise_multiplier=0.0, max_grad_norm=clip, poisson_sampling=False,
    )
    dp_optimizer.expected_batch_size = int(expected_batch)
    for _ in range(2):
        dp_optimizer.zero_grad()
        nn.functional.cross_entropy(module(x), y).backward()  # mean: Opacus rescales by the batch
        dp_optimizer.step()
    for p, q in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_per_sample_gradients_match_one_at_a_time():
    model = small_model()
    x, y = data(6)
    engine = PerSampleGradients(model)
    grads = engine.backward_per_sample(nn.functional.cross_entropy(model(x), y, reduction="none"))
    engine.detach()
    for i in range(6):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(g[i], p.grad, rtol=1e-4, atol=1e-6)


def test_one_example_moves_the_privatised_gradient_by_at_most_c_over_b():
    x, y = data(12)
    huge_x = x[:1] * 1e4
    clip, expected_batch = 0.5, 12.0
    model = small_model()
    algo = algorithm_class("dpsgd")(model, TensorTask(x, y), SGD_CFG, 0.1, privacy(0.0, clip, expected_batch))
    without, _ = algo.clip_and_accumulate([(x[1:], y[1:])])
    with_outlier, _ = algo.clip_and_accumulate([(torch.cat([huge_x, x[1:]]), y)])
    diff = torch.cat([(a - b).flatten() for a, b in zip(algo.privatize(with_outlier), algo.privatize(without))])
    assert diff.norm() <= clip / expected_batch * (1 + 1e-4)
    assert diff.norm() >= 0.5 * clip / expected_batch  # the outlier really was clipped, not dropped


def test_noise_actually_added_has_the_stated_std():
    """An empty Poisson batch: the DP-SGD update is pure noise, -lr * N(0, (sigma C)^2) / B."""
    torch.manual_seed(0)
    model = nn.Linear(400, 100)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.zeros(0, 400), torch.zeros(0, dtype=torch.long)
    sigma, clip, expected_batch, lr = 1.3, 2.0, 8.0, 1.0
    algo = algorithm_class("dpsgd")(model, TensorTask(x, y), SGD_CFG, lr, privacy(sigma, clip, expected_batch))
    result = algo.train_step([(x, y)], 0)
    assert result.batch_size == 0
    noise = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]).double()
    std = sigma * clip / expected_batch
    n = noise.numel()
    chi2 = float((noise / std).pow(2).sum())
    assert abs(chi2 - n) < 5 * math.sqrt(2 * n), f"chi-square {chi2} for {n} degrees of freedom"
    assert abs(float(noise.mean())) < 5 * std / math.sqrt(n)


def test_noise_does_not_depend_on_the_seed():
    torch.manual_seed(0)
    first = GaussianNoise("cpu").sample((1000,), 1.0)
    torch.manual_seed(0)
    second = GaussianNoise("cpu").sample((1000,), 1.0)
    assert not torch.allclose(first, second)


def test_secure_noise_has_the_stated_std():
    noise = GaussianNoise("cpu", secure=True).sample((200_000,), 0.7).double()
    assert abs(float(noise.std()) - 0.7) < 0.01


POINTS = [  # (sigma, q, steps, delta)
    (1.0, 0.00512, 5859, 1e-5),
    (0.8, 0.0152, 197, 7.4e-6),
    (0.5, 0.01, 1000, 1e-5),
    (3.0, 0.1, 512, 1e-6),
]


def dpa_event(sigma, q, steps):
    import dp_accounting as dpa

    return dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), steps)


def ledger(sigma, q, steps):
    book = Ledger()
    book.add(GaussianMechanism(sigma, q), steps)
    return book


@pytest.mark.parametrize("sigma,q,steps,delta", POINTS)
def test_rdp_and_pld_match_google_dp_accounting(sigma, q, steps, delta):
    import dp_accounting as dpa

    rdp_ref = dpa.rdp.RdpAccountant().compose(dpa_event(sigma, q, steps)).get_epsilon(delta)
    pld_ref = dpa.pld.PLDAccountant(value_discretization_interval=1e-4).compose(dpa_event(sigma, q, steps)).get_epsilon(delta)
    assert RDPAccountant().epsilon(ledger(sigma, q, steps), delta) == pytest.approx(rdp_ref, rel=5e-3)
    assert PLDAccountant().epsilon(ledger(sigma, q, steps), delta) == pytest.approx(pld_ref, rel=2e-2)
    prv = PRVAccountant().epsilon(ledger(sigma, q, steps), delta)
    assert prv == pytest.approx(pld_ref, rel=2e-2)
    assert prv <= RDPAccountant().epsilon(ledger(sigma, q, steps), delta)  # RDP is the looser bound


def test_known_value_from_jax_privacy_doctest():
    assert PLDAccountant(1e-4).epsilon(ledger(3.0, 0.1, 512), 1e-6) == pytest.approx(3.77, abs=0.01)


def test_heterogeneous_ledger_composes_like_dp_accounting():
    import dp_accounting as dpa

    book = Ledger()
    book.add(GaussianMechanism(1.0, 0.01), 300)
    book.add(GaussianMechanism(2.0, 0.02), 100)
    event = dpa.ComposedDpEvent([dpa_event(1.0, 0.01, 300), dpa_event(2.0, 0.02, 100)])
    reference = dpa.rdp.RdpAccountant().compose(event).get_epsilon(1e-5)
    assert RDPAccountant().epsilon(book, 1e-5) == pytest.approx(reference, rel=5e-3)
    with pytest.raises(Exception, match="gdp accountant"):
        GDPAccountant().epsilon(book, 1e-5)


@pytest.mark.parametrize("accountant", [RDPAccountant(), pytest.param(PLDAccountant(), marks=pytest.mark.slow)])  # PLD: seconds
@pytest.mark.parametrize("target", [1.0, 8.0])
def test_calibrated_sigma_is_tight_and_agrees_with_dp_accounting(accountant, target):
    import dp_accounting as dpa

    q, steps, delta = 0.00512, 2000, 1e-5
    sigma = calibrate_noise_multiplier(accountant, lambda s: ledger(s, q, steps), target, delta)
    eps = accountant.epsilon(ledger(sigma, q, steps), delta)
    assert target - 0.01 <= eps <= target
    make = dpa.rdp.RdpAccountant if accountant.name == "rdp" else (lambda: dpa.pld.PLDAccountant(value_discretization_interval=1e-3))
    reference = dpa.calibrate_dp_mechanism(
        make, lambda s: dpa_event(s, q, steps), target, delta,
        bracket_interval=dpa.ExplicitBracketInterval(0.3, 50.0),
    )
    assert sigma == pytest.approx(reference, rel=1e-2)


def test_unreachable_target_is_a_user_error():
    from dpbench.errors import UserError

    with pytest.raises(UserError, match="no noise multiplier reaches"):
        calibrate_noise_multiplier(RDPAccountant(), lambda s: ledger(s, 1.0, 10_000), 1e-6, 1e-5)


def test_poisson_batch_sizes_have_binomial_mean_and_variance():
    n, q, draws = 1000, 0.1, 3000
    batches = iter(PoissonBatches(n, q))
    sizes = np.array([len(next(batches)) for _ in range(draws)])
    mean, var = q * n, q * (1 - q) * n
    assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / draws)
    assert abs(sizes.var() / var - 1) < 5 * math.sqrt(2 / draws)


@pytest.mark.slow  # a run (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_zero_size_poisson_batches_are_possible_and_handled(tiny_cfg, tmp_path):
    from dpbench.run import run_job

    # q = 1/256: most Poisson batches are empty; the run must still finish and account every step.
    results = run_job(tiny_cfg("algo=dpadam", "train.batch_size=1", "train.steps=10"), tmp_path, show_progress=False)
    assert results.privacy.steps == 10
    assert sum(r["count"] for r in results.privacy.ledger) == 10


def test_a_release_halts_on_any_non_finite_entry_and_not_on_large_finite_ones():
    """The finiteness check reads each tensor's sum: a non-finite entry makes it non-finite, and a
    sum that overflowed from finite entries is checked entry by entry, not halted on."""
    from dpbench.privacy.release import _halt_unless_finite
    from dpbench.errors import DivergedError

    _halt_unless_finite("gradient", [[torch.full((3,), 3e38), torch.zeros(2)]])  # its sum overflows
    _halt_unless_finite("gradient", [])
    for bad in ([float("inf")], [float("-inf")], [float("nan")], [float("inf"), float("-inf")]):
        value = torch.zeros(5)
        value[: len(bad)] = torch.tensor(bad)
        with pytest.raises(DivergedError, match="not finite"):
            _halt_unless_finite("gradient", [[torch.ones(2)], [torch.full((3,), 3e38), value.to(torch.bfloat16)]])
