"""Multi-process data parallel training under `torchrun` (one device per rank): the process group
and the collectives the run uses. How a run stays ONE privatised release per logical step over K
ranks (rank 0's Poisson batch split indices[r::K], one noise draw on rank 0, collective stops) is
in docs/distributed.md.

    torchrun --nproc_per_node=K -m dpbench.cli algo=dpadam ...

Here: joining the ranks (`init_from_environment`, SLURM's variables adopted), this rank's place
(`rank`, `world_size`, `is_main_process`) and device (`bind_device`: GPU LOCAL_RANK, which must
exist; CPU ranks never touch CUDA), sums, broadcasts and row shards over the ranks (gloo, plus
nccl for CUDA tensors), and the agreements: `check_replicas` (seeded model and public randomness
equal on all ranks), `check_same_as_rank_zero`, and `raise_together` (a failure on any rank stops
every rank at the same point: a small all-reduce on a gloo control group).

Without torchrun (WORLD_SIZE unset or 1) every helper is a no-op and nothing changes.
"""

from __future__ import annotations

import hashlib
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dpbench.errors import DivergedError, UserError


def launched() -> bool:
    """Whether torchrun (or an equivalent launcher) started this process as one of several ranks."""
    adopt_slurm_environment()
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


# --- SLURM tasks as ranks (conf/hydra/launcher/slurm_fsdp.yaml) ------------------------------------------
SLURM_OPT_IN = "DPBENCH_RANKS_FROM_SLURM"  # set by the launcher config: each SLURM task is one rank
MASTER_PORT_BASE = 29500


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list (`gpu[03-05,9],cpu1` -> `gpu03`; `n1,n2` -> `n1`)."""
    nodelist = nodelist.strip()
    head = nodelist.split(",", 1)[0] if "[" not in nodelist.split(",", 1)[0] else nodelist.split("]", 1)[0] + "]"
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    first = ranges.rstrip("]").split(",", 1)[0].split("-", 1)[0]
    return prefix + first


def slurm_environment(env) -> dict[str, str]:
    """What torchrun would set for this SLURM task, from SLURM's variables (srun, or submitit's
    tasks): RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID,
    LOCAL_WORLD_SIZE = the tasks on this node, MASTER_ADDR = the first host of SLURM_JOB_NODELIST
    (where rank 0 runs: SLURM places tasks in node order), MASTER_PORT = MASTER_PORT_BASE + the job
    id mod 1000 (one port per job, the same on every task). {} unless the launcher opted in
    (DPBENCH_RANKS_FROM_SLURM=1) and this is a SLURM task; values already set (torchrun's) are kept."""
    if env.get(SLURM_OPT_IN) != "1" or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return {}
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "localhost"
    per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0] or str(
        int(env["SLURM_NTASKS"]) // max(int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1), 1))
    derived = {
        "RANK": env["SLURM_PROCID"],
        "WORLD_SIZE": env["SLURM_NTASKS"],
        "LOCAL_RANK": env.get("SLURM_LOCALID", "0"),
        "LOCAL_WORLD_SIZE": per_node,
        "MASTER_ADDR": first_host(nodelist),
        "MASTER_PORT": str(MASTER_PORT_BASE + int(env.get("SLURM_JOB_ID", "0")) % 1000),
    }
    return {key: value for key, value in derived.items() if key not in env}


def adopt_slurm_environment(environ=None) -> dict[str, str]:
    """Set `slurm_environment`'s variables in `environ` (default: this process's); what was set."""
    environ = os.environ if environ is None else environ
    derived = slurm_environment(environ)
    environ.update(derived)
    return derived


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_process() -> bool:
    """Rank 0 (or the only process): the one that writes files, logs and prints."""
    return rank() == 0


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def cuda_device_count() -> int:
    """GPUs this process sees (0 without CUDA). The one place that asks torch, so that tests can
    stand in for a machine with GPUs."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_groups: dict[str, Any] = {}  # "control": gloo group for agreements; "cuda": nccl group for CUDA tensors
_run_device_type: str | None = None  # what bind_device bound this process to (None: not bound yet)


def run_uses_cuda() -> bool:
    """Whether this process trains on a GPU (before `bind_device`: whenever it sees one), so that
    a CPU run never initialises CUDA, not even for the RNG states of a checkpoint."""
    return cuda_device_count() > 0 and _run_device_type in (None, "cuda")


def init_from_environment() -> None:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT); idempotent.

    The group is gloo: it starts before the config (and so the device) is known (`dpbench.cli`
    agrees on the run folder first), and it never touches CUDA. `bind_device` adds nccl for a
    CUDA run. A second gloo group carries only the failure agreements of `raise_together`, so they
    can never pair with a collective of the training step.
    """
    if not launched() or is_distributed():
        return
    dist.init_process_group(backend="gloo")
    _groups.clear()
    _groups["control"] = dist.new_group(backend="gloo")
    from dpbench.logging.console import console

    console.quiet = not is_main_process()  # one progress bar, one summary


def cuda_ordinal(device: torch.device) -> int | None:
    """The GPU this process trains on when `device` is CUDA and torchrun launched it (LOCAL_RANK),
    None otherwise; a one-line error when that GPU does not exist."""
    if device.type != "cuda" or not launched():
        return None
    ordinal, count = local_rank(), cuda_device_count()
    if ordinal >= count:
        raise UserError(
            f"this run trains on CUDA, so torchrun local rank {ordinal} needs GPU {ordinal}, but this process sees "
            f"{count} GPU(s): run at most {count} processes per node (--nproc_per_node), let every process see "
            "all the node's GPUs (CUDA_VISIBLE_DEVICES), or set device=cpu"
        )
    return ordinal


def bind_device(device: torch.device) -> None:
    """Make `cuda` mean this rank's GPU (and sum CUDA tensors over nccl) when the run's device is
    CUDA; nothing for CPU ranks. Every rank calls it; all raise together if any rank cannot."""
    global _run_device_type
    _run_device_type = device.type
    error = None
    try:
        ordinal = cuda_ordinal(device)
        if ordinal is not None:
            torch.cuda.set_device(ordinal)
    except UserError as failure:
        error = failure
    raise_together(error, "binding its device")
    check_same_as_rank_zero("device type", {"device": device.type})
    if device.type == "cuda" and is_distributed() and "cuda" not in _groups:
        _groups["cuda"] = dist.new_group(backend="nccl")


def backend() -> str | None:
    return dist.get_backend() if is_distributed() else None


def _group_of(tensor: torch.Tensor):
    """The group that carries `tensor`: nccl for CUDA tensors, the default (gloo) group otherwise."""
    if tensor.device.type != "cuda":
        return None
    if "cuda" not in _groups:
        raise RuntimeError("a CUDA tensor in a collective, but the run's device was not bound (bind_device)")
    return _groups["cuda"]


def all_reduce_sum(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Sum each tensor over the ranks, in place (one collective per tensor: no extra
    parameter-sized buffer, which matters for the largest models)."""
    if is_distributed():
        for tensor in tensors:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=_group_of(tensor))
    return tensors


def row_shard(rows: int, index: int | None = None, count: int | None = None) -> slice:
    """The rows of a tensor with `rows` rows (dim 0) that rank `index` of `count` (default: this
    rank of this run's) holds when the ranks shard it: torch.chunk's rule, which is FSDP2's
    Shard(0): ceil(rows / count) rows each, the last ranks fewer or none."""
    index, count = rank() if index is None else index, world_size() if count is None else count
    per_rank = -(-rows // count)
    return slice(min(index * per_rank, rows), min((index + 1) * per_rank, rows))


def row_shard_shape(shape) -> torch.Size:
    """The shape of this rank's rows (`row_shard`) of a tensor of `shape`: what
    `reduce_scatter_rows` returns for it (a 0-dim tensor counts as one row, held by rank 0; one
    process: `shape` itself)."""
    shape = torch.Size(shape)
    if not is_distributed():
        return shape
    mine = row_shard(shape[0] if shape else 1)
    if not shape:
        return shape if mine.stop > mine.start else torch.Size([0])
    return torch.Size([mine.stop - mine.start, *shape[1:]])


_NO_REDUCE_SCATTER: set[str] = set()  # backends whose build turned out to lack reduce-scatter


def reduce_scatter_rows(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of `tensor` over the ranks, this rank's rows of it only (`row_shard`; a 0-dim tensor
    counts as one row, held by rank 0). One process: `tensor` itself. `tensor` may be overwritten."""
    if not is_distributed():
        return tensor
    rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
    mine, world = row_shard(rows.shape[0]), world_size()
    shape = row_shard_shape(tensor.shape)
    group = _group_of(tensor)
    backend = dist.get_backend(group)
    if backend not in _NO_REDUCE_SCATTER:
        per_rank = -(-rows.shape[0] // world)
        padding = per_rank * world - rows.shape[0]  # reduce-scatter splits equal blocks
        source = torch.cat([rows, rows.new_zeros((padding, *rows.shape[1:]))]) if padding else rows.contiguous()
        shard = rows.new_empty((per_rank, *rows.shape[1:]))
        try:
            getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(shard, source, op=dist.ReduceOp.SUM,
                                                                              group=group)
            return shard[: mine.stop - mine.start].reshape(shape)
        except (RuntimeError, NotImplementedError) as error:
            # raised before any communication, alike on every rank (one backend), so no rank is left waiting
            if "not support" not in str(error):
                raise
            _NO_REDUCE_SCATTER.add(backend)
    # Backends without reduce-scatter (gloo in some torch builds): the whole sum on every rank, in
    # place, then this rank's rows, copied so that the whole sum can be freed.
    rows = rows.contiguous()
    dist.all_reduce(rows, op=dist.ReduceOp.SUM, group=group)
    return rows[mine].clone().reshape(shape)


def gather_rows(shard: torch.Tensor, shape) -> torch.Tensor:
    """The whole tensor of `shape` of which each rank holds its rows (`row_shard`: torch.chunk's
    rule along dim 0, what `reduce_scatter_rows` leaves; a 0-dim tensor counts as one row, held by
    rank 0), on every rank: the ranks' shards padded to equal rows, all-gathered, concatenated in
    rank order and trimmed. `shape` may be a row count (the rest of `shard`'s shape then follows).
    One process: `shard` itself. Every rank must call it alike (it is a collective)."""
    if not is_distributed():
        return shard
    shape = torch.Size([shape, *shard.shape[1:]]) if isinstance(shape, int) else torch.Size(shape)
    rows = shape[0] if shape else 1
    tail = shape[1:]
    mine, world = row_shard(rows), world_size()
    held = shard.reshape(mine.stop - mine.start, *tail)  # a 0-dim shard: one row (rank 0) or none
    per_rank = -(-rows // world)
    padded = torch.cat([held, held.new_zeros((per_rank - held.shape[0], *tail))]) if held.shape[0] < per_rank else held
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded.contiguous(), group=_group_of(shard))
    return torch.cat(pieces)[:rows].reshape(shape)


def all_reduce_scalars(*values: float) -> list[float]:
    """Sum python floats over the ranks (float64 on the CPU)."""
    if not is_distributed():
        return list(values)
    buffer = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    return buffer.tolist()


def same_on_every_rank(values: list[int]) -> bool:
    """Whether every rank holds the same list of integers (exact below 2**53), given that every
    rank's list has the same length: one small all-reduce (MAX of the values and of their
    negatives, float64 on the CPU), whose answer is the same on every rank. One process: True."""
    if not is_distributed():
        return True
    values = torch.tensor([float(v) for v in values], dtype=torch.float64)
    both = torch.cat([values, -values])
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return bool(torch.equal(both[: values.numel()], -both[values.numel():]))


def broadcast(tensors: list[torch.Tensor], source: int = 0) -> list[torch.Tensor]:
    """Overwrite each tensor with rank `source`'s, in place."""
    if is_distributed():
        for tensor in tensors:
            dist.broadcast(tensor, src=source, group=_group_of(tensor))
    return tensors


def broadcast_object(value: Any, source: int = 0) -> Any:
    """Rank `source`'s picklable value on every rank."""
    if not is_distributed():
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=source)
    return holder[0]


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's picklable value, in rank order, on every rank."""
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def shutdown() -> None:
    """Leave the process group (at the end of a torchrun run): frees its sockets and communicators."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _groups.clear()


# --- stopping together ----------------------------------------------------------------------------
class PeerFailure(RuntimeError):
    """Another rank failed: this one stops at the same point."""


# Error types that every rank raises alike when one rank raised them (a diverged run is recorded
# as diverged by rank 0, a user error stays a one-line error); any other becomes PeerFailure.
SHARED_ERRORS: dict[str, type[Exception]] = {"DivergedError": DivergedError, "UserError": UserError}
PATIENCE_S = 600.0  # how long a failed rank waits for the others to reach the agreement
STEP_PATIENCE_S = 60.0  # ... at the end of a training step: at least this, or 3x the slowest step


def raise_together(error: BaseException | None, where: str, patience_s: float | None = None) -> None:
    """Every rank calls this at the same point of the run with what it failed with (None: nothing).
    One small all-reduce of a flag tells all ranks whether any failed; if so, each raises: its own
    error, or that of the lowest failed rank (`SHARED_ERRORS`, else PeerFailure). One process:
    raises `error` if there is one.

    A failed rank waits at most `patience_s` for the others: if they are blocked in a collective of
    the step it left, they never come, so it closes the process group (their collective then fails)
    and raises its error."""
    if not is_distributed():
        if error is not None:
            raise error
        return
    control = _groups.get("control")
    flag = torch.tensor([0.0 if error is None else 1.0], dtype=torch.float64)
    try:
        work = dist.all_reduce(flag, op=dist.ReduceOp.SUM, group=control, async_op=True)
        if error is None:
            work.wait()
        else:
            work.wait(timeout=timedelta(seconds=PATIENCE_S if patience_s is None else patience_s))
    except Exception as agreement_failure:  # noqa: BLE001 - a peer left or never came: stop here
        if error is not None:
            shutdown()
            raise error from None
        raise PeerFailure(f"another rank stopped before this one finished {where} (the process group closed): "
                          "its error is in its output") from agreement_failure
    if flag.item() == 0:
        return
    failures = [None] * world_size()
    dist.all_gather_object(failures, None if error is None else (type(error).__name__, str(error)), group=control)
    if error is not None:
        raise error
    failed_rank, (kind, message) = next((r, f) for r, f in enumerate(failures) if f is not None)
    raise SHARED_ERRORS.get(kind, PeerFailure)(f"rank {failed_rank} failed {where}: {kind}: {message}")


def check_same_as_rank_zero(what: str, value: dict) -> None:
    """Fail on every rank, in one line, unless every rank's `value` equals rank 0's."""
    if not is_distributed():
        return
    reference = broadcast_object(value)
    differing = sorted(key for key in set(reference) | set(value) if reference.get(key) != value.get(key))
    error = None
    if differing:
        shown = "; ".join(f"{key} {value.get(key)!r} vs {reference.get(key)!r}" for key in differing[:3])
        error = UserError(f"the {what} on rank {rank()} differs from rank 0's ({shown}): "
                          "every rank must run the same command, config and code")
    raise_together(error, f"checking the {what}")


def check_replicas(model: torch.nn.Module) -> None:
    """Fail before training unless every rank holds rank 0's parameters, buffers and global RNG
    state (from which the public seeds of projectors and directions are drawn). Every rank runs
    the same collectives and raises together (a lone failing rank would leave the others waiting)."""
    if not is_distributed():
        return
    differing = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if hasattr(tensor, "to_local"):  # a shard (train.sharding=fsdp): checked whole before sharding (run.setup)
            continue
        reference = tensor.detach().clone()
        broadcast([reference])
        if not torch.equal(reference, tensor.detach()):
            differing.append(name)
    state = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    if broadcast_object(state) != state:
        differing.append("the seeded torch RNG state (public seeds)")
    (ranks_differing,) = all_reduce_scalars(float(bool(differing)))
    if ranks_differing:
        mine = f"here (rank {rank()}): {', '.join(differing[:3])}" if differing else f"not on rank {rank()}"
        raise RuntimeError(
            f"model initialisation differs from rank 0's on {int(ranks_differing)} rank(s), {mine}; "
            "every rank must build the model from the same seed"
        )


def require_data_parallel(algo_cls: type, name: str) -> None:
    """Refuse, with the fix, an algorithm whose step is not a sum of per-rank releases."""
    if not is_distributed():
        return
    if not algo_cls.private:
        raise UserError(
            f"algo={name} is non-private: multi-process runs support private algorithms only "
            "(their releases are summed over ranks); run it in one process, without torchrun"
        )
    if not algo_cls.data_parallel:
        raise UserError(f"algo={name} does not support multi-process data parallel runs; run it without torchrun")
