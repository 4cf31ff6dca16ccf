"""Resuming a run: a stored results.json or checkpoint is reused only when it is of the same config,
and a run that starts over in a folder an earlier attempt used says so in its results.

A grid's job folder is named by its overrides, so the same command finds it again. A single run's
folder is named by the time it started: `unfinished_attempt` finds the folder of an interrupted
run of the same config (a checkpoint, no results.json) beside it, and the run continues there."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from dpbench.runtime.checkpoint import CHECKPOINT_FILE, SHARDS_DIR, checkpoint_path, read_checkpoint
from dpbench.logging.console import console
from dpbench.logging.results import RESULTS_FILE, RunResults, read_results
from dpbench.run_config import resolved_config
from dpbench.schema import DEFAULT_SUPPLIERS, PREDATING_VALUES, RUN_INVARIANT_KEYS, USED_ONLY_WITH, default_of

UNUSED_WITH_STEPS = "train.epochs"  # not compared where either side sets train.steps


def config_differences(stored: dict, current: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two resolved configs (ignored keys left out)."""
    if not prefix:
        stored, current = _without_unread(stored, current), _without_unread(current, stored)
    keys = sorted(set(stored) | set(current))
    out = []
    for key in keys:
        dotted = f"{prefix}{key}"
        if dotted in RUN_INVARIANT_KEYS:
            continue
        a, b = stored.get(key, PREDATING_VALUES.get(dotted, "<absent>")), current.get(key, "<absent>")
        if dotted in DEFAULT_SUPPLIERS:
            continue
        if dotted == UNUSED_WITH_STEPS and (stored.get("steps") is not None or current.get("steps") is not None):
            continue  # steps win: epochs change nothing (an algorithm's default_steps nulls them; older runs recorded 30)
        if a == "<absent>" and b == default_of(dotted, current.get("name") if prefix == "algo." else None):
            continue  # a key added since the run was stored, left at its default
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, dotted + ".")
        elif a != b:
            out.append(f"{dotted} ({a!r} -> {b!r})")
    return out


def _without_unread(config: dict, other: dict) -> dict:
    """`config` less each USED_ONLY_WITH key that neither config reads."""
    def select(tree, dotted):
        for part in dotted.split("."):
            tree = tree.get(part) if isinstance(tree, dict) else None
        return tree

    out = config
    for dotted, (switch, value) in USED_ONLY_WITH.items():
        section, key = dotted.split(".")
        if value not in (select(config, switch), select(other, switch)) and key in (out.get(section) or {}):
            out = {**out, section: {k: v for k, v in out[section].items() if k != key}}
    return out


def matches_config(stored: dict, cfg: DictConfig, held: str, otherwise: str) -> bool:
    """Whether a stored run (results.json or checkpoint) is of this config; if not, say so."""
    differences = config_differences(stored.get("config") or {}, resolved_config(cfg))
    if differences:
        console.print(f"[yellow]note:[/] {held} of another config ({'; '.join(differences[:4])}); {otherwise}",
                      soft_wrap=True)
    return not differences


def reusable_results(cfg: DictConfig, run_dir: Path) -> RunResults | None:
    """The stored results of this exact job, or None (with the reason printed) to run it."""
    if not cfg.resume or (existing := read_results(run_dir)) is None:
        return None
    if not matches_config(existing, cfg, f"{run_dir} holds a run", "running it again"):
        return None
    console.print(f"[dim]results.json exists in {run_dir}: skipping (resume=false reruns it)[/]")
    return RunResults.from_json(existing)


# what an attempt leaves in its folder (checkpoint-shards: a sharded run's; error.txt: dpbench.cli.ERROR_FILE, written for a failed grid job)
EARLIER_ATTEMPT_FILES = (CHECKPOINT_FILE, SHARDS_DIR, "wandb", "error.txt", RESULTS_FILE)


def earlier_attempt_note(run_dir: Path) -> str | None:
    """A run starting from step 0 in a folder an earlier attempt used: that attempt's releases (its
    published evaluations, its W&B run) are in no epsilon, and results.json says so."""
    left = [name for name in EARLIER_ATTEMPT_FILES if (Path(run_dir) / name).exists()]
    if not left:
        return None
    return (f"this run started from step 0 in a folder an earlier attempt left ({', '.join(left)}); whatever that "
            "attempt released or published is outside this run's epsilon (their privacy costs add up)")


def resumable_checkpoint(cfg: DictConfig, run_dir: Path) -> dict | None:
    """The checkpoint of this exact job to continue from (same rule as `reusable_results`), or None."""
    if (stored := read_checkpoint(run_dir) if cfg.resume else None) is None:
        return None
    return stored if matches_config(stored, cfg, f"the checkpoint in {run_dir} is", "starting from step 0") else None


def stored_config(run_dir: Path) -> dict | None:
    """The config of the checkpoint in `run_dir`, read without loading its tensors (None: unreadable)."""
    import torch

    try:
        payload = torch.load(checkpoint_path(run_dir), map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - damaged or not a checkpoint: not an attempt to continue
        return None
    return payload.get("config") if isinstance(payload, dict) else None


def unfinished_attempt(cfg: DictConfig, run_dir: Path) -> Path | None:
    """The newest folder beside `run_dir` (a single run's timestamped folder) holding a checkpoint of
    this config and no results.json: an interrupted attempt of this run, to continue (resume=true).
    When the newest interrupted attempt is of another config, a note names what differs and where it is."""
    run_dir = Path(run_dir)
    if not cfg.resume or not run_dir.parent.is_dir():
        return None
    current = resolved_config(cfg)
    attempts = [path.parent for path in run_dir.parent.glob(f"*/{CHECKPOINT_FILE}")
                if path.parent != run_dir and not (path.parent / RESULTS_FILE).exists()]
    newest_other = None
    for folder in sorted(attempts, key=lambda folder: checkpoint_path(folder).stat().st_mtime, reverse=True):
        stored = stored_config(folder)
        if stored is None:
            continue
        differences = config_differences(stored, current)
        if not differences:
            return folder
        newest_other = newest_other or (folder, differences)
    if newest_other is not None:
        folder, differences = newest_other
        console.print(f"[yellow]note:[/] the interrupted run in {folder} is of another config "
                      f"({'; '.join(differences[:4])}{'; ...' if len(differences) > 4 else ''}): starting a new run; "
                      "rerun that run's own command to continue it", soft_wrap=True)
    return None


def continue_unfinished_attempt(cfg: DictConfig, run_dir: Path) -> Path:
    """The folder a single run runs in: an unfinished attempt of the same config if there is one (the
    new, still empty folder is then removed), else `run_dir`."""
    earlier = unfinished_attempt(cfg, run_dir)
    if earlier is None:
        return run_dir
    run_dir = Path(run_dir)
    if run_dir.is_dir() and all(p.is_file() and p.stat().st_size == 0 for p in run_dir.iterdir()):
        for leftover in run_dir.iterdir():  # Hydra's empty job log
            leftover.unlink()
        run_dir.rmdir()
    console.print(f"continuing the interrupted run in {earlier} (resume=false starts a new one)", soft_wrap=True)
    return earlier
