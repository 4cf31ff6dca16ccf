"""Per-sample gradients through Opacus's grad samplers, with a seam for per-layer transforms.

Three engines compute the clipped sum Σ_i f_i g_i of a physical batch (`algo.per_sample`):
`materialize` (this module: every per-sample gradient formed, Opacus's default), `ghost` (norms
without per-sample gradients, then a second backward that sums the clipped pieces) and `bk`
(book-keeping, one backward): both in bookkeeping.py. `PerSampleGradients.for_mode` builds one; each
has `clipped_sum(losses, factors_fn) -> sums` and meters its largest per-example working set in
`peak_bytes` (results.json's per_sample_grad_bytes).

`PerSampleGradients` attaches Opacus's forward/backward hooks to a model. After
`backward_per_sample(losses)` every trainable parameter holds a tensor [B, ...] of per-example
gradients. `sampler_overrides` maps a module *instance* to a function
`(module, activations, backprops) -> {param: per-sample tensor}` that replaces Opacus's grad
sampler for that module only: DP-GRAPE uses it to compute projected per-sample gradients inside
the hook, so the full per-sample gradient of a projected layer is never materialised.
"""

from __future__ import annotations

from typing import Callable

import torch
from opacus.grad_sample import GradSampleModule
from torch import nn

from dpbench.errors import UserError
from dpbench.precision import unscaled_per_example

GradSampler = Callable[[nn.Module, list[torch.Tensor], torch.Tensor], dict[nn.Parameter, torch.Tensor]]


class _GradSampleModuleWithOverrides(GradSampleModule):
    """Opacus's GradSampleModule, looking up grad samplers by module instance before type."""

    def __init__(self, module: nn.Module, overrides: dict[nn.Module, GradSampler]):
        # Opacus keeps GRAD_SAMPLERS as a class attribute; use a per-instance copy extended with
        # the overrides. Both are plain attributes, set before hooks are added in __init__.
        self._overrides = overrides
        self.GRAD_SAMPLERS = {**GradSampleModule.GRAD_SAMPLERS, **overrides}
        super().__init__(module, batch_first=True, loss_reduction="sum", strict=True)

    def _get_module_type(self, module: nn.Module):
        return module if module in getattr(self, "_overrides", {}) else type(module)


class PerSampleGradients:
    def __init__(self, model: nn.Module, sampler_overrides: dict[nn.Module, GradSampler] | None = None):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._module = _GradSampleModuleWithOverrides(model, sampler_overrides or {})
        self.peak_bytes = 0  # largest set of per-sample gradients formed at once
        self.loss_scale = 1.0  # train.precision=fp16: divided out of every per-sample gradient (fp32)

    def meter(self, held_bytes: int) -> None:
        """Record per-example bytes held at once (a caller holding two sets reports their sum)."""
        self.peak_bytes = max(self.peak_bytes, held_bytes)

    def backward_per_sample(self, losses: torch.Tensor) -> list[torch.Tensor]:
        """Backpropagate per-example losses [B]; return per-sample grads aligned with `self.params`.

        The summed batch gradient that autograd also accumulates in `.grad` is discarded.
        """
        (losses.sum() * self.loss_scale).backward()
        per_sample = []
        for p in self.params:
            grad_sample = p.grad_sample
            if isinstance(grad_sample, list):  # several backward passes without a reset
                raise RuntimeError("per-sample gradients were accumulated twice without a reset")
            if grad_sample is None:  # parameter unused in this forward pass
                grad_sample = torch.zeros((losses.shape[0], *p.shape), device=p.device, dtype=p.dtype)
            grad_sample = unscaled_per_example(_sum_rows_per_example(grad_sample, losses.shape[0]), self.loss_scale)
            per_sample.append(grad_sample)
            p.grad_sample = None
            p.grad = None
        self.meter(sum(g.numel() * g.element_size() for g in per_sample))
        return per_sample

    def clipped_sum(self, losses: torch.Tensor, factors_fn) -> list[torch.Tensor]:
        """Σ_i f_i g_i (fp32) with f = factors_fn(per-example norms)."""
        per_sample = self.backward_per_sample(losses)
        return clipped_sum(per_sample, factors_fn(per_sample_norms(per_sample)))

    def detach(self) -> None:
        self._module._close()

    @staticmethod
    def for_mode(mode: str, model: nn.Module, sampler_overrides: dict | None = None):
        """The engine for `algo.per_sample=mode` (materialize | ghost | bk)."""
        if mode not in PER_SAMPLE_ENGINES:
            raise UserError(f"algo.per_sample={mode!r} is not known; use one of {', '.join(PER_SAMPLE_ENGINES)}")
        return PER_SAMPLE_ENGINES[mode](model, dict(sampler_overrides or {}))


def _ghost_engine(model: nn.Module, overrides: dict):
    from dpbench.privacy.bookkeeping import BookKeeping

    # Hand-written rather than Opacus's GradSampleModuleFastGradientClipping: its second pass is
    # autograd's backward of Σ_i f_i ℓ_i, which under autocast sums the clipped gradients in
    # bf16/fp16 (one added example moved the sum by 2·C at batch 1024), lets a non-finite example
    # poison the sum through 0 · inf, and cannot see DP-GRAPE's projection (bookkeeping.py).
    return BookKeeping(model, overrides, passes=2)


def _bk_engine(model: nn.Module, overrides: dict):
    from dpbench.privacy.bookkeeping import BookKeeping

    return BookKeeping(model, overrides, passes=1)


PER_SAMPLE_ENGINES: dict[str, Callable] = {
    "materialize": PerSampleGradients,
    "ghost": _ghost_engine,
    "bk": _bk_engine,
}


def _sum_rows_per_example(grad_sample: torch.Tensor, examples: int) -> torch.Tensor:
    """[R, ...] per-row gradients -> [B, ...] per-example ones, when an example spans R/B rows.

    Candidate scoring feeds K sequences per example, laid out example-major (rows b*K..b*K+K-1
    are example b); the privacy unit is the example, so its rows' gradients are summed before
    clipping.
    """
    rows = grad_sample.shape[0]
    if rows == examples:
        return grad_sample
    if examples == 0 or rows % examples:
        raise RuntimeError(f"{rows} per-row gradients do not split into {examples} examples")
    return grad_sample.view(examples, rows // examples, *grad_sample.shape[1:]).sum(dim=1)


def per_sample_norms(per_sample: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm of each example's gradient over all given tensors (flat clipping): [B]."""
    squared = [g.reshape(g.shape[0], -1).float().pow(2).sum(dim=1) for g in per_sample]
    return torch.stack(squared, dim=0).sum(dim=0).sqrt()


# Clipping rules: per-example scale factor from the per-example norm. "flat" is Abadi et al.'s
# min(1, C/||g||) (Opacus's form, with its 1e-6 guard); the others are DP-SGD variants whose
# sensitivity is still C.
CLIP_FACTORS: dict[str, Callable[[torch.Tensor, float, float], torch.Tensor]] = {
    "flat": lambda norms, c, gamma: (c / (norms + 1e-6)).clamp(max=1.0),
    "automatic": lambda norms, c, gamma: c / (norms + gamma),
    "psac": lambda norms, c, gamma: c / (norms + gamma / (norms + gamma)),
}


def clip_factors(norms: torch.Tensor, clip_norm: float, rule: str = "flat", gamma: float = 0.01) -> torch.Tensor:
    factors = CLIP_FACTORS[rule](norms, clip_norm, gamma)
    # A NaN/inf gradient from one example must not poison the sum: it contributes nothing.
    return torch.where(torch.isfinite(norms), factors, torch.zeros_like(factors))


def clipped_sum(per_sample: list[torch.Tensor], factors: torch.Tensor) -> list[torch.Tensor]:
    """sum_i factor_i * g_i for each tensor, accumulated in float32."""
    factors = factors.float()
    return [
        torch.einsum("b,b...->...", factors, torch.nan_to_num(g.float(), nan=0.0, posinf=0.0, neginf=0.0))
        for g in per_sample
    ]
