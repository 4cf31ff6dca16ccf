"""A non-finite training record (a NaN or inf the data holds) never halts a run and changes no release.

For every private algorithm in the registry, at every kind of step it runs (DPDR's DP-SGD and
decomposition steps, DIFF's and DIFF2's difference steps, DC-DPSGD's threshold and rank rules, the
per-example engines), one step on a batch plus a non-finite record completes and releases what the
same step releases without it (noise off), and its mean training loss is the clean batch's. The
record is dropped with a select, not multiplied by its clip factor 0 (0 · NaN is NaN: that halted
DPDR at its first decomposition step). End to end, a DPDR run on digits with a NaN training image
completes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import pytest
import torch
from helpers.cli import dpbench_in_process
from helpers.config import FIXED_SIGMA, OFFLINE, compose
from helpers.projected import TensorTask

from dpbench.algorithms import ALGORITHMS
from dpbench.models.vit import DPViT
from dpbench.privacy.plan import PrivacySetup

BATCH = 8  # clean examples; the record is example BATCH
PRIVATE = [name for name in ALGORITHMS.names() if ALGORITHMS.get(name).private]

# name -> {variant: (overrides, steps)}: the steps cover every kind of step the algorithm runs
VARIANTS = {
    "dpdr": {"": (["algo.decomposition_steps=2"], 3)},  # DP-SGD, decomposition, DP-SGD
    "diff": {"": ([], 2)},  # DP-SGD, then a difference step
    "diff2": {"": (["algo.restart_interval=2"], 2)},  # restart, then a difference step
    "dcdpsgd": {"threshold": (["algo.subspace_dim=4"], 2),  # step 1 clips at a finite tau
                "rank": (["algo.subspace_dim=4", "algo.tail_selection=rank"], 1)},
    "dplora": {"": (["algo.target_modules=[qkv,fc1]"], 1)},
    # the per-example engines (every first-order algorithm clips through one of them)
    "dpsgd": {engine: ([f"algo.per_sample={engine}"], 1) for engine in ("materialize", "ghost", "bk")},
}
RECORDS = ("nan", "inf")  # a NaN image; an image with one +inf pixel
# DC-DPSGD's score releases (a per-example vector in rank mode, a histogram in threshold mode) still
# count the record: dpbench/algorithms/dcdpsgd.py scores it 0 instead of leaving it out (see below)
SCORE_PARTS = {("scores", 0), ("scores_and_gradient", 0)}


class ZeroNoise:
    device = torch.device("cpu")

    def sample(self, shape, std, dtype=torch.float32):
        return torch.zeros(shape, dtype=dtype)


def tiny_vit():
    torch.manual_seed(0)  # the same model, and the same public seeds the algorithm draws after it
    return DPViT(img_size=4, patch_size=2, in_chans=1, num_classes=3, embed_dim=8, depth=1, num_heads=2,
                 mlp_ratio=2.0, global_pool="token")


def records_task() -> TensorTask:
    """BATCH clean examples, then one record of each kind in RECORDS (examples BATCH, BATCH + 1)."""
    g = torch.Generator().manual_seed(0)
    n = BATCH + len(RECORDS)
    inputs, labels = torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    inputs[BATCH] = float("nan")
    inputs[BATCH + 1, 0, 1, 2] = float("inf")
    return TensorTask(inputs, labels, torch.full((n,), 10.0))  # loss x 10: every example is clipped


@functools.cache
def algo_config(name, overrides):
    return compose([*OFFLINE, f"algo={name}", "dataset=synthetic", *overrides]).algo


def build(name, overrides, task):
    setup = PrivacySetup(noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=float(BATCH), sample_rate=0.5,
                         noise=ZeroNoise())
    algorithm = ALGORITHMS.get(name)(tiny_vit(), task, algo_config(name, tuple(overrides)), 1e-2, setup)
    seen = []
    algorithm.release_observer = lambda release, parts, noisy, mechanism: seen.append((release, [
        (torch.cat([v.detach().double().flatten() for v in values]), part.sensitivity) for part, values in zip(parts, noisy)]))
    return algorithm, seen


def run(name, overrides, steps, task, examples):
    """`steps` steps, each on the logical batch `examples`: ([(release, parts)] per step, results, algorithm)."""
    algorithm, seen = build(name, overrides, task)
    releases, results = [], []
    for step in range(steps):
        seen.clear()
        results.append(algorithm.train_step([task.batch(examples)], step))
        releases.append(list(seen))
    return releases, results, algorithm


def cases():
    for name in PRIVATE:
        for variant, (overrides, steps) in VARIANTS.get(name, {"": ([], 1)}).items():
            yield pytest.param(name, tuple(overrides), steps, id="-".join(filter(None, [name, variant])))


@pytest.mark.parametrize("name,overrides,steps", list(cases()))
def test_a_non_finite_record_completes_every_step_and_changes_no_release(name, overrides, steps):
    """A run on the batch plus the record beside one on the batch alone, step by step."""
    task = records_task()
    clean, clean_results, _ = run(name, overrides, steps, task, list(range(BATCH)))
    for offset, record in enumerate(RECORDS):
        releases, results, algorithm = run(name, overrides, steps, task, [*range(BATCH), BATCH + offset])
        for step, (without, with_record) in enumerate(zip(clean, releases)):
            where = f"{record} record, step {step}"
            assert without and [r for r, _ in without] == [r for r, _ in with_record], where
            for (release, parts), (_, moved_parts) in zip(without, with_record):
                for index, ((a, sensitivity), (b, _)) in enumerate(zip(parts, moved_parts)):
                    if name == "dcdpsgd" and (release, index) in SCORE_PARTS:
                        continue  # test_dcdpsgd_scores_leave_a_non_finite_record_out
                    assert torch.isfinite(b).all(), f"{where}: {release} not finite"
                    moved = (a - b).norm().item() / sensitivity
                    assert moved <= 1e-4, f"{where}: {release} moved {moved:.2e}x its sensitivity"
            # the loss statistics leave the record out: finite, and the clean batch's mean
            assert results[step].loss == pytest.approx(clean_results[step].loss, rel=1e-5), where
            assert results[step].batch_size == BATCH + 1, where  # the realised batch still counts it
        assert algorithm.unnoised_counters() == {"nonfinite_examples": steps}, record


@pytest.mark.parametrize("variant", ["threshold", "rank"])
def test_dcdpsgd_scores_leave_a_non_finite_record_out(variant):
    overrides, _ = VARIANTS["dcdpsgd"][variant]
    task = records_task()
    (without,), _, _ = run("dcdpsgd", tuple(overrides), 1, task, list(range(BATCH)))
    (with_record,), _, _ = run("dcdpsgd", tuple(overrides), 1, task, list(range(BATCH + 1)))
    for (release, parts), (_, moved_parts) in zip(without, with_record):
        for index, ((a, _), (b, _)) in enumerate(zip(parts, moved_parts)):
            if (release, index) in SCORE_PARTS:
                assert a.shape == b.shape and (a - b).norm().item() <= 1e-6, release


def test_a_dpdr_run_on_digits_with_a_nan_training_image_completes(tmp_path, monkeypatch):
    """The review's reproduction, shrunk: sample rate 1, so the NaN image is in every step's batch
    (step 0 DP-SGD, steps 1-2 decomposition), and the un-noised statistics on (the loss check on)."""
    from dpbench.data import DATASETS

    digits = DATASETS.get("digits")

    def poisoned(cfg, seed):
        data = digits(cfg, seed)
        train = data.train_images[:64].clone()
        train[0] = float("nan")
        return dataclasses.replace(data, train_images=train, train_labels=data.train_labels[:64])

    monkeypatch.setitem(DATASETS._entries, "digits", poisoned)
    run = tmp_path / "run"
    completed = dpbench_in_process("algo=dpdr", "dataset=digits", "logger=none", "device=cpu", *FIXED_SIGMA,
                                   "train.steps=3", "train.batch_size=64", "train.eval_every=3",
                                   "model.depth=1", "model.embed_dim=16", "model.num_heads=2",
                                   f"hydra.run.dir={run}", cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "completed" and results["privacy"]["steps"] == 3
    assert results["algorithm"]["nonfinite_examples"] == 3  # once a step
    assert math.isfinite(results["metrics"]["train_loss"])
