"""Book-keeping (Bu et al., ICML 2023) and ghost clipping without per-example gradients.

`algo.per_sample=bk`: one backward pass of the summed loss. Hooks keep, for each trainable layer,
what its per-example gradient is made of, then each example's norm, the clip factors f_i and the
clipped sum Σ_i f_i G_i in one matmul per layer:

* Linear over [B, T, in] (T = all middle positions): input a_i [T, in], output gradient g_i
  [T, out], G_i = g_iᵀ a_i. ‖G_i‖² = Σ_{t,s} (a_i a_iᵀ)_{ts} (g_i g_iᵀ)_{ts} (ghost norm, T² per
  example) when T² < in·out, else from the instantiated G_i; the layer keeps (a, g) when
  T·(in+out) < in·out, else G_i, whichever is smaller (fastDP's "mixed" choice). Clipped sum:
  (f ⊙ g)ᵀ a over all B·T rows.
* A Linear with a gradient map (DP-GRAPE): the same with (a, gP) or (aP, g), so the projected
  per-example gradient is never formed unless that is the smaller form.
* Embedding: token ids and g; ghost norm through equal-id pairs; clipped sum by index_add.
* LayerNorm (timm's too): per-example [B, d] weight and bias gradients, x̂ recomputed from the
  saved input (instantiated: d numbers per example).
* Any other layer (GroupNorm, Conv2d, DP-ViT's token embedding, ...): its per-example
  gradient instantiated by Opacus's grad sampler (functorch for layers Opacus does not know).
  Their per-example gradients are small in the models here (norm scales, biases, small convs),
  so the instantiated form is the cheap one and the hand-written ghost forms are not needed.

`algo.per_sample=ghost`: the same hooks in a first backward keep nothing but each example's squared
norm (one layer's working set at a time); a second backward through the same graph rebuilds each
layer's pieces and sums f_i G_i in fp32 as they arrive, capped per parameter at the norm the first
pass measured (so the bound holds even if the GPU's kernels are not deterministic). Opacus's ghost
clipping instead backpropagates Σ_i f_i ℓ_i with autograd, which under autocast sums in bf16.

Both engines check once, against autograd's own summed gradient, that every trainable parameter's
gradient is made only of what the hooks saw (a parameter read outside its module's forward would
otherwise be released without a per-example norm), and give a non-finite example clip factor 0.

Written by hand because Opacus 1.6 has no book-keeping and its ghost clipping sums in low
precision. Rows that belong to one example (candidate scoring: R = K·B rows, example-major) are
merged into the token axis, which is exact for these layers: the example's gradient sums over its
rows and tokens alike. A parameter used by several layer calls (tied or reused) has the norm of
its summed per-example gradient, not the parts' norms: calls of one layer kind concatenate their
tokens; an output layer tied to the input embedding keeps both parts and adds their cross term
(`TiedPieces`); anything else is instantiated and summed.
"""

from __future__ import annotations

from collections import Counter
from functools import partial
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from opacus.grad_sample import GradSampleModule
from opacus.grad_sample.functorch import ft_compute_per_sample_gradient, prepare_layer
from torch import nn
from torch.autograd.graph import get_gradient_edge

from dpbench.errors import UserError
from dpbench.privacy.clipping import clipped_sum, sum_rows_per_example

FactorsFn = Callable[[torch.Tensor], torch.Tensor]


class LinearGradientMap(Protocol):
    """A linear map applied to a Linear layer's per-example weight gradients (DP-GRAPE's projection).

    `pair(a, g)` -> (a', g') with mapped G_i = Σ_t g'_tᵀ a'_t; `map_gradient(param, grad)` maps a
    summed gradient of the layer's parameter (identity for the bias)."""

    def pair(self, activations: torch.Tensor, backprops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def map_gradient(self, param: nn.Parameter, gradient: torch.Tensor) -> torch.Tensor: ...


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _scaled_rows(g: torch.Tensor, factors: torch.Tensor, all_finite: bool = False, in_place: bool = False) -> torch.Tensor:
    """f_i · g_i in fp32 (one new tensor: bf16 · fp32 promotes in the product; `in_place`: into an
    fp32 g nothing else reads), rows with f_i = 0 zeroed in place so that 0 · inf cannot poison the
    sum (unless `all_finite`: no f_i is 0)."""
    factors = factors.float().view(-1, *([1] * (g.dim() - 1)))
    scaled = g.mul_(factors) if in_place else torch.mul(g, factors)
    if not all_finite:
        scaled.masked_fill_(factors == 0, 0.0)
    return scaled.float()  # (a float64 model: cast back)


def _keep_rows(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Zero the examples whose clip factor is 0 (non-finite gradient), so 0 · inf cannot poison
    the sum; materialize's clipped_sum drops them the same way."""
    return torch.where(keep.view(-1, *([1] * (x.dim() - 1))), x, torch.zeros((), dtype=x.dtype, device=x.device))


class Instantiated:
    """Per-example gradients [B, ...] of one parameter."""

    def __init__(self, grad_sample: torch.Tensor):
        self.grad_sample = grad_sample

    def nbytes(self) -> int:
        return _bytes(self.grad_sample)

    def tensors(self) -> list[torch.Tensor]:
        return [self.grad_sample]

    def instantiate(self) -> torch.Tensor:
        return self.grad_sample

    def compact(self, input_readers: int = 1):
        return self

    def norm_sq(self) -> torch.Tensor:
        return self.grad_sample.reshape(self.grad_sample.shape[0], -1).float().pow(2).sum(dim=1)

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        if not all_finite:  # zero the rows of dropped examples first (0 · inf)
            return clipped_sum([self.grad_sample], factors)[0]
        flat = self.grad_sample.reshape(self.grad_sample.shape[0], -1).float()
        return (factors.float() @ flat).view(self.grad_sample.shape[1:])


class OuterProduct:
    """Per-example weight gradients G_i = g_iᵀ a_i [out, in] from a [B, T, in] and g [B, T, out]."""

    def __init__(self, activations: torch.Tensor, backprops: torch.Tensor):
        self.a, self.g = activations, backprops

    def nbytes(self) -> int:
        return _bytes(self.a, self.g)

    def tensors(self) -> list[torch.Tensor]:
        return [self.a, self.g]

    def instantiate(self) -> torch.Tensor:
        return torch.einsum("bto,bti->boi", self.g, self.a)

    def compact(self, input_readers: int = 1):
        """The smaller of (a, g) and the instantiated G_i, by the bytes each adds: an input that
        `input_readers` layers keep (q, k and v read one) costs each of them its share."""
        kept = self.g.numel() * self.g.element_size() + self.a.numel() * self.a.element_size() / max(input_readers, 1)
        instantiated = self.a.shape[0] * self.a.shape[2] * self.g.shape[2] * self.g.element_size()
        return Instantiated(self.instantiate()) if instantiated <= kept else self

    def norm_sq(self) -> torch.Tensor:
        tokens, d_in, d_out = self.a.shape[1], self.a.shape[2], self.g.shape[2]
        a, g = self.a.float(), self.g.float()
        if tokens * tokens >= d_in * d_out:
            return self.instantiate().float().flatten(1).pow(2).sum(dim=1)
        gram_a = torch.bmm(a, a.transpose(1, 2))  # [B, T, T]
        gram_g = torch.bmm(g, g.transpose(1, 2))
        return (gram_a * gram_g).sum(dim=(1, 2)).clamp(min=0)

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        """Σ_i f_i G_i = (f ⊙ g)ᵀ a = gᵀ (f ⊙ a). Rows of dropped examples (f_i = 0: a non-finite
        gradient) are zeroed in a and g, unless `all_finite` says no f_i is 0 (then every row is
        finite). The factors scale g in place when `own_g` says nothing else reads it (book-keeping
        after its backward: no copy, no new memory), else a copy of the narrower of a and g."""
        def unscaled(x):
            return x.float() if all_finite else _keep_rows(x.float(), factors > 0)

        if own_g and self.g.dtype == torch.float32 and self.g.is_contiguous():
            a, g = unscaled(self.a), _scaled_rows(self.g, factors, all_finite, in_place=True)
        elif self.a.shape[2] < self.g.shape[2]:
            a, g = _scaled_rows(self.a, factors, all_finite), unscaled(self.g)
        else:
            a, g = unscaled(self.a), _scaled_rows(self.g, factors, all_finite)
        return g.reshape(-1, g.shape[2]).transpose(0, 1) @ a.reshape(-1, a.shape[2])  # [out, in]

    def merge(self, other: "OuterProduct") -> "OuterProduct":
        """Two calls of one layer: their tokens concatenate (G_i = Σ over both calls)."""
        return OuterProduct(torch.cat([self.a, other.a], dim=1), torch.cat([self.g, other.g], dim=1))


class EmbeddingRows:
    """Per-example gradients of an embedding table [V, d] from token ids [B, T] and g [B, T, d]."""

    def __init__(self, ids: torch.Tensor, backprops: torch.Tensor, num_embeddings: int):
        self.ids, self.g, self.num_embeddings = ids, backprops, num_embeddings

    def nbytes(self) -> int:
        return _bytes(self.ids, self.g)

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids, self.g]

    def instantiate(self) -> torch.Tensor:
        batch, _, dim = self.g.shape
        grads = torch.zeros((batch, self.num_embeddings, dim), dtype=self.g.dtype, device=self.g.device)
        return grads.scatter_add_(1, self.ids.unsqueeze(-1).expand(-1, -1, dim), self.g)

    def compact(self, input_readers: int = 1):
        tokens, dim = self.ids.shape[1], self.g.shape[2]
        return Instantiated(self.instantiate()) if self.num_embeddings * dim <= tokens * (dim + 1) else self

    def norm_sq(self) -> torch.Tensor:
        g = self.g.float()
        same_row = (self.ids.unsqueeze(2) == self.ids.unsqueeze(1)).float()  # [B, T, T]
        return (same_row * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2)).clamp(min=0)

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        g = _scaled_rows(self.g, factors, all_finite)
        table = torch.zeros((self.num_embeddings, g.shape[2]), dtype=torch.float32, device=g.device)
        return table.index_add_(0, self.ids.reshape(-1), g.reshape(-1, g.shape[2]))

    def merge(self, other: "EmbeddingRows") -> "EmbeddingRows":
        return EmbeddingRows(torch.cat([self.ids, other.ids], 1), torch.cat([self.g, other.g], 1), self.num_embeddings)


def _ties(outer: OuterProduct, rows: EmbeddingRows) -> bool:
    """An output layer [V, d] (g: [B, T, V], a: [B, T, d]) and an embedding table [V, d]."""
    return outer.g.shape[2] == rows.num_embeddings and outer.a.shape[2] == rows.g.shape[2]


def _outer_embedding_cross(outer: OuterProduct, rows: EmbeddingRows) -> torch.Tensor:
    """⟨g_iᵀ a_i, E_i⟩ per example for an output layer [V, d] tied to an embedding table [V, d]
    (E_i[v] = Σ_{s: id_s = v} g'_s): Σ_{t,s} g_t[id_s] (a_t · g'_s), a [B, T, T'] product instead
    of two [B, V, d] per-example tables."""
    tokens = outer.g.shape[1]
    picked = outer.g.gather(2, rows.ids.unsqueeze(1).expand(-1, tokens, -1)).float()  # g_t[id_s]: [B, T, T']
    return (picked * torch.bmm(outer.a.float(), rows.g.float().transpose(1, 2))).sum(dim=(1, 2))


class TiedPieces:
    """One parameter read by layers of different kinds (a language model's output layer tied to
    its input embedding): the parts kept apart, ‖Σ_k G_k‖² = Σ_k ‖G_k‖² + 2 Σ_{j<k} ⟨G_j, G_k⟩
    with the cross terms in ghost form, so no per-example table is formed unless it is smaller."""

    def __init__(self, outer: OuterProduct, rows: EmbeddingRows):
        self.outer, self.rows = outer, rows

    def nbytes(self) -> int:
        return self.outer.nbytes() + self.rows.nbytes()

    def tensors(self) -> list[torch.Tensor]:
        return self.outer.tensors() + self.rows.tensors()

    def instantiate(self) -> torch.Tensor:
        return self.outer.instantiate() + self.rows.instantiate()

    def compact(self, input_readers: int = 1):
        batch, vocab, dim = self.rows.g.shape[0], self.rows.num_embeddings, self.rows.g.shape[2]
        return Instantiated(self.instantiate()) if batch * vocab * dim * self.rows.g.element_size() <= self.nbytes() else self

    def norm_sq(self) -> torch.Tensor:
        cross = _outer_embedding_cross(self.outer, self.rows)
        return (self.outer.norm_sq() + self.rows.norm_sq() + 2 * cross).clamp(min=0)

    def clipped_sum(self, factors: torch.Tensor, all_finite: bool = False, own_g: bool = False) -> torch.Tensor:
        return self.outer.clipped_sum(factors, all_finite) + self.rows.clipped_sum(factors, all_finite)

    def merge(self, other):
        """A third call of the parameter: joined to the part of its kind."""
        if isinstance(other, OuterProduct):
            return TiedPieces(self.outer.merge(other), self.rows)
        if isinstance(other, EmbeddingRows):
            return TiedPieces(self.outer, self.rows.merge(other))
        raise RuntimeError("not a part of this tie")


def _tie(first, second):
    """TiedPieces for an output layer and an embedding sharing one table, else None."""
    for outer, rows in ((first, second), (second, first)):
        if isinstance(outer, OuterProduct) and isinstance(rows, EmbeddingRows) and _ties(outer, rows):
            return TiedPieces(outer, rows)
    return None


def _merge(first, second):
    if (type(first) is type(second) or isinstance(first, TiedPieces)) and hasattr(first, "merge"):
        try:
            return first.merge(second)
        except RuntimeError:  # shapes that do not concatenate: fall through to instantiation
            pass
    tied = _tie(first, second)
    if tied is not None:
        return tied
    return Instantiated(first.instantiate() + second.instantiate())


def _tokens(x: torch.Tensor, examples: int) -> torch.Tensor:
    """[R, ..., d] -> [B, T, d]: every position of an example's rows becomes a token."""
    return x.reshape(examples, -1, x.shape[-1])


def _linear_pieces(module: nn.Linear, activations, backprops, examples: int, gradient_map) -> dict:
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


# LayerNorm classes whose forward is F.layer_norm over `normalized_shape` (timm's adds a fused-kernel
# option). Opacus looks samplers up by exact type and sends any other class whole to functorch,
# whose vmap holds a layer norm's forward and backward for the whole batch at once: 245 MiB of the
# ViT shape's peak came from timm's LayerNorm there. Names, not classes: timm stays unimported.
LAYER_NORMS = frozenset({"torch.nn.modules.normalization.LayerNorm", "timm.layers.norm.LayerNorm"})


def is_layer_norm(module: nn.Module) -> bool:
    kind = type(module)
    return f"{kind.__module__}.{kind.__qualname__}" in LAYER_NORMS


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


def _plain_embedding(module: nn.Module) -> bool:
    return type(module) is nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq and not module.sparse


def _instantiated_pieces(sampler, module, activations, backprops, examples: int) -> dict:
    grads = sampler(module, activations, backprops)
    return {p: Instantiated(sum_rows_per_example(gs, examples)) for p, gs in grads.items() if p.requires_grad}


def _hooked_modules(model: nn.Module, overrides: dict) -> list[nn.Module]:
    """Modules that own trainable parameters, as Opacus walks them: a module without a known
    per-sample rule is handed whole to functorch, so its children are not walked."""
    found = []

    def walk(module):
        own = any(p.requires_grad for p in module.parameters(recurse=False))
        known = module in overrides or type(module) in (nn.Linear, nn.Embedding) or is_layer_norm(module) \
            or type(module) in GradSampleModule.GRAD_SAMPLERS
        if own:
            found.append(module)
            if not known:
                return
        for child in module.children():
            walk(child)

    walk(model)
    return found


class BookKeeping:
    """Clipped per-example gradient sums from layer inputs and output gradients (see module doc).

    `passes=1` is book-keeping; `passes=2` is ghost clipping (norms, then a second backward whose
    hooks sum the clipped pieces in fp32). `overrides` maps module instances to a
    `LinearGradientMap` (Linear layers) or to an Opacus-signature grad sampler (instantiated form)."""

    def __init__(self, model: nn.Module, overrides: dict | None = None, passes: int = 1):
        self.model = model
        self.overrides = dict(overrides or {})
        self.passes = passes
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.modules = _hooked_modules(model, self.overrides)
        # Layers without a rule or an Opacus sampler go whole through functorch (all their
        # parameters, children included), as in Opacus.
        self._functorch = {
            m for m in self.modules
            if m not in self.overrides and not self._has_rule(m) and type(m) not in GradSampleModule.GRAD_SAMPLERS
        }
        for module in self._functorch:
            prepare_layer(module)
        self._activations: dict[nn.Module, list] = {}
        self._replay: dict[nn.Module, list] = {}  # ghost: activations again for the second backward
        self._pending: dict[nn.Parameter, int] = {}
        self._calls: dict[nn.Parameter, int] = {}
        self._open: dict[nn.Parameter, object] = {}  # pieces awaiting more calls of their parameter
        self._kept: dict[nn.Parameter, object] = {}  # book-keeping: pieces for the clipped sum
        self._norm_sq: dict[nn.Parameter, torch.Tensor] = {}
        self._summed: dict[nn.Parameter, torch.Tensor] = {}  # ghost's second pass, or the coverage check
        self._factors: torch.Tensor | None = None  # set while the second pass sums
        self._entry_edges: list[tuple] = []  # bottom layers' calls: (module, its inputs, its output's edge)
        self._readers: dict[int, int] = {}  # layers reading each input storage in this forward
        self._held: set[int] = set()  # storages of the kept pieces (a shared input is held once)
        self._examples = 0
        self._held_bytes = 0
        self._coverage_checked = False
        self.tolerance = 1e-4  # coverage check; low precision (autocast) rounds autograd's own sums more
        self.working_bytes = 0  # per-example bytes held at the peak of the last backward
        self.peak_bytes = 0  # ... of any backward (what the run reports)
        self._enabled = True
        self._handles = []
        for module in self.modules:
            self._handles.append(module.register_forward_hook(self._capture_activations))

    def _has_rule(self, module) -> bool:
        override = self.overrides.get(module)
        return hasattr(override, "pair") or type(module) is nn.Linear or _plain_embedding(module) or is_layer_norm(module)

    # --- hooks ---------------------------------------------------------------------------
    def _capture_activations(self, module, inputs, output):
        """Forward hook: keep the layer's inputs and ask for its output's gradient. A pre-hook on
        the output's autograd node rather than a full module backward hook, which wraps every input
        and output of the layer in an extra autograd node."""
        if not (self._enabled and torch.is_grad_enabled()):
            return
        activations = [t.detach() for t in inputs]
        self._activations.setdefault(module, []).append(activations)
        if inputs and torch.is_tensor(inputs[0]):
            storage = _storage(inputs[0])
            self._readers[storage] = self._readers.get(storage, 0) + 1
        for p in module.parameters(recurse=module in self._functorch):
            if p.requires_grad:
                self._pending[p] = self._pending.get(p, 0) + 1
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if torch.is_tensor(first) and first.grad_fn is not None:
            # On the node that made the output, not on the tensor: an in-place change of the
            # output after this forward would hand a tensor hook the gradient of the changed value.
            first.grad_fn.register_prehook(partial(self._capture_backprops, module, first.output_nr))
            if not any(torch.is_tensor(t) and t.requires_grad for t in inputs):
                self._entry_edges.append((module, activations, get_gradient_edge(first)))

    def _capture_backprops(self, module, index, output_grads):
        if self._enabled and output_grads[index] is not None:
            self._take(module, self._activations[module].pop(), output_grads[index])

    def _take(self, module, activations, output_grad) -> None:
        """One layer call's input and output gradient: its pieces, closed when its parameters'
        last call is in."""
        if self.passes == 2 and self._factors is None:
            self._replay.setdefault(module, []).append(activations)
        backprops = output_grad.detach()
        for p, piece in self._pieces(module, activations, backprops).items():
            self._open[p] = piece if p not in self._open else _merge(self._open[p], piece)
            self._pending[p] -= 1
            if self._pending[p] == 0:
                self._close(p)

    def _pieces(self, module, activations, backprops) -> dict:
        override = self.overrides.get(module)
        if hasattr(override, "pair"):
            return _linear_pieces(module, activations, backprops, self._examples, override)
        if override is None and type(module) is nn.Linear:
            return _linear_pieces(module, activations, backprops, self._examples, None)
        if override is None and _plain_embedding(module):
            return _embedding_pieces(module, activations, backprops, self._examples)
        if override is None and is_layer_norm(module):
            return _layer_norm_pieces(module, activations, backprops, self._examples)
        sampler = override or GradSampleModule.GRAD_SAMPLERS.get(type(module), ft_compute_per_sample_gradient)
        return _instantiated_pieces(sampler, module, activations, backprops, self._examples)

    def _backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """Backpropagate to every layer's output, computing no weight gradient.

        autograd is asked for the gradients of the bottom layers' outputs (layers none of whose
        inputs requires grad), at the nodes that made them: every other layer's backward runs (its
        hook fires) and nothing below those outputs does, so not even the bottom layers' weight
        gradients are formed. That matters for a tied table: asking for the input embedding's
        gradient (`backward_through_layers`, the materialize engine's way) also computes the tied
        output layer's [V, d] weight gradient, a matmul as large as its input gradient's. The bottom
        layers' own hooks do not fire (their nodes do not run): their output gradients come back
        from autograd instead. No bottom layer (the data itself requires grad): a full backward."""
        if not self._entry_edges:
            loss.backward(retain_graph=retain_graph)
            return
        for module, activations, _ in self._entry_edges:
            # Off the stacks first: a layer also called on a hidden state pops only that call's inputs.
            stack = self._activations.get(module, [])
            index = next((i for i, kept in enumerate(stack) if kept is activations), None)
            if index is not None:
                del stack[index]
        edges = [edge for _, _, edge in self._entry_edges]
        grads = torch.autograd.grad(loss, edges, retain_graph=retain_graph, allow_unused=True)
        for (module, activations, _), grad in zip(self._entry_edges, grads):
            if grad is not None:  # (None: the call's output did not reach the loss)
                self._take(module, activations, grad)

    def _close(self, p: nn.Parameter) -> None:
        """All calls of p are in: its squared norms and, by pass, what is kept of it."""
        piece = self._open.pop(p)
        if self._factors is not None:  # ghost's second pass: this parameter's clipped sum, now
            self._summed[p] = self._second_pass_sum(p, piece)
            self.working_bytes = max(self.working_bytes, piece.nbytes() + self._open_bytes())
            return
        if not self._coverage_checked:  # unclipped sum, compared with autograd's (first call only)
            self._summed[p] = piece.clipped_sum(torch.ones(self._examples, device=piece_device(piece)))
        if self.passes == 1:
            piece = piece.compact(self._readers.get(_storage(piece.a), 1) if isinstance(piece, OuterProduct) else 1)
        self._norm_sq[p] = piece.norm_sq()
        transient = piece.nbytes()
        if self.passes == 1:
            self._kept[p] = piece
            self._held_bytes += _new_bytes(piece.tensors(), self._held)
            transient = 0
        self.working_bytes = max(self.working_bytes, self._held_bytes + transient + self._open_bytes())

    def _second_pass_sum(self, p: nn.Parameter, piece) -> torch.Tensor:
        """Σ_i f_i G_i for one parameter from the second backward's piece, in fp32.

        The second backward recomputes G_i; on a deterministic backend it is bit for bit the one
        whose norm the first pass measured. Where kernels are not deterministic (atomics on a GPU)
        each parameter's contribution is capped at the norm measured in the first pass, so that
        Σ_p ‖f_i G_{i,p}‖² ≤ f_i² ‖G_i‖² ≤ C² holds whatever the kernels did; a row that turned
        non-finite is dropped."""
        measured, again = self._norm_sq[p], piece.norm_sq()
        finite = torch.isfinite(again)
        cap = torch.where(again > measured, (measured / again.clamp(min=1e-30)).sqrt(), torch.ones_like(again))
        cap = torch.where(finite, cap, torch.zeros_like(cap))
        return piece.clipped_sum(self._factors * cap)

    def _open_bytes(self) -> int:
        return sum(piece.nbytes() for piece in self._open.values())

    # --- the engine interface -----------------------------------------------------------------
    def clipped_sum(self, losses: torch.Tensor, factors_fn: FactorsFn) -> list[torch.Tensor]:
        """Σ_i f_i g_i (fp32, aligned with `params`) for per-example losses [B]; `peak_bytes`
        meters the per-example working bytes held at the peak."""
        self._examples = losses.shape[0]
        self.working_bytes = self._held_bytes = 0
        try:
            self._calls = dict(self._pending)
            keep_graph = self.passes == 2
            if self._coverage_checked:
                self._backward(losses.sum(), retain_graph=keep_graph)
            else:  # autograd's own weight gradients too, once, for the coverage check
                losses.sum().backward(retain_graph=keep_graph)
            self._finish_pass()
            if not self._coverage_checked:
                self._check_coverage()
            self._drop_grads()
            norms = self._norms(losses)
            factors = factors_fn(norms)
            sums = self._book_kept_sums(factors) if self.passes == 1 else self._reweighted_sums(losses, factors)
        finally:
            self._reset()
        self.peak_bytes = max(self.peak_bytes, self.working_bytes)
        return sums

    def _finish_pass(self) -> None:
        for p in list(self._open):  # a call whose output did not reach the loss
            self._close(p)

    def _check_coverage(self) -> None:
        """Refuse a trainable parameter whose gradient has a part no hook saw (a parameter read
        outside its module's forward, e.g. by a parent module): no per-example norm would cover
        that part. Compares autograd's summed gradient with the sum of the hooks' pieces, once."""
        uncovered = []
        names = {p: n for n, p in self.model.named_parameters()}
        maps = {p: o for m, o in self.overrides.items() if hasattr(o, "map_gradient") for p in m.parameters()}
        grads = [p.grad for p in self.params if p.grad is not None]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self._summed.clear()
            return  # a non-finite example: compare on a later call
        # Rounding is measured against what was summed, not against the sum: a parameter whose
        # examples' gradients cancel (a LayerNorm weight under bf16: sum 20, Σ_i ‖G_i‖ 7000) is
        # compared at the tolerance times Σ_i ‖G_i‖, and one whose gradient is zero in exact
        # arithmetic (an attention key's bias: the softmax ignores it), rounding noise in both
        # sums, against the whole gradient at a thousandth of the tolerance.
        floor = 1e-3 * self.tolerance * float(torch.stack([g.float().norm() for g in grads]).norm()) if grads else 0.0
        for p in self.params:
            seen = self._summed.get(p)
            grad = p.grad
            if grad is None:
                continue
            grad = maps[p].map_gradient(p, grad.float()) if p in maps else grad.float()
            if seen is None:
                missing = grad.norm()
            else:
                missing = (grad - seen).norm() if seen.shape == grad.shape else torch.tensor(0.0)
            summed = self._norm_sq[p].sqrt().sum().item() if p in self._norm_sq else 0.0
            if missing.item() > self.tolerance * max(grad.norm().item(), summed) + floor + 1e-7:
                uncovered.append(names.get(p, "?"))
        self._summed.clear()
        self._coverage_checked = True
        if uncovered:
            mode = "bk" if self.passes == 1 else "ghost"
            raise UserError(
                f"algo.per_sample={mode}: the gradient of {', '.join(uncovered[:5])} is not (only) what its module's "
                "forward output received (the parameter is read outside that forward, or a view of the output "
                "is changed in place), so no per-example norm would cover it; use algo.per_sample=materialize "
                "or keep the parameter and the output inside the module"
            )

    def _norms(self, losses: torch.Tensor) -> torch.Tensor:
        norm_sq = torch.zeros(losses.shape[0], dtype=torch.float32, device=losses.device)
        for value in self._norm_sq.values():
            norm_sq = norm_sq + value.float()
        return norm_sq.sqrt()

    def _book_kept_sums(self, factors: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's clipped sum, its kept pieces released as soon as it is formed (the
        next layer's temporaries reuse their memory)."""
        # One host sync per step: when no clip factor is 0, no example's norm was non-finite, so
        # none of its pieces holds an inf or a NaN (either would make its norm non-finite) and the
        # sums skip zeroing dropped rows: a copy of every kept input and a pass over every output
        # gradient (about 6% of a ViT step on the CPU).
        all_finite = bool((factors > 0).all())
        # After the backward, a kept output gradient is read by the pieces that hold it and nothing
        # else: the last of them may scale it in place (one g can reach several layers, e.g. the
        # summed word and position embeddings, so pieces are counted by storage).
        readers = Counter(_storage(t) for piece in self._kept.values() for t in piece.tensors())
        sums = {}
        for p in list(self._kept):
            piece = self._kept.pop(p)
            own_g = isinstance(piece, OuterProduct) and readers[_storage(piece.g)] == 1
            sums[p] = piece.clipped_sum(factors, all_finite, own_g=own_g)
            readers.subtract(_storage(t) for t in piece.tensors())
        return [sums[p] if p in sums else torch.zeros(p.shape, device=p.device) for p in self.params]

    def _reweighted_sums(self, losses: torch.Tensor, factors: torch.Tensor) -> list[torch.Tensor]:
        """Ghost's second pass: the same backward again, every clipped piece summed in fp32 by the
        hooks as it arrives (one layer's working set at a time). Not autograd's reweighted
        backward (Opacus's ghost clipping): under autocast that sums Σ_i f_i g_i in bf16/fp16,
        whose rounding grows with the batch (one added example moved it by 2·C at batch 1024),
        and a non-finite example would poison it through 0 · inf."""
        self._factors = factors.detach().float()
        self._pending = dict(self._calls)
        self._activations = {m: list(reversed(kept)) for m, kept in self._replay.items()}
        self._replay = {}
        self._backward(losses.sum())
        self._finish_pass()
        self._drop_grads()
        return [self._summed.get(p, torch.zeros(p.shape, device=p.device)) for p in self.params]

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None  # the non-private batch gradient autograd also accumulated

    def _reset(self) -> None:
        self._drop_grads()
        self._activations.clear()
        self._replay.clear()
        self._pending.clear()
        self._open.clear()
        self._kept.clear()
        self._norm_sq.clear()
        self._summed.clear()
        self._factors = None
        self._entry_edges.clear()
        self._readers.clear()
        self._held.clear()

    def backward_per_sample(self, losses):
        raise UserError("this algorithm needs per-example gradients; use algo.per_sample=materialize")

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _new_bytes(tensors: list[torch.Tensor], held: set[int]) -> int:
    """Bytes of the tensors whose storage is not yet in `held` (then added to it)."""
    new = 0
    for t in tensors:
        if _storage(t) not in held:
            held.add(_storage(t))
            new += t.numel() * t.element_size()
    return new


def piece_device(piece) -> torch.device:
    if isinstance(piece, TiedPieces):
        return piece.outer.g.device
    return (piece.grad_sample if isinstance(piece, Instantiated) else piece.g).device
