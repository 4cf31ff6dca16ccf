"""The `dpbench` console script: compose the Hydra config, run the job, map errors to exit codes.

    dpbench                                   # DP-GRAPE, micro ViT, bundled digits, eps=8
    dpbench algo=dpsgd privacy.epsilon=3      # any config value can be overridden
    dpbench -m algo=adam,dpadam seed=0,1      # a grid; finished jobs are skipped on rerun
    torchrun --nproc_per_node=4 -m dpbench.cli algo=dpadam   # data parallel (dpbench/runtime/distributed.py)

Exit status: 0 done; 1 a run failed (diverged, or some jobs of a grid failed); 2 bad input
(dpbench's checks or Hydra's composition errors); 75 stopped by SIGTERM/SIGUSR1 after writing a
checkpoint (rerun the same command to resume); 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from dpbench import startup
from dpbench.errors import DivergedError, UserError
from dpbench.paths import config_dir

if TYPE_CHECKING:  # torch: imported once a command needs it (dpbench/startup.py answers --help without)
    from dpbench.logging.results import RunResults

EXIT_RUN_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130
ERROR_FILE = "error.txt"

# Jobs of this process's grid that failed: (job folder, one-line reason), filled by GridFailures
# when the grid ends. A grid goes on past a failed job and the process exits non-zero at the end.
_grid_failures: list[tuple[Path, str]] = []
_own_exit: list[int] = []  # exit statuses dpbench itself chose (vs Hydra's status 1 for its errors)


def _exit(status: int) -> None:
    _own_exit.append(status)
    sys.exit(status)


def _record_failure(run_dir: Path, message: str, detail: str | None = None) -> None:
    from dpbench.runtime import distributed

    if not distributed.is_main_process():  # under torchrun, rank 0 writes error.txt
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / ERROR_FILE).write_text(message + "\n" + (detail or ""))


# Shared file systems stamp files with the file server's clock, which may lag this machine's.
CLOCK_SLACK_S = 2.0


def failed_jobs(sweep_dir: Path, since: float) -> list[tuple[Path, str]]:
    """(job folder, first line of its error.txt) of the jobs under sweep_dir that failed since
    `since` (a time.time()); older error.txt files belong to earlier grids."""
    failed = []
    for path in sorted(Path(sweep_dir).rglob(ERROR_FILE)):
        try:
            if path.stat().st_mtime < since - CLOCK_SLACK_S:
                continue
            message = path.read_text().partition("\n")[0]
        except OSError:  # removed meanwhile (a job of the same grid restarting)
            continue
        failed.append((path.parent, message))
    return failed


class GridFailures(Callback):
    """After a grid, the jobs that failed in it (registered in conf/config.yaml, hydra.callbacks).

    Launchers such as joblib and submitit run jobs in other processes, so the failures are read
    back from the sweep folder: the error.txt files the grid's jobs wrote."""

    def __init__(self) -> None:
        self.started = time.time()

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        self.started = time.time()

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if str(config.hydra.sweeper.get("_target_", "")) == ACCOUNTED_SWEEPERS[1]:
            return  # a private study's failed trials are outcomes outside its epsilon (scored -inf), not shown
        _grid_failures.extend(failed_jobs(Path(config.hydra.sweep.dir), self.started))
        if str(config.hydra.sweeper.get("_target_", "")) == ACCOUNTED_SWEEPERS[0]:  # Hydra's basic grid
            grid_selection_note(Path(config.hydra.sweep.dir))
            print_grid_table(Path(config.hydra.sweep.dir))


def print_grid_table(sweep_dir: Path) -> None:
    """After a grid: its runs in one table, and the report command."""
    from dpbench.api import load_runs
    from dpbench.logging.console import console, grid_table

    if not Path(sweep_dir).is_dir():  # nothing ran
        return
    frame = load_runs(sweep_dir)
    if frame.empty:
        return
    console.print(grid_table(frame, sweep_dir))
    console.print(f"report: dpbench-report {sweep_dir}   (add --leaderboard for the ranked benchmark table)", soft_wrap=True)


# Run folders this process's Hydra is about to make (they did not exist before the command), each with
# its nearest folder that did: a job refused in one removes what Hydra made for it (mkdir -p) again.
_new_run_dirs: dict[Path, Path] = {}


class Preflight(Callback):
    """Before Hydra makes the run or sweep folder (registered in conf/config.yaml, hydra.callbacks):
    the machine checks of dpbench/preflight.py, so that a missing GPU, a missing W&B login or an
    unwritable folder is one line and exit 2 with nothing made (dpbench.preflight)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        folder = Path(str(config.hydra.run.dir)).absolute()
        self._check(config, folder, "hydra.run.dir")
        if not folder.exists():
            _new_run_dirs[folder] = next(p for p in folder.parents if p.exists())

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        folder = Path(str(config.hydra.sweep.dir)).absolute()
        self._check(config, folder, "hydra.sweep.dir")
        if not folder.exists():  # a grid refused before its first job (a typo in a value) removes it again
            _new_run_dirs[folder] = next(p for p in folder.parents if p.exists())

    @staticmethod
    def _check(config: DictConfig, folder: Path, key: str) -> None:
        from dpbench.preflight import Refused, check_environment

        try:
            check_environment(config, folder, key)
        except UserError as error:
            raise Refused(error) from None  # past Hydra's callback guard, to run_app's one line


# What a refused single run leaves in a folder Hydra made for it: Hydra's <job name>.log and dpbench's .hydra/
# (a refused grid: Hydra's multirun.yaml)
REFUSED_RUN_FILES = {".hydra", ".hydra/config.yaml", ".hydra/overrides.yaml", "multirun.yaml"}


def remove_refused_run_dir(run_dir: Path) -> None:
    """Remove the folder of a refused single run when this command made it and it holds nothing else
    (any Hydra app composing conf/config.yaml, dpbench-audit too: its Preflight recorded the folder)."""
    import shutil

    from dpbench.cli import _new_run_dirs as made  # the callback's module, also under `python -m`

    run_dir = Path(run_dir).absolute()
    if run_dir not in made or not run_dir.is_dir():
        return
    left = {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")}
    if not all(name in REFUSED_RUN_FILES or ("/" not in name and name.endswith(".log")) for name in left):
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in run_dir.parents:  # outputs/runs/ too, when this command made it and it is empty
        if parent == made[run_dir] or not parent.is_relative_to(made[run_dir]):
            break
        try:
            parent.rmdir()  # only an empty folder
        except OSError:
            break


SELECTION_FILE = "grid_selection.json"


def grid_selection_note(sweep_dir: Path) -> dict | None:
    """After a basic grid of private runs with noisy validation scores: what selecting among them
    by those scores costs. A grid is a FIXED number of trials, so the selection is charged all of
    them composed (epsilon_naive, dpbench.study.grid_selection_epsilon), not one run's epsilon:
    printed, and written to <sweep dir>/grid_selection.json. None when no run has a score."""
    import json

    from dpbench import study
    from dpbench.logging.console import console
    from dpbench.logging.results import read_results

    runs = [r for path in sorted(Path(sweep_dir).rglob("results.json"))
            if (r := read_results(path.parent)) is not None and (r.get("metrics") or {}).get("validation_score") is not None
            and (r.get("privacy") or {}).get("private")]
    deltas = {float(r["privacy"]["delta"]) for r in runs}
    if not runs or len(deltas) != 1:
        return None
    delta = deltas.pop()
    one = max(float(r["privacy"]["epsilon"]) for r in runs)
    naive = study.grid_selection_epsilon([r["privacy"]["ledger"] for r in runs], delta)
    note = {"runs": len(runs), "delta": delta, "epsilon_one_run": one, "epsilon_naive": naive,
            "note": (f"selecting among these {len(runs)} private runs by their noisy validation scores is a fixed-K "
                     f"selection: it costs epsilon_naive = {naive:.3f} (all {len(runs)} runs composed, dp-accounting RDP, "
                     f"delta {delta:g}), not one run's {one:.3f}; hydra/sweeper=private_search (a random K, only the best "
                     "released) is charged much less when there are many trials (docs/tuning.md)")}
    (Path(sweep_dir) / SELECTION_FILE).write_text(json.dumps(note, indent=2) + "\n")
    console.print(f"[yellow]note:[/] {note['note']}", soft_wrap=True)
    return note


def objective(cfg: DictConfig, results: RunResults | None) -> float:
    """What the job returns to a Hydra sweeper: `optimize` names a metrics key, "-key" negates it.

    Selection never reads the test set by default: with a validation split
    (dataset.validation_fraction > 0) and `optimize` left at its default, the job returns the
    final model's noisy validation score (metrics.validation_score)."""
    from dpbench.run_config import DEFAULT_OPTIMIZE

    key = str(cfg.get("optimize") or DEFAULT_OPTIMIZE)
    if key == DEFAULT_OPTIMIZE and float(cfg.dataset.get("validation_fraction", 0) or 0) > 0:
        key = "validation_score"
    sign, key = (-1.0, key[1:]) if key.startswith("-") else (1.0, key)
    value = results.metrics.to_json().get(key) if results is not None else None
    return float("nan") if value is None else sign * float(value)  # a failed job: nan


def launcher_threads() -> int | None:
    """Intra-op threads for one job when the launcher runs several at once on this machine."""
    import os

    launcher = HydraConfig.get().launcher
    per_task = launcher.get("cpus_per_task")  # submitit (local and SLURM)
    if per_task:
        return int(per_task)
    parallel = launcher.get("n_jobs")  # joblib
    if parallel and int(parallel) > 1:
        return max(1, (os.cpu_count() or 1) // int(parallel))
    return None


def save_job_config(cfg: DictConfig, run_dir: Path) -> None:
    """.hydra/config.yaml and overrides.yaml of a job that runs (Hydra's own copy is off, so a
    skipped job keeps the files of the run that produced its results.json)."""
    from omegaconf import OmegaConf

    folder = run_dir / ".hydra"
    folder.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, folder / "config.yaml")
    OmegaConf.save(OmegaConf.create(list(HydraConfig.get().overrides.task)), folder / "overrides.yaml")


# Sweepers whose selection among private runs dpbench can state the privacy of: a grid selects
# nothing (every job is reported), private_search charges its selection (dpbench/study/).
ACCOUNTED_SWEEPERS = ("hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
                      "hydra_plugins.dpbench_private_search.private_search.PrivateSearchSweeper")


def check_sweeper(cfg: DictConfig, sweeper_target: str) -> None:
    """Refuse a private run under a sweeper that selects on its results uncharged: Optuna's samplers
    (TPE) read earlier trials' scores, so the trials are not independent and no study epsilon holds."""
    from dpbench.algorithms import algorithm_class

    if sweeper_target and sweeper_target not in ACCOUNTED_SWEEPERS and algorithm_class(cfg.algo.name).private:
        raise UserError(f"{sweeper_target.rsplit('.', 1)[-1]} selects among private runs without charging the selection: "
                        "use hydra/sweeper=private_search with dataset.validation_fraction (docs/tuning.md)")


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
def _main(cfg: DictConfig) -> float:
    from omegaconf import open_dict
    from rich.markup import escape

    from dpbench.logging.console import console
    from dpbench.run import run_job
    from dpbench.runtime.checkpoint import EXIT_PREEMPTED, Preempted

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    in_grid = HydraConfig.get().mode == RunMode.MULTIRUN
    if in_grid:
        try:
            check_sweeper(cfg, str(HydraConfig.get().sweeper.get("_target_", "")))
        except UserError as error:  # every trial would be refused alike: stop the sweep
            console.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)
            _exit(EXIT_BAD_INPUT)
    # [resume] a single run's folder is named by its start time: continue an interrupted attempt of this config instead
    if not in_grid and not any(o.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for o in HydraConfig.get().overrides.hydra):
        from dpbench.resume import continue_unfinished_attempt

        run_dir = continue_unfinished_attempt(cfg, run_dir)
    with open_dict(cfg):
        if cfg.get("threads") is None and (threads := launcher_threads()):
            cfg.threads = threads
        if in_grid and cfg.logger.name == "wandb":  # one W&B group per grid, names that differ
            cfg.logger.group = cfg.logger.get("group") or cfg.name
            point = HydraConfig.get().job.override_dirname
            if cfg.logger.get("run_name") is None and point:
                cfg.logger.run_name = f"{cfg.algo.name}-{point}"

    def starting() -> None:  # only for a job that runs: a skipped one's folder is left untouched
        (run_dir / ERROR_FILE).unlink(missing_ok=True)
        save_job_config(cfg, run_dir)

    # a private search's trial publishes nothing itself (dpbench/study/publish.py): no bar, no table, no message
    private_trial = in_grid and str(HydraConfig.get().sweeper.get("_target_", "")) == ACCOUNTED_SWEEPERS[1]
    was_quiet, console.quiet = console.quiet, console.quiet or private_trial
    try:
        if in_grid:  # a grid's own points may set device or logger (the sweep's base was checked by Preflight)
            from dpbench.preflight import check_device, check_wandb_login

            check_device(cfg)
            check_wandb_login(cfg)
        return objective(cfg, run_job(cfg, run_dir, show_progress=not private_trial, on_start=starting))
    except Preempted as error:  # the whole process stops (a grid too): rerunning resumes it
        console.print(f"[bold yellow]stopped:[/] {error}", soft_wrap=True)
        _exit(EXIT_PREEMPTED)
    except UserError as error:
        console.print(f"[bold red]error:[/] {escape(str(error))}", soft_wrap=True)  # text, not markup: "(batch, [T])"
        if not in_grid:
            remove_refused_run_dir(run_dir)  # a refused command leaves no run folder behind
            _exit(EXIT_BAD_INPUT)
        _record_failure(run_dir, f"error: {error}")
    except DivergedError as error:
        console.print(f"[bold red]diverged:[/] {escape(str(error))}", soft_wrap=True)
        if not in_grid:
            _exit(EXIT_RUN_FAILED)
        _record_failure(run_dir, f"diverged: {error}")
    except Exception as error:  # noqa: BLE001 - a grid goes on past a crashed job, with its traceback kept
        if not in_grid:
            raise
        console.print(f"[bold red]failed:[/] {type(error).__name__}: {escape(str(error))} (traceback in {run_dir / ERROR_FILE})", soft_wrap=True)
        _record_failure(run_dir, f"failed: {type(error).__name__}: {error}", traceback.format_exc())
    finally:
        console.quiet = was_quiet
    return float("nan")


def shared_run_dir(argv: list[str]) -> list[str]:
    """Under torchrun every rank composes its own config, so `${now:...}` in hydra.run.dir could
    name a different folder per rank: pin it to rank 0's clock (unless the command sets the dir)."""
    import re
    from datetime import datetime

    from omegaconf import OmegaConf

    from dpbench.runtime import distributed

    distributed.init_from_environment()
    started = distributed.broadcast_object(datetime.now())
    if any(arg.startswith(("hydra.run.dir=", "++hydra.run.dir=")) for arg in argv):
        return argv
    primary = OmegaConf.load(Path(config_dir()) / "config.yaml")
    pattern = OmegaConf.to_container(primary.hydra.run, resolve=False)["dir"]
    return [*argv, "hydra.run.dir=" + re.sub(r"\$\{now:([^}]*)\}", lambda m: started.strftime(m.group(1)), pattern)]


def flag_error(argv: list[str]) -> str | None:
    """A flag Hydra's parser does not know (`--lr 0.1`, the habit of argparse scripts) or a bad
    value of one it knows (`--cfg jobs`), as one line; None when the flags parse (--help: Hydra's)."""
    import argparse

    from hydra._internal.utils import get_args_parser  # the parser @hydra.main uses

    if {"-h", "--help", "--hydra-help"} & set(argv):
        return None
    parser = get_args_parser()
    parser.exit_on_error = False  # raise instead of printing the usage and exiting
    try:
        _, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as error:
        return str(error)
    flags = [a for a in unknown if a.startswith("-")]
    if flags:
        return (f"{flags[0]} is not an option of dpbench: settings are key=value overrides (e.g. train.lr=0.1, "
                "not --lr 0.1); `dpbench --help` lists the groups and keys")
    return None


def _refuse(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_BAD_INPUT)


def answered_without_torch() -> None:
    """What the command line settles before anything imports torch (dpbench/startup.py): --version, a bad
    flag, --help, Tab completion, a config-group option that does not exist; they exit here."""
    if "--version" in sys.argv[1:]:
        from dpbench import __version__

        print(f"dpbench {__version__}")
        sys.exit(0)
    completion = bool({"--shell-completion", "-sc"} & set(sys.argv))
    if completion and not any(a.split("=")[0] in ("install", "uninstall", "query") for a in sys.argv):
        _refuse("--shell-completion needs a subcommand, e.g. `eval \"$(dpbench -sc install=bash)\"`")
    if {"-m", "--multirun"} & set(sys.argv[2:]):  # `dpbench algo=grape -m seed=0,1`: Hydra's parser wants it first
        flag = next(a for a in sys.argv[1:] if a in ("-m", "--multirun"))
        sys.argv = [sys.argv[0], flag, *(a for a in sys.argv[1:] if a != flag)]
    if problem := flag_error(sys.argv[1:]):  # Hydra's parser would print its 8-line usage
        _refuse(problem)
    modes = [a for a in sys.argv[1:] if a in ("-m", "--multirun", "-c", "--cfg", "-i", "--info")]
    if len(modes) > 1:  # Hydra raises a ValueError (a traceback) on two of them
        _refuse(f"{' and '.join(modes)} cannot be combined; to see a grid's config, give one point without -m "
                "(e.g. `dpbench experiment=NAME --cfg job`)")
    if completion or {"-h", "--help"} & set(sys.argv[1:]):
        if startup.answer_without_schemas(_main):
            sys.exit(0)
        return  # the stand-ins did not suffice: the real schemas answer
    if not {"--hydra-help", "-c", "--cfg", "-i", "--info"} & set(sys.argv[1:]):
        if problem := startup.missing_group_option(sys.argv[1:], __file__):
            _refuse(problem)


def main() -> None:
    try:
        answered_without_torch()
        from dpbench.runtime import distributed  # torch
        from dpbench.logging.console import console
        from dpbench.schema import run_app
    except KeyboardInterrupt:  # importing torch takes seconds: a Ctrl-C there is one line, not its traceback
        startup.interrupted()
    try:
        if distributed.launched():  # torchrun --nproc_per_node=K: one folder, written by rank 0
            sys.argv = [sys.argv[0], *shared_run_dir(sys.argv[1:])]
        run_app(_main)  # schemas registered; a type or choice error or a Preflight refusal: one line, exit 2
    except KeyboardInterrupt:
        # [resume] run_job printed where a single run continues (its checkpoint) or why it cannot
        console.print("interrupted: finished jobs keep their results.json, checkpointed ones their checkpoint; "
                      "rerun the same command to resume")
        sys.exit(EXIT_INTERRUPTED)
    except SystemExit as exit_:
        # Hydra reports its own errors (unknown override, bad grammar, missing config) with exit
        # status 1; they are bad input like dpbench's own.
        hydra_error = exit_.code == 1 and not _own_exit
        status = EXIT_BAD_INPUT if hydra_error else exit_.code
        if status == EXIT_BAD_INPUT:  # a refused grid or run leaves no folder it made behind
            from dpbench.cli import _new_run_dirs as made  # the callback's module, also under `python -m`

            for folder in list(made):
                remove_refused_run_dir(folder)
        sys.exit(status)
    finally:
        distributed.shutdown()  # torchrun: leave the process group however the run ended
    # Hydra instantiated GridFailures from `dpbench.cli`, which is not this module under `python -m`.
    from dpbench.cli import _grid_failures as failures

    if failures:
        console.print(f"[bold red]{len(failures)} job(s) of the grid failed:[/]")
        for run_dir, message in failures:
            console.print(f"  {run_dir}: {message}", soft_wrap=True)
        sys.exit(EXIT_RUN_FAILED)


if __name__ == "__main__":
    main()
