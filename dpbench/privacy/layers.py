"""The layer catalogue of book-keeping and ghost clipping (bookkeeping.py): which layer kinds have
a hand-written piece rule (pieces.py), and what every other layer gets.

`RULES` is the one table. It is keyed by layer class and resolved along the module class's MRO, so
a subclass that runs its base's forward (one FSDP2 makes by swapping a wrapped module's class, or
one that only adds attributes) gets its base's rule; a subclass with a forward of its own (timm's
LayerNorm2d permutes its input, LayerNormAct adds an activation) gets none unless it is listed.
Each rule declares how a layer call's pieces are built and the forms it keeps, each form's
`norm_sq()` adding that form's rounding bound:

* nn.Linear over [B, T, in] (T = all middle positions): the weight's input a_i [T, in] and output
  gradient g_i [T, out] (`OuterProduct`), the bias instantiated. A Linear with a gradient map
  (DP-GRAPE, `LinearGradientMap`): the same with (a, gP) or (aP, g).
* nn.Embedding (no max_norm, scale_grad_by_freq or sparse): token ids and g (`EmbeddingRows`).
* nn.LayerNorm, timm's too: per-example [B, d] weight and bias gradients, x̂ recomputed from the
  saved input (`Instantiated`: d numbers per example).
* Any other layer (GroupNorm, Conv2d, DP-ViT's token embedding, ...): its per-example gradient
  instantiated by Opacus's grad sampler (functorch, all its parameters and children at once, for
  layers Opacus does not know). Their per-example gradients are small in the models here (norm
  scales, biases, small convs), so the instantiated form is the cheap one.

Rows that belong to one example (candidate scoring: R = K·B rows, example-major) are merged into
the token axis, which is exact for these layers: the example's gradient sums over its rows and
tokens alike.

Adding a layer kind: its rule (a pieces function, its forms; a new form in pieces.py with its
rounding bound), one entry in `RULES`, and an adversarial case in tests/privacy/test_layer_catalogue.py,
which requires one for every entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer
from torch import nn

from dpbench.privacy.clipping import sum_rows_per_example
from dpbench.privacy.pieces import EmbeddingRows, Instantiated, OuterProduct, Piece


class LinearGradientMap(Protocol):
    """A linear map applied to a Linear layer's per-example weight gradients (DP-GRAPE's projection).

    `pair(a, g)` -> (a', g') with mapped G_i = Σ_t g'_tᵀ a'_t; `map_gradient(param, grad)` maps a
    summed gradient of the layer's parameter (identity for the bias); `sum_shape(param)` is the
    shape of the mapped gradient (`summed_shapes`)."""

    def pair(self, activations: torch.Tensor, backprops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def map_gradient(self, param: nn.Parameter, gradient: torch.Tensor) -> torch.Tensor: ...

    def sum_shape(self, param: nn.Parameter) -> torch.Size: ...


def summed_shapes(overrides: dict) -> dict[nn.Parameter, torch.Size]:
    """The shape of each clipped sum that an override changes (its `sum_shape`: DP-GRAPE's projected
    one); every other parameter's sum has the parameter's shape. Every engine gives a parameter no
    hook reached in a chunk zeros of this shape, so that chunks add up whichever layers each reached."""
    return {p: torch.Size(override.sum_shape(p)) for module, override in overrides.items()
            if hasattr(override, "sum_shape") for p in module.parameters(recurse=False) if p.requires_grad}


def zero_sum(param: nn.Parameter, shapes: dict[nn.Parameter, torch.Size], rows: tuple[int, ...] = (),
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Zeros in the shape of `param`'s clipped sum (`summed_shapes`), after `rows` (e.g. (B,): per example)."""
    return torch.zeros((*rows, *shapes.get(param, param.shape)), device=param.device, dtype=dtype)


# (module, its inputs, its output gradient, examples B) -> {parameter: piece}
PiecesFn = Callable[[nn.Module, list, torch.Tensor, int], dict]


def _always(module: nn.Module) -> bool:
    return True


@dataclass(frozen=True)
class PieceRule:
    """How one layer kind's per-example gradients are kept.

    `pieces`: one layer call's pieces per trainable parameter, from its inputs and output gradient
    (an example's rows and positions become its tokens). `forms`: the piece forms it returns; each
    form's `norm_sq()` is the computed squared norm plus that form's rounding bound (pieces.py).
    `applies`: the layer configurations the pieces are right for (the others are instantiated)."""

    pieces: PiecesFn
    forms: tuple[type[Piece], ...]
    applies: Callable[[nn.Module], bool] = _always


def _tokens(x: torch.Tensor, examples: int) -> torch.Tensor:
    """[R, ..., d] -> [B, T, d]: every position of an example's rows becomes a token."""
    return x.reshape(examples, -1, x.shape[-1])


def _linear_pieces(module: nn.Linear, activations, backprops, examples: int,
                   gradient_map: LinearGradientMap | None = None) -> dict:
    a = _tokens(activations[0].to(backprops.dtype), examples)
    g = _tokens(backprops, examples)
    pieces = {}
    if module.bias is not None and module.bias.requires_grad:
        pieces[module.bias] = Instantiated(g.sum(dim=1, dtype=torch.float32))  # bf16 rows: summed and kept in fp32
    if module.weight.requires_grad:
        if gradient_map is not None:
            a, g = gradient_map.pair(a, g)
        pieces[module.weight] = OuterProduct(a, g)
    return pieces


def _embedding_pieces(module: nn.Embedding, activations, backprops, examples: int) -> dict:
    ids = activations[0].reshape(examples, -1)
    g = _tokens(backprops, examples)
    if module.padding_idx is not None:  # the padding row gets no gradient
        g = g * (ids != module.padding_idx).unsqueeze(-1).to(g.dtype)
    return {module.weight: EmbeddingRows(ids, g, module.num_embeddings)} if module.weight.requires_grad else {}


def _plain_embedding(module: nn.Embedding) -> bool:
    """An embedding whose gradient is its output gradient's rows, scattered by id."""
    return module.max_norm is None and not module.scale_grad_by_freq and not module.sparse


def _layer_norm_pieces(module: nn.LayerNorm, activations, backprops, examples: int) -> dict:
    """Per-example gradients of a LayerNorm's weight Σ_t x̂_t ⊙ g_t and bias Σ_t g_t, [B, *shape]
    (fp32): x̂ recomputed from the saved input, an example's rows and positions summed at once."""
    shape = tuple(module.normalized_shape)
    g = backprops.reshape(examples, -1, *shape).float()
    pieces = {}
    if module.weight is not None and module.weight.requires_grad:
        normed = F.layer_norm(activations[0].reshape(examples, -1, *shape).float(), shape, eps=module.eps)
        pieces[module.weight] = Instantiated(normed.mul_(g).sum(dim=1))  # normed is new: no copy
    if module.bias is not None and module.bias.requires_grad:
        pieces[module.bias] = Instantiated(g.sum(dim=1))
    return pieces


LINEAR = PieceRule(_linear_pieces, forms=(OuterProduct, Instantiated))
EMBEDDING = PieceRule(_embedding_pieces, forms=(EmbeddingRows,), applies=_plain_embedding)
LAYER_NORM = PieceRule(_layer_norm_pieces, forms=(Instantiated,))

RULES: dict[type[nn.Module] | str, PieceRule] = {
    nn.Linear: LINEAR,
    nn.Embedding: EMBEDDING,
    nn.LayerNorm: LAYER_NORM,
    # F.layer_norm over `normalized_shape` in a forward of its own (a fused-kernel option). Named,
    # not imported: timm stays unimported. Without a rule Opacus (exact types) sends it whole to
    # functorch, whose vmap holds a layer norm's forward and backward for the whole batch at once.
    "timm.layers.norm.LayerNorm": LAYER_NORM,
}


def rule_for(module: nn.Module) -> PieceRule | None:
    """The rule of the module's class or of its nearest base in `RULES`, if the module runs that
    class's forward; else None."""
    kind = type(module)
    for base in kind.__mro__:
        rule = RULES.get(base)
        if rule is None:
            rule = RULES.get(f"{base.__module__}.{base.__qualname__}")
        if rule is not None:
            return rule if kind.forward is base.forward else None
    return None


def is_layer_norm(module: nn.Module) -> bool:
    """A layer norm with nn.LayerNorm's function: F.layer_norm over `normalized_shape`."""
    return rule_for(module) is LAYER_NORM


def is_gradient_map(override) -> bool:
    return hasattr(override, "pair")


def has_rule(module: nn.Module, override=None) -> bool:
    """Whether the layer's pieces come from a rule (not from a grad sampler or functorch)."""
    if is_gradient_map(override):
        return True
    rule = rule_for(module) if override is None else None
    return rule is not None and rule.applies(module)


def by_functorch(module: nn.Module) -> bool:
    """A layer with neither a rule nor an Opacus grad sampler (and no override): functorch
    instantiates its per-example gradients, all its parameters (children included) at once."""
    return not has_rule(module) and type(module) not in GradSampleModule.GRAD_SAMPLERS


def layer_pieces(module: nn.Module, activations, backprops: torch.Tensor, examples: int, override=None) -> dict:
    """One layer call's pieces per trainable parameter. `override`: a `LinearGradientMap` (a Linear
    layer) or an Opacus-signature grad sampler (instantiated form)."""
    check_rows(module, [activations[0] if activations else None, backprops], examples)
    if is_gradient_map(override):
        return _linear_pieces(module, activations, backprops, examples, override)
    rule = rule_for(module) if override is None else None
    if rule is not None and rule.applies(module):
        return rule.pieces(module, activations, backprops, examples)
    sampler = override or GradSampleModule.GRAD_SAMPLERS.get(type(module), ft_compute_per_sample_gradient)
    return _instantiated_pieces(sampler, module, activations, backprops, examples)


def check_rows(module: nn.Module, tensors, examples: int) -> None:
    """Never reshape rows that do not split into the examples (a [T, B, d] input with T not a
    multiple of B would reshape silently into mixed "examples"); the layout probe (layout.py)
    refuses such a model before training, this is the engines' own guard."""
    from dpbench.errors import UserError

    for t in tensors:
        if examples and torch.is_tensor(t) and t.dim() and t.shape[0] % examples:
            raise UserError(f"layer {type(module).__name__}: {t.shape[0]} rows along dimension 0 for {examples} "
                            "examples; every per-example engine needs each example's rows together along "
                            "dimension 0: feed it batch-first tensors (e.g. batch_first=True)")


def _instantiated_pieces(sampler, module, activations, backprops, examples: int) -> dict:
    grads = sampler(module, activations, backprops)
    return {p: Instantiated(sum_rows_per_example(gs, examples)) for p, gs in grads.items() if p.requires_grad}


def hooked_modules(model: nn.Module, overrides: dict) -> list[nn.Module]:
    """Modules that own trainable parameters, as Opacus walks them: a module without a known
    per-sample rule is handed whole to functorch, so its children are not walked."""
    found = []

    def walk(module):
        own = any(p.requires_grad for p in module.parameters(recurse=False))
        known = module in overrides or rule_for(module) is not None or type(module) in GradSampleModule.GRAD_SAMPLERS
        if own:
            found.append(module)
            if not known:
                return
        for child in module.children():
            walk(child)

    walk(model)
    return found


# --- corrections to Opacus's grad samplers ------------------------------------------------------
# Opacus 1.6's conv sampler unfolds with zero padding whatever the padding mode (reflect, replicate
# and circular convs got norms 10–32% low), and its embedding sampler gives the padding row a
# gradient that autograd does not (39% high). Both are corrected per module instance, as overrides.


def _functorch_sampler(module: nn.Module):
    """functorch's per-example gradient of the module's own forward (its padding mode included)."""
    prepare_layer(module)
    return ft_compute_per_sample_gradient


def embedding_grad_sample(layer: nn.Embedding, activations, backprops, *, zero_padding_row: bool = False) -> dict:
    """Opacus's embedding grad sampler (its scatter of each example's token gradients into [B, V, d]),
    writing into the per-example gradient a tied output layer already left on the weight.

    Opacus would form a second [B, V, d] and add it (`create_or_accumulate_grad_sample`): two
    vocabulary-wide per-example tables at once (RoBERTa-large at B = 40: 2 x 8.2 GB). Here the
    scatter goes into that buffer, and a first table becomes the buffer itself (the materialize
    engine, per_sample.py, does the same for a Linear's weight). `zero_padding_row`: the padding
    row gets no gradient from this layer, as autograd gives it none (the tied layer's part stays)."""
    weight = layer.weight
    if not weight.requires_grad:
        return {}
    ids = activations[0]
    examples, width = ids.shape[0], layer.embedding_dim
    current = getattr(weight, "_current_grad_sample", None)
    target = current[:examples] if current is not None else \
        torch.zeros(examples, *weight.shape, device=weight.device, dtype=backprops.dtype)
    kept = target[:, layer.padding_idx].clone() if zero_padding_row and layer.padding_idx is not None else None
    index = ids.unsqueeze(-1).expand(*ids.shape, width).reshape(examples, -1, width)
    target.scatter_add_(1, index, backprops.reshape(examples, -1, width).to(target.dtype))
    if kept is not None:
        target[:, layer.padding_idx] = kept
    if current is not None:
        return {}
    if examples == getattr(layer, "max_batch_len", None):  # Opacus would copy it into a zeroed twin
        weight._current_grad_sample = target
        return {}
    return {weight: target}


def _embedding_without_padding_row(layer: nn.Embedding, activations, backprops) -> dict:
    return embedding_grad_sample(layer, activations, backprops, zero_padding_row=True)


def opacus_corrections(model: nn.Module, *, embeddings: bool) -> dict:
    """{module: grad sampler} for the layers whose Opacus sampler is wrong: convs with a padding
    mode other than zeros, and (`embeddings`: engines that use Opacus's embedding sampler) an
    Embedding with a padding row."""
    corrections = {}
    for module in model.modules():
        if isinstance(module, nn.modules.conv._ConvNd) and module.padding_mode != "zeros":
            corrections[module] = _functorch_sampler(module)
        elif embeddings and type(module) is nn.Embedding and module.padding_idx is not None:
            corrections[module] = _embedding_without_padding_row
    return corrections
