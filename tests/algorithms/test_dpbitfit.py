"""DP-BiTFiT trains the biases and the head only, through DP-Adam's release."""

from __future__ import annotations

import pytest
import torch
from helpers.algorithms import build_algorithm

# the engine's backward hooks fire on a first layer whose inputs need no gradient: harmless
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def trained_names(algorithm) -> set[str]:
    return {name for name, p in algorithm.model.named_parameters() if p.requires_grad}


def test_only_the_biases_and_the_head_train_and_the_frozen_weights_stay():
    algorithm, task, _ = build_algorithm("dpbitfit", "algo.train_modules=['3']", sigma=1.0)
    assert trained_names(algorithm) == {"1.bias", "3.weight", "3.bias"}  # tiny_model: Flatten, Linear, Tanh, Linear
    assert {id(p) for p in algorithm.params} == {id(p) for p in algorithm.model.parameters() if p.requires_grad}
    before = {name: p.detach().clone() for name, p in algorithm.model.named_parameters()}
    algorithm.train_step([task.batch(range(8))], 0)
    after = dict(algorithm.model.named_parameters())
    assert torch.equal(after["1.weight"], before["1.weight"])
    assert all(not torch.equal(after[name], before[name]) for name in ("1.bias", "3.weight", "3.bias"))


def test_a_model_that_names_no_head_trains_its_biases_and_says_so():
    algorithm, _, _ = build_algorithm("dpbitfit")
    assert trained_names(algorithm) == {"1.bias", "3.bias"}
    assert any("only the biases train" in note for note in algorithm.run_notes)
