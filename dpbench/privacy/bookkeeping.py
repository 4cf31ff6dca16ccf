"""Book-keeping (Bu et al., ICML 2023) and ghost clipping without per-example gradients.

`algo.per_sample=bk`: one backward pass of the summed loss. Hooks keep, for each trainable layer,
what its per-example gradient is made of (its pieces: the layer catalogue, layers.py, says how for
each layer kind; pieces.py holds the forms), then each example's norm, the clip factors f_i and
the clipped sum Σ_i f_i G_i in one matmul per layer.

`algo.per_sample=ghost`: the same hooks in a first backward keep nothing but each example's squared
norm (one layer's working set at a time); a second backward through the same graph rebuilds each
layer's pieces and sums f_i G_i in fp32 as they arrive, capped per parameter at the norm the first
pass measured (so the bound holds even if the GPU's kernels are not deterministic). Opacus's ghost
clipping instead backpropagates Σ_i f_i ℓ_i with autograd, which under autocast sums in bf16.

Each example's clip norm sums its pieces' squared norms, each an upper bound that covers its own
rounding (pieces.py; docs/privacy.md, "Rounding and the clip norm").

Both engines check once, against autograd's own summed gradient, that every trainable parameter's
gradient is made only of what the hooks saw (a parameter read outside its module's forward would
otherwise be released without a per-example norm), and give a non-finite example clip factor 0.

Written by hand because Opacus 1.6 has no book-keeping and its ghost clipping sums in low
precision. A parameter used by several layer calls (tied or reused) has the norm of its summed
per-example gradient, not the parts' norms: its calls' pieces are merged before its norm is taken
(`merge_pieces`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from functools import partial

import torch
from opacus.grad_sample.functorch import prepare_layer
from torch import nn
from torch.autograd.graph import get_gradient_edge

from dpbench.errors import UserError
from dpbench.privacy.clipping import Reduce, layer_norms

# LinearGradientMap, is_layer_norm and the piece forms moved to layers.py and pieces.py; they stay
# importable from here for one release.
from dpbench.privacy.layers import (
    LinearGradientMap,  # noqa: F401
    by_functorch,
    hooked_modules,
    opacus_corrections,
    is_layer_norm,  # noqa: F401
    layer_pieces,
    summed_shapes,
    zero_sum,
)
from dpbench.privacy.pieces import (
    EmbeddingRows,  # noqa: F401
    Instantiated,  # noqa: F401
    OuterProduct,
    TiedPieces,  # noqa: F401
    merge_pieces,
    piece_device,
)
from dpbench.privacy.coverage import check_coverage
from dpbench.privacy.rounding import UNIT_ROUNDOFF, exact_arithmetic, fp64_slack, round_down_fp32, round_up_fp32

FactorsFn = Callable[[torch.Tensor], torch.Tensor]


class _BackwardState:
    """What the hooks collect for one `clipped_sum`, from its forward's inputs to its backward's
    pieces, norms and sums; `_reset` starts a new one."""

    def __init__(self):
        self.activations: dict[nn.Module, list] = {}  # each layer's calls' inputs, in call order
        self.replay: dict[nn.Module, list] = {}  # ghost: activations again for the second backward
        self.pending: dict[nn.Parameter, int] = {}  # calls of each parameter not yet backpropagated
        self.calls: dict[nn.Parameter, int] = {}  # calls of each parameter in the forward (ghost: for its second pass)
        self.open: dict[nn.Parameter, object] = {}  # pieces awaiting more calls of their parameter
        self.kept: dict[nn.Parameter, object] = {}  # book-keeping: pieces for the clipped sum
        self.norm_sq: dict[nn.Parameter, torch.Tensor] = {}
        self.summed: dict[nn.Parameter, torch.Tensor] = {}  # ghost's second pass, or the coverage check
        self.factors: torch.Tensor | None = None  # set while the second pass sums
        self.reduce: Reduce | None = None  # ghost's second pass: each sum reduced as its hook forms it
        self.entry_edges: list[tuple] = []  # bottom layers' calls: (module, its inputs, its output's edge)
        self.readers: dict[int, int] = {}  # layers reading each input storage in this forward
        self.held: set[int] = set()  # storages of the kept pieces (a shared input is held once)
        self.held_bytes = 0


class BookKeeping:
    """Clipped per-example gradient sums from layer inputs and output gradients (see module doc).

    `passes=1` is book-keeping; `passes=2` is ghost clipping (norms, then a second backward whose
    hooks sum the clipped pieces in fp32). `overrides` maps module instances to a
    `LinearGradientMap` (Linear layers) or to an Opacus-signature grad sampler (instantiated form)."""

    sum_observer = None  # the engine protocol's observer of each chunk's sums (dpbench-audit)

    def __init__(self, model: nn.Module, overrides: dict | None = None, passes: int = 1):
        self.model = model
        self.overrides = {**opacus_corrections(model, embeddings=False), **(overrides or {})}
        self.passes = passes
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.modules = hooked_modules(model, self.overrides)
        self._sum_shapes = summed_shapes(self.overrides)  # a parameter no hook reached: zeros of its sum's shape
        # Layers without a rule or an Opacus sampler go whole through functorch (all their
        # parameters, children included), as in Opacus.
        self._functorch = {m for m in self.modules if m not in self.overrides and by_functorch(m)}
        for module in self._functorch:
            prepare_layer(module)
        # A sharded model (train.sharding=fsdp): the hooks see FSDP2's unsharded parameters, which
        # are other objects than the sharded ones in `params`; what they collect is keyed by the
        # sharded parameter of the same name (each module's names -> its parameters in `params`).
        self._canonical = _canonical_names(model, self.modules, self._functorch) \
            if any(hasattr(p, "to_local") for p in self.params) else None
        self._state = _BackwardState()
        self._position = {p: i for i, p in enumerate(self.params)}  # each parameter's place in `params`
        self._examples = 0  # B of the latest clipped_sum (a backward outside one reuses it)
        self._coverage_checked = False
        self.tolerance = 1e-4  # coverage check; low precision (autocast) rounds autograd's own sums more
        self.working_bytes = 0  # per-example bytes held at the peak of the last backward
        self.peak_bytes = 0  # ... of any backward (what the run reports)
        self._enabled = True
        self._handles = []
        for module in self.modules:
            self._handles.append(module.register_forward_hook(self._capture_activations))

    # --- hooks ---------------------------------------------------------------------------
    def _capture_activations(self, module, inputs, output):
        """Forward hook: keep the layer's inputs and ask for its output's gradient. A pre-hook on
        the output's autograd node rather than a full module backward hook, which wraps every input
        and output of the layer in an extra autograd node."""
        if not (self._enabled and torch.is_grad_enabled()):
            return
        state = self._state
        activations = [t.detach() for t in inputs]
        state.activations.setdefault(module, []).append(activations)
        if inputs and torch.is_tensor(inputs[0]):
            storage = _storage(inputs[0])
            state.readers[storage] = state.readers.get(storage, 0) + 1
        for p, key in self._keyed_parameters(module):
            if p.requires_grad:
                state.pending[key] = state.pending.get(key, 0) + 1
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if torch.is_tensor(first) and first.grad_fn is not None:
            # On the node that made the output, not on the tensor: an in-place change of the
            # output after this forward would hand a tensor hook the gradient of the changed value.
            first.grad_fn.register_prehook(partial(self._capture_backprops, module, first.output_nr))
            if not any(torch.is_tensor(t) and t.requires_grad for t in inputs):
                state.entry_edges.append((module, activations, get_gradient_edge(first)))

    def _keyed_parameters(self, module) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(parameter the module holds now, the key of what the hooks collect for it): itself, or
        for a sharded model the sharded parameter of its name (FSDP2 swaps in unsharded ones)."""
        recurse = module in self._functorch
        if self._canonical is None:
            return [(p, p) for p in module.parameters(recurse=recurse)]
        names = self._canonical[module]
        return [(p, names[name]) for name, p in module.named_parameters(recurse=recurse)]

    def _capture_backprops(self, module, index, output_grads):
        if self._enabled and output_grads[index] is not None:
            self._take(module, self._state.activations[module].pop(), output_grads[index])

    def _take(self, module, activations, output_grad) -> None:
        """One layer call's input and output gradient: its pieces, closed when its parameters'
        last call is in."""
        state = self._state
        if self.passes == 2 and state.factors is None:
            state.replay.setdefault(module, []).append(activations)
        backprops = output_grad.detach()
        pieces = layer_pieces(module, activations, backprops, self._examples, self.overrides.get(module))
        if self._canonical is not None:  # the unsharded parameters' pieces, under the sharded ones
            keys = dict(self._keyed_parameters(module))
            pieces = {keys[p]: piece for p, piece in pieces.items()}
        for p, piece in pieces.items():
            state.open[p] = piece if p not in state.open else merge_pieces(state.open[p], piece)
            state.pending[p] -= 1
            if state.pending[p] == 0:
                self._close(p)

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
        state = self._state
        if not state.entry_edges:
            loss.backward(retain_graph=retain_graph)
            return
        for module, activations, _ in state.entry_edges:
            # Off the stacks first: a layer also called on a hidden state pops only that call's inputs.
            stack = state.activations.get(module, [])
            index = next((i for i, kept in enumerate(stack) if kept is activations), None)
            if index is not None:
                del stack[index]
        edges = [edge for _, _, edge in state.entry_edges]
        grads = torch.autograd.grad(loss, edges, retain_graph=retain_graph, allow_unused=True)
        for (module, activations, _), grad in zip(state.entry_edges, grads):
            if grad is not None:  # (None: the call's output did not reach the loss)
                self._take(module, activations, grad)

    def _close(self, p: nn.Parameter) -> None:
        """All calls of p are in: its squared norms and, by pass, what is kept of it."""
        state = self._state
        piece = state.open.pop(p)
        if state.factors is not None:  # ghost's second pass: this parameter's clipped sum, now
            # train.sharding=fsdp: reduce-scattered at once, inside the backward, so that one
            # parameter's full-size sum exists at a time (the temporary dies when `reduce` returns)
            state.summed[p] = self._second_pass_sum(p, piece) if state.reduce is None else \
                state.reduce(self._second_pass_sum(p, piece), self._position[p])
            self.working_bytes = max(self.working_bytes, piece.nbytes() + self._open_bytes())
            return
        if not self._coverage_checked:  # unclipped sum, compared with autograd's (first call only)
            state.summed[p] = piece.clipped_sum(torch.ones(self._examples, device=piece_device(piece)))
        if self.passes == 1:
            piece = piece.compact(state.readers.get(_storage(piece.a), 1) if isinstance(piece, OuterProduct) else 1)
        with exact_arithmetic(piece_device(piece)):
            state.norm_sq[p] = piece.norm_sq()
        transient = piece.nbytes()
        if self.passes == 1:
            state.kept[p] = piece
            state.held_bytes += _new_bytes(piece.tensors(), state.held)
            transient = 0
        self.working_bytes = max(self.working_bytes, state.held_bytes + transient + self._open_bytes())

    def _second_pass_sum(self, p: nn.Parameter, piece) -> torch.Tensor:
        """Σ_i f_i G_i for one parameter from the second backward's piece, in fp32.

        The second backward recomputes G_i; on a deterministic backend it is bit for bit the one
        whose norm the first pass measured. Where kernels are not deterministic (atomics on a GPU)
        each parameter's contribution is capped at the norm measured in the first pass, so that
        Σ_p ‖f_i G_{i,p}‖² ≤ f_i² ‖G_i‖² ≤ C² holds whatever the kernels did; a row that turned
        non-finite is dropped. Both norms are the pieces' upper bounds (rounding included), and the cap
        is rounded down."""
        with exact_arithmetic(piece_device(piece)):
            measured, again = self._state.norm_sq[p], piece.norm_sq()
            finite = torch.isfinite(again)
            cap = torch.where(again > measured, (measured / again.clamp(min=1e-300)).sqrt() * (1 - 4 * UNIT_ROUNDOFF[torch.float64]),
                              torch.ones_like(again))
            cap = round_down_fp32(torch.where(finite, cap, torch.zeros_like(cap)))
            return piece.clipped_sum(self._factors_of(p, self._state.factors) * cap)

    def _open_bytes(self) -> int:
        return sum(piece.nbytes() for piece in self._state.open.values())

    # --- the engine interface -----------------------------------------------------------------
    def clipped_sum(self, losses: torch.Tensor, factors_fn: FactorsFn, reduce: Reduce | None = None,
                    per_layer: bool = False) -> list[torch.Tensor]:
        """Σ_i f_i g_i (fp32, aligned with `params`) for per-example losses [B]. `per_layer`:
        factors_fn gets [L, B] (each parameter's own clip norm, the bound its pieces give, rounded
        up; 0 for a parameter no hook reached) and returns [L, B], row l scaling parameter l. `peak_bytes`
        meters the per-example working bytes held at the peak. `reduce` (train.sharding=fsdp:
        `distributed.reduce_scatter_rows`): applied to each parameter's sum, with its position in
        `params`, as soon as it is formed, so that one full-size sum exists at a time: bk after
        the backward, in the order of `params`; ghost inside its second backward, as each hook
        forms it, in the backward's order (the same graph, hence the same order, on every rank:
        FSDP2's own reduce-scatters rely on it too), then zeros for the parameters no hook
        reached, in the order of `params`."""
        self._examples = losses.shape[0]
        self.working_bytes = self._state.held_bytes = 0
        try:
            self._state.calls = dict(self._state.pending)
            keep_graph = self.passes == 2
            if self._coverage_checked:
                self._backward(losses.sum(), retain_graph=keep_graph)
            else:  # autograd's own weight gradients too, once, for the coverage check
                losses.sum().backward(retain_graph=keep_graph)
            self._finish_pass()
            if not self._coverage_checked:
                check_coverage(self)
            self._drop_grads()
            norms = self._layer_norms(losses) if per_layer else self._norms(losses)
            factors = factors_fn(norms)
            sums = self._book_kept_sums(factors, reduce) if self.passes == 1 else \
                self._reweighted_sums(losses, factors, reduce)
        finally:
            self._reset()
        self.peak_bytes = max(self.peak_bytes, self.working_bytes)
        if self.sum_observer is not None:  # the engine protocol's observation point (read only)
            self.sum_observer(sums, reduce is not None)
        return sums

    def _finish_pass(self) -> None:
        for p in list(self._state.open):  # a call whose output did not reach the loss
            self._close(p)

    def _norms(self, losses: torch.Tensor) -> torch.Tensor:
        """Each example's clip norm: the parameters' bounds summed in fp64, clamped at 0 (a guard:
        every bound is ≥ 0 when it holds), widened for that sum's rounding, rounded up to fp32."""
        norm_sq = torch.zeros(losses.shape[0], dtype=torch.float64, device=losses.device)
        for value in self._state.norm_sq.values():
            norm_sq = norm_sq + value.double()
        return round_up_fp32((norm_sq.clamp(min=0) * fp64_slack(len(self._state.norm_sq) + 4)).sqrt() * fp64_slack(2))

    def _layer_norms(self, losses: torch.Tensor) -> torch.Tensor:
        """[L, B]: each parameter's clip norm (per-layer clipping), in the order of `params`."""
        missing = torch.zeros(losses.shape[0], dtype=torch.float64, device=losses.device)
        return layer_norms([self._state.norm_sq.get(p, missing) for p in self.params])

    def _factors_of(self, p: nn.Parameter, factors: torch.Tensor) -> torch.Tensor:
        """The [B] factors that scale parameter p: its row of per-layer factors [L, B], else all of them."""
        return factors[self._position[p]] if factors.dim() == 2 else factors

    def _book_kept_sums(self, factors: torch.Tensor, reduce: Reduce | None = None) -> list[torch.Tensor]:
        """Each parameter's clipped sum, its kept pieces released as soon as it is formed (the
        next layer's temporaries reuse their memory). `reduce`: each sum reduced as soon as it is
        formed, in the order of `params` (a collective: the same order on every rank), so that
        one full-size sum exists at a time."""
        # One host sync per step: when no clip factor is 0, no example's norm was non-finite, so
        # none of its pieces holds an inf or a NaN (either would make its norm non-finite) and the
        # sums skip zeroing dropped rows: a copy of every kept input and a pass over every output
        # gradient.
        all_finite = bool((factors > 0).all())
        # After the backward, a kept output gradient is read by the pieces that hold it and nothing
        # else: the last of them may scale it in place (one g can reach several layers, e.g. the
        # summed word and position embeddings, so pieces are counted by storage).
        readers = Counter(_storage(t) for piece in self._state.kept.values() for t in piece.tensors())

        def formed(p: nn.Parameter) -> torch.Tensor:
            piece = self._state.kept.pop(p)
            own_g = isinstance(piece, OuterProduct) and readers[_storage(piece.g)] == 1
            with exact_arithmetic(piece_device(piece)):
                summed = piece.clipped_sum(self._factors_of(p, factors), all_finite, own_g=own_g)
            readers.subtract(_storage(t) for t in piece.tensors())
            return summed

        if reduce is not None:
            return [reduce(formed(p) if p in self._state.kept else zero_sum(p, self._sum_shapes), i)
                    for i, p in enumerate(self.params)]
        sums = {p: formed(p) for p in list(self._state.kept)}  # in the backward's order
        return [sums[p] if p in sums else zero_sum(p, self._sum_shapes) for p in self.params]

    def _reweighted_sums(self, losses: torch.Tensor, factors: torch.Tensor,
                         reduce: Reduce | None = None) -> list[torch.Tensor]:
        """Ghost's second pass: the same backward again, every clipped piece summed in fp32 by the
        hooks as it arrives (one layer's working set at a time). Not autograd's reweighted
        backward (Opacus's ghost clipping): under autocast that sums Σ_i f_i g_i in bf16/fp16,
        whose rounding grows with the batch, a non-finite example would poison it through 0 · inf,
        and no per-parameter cap at the first pass's norm could be applied.

        `reduce` (train.sharding=fsdp): each parameter's sum is reduced in the hook that forms it
        (`_close`), inside this backward, rather than after it: the hooks already hold each sum
        alone, so the full-size sums of the whole model never coexist (as with bk: one parameter's
        at a time), while FSDP2's gradient sync and the hooks' fp32 sums stay as they are. (Chosen
        over making this pass a plain FSDP backward of Σ_i f_i ℓ_i, whose reduce-scattered
        gradients would be autograd's sums: without the cap and the non-finite guard above.)"""
        state = self._state
        state.factors = factors.detach().float()
        state.reduce = reduce
        state.pending = dict(state.calls)
        state.activations = {m: list(reversed(kept)) for m, kept in state.replay.items()}
        state.replay = {}
        self._backward(losses.sum())
        self._finish_pass()
        self._drop_grads()
        if reduce is not None:  # the parameters no hook reached: zeros, reduced alike on every rank
            for i, p in enumerate(self.params):
                if p not in state.summed:
                    state.summed[p] = reduce(zero_sum(p, self._sum_shapes), i)
        return [state.summed.get(p, zero_sum(p, self._sum_shapes)) for p in self.params]

    def _drop_grads(self) -> None:
        for p in self.params:
            p.grad = None  # the non-private batch gradient autograd also accumulated

    def _reset(self) -> None:
        self._drop_grads()
        self._state = _BackwardState()

    def backward_per_sample(self, losses):
        raise UserError("this algorithm needs per-example gradients; use algo.per_sample=materialize")

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _canonical_names(model: nn.Module, modules: list[nn.Module], functorch: set) -> dict:
    """{hooked module: {its parameter names: the model's parameter of that qualified name}}."""
    everything = dict(model.named_parameters(remove_duplicate=False))
    prefixes = {module: name for name, module in model.named_modules(remove_duplicate=False)}
    return {module: {name: everything[f"{prefixes[module]}.{name}" if prefixes[module] else name]
                     for name, _ in module.named_parameters(recurse=module in functorch, remove_duplicate=False)}
            for module in modules}


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
