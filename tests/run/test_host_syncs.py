"""A training step makes a bounded number of host syncs, independent of the model's depth: on a
GPU each `.item()` / `bool(t)` / `float(t)` stalls the kernel queue (1,200 a step for OPT-1.3B
before this was bounded). Counted on the CPU through dpbench.runtime.host_syncs."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers.projected import TensorTask
from helpers.config import OFFLINE, compose

from dpbench.algorithms import algorithm_class
from dpbench.runtime.host_syncs import count_host_syncs
from dpbench.models.vit import DPViT
from dpbench.precision import Precision
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.plan import PrivacySetup

ENGINES = ("materialize", "ghost", "bk")
WITH_ENGINES = ("dpadam", "dpsgd", "grape")
ALGORITHMS = ["adam", "sgd", "galore", "lora", "mezo", "dcdpsgd", "diff", "diff2", "dpadam", "dpdr", "dpgd0th",
              "dplora", "dpsgd", "dpzero", "galore_naive", "grape"]


def vit(depth):
    torch.manual_seed(0)
    return DPViT(img_size=4, patch_size=2, in_chans=1, num_classes=3, embed_dim=8, depth=depth, num_heads=2,
                 mlp_ratio=2.0, global_pool="token")


@functools.cache
def config(name, engine):
    overrides = [f"algo.per_sample={engine}"] if name in WITH_ENGINES else []
    overrides += ["algo.target_modules=[qkv,fc1]"] if name in ("dplora", "lora") else []
    return compose([*OFFLINE, f"algo={name}", "dataset=synthetic", *overrides])


def syncs_per_step(name, engine, depth, precision="fp32"):
    g = torch.Generator().manual_seed(0)
    task = TensorTask(torch.randn(16, 1, 4, 4, generator=g), torch.randint(0, 3, (16,), generator=g))
    cls = algorithm_class(name)
    setup = PrivacySetup(noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=8.0, sample_rate=0.5,
                         noise=GaussianNoise()) if cls.private else None
    algorithm = cls(vit(depth), task, config(name, engine).algo, 1e-3, setup)
    algorithm.use_precision(Precision(precision, "cpu"))
    chunks = [task.batch(range(0, 5)), task.batch(range(5, 11))]
    algorithm.train_step(chunks, 0)  # the first step may check once (e.g. the engines' coverage check)
    counts = []
    for step in (1, 2):
        with count_host_syncs() as syncs:
            algorithm.train_step(chunks, step)
        counts.append(syncs.count)
    return max(counts)


def combinations():
    for name in ALGORITHMS:
        for engine in ENGINES if name in WITH_ENGINES else ("materialize",):
            yield pytest.param(name, engine, id=f"{name}-{engine}")


@pytest.mark.parametrize("name,engine", list(combinations()))
def test_host_syncs_per_step_do_not_grow_with_depth(name, engine):
    shallow, deep = syncs_per_step(name, engine, depth=1), syncs_per_step(name, engine, depth=4)
    assert deep == shallow, f"{shallow} host syncs a step at depth 1, {deep} at depth 4"
    assert shallow <= 12


def test_the_counter_counts_and_restores():
    t = torch.ones(3)
    with count_host_syncs() as syncs:
        t.sum().item(), bool(t.all()), float(t[0]), t.tolist()
    assert syncs.count == 4
    with count_host_syncs() as syncs:
        pass
    t.sum().item()
    assert syncs.count == 0
