"""Tasks: a dataset, the per-sample loss and the evaluation metric, per task kind.

The one primitive every algorithm uses is `per_sample_loss(model, batch) -> Tensor[B]`:
first-order algorithms backpropagate it, zeroth-order ones difference it under perturbation.
"""

from __future__ import annotations

import torch

from dpbench.tasks.base import TASKS, Batch, Task

__all__ = ["TASKS", "Batch", "Task", "build_task"]


def build_task(cfg, device: torch.device) -> Task:
    kind = cfg.dataset.get("task", "image_classification")
    if kind == "language":  # the model's family record says which: RoBERTa -> prompt_mlm, OPT -> causal_lm
        from dpbench.tasks.language import language_task_kind

        kind = language_task_kind(cfg)
    return TASKS.get(kind)(cfg, device)
