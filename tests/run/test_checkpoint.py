"""Checkpoints: a stopped run resumes with the same steps, ledger and epsilon; every algorithm's
state survives a save/load; SIGTERM checkpoints and exits 75; damaged checkpoints are user errors."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.config import REPO, TINY, compose

from dpbench.algorithms import ALGORITHMS, Algorithm, algorithm_class, import_all
from dpbench.runtime.algorithm_state import CheckpointMismatch, algorithm_state, load_algorithm_state
from dpbench.runtime.checkpoint import CHECKPOINT_FILE, EXIT_PREEMPTED, restore_rng_states, rng_states
from dpbench.errors import UserError
from dpbench.privacy.noise import GaussianNoise
from dpbench.run import run_job, setup
from dpbench.runtime.trainer import Trainer

import_all()
STEPS = ["train.steps=8", "train.eval_every=4", "train.checkpoint_every=3"]
SIGMA = ["privacy.noise_multiplier=1.0"]  # fixed sigma: no calibration (seconds per run)


class Killed(Exception):
    pass


def kill_at_step(monkeypatch, step: int) -> None:
    """The process "dies" when step `step` starts (after the checkpoints of the steps before it)."""
    original = Algorithm.train_step

    def train_step(self, batches, step_index):
        if step_index == step:
            raise Killed
        return original(self, batches, step_index)

    monkeypatch.setattr(Algorithm, "train_step", train_step)


def run_killed_then_resumed(cfg, run_dir, monkeypatch, step: int) -> dict:
    with monkeypatch.context() as patch:
        kill_at_step(patch, step)
        with pytest.raises(Killed):
            run_job(cfg, run_dir, show_progress=False)
    assert (run_dir / CHECKPOINT_FILE).is_file() and not (run_dir / "results.json").exists()
    results = run_job(cfg, run_dir, show_progress=False)
    assert not (run_dir / CHECKPOINT_FILE).exists()  # deleted once results.json is written
    return results


def test_a_killed_private_run_resumes_to_the_same_steps_ledger_and_epsilon(tmp_path, monkeypatch):
    cfg = compose(TINY + STEPS + SIGMA + ["algo=grape"])
    whole = run_job(cfg, tmp_path / "whole", show_progress=False)
    resumed = run_killed_then_resumed(cfg, tmp_path / "resumed", monkeypatch, step=5)
    assert resumed.resumed_from_step == 4 and whole.resumed_from_step is None  # eval at 4 checkpoints too
    assert resumed.privacy.steps == whole.privacy.steps == 8
    assert resumed.privacy.ledger == whole.privacy.ledger
    assert sum(m["count"] for m in resumed.privacy.ledger) == 8
    assert resumed.privacy.epsilon == whole.privacy.epsilon
    assert [h.step for h in resumed.history] == [4, 8]
    assert resumed.history[0].epsilon == whole.history[0].epsilon


@pytest.mark.parametrize("extra", [["algo=adam"], ["algo=sgd", "algo.momentum=0.9", "privacy.sampling=shuffle"]])
def test_a_resumed_seeded_run_is_bit_identical_to_the_uninterrupted_one(extra, tmp_path, monkeypatch):
    """Non-private runs are fully seeded: model, optimizer, RNG and data order all come back."""
    cfg = compose(TINY + STEPS + extra)
    whole = run_job(cfg, tmp_path / "whole", show_progress=False)
    resumed = run_killed_then_resumed(cfg, tmp_path / "resumed", monkeypatch, step=7)
    assert resumed.resumed_from_step == 6
    assert resumed.history == whole.history
    assert resumed.metrics == whole.metrics
    assert resumed.compute == whole.compute and whole.compute.forward_equivalents > 0  # the passes before the checkpoint too


# --- every algorithm's state ------------------------------------------------------------------------
ROUND_TRIP = {  # intervals that make the step after the checkpoint use the stored state
    "dpdr": ["algo.decomposition_steps=10"], "diff2": ["algo.restart_interval=10"],
    "galore": ["algo.update_interval=10"], "galore_naive": ["algo.update_interval=10"],
    "grape": ["algo.update_interval=10"], "dcdpsgd": ["algo.score_params=first"],
    "dpgd0th": ["privacy.clip_norm=1000"],  # at C=1 every |s_i| is clipped to C/sqrt(d) and the signs cancel
    "dpzero": ["privacy.clip_norm=1000"],  # at C=1 every s_i is clipped to +-1: 8 signs of 16 each way sum to 0
}


@pytest.mark.parametrize("algo", sorted(ALGORITHMS.names()))
def test_every_algorithm_continues_from_its_state_dict_exactly(algo, monkeypatch):
    """Save after step k, load into a fresh build: with noise off and a fixed batch, step k gives the
    same parameters as the algorithm that never stopped."""
    monkeypatch.setattr(GaussianNoise, "sample", lambda self, shape, std, dtype=torch.float32: torch.zeros(shape, dtype=dtype))
    sigma = SIGMA if algorithm_class(algo).private else []  # a non-private run refuses a privacy setting
    cfg = compose(TINY + sigma + [f"algo={algo}", "device=cpu", *ROUND_TRIP.get(algo, [])])
    job = setup(cfg)
    batch = lambda i: [job.task.batch(list(range(8 * i, 8 * i + 16)))]  # noqa: E731
    k = 3
    for i in range(k):
        job.algorithm.train_step(batch(i), i)
    buffer = io.BytesIO()
    torch.save({"algorithm": algorithm_state(job.algorithm), "rng": rng_states()}, buffer)
    before = {n: p.detach().clone() for n, p in job.algorithm.model.named_parameters()}
    job.algorithm.train_step(batch(k), k)
    expected = {n: p.detach().clone() for n, p in job.algorithm.model.named_parameters()}
    assert any(not torch.equal(before[n], v) for n, v in expected.items())  # step k moves the model

    fresh = setup(cfg)
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    load_algorithm_state(fresh.algorithm, saved["algorithm"])
    restore_rng_states(saved["rng"])
    fresh.algorithm.train_step(batch(k), k)
    got = dict(fresh.algorithm.model.named_parameters())
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    trainable = {n for n, p in got.items() if p.requires_grad}
    assert set(saved["algorithm"]["parameters"]) == trainable  # frozen ones are rebuilt, not stored


def test_frozen_parameters_are_fingerprinted_not_stored():
    cfg = compose(TINY + ["algo=lora", "device=cpu"])
    job = setup(cfg)
    state = algorithm_state(job.algorithm)
    frozen = [n for n, p in job.algorithm.model.named_parameters() if not p.requires_grad]
    assert frozen and set(state["frozen"]) == set(frozen) and not set(frozen) & set(state["parameters"])
    fresh = setup(cfg)
    with torch.no_grad():
        dict(fresh.algorithm.model.named_parameters())[frozen[0]].add_(1e-2)  # e.g. a changed weights file
    with pytest.raises(CheckpointMismatch, match="frozen parameter"):
        load_algorithm_state(fresh.algorithm, state)


# --- signals ------------------------------------------------------------------------------------------
def dpbench(*args, cwd):
    env = {"WANDB_MODE": "disabled", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(cwd),
           "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "dpbench.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # starts processes
def test_sigterm_checkpoints_exits_75_and_the_rerun_finishes_the_same_run(tmp_path, capsys):
    run = tmp_path / "run"
    args = [*TINY, *SIGMA, "algo=dpsgd", "train.steps=40", "train.eval_every=40", "train.checkpoint_every=2",
            f"hydra.run.dir={run}"]
    process = dpbench(*args, cwd=tmp_path)
    deadline = time.time() + 120
    while not (run / CHECKPOINT_FILE).exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    output = process.communicate(timeout=120)[0]
    assert process.returncode == EXIT_PREEMPTED, output[-2000:]
    assert "SIGTERM received: stopped after step" in output and "rerun the same command to resume" in output
    assert not (run / "results.json").exists()
    stopped_at = torch.load(run / CHECKPOINT_FILE, weights_only=True)["step"]
    assert 2 <= stopped_at < 40

    cfg = compose(args[:-1])  # the same job, rerun in-process (saves a start-up)
    results = run_job(cfg, run, show_progress=False)
    captured = capsys.readouterr()
    assert f"resuming from step {stopped_at} of 40" in captured.out + captured.err
    assert results.resumed_from_step == stopped_at and results.privacy.steps == 40
    assert sum(m["count"] for m in results.privacy.ledger) == 40
    whole = run_job(cfg, tmp_path / "whole", show_progress=False)  # uninterrupted
    assert results.privacy.epsilon == whole.privacy.epsilon
    assert results.privacy.ledger == whole.privacy.ledger


def test_submitit_signal_is_handed_on_after_the_checkpoint(tmp_path, monkeypatch):
    """Under submitit (a Python handler on SIGUSR2): finish the step, checkpoint, then call that
    handler, which requeues the job and exits."""
    seen = []

    def submitit_handler(signum, frame):  # stands in for submitit's checkpoint_and_try_requeue
        seen.append(torch.load(tmp_path / CHECKPOINT_FILE, weights_only=True)["step"])
        raise SystemExit(144)

    previous = signal.signal(signal.SIGUSR2, submitit_handler)
    original = Trainer._record

    def record(self, result):
        original(self, result)
        if self.state.step == 3:
            os.kill(os.getpid(), signal.SIGUSR2)  # arrives mid-run, while step 4 would follow

    monkeypatch.setattr(Trainer, "_record", record)
    try:
        with pytest.raises(SystemExit):
            run_job(compose(TINY + SIGMA + ["train.steps=8", "train.eval_every=8"]), tmp_path, show_progress=False)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert seen == [3]  # the handler ran after the step-3 checkpoint was on disk
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


# --- damaged or foreign checkpoints ---------------------------------------------------------------------
def test_damaged_or_incompatible_checkpoints_are_one_line_errors_naming_the_fix(tmp_path, monkeypatch):
    cfg = compose(TINY + STEPS + SIGMA + ["algo=dpsgd"])
    with monkeypatch.context() as patch:
        kill_at_step(patch, 5)
        with pytest.raises(Killed):
            run_job(cfg, tmp_path, show_progress=False)
    path = tmp_path / CHECKPOINT_FILE
    good = path.read_bytes()
    payload = torch.load(path, weights_only=True)

    def fails_with(match):
        with pytest.raises(UserError, match=match) as error:
            run_job(cfg, tmp_path, show_progress=False)
        assert "\n" not in str(error.value) and "delete" in str(error.value) and "resume=false" in str(error.value)

    path.write_bytes(good[: len(good) // 2])
    fails_with("unreadable")
    payload["trainer"]["algorithm"]["parameters"].popitem()
    torch.save(payload, path)
    fails_with("does not fit this run .*parameters")
    payload = torch.load(io.BytesIO(good), weights_only=True)
    payload["trainer"]["ledger"][0]["noise_multiplier"] *= 1.5
    torch.save(payload, path)
    fails_with("does not fit this run .*ledger")
    path.write_bytes(good)
    assert run_job(cfg, tmp_path, show_progress=False).resumed_from_step == 4


@pytest.mark.slow  # seconds each: the fast tier stays under its 5 minutes
def test_another_config_or_resume_false_starts_over(tmp_path, monkeypatch, capsys):
    cfg = compose(TINY + STEPS + SIGMA + ["algo=dpsgd"])
    with monkeypatch.context() as patch:
        kill_at_step(patch, 5)
        with pytest.raises(Killed):
            run_job(cfg, tmp_path, show_progress=False)
    other = compose(TINY + STEPS + SIGMA + ["algo=dpsgd", "train.lr=0.05", "train.checkpoint_every=5"])
    assert run_job(other, tmp_path, show_progress=False).resumed_from_step is None
    captured = capsys.readouterr()
    assert "is of another config (train.lr" in captured.out + captured.err
    assert not (tmp_path / CHECKPOINT_FILE).exists()


def test_checkpoint_every_must_be_positive():
    from dpbench.run_config import validate

    with pytest.raises(UserError, match="train.checkpoint_every must be >= 1"):
        validate(compose(TINY + ["train.checkpoint_every=0"]))
