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

Also here, what keeps the fp32 parts fp32: TF32 off in private runs (`TF32`) and trainable
weights required in fp32 (`require_fp32_trainable`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from omegaconf import DictConfig

from dpbench.errors import DivergedError, UserError

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


def require_native_bf16(device, cuda=torch.cuda) -> None:
    """A CUDA GPU without bf16 units (before Ampere) runs bf16 emulated: far slower, so its timings
    and memory are not those of a bf16 run. One-line error instead (`cuda` is a seam for tests)."""
    if torch.device(device).type == "cuda" and not cuda.is_bf16_supported(including_emulation=False):
        raise UserError(
            "this GPU has no native bfloat16 (torch.cuda.is_bf16_supported(including_emulation=False) is False): "
            "use train.precision=fp16 or fp32 and model.dtype=float32 or float16"
        )


class TF32Switch:
    """TF32 (a 10-bit mantissa in fp32 matmuls and convolutions on Ampere and later GPUs) off for
    private runs: per-example norms and clipped sums must be computed in fp32 for the stated
    sensitivity to hold. A non-private run gets the process's own settings back, so in a grid run
    in one process a job's numerics do not depend on the jobs before it. `backends` and
    `torch_module` are seams for tests."""

    def __init__(self, backends=torch.backends, torch_module=torch):
        self.backends, self.torch = backends, torch_module
        self.defaults: tuple | None = None

    def apply(self, private: bool) -> None:
        b = self.backends
        if self.defaults is None:
            self.defaults = (b.cuda.matmul.allow_tf32, b.cudnn.allow_tf32, self.torch.get_float32_matmul_precision())
        matmul, cudnn, matmul_precision = (False, False, "highest") if private else self.defaults
        b.cuda.matmul.allow_tf32 = matmul
        b.cudnn.allow_tf32 = cudnn
        self.torch.set_float32_matmul_precision(matmul_precision)


TF32 = TF32Switch()
LOW_PRECISION = (torch.bfloat16, torch.float16)


def require_fp32_trainable(model: torch.nn.Module, cfg: DictConfig) -> None:
    """Trainable weights in bf16/fp16 have no fp32 master copy: an update below half their
    precision is lost and Adam's eps 1e-8 is 0 in fp16 (NaN at step 1). Low model.dtype is for
    frozen weights (LoRA's base model); the forward goes low precision through train.precision
    (autocast)."""
    low = [(n, p.dtype) for n, p in model.named_parameters() if p.requires_grad and p.dtype in LOW_PRECISION]
    if low:
        dtype = str(low[0][1]).removeprefix("torch.")
        raise UserError(
            f"model.dtype={cfg.model.get('dtype', dtype)} leaves {len(low)} trainable tensors (e.g. {low[0][0]}) in "
            f"{dtype} with no fp32 master copy, so small updates are lost: set model.dtype=float32, with "
            "train.precision=bf16 (or fp16) for a low-precision forward"
        )
