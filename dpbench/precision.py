"""`train.precision`: the forward pass under autocast (fp32 | bf16 | fp16).

Only the forward runs in low precision: master weights, optimizer state, per-example norms,
clipped sums and the privacy noise stay fp32 (`clipped_sum` accumulates in fp32, the noise is
added to those sums), so the stated sensitivity and noise std hold as in fp32. bf16 has fp32's
range and needs no loss scaling. fp16 gradients underflow below 6e-8, so fp16 backpropagates the
loss times a static `FP16_LOSS_SCALE` and divides it out in fp32: per-example gradients (the
materialize engine) before any norm is taken, batch gradients (non-private algorithms) before the
optimizer step. An example whose gradient overflows gets clip factor 0, like any non-finite one. A static scale rather than torch's GradScaler: GradScaler scales the batch
gradient and skips steps on overflow, while a DP step must clip per-example gradients and
release its noise whatever happens. For non-private algorithms an overflow (a gradient above
65504 / scale) stops the run with a one-line error instead of being dropped silently.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dpbench.errors import DivergedError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
FP16_LOSS_SCALE = 2.0**10


@dataclass(frozen=True)
class Precision:
    name: str = "fp32"
    device_type: str = "cpu"

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES[self.name]

    @property
    def loss_scale(self) -> float:
        return FP16_LOSS_SCALE if self.name == "fp16" else 1.0

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


FP32 = Precision()


def unscaled(gradients: list[torch.Tensor], scale: float) -> list[torch.Tensor]:
    """Batch gradients / scale in fp32 (unchanged when unscaled); an overflowed value stops the
    (non-private) run. One host sync for all of them, not one per parameter."""
    if scale == 1.0 or not gradients:
        return gradients
    if not bool(torch.stack([torch.isfinite(g).all() for g in gradients]).all()):
        raise DivergedError(f"an fp16 gradient overflowed at loss scale {scale:g}; use train.precision=bf16 or lower train.lr")
    return [g.float() / scale for g in gradients]



def unscaled_per_example(gradient: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-example gradients / scale in fp32, with no check: an overflowed example is non-finite,
    so its clip factor is 0 and it drops out of the sum (stopping would tell whether, and when, an
    example that overflows was sampled)."""
    return gradient if scale == 1.0 else gradient.float() / scale
