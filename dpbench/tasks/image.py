"""Image classification: a per-example loss (`dataset.loss`: cross_entropy | ldam), accuracy on
the held-out split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpbench.data import load_dataset
from dpbench.errors import UserError
from dpbench.models import DataSpec
from dpbench.tasks import TASKS, Task


@TASKS.register("image_classification")
class ImageClassificationTask(Task):
    margins: torch.Tensor | None = None  # LDAM class margins; None = plain cross-entropy

    def __init__(self, cfg, device: torch.device, eval_batch_size: int = 1024):
        self.data = load_dataset(cfg.dataset, cfg.seed)
        self.device = device
        self.train_size = len(self.data.train_labels)
        self.eval_batch_size = eval_batch_size
        loss_name = cfg.dataset.get("loss", "cross_entropy")
        if loss_name == "cross_entropy":
            self.margins = None
        elif loss_name == "ldam":
            # From the config's public class profile, never from the private labels: a margin
            # computed from label counts makes every example's loss depend on every other label.
            profile = public_class_profile(cfg.dataset, self.data.num_classes)
            self.margins = ldam_margins(profile, float(cfg.dataset.get("ldam_max_margin", 0.5))).to(device)
            self.ldam_scale = float(cfg.dataset.get("ldam_scale", 30.0))
        else:
            raise UserError(f"dataset.loss={loss_name!r} is not known; use cross_entropy or ldam")

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
        logits = model(images)
        if self.margins is None:
            return F.cross_entropy(logits, labels, reduction="none")
        # LDAM: subtract the true class's margin, scale, cross-entropy (Cao et al. 2019).
        shifted = logits - F.one_hot(labels, logits.shape[1]) * self.margins[labels][:, None]
        return F.cross_entropy(self.ldam_scale * shifted, labels, reduction="none")

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return self._accuracy_and_loss(model, self.data.test_images, self.data.test_labels)

    def train_metrics(self, model: nn.Module, size: int) -> dict[str, float]:
        """Accuracy and loss on the first `size` training examples (a fixed subset): un-noised
        statistics of the private data, reported only with privacy.log_private_stats."""
        return self._accuracy_and_loss(model, self.data.train_images[:size], self.data.train_labels[:size])

    @torch.no_grad()
    def _accuracy_and_loss(self, model: nn.Module, all_images, all_labels) -> dict[str, float]:
        was_training = model.training
        model.eval()
        correct, loss, n = 0, 0.0, len(all_labels)
        for start in range(0, n, self.eval_batch_size):
            images = all_images[start : start + self.eval_batch_size].to(self.device)
            labels = all_labels[start : start + self.eval_batch_size].to(self.device)
            logits = model(images)
            loss += F.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == labels).sum().item()
        model.train(was_training)
        return {"accuracy": correct / max(n, 1), "loss": loss / max(n, 1)}


def public_class_profile(dataset_cfg, num_classes: int) -> torch.Tensor:
    """Relative class sizes the dataset config declares: public, data-independent.

    A long-tailed dataset (`imbalance_factor` rho, as cifar10_lt / imagenette_lt build it, see
    dpbench.data.images.long_tail_indices) gives class c the share rho^(c/(K-1)) of the largest
    class, in class-index order; a dataset without one is balanced.
    """
    imbalance = dataset_cfg.get("imbalance_factor")
    if imbalance is None or num_classes < 2:
        return torch.ones(num_classes)
    if not 0 < float(imbalance) <= 1:
        raise UserError(f"dataset.imbalance_factor={imbalance} must lie in (0, 1]")
    exponents = torch.arange(num_classes, dtype=torch.float64) / (num_classes - 1)
    return torch.as_tensor(float(imbalance)).double().pow(exponents).float()


def ldam_margins(class_sizes: torch.Tensor, max_margin: float = 0.5) -> torch.Tensor:
    """LDAM margins m_c proportional to n_c^(-1/4), the largest equal to max_margin.

    `class_sizes` are relative sizes from the public profile (only ratios matter). DRW
    re-weighting is not implemented (it starts at epoch 160 in the reference code, after these
    papers' 40-50 epochs).
    """
    inverse = class_sizes.float().clamp_min(1e-12).pow(-0.25)
    return inverse * (max_margin / inverse.max())
