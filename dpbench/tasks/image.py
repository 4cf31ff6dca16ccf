"""Image classification: a per-example loss (`dataset.loss`: cross_entropy | ldam, optionally
LDAM-DRW's deferred class re-weighting from `dataset.drw_epoch`), accuracy on the held-out split."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpbench.data import load_dataset
from dpbench.data.user import load_user_dataset
from dpbench.data.validation import split_training_set, tensor_rows
from dpbench.errors import UserError
from dpbench.models import DataSpec
from dpbench.models.user import forward_of, import_object, logits_of, names_builder
from dpbench.tasks.base import TASKS, Task


@TASKS.register("image_classification")
class ImageClassificationTask(Task):
    margins: torch.Tensor | None = None  # LDAM class margins; None = plain cross-entropy
    drw: "DeferredReweighting | None" = None  # LDAM-DRW class re-weighting; None = unweighted losses
    user_loss = None  # dataset.loss=package.module:function: a user's per-example loss (outputs, labels) -> [B]

    def __init__(self, cfg, device: torch.device, eval_batch_size: int = 1024):
        user_data = names_builder(cfg.dataset)  # dataset.builder=package.module:function (dpbench/data/user.py)
        self.data = (load_user_dataset if user_data else load_dataset)(cfg.dataset, cfg.seed)
        self.device = device
        # dataset.validation_fraction: validation examples leave the training set (a keyed hash of
        # each image's bytes and label decides; dpbench/data/validation.py says why)
        self.split = split_training_set(cfg.dataset, tensor_rows(self.data.train_images, self.data.train_labels))
        if self.split is not None:
            kept, held = (torch.as_tensor(i, dtype=torch.long) for i in (self.split.train_indices, self.split.validation_indices))
            self.validation_images, self.validation_labels = self.data.train_images[held], self.data.train_labels[held]
            self.data.train_images, self.data.train_labels = self.data.train_images[kept], self.data.train_labels[kept]
        self.train_size = len(self.data.train_labels)
        self.eval_batch_size = eval_batch_size
        loss_name = cfg.dataset.get("loss", "cross_entropy")
        if loss_name == "cross_entropy":
            self.margins = None
        elif ":" in loss_name:  # a user's loss by import path (docs/bring-your-own.md)
            self.margins, self.user_loss, self.loss_path = None, import_object(loss_name, "dataset.loss"), loss_name
        elif loss_name == "ldam":
            # From the config's public class profile, never from the private labels: a margin
            # computed from label counts makes every example's loss depend on every other label.
            profile = public_class_profile(cfg.dataset, self.data.num_classes)
            self.margins = ldam_margins(profile, float(cfg.dataset.get("ldam_max_margin", 0.5))).to(device)
            self.ldam_scale = float(cfg.dataset.get("ldam_scale", 30.0))
        else:
            raise UserError(f"dataset.loss={loss_name!r} is not known; use cross_entropy, ldam or package.module:function")
        self.drw = DeferredReweighting.from_config(cfg, self.data.num_classes, self.planning_size, device)

    def set_step(self, step: int) -> None:
        """The training step about to run (DRW switches its class weights on at `dataset.drw_epoch`)."""
        if self.drw is not None:
            self.drw.step = step

    def model_spec(self) -> DataSpec:
        return DataSpec(
            num_classes=self.data.num_classes,
            channels=self.data.channels,
            image_size=self.data.image_size,
            patch_size=self.data.patch_size,
            input_shape=tuple(self.data.train_images.shape[1:]),
        )

    def batch(self, indices: list[int]):
        index = torch.as_tensor(indices, dtype=torch.long)
        return (
            self.data.train_images[index].to(self.device, non_blocking=True),
            self.data.train_labels[index].to(self.device, non_blocking=True),
        )

    def batch_size(self, batch) -> int:
        return int(batch[1].shape[0])

    def train_label(self, index: int) -> int:
        """Record `index`'s class (the layout probe replaces a record by one of its class and of another)."""
        return int(self.data.train_labels[index])

    def per_sample_loss(self, model: nn.Module, batch) -> torch.Tensor:
        images, labels = batch
        logits = logits_of(forward_of(model, images))  # a Hugging Face model's ModelOutput: its .logits
        if self.user_loss is not None:
            return self._user_losses(logits, labels)
        if self.margins is None:
            losses = F.cross_entropy(logits, labels, reduction="none")
        else:  # LDAM: subtract the true class's margin, scale, cross-entropy (Cao et al. 2019).
            shifted = logits - F.one_hot(labels, logits.shape[1]) * self.margins[labels][:, None]
            losses = F.cross_entropy(self.ldam_scale * shifted, labels, reduction="none")
        # DRW weights each example's loss by its class weight. Privacy is unchanged: the weight
        # scales that example's gradient BEFORE per-example clipping, so the clipped
        # contribution still has norm <= the clip bound (and the weights are public).
        return losses if self.drw is None else losses * self.drw.weights(labels)

    def _user_losses(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The user's loss, refused in one line unless it gives one loss per example (every call:
        a shape test costs nothing; the message names no batch size, which Poisson sampling keeps private)."""
        losses = self.user_loss(logits, labels)
        if not (torch.is_tensor(losses) and losses.shape == labels.shape):
            if not torch.is_tensor(losses):
                got = f"a {type(losses).__name__}"
            else:
                got = "a scalar" if losses.dim() == 0 else f"a {losses.dim()}-dimensional tensor of another shape"
            raise UserError(f"dataset.loss={self.loss_path} returned {got}; it must return one loss per example, "
                            "shape [batch size] (e.g. reduction='none')")
        return losses

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        return self._accuracy_and_loss(model, self.data.test_images, self.data.test_labels)

    @torch.no_grad()
    def validation_scores(self, model: nn.Module) -> torch.Tensor:
        """1 for each correctly classified validation example, else 0."""
        was_training = model.training
        model.eval()
        correct = []
        for start in range(0, len(self.validation_labels), self.eval_batch_size):
            images = self.validation_images[start : start + self.eval_batch_size].to(self.device)
            labels = self.validation_labels[start : start + self.eval_batch_size].to(self.device)
            correct.append((logits_of(forward_of(model, images)).argmax(dim=1) == labels).float())
        model.train(was_training)
        return torch.cat(correct) if correct else torch.zeros(0, device=self.device)

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
            logits = logits_of(forward_of(model, images))
            if self.user_loss is not None:  # the test loss in the user's own terms
                loss += self._user_losses(logits, labels).sum().item()
            else:
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


def public_class_counts(dataset_cfg, num_classes: int, train_size: int) -> torch.Tensor:
    """Class sizes of the public profile scaled to the n training examples (n is public: q = B/n).

    Scaling the relative profile to n gives cifar10_lt's sizes (5000 ... 50) to within their
    integer rounding (at most 0.5%), without reading a label."""
    profile = public_class_profile(dataset_cfg, num_classes).double()
    return (profile * (train_size / profile.sum())).float()


def class_balanced_weights(class_sizes: torch.Tensor, beta: float) -> torch.Tensor:
    """Effective-number class weights (Cui et al. 2019), as LDAM-DRW's code computes them:
    (1 - beta) / (1 - beta^n_c), normalised to sum to the number of classes (beta = 0: all 1)."""
    sizes = class_sizes.double()
    weights = (1.0 - beta) / (1.0 - torch.pow(torch.as_tensor(beta, dtype=torch.float64), sizes))
    return (weights * (len(sizes) / weights.sum())).float()


class DeferredReweighting:
    """LDAM-DRW's deferred re-weighting (Cao et al. 2019): plain losses until epoch `drw_epoch`,
    then each example's loss times its class's effective-number weight.

    The weights come from the config's public class profile, never from the labels (weights
    from label counts would make every example's loss depend on every other label). Step s is
    in epoch floor(s B / n), B the expected batch size. The task learns the step from
    `ImageClassificationTask.set_step` (`Algorithm.train_step` calls it before every step); a
    loss computed before any step was set says so instead of silently not weighting.
    """

    def __init__(self, class_weights: torch.Tensor, drw_epoch: int, steps_per_epoch: float):
        self.class_weights, self.drw_epoch, self.steps_per_epoch = class_weights, drw_epoch, steps_per_epoch
        self.step: int | None = None

    @classmethod
    def from_config(cls, cfg, num_classes: int, train_size: int, device) -> "DeferredReweighting | None":
        drw_epoch = cfg.dataset.get("drw_epoch")
        if drw_epoch is None:  # the papers' runs: 40-50 epochs, before the reference code's epoch 160 (P15)
            return None
        beta = float(cfg.dataset.get("drw_beta", 0.9999))
        if int(drw_epoch) < 0 or not 0 <= beta < 1:
            raise UserError(f"dataset.drw_epoch={drw_epoch} must be >= 0 and dataset.drw_beta={beta} in [0, 1)")
        weights = class_balanced_weights(public_class_counts(cfg.dataset, num_classes, train_size), beta)
        return cls(weights.to(device), int(drw_epoch), train_size / float(cfg.train.batch_size))

    def active(self) -> bool:
        if self.step is None:
            raise UserError(
                "dataset.drw_epoch needs the training step: call task.set_step(step) before the loss "
                "(Algorithm.train_step does), or set dataset.drw_epoch=null"
            )
        return self.step >= self.drw_epoch * self.steps_per_epoch

    def weights(self, labels: torch.Tensor) -> torch.Tensor:
        """Per-example loss weights: 1 before drw_epoch, the class weights from then on."""
        if not self.active():
            return torch.ones(labels.shape, device=labels.device)
        return self.class_weights.to(labels.device)[labels]


def ldam_margins(class_sizes: torch.Tensor, max_margin: float = 0.5) -> torch.Tensor:
    """LDAM margins m_c proportional to n_c^(-1/4), the largest equal to max_margin.

    `class_sizes` are relative sizes from the public profile (only ratios matter). DRW
    re-weighting is `DeferredReweighting` (off by default: it starts at epoch 160 in the
    reference code, after these papers' 40-50 epochs).
    """
    inverse = class_sizes.float().clamp_min(1e-12).pow(-0.25)
    return inverse * (max_margin / inverse.max())
