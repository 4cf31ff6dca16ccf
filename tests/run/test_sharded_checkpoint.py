"""Sharded checkpoints (train.sharding=fsdp, torch.distributed.checkpoint) with 2 and 3 gloo
ranks on the CPU: each rank writes its shards and checkpoint.pt names the one complete folder; a
resume restores bit-identical parameters and Adam state and finishes the planned steps with the
ledger and epsilon of an uninterrupted run; 3 ranks resume what 2 wrote (DCP reshards); SIGUSR1
on one rank stops both after a checkpoint; SIGTERM to rank processes launched as srun/torchrun
start them exits 75 and the same command resumes. The privacy noise is entropy-seeded, so an
interrupted run is compared with the state it saved, not with an uninterrupted run's parameters.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.config import REPO
from helpers.ranks import free_port, spawn_ranks
from helpers.sharded_checkpoint_worker import (
    NOISELESS_AT,
    SIGNAL_AT,
    STEPS,
    resume_noiseless,
    run_noiseless,
    run_three,
    run_two,
)

from dpbench.logging.console import LOG_FILE
from dpbench.runtime.checkpoint import CHECKPOINT_FILE, EXIT_PREEMPTED, SHARDS_DIR

TWO: dict = {}  # where the 2-rank spawn wrote (the 3-rank resume copies its checkpoint)


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    """Both ranks' snapshots and results (one spawn: process start-up dominates)."""
    TWO["out"] = tmp_path_factory.mktemp("two")
    return spawn_ranks(run_two, 2, TWO["out"])


@pytest.fixture(scope="module")
def three(two, tmp_path_factory) -> list[dict]:
    """3 ranks resume the checkpoint 2 ranks wrote (the copy `run_two` made before resuming)."""
    out = tmp_path_factory.mktemp("three")
    shutil.copytree(TWO["out"] / "for_three", out / "run")
    return spawn_ranks(run_three, 3, out)


def assert_same_state(saved: dict, loaded: dict, shards: bool = True) -> None:
    """Parameters, Adam's moments and step, and its hyperparameters, bit for bit."""
    keys = ("params", "optimizer") + (("own_params", "own_optimizer") if shards else ())
    for key in keys:
        assert saved[key].keys() == loaded[key].keys() and saved[key], key
    for key in [k for k in keys if "params" in k]:
        for name, value in saved[key].items():
            assert torch.equal(loaded[key][name], value), (key, name)
    for key in [k for k in keys if "optimizer" in k]:
        for name, state in saved[key].items():
            assert state.keys() == loaded[key][name].keys() == {"step", "exp_avg", "exp_avg_sq"}
            assert all(torch.equal(loaded[key][name][k], v) for k, v in state.items()), (key, name)
    assert saved["groups"] == loaded["groups"]


@pytest.mark.slow  # starts processes (the spawn: about 40 s)
def test_each_checkpoint_is_one_complete_folder_named_by_checkpoint_pt(two):
    for rank in two:
        assert rank["killed"] == "Killed"
        assert sorted(rank["saved_at_kill"]) == [2, 3, 4]  # every 2 steps and after the evaluation at 3
        # after each write only the folder checkpoint.pt names is left (the older ones are pruned)
        for step, saved in rank["saved_at_kill"].items():
            (folder,) = saved["folders"]
            assert folder.startswith(f"step-{step:08d}-")
        after = rank["after_kill"]
        assert after["files"] == [SHARDS_DIR, CHECKPOINT_FILE] and after["stored_step"] == 4
        assert after["folders"] == rank["saved_at_kill"][4]["folders"]
    # the whole run and the resumed one leave only results.json and the console's log: no checkpoint
    assert two[0]["whole_left"] == two[0]["resumed_left"] == [LOG_FILE, "results.json"]


@pytest.mark.slow  # starts processes
def test_a_resume_restores_the_saved_shards_bit_for_bit_and_finishes_the_run(two):
    for rank in two:
        (loaded,) = rank["resumed_loaded"]
        assert loaded["step"] == 4
        assert_same_state(rank["saved_at_kill"][4], loaded)
        resumed, whole = rank["resumed"], rank["whole"]
        assert resumed["resumed_from_step"] == 4 and whole["resumed_from_step"] is None
        assert resumed["steps"] == whole["steps"] == STEPS
        assert sum(m["count"] for m in resumed["ledger"]) == STEPS
        assert resumed["ledger"] == whole["ledger"] and resumed["epsilon"] == whole["epsilon"]
        assert resumed["history"] == whole["history"] == [3, 6]


@pytest.mark.slow  # starts processes
def test_sigusr1_on_one_rank_checkpoints_and_stops_every_rank_then_the_rerun_resumes(two):
    first, second = two
    assert first["preempted"]["message"].startswith(f"SIGUSR1 received: stopped after step {SIGNAL_AT} with a checkpoint")
    assert second["preempted"]["message"].startswith(f"a stop signal (on another rank) received: stopped after step {SIGNAL_AT}")
    for rank in two:
        assert sorted(rank["signal_saved"]) == [SIGNAL_AT]  # no checkpoint_every: the signal's only
        (loaded,) = rank["signal_loaded"]
        assert_same_state(rank["signal_saved"][SIGNAL_AT], loaded)
        assert rank["signal_resumed"]["resumed_from_step"] == SIGNAL_AT
        assert rank["signal_resumed"]["steps"] == STEPS and rank["signal_resumed"]["ledger"] == rank["whole"]["ledger"]


@pytest.mark.slow  # starts 3 processes on the CPU (about 40 s)
def test_three_ranks_resume_what_two_wrote_resharded(two, three):
    """DCP reads each of 3 ranks' rows (torch.chunk's 22/22/20 of 64) from the 2 ranks' files; the
    gathered tensors equal what 2 ranks saved; the run finishes, writing 3-rank checkpoints."""
    saved = two[0]["saved_at_kill"][4]
    for rank, got in enumerate(three):
        (loaded,) = got["loaded"]
        assert loaded["step"] == 4
        assert_same_state(saved, loaded, shards=False)
        for name, value in loaded["params"].items():
            pieces = torch.chunk(value, 3)
            assert torch.equal(loaded["own_params"][name], pieces[rank] if rank < len(pieces) else value[:0]), name
        assert sorted(got["saved"]) == [5, 6]  # checkpoint_every=1, and the final evaluation: 3-rank checkpoints of uneven shards
        resumed = got["resumed"]
        assert resumed["resumed_from_step"] == 4 and resumed["steps"] == STEPS
        assert resumed["ledger"] == two[0]["whole"]["ledger"] and resumed["epsilon"] == two[0]["whole"]["epsilon"]
        assert any("written by 2 process(es), this run has 3" in note for note in resumed["notes"])


# --- the command line: SIGTERM -> checkpoint -> exit 75 -> the same command resumes ---------------------
def launch_ranks(args: list[str], world: int, cwd) -> list[subprocess.Popen]:
    """`world` dpbench processes with the environment torchrun (or srun) gives each rank."""
    port = str(free_port())
    processes = []
    for rank in range(world):
        env = {"WANDB_MODE": "disabled", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(cwd),
               "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        processes.append(subprocess.Popen([sys.executable, "-m", "dpbench.cli", *args], cwd=cwd, env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return processes


@pytest.mark.slow  # starts 4 processes (about 65 s on two busy cores)
def test_sigterm_checkpoints_a_sharded_run_exits_75_and_the_same_command_resumes(tmp_path):
    run = tmp_path / "run"
    args = ["train.sharding=fsdp", "algo=dpadam", "algo.per_sample=bk", "model=vit", "dataset=synthetic", "device=cpu",
            "logger=none", "train.batch_size=16", "privacy.noise_multiplier=1.0", "train.steps=24", "train.eval_every=24",
            "train.checkpoint_every=2", f"hydra.run.dir={run}"]
    processes = launch_ranks(args, 2, tmp_path)
    deadline = time.time() + 180
    while not (run / CHECKPOINT_FILE).exists() and all(p.poll() is None for p in processes) and time.time() < deadline:
        time.sleep(0.02)
    for process in processes:  # SLURM signals every task of the step
        process.send_signal(signal.SIGTERM)
    outputs = [process.communicate(timeout=180)[0] for process in processes]
    assert [p.returncode for p in processes] == [EXIT_PREEMPTED] * 2, outputs[0][-2000:] + outputs[1][-2000:]
    assert "SIGTERM received: stopped after step" in outputs[0] and "rerun the same command to resume" in outputs[0]
    assert not (run / "results.json").exists()
    stopped_at = torch.load(run / CHECKPOINT_FILE, weights_only=True)["step"]
    assert 2 <= stopped_at < 24 and len(list((run / SHARDS_DIR).iterdir())) == 1

    processes = launch_ranks(args, 2, tmp_path)  # the same command again
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert [p.returncode for p in processes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert f"resuming from step {stopped_at} of 24" in outputs[0]
    results = json.loads((run / "results.json").read_text())
    assert results["resumed_from_step"] == stopped_at and results["privacy"]["steps"] == 24
    assert sum(m["count"] for m in results["privacy"]["ledger"]) == 24
    assert not (run / CHECKPOINT_FILE).exists() and not (run / SHARDS_DIR).exists()


# --- without processes ---------------------------------------------------------------------------------
def test_a_checkpoint_naming_missing_shards_is_a_one_line_error(tmp_path):
    from dpbench.runtime.checkpoint import read_checkpoint, write_checkpoint
    from dpbench.errors import UserError

    write_checkpoint(tmp_path, {"config": {}, "step": 2, "trainer": {"algorithm": {
        "sharded": {"folder": "step-00000002-0000", "world_size": 2}, "attributes": [{}, {}]}}})
    with pytest.raises(UserError, match="names the sharded state .* which is missing or incomplete; delete") as error:
        read_checkpoint(tmp_path)
    assert "\n" not in str(error.value)
    folder = tmp_path / SHARDS_DIR / "step-00000002-0000"
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"")
    assert read_checkpoint(tmp_path)["trainer"]["algorithm"]["sharded"]["path"] == str(folder)


def test_a_sharded_checkpoint_does_not_load_into_an_unsharded_algorithm_and_back():
    import types

    from dpbench.runtime.algorithm_state import CheckpointMismatch, load_algorithm_state

    with pytest.raises(CheckpointMismatch, match="one of the checkpoint and this run is sharded"):
        load_algorithm_state(types.SimpleNamespace(sharded=False), {"sharded": {"folder": "x"}})
    with pytest.raises(CheckpointMismatch, match="one of the checkpoint and this run is sharded"):
        load_algorithm_state(types.SimpleNamespace(sharded=True), {"parameters": {}})


def test_delete_checkpoint_removes_the_shards_after_checkpoint_pt(tmp_path):
    from dpbench.runtime.checkpoint import delete_checkpoint

    (tmp_path / CHECKPOINT_FILE).write_bytes(b"x")
    (tmp_path / SHARDS_DIR / "step-00000002-0000").mkdir(parents=True)
    delete_checkpoint(tmp_path)
    assert not list(tmp_path.iterdir())


def test_an_interrupted_save_leaves_the_previous_checkpoint_and_the_next_save_prunes_it(tmp_path):
    from dpbench.runtime.checkpoint import prune_shards

    root = tmp_path / SHARDS_DIR
    for name in ("step-00000002-aaaa", "step-00000004-bbbb", "step-00000006-cccc"):  # 6: a save cut short
        (root / name).mkdir(parents=True)
    prune_shards(tmp_path, keep="step-00000004-bbbb")
    assert [p.name for p in root.iterdir()] == ["step-00000004-bbbb"]


# --- noise off: the resumed run ends where the uninterrupted one does ----------------------------------
@pytest.fixture(scope="module")
def noiseless(tmp_path_factory) -> tuple[list[dict], list[dict]]:
    """2 ranks: STEPS uninterrupted steps and a run killed after its checkpoint at NOISELESS_AT;
    then 2 fresh processes resume the killed run (a copy) to STEPS. Noise off, a fixed order."""
    first = tmp_path_factory.mktemp("noiseless")
    whole = spawn_ranks(run_noiseless, 2, first)
    second = tmp_path_factory.mktemp("noiseless_resumed")
    shutil.copytree(first / "killed", second / "killed")
    return whole, spawn_ranks(resume_noiseless, 2, second)


@pytest.mark.slow  # two spawns of 2 processes (about 25 s)
def test_with_noise_off_a_resumed_sharded_run_ends_at_the_uninterrupted_parameters(noiseless):
    """DP-Adam bk on the micro ViT, 2 ranks, every noise draw exactly zero and the shuffled order
    from a fixed seed (test-only seams): 6 steps straight, and 3 steps + checkpoint + a resume in
    fresh processes to step 6, end at the same parameters and Adam state, bit for bit (measured;
    the bound asked for was 1e-6 relative), whole tensors and each rank's own shards."""
    whole, resumed = noiseless
    for first, second in zip(whole, resumed):
        assert first["killed"] == "Killed" and first["stored_step"] == NOISELESS_AT
        assert sorted(first["saved"]) == [NOISELESS_AT]  # the killed run's one checkpoint
        assert second["resumed"]["resumed_from_step"] == NOISELESS_AT and second["resumed"]["steps"] == STEPS
        assert second["resumed"]["ledger"] == first["whole"]["ledger"]
        (loaded,) = second["loaded"]
        assert_same_state(first["saved"][NOISELESS_AT], loaded)  # the resume starts from what was written
        (uninterrupted,) = first["finals"]
        (finished,) = second["finals"]
        assert uninterrupted["step"] == finished["step"] == STEPS
        # the resumed steps moved every parameter: the comparison is not of the checkpoint with itself
        assert all(not torch.equal(loaded["params"][n], v) for n, v in finished["params"].items())
        assert_same_state(uninterrupted, finished)
