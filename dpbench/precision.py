"""`train.precision`: the forward pass under autocast (fp32 | bf16 | fp16).

Only the forward runs in low precision: master weights, optimizer state, per-example norms,
clipped sums and the privacy noise stay fp32 (`clipped_sum` accumulates in fp32, the noise is
added to those sums), so the stated sensitivity and noise std hold as in fp32. bf16 has fp32's
range and needs no loss scaling. fp16 is refused: its per-example gradients underflow without
loss scaling, and torch's dynamic GradScaler scales the batch gradient, not the per-example
gradients the norms are taken of (unscaling them before clipping is not implemented yet).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from dpbench.errors import UserError

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str = "fp32"
    device_type: str = "cpu"

    @property
    def dtype(self) -> torch.dtype | None:
        return DTYPES[self.name]

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)


FP32 = Precision()


def precision_for(name: str, device: torch.device) -> Precision:
    if name not in DTYPES:
        raise UserError(f"train.precision={name!r} is not known; use one of {', '.join(DTYPES)}")
    if name == "fp16":
        raise UserError("train.precision=fp16 is not supported (per-example gradients underflow without loss scaling); use train.precision=bf16")
    return Precision(name, device.type)
