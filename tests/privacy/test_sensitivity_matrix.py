"""The sensitivity test matrix: every private algorithm × `algo.per_sample` engine × precision.

Neighbouring logical batches of 512 and 513 examples (the 513th an adversary's, its loss scaled so
its gradient is far above any clip bound), one step, noise off: every released quantity moves by
at most 1.0001 × the sensitivity its release declares to the ledger, or the combination is
refused before training with one line. Low precision is where this used to fail: ghost clipping
summed the clipped gradients in bf16, and one added example moved the sum by 2·C.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.projected import TensorTask
from helpers.config import OFFLINE, compose

from dpbench.algorithms import algorithm_class
from dpbench.errors import UserError
from dpbench.precision import Precision
from dpbench.privacy.plan import PrivacySetup

from dpbench.models.vit import DPViT

PRIVATE = ["dcdpsgd", "diff", "diff2", "dpadam", "dpdr", "dpgd0th", "dplora", "dpsgd", "dpzero", "galore_naive", "grape"]
ENGINES = {"dpadam": ["materialize", "ghost", "bk"], "dpsgd": ["materialize", "ghost", "bk"], "grape": ["materialize", "ghost", "bk"],
           "dcdpsgd": ["materialize", "rank"]}  # rank: DC-DPSGD's paper rule (default: threshold), materialize only
PRECISIONS = ["fp32", "bf16", "fp16"]
BATCH = 512


class ZeroNoise:
    def __init__(self):
        self.device = torch.device("cpu")

    def sample(self, shape, std, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype)


def tiny_vit():
    torch.manual_seed(0)
    return DPViT(img_size=4, patch_size=2, in_chans=1, num_classes=3, embed_dim=8, depth=1, num_heads=2,
                 mlp_ratio=2.0, global_pool="token")


def neighbouring_tasks(adversary_weight: float = 300.0, batch: int = BATCH):
    """The same 512 examples, and those plus an adversary's (its loss × 300: far above the clip
    bound, yet no fp16 overflow; or a non-finite one). Every example is
    clipped (loss × 100) and they share a label, so their clipped gradients align and the sum is
    ~B·C: the size at which a low-precision sum's rounding exceeds C."""
    g = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(batch + 1, 1, 4, 4, generator=g), torch.zeros(batch + 1, dtype=torch.long)
    weights = torch.full((batch + 1,), 100.0)
    weights[-1] = adversary_weight
    return TensorTask(inputs, labels, weights)


@functools.cache
def algo_config(name, engine):
    overrides = [f"algo.per_sample={engine}"] if engine in ("ghost", "bk") or name in ("dpadam", "dpsgd", "grape") else []
    overrides += ["algo.tail_selection=rank"] if engine == "rank" else []  # DC-DPSGD's paper rule
    overrides += ["algo.target_modules=[qkv,fc1]"] if name == "dplora" else []
    return compose([*OFFLINE, f"algo={name}", "dataset=synthetic", *overrides])


def released(name, engine, precision, examples, task):
    """The noiseless releases of one step on the first `examples`: {release: [(values, sensitivity)]}."""
    cfg = algo_config(name, engine)
    cls = algorithm_class(name)
    setup = PrivacySetup(noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=float(BATCH),
                         sample_rate=0.5, noise=ZeroNoise())
    return step_releases(cls(tiny_vit(), task, cfg.algo, 1e-3, setup), precision, task, examples)


def step_releases(algorithm, precision, task, examples):
    """One step of `algorithm` on the task's first `examples`: {release: [(values, sensitivity)]}."""
    algorithm.use_precision(Precision(precision, "cpu"))
    seen = {}

    def observe(release, parts, noisy, mechanism):
        seen[release] = [(torch.cat([v.detach().double().flatten() for v in part.values]), part.sensitivity) for part in parts]

    algorithm.release_observer = observe
    algorithm.train_step([task.batch(list(range(examples)))], 0)
    return seen


def combinations():
    for name in PRIVATE:
        for engine in ENGINES.get(name, ["materialize"]):
            for precision in PRECISIONS:
                yield pytest.param(name, engine, precision, id=f"{name}-{engine}-{precision}")


@pytest.mark.parametrize("name,engine,precision", list(combinations()))
def test_one_added_example_moves_each_release_by_at_most_its_sensitivity(name, engine, precision):
    assert_bounded(name, engine, precision, neighbouring_tasks(), bound=1.0001)


@pytest.mark.parametrize("name,engine,precision", list(combinations()))
def test_a_non_finite_example_is_dropped_not_halted_on(name, engine, precision):
    """Its clip factor is 0 in every engine and precision: the release does not move (a halt
    would tell whether, and when, the example was sampled). A release that counts examples
    (DC-DPSGD's score histogram) still counts it, within its sensitivity."""
    assert_bounded(name, engine, precision, neighbouring_tasks(float("inf"), batch=32), bound=1e-4,
                   counting_bound=1.0001)


# DC-DPSGD's score release (rank mode: per-example scores) and, in threshold mode, the score
# histogram released with the gradient: (release, part) that count the batch's examples
COUNTING_PARTS = {("scores", 0), ("scores_and_gradient", 0)}


def assert_bounded(name, engine, precision, task, bound, counting_bound=None):
    cls = algorithm_class(name)
    try:
        without = released(name, engine, precision, task.train_size - 1, task)
    except UserError as refused:  # refused before training, with one line
        assert "\n" not in str(refused) and "train.precision" in str(refused), refused
        assert (precision == "fp16" and engine != "materialize") or (precision != "fp32" and not cls.autocast_forward), refused
        return
    with_adversary = released(name, engine, precision, task.train_size, task)
    assert without and set(without) == set(with_adversary)
    for release, parts in without.items():
        for k, ((a, sensitivity), (b, _)) in enumerate(zip(parts, with_adversary[release])):
            if b.numel() == a.numel() + 1:  # a per-example release (DC-DPSGD's scores): the adversary's own entry
                a = torch.cat([a, a.new_zeros(1)])
            moved = (a - b).norm().item()
            limit = counting_bound if counting_bound is not None and (release, k) in COUNTING_PARTS else bound
            assert moved <= limit * sensitivity, f"{release}: moved {moved / sensitivity:.4f}× its sensitivity"


@pytest.mark.parametrize("engine", ["materialize", "ghost", "bk"])
def test_automatic_clipping_moves_the_release_by_c_in_every_engine(engine):
    """privacy.clipping=automatic (Auto-S: factor C / (|g| + gamma)) at C = 0.5: the adversary's
    contribution has norm C |g| / (|g| + gamma), just under C, so one added example moves the sum
    by at most C and, its gradient being large, by nearly C: the bound is C, not 1 or C / gamma."""
    clip = 0.5
    sensitivity, moved = release_moved_by_the_adversary("dpadam", engine, clip, clipping="automatic", clipping_gamma=0.01)
    assert sensitivity == clip
    assert 0.99 * clip <= moved <= 1.0001 * clip


def release_moved_by_the_adversary(algo: str, engine: str, clip: float, **clipping) -> tuple[float, float]:
    """(stated sensitivity, how far the gradient release moves) when `algo` on `engine`, clipping at
    `clip` with `clipping` (PrivacySetup's options), steps with and without the adversarial example."""
    task = neighbouring_tasks()

    def release(examples):
        setup = PrivacySetup(noise_multiplier=1.0, clip_norm=clip, expected_batch_size=float(BATCH), sample_rate=0.5,
                             noise=ZeroNoise(), **clipping)
        algorithm = algorithm_class(algo)(tiny_vit(), task, algo_config(algo, engine).algo, 1e-3, setup)
        return step_releases(algorithm, "fp32", task, examples)["gradient"]

    (without, sensitivity), = release(task.train_size - 1)
    (with_adversary, _), = release(task.train_size)
    return sensitivity, (with_adversary - without).norm().item()


@pytest.mark.parametrize("engine", ["materialize", "ghost", "bk"])
def test_per_layer_clipping_moves_the_release_by_at_most_c_in_every_engine(engine):
    """privacy.clipping=per_layer at C = 0.5 (thresholds from the initial weights' norms): the
    adversary's parts are clipped to C_l each, Σ_l C_l² = C², so one added example moves the sum
    by at most C, and, its gradient being large in every layer, by nearly C."""
    clip = 0.5
    sensitivity, moved = release_moved_by_the_adversary("dpsgd", engine, clip, clipping="per_layer",
                                                        per_layer_thresholds="init_norm")
    assert sensitivity == clip
    assert 0.9 * clip <= moved <= 1.0001 * clip
