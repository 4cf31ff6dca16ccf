"""Run dpbench from Python (a notebook, a script) with the same config and overrides as the CLI.

    from dpbench.api import run
    results = run(["algo=dpadam", "privacy.epsilon=3", "logger=none"])
    results.metrics.test_accuracy, results.privacy.epsilon

`run` composes conf/ exactly as `dpbench <overrides>` does, trains, writes results.json into
`run_dir` (default: a new folder under outputs/runs/) and returns its `RunResults`
(dpbench.logging.results: one typed section per block of the file; `to_json()` is the file), with
`results.run_dir` the folder. It reruns the job unless `resume=True` is passed and `run_dir` holds a
run of the same config. `quiet=True` prints nothing (no bar, no table, no notes).

    from dpbench.api import grid, load_runs
    grid(["logger=none"], {"algo": ["grape", "dpadam"], "seed": [0, 1]}, "outputs/multirun/mine")
    load_runs("outputs/multirun/mine")   # a pandas.DataFrame: one row per run

    from dpbench.api import train_module   # your own nn.Module and datasets (docs/bring-your-own.md)
    train_module(model, train, test, num_classes=3, overrides=["algo=grape", "logger=none"])
"""

from __future__ import annotations

import time
from pathlib import Path

from omegaconf import DictConfig

from dpbench.logging.results import RunResults


def compose(overrides: list[str] | None = None) -> DictConfig:
    """The config `dpbench <overrides>` would run (without Hydra's runtime section)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from dpbench.paths import config_dir
    from dpbench.schema import checked_composition

    check_overrides(overrides)
    with checked_composition(), initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


def check_overrides(overrides) -> None:
    """A list of `key=value` strings: a string alone would be read one character per override."""
    from dpbench.errors import UserError

    if isinstance(overrides, str):
        raise UserError(f"overrides must be a list of strings, e.g. [{overrides!r}], not the string {overrides!r}")
    if overrides is not None and not isinstance(overrides, (list, tuple)):  # a dict: its keys alone would be read
        raise UserError(f"overrides must be a list of 'key=value' strings, e.g. ['algo=grape'], got a {type(overrides).__name__}")


def run(overrides: list[str] | None = None, run_dir: str | Path | None = None, resume: bool = False,
        show_progress: bool = True, quiet: bool = False) -> RunResults:
    """Compose, run one job and return its results (docs/running.md, "What a run writes"), with
    `results.run_dir` the folder it wrote. `quiet`: no output at all (errors still raise).
    Bad input, as the console script refuses it, raises `dpbench.errors.UserError` (one line)."""
    from omegaconf import open_dict

    from dpbench.logging.console import console
    from dpbench.preflight import check_environment
    from dpbench.run import run_job

    cfg = compose(overrides)
    with open_dict(cfg):
        cfg.resume = resume
    if run_dir is None:
        run_dir = Path("outputs/runs") / f"{time.strftime('%Y-%m-%d_%H-%M-%S')}_{cfg.algo.name}_{cfg.dataset.name}_api"
    check_environment(cfg, run_dir, "run_dir")  # device, W&B login, writable folder: before any work
    was_quiet, console.quiet = console.quiet, quiet or console.quiet
    try:
        results = run_job(cfg, Path(run_dir), show_progress=show_progress and not quiet)
    finally:
        console.quiet = was_quiet
    results.run_dir = Path(run_dir)
    return results


def grid(overrides: list[str] | None, sweep: dict[str, list], folder: str | Path, quiet: bool = True,
         resume: bool = True) -> list[RunResults]:
    """Run every combination of `sweep` ({key: [values]}, as `dpbench -m key=a,b`) on top of
    `overrides`, one job after another, each in `folder/<key=value,...>` (the CLI's folder names),
    and return their results in order. `resume`: a job whose folder holds a finished run of the same
    config is not run again (an interrupted grid, rerun, continues)."""
    import itertools

    from dpbench.run_config import API_GRID

    from dpbench.errors import UserError

    check_overrides(overrides)
    for key, values in sweep.items():
        if not isinstance(values, (list, tuple)) or not values:  # "grape,dpadam" would be swept one character at a time
            raise UserError(f"grid: sweep[{key!r}] must be a non-empty list of values, e.g. {{{key!r}: ['a', 'b']}}, "
                            f"got {values!r}")
    keys = list(sweep)
    out = []
    token = API_GRID.set(True)  # a grid's shared privacy keys are notes for its non-private jobs, as with -m
    try:
        for values in itertools.product(*(sweep[k] for k in keys)):
            point = [f"{k}={v}" for k, v in zip(keys, values)]
            out.append(run([*(overrides or []), *point], Path(folder) / ",".join(point), resume=resume, quiet=quiet))
    finally:
        API_GRID.reset(token)
    return out


def load_runs(folder: str | Path):
    """Every run under `folder` (results.json files, any schema version) as a pandas.DataFrame: one
    row per run, with run_dir, status, algo, model, dataset, seed and the figures under the names
    W&B and the summary table use ("test/accuracy", "privacy/epsilon", ...)."""
    import pandas as pd

    from dpbench.logging.results import RESULTS_FILE, read_results

    from dpbench.errors import UserError

    if not Path(folder).is_dir():  # a typo in the path would otherwise read as a folder without runs
        raise UserError(f"load_runs: {folder} is not a folder")
    rows = []
    for path in sorted(Path(folder).rglob(RESULTS_FILE)):
        results = RunResults.from_json(read_results(path.parent))
        rows.append({"run_dir": str(path.parent), "algo": results.algo, "model": results.model,
                     "dataset": results.dataset, "seed": results.seed, **results.summary()})
    return pd.DataFrame(rows, columns=None if rows else ["run_dir", "algo", "model", "dataset", "seed"])


def rebuild(run_dir: str | Path, overrides: list[str] | None = None):
    """The run's job (task, model, algorithm) rebuilt from the config saved with its model, with dotted
    `overrides` (dataset.*, device, threads, model.path: what the weights do not depend on), its saved weights
    loaded, in eval mode. (Here, not in dpbench.saved_model: rebuilding runs `setup`, and run.py
    imports saved_model to write the file.)"""
    from omegaconf import OmegaConf

    from dpbench.errors import UserError
    from dpbench.run import setup
    from dpbench.run_config import stored_config
    from dpbench.assets import asset_dir
    from dpbench.saved_model import find_base, load_weights, saved_config

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a folder; give a run folder such as outputs/runs/<run>")
    config = stored_config(saved_config(run_dir))  # older runs' epsilon beside sigma reads as today's checks want
    allowed = ("dataset.", "device=", "threads=", "model.path=")
    for override in overrides or []:
        if not override.startswith(allowed) or "=" not in override:
            raise UserError(f"cannot override {override.split('=')[0]!r} when evaluating a saved model: only "
                            "dataset.*, device, threads and model.path (the weights depend on the rest)")
        key, absent = override.split("=")[0], object()
        if OmegaConf.select(config, key, default=absent) is absent:  # a typo would evaluate the run's own test set
            raise UserError(f"{key} is not a key of this run's config (dataset keys: "
                            f"{', '.join(config.get('dataset') or {})})")
    config = OmegaConf.merge(config, OmegaConf.from_dotlist(list(overrides or [])))
    base = find_base(run_dir, config.model)  # by SHA-256, before anything is built: a moved cache still serves
    if base is not None and not (config.model.get("asset") and base == asset_dir(str(config.model.asset))):
        config.model.path = str(base)  # model.path wins over model.asset (dpbench/models/bert.py)
    job = setup(config)
    load_weights(job.model, run_dir, base)
    job.model.eval()
    return job


def load_model(run_dir: str | Path, overrides: list[str] | None = None):
    """The trained model a run kept (`model.safetensors`, docs/running.md "What a run writes"): the
    task, model and algorithm rebuilt from the config saved with it (`overrides`: dataset.*, device,
    threads), its weights loaded, in eval mode. A torch.nn.Module."""
    return rebuild(run_dir, overrides).model


def evaluate_saved(run_dir: str | Path) -> dict:
    """Evaluate a run's saved final model (model.safetensors; final_model.pt of an older run) on the
    test set, once: the task and model are rebuilt from the saved config, the saved weights loaded,
    and the task's test metrics (with `metric`, what `accuracy` holds) written into results.json as
    `saved_model_test` and returned. A search evaluates only the model it selected (by its
    validation score) this way. A run evaluated before returns its stored figures: the test set is
    not read again."""
    from dpbench.errors import UserError
    from dpbench.logging.results import read_results, write_results
    run_dir = Path(run_dir)
    stored = read_results(run_dir)
    if stored is None:
        raise UserError(f"{run_dir} holds no results.json: run it to the end first")
    results = RunResults.from_json(stored)
    if results.saved_model_test:  # evaluated already (a resumed study): the test set is read once
        return dict(results.saved_model_test)
    job = rebuild(run_dir)  # same seed: the frozen parts are rebuilt as they were
    metrics = {"metric": job.task.metric_name, **job.task.evaluate(job.model)}
    results.saved_model_test = metrics
    write_results(run_dir, results)
    return metrics



def train_module(model, train, test, *, num_classes: int, overrides: list[str] | None = None, loss=None,
                 trained_modules: list[str] | None = None, projected_modules: list[str] | None = None,
                 lora_targets: list[str] | None = None, name: str = "module", run_dir: str | Path | None = None,
                 show_progress: bool = True, quiet: bool = False) -> RunResults:
    """Train a user's `torch.nn.Module` with any dpbench algorithm and accountant (the habit of
    Opacus's `make_private`; docs/bring-your-own.md, "From Python") and return its `RunResults`.

    The run trains a copy of `model`; when it completes, the trained weights and buffers are loaded
    into `model` (LoRA adapters merged into their layers), which is otherwise as it was handed
    over: no engine hooks, no per-example attributes, its own layers, `requires_grad` flags,
    train/eval mode, devices and dtypes (another engine, or another train_module, can be built on it).

    `train`, `test`: map-style datasets (`__len__`, `__getitem__`) of `(x, y)` pairs, sampled by
    dpbench's own sampler; `overrides`: `dpbench` command-line overrides (algorithm, privacy, train);
    `loss`: a per-example loss `(outputs, labels) -> Tensor[B]` (`reduction='none'`; default
    cross-entropy); `trained_modules` / `projected_modules` / `lora_targets`: the model's family
    facts (fnmatch patterns of module names). The run goes through the config route
    (`model=custom`, `dataset=custom`, dpbench/handover.py), so the per-example checks run first. A
    DataLoader, an IterableDataset or data without a length, a `model=`/`dataset=` override, or a
    loss that is not per-example raises a one-line `UserError`."""
    from torch import nn

    from dpbench.data.user import check_map_style
    from dpbench.errors import UserError
    from dpbench.handover import handed, handed_overrides, load_trained_weights, trainable_copy

    if not isinstance(model, nn.Module):
        raise UserError(f"train_module: model must be a torch.nn.Module, got a {type(model).__name__}")
    for which, split in (("train", train), ("test", test)):
        check_map_style(split, f"train_module: {which} is")
    taken = [o for o in overrides or [] if o.lstrip("+~").split("=")[0] in ("model", "dataset")]
    if taken:
        raise UserError(f"train_module trains the model and data it is given; leave {', '.join(taken)} out of overrides")
    handover = handed_overrides(name, loss is not None, trained_modules, projected_modules, lora_targets)
    trained = trainable_copy(model)  # the run hooks, wraps and freezes the copy, never the caller's module
    with handed(trained, train, test, num_classes, loss):
        results = run([*handover, *(overrides or [])], run_dir=run_dir, show_progress=show_progress, quiet=quiet)
    load_trained_weights(model, trained)
    return results
