"""The compute a run spends training, in forward-pass equivalents: one example's forward is 1, its
backward 2 (the usual FLOP ratio of a backward to a forward), whatever the model. Wall time on
shared cores is noise; this count is not.

`ComputeTally` counts what runs, in the one place where per-example losses are formed
(`Algorithm.per_example_losses`): each forward of a chunk of b examples adds b forwards, and a
hook on its losses adds b backwards each time a backward runs through them, so a second backward
(ghost clipping's reweighted pass) counts again, and a recomputed chunk (DC-DPSGD's rank-mode pass 2 with
several physical chunks, DIFF2's gradients at the previous parameters) counts its forward and
backward again. Zeroth-order steps run forwards only (two per example). What is not a pass of the
model (book-keeping's norms from kept activations, DPZero's direction draws, the noise, the
optimizer) is not counted.

Each algorithm also declares what a step costs per example (`Algorithm.forward_equivalents_per_example`),
from its config alone (public): the plan `train.compute_budget` sets the steps from, and what a
run that withholds its measured counts (privacy.log_private_stats=false) reports;
tests/algorithms/test_compute.py holds every registered algorithm's declaration to its count.
"""

from __future__ import annotations

import math

import torch

FORWARD = 1.0  # one example's forward pass
BACKWARD = 2.0  # one example's backward pass: about twice a forward's arithmetic


class ComputeTally:
    """Forward and backward passes over examples, and the examples of the logical batches trained on."""

    def __init__(self) -> None:
        self.forwards = 0  # examples forwarded (a chunk of b examples: b)
        self.backwards = 0  # examples backpropagated (each backward through a chunk's losses: b)
        self.examples = 0  # examples of the logical batches the steps trained on, each once

    def forward(self, losses: torch.Tensor) -> torch.Tensor:
        """Count the forward that formed per-example `losses` [b], and every backward through them."""
        self.forwards += losses.shape[0]
        if losses.requires_grad:
            losses.register_hook(self._backward)
        return losses

    def _backward(self, grad: torch.Tensor) -> None:
        self.backwards += grad.shape[0]  # a shape, not a value: no host sync

    @property
    def forward_equivalents(self) -> float:
        return FORWARD * self.forwards + BACKWARD * self.backwards

    @property
    def per_example(self) -> float | None:
        return self.forward_equivalents / self.examples if self.examples else None

    def state(self) -> list[int]:
        return [self.forwards, self.backwards, self.examples]

    def load(self, state: list[int]) -> None:
        self.forwards, self.backwards, self.examples = (int(v) for v in state)


def planned_chunks(batch_size: int, physical_batch_size: int | None) -> int:
    """Physical chunks of a logical batch of the expected size (train.physical_batch_size null: one)."""
    return max(1, math.ceil(batch_size / physical_batch_size)) if physical_batch_size else 1


def steps_for_budget(budget: float, train_size: int, batch_size: int, per_example: float) -> int:
    """train.compute_budget (forward-pass equivalents per training example, e.g. 3 = one epoch of
    forward and backward) as steps of `batch_size` expected examples costing `per_example` each."""
    return max(1, round(budget * train_size / (per_example * batch_size)))
