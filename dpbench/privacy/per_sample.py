"""The `materialize` engine: per-sample gradients through Opacus's grad samplers, with a seam for
per-layer transforms (engines.py lists every engine; clipping.py the clipping rules).

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

from dpbench.precision import unscaled_per_example
from dpbench.privacy.clipping import (
    Reduce, clipped_sum, per_sample_layer_norms, per_sample_norms, reduce_each, sum_rows_per_example,
)
from dpbench.privacy.layers import (
    check_rows, embedding_grad_sample, is_layer_norm, opacus_corrections, summed_shapes, zero_sum,
)

GradSampler = Callable[[nn.Module, list[torch.Tensor], torch.Tensor], dict[nn.Parameter, torch.Tensor]]


class _GradSampleModuleWithOverrides(GradSampleModule):
    """Opacus's GradSampleModule, looking up grad samplers by module instance before type."""

    def __init__(self, module: nn.Module, overrides: dict[nn.Module, GradSampler]):
        # Opacus keeps GRAD_SAMPLERS as a class attribute; use a per-instance copy extended with
        # the overrides. Both are plain attributes, set before hooks are added in __init__.
        self._overrides = overrides
        # A LayerNorm subclass with LayerNorm's function (timm's) gets Opacus's LayerNorm sampler
        # instead of functorch (the layer catalogue's `is_layer_norm`, layers.py).
        layer_norms = {type(m): GradSampleModule.GRAD_SAMPLERS[nn.LayerNorm] for m in module.modules()
                       if is_layer_norm(m) and m.bias is not None and m.weight is not None}
        # Linear and Embedding weights: their per-example gradient becomes Opacus's buffer itself,
        # not copied into a zeroed twin (two of the largest table at once); a tied table's second
        # part is scattered into it (layers.embedding_grad_sample).
        self.GRAD_SAMPLERS = {**GradSampleModule.GRAD_SAMPLERS, nn.Linear: _linear_weight_as_buffer,
                              nn.Embedding: embedding_grad_sample, **layer_norms, **overrides}
        super().__init__(module, batch_first=True, loss_reduction="sum", strict=True)
        self.examples = 0  # examples in the batch being backpropagated (set by the engine)

    def _get_module_type(self, module: nn.Module):
        return module if module in getattr(self, "_overrides", {}) else type(module)

    def rearrange_grad_samples(self, *, module, backprops, loss_reduction, batch_first):
        """Opacus's, then an example's rows merged into its token axis where that is exact.

        A layer fed R = k·B rows (HF OPT flattens [B, T, d] to [B·T, d] before fc1/fc2 and its
        final LayerNorm; candidate scoring feeds K rows per example, example-major) would
        otherwise get one per-*row* gradient each, [B·T, out, in] for a Linear (T times an example's
        gradient), summed per example only afterwards. For layers whose
        per-example gradient sums over every position of the input (Linear, Embedding, LayerNorm)
        the rows of one example are just more positions: [R, ..., d] -> [B, R/B·..., d] gives the
        per-example gradient directly, exactly."""
        activations, backprops = super().rearrange_grad_samples(
            module=module, backprops=backprops, loss_reduction=loss_reduction, batch_first=batch_first)
        rows, examples = backprops.shape[0], self.examples
        check_rows(module, [backprops], examples)
        if not examples or rows == examples or rows % examples or not _merges_rows(module):
            return activations, backprops
        tail = len(module.normalized_shape) if is_layer_norm(module) else 1
        merge = lambda t, keep: t.reshape(examples, -1, *t.shape[t.dim() - keep:]) if keep else t.reshape(examples, -1)
        if type(module) is nn.Embedding:  # ids [R, ...] -> [B, ·]; their gradients [B, ·, d]
            activations = [merge(activations[0], 0), *activations[1:]]
        else:
            activations = [merge(activations[0], tail), *activations[1:]]
        module.max_batch_len = examples  # the per-sample buffers Opacus allocates: [B, ...]
        return activations, merge(backprops, tail)


def _linear_weight_as_buffer(module: nn.Linear, activations, backprops) -> dict:
    """Opacus's Linear grad sampler; the weight's [B, out, in] (a fresh einsum) is handed to Opacus
    as the layer's per-example buffer, which `create_or_accumulate_grad_sample` would otherwise
    allocate zeroed and copy it into (two of a vocabulary-wide head's [B, V, d] at once)."""
    grads = GradSampleModule.GRAD_SAMPLERS[nn.Linear](module, activations, backprops)
    weight = module.weight
    if weight in grads and not hasattr(weight, "_current_grad_sample") \
            and grads[weight].shape[0] == getattr(module, "max_batch_len", None):
        weight._current_grad_sample = grads.pop(weight)
    return grads


def track_entry_params(entry: set, module: nn.Module, inputs) -> None:
    """Forward-hook helper: a layer none of whose inputs requires grad sits at the bottom of the
    graph; its parameters are the targets of `backward_through_layers`."""
    if not any(torch.is_tensor(t) and t.requires_grad for t in inputs):
        entry.update(p for p in module.parameters() if p.requires_grad)


def backward_through_layers(loss: torch.Tensor, entry_params: set, retain_graph: bool = False) -> None:
    """Backpropagate to every layer's output (the hooks fire) without computing weight gradients.

    Every trainable layer lies on a path from the loss down to a bottom layer's parameters, so
    asking autograd for those parameters' gradients only runs every layer's backward, and skips
    the weight gradients (and their memory) of all the others: the hooks need only the output
    gradients. The bottom layers' `.grad` is dropped by the caller."""
    if entry_params:
        torch.autograd.backward(loss, inputs=list(entry_params), retain_graph=retain_graph)
    else:
        loss.backward(retain_graph=retain_graph)


def _merges_rows(module: nn.Module) -> bool:
    """Layers whose per-example gradient is a sum over input positions (see rearrange_grad_samples)."""
    return type(module) in (nn.Linear, nn.Embedding) or is_layer_norm(module)


class PerSampleGradients:
    sum_observer = None  # the engine protocol's observer of each chunk's sums (dpbench-audit)

    def __init__(self, model: nn.Module, sampler_overrides: dict[nn.Module, GradSampler] | None = None):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        overrides = {**opacus_corrections(model, embeddings=True), **(sampler_overrides or {})}
        self._module = _GradSampleModuleWithOverrides(model, overrides)
        self._sum_shapes = summed_shapes(overrides)  # a transform's shapes (DP-GRAPE projects), else the parameter's
        self.peak_bytes = 0  # largest set of per-sample gradients formed at once
        self.loss_scale = 1.0  # train.precision=fp16: divided out of every per-sample gradient (fp32)
        # The bottom layers' parameters: the backward asks autograd for their gradients only, so
        # it runs every layer's backward (the grad samplers' hooks fire) without also computing the
        # summed weight gradient of every other layer, which the per-sample gradients replace.
        self._entry_params: set[nn.Parameter] = set()
        self._handles = [m.register_forward_hook(self._track_entry)
                         for m in model.modules() if any(p.requires_grad for p in m.parameters(recurse=False))]

    def _track_entry(self, module, inputs, _output):
        if torch.is_grad_enabled() and self._module.hooks_enabled:
            track_entry_params(self._entry_params, module, inputs)

    def meter(self, held_bytes: int) -> None:
        """Record per-example bytes held at once (a caller holding two sets reports their sum)."""
        self.peak_bytes = max(self.peak_bytes, held_bytes)

    def backward_per_sample(self, losses: torch.Tensor) -> list[torch.Tensor]:
        """Backpropagate per-example losses [B]; return per-sample grads aligned with `self.params`.

        The summed batch gradient that autograd also accumulates in `.grad` is discarded.
        """
        self._module.examples = losses.shape[0]
        try:
            backward_through_layers(losses.sum() * self.loss_scale, self._entry_params)
        finally:
            self._entry_params.clear()
            self._module.examples = 0
        per_sample = []
        for p in self.params:
            grad_sample = p.grad_sample
            if isinstance(grad_sample, list):  # several backward passes without a reset
                raise RuntimeError("per-sample gradients were accumulated twice without a reset")
            if grad_sample is None:  # parameter unused in this forward pass: zeros of what its hook would form
                grad_sample = zero_sum(p, self._sum_shapes, rows=(losses.shape[0],), dtype=p.dtype)
            grad_sample = unscaled_per_example(sum_rows_per_example(grad_sample, losses.shape[0]), self.loss_scale)
            per_sample.append(grad_sample)
            p.grad_sample = None
            p.grad = None
        self.meter(sum(g.numel() * g.element_size() for g in per_sample))
        return per_sample

    def clipped_sum(self, losses: torch.Tensor, factors_fn, reduce: Reduce | None = None,
                    per_layer: bool = False) -> list[torch.Tensor]:
        """Σ_i f_i g_i (fp32) with f = factors_fn(per-example norms); `reduce` (the engine
        protocol's) applied to each, in the order of `params`, after they are all formed.
        `per_layer`: factors_fn gets [L, B] bounds on each parameter's per-example norms (rounding
        included) and returns [L, B] factors, row l scaling parameter l."""
        per_sample = self.backward_per_sample(losses)
        norms = per_sample_layer_norms(per_sample) if per_layer else per_sample_norms(per_sample)
        sums = clipped_sum(per_sample, factors_fn(norms), overwrite=True)
        del per_sample
        sums = reduce_each(sums, reduce)
        if self.sum_observer is not None:  # the engine protocol's observation point (read only)
            self.sum_observer(sums, reduce is not None)
        return sums

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._module._close()
