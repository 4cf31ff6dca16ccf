"""An algorithm's state in a checkpoint: what its class declares to keep, as plain containers.

`algorithm_state()` holds the trainable parameters and buffers, the torch optimizer's state and the
attributes the class lists in `checkpoint_attributes` (dotted names; tensors, generators,
containers: `pack` / `unpack`); frozen parameters are rebuilt from the config and seed and only
their fingerprint is kept. A sharded model's parameters and optimizer state go through
`torch.distributed.checkpoint` instead (`save_sharded_state`, each rank its shards). The file,
its schedule and the signals that trigger it: checkpoint.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dpbench.runtime import distributed

# --- algorithm state: attributes of any shape as plain containers ---------------------------------
class CheckpointMismatch(ValueError):
    """The stored state does not fit the algorithm or model being restored."""


def pack(value, names: dict[int, str]):
    """A checkpointable copy of `value`: tensors on the CPU, generators as their state, dicts keyed
    by parameters keyed by parameter name (`names`: id -> name), containers recursively."""
    if isinstance(value, torch.Generator):
        return {"__kind__": "generator", "state": value.get_state()}
    if hasattr(value, "to_local"):  # a DTensor (train.sharding=fsdp): only its rank's shard is here
        raise TypeError("cannot checkpoint a sharded tensor (DTensor) as an attribute: keep it in the optimizer")
    if torch.is_tensor(value):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        if value and all(isinstance(key, torch.nn.Parameter) for key in value):
            return {"__kind__": "by_parameter", "items": {names[id(k)]: pack(v, names) for k, v in value.items()}}
        return {key: pack(v, names) for key, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(pack(v, names) for v in value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot checkpoint a {type(value).__name__}")


def unpack(saved, current, device: torch.device, parameters: dict[str, torch.nn.Parameter]):
    """The inverse of `pack`; a generator is restored into `current` in place (others share it)."""
    kind = saved.get("__kind__") if isinstance(saved, dict) else None
    if kind == "generator":
        generator = current if isinstance(current, torch.Generator) else torch.Generator()
        generator.set_state(saved["state"])
        return generator
    if kind == "by_parameter":
        missing = set(saved["items"]) - set(parameters)
        if missing:
            raise CheckpointMismatch(f"state of unknown parameters {sorted(missing)[:3]}")
        return {parameters[n]: unpack(v, None, parameters[n].device, parameters) for n, v in saved["items"].items()}
    if torch.is_tensor(saved):
        return saved.to(device)
    if isinstance(saved, dict):
        return {key: unpack(v, None, device, parameters) for key, v in saved.items()}
    if isinstance(saved, (list, tuple)):
        return type(saved)(unpack(v, None, device, parameters) for v in saved)
    return saved


def frozen_fingerprint(model: torch.nn.Module) -> dict[str, list[float]]:
    """(sum, norm) of every frozen parameter: they are rebuilt from config and seed, not stored."""
    return {
        name: [float(torch.sum(p.detach(), dtype=torch.float64)), float(torch.linalg.vector_norm(p.detach(), dtype=torch.float64))]
        for name, p in model.named_parameters()
        if not p.requires_grad
    }


def check_frozen(model: torch.nn.Module, stored: dict[str, list[float]]) -> None:
    rebuilt = frozen_fingerprint(model)
    if set(rebuilt) != set(stored):
        raise CheckpointMismatch("the frozen parameters differ")
    for name, values in stored.items():
        if not np.allclose(rebuilt[name], values, rtol=1e-5, atol=1e-6):
            raise CheckpointMismatch(f"the rebuilt frozen parameter {name} differs from the checkpointed run's")


def _attribute(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _attributes_state(algorithm, log_private_stats: bool, names: dict[int, str]) -> dict:
    withheld = set() if log_private_stats else algorithm.private_statistics()
    return {a: None if a in withheld else pack(_attribute(algorithm, a), names) for a in algorithm.checkpointed_attributes()}


def _load_attributes(algorithm, attributes: dict, device: torch.device, parameters: dict) -> None:
    needed = algorithm.checkpointed_attributes()
    if set(attributes) != set(needed):
        raise CheckpointMismatch(f"it holds {sorted(attributes)}, {type(algorithm).__name__} needs {sorted(needed)}")
    for dotted, saved in attributes.items():
        if saved is None and dotted in algorithm.private_statistics():
            continue  # withheld (privacy.log_private_stats=false): the fresh value stays
        owner, _, name = dotted.rpartition(".")
        target = _attribute(algorithm, owner) if owner else algorithm
        setattr(target, name, unpack(saved, getattr(target, name), device, parameters))


def algorithm_state(algorithm, log_private_stats: bool = True) -> dict:
    """What continuing a run needs of an `Algorithm`: trainable parameters and buffers (frozen
    parameters are rebuilt from config and seed; their fingerprint is kept), a torch `optimizer`'s
    state and the attributes its class lists in `checkpoint_attributes` (None for its un-noised
    private statistics unless `log_private_stats`: resuming does not need them)."""
    model = algorithm.model
    names = {id(p): n for n, p in model.named_parameters()}
    optimizer = getattr(algorithm, "optimizer", None)
    if "_frozen_fingerprint" not in vars(algorithm):  # frozen parameters never change: computed once
        algorithm._frozen_fingerprint = frozen_fingerprint(model)
    return {
        "parameters": {n: pack(p, names) for n, p in model.named_parameters() if p.requires_grad},
        "buffers": {n: pack(b, names) for n, b in model.named_buffers()},
        "frozen": algorithm._frozen_fingerprint,
        "optimizer": pack(optimizer.state_dict(), names) if isinstance(optimizer, torch.optim.Optimizer) else None,
        "attributes": _attributes_state(algorithm, log_private_stats, names),
    }


def load_algorithm_state(algorithm, state: dict) -> None:
    """Restore `algorithm_state()` (or a sharded run's `sharded_algorithm_entry`) into a freshly
    built algorithm (CheckpointMismatch if it does not fit)."""
    sharded = getattr(algorithm, "sharded", False)
    if isinstance(state.get("sharded"), dict) or sharded:
        if not (isinstance(state.get("sharded"), dict) and sharded):
            raise CheckpointMismatch("one of the checkpoint and this run is sharded (train.sharding=fsdp), the other not")
        load_sharded_state(algorithm, state)
        return
    model = algorithm.model
    parameters = dict(model.named_parameters())
    stored = {**state["parameters"], **state["buffers"]}
    current = {**{n: p for n, p in parameters.items() if p.requires_grad}, **dict(model.named_buffers())}
    if set(stored) != set(current) or any(stored[n].shape != current[n].shape for n in current):
        raise CheckpointMismatch("its trained parameters or buffers differ in name or shape")
    check_frozen(model, state["frozen"])
    with torch.no_grad():
        for name, tensor in current.items():
            tensor.copy_(stored[name])
    optimizer = getattr(algorithm, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(state["optimizer"])
    device = next(iter(parameters.values())).device if parameters else torch.device("cpu")
    _load_attributes(algorithm, state["attributes"], device, parameters)


# --- sharded state (train.sharding=fsdp): torch.distributed.checkpoint ------------------------------
def _dcp_state(algorithm) -> dict:
    """The model's and optimizer's state dicts as DCP reads and writes them: DTensors holding this
    rank's shards, keyed by parameter name (`get_state_dict`; a collective)."""
    from torch.distributed.checkpoint import state_dict as dcp_state

    optimizer = getattr(algorithm, "optimizer", None)
    if isinstance(optimizer, torch.optim.Optimizer):
        model_state, optimizer_state = dcp_state.get_state_dict(algorithm.model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}
    return {"model": dcp_state.get_model_state_dict(algorithm.model)}


def save_sharded_state(algorithm, folder: Path) -> None:
    """Every rank writes its shards of the model and optimizer state into `folder` (`dcp.save`, a
    collective; rank 0 adds DCP's .metadata once all have written)."""
    import torch.distributed.checkpoint as dcp

    folder.mkdir(parents=True, exist_ok=True)
    dcp.save(_dcp_state(algorithm), checkpoint_id=str(folder))


def sharded_algorithm_entry(algorithm, folder_name: str, log_private_stats: bool = True) -> dict:
    """checkpoint.pt's algorithm state of a sharded run: the DCP folder's name (relative to the
    run folder's checkpoint-shards/, so a moved run folder still resumes), the world size that
    wrote it and every rank's `checkpoint_attributes` (a collective: every rank calls it)."""
    names = {id(p): n for n, p in algorithm.model.named_parameters()}
    attributes = distributed.all_gather_object(_attributes_state(algorithm, log_private_stats, names))
    return {"sharded": {"folder": folder_name, "world_size": distributed.world_size()}, "attributes": attributes}


def load_sharded_state(algorithm, state: dict) -> None:
    """Restore a sharded checkpoint into a freshly built sharded algorithm: each rank reads its
    rows of every parameter and optimizer state from the DCP folder (`dcp.load`, resharding when
    the checkpoint was written by another number of ranks), then this rank's attributes (rank 0's
    under another world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict as dcp_state

    path = state["sharded"].get("path")
    if path is None:
        raise CheckpointMismatch("it does not say where its sharded state is (read it with read_checkpoint)")
    target = _dcp_state(algorithm)
    dcp.load(target, checkpoint_id=path)
    if "optimizer" in target:
        dcp_state.set_state_dict(algorithm.model, algorithm.optimizer, model_state_dict=target["model"],
                                 optim_state_dict=target["optimizer"])
    else:
        dcp_state.set_model_state_dict(algorithm.model, target["model"])
    per_rank = state["attributes"]
    mine = per_rank[distributed.rank()] if len(per_rank) == distributed.world_size() else per_rank[0]
    parameters = dict(algorithm.model.named_parameters())
    device = next(iter(parameters.values())).device if parameters else torch.device("cpu")
    _load_attributes(algorithm, mine, device, parameters)
