"""Jobs that stop early: an interrupted job's offline W&B run is marked failed and replaced by its
rerun (so `wandb sync` uploads the job once); a grid's failed jobs are summarised and make the
process exit 1 whichever launcher ran them."""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
from helpers.cli import dpbench
from helpers.config import FIXED_SIGMA, TINY, compose
from helpers.wandb_records import exit_code

from dpbench.cli import ERROR_FILE, failed_jobs
from dpbench.logging.wandb_logger import UNFINISHED_MARKER, LoggerCallback
from dpbench.run import run_job


def joblib_launcher_installed() -> bool:
    try:  # find_spec of a dotted name raises when the namespace package is absent
        return importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher") is not None
    except ModuleNotFoundError:
        return False


def wandb_sync_dry_run(folder) -> str:
    """What `wandb sync` would upload from a wandb folder (it lists runs before logging in)."""
    env = {"PATH": os.environ["PATH"], "HOME": str(folder.parent), "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "-m", "wandb", "sync", "--dry-run", str(folder)],
                          capture_output=True, text=True, env=env, timeout=120)
    return done.stdout + done.stderr


@pytest.mark.slow  # W&B's service process, and `wandb sync` in another
def test_an_interrupted_offline_run_is_marked_failed_and_its_rerun_replaces_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose([o for o in TINY if not o.startswith("logger")] + ["logger=wandb", *FIXED_SIGMA])
    wandb_dir = tmp_path / "wandb"
    unrelated = wandb_dir / "offline-run-20000101_000000-someone"  # not started by dpbench: never touched
    unrelated.mkdir(parents=True)
    (unrelated / "run-someone.wandb").write_bytes(b"")

    def ctrl_c(self, trainer, result):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(LoggerCallback, "on_step", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            run_job(cfg, tmp_path, show_progress=False)
    (first,) = set(wandb_dir.glob("offline-run-*")) - {unrelated}
    assert (first / UNFINISHED_MARKER).is_file()
    assert exit_code(next(first.glob("run-*.wandb"))) == 130  # W&B shows it failed, not finished

    results = run_job(cfg, tmp_path, show_progress=False)  # the rerun of the job
    (second,) = set(wandb_dir.glob("offline-run-*")) - {unrelated}
    assert second != first and not first.exists() and unrelated.is_dir()
    assert not (second / UNFINISHED_MARKER).exists()
    assert exit_code(next(second.glob("run-*.wandb"))) == 0 and results.status == "completed"
    listed = wandb_sync_dry_run(wandb_dir)
    run_id = second.name.rsplit("-", 1)[1]
    assert "Would sync 2 run(s)" in listed and f"run-{run_id}.wandb" in listed and first.name not in listed


@pytest.mark.slow  # W&B's service process, and `wandb sync` in another
def test_a_run_resumed_from_its_checkpoint_continues_its_w_and_b_run(tmp_path, monkeypatch):
    from dpbench.algorithms import Algorithm
    from dpbench.logging.wandb_logger import RUN_ID_FILE

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose([o for o in TINY if not o.startswith(("logger", "train.steps", "train.eval_every"))]
                  + ["logger=wandb", *FIXED_SIGMA, "train.steps=4", "train.eval_every=2"])
    original = Algorithm.train_step

    def ctrl_c_at_step_3(self, batches, step_index):
        if step_index == 3:
            raise KeyboardInterrupt
        return original(self, batches, step_index)

    with monkeypatch.context() as patch:
        patch.setattr(Algorithm, "train_step", ctrl_c_at_step_3)
        with pytest.raises(KeyboardInterrupt):
            run_job(cfg, tmp_path, show_progress=False)
    (first,) = (tmp_path / "wandb").glob("offline-run-*")
    run_id = (tmp_path / RUN_ID_FILE).read_text().strip()
    assert first.name.endswith(run_id)
    results = run_job(cfg, tmp_path, show_progress=False)  # resumes from step 2: the same W&B run
    assert results.resumed_from_step == 2
    attempts = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(attempts) == 2 and all(folder.name.endswith(run_id) for folder in attempts)  # one run id, both kept
    assert exit_code(next(attempts[-1].glob("run-*.wandb"))) == 0
    assert f"model-{run_id}".encode() in next(attempts[-1].glob("run-*.wandb")).read_bytes()  # the model artifact
    listed = wandb_sync_dry_run(tmp_path / "wandb")
    assert "Would sync 2 run(s)" in listed and listed.count(f"run-{run_id}.wandb") == 2, listed  # both attempts, one id


def test_failed_jobs_are_the_error_files_written_since_the_grid_started(tmp_path):
    stale, fresh, good = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for folder in (stale, fresh, good):
        folder.mkdir()
    (stale / ERROR_FILE).write_text("diverged: an earlier grid\n")
    old = time.time() - 3600
    os.utime(stale / ERROR_FILE, (old, old))
    started = time.time() - 1
    (fresh / ERROR_FILE).write_text("error: privacy.epsilon must be positive\ntraceback lines\n")
    assert failed_jobs(tmp_path, started) == [(fresh, "error: privacy.epsilon must be positive")]
    assert len(failed_jobs(tmp_path, old - 10)) == 2


@pytest.mark.slow  # the console script, and joblib's worker processes
@pytest.mark.skipif(not joblib_launcher_installed(),
                    reason="hydra-joblib-launcher is not installed (pip install 'dpbench[parallel]')")
def test_a_grid_run_by_worker_processes_reports_its_failed_jobs_and_exits_1(tmp_path):
    sweep = tmp_path / "sweep"
    done = dpbench("-m", "hydra/launcher=local_parallel", "hydra.launcher.n_jobs=2", "privacy.epsilon=-1,-2", *TINY,
                   f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert "Joblib.Parallel" in done.stdout + done.stderr  # the jobs ran in worker processes
    assert done.returncode == 1, done.stderr[-2000:]
    assert len(list(sweep.glob(f"*/{ERROR_FILE}"))) == 2  # the grid went on past the first failure
    assert "2 job(s) of the grid failed" in done.stderr and "privacy.epsilon must be positive" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow  # three runs of the command, end to end
def test_ctrl_c_after_an_evaluation_then_the_same_command_continues_from_it_with_its_ledger(tmp_path, monkeypatch):
    """A single run's folder is named by its start time: the rerun finds the interrupted attempt
    (a checkpoint of the same config, no results.json) and continues it there."""
    from helpers.cli import dpbench_in_process

    from dpbench.algorithms import Algorithm

    command = [*TINY, *FIXED_SIGMA, "algo=dpsgd", "train.steps=4", "train.eval_every=2"]
    original = Algorithm.train_step

    def ctrl_c_at(step):
        def train_step(self, batches, step_index):
            if step_index == step:
                raise KeyboardInterrupt
            return original(self, batches, step_index)
        return train_step

    with monkeypatch.context() as patch:
        patch.setattr(Algorithm, "train_step", ctrl_c_at(1))  # before the first evaluation: nothing to resume
        early = dpbench_in_process(*command, cwd=tmp_path)
        assert early.returncode == 130 and "before the first checkpoint" in early.stderr
        patch.setattr(Algorithm, "train_step", ctrl_c_at(3))  # after the evaluation at step 2
        stopped = dpbench_in_process(*command, cwd=tmp_path)
    assert stopped.returncode == 130, stopped.stderr
    assert "holds step 2; rerun the same command to continue from it" in stopped.stderr
    runs = tmp_path / "outputs" / "runs"
    (attempt,) = [folder for folder in runs.iterdir() if (folder / "checkpoint.pt").is_file()]
    time.sleep(1.1)
    other = dpbench_in_process(*command, "train.lr=0.123", cwd=tmp_path)  # another config: a new run, with a note
    assert other.returncode == 0, other.stderr
    assert f"the interrupted run in {attempt} is of another config (train.lr" in " ".join(other.stderr.split())
    before = set(runs.iterdir())

    time.sleep(1.1)  # a new second: the rerun's own folder would have another name
    resumed = dpbench_in_process(*command, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert f"continuing the interrupted run in {attempt}" in resumed.stderr
    assert "resuming from step 2 of 4" in resumed.stderr
    assert set(runs.iterdir()) == before  # no new folder: the attempt's own
    results = json.loads((attempt / "results.json").read_text())
    assert results["resumed_from_step"] == 2 and results["privacy"]["steps"] == 4
    assert sum(m["count"] for m in results["privacy"]["ledger"]) == 4  # its ledger went on from the checkpoint's
    assert [h["step"] for h in results["history"]] == [2, 4]
    assert (attempt / "model.safetensors").is_file() and not (attempt / "checkpoint.pt").exists()


def test_the_console_of_a_run_goes_to_its_cli_log(tmp_path):
    from dpbench.logging.console import LOG_FILE

    run_job(compose([*TINY, "algo=adam", "train.steps=2"]), tmp_path, show_progress=True)
    log = (tmp_path / LOG_FILE).read_text()
    assert "own peak" in log and "test acc" in log and "results:" in log  # the summary table, as plain text
    assert "\x1b[" not in log  # no terminal codes
