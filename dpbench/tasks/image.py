"""Image classification: cross-entropy per example, accuracy on the held-out split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpbench.data import load_dataset
from dpbench.models import DataSpec
from dpbench.tasks import TASKS, Task


@TASKS.register("image_classification")
class ImageClassificationTask(Task):
    def __init__(self, cfg, device: torch.device, eval_batch_size: int = 1024):
        self.data = load_dataset(cfg.dataset, cfg.seed)
        self.device = device
        self.train_size = len(self.data.train_labels)
        self.eval_batch_size = eval_batch_size

    def model_spec(self) -> DataSpec:
        return DataSpec(
            num_classes=self.data.num_classes,
            channels=self.data.channels,
            image_size=self.data.image_size,
            patch_size=self.data.patch_size,
        )

    def batch(self, indices: list[int]):
        index = torch.as_tensor(indices, dtype=torch.long)
        return (
            self.data.train_images[index].to(self.device, non_blocking=True),
            self.data.train_labels[index].to(self.device, non_blocking=True),
        )

    def batch_size(self, batch) -> int:
        return int(batch[1].shape[0])

    def per_sample_loss(self, model: nn.Module, batch) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(model(images), labels, reduction="none")

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        was_training = model.training
        model.eval()
        correct, loss, n = 0, 0.0, len(self.data.test_labels)
        for start in range(0, n, self.eval_batch_size):
            images = self.data.test_images[start : start + self.eval_batch_size].to(self.device)
            labels = self.data.test_labels[start : start + self.eval_batch_size].to(self.device)
            logits = model(images)
            loss += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == labels).sum().item()
        model.train(was_training)
        return {"accuracy": correct / n, "loss": loss / n}
