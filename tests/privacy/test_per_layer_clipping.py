"""privacy.clipping=per_layer: each trainable parameter's part of an example's gradient clipped to
its own C_l (Σ_l C_l² = C², public thresholds), so the clipped sum's sensitivity is C; the same
norms, factors and sums in every engine (materialize, ghost, bk); refused where it does not apply."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.projected import TensorTask, algo_cfg
from torch import nn

from dpbench.algorithms import PrivacySetup, algorithm_class
from dpbench.models.vit import DPViT
from dpbench.errors import UserError
from dpbench.privacy.clipping import (
    layer_thresholds, per_layer_factors, per_sample_layer_norms,
)
from dpbench.privacy.engines import build_engine
from dpbench.privacy.noise import GaussianNoise

ENGINES = ["materialize", "ghost", "bk"]
CLIP = 0.5


def tiny_vit():
    """A ViT small enough for the fast tier (patch embedding, tokens, attention, MLP, norms, head)."""
    torch.manual_seed(0)
    return DPViT(img_size=4, patch_size=2, in_chans=1, num_classes=3, embed_dim=8, depth=1, num_heads=2,
                 mlp_ratio=2.0, global_pool="token")


def image_task(n=8, weights=None):
    g = torch.Generator().manual_seed(0)
    return TensorTask(torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g), weights)


def setup(clip=CLIP, thresholds="equal", clipping="per_layer"):
    return PrivacySetup(noise_multiplier=0.0, clip_norm=clip, expected_batch_size=8.0, sample_rate=0.1,
                        noise=GaussianNoise(), clipping=clipping, per_layer_thresholds=thresholds)


def build(name, model, task, engine, **privacy):
    return algorithm_class(name)(model, task, algo_cfg(name, per_sample=engine, **({"momentum": 0.0} if name == "dpsgd" else {})),
                                 1e-2, setup(**privacy))


def per_example_layer_grads(model, task, n):
    """Each example's gradient of each trainable parameter, autograd on the example alone in fp64: [n][L]."""
    model = model.double()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = []
    for i in range(n):
        x, y, w = task.batch([i])
        loss = task.per_sample_loss(model, (x.double(), y, w.double())).sum()
        grads.append([torch.zeros_like(p) if g is None else g
                      for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))])
    model.float()
    return grads


@pytest.mark.parametrize("rule", ["equal", "init_norm"])
def test_thresholds_square_sum_to_c_squared_from_public_weights(rule):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    nn.init.zeros_(model[0].bias)
    params = list(model.parameters())
    thresholds = layer_thresholds(params, 2.0, rule)
    total = thresholds.pow(2).sum().item()
    assert total <= 4.0 and total == pytest.approx(4.0, rel=1e-12)
    assert (thresholds > 0).all()  # a zero-initialised bias still learns
    if rule == "equal":
        assert torch.allclose(thresholds, torch.full((len(params),), 2.0 / math.sqrt(len(params)), dtype=torch.float64))
    else:
        norms = torch.tensor([p.detach().double().norm().item() for p in params], dtype=torch.float64)
        smallest = norms[norms > 0].min()
        expected = torch.where(norms > 0, norms, smallest)
        torch.testing.assert_close(thresholds, 2.0 * expected / expected.norm(), rtol=1e-12, atol=0)


def test_factors_clip_each_layer_to_its_threshold_and_drop_non_finite_examples():
    thresholds = torch.tensor([0.6, 0.8], dtype=torch.float64)  # C = 1
    norms = torch.tensor([[3.0, 0.1, float("nan"), 0.0], [0.2, 8.0, 1.0, 0.0]])
    factors = per_layer_factors(norms, thresholds)
    expected = torch.tensor([[0.6 / 3.0, 1.0, 0.0, 1.0], [1.0, 0.8 / 8.0, 0.0, 1.0]])
    torch.testing.assert_close(factors, expected, rtol=1e-6, atol=0)
    assert (factors.double() * norms.double().nan_to_num(0) <= thresholds.view(-1, 1)).all()  # rounded down


@pytest.mark.parametrize("engine", ENGINES)
def test_each_engine_hands_per_layer_norms_of_the_per_example_gradients(engine):
    """The [L, B] norms each engine hands the clip rule are each parameter's per-example gradient
    norm (autograd on one example), in the order of the engine's params, bounds at or above it."""
    task, model = image_task(), tiny_vit()
    reference = per_example_layer_grads(model, task, 6)
    expected = torch.tensor([[g.norm().item() for g in grads] for grads in reference], dtype=torch.float64).T  # [L, B]
    built = build_engine(engine, model, unprobed=True)
    seen = []

    def factors(norms):
        seen.append(norms.detach().double())
        return torch.ones_like(norms)

    try:
        for _ in range(2):  # the coverage-checking first call, then the steady path
            built.clipped_sum(task.per_sample_loss(model, task.batch(range(6))), factors, per_layer=True)
    finally:
        built.detach()
    for norms in seen:
        assert norms.shape == expected.shape
        torch.testing.assert_close(norms, expected, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("rule", ["equal", "init_norm"])
def test_clipped_sum_equals_the_hand_reference_in_every_engine(rule):
    """Σ_i Σ_l min(1, C_l / ‖g_il‖) g_il from per-example autograd gradients: the three engines agree
    with it (large and small examples, so some layers are clipped and some are not)."""
    task = image_task(weights=torch.tensor([1.0, 40.0] * 4))
    reference_grads = per_example_layer_grads(tiny_vit(), task, 8)
    thresholds = layer_thresholds([p for p in tiny_vit().parameters() if p.requires_grad], CLIP, rule)
    expected = [sum(min(1.0, thresholds[l].item() / (grads[l].norm().item() + 1e-6)) * grads[l]
                    for grads in reference_grads) for l in range(len(thresholds))]
    clipped = [factor < 1.0 for grads in reference_grads for factor in
               (thresholds[l].item() / grads[l].norm().item() for l in range(len(thresholds)))]
    assert any(clipped) and not all(clipped)
    for engine in ENGINES:
        algo = build("dpsgd", tiny_vit(), task, engine, thresholds=rule)
        torch.testing.assert_close(algo.layer_thresholds, thresholds)
        sums, _ = algo.clip_and_accumulate([task.batch(range(0, 5)), task.batch(range(5, 8))])
        for e, a in zip(expected, sums):
            torch.testing.assert_close(a.double(), e, rtol=1e-4, atol=1e-6 * CLIP)


@pytest.mark.parametrize("engine", ENGINES)
def test_grape_projected_sums_agree_across_engines(engine):
    """DP-GRAPE's layers are its engine's params, its weights' parts projected: the same sums in every engine."""
    task = image_task(weights=torch.tensor([1.0, 40.0] * 4))
    batches = [task.batch(range(0, 5)), task.batch(range(5, 8))]
    expected, _ = build("grape", tiny_vit(), task, "materialize").clip_and_accumulate(batches)
    actual, _ = build("grape", tiny_vit(), task, engine).clip_and_accumulate(batches)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_adversarial_example_contributes_at_most_c_rounding_included(engine):
    """One example whose every layer's gradient is far above its C_l (loss × 1e4): each layer's
    clipped part f_l g_l, in fp64 from the factors the engine used and the example's gradient
    (autograd in fp64: 1e-6 for its difference from the fp32 forward's), has norm ≤ C_l, and the
    concatenation ≤ C. The exact bound on materialised tensors: the next test."""
    task = image_task(n=2, weights=torch.tensor([1e4, 1e4]))
    model = tiny_vit()
    algo = build("dpsgd", model, task, engine)
    seen = []
    rule = algo.example_factors

    def observed(norms, *args, **kwargs):
        factors = rule(norms, *args, **kwargs)
        seen.append(factors.detach().double())
        return factors

    algo.example_factors = observed
    algo.clip_and_accumulate([task.batch([0])])
    (factors,) = seen
    grads = per_example_layer_grads(tiny_vit(), task, 1)[0]
    parts = torch.stack([factors[l, 0] * g.double().norm() for l, g in enumerate(grads)])
    assert (factors < 1).all()
    assert (parts <= algo.layer_thresholds * (1 + 1e-6)).all()
    assert parts.pow(2).sum().sqrt().item() <= CLIP * (1 + 1e-6)


def test_materialize_factors_bound_the_materialised_tensors_exactly():
    """materialize's per-layer norms bound the fp32 tensors it sums (fp64 norm of each), so that
    f_l ‖g_l‖ ≤ C_l exactly, for gradients at extreme scales (1e-20 .. 1e20, cancelling sizes)."""
    g = torch.Generator().manual_seed(0)
    per_sample = [torch.randn(5, 7, 3, generator=g) * scale for scale in (1e-20, 1.0, 3e5, 1e20)]
    per_sample.append(torch.full((5, 1000), 1.0 + 2.0**-23))  # a long sum of equal squares
    thresholds = layer_thresholds(per_sample, CLIP)
    factors = per_layer_factors(per_sample_layer_norms(per_sample), thresholds).double()
    exact = torch.stack([t.double().flatten(1).norm(dim=1) for t in per_sample])  # [L, B]
    parts = factors * exact
    assert (parts <= thresholds.view(-1, 1)).all()
    assert (parts.pow(2).sum(0) <= CLIP**2).all()


@pytest.mark.parametrize("name", ["dcdpsgd", "dpdr", "diff", "diff2", "dpzero"])
def test_algorithms_that_clip_their_own_quantities_refuse_it(name):
    task = image_task()
    cls = algorithm_class(name)
    with pytest.raises(UserError) as refused:
        cls(tiny_vit(), task, algo_cfg(name), 1e-2, setup())
    message = str(refused.value)
    assert "\n" not in message and "privacy.clipping=flat" in message and "{" not in message, message
    assert name == "dcdpsgd" or "algo=dpadam|dpadambc|dpbitfit|dplora|dpsgd|galore_naive|grape" in message, message


def test_the_declaration_is_stated_by_each_class():
    """A subclass does not inherit it unstated (DP-BiTFiT and DP-LoRA state it again)."""
    from dpbench.algorithms import ALGORITHMS

    takers = {n for n in ALGORITHMS.names() if ALGORITHMS.get(n).stated("per_layer_clipping")}
    assert takers == {"dpsgd", "dpadam", "dpadambc", "dpbitfit", "dplora", "grape", "galore_naive"}


def test_sharded_runs_refuse_it_in_one_line(monkeypatch):
    from helpers.config import compose

    from dpbench.algorithms import ALGORITHMS
    from dpbench.runtime import sharding

    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose(["logger=none", "algo=dpadam", "algo.per_sample=bk", "train.sharding=fsdp", "privacy.clipping=per_layer"])
    with pytest.raises(UserError, match="privacy.clipping=per_layer is not supported"):
        sharding.check_supported(cfg, ALGORITHMS)


@pytest.mark.slow  # a default job end to end and an audit (the slow tier)
def test_dpsgd_with_per_layer_clipping_learns_the_default_job_and_passes_the_audit(tmp_path):
    """`dpbench algo=dpsgd privacy.clipping=per_layer logger=none` beats chance (0.1 on digits) twice;
    it measured 0.75 (equal thresholds, materialize). Then `dpbench-audit` on it: the sensitivity
    measured is C (the other engines: tests/tools/audit/test_audit.py's variants)."""
    from helpers.config import OFFLINE, TINY, compose

    from dpbench.run import run_job
    from dpbench.tools.audit.runner import run_audit

    cfg = compose([*OFFLINE, "algo=dpsgd", "privacy.clipping=per_layer", "train.eval_every=0", "train.checkpoint=false"])
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.status == "completed"
    assert results.metrics.test_accuracy >= 0.2, results.metrics.test_accuracy
    (tmp_path / "audit").mkdir()
    report = run_audit(compose([*TINY, "audit.noise_steps=3", "audit.trials=3", "audit.alpha=1e-6", "algo=dpsgd",
                                "privacy.clipping=per_layer"]), tmp_path / "audit")
    assert report.passed, [c for c in report.checks if not c.passed]
