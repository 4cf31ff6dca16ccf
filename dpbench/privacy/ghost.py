"""Ghost clipping through Opacus (`algo.per_sample=ghost`): per-example gradient norms without
per-example gradients, then a second backward of the loss reweighted by the clip factors.

Opacus's GradSampleModuleFastGradientClipping computes, in its backward hooks, each example's
gradient norm: by the ghost-norm identity for Linear and Embedding layers, and for every other
layer from that layer's per-example gradient, instantiated and dropped at once ("fast gradient
clipping"). The clip factors f_i come from dpbench's clipping rule on those norms; the second
backward of Σ_i f_i ℓ_i, hooks off, leaves Σ_i f_i g_i in `.grad`. This is Opacus's
DPTensorFastGradientClipping.backward, unrolled so the sum is accumulated over physical batches
and noised once per logical step by the algorithm, like every other mode.
"""

from __future__ import annotations

import torch
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from torch import nn

from dpbench.errors import DivergedError, UserError
from dpbench.privacy.bookkeeping import FactorsFn, backward_through_layers, track_entry_params


def _working_bytes(module: nn.Module, inputs, examples: int) -> int:
    """What Opacus forms for one layer's norms: two [B, T, T] Gram matrices for a Linear or
    Embedding over T tokens, else that layer's per-example gradient."""
    x = inputs[0]
    if isinstance(module, (nn.Linear, nn.Embedding)):
        features = x.shape[-1] if isinstance(module, nn.Linear) else 1
        tokens = x.numel() // max(1, examples * features)
        return 2 * examples * tokens * tokens * 4
    return examples * sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


class OpacusGhostClipping:
    def __init__(self, model: nn.Module):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        owners = [id(p) for m in model.modules() for p in m.parameters(recurse=False) if p.requires_grad]
        if len(owners) != len(set(owners)):  # Opacus would raise mid-forward
            raise UserError("algo.per_sample=ghost: Opacus's ghost clipping does not support tied parameters; use bk or materialize")
        # loss_reduction="sum": the hooks see the gradient of Σ_i ℓ_i, each example's own.
        self._module = GradSampleModuleFastGradientClipping(
            model, batch_first=True, loss_reduction="sum", max_grad_norm=1.0, use_ghost_clipping=True, strict=True
        )
        self.working_bytes = 0  # largest per-layer working set seen in a forward
        self.peak_bytes = 0  # per-example bytes held at the peak of any step (what the run reports)
        self._entry_params: set[nn.Parameter] = set()
        for _, module in self._module.named_modules():
            if any(p.requires_grad for p in module.parameters(recurse=False)):
                module.register_forward_hook(self._measure)

    def _measure(self, module, inputs, _output):
        if torch.is_grad_enabled() and inputs and torch.is_tensor(inputs[0]):
            track_entry_params(self._entry_params, module, inputs)
            self.working_bytes = max(self.working_bytes, _working_bytes(module, inputs, inputs[0].shape[0]))

    def clipped_sum(self, losses: torch.Tensor, factors_fn: FactorsFn) -> list[torch.Tensor]:
        examples = losses.shape[0]
        backward_through_layers(losses.sum(), self._entry_params, retain_graph=True)  # the norm pass
        self._entry_params.clear()
        norms = self._norms(examples, losses.device)
        for p in self.params:
            p.grad = None
        if norms.shape[0] != examples:
            raise UserError(
                f"algo.per_sample=ghost sees {norms.shape[0]} rows for {examples} examples (candidate scoring); "
                "use algo.per_sample=bk or materialize"
            )
        if not bool(torch.isfinite(norms).all()):
            # 0 · inf would still flow through the bad example in the second backward; nothing
            # has been released, so the step ends here.
            raise DivergedError("a per-example gradient is not finite under algo.per_sample=ghost; lower train.lr")
        factors = factors_fn(norms)
        self._module.disable_hooks()
        try:
            (factors.detach().to(losses.dtype) * losses).sum().backward()
        finally:
            self._module.enable_hooks()
        sums = []
        for p in self.params:
            sums.append(p.grad.float() if p.grad is not None else torch.zeros(p.shape, device=p.device))
            p.grad = None
        self.peak_bytes = max(self.peak_bytes, self.working_bytes + 4 * examples * len(self.params))
        return sums

    def _norms(self, examples: int, device) -> torch.Tensor:
        """[R] norms over all parameters (R rows); a parameter unused in this pass adds 0."""
        norms = []
        for p in self.params:
            if getattr(p, "_norm_sample", None) is not None:
                norms.append(p._norm_sample.float())
                del p._norm_sample
        if not norms:
            return torch.zeros(examples, device=device)
        return torch.stack(norms).pow(2).sum(dim=0).sqrt()

    def backward_per_sample(self, losses):
        raise UserError("this algorithm needs per-example gradients; use algo.per_sample=materialize")

    def detach(self) -> None:
        self._module._close()
