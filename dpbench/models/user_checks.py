"""The per-example checks a user's model (`model.builder`, dpbench/models/user.py) passes before a
private run trains it: dpbench's own models are covered by its tests, a user's module only by these.

1. Layers no engine forms per-example gradients for (`privacy.layout.check_layers`: torch's
   MultiheadAttention and recurrent layers, ...), then layers that mix the examples of a batch, as
   Opacus's `ModuleValidator` finds them (BatchNorm; InstanceNorm with running statistics), then any
   buffer a training forward writes (a running statistic of the batch: it would carry every
   example's data into the model unclipped and un-noised).
2. The layout probe (`privacy.layout.check_layout`): each example's rows stay together along
   dimension 0 in every layer the engine hooks (a sequence-first layer fails it), on the first
   records and at the run's largest chunk (`train.physical_batch_size`, else `train.batch_size`)
   and a random size below it, one record replaced at a random position by one of its class, one
   of another class and an outlier.
3. The engine's per-example gradient norms equal autograd's on each example alone (float64 copy,
   dropout off), on the first records and at those two sizes with an outlier record: the norms the
   clip factors are computed from are the norms of what is summed.

Each failure is one line naming the layer and the fix (exit 2 from the console script).
"""

from __future__ import annotations

import copy
import math
import warnings

import torch
from torch import nn

from dpbench.errors import UserError
from dpbench.models.user import names_builder

NORM_EXAMPLES = 4  # records whose norms are compared (the first of the training set)
NORM_TOLERANCE = 1e-4  # relative: the engines form norms in fp32 from a float64 model's pieces
LOW_PRECISION_TOLERANCE = 1e-2  # relative, for a model too large for a float64 copy (checked in its own dtype)


def check_user_model(cfg, task, model: nn.Module) -> None:
    """Run the checks of the module docstring on a user's model, or any model under a user's loss
    (`dataset.loss=package.module:function`), of a private run (others: nothing)."""
    from dpbench.algorithms import algorithm_class
    from dpbench.privacy.layers import hooked_modules
    from dpbench.privacy.layout import LayoutProbe, check_layers, check_layout

    algo = algorithm_class(cfg.algo.name)
    user_loss = ":" in str(cfg.dataset.get("loss") or "")  # a user's loss may mix examples too
    if not (names_builder(cfg.model) or user_loss) or not algo.private:
        return
    engine = str(cfg.algo.get("per_sample") or "materialize") if algo.per_example_engine else "materialize"
    name = f"model={cfg.model.name}"
    check_layers(model, engine)
    check_mixing_layers(model, name)
    probe = LayoutProbe.of_task(task, largest_chunk(cfg))
    check_buffers_unwritten(model, probe, name)
    check_layout(model, hooked_modules(model, {}), probe, engine)
    if algo.per_example_engine:
        check_norms(model, probe, engine, name)


def largest_chunk(cfg) -> int | None:
    """The largest batch a forward of the run sees: train.physical_batch_size, else the logical
    batch plus 4 standard deviations of Poisson sampling's draw (a whole Poisson batch is one chunk)."""
    physical, logical = cfg.train.get("physical_batch_size"), cfg.train.get("batch_size")
    if physical:
        return int(physical)
    return int(logical + math.ceil(4 * math.sqrt(logical))) if logical else None


def check_mixing_layers(model: nn.Module, name: str) -> None:
    """Refuse a layer Opacus's ModuleValidator rejects (BatchNorm, InstanceNorm with running stats)."""
    from opacus.validators import ModuleValidator

    for layer, module in model.named_modules():
        validator = ModuleValidator.VALIDATORS.get(type(module))
        if validator is not None and any(p.requires_grad for p in module.parameters()) and validator(module):
            raise UserError(f"{name}: layer {layer or 'model'} ({type(module).__name__}) makes each example's output "
                            "depend on the other examples of its batch, so no per-example clip bounds its effect; "
                            "use nn.GroupNorm or nn.LayerNorm (opacus.validators.ModuleValidator.fix swaps them)")


def check_buffers_unwritten(model: nn.Module, probe, name: str) -> None:
    """Refuse a model whose training forward writes a buffer (a running statistic of the batch)."""
    subject = copy.deepcopy(model)
    before = {n: b.detach().clone() for n, b in subject.named_buffers()}
    if not before:
        return
    with torch.no_grad():  # at two records and at the run's largest chunk (a statistic kept only above a size)
        for examples in sorted({min(2, probe.size), min(int(probe.largest or 2), probe.size)}):
            probe.losses(subject, probe.batch(list(range(examples))))
    for n, b in subject.named_buffers():
        if n in before and (b.shape != before[n].shape or not torch.equal(b, before[n])):
            raise UserError(f"{name}: buffer {n} changes during a training forward (a statistic of the batch), so it "
                            "carries every example's data into the model unclipped; compute it from public data or "
                            "drop it (BatchNorm: use nn.GroupNorm)")


def check_norms(model: nn.Module, probe, engine: str, name: str) -> None:
    """The engine's per-example gradient norms against autograd on each example alone: on the
    first records, then (where the probe knows the run's largest chunk) on a batch at each of
    `probe.sizes()` holding an outlier record at a random position, compared at the outlier and at
    NORM_EXAMPLES - 1 other random examples."""
    from dpbench.privacy.engines import engine_spec
    from dpbench.privacy.layout import DRAWS, FLOAT64_COPY_LIMIT, _outlier, _widen

    size = sum(t.numel() for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()) * 8
    wide = size <= FLOAT64_COPY_LIMIT  # as the layout probe: a large model is copied in its own dtype
    subject = copy.deepcopy(model).double() if wide else copy.deepcopy(model)
    dtype, tolerance = (torch.float64, NORM_TOLERANCE) if wide else (None, LOW_PRECISION_TOLERANCE)
    for module in subject.modules():  # the same function in the batch and alone (train mode kept: the hooks need it)
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    first = list(range(min(NORM_EXAMPLES, probe.size)))
    # (where, the batch, the positions compared, each of them alone)
    cases = [("", _widen(probe.batch(first), dtype), first, [_widen(probe.batch([i]), dtype) for i in first])]
    for examples in probe.sizes():  # the run's largest chunk and a random size below it
        indices, position = DRAWS.sample(range(probe.size), examples), DRAWS.randrange(examples)
        plain = _widen(probe.batch(indices), dtype)
        batch = _outlier(plain, position, examples)
        others = DRAWS.sample([i for i in range(examples) if i != position], min(NORM_EXAMPLES - 1, examples - 1))
        alone = [_widen(probe.batch([indices[i]]), dtype) for i in [position, *others]]
        if batch is not None:
            try:
                with torch.no_grad():
                    probe.losses(subject, batch)
                alone[0] = _outlier(alone[0], 0, 1)
            except (RuntimeError, IndexError, ValueError):  # inputs far outside what the model takes
                batch = None
        cases.append((f" in a batch of {examples}", plain if batch is None else batch, [position, *others], alone))
    params = [p for p in subject.parameters() if p.requires_grad]
    expected = []
    for _, _, _, alone in cases:
        norms = []
        for one in alone:
            grads = torch.autograd.grad(probe.losses(subject, one).sum(), params, allow_unused=True)
            norms.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads if g is not None))))
        expected.append(norms)
    seen: list[torch.Tensor] = []

    def record(norms: torch.Tensor) -> torch.Tensor:
        seen.append(norms.detach().double().cpu())
        return torch.zeros_like(norms)  # nothing is summed: only the norms are compared

    hooked = engine_spec(engine).build(subject, {})
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")  # as the trainer: inputs need no grad
            for _, batch, positions, _ in cases:
                count = len(seen)
                hooked.clipped_sum(probe.losses(subject, batch), record)
                if len(seen) == count:  # no hooked layer: no norm at all
                    seen.append(torch.zeros(max(positions) + 1, dtype=torch.float64))
    finally:
        hooked.detach()
    for (where, _, positions, _), norms, wanted in zip(cases, seen, expected):
        for i, want in zip(positions, wanted):
            got = float(norms[i])
            if abs(got - want) > tolerance * max(abs(want), 1e-12) + 1e-9:
                # no value in the message: the norms are statistics of private records
                raise UserError(f"{name}: algo.per_sample={engine}'s per-example gradient norm of example {i}{where} "
                                "differs from autograd's on that example alone, so clipping would not bound it; a layer "
                                "mixes examples (a statistic over the batch, a flip or shift of it) or a parameter is "
                                "read outside its own module's forward: compute each example alone and keep each "
                                "parameter inside its module")
