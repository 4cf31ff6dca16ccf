"""A training step makes a bounded number of host syncs, independent of the model's depth: on a
GPU each `.item()` / `bool(t)` / `float(t)` stalls the kernel queue (1,200 a step for OPT-1.3B
before this was bounded). Counted on the CPU through dpbench.runtime.host_syncs."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.projected import TensorTask
from helpers.config import OFFLINE, compose
from helpers.toy_algorithms import partial_toy  # noqa: F401 (a fixture)

from dpbench.algorithms import ALGORITHMS, algorithm_class
from dpbench.runtime.host_syncs import count_host_syncs
from dpbench.models import FAMILY_ATTRIBUTE
from dpbench.models.vit import DPViT
from dpbench.precision import Precision
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.plan import PrivacySetup

ENGINES = ("materialize", "ghost", "bk")


def engines(name: str) -> tuple[str, ...]:
    """Every engine for an algorithm whose options declare algo.per_sample, else its own."""
    options = ALGORITHMS.options(name)
    return ENGINES if "per_sample" in getattr(options, "__dataclass_fields__", {}) else ("materialize",)


def vit(depth):
    torch.manual_seed(0)
    model = DPViT(img_size=4, patch_size=2, in_chans=1, num_classes=3, embed_dim=8, depth=depth, num_heads=2,
                  mlp_ratio=2.0, global_pool="token")
    setattr(model, FAMILY_ATTRIBUTE, "vit")  # the family's defaults (LoRA's targets, the trained head) apply
    return model


def config(selection: tuple[str, ...], engine):
    overrides = [f"algo.per_sample={engine}"] if engine != "materialize" else []
    return compose([*OFFLINE, *selection, "dataset=synthetic", *overrides])


cached_config = functools.cache(config)


def syncs_per_step(name, engine, depth, precision="fp32", selection=None):
    g = torch.Generator().manual_seed(0)
    task = TensorTask(torch.randn(16, 1, 4, 4, generator=g), torch.randint(0, 3, (16,), generator=g))
    cls = algorithm_class(name)
    setup = PrivacySetup(noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=8.0, sample_rate=0.5,
                         noise=GaussianNoise()) if cls.private else None
    cfg = config(tuple(selection), engine) if selection else cached_config((f"algo={name}",), engine)
    algorithm = cls(vit(depth), task, cfg.algo, 1e-3, setup)
    algorithm.use_precision(Precision(precision, "cpu"))
    chunks = [task.batch(range(0, 5)), task.batch(range(5, 11))]
    algorithm.train_step(chunks, 0)  # the first step may check once (e.g. the engines' coverage check)
    counts = []
    for step in (1, 2):
        with count_host_syncs() as syncs:
            algorithm.train_step(chunks, step)
        counts.append(syncs.count)
    return max(counts)


def combinations() -> list[tuple[str, str]]:
    """Every registered algorithm, with every engine its options let it choose."""
    return [(name, engine) for name in ALGORITHMS.names() for engine in engines(name)]


def check_bounded(name, engine, selection=None):
    shallow, deep = (syncs_per_step(name, engine, depth, selection=selection) for depth in (1, 4))
    assert deep == shallow, f"{shallow} host syncs a step at depth 1, {deep} at depth 4"
    assert shallow <= 12


@pytest.mark.parametrize("name,engine", [pytest.param(*c, id="-".join(c)) for c in combinations()])
def test_host_syncs_per_step_do_not_grow_with_depth(name, engine):
    check_bounded(name, engine)


def test_a_newly_registered_algorithm_is_counted_with_no_list_to_edit(partial_toy):
    assert ("partial", "ghost") in combinations() and ("dpzero", "materialize") in combinations()
    check_bounded("partial", "materialize", selection=partial_toy)


def test_the_counter_counts_and_restores():
    t = torch.ones(3)
    with count_host_syncs() as syncs:
        t.sum().item(), bool(t.all()), float(t[0]), t.tolist()
    assert syncs.count == 4
    with count_host_syncs() as syncs:
        pass
    t.sum().item()
    assert syncs.count == 0
