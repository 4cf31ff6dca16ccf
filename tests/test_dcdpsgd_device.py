"""DC-DPSGD's score subspace: drawn on the model's device once per step, and built in blocks of
rows when d_id x k is too large to hold (every point of the preset grids runs)."""

from __future__ import annotations

import pytest
import torch
from helpers.algorithms import build_algorithm
from helpers.config import compose

from dpbench.algorithms import dcdpsgd
from dpbench.algorithms.dcdpsgd import BlockBasis, SubWeibullSubspaces, subspace_scores
from dpbench.run import setup


def test_block_basis_is_the_orthonormal_basis_of_the_same_draw():
    subspaces = SubWeibullSubspaces(300, 20, 2.0, torch.Generator().manual_seed(0), max_elements=1000)
    assert subspaces.blocks == 6 and subspaces.basis.shape == (50, 20)  # one block of rows held at a time
    basis = subspaces.draw()
    assert isinstance(basis, BlockBasis)
    dense = basis.dense()
    assert torch.allclose(dense.T @ dense, torch.eye(20), atol=1e-5)
    raw = torch.cat([subspaces.block(basis.seed, i).clone() for i in range(subspaces.blocks)])
    reference = torch.linalg.qr(raw)[0]  # Householder QR of the whole draw: the same span
    grads = torch.randn(16, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 16)[:, None]
    scores = subspace_scores(grads, basis)
    assert scores.dtype == torch.float32 and scores.min() >= 0 and scores.max() <= 1
    assert torch.allclose(scores, subspace_scores(grads, reference), atol=1e-5)
    assert not torch.allclose(basis.dense(), subspaces.draw().dense())  # a fresh subspace every draw


def test_dense_basis_scores_are_those_of_the_orthonormal_basis_of_the_same_draw():
    subspaces = SubWeibullSubspaces(300, 20, 2.0, torch.Generator().manual_seed(0))
    basis = subspaces.draw()
    reference = torch.linalg.qr(basis.raw.clone())[0]
    assert torch.allclose(basis.dense().T @ basis.dense(), torch.eye(20), atol=1e-5)
    grads = torch.randn(16, 300, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 16)[:, None]
    assert torch.allclose(subspace_scores(grads, basis), subspace_scores(grads, reference), atol=1e-5)
    draws = torch.stack([SubWeibullSubspaces(1, 1, 1.0, torch.Generator().manual_seed(i)).draw().raw[0, 0] for i in range(2000)])
    assert abs(draws.mean()) < 0.15 and draws.abs().mean().item() == pytest.approx(1.0, rel=0.1)  # Laplace(0, 1) at theta 1


def test_subspace_and_its_generator_live_on_the_models_device_and_are_drawn_once_per_step(monkeypatch):
    algorithm, task, _ = build_algorithm("dcdpsgd", "algo.subspace_dim=8")
    device = algorithm.params[0].device
    assert algorithm.projection_generator.device == device and algorithm.subspaces.basis.device == device
    draws = []
    draw = algorithm.subspaces.draw
    monkeypatch.setattr(algorithm.subspaces, "draw", lambda: draws.append(1) or draw())
    algorithm.train_step([task.batch(list(range(8))), task.batch(list(range(8, 16)))], 0)  # two physical chunks
    assert len(draws) == 1


@pytest.mark.parametrize("k", [150, 200])
def test_dcdpsgd_t3_points_beyond_the_projection_limit_run(k):
    """cnn5 at 32x32x3 (357k parameters scored) with k = 150 and 200 refused before; now in blocks."""
    cfg = compose(["experiment=dcdpsgd_t3", f"algo.subspace_dim={k}", "dataset=synthetic", "dataset.channels=3",
                   "dataset.image_size=32", "dataset.num_classes=10", "dataset.train_size=64", "dataset.test_size=8",
                   "logger=none", "device=cpu", "train.batch_size=4", "train.steps=2", "privacy.noise_multiplier=1.0",
                   "algo.score_noise_multiplier=1.0"])
    job = setup(cfg)
    algorithm = job.algorithm
    assert algorithm.subspaces.blocks > 1
    assert algorithm.subspaces.basis.numel() <= dcdpsgd.MAX_PROJECTION_ELEMENTS
    assert algorithm.extra_results()["score_subspace_blocks"] == algorithm.subspaces.blocks
    if k == 200:  # one step (two physical chunks) of the paper's default k
        result = algorithm.train_step([job.task.batch([0, 1]), job.task.batch([2, 3])], 0)
        assert result.batch_size == 4 and algorithm.last_tail.shape == (4,)


def test_block_subspaces_follow_the_generator_state():
    """The public subspace is reproducible from the checkpointed generator state."""
    first = SubWeibullSubspaces(120, 10, 2.0, torch.Generator().manual_seed(3), max_elements=400)
    state = first.generator.get_state()
    one = first.draw().dense()
    first.generator.set_state(state)
    assert torch.equal(one, first.draw().dense())
