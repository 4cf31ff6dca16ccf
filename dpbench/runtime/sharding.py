"""`train.sharding=fsdp`: private training with PyTorch FSDP2 (`fully_shard`) under torchrun; how
a sharded step, its releases and its checkpoints run is in docs/sharding.md.

This module holds what the other modules ask about a sharded model:
* whether a config can run sharded (`check_supported`: the algorithms whose class declares
  `shardable`, fp32, a model family that names its blocks, torchrun; everything else refused in
  one line);
* `shard_model`: every transformer block (the family record's `block_modules`) wrapped with
  `fully_shard`, a block whose parameters are also used outside it (a tied embedding and head)
  left to the root, then the root. Every FSDP module reduce-scatters gradients as a SUM
  (FSDP2's default is the average), as the engines' coverage check reads it;
* this rank's view of a sharded tensor (`local`, `local_rows`, `local_bytes`, `sharded_grad`),
  and `reshard`;
* a step's agreements: `max_over_ranks` (every rank runs as many physical chunks: FSDP2's
  all-gathers and reduce-scatters are collectives), `IntoShards` (each clipped sum
  sum-reduce-scattered into this rank's rows as it is formed: no full-size accumulator) and
  `zero_factors` (a padding chunk contributes exactly 0).
"""

from __future__ import annotations

import fnmatch
import sys

import torch
from torch import nn

from dpbench.runtime import distributed
from dpbench.errors import UserError
from dpbench.privacy.engines import SHARDED_SUMS, engine_spec, engines_with

NONE, FSDP = "none", "fsdp"
SUPPORTED_PRECISION = "fp32"


def supported(algorithms) -> str:
    """What train.sharding=fsdp runs, read from the registry `algorithms`: the algorithms that declare
    `shardable`, with the per-example engines that hand each clipped sum to a reduce as it is formed."""
    shardable = [name for name in algorithms.names() if algorithms.get(name).stated("shardable")]
    with_engine = [name for name in shardable if algorithms.get(name).per_example_engine]
    forwards_only = [name for name in shardable if not algorithms.get(name).per_example_engine]
    return (f"train.sharding=fsdp supports algo={'|'.join(with_engine)} with "
            f"algo.per_sample={'|'.join(engines_with(SHARDED_SUMS))} and algo={'|'.join(forwards_only)}, "
            f"train.precision={SUPPORTED_PRECISION}, on a model whose family names its transformer blocks "
            "(vit, opt, roberta), under torchrun with 2 or more processes")


def requested(cfg) -> str:
    """The run's `train.sharding` (none when the key is absent)."""
    return str(cfg.train.get("sharding") or NONE)


def check_supported(cfg, algorithms) -> None:
    """One line naming what is supported, unless `train.sharding=fsdp` can run as configured. What an
    algorithm supports is its class's declaration (`shardable`, `per_example_engine`), read from the
    registry `algorithms` (passed in: the algorithms import this module)."""
    if requested(cfg) == NONE:
        return
    algo = str(cfg.algo.name)
    engine = str(cfg.algo.get("per_sample", "materialize"))
    algo_cls = algorithms.get(algo)
    problem = None
    if not distributed.launched():
        problem = "it needs several processes (torchrun --nproc_per_node=K, K >= 2), this is one"
    elif not algo_cls.stated("shardable"):  # its own statement: a subclass does not inherit it
        unstated = f" (its class {algo_cls.__name__} does not state shardable = True; its base's does not pass on)" \
            if algo_cls.shardable else ""
        problem = f"algo={algo} is not supported{unstated}"
    elif algo_cls.per_example_engine and not engine_spec(engine).has(SHARDED_SUMS):
        problem = f"algo.per_sample={engine} is not supported"
    elif str(cfg.get("privacy", {}).get("clipping", "flat")) == "per_layer":  # (init norms of sharded tensors: not yet)
        problem = "privacy.clipping=per_layer is not supported"
    elif str(cfg.train.get("precision", "fp32")) != SUPPORTED_PRECISION:
        problem = f"train.precision={cfg.train.precision} is not supported"
    elif not block_patterns(str(cfg.model.name)):
        problem = f"model={cfg.model.name} names no transformer blocks to shard"
    if problem is not None:
        raise UserError(f"{problem}: {supported(algorithms)}")


def block_patterns(model_name: str) -> tuple[str, ...]:
    """The family record's `block_modules` of the registered model `model_name` (() if none)."""
    from dpbench.models import MODELS

    if model_name not in MODELS.names():
        return ()
    return tuple(getattr(MODELS.get(model_name).family, "block_modules", ()))


def block_modules(model: nn.Module, patterns: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The outermost modules whose qualified names match one of `patterns` (fnmatch: `*` also
    matches dots, so `blocks.*` names `blocks.0`, not `blocks.0.attn`)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(outer + ".") for outer, _ in found):
            continue
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            found.append((name, module))
    return found


def _shared_outside(model: nn.Module, block_name: str, block: nn.Module) -> bool:
    """Whether a parameter of `block` is also a parameter of a module outside it (tied)."""
    inside = {id(p) for p in block.parameters()}
    prefix = block_name + "."
    return any(id(p) in inside for name, p in model.named_parameters(remove_duplicate=False)
               if not name.startswith(prefix))


def shard_model(model: nn.Module, patterns: tuple[str, ...], device: torch.device) -> list[str]:
    """Wrap `model`'s blocks, then the root, with FSDP2's `fully_shard` (SUM reductions); the
    names of the blocks wrapped (a tied block is left to the root)."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    cuda_group = distributed._groups.get("cuda") if device.type == "cuda" else None  # nccl (bind_device)
    mesh = DeviceMesh.from_group(cuda_group, "cuda") if cuda_group is not None else \
        init_device_mesh(device.type, (distributed.world_size(),))
    wrapped = []
    for name, block in block_modules(model, patterns):
        if not _shared_outside(model, name, block):
            fully_shard(block, mesh=mesh)
            wrapped.append(name)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a sum over ranks, not their mean
            module.set_force_sum_reduction_for_comms(True)  # ... as ReduceOp.SUM (gloo has no AVG)
    return wrapped


def is_sharded(model: nn.Module) -> bool:
    """Whether `shard_model` wrapped `model` (no import of FSDP when nothing did)."""
    if "torch.distributed.fsdp" not in sys.modules:
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor; any other tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def reshard(model: nn.Module) -> None:
    """Drop the gathered (unsharded) parameters FSDP2 still holds: it keeps the root's after a
    forward, expecting a backward, so after an evaluation, or at the end of training, every rank
    would hold the root's whole parameters (and reads of `model.parameters()` would see them).
    A no-op for a model that `shard_model` did not wrap."""
    if not is_sharded(model):
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def local_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors` (a DTensor's shard, not its global size)."""
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def local_rows(param: torch.Tensor) -> slice:
    """The rows (dim 0) of the whole `param` that this rank's shard holds (FSDP2's Shard(0),
    `distributed.row_shard`); checked against the shard's own shape."""
    rows = distributed.row_shard(param.shape[0])
    if local(param).shape[0] != rows.stop - rows.start:
        raise RuntimeError(f"this rank's shard of a {tuple(param.shape)} parameter holds {local(param).shape[0]} rows, "
                           f"not torch.chunk's {rows.stop - rows.start}")
    return rows


def sharded_grad(param: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """`shard` (this rank's rows of a released gradient) as the gradient of the sharded `param`."""
    mine = local(param)
    if shard.shape != mine.shape:
        raise RuntimeError(f"released shard {tuple(shard.shape)} is not the parameter's {tuple(mine.shape)}")
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard.to(mine.dtype), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def max_over_ranks(value: int) -> int:
    """The largest `value` of any rank (this rank's in one process)."""
    if not distributed.is_distributed():
        return value
    buffer = torch.tensor([float(value)], dtype=torch.float64)
    torch.distributed.all_reduce(buffer, op=torch.distributed.ReduceOp.MAX)
    return int(buffer.item())


# ---- FSDP's accumulators: what DPFirstOrderAlgorithm sums a sharded step's clipped sums into ----
class IntoShards:
    """The engine's `reduce` under train.sharding=fsdp (`DPFirstOrderAlgorithm.accumulates_shards`):
    each parameter's full-size clipped sum of a chunk, handed over with its position in the
    engine's `params` (bk: in that order, after the backward; ghost: in its second backward's
    order, as each hook forms it), is sum-reduce-scattered over the ranks
    (`distributed.reduce_scatter_rows`) and added into this rank's shard rows of the step's running
    sum, which it returns; so neither a full-size accumulator nor a second shard-size copy of a
    chunk's sums is held."""

    def __init__(self, count: int):
        self.count = count
        self.sums: list[torch.Tensor | None] = [None] * count  # this rank's rows of each parameter's running sum
        self.order: list[int] = []  # the positions reduced in the chunk in progress, in the order reduced

    def __call__(self, summed: torch.Tensor, index: int) -> torch.Tensor:
        shard = distributed.reduce_scatter_rows(summed)
        del summed  # the full-size sum is the engine's to drop now
        self.order.append(index)
        if self.sums[index] is None:  # the first chunk
            self.sums[index] = shard
        else:
            self.sums[index].add_(shard)
        return self.sums[index]

    def check(self, returned: list[torch.Tensor]) -> list[torch.Tensor]:
        """The running sums, after the engine returned `returned` for one chunk: it must have
        reduced every parameter once, and every rank in the same order (else the ranks' reduce-
        scatters paired different parameters: checked with one small all-reduce, which every rank
        runs and decides alike, before anything is released)."""
        order, self.order = self.order, []
        if sorted(order) != list(range(self.count)) or len(returned) != self.count or \
                any(got is not kept for got, kept in zip(returned, self.sums)):
            raise RuntimeError("the engine did not reduce each parameter's clipped sum once")
        if not distributed.same_on_every_rank(order):
            raise RuntimeError("the ranks reduce-scattered the parameters' clipped sums in different orders "
                               "(their backward passes differ)")
        return self.sums


def zero_factors(norms: torch.Tensor) -> torch.Tensor:
    """Clip factor 0 for every example (a padding chunk of train.sharding=fsdp)."""
    return torch.zeros_like(norms, dtype=torch.float32)
