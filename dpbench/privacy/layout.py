"""Which rows belong to which example: the per-example engines' layout contract, checked before
training, and the layer kinds no engine takes.

Every engine (materialize, ghost, bk) reads a hooked layer's input and output gradient with its
examples along dimension 0: R = k·B rows, example b owning rows b·k .. b·k + k − 1 (k = 1; OPT's
[B·T, d] flattening before fc1/fc2, k = T; candidate scoring's K rows per example, k = K). A
layer fed [T, B, d] (a sequence-first model, `DPMultiheadAttention(batch_first=False)`) breaks it:
its "examples" would mix every example's tokens, and the clipped sum's sensitivity with them.

`check_layout` proves the contract on the model itself, once, before the engine hooks it: a
float64 copy runs the task's per-example loss on a few records, then again with one record
replaced (the neighbouring relation) and its loss weighted differently; in every hooked layer's
inputs and output gradient only that example's rows may change. In a right layout the other
rows are bit for bit the same whatever the records hold (each row is computed on its own), so
the outcome depends on the model's structure, not on the records' values. A layer that fails is
refused in one line naming it and the fix.

Where the probe knows the largest chunk the run uses (`LayoutProbe.largest`: a user's model,
dpbench/models/user_checks.py), it also runs at that size and at a random size below it, the
replaced example at a random position, three times at each: by a record of the same class, by
one of another class, and by an outlier (the record's inputs scaled far out). A model that mixes
its batch only above some size, only with a partner row (a flip), only through a batch maximum
or only across classes is refused there. Sizes and positions come from the OS's entropy, not the
seed. What this cannot prove is in docs/bring-your-own.md.

`check_layers` refuses, before any engine is built, the layer kinds whose per-example gradient
the engines do not form right: torch's MultiheadAttention and recurrent layers (Opacus's DP
versions instead; its DPLSTM/DPGRU/DPRNN with materialize only), EmbeddingBag, and an Embedding
with `scale_grad_by_freq` (its gradient scales by counts over the whole batch, so one example's
gradient depends on the others).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from dpbench.errors import UserError

FLOAT64_COPY_LIMIT = 2**31  # bytes of a float64 copy beyond which the model is probed in place, in its dtype
REPLACEMENT_TRIES = 16  # records tried for a replacement whose batch has the same shapes (padding)
# Relative change (of the tensor's largest entry) below which a row counts as unchanged: other
# examples' rows are bit-identical in a right layout; mixing moves them by far more.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
OUTLIER_SCALE = 100.0  # an outlier record: its floating inputs x -> 100 x + 100 (far beyond the data's norms)
OUTLIER = "an outlier (its inputs scaled far out)"
CANDIDATE_TRIES = 64  # records read for a replacement of the same (another) class
# Sizes and positions beyond the first records: unpredictable from the seed or the data.
DRAWS = random.SystemRandom()


@dataclass(frozen=True)
class LayoutProbe:
    """What the probe needs of the task: its per-example loss, its batches and how many records
    `batch` indexes (`Task.per_sample_loss`, `Task.batch`, `Task.train_size`)."""

    losses: Callable[[nn.Module, Any], torch.Tensor]
    batch: Callable[[list[int]], Any]
    size: int
    # The largest chunk the run uses (a user's model: dpbench.models.user_checks.largest_chunk): the
    # probe also runs at it and at a random size below it. None: the first records only.
    largest: int | None = None
    label: Callable[[int], Any] | None = None  # a record's class (None: read from its batch of one)

    @classmethod
    def of_task(cls, task, largest: int | None = None) -> "LayoutProbe":
        set_step = getattr(task, "set_step", None)  # a loss that reads the step (LDAM-DRW) sees the first

        def losses(model, batch):
            if set_step is not None:
                set_step(0)  # train_step sets each step's own
            return task.per_sample_loss(model, batch)

        return cls(losses, task.batch, int(task.train_size), largest, getattr(task, "train_label", None))

    def sizes(self) -> list[int]:
        """The batch sizes probed beyond the first records: the largest chunk (one record kept spare
        for a replacement) and a random size below it; none without `largest`."""
        top = min(int(self.largest or 0), self.size - 1)
        if top < 2:
            return []
        return [top, DRAWS.randrange(2, top)] if top > 2 else [top]

    def label_of(self, index: int):
        """Record `index`'s class: `label`, else the last integer tensor of one entry in its batch."""
        if self.label is not None:
            return int(self.label(index))
        found = [t for t in _tensors(self.batch([index])) if not t.is_floating_point() and t.numel() == 1]
        return int(found[-1]) if found else None


def check_layers(model: nn.Module, engine: str) -> None:
    """One line naming the first layer whose per-example gradient no engine forms right, and the fix."""
    for name, module in model.named_modules():
        if not any(p.requires_grad for p in module.parameters()):
            continue
        fix = _unsupported(module, engine)
        if fix:
            raise UserError(f"algo.per_sample={engine}: layer {name or 'model'} ({type(module).__name__}) {fix}")


def _unsupported(module: nn.Module, engine: str) -> str | None:
    from opacus.layers.dp_rnn import DPRNNBase

    if isinstance(module, nn.MultiheadAttention):
        return ("has no per-example gradient rule in dpbench's engines; "
                "use opacus.layers.DPMultiheadAttention(batch_first=True) instead")
    if isinstance(module, nn.RNNBase):
        kind = {nn.LSTM: "DPLSTM", nn.GRU: "DPGRU"}.get(type(module), "DPRNN")
        return (f"has no per-example gradient rule in dpbench's engines; use opacus.layers.{kind}(batch_first=True) "
                "with algo.per_sample=materialize instead")
    if isinstance(module, DPRNNBase) and engine != "materialize":  # its cells' functorch pieces fail in these hooks
        return "is served by algo.per_sample=materialize only; use that"
    if isinstance(module, nn.EmbeddingBag):  # Opacus's sampler: 2-D input fails, 1-D with offsets gave wrong norms
        return ("has no per-example gradient rule in dpbench's engines; use nn.Embedding and reduce each "
                "example's bag (sum or mean) in the forward")
    if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        return ("scales its gradient by token counts over the whole batch, so one example's gradient "
                "depends on the others; set scale_grad_by_freq=False")
    return None


def check_layout(model: nn.Module, modules: Iterable[nn.Module], probe: LayoutProbe, engine: str) -> None:
    """Refuse, in one line, a hooked layer whose inputs or output gradient do not keep each
    example's rows together along dimension 0 (module doc). Needs 3 records (2 to keep, 1 to
    replace); a sharded model (train.sharding=fsdp) is not copied and not probed."""
    if probe.size < 3 or any(hasattr(p, "to_local") for p in model.parameters()):
        return
    names = {m: n for n, m in model.named_modules()}
    targets = [(names[m], m) for m in modules if m in names]
    if not targets:
        return
    verdict = None if _PASSED is None else _verdict_key(model, targets, probe, engine)
    if verdict is not None and verdict in _PASSED:
        return
    _check_layout(model, targets, probe, engine)
    if verdict is not None:
        _PASSED.add(verdict)


# Layouts that passed inside `layout_verdicts_reused` (None outside it).
_PASSED: set | None = None


@contextlib.contextmanager
def layout_verdicts_reused() -> Iterator[None]:
    """Inside this block a model identical to one whose layout already passed (the same module tree,
    parameters, hooked layers, engine and task loss) is not probed again. For the self-audit, which
    builds dozens of jobs from one config that differ only in their records: the layout is the
    model's structure (module doc), and its probe was a third of an audit's time."""
    global _PASSED
    outer, _PASSED = _PASSED, set() if _PASSED is None else _PASSED
    try:
        yield
    finally:
        _PASSED = outer


def _verdict_key(model: nn.Module, targets, probe: LayoutProbe, engine: str) -> tuple:
    parameters = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters())
    loss = (getattr(probe.losses, "__module__", None), getattr(probe.losses, "__qualname__", None))
    return (engine, repr(model), parameters, tuple(name for name, _ in targets), probe.size, probe.largest, loss)


def _check_layout(model: nn.Module, targets, probe: LayoutProbe, engine: str) -> None:
    subject, dtype = _probe_model(model)
    copies = dict(subject.named_modules())
    targets = [(name, copies[name]) for name, _ in targets]
    kept = [0, 1, 2] if probe.size >= 4 else [0, 1]
    base = probe.batch(kept)
    replaced, allowed = _neighbour(probe, kept, base)
    _compare(subject, targets, probe, dtype, engine, base, len(kept), [("", 1, _widen(replaced, dtype), allowed)], "")
    for size in probe.sizes():  # the run's largest chunk and a random size below it
        indices = DRAWS.sample(range(probe.size), size)
        base = probe.batch(indices)
        neighbours = _neighbours(probe, indices, base, dtype)
        _compare(subject, targets, probe, dtype, engine, base, size, neighbours, f" in a batch of {size}")


def _compare(subject, targets, probe: LayoutProbe, dtype, engine: str, base, examples: int, neighbours,
             where: str) -> None:
    """The hooked layers' rows on `base` (of `examples`) against each neighbouring batch (one
    example replaced, its loss weighted 2): a one-line UserError where rows outside `allowed` moved."""
    firsts: dict[int, dict] = {}
    for what, position, batch, allowed in neighbours:
        weights = torch.ones(examples, dtype=torch.float64)
        if position not in firsts:
            firsts[position] = _record(subject, targets, probe, _widen(base, dtype), weights)
        first = firsts[position]
        weights[position] = 2.0  # the replaced example's loss also moves its output gradients
        try:
            second = _record(subject, targets, probe, batch, weights)
        except (RuntimeError, IndexError, ValueError):
            if what != OUTLIER:
                raise
            continue  # inputs far outside what the model takes (an index, a range it checks): no outlier probe
        for name, module in targets:
            for call, (a, b) in enumerate(zip(first[module], second[module])):
                for part, x, y in _pairs(a, b):
                    problem = _rows_problem(x, y, examples, allowed, TOLERANCE.get(dtype, 1e-2))
                    if problem:
                        replaced = f" when example {position} is replaced by {what}" if what else ""
                        raise UserError(
                            f"algo.per_sample={engine}: layer {name or 'model'} ({type(module).__name__}): its {part} "
                            f"{tuple(x.shape)}{where} {problem}{replaced}; every per-example engine needs each "
                            "example's rows together along dimension 0, computed from that example alone: feed it "
                            "batch-first tensors (e.g. batch_first=True) and compute nothing across the batch "
                            "(a batch statistic, a flip or shift of the batch)")


def _neighbours(probe: LayoutProbe, indices: list[int], base, dtype) -> list:
    """[(what replaces the example, its position (drawn afresh for each), the neighbouring batch
    (widened), the examples allowed to move)]: a record of the same class, one of another class
    (any record where classes are not known), each whose batch has the same shapes, and an outlier
    (its floating inputs scaled far out, where the batch has any). Where no record fits: the
    example swapped with another."""
    shapes, taken, size = _shapes(base), set(indices), len(indices)
    drawn = DRAWS.sample(range(probe.size), min(probe.size, size + CANDIDATE_TRIES))
    others = [r for r in drawn if r not in taken][:CANDIDATE_TRIES]
    kinds = {"a record of the same class": lambda c, label: c == label,
             "a record of another class": lambda c, label: c != label}
    found = []
    for what, fits in kinds.items():
        position = DRAWS.randrange(size)
        label = probe.label_of(indices[position])
        if label is None:  # classes unknown: any record, once
            what, fits = "another record", None
        for record in others:
            if fits is not None and not fits(probe.label_of(record), label):
                continue
            candidate = probe.batch([*indices[:position], record, *indices[position + 1:]])
            if _shapes(candidate) == shapes:
                found.append((what, position, _widen(candidate, dtype), {position}))
                break
        if label is None:
            break
    if not found and size > 1:
        position = DRAWS.randrange(size)
        other = DRAWS.choice([i for i in range(size) if i != position])
        swapped = list(indices)
        swapped[position], swapped[other] = swapped[other], swapped[position]
        found.append((f"example {other} (no other record fits its shapes)", position, _widen(probe.batch(swapped), dtype),
                      {position, other}))
    position = DRAWS.randrange(size)
    outlier = _outlier(_widen(base, dtype), position, size)
    if outlier is not None:
        found.append((OUTLIER, position, outlier, {position}))
    return found


def _outlier(batch, position: int, examples: int):
    """The batch with example `position`'s floating inputs x -> OUTLIER_SCALE (x + 1), or None where
    it has no floating tensor with one row per example."""
    hit = []

    def scale(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dim() == 0 or t.shape[0] != examples:
            return t
        hit.append(t)
        t = t.clone()
        t[position] = OUTLIER_SCALE * (t[position] + 1)
        return t

    scaled = _map_tensors(batch, scale)
    return scaled if hit else None


def _probe_model(model: nn.Module) -> tuple[nn.Module, torch.dtype]:
    """A float64 copy of the model, or, where that copy would be too large, the model itself
    (its forward and backward run; no parameter's .grad is touched)."""
    params = list(model.parameters()) + list(model.buffers())
    if sum(p.numel() for p in params if p.is_floating_point()) * 8 <= FLOAT64_COPY_LIMIT:
        return copy.deepcopy(model).double(), torch.float64
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    return model, torch.float32 if dtypes <= {torch.float32, torch.float64} else torch.bfloat16


def _neighbour(probe: LayoutProbe, kept: list[int], base) -> tuple[Any, set[int]]:
    """The batch with example 1 replaced by another record whose batch has the same shapes
    (language batches pad to their longest row), and the examples allowed to change. Fallback
    where no record fits: examples 1 and 2 swapped (then only example 0 must stay)."""
    shapes = _shapes(base)
    for record in range(len(kept), min(probe.size, len(kept) + REPLACEMENT_TRIES)):
        indices = [kept[0], record, *kept[2:]]
        candidate = probe.batch(indices)
        if _shapes(candidate) == shapes:
            return candidate, {1}
    if len(kept) == 3:
        return probe.batch([kept[0], kept[2], kept[1]]), {1, 2}
    return base, {1}  # (two records and no fit: the loss weight alone moves example 1)


def _record(model: nn.Module, targets, probe: LayoutProbe, batch, weights: torch.Tensor) -> dict:
    """{module: [(its tensor inputs, its output gradient) per call]} for Σ_i w_i ℓ_i."""
    calls: dict[nn.Module, list] = {m: [] for _, m in targets}
    edges: list = []

    def hook(module, inputs, output):
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        edge = get_gradient_edge(first) if torch.is_tensor(first) and first.grad_fn is not None else None
        calls[module].append([[t.detach() for t in inputs if torch.is_tensor(t)], edge])
        edges.append((module, len(calls[module]) - 1, edge))

    handles = [m.register_forward_hook(hook) for _, m in targets]
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    try:
        with torch.enable_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)  # the same dropout masks in both forwards
            losses = probe.losses(model, batch)
            loss = (losses.double() * weights.to(losses.device)).sum()
            wanted = [(m, i, e) for m, i, e in edges if e is not None]
            grads = torch.autograd.grad(loss, [e for _, _, e in wanted], allow_unused=True) if wanted else []
    finally:
        for handle in handles:
            handle.remove()
    for (module, index, _), grad in zip(wanted, grads):
        calls[module][index][1] = grad
    for module in calls:
        for call in calls[module]:
            if not torch.is_tensor(call[1]):
                call[1] = None
    return calls


def _pairs(a, b):
    """(what, tensor from the first batch, from the neighbouring one) for every compared tensor."""
    for k, (x, y) in enumerate(zip(a[0], b[0])):
        yield ("input" if k == 0 else f"input {k}"), x, y
    if a[1] is not None and b[1] is not None:
        yield "output gradient", a[1], b[1]


def _rows_problem(x: torch.Tensor, y: torch.Tensor, examples: int, allowed: set[int], tolerance: float) -> str | None:
    """What breaks the layout in one compared tensor, or None."""
    if x.shape != y.shape:
        return "changes shape when another example is replaced"
    if x.dim() == 0:
        return "has no example dimension"
    rows = x.shape[0]
    if rows % examples:
        return f"has {rows} rows along dimension 0 for {examples} examples" + _found_at(x, y, examples, tolerance)
    moved = _moved(x, y, tolerance)
    blocks = moved.reshape(examples, -1).any(dim=1)
    if any(bool(blocks[b]) for b in range(examples) if b not in allowed):
        return "mixes examples within the rows of dimension 0" + _found_at(x, y, examples, tolerance)
    return None


def _moved(x: torch.Tensor, y: torch.Tensor, tolerance: float) -> torch.Tensor:
    if not x.is_floating_point():
        return x != y
    x, y = x.double(), y.double()
    finite = torch.isfinite(x) & torch.isfinite(y)  # an outlier's overflow: its own rows, not the scale
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    scale = torch.maximum(torch.where(finite, x.abs(), zero).max(), torch.where(finite, y.abs(), zero).max())
    same = (x == y) | (torch.isnan(x) & torch.isnan(y))
    return torch.where(finite, (x - y).abs() > tolerance * scale, ~same)


def _found_at(x: torch.Tensor, y: torch.Tensor, examples: int, tolerance: float) -> str:
    """' (its examples lie along dimension d)' where one dimension of size B holds the changes."""
    moved = _moved(x, y, tolerance)
    for d in range(1, x.dim()):
        if x.shape[d] == examples and bool(moved.any()):
            others = moved.movedim(d, 0).reshape(examples, -1).any(dim=1)
            if int(others.sum()) == 1:
                return f" (its examples lie along dimension {d})"
    return ""


def _shapes(batch) -> list:
    return [tuple(t.shape) for t in _tensors(batch)]


def _tensors(batch) -> list[torch.Tensor]:
    if torch.is_tensor(batch):
        return [batch]
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return [t for f in dataclasses.fields(batch) for t in _tensors(getattr(batch, f.name))]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def _widen(batch, dtype: torch.dtype):
    """The batch with its floating tensors in `dtype` (a float64 copy reads float64 inputs)."""
    if dtype != torch.float64:
        return batch
    return _map_tensors(batch, lambda t: t.double() if t.is_floating_point() else t)


def _map_tensors(batch, fn: Callable[[torch.Tensor], torch.Tensor]):
    """The batch with `fn` applied to each of its tensors, its structure kept."""
    if torch.is_tensor(batch):
        return fn(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: _map_tensors(getattr(batch, f.name), fn)
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, dict):
        return type(batch)((k, _map_tensors(v, fn)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a named tuple
        return type(batch)(*(_map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map_tensors(v, fn) for v in batch)
    return batch
