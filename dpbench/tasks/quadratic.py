"""DPZero's synthetic study (Zhang et al. 2024, Sec. 5.1 and App. B.1, Table 6, Figs. 1-2).

Data: n training points x_i in R^d with i.i.d. N(1, 1) coordinates, and a test set of the same
law and size. Loss of the parameter theta in R^d on example i:
    l_i(theta) = 1/2 (theta - x_i)^T A (theta - x_i),   A = diag(a_1..a_d), ||A||_2 = 1,
with the spectrum (`dataset.spectrum`) choosing the effective rank r = Tr(A):
    d:      a_j = 1            Tr(A) = d
    sqrt_d: a_j = 1/sqrt(j)    Tr(A) = O(sqrt d)
    log_d:  a_j = 1/j          Tr(A) = O(log d)
The model is the point theta itself (`model=quadratic`), started at 0 (the paper does not say
where; 0 puts every method at the same initial error Tr(A) + ...).

Evaluation reports what the paper plots: the norm of the full gradient of the test objective,
||grad F_test(theta)|| = ||A (theta - mean_test)|| (Fig. 1 d-f; `accuracy` holds it, so
`test_accuracy` in results.json is this gradient norm -- lower is better), and the test loss
F_test(theta) (Fig. 2 d-f, `loss`); the training-set counterparts are returned as well.
Closed forms in float64: F(theta) = 1/2 (theta - m)^T A (theta - m) + 1/2 mean_i (x_i - m)^T A (x_i - m).
"""

from __future__ import annotations

import torch
from opacus.grad_sample import register_grad_sampler
from torch import nn

from dpbench.data.validation import split_training_set, tensor_rows
from dpbench.errors import UserError
from dpbench.tasks.base import TASKS, Task

SPECTRA = {
    "d": lambda j: torch.ones_like(j),
    "sqrt_d": lambda j: j.rsqrt(),
    "log_d": lambda j: j.reciprocal(),
}


def spectrum(name: str, dimension: int) -> torch.Tensor:
    """Diagonal of A, float64 [d], largest entry 1."""
    if name not in SPECTRA:
        raise UserError(f"dataset.spectrum={name!r} is not known; use one of {', '.join(SPECTRA)}")
    return SPECTRA[name](torch.arange(1, dimension + 1, dtype=torch.float64))


class QuadraticPoint(nn.Module):
    """The parameter theta in R^d; forward gives each example's residual theta - x_i: [B, d]."""

    def __init__(self, dimension: int):
        super().__init__()
        self.point = nn.Parameter(torch.zeros(dimension))

    def forward(self, points: torch.Tensor) -> torch.Tensor:
        return self.point.unsqueeze(0) - points


@register_grad_sampler(QuadraticPoint)
def quadratic_point_grad_sample(layer: QuadraticPoint, activations, backprops: torch.Tensor) -> dict:
    """Per-example gradient of theta: d(theta - x_i)/d theta = I, so it is the output gradient [B, d]
    (Opacus would otherwise run functorch over the module, about 20x slower at n = 10^4, d = 2000)."""
    return {layer.point: backprops} if layer.point.requires_grad else {}


class SplitSummary:
    """Mean and spread of one split, enough for the closed-form loss and gradient."""

    def __init__(self, points: torch.Tensor, diagonal: torch.Tensor):
        points = points.double()
        self.mean = points.mean(dim=0)
        self.spread = float(((points - self.mean).pow(2) * diagonal).sum(dim=1).mean())
        self.diagonal = diagonal

    def metrics(self, theta: torch.Tensor) -> tuple[float, float]:
        """(||grad F(theta)||, F(theta))."""
        offset = theta.double().cpu() - self.mean
        gradient = self.diagonal * offset
        return float(gradient.norm()), 0.5 * float((offset * gradient).sum()) + 0.5 * self.spread


@TASKS.register("quadratic")
class QuadraticTask(Task):
    metric_name = "test_grad_norm"  # what evaluate()'s 'accuracy' holds
    higher_is_better = False

    def __init__(self, cfg, device: torch.device):
        data = cfg.dataset
        self.dimension = int(data.dimension)
        if self.dimension < 1:
            raise UserError(f"dataset.dimension must be a positive integer, got {data.dimension}")
        self.diagonal = spectrum(str(data.spectrum), self.dimension)
        generator = torch.Generator().manual_seed(int(data.data_seed))
        self.train_points = 1.0 + torch.randn(int(data.train_size), self.dimension, generator=generator)
        test_points = 1.0 + torch.randn(int(data.test_size), self.dimension, generator=generator)
        # dataset.validation_fraction: a keyed hash of each point's coordinates picks the validation
        # points (dpbench/data/validation.py); the training summary is of the training part
        self.split = split_training_set(data, tensor_rows(self.train_points))
        if self.split is not None:
            self.validation_points = self.train_points[torch.as_tensor(self.split.validation_indices, dtype=torch.long)]
            self.train_points = self.train_points[torch.as_tensor(self.split.train_indices, dtype=torch.long)]
        self.train_summary = SplitSummary(self.train_points, self.diagonal)
        self.test_summary = SplitSummary(test_points, self.diagonal)
        self.device = device
        self.train_size = len(self.train_points)
        self.weights = self.diagonal.float().to(device)

    def build_model(self, model_cfg) -> nn.Module:
        if model_cfg.name != "quadratic":
            raise UserError(f"dataset=quadratic needs model=quadratic (got model={model_cfg.name})")
        return QuadraticPoint(self.dimension)

    def batch(self, indices: list[int]) -> torch.Tensor:
        return self.train_points[torch.as_tensor(indices, dtype=torch.long)].to(self.device)

    def batch_size(self, batch: torch.Tensor) -> int:
        return int(batch.shape[0])

    def per_sample_loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        residuals = model(batch)  # [B, d]
        return 0.5 * (residuals.pow(2) * self.weights).sum(dim=1)

    @torch.no_grad()
    def validation_scores(self, model: nn.Module) -> torch.Tensor:
        """Each validation point's loss over 2 Tr(A) (the loss at theta = 0 is about Tr(A)), clipped to
        [0, 1]: lower is better, like the task's headline metric."""
        residuals = model.point.detach().double().cpu().unsqueeze(0) - self.validation_points.double()
        losses = 0.5 * (residuals.pow(2) * self.diagonal).sum(dim=1)
        return (losses / (2 * float(self.diagonal.sum()))).clamp(0, 1).float()

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        theta = model.point.detach()
        test_norm, test_loss = self.test_summary.metrics(theta)
        train_norm, train_loss = self.train_summary.metrics(theta)
        return {
            "accuracy": test_norm,  # the headline metric (metric_name): test gradient norm
            "loss": test_loss,
            "test_grad_norm": test_norm,
            "train_grad_norm": train_norm,
            "train_loss": train_loss,
        }
