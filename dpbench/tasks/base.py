"""The Task interface and the task registry (`dataset.task`), apart from the package's __init__ so
that task modules import them without importing the package that dispatches to them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dpbench.registry import Registry

if TYPE_CHECKING:
    from dpbench.data.validation import ValidationSplit

Batch = Any  # whatever the task's batches are; algorithms only hand them back to the task


class Task(ABC):
    train_size: int  # training examples `batch` indexes (with a validation split: the realised training part)
    # dataset.validation_fraction > 0: the split of the loaded training set (dpbench/data/validation.py)
    split: "ValidationSplit | None" = None

    @property
    def planning_size(self) -> int:
        """The public training-set size q = B / n, B and T are planned with: n (1 - f) rounded half
        up with a validation split (never the realised part's size), else `train_size`."""
        return self.split.planned_train_size if self.split is not None else self.train_size

    def validation_scores(self, model: nn.Module) -> torch.Tensor:
        """Per-example score in [0, 1] of each validation example, shape [n_val] (1: correct; generation:
        its F1): the private validation score sums them, so one example moves the sum by at most 1."""
        raise NotImplementedError(f"{type(self).__name__} has no per-example validation score")

    @abstractmethod
    def batch(self, indices: list[int]) -> Batch:
        """The training examples at these indices, on the task's device."""

    @abstractmethod
    def batch_size(self, batch: Batch) -> int: ...

    @abstractmethod
    def per_sample_loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Loss of each example, shape [B]."""

    @abstractmethod
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Test metrics; must contain 'accuracy' (the headline metric)."""

    metric_name = "accuracy"  # what evaluate()'s 'accuracy' holds (e.g. "f1" for generation)
    higher_is_better = True  # whether a larger headline metric is better (best_test_accuracy)

    def model_spec(self):
        """What the model builder needs (input shape, classes)."""
        raise NotImplementedError

    def set_step(self, step: int) -> None:
        """The training step about to run (`Algorithm.train_step` tells every task; a loss that
        changes over training, like LDAM-DRW's deferred re-weighting, reads it)."""

    def build_model(self, model_cfg) -> nn.Module:
        """The model for this task: the `model` group's builder, given `model_spec()`. Tasks whose
        model depends on them (a language model needs the task's tokenizer) override it."""
        from dpbench.models import build_model
        from dpbench.models.user import build_user_model, names_builder

        if names_builder(model_cfg):  # a user's builder by import path (model.builder)
            return build_user_model(model_cfg, self.model_spec())
        return build_model(model_cfg, self.model_spec())


# Every module of this package registers on the first lookup; they import transformers only when
# a language task is built (see dpbench/registry.py).
TASKS: Registry[type[Task]] = Registry("task", package="dpbench.tasks")
