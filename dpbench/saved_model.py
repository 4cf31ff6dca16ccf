"""The trained model a run keeps: `model.safetensors` in the run folder, the one release of its weights.

Written at the end of a completed run (train.save_model=true, the default; always with
train.evaluate_test=false, whose test metric can only come from it), after the ledger is complete
and results.json's privacy section is computed: the file is covered by the epsilon results.json
reports. A run that fails or stops leaves none (checkpoint.pt is internal: it is not a release,
holds optimizer state, and is deleted once the run ends).

What the file holds (safetensors: tensors plus a string-to-string header, no pickle):
- the model's state dict (parameters and persistent buffers); a tensor tied to another (the same
  Parameter under two names, e.g. an LM head sharing the embedding) is stored once under its first
  name and the header lists its aliases, as safetensors refuses shared tensors;
- frozen parameters too, except when the model is built from a base checkpoint on disk
  (`model.path`, or a fetched `model.asset`): those are rebuilt from it, and the header names it
  with its SHA-256 (checked on load) and a (sum, norm) fingerprint of every frozen parameter;
- the resolved config, which rebuilds the task, model and algorithm (LoRA adds its adapters).

`load_model(run_dir)` (also `dpbench.api.load_model`) rebuilds from the header and loads the
weights; `dpbench-evaluate RUN_DIR` prints its test metric. The base checkpoint is found by its
SHA-256, not by the path it had where the run trained (`find_base`): a moved cache still serves.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from omegaconf import DictConfig

from dpbench.errors import UserError
from dpbench.paths import atomic_write

MODEL_FILE = "model.safetensors"
LEGACY_MODEL_FILE = "final_model.pt"  # dpbench before model.safetensors: trainable parameters, train.evaluate_test=false
FORMAT = "dpbench-model"
FORMAT_VERSION = "1"


def wanted(cfg: DictConfig) -> bool:
    """Whether a completed run keeps its model."""
    return bool(cfg.train.get("save_model", True)) or not bool(cfg.train.get("evaluate_test", True))


def base_checkpoint(model_cfg) -> Path | None:
    """The base checkpoint on disk the model's frozen parts come from (None: built from config and seed)."""
    if model_cfg.get("path"):
        return Path(str(model_cfg.path)).expanduser()
    if model_cfg.get("asset"):
        from dpbench.assets import asset_dir

        return asset_dir(str(model_cfg.asset))
    return None


def sha256_of_checkpoint(path: Path) -> str:
    """SHA-256 of a file, or of a folder's files (their relative names and contents, in name order)."""
    from dpbench.assets import sha256_of

    if path.is_file():
        return sha256_of(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path)).encode() + b"\0" + sha256_of(file).encode())
    return digest.hexdigest()


def _tensors(model: torch.nn.Module, omit_frozen: bool) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict's tensors with each tied one stored once, and {alias: stored name}."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    first: dict[int, str] = {}
    tensors, aliases = {}, {}
    for name, value in model.state_dict(keep_vars=True).items():
        if omit_frozen and name in frozen:
            continue
        if id(value) in first:  # tied: the same tensor object under another name
            aliases[name] = first[id(value)]
            continue
        first[id(value)] = name
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
    return tensors, aliases


def save_model(model: torch.nn.Module, cfg: DictConfig, config: dict, run_dir: Path) -> Path:
    """Write `model.safetensors` (see the module docstring); `config` is the run's resolved config."""
    from safetensors.torch import save

    from dpbench.runtime.algorithm_state import frozen_fingerprint

    base = base_checkpoint(cfg.model)
    if base is not None and not base.exists():
        base = None  # built without it (a test's tiny config): every weight is stored
    tensors, aliases = _tensors(model, omit_frozen=base is not None)
    header = {
        "format": FORMAT, "version": FORMAT_VERSION,
        "config": json.dumps(config),
        "aliases": json.dumps(aliases),
        "base": json.dumps(None if base is None else {"path": str(base), "sha256": sha256_of_checkpoint(base)}),
        "frozen": json.dumps(frozen_fingerprint(model) if base is not None else {}),
    }
    data = save(tensors, metadata=header)
    return atomic_write(Path(run_dir) / MODEL_FILE, lambda handle: handle.write(data), binary=True)


def read_header(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
    except Exception as error:  # noqa: BLE001 - truncated or not a safetensors file
        raise UserError(f"{path} is unreadable ({type(error).__name__}); it is not a model dpbench saved") from error
    if header.get("format") != FORMAT:
        raise UserError(f"{path} is not a model dpbench saved (no '{FORMAT}' header)")
    return {key: json.loads(value) for key, value in header.items() if key not in ("format", "version")}


def saved_config(run_dir: Path) -> dict:
    """The resolved config stored with the run's model (model.safetensors, else results.json for final_model.pt)."""
    path = Path(run_dir) / MODEL_FILE
    if path.is_file():
        return read_header(path)["config"]
    from dpbench.logging.results import read_results

    stored = read_results(run_dir) if (Path(run_dir) / LEGACY_MODEL_FILE).is_file() else None
    if stored is None:
        raise UserError(f"{run_dir} holds no {MODEL_FILE}: run it to the end with train.save_model=true (the default)")
    return stored["config"]


def find_base(run_dir: Path, model_cfg=None) -> Path | None:
    """The base checkpoint the saved model's frozen parts are rebuilt from (None: it has none), found
    by its SHA-256 among `model.path` (as given now), the fetched `model.asset` in the current cache
    and the path it had when the run trained; else one line before anything is rebuilt."""
    path = Path(run_dir) / MODEL_FILE
    base = read_header(path)["base"] if path.is_file() else None
    if base is None:
        return None
    candidates = []
    if model_cfg is not None and model_cfg.get("path"):
        candidates.append(Path(str(model_cfg.path)).expanduser())
    if model_cfg is not None and model_cfg.get("asset"):
        from dpbench.assets import asset_dir, fetch_command

        candidates.append(asset_dir(str(model_cfg.asset)))
    candidates.append(Path(base["path"]))
    candidates = list(dict.fromkeys(candidates))
    for candidate in candidates:
        if candidate.exists() and sha256_of_checkpoint(candidate) == base["sha256"]:
            return candidate
    fetch = (f", or fetch the asset with `{fetch_command(str(model_cfg.asset))}`"
             if model_cfg is not None and model_cfg.get("asset") else "")
    raise UserError(f"{path} needs its base checkpoint (SHA-256 {base['sha256'][:12]}...), which is not at "
                    f"{' nor '.join(map(str, candidates))}: give its place with model.path=DIR{fetch}")


def load_weights(model: torch.nn.Module, run_dir: Path, base_folder: Path | None = None) -> None:
    """Load the saved weights into a model rebuilt from `saved_config` (UserError if they do not fit);
    `base_folder`: the base checkpoint `find_base` found (else it is looked up at its saved path)."""
    from safetensors.torch import load_file

    from dpbench.runtime.algorithm_state import CheckpointMismatch, check_frozen

    run_dir = Path(run_dir)
    path = run_dir / MODEL_FILE
    if not path.is_file():  # an older run's final_model.pt: its trainable parameters
        state = torch.load(run_dir / LEGACY_MODEL_FILE, map_location="cpu", weights_only=True)
        parameters = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                parameters[name].copy_(value)
        return
    header = read_header(path)
    base = header["base"]
    if base is not None and base_folder is None:
        find_base(run_dir)  # the checkpoint at its saved path, or one line
    tensors = load_file(str(path))  # on the CPU; load_state_dict copies them to the model's device
    expected = set(model.state_dict()) - set(header["aliases"])
    if base is not None:
        expected -= {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    if set(tensors) != expected:
        extra, missing = sorted(set(tensors) - expected), sorted(expected - set(tensors))
        raise UserError(f"{path} does not fit the model rebuilt from its config (unexpected {extra[:3]}, missing {missing[:3]})")
    incompatible = model.load_state_dict(tensors, strict=False)
    if incompatible.unexpected_keys:
        raise UserError(f"{path} holds weights the rebuilt model lacks: {incompatible.unexpected_keys[:3]}")
    try:
        if base is not None:
            check_frozen(model, header["frozen"])
    except CheckpointMismatch as error:
        raise UserError(f"{path}: {error}; the base checkpoint does not rebuild the trained model") from error
