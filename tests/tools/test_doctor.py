"""dpbench-doctor: one row per algorithm and precision, in process; exit status 1 on any failure;
the host-sync counter through its CUDA seam."""

from __future__ import annotations

import warnings

import pytest
import torch
from rich.console import Console

from dpbench.tools import doctor


def _run(*argv: str):
    console = Console(record=True, width=200)
    code, rows = doctor.run_doctor(["--device", "cpu", "--steps", "2", *argv], console)
    return code, rows, console.export_text()


@pytest.mark.slow  # trains every algorithm end to end (the slow tier)
def test_doctor_runs_each_algorithm_in_fp32_and_bf16():
    code, rows, text = _run("--algos", "dpsgd,adam,dpzero", "--no-fsdp")
    assert code == 0
    assert [(r.algo, r.precision, r.status) for r in rows] == [
        ("dpsgd", "fp32", "ok"), ("dpsgd", "bf16", "ok"), ("adam", "fp32", "ok"), ("adam", "bf16", "ok"),
        ("dpzero", "fp32", "ok"), ("dpzero", "bf16", "n/a"),  # zeroth-order: no autocast
    ]
    for row in rows:
        if row.status == "ok":
            assert row.step_s > 0 and row.peak_mib is not None
        assert row.syncs_per_step is None or 0 < row.syncs_per_step <= 12  # counted as on a GPU (n/a if it failed)
    assert "own peak RSS MiB" in text and "host syncs/step" in text and "dpzero" in text


def test_a_failing_algorithm_makes_a_row_and_exit_status_1(monkeypatch):
    import dpbench.run

    setup = dpbench.run.setup

    def broken(cfg):
        if cfg.algo.name == "adam":
            raise RuntimeError("CUDA error: no kernel image is available\nsecond line")
        return setup(cfg)

    monkeypatch.setattr(dpbench.run, "setup", broken)
    code, rows, text = _run("--algos", "adam,sgd", "--precisions", "fp32", "--no-fsdp")
    assert code == 1
    assert [(r.algo, r.status) for r in rows] == [("adam", "error"), ("sgd", "ok")]  # the others still run
    assert rows[0].note == "RuntimeError: CUDA error: no kernel image is available"
    assert "1 of 2 checks failed" in text


class FakeCuda:
    def __init__(self):
        self.modes = []

    def set_sync_debug_mode(self, mode):
        self.modes.append(mode)


def test_host_syncs_are_counted_per_step():
    def step():
        warnings.warn("called a synchronizing CUDA operation")  # what sync debug mode emits per sync
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")
        return "result"

    cuda = FakeCuda()
    counter = doctor.SyncCounter(torch.device("cuda", 0), cuda)
    counted = counter.wrap(step)
    assert counted() == "result" and counted() == "result"
    assert counter.per_step == 2.0 and cuda.modes == ["warn", "default"] * 2
    cpu = doctor.SyncCounter(torch.device("cpu"), FakeCuda())
    syncing = cpu.wrap(lambda: torch.ones(2).sum().item())
    assert syncing() == 2.0 and syncing() == 2.0
    assert cpu.per_step == 1.0  # the .item() each step would make on a GPU


def test_fsdp_row_is_skipped_with_fewer_than_two_gpus_and_says_why():
    code, rows, text = _run("--algos", "sgd", "--precisions", "fp32")
    assert code == 0 and [(r.algo, r.status) for r in rows] == [("sgd", "ok"), ("fsdp (dpadam bk)", "n/a")]
    assert "needs 2 or more CUDA GPUs, this machine has 0" in rows[-1].note and "fsdp (dpadam bk)" in text


def test_fsdp_row_runs_one_rank_per_gpu_under_torchrun(tmp_path):
    import json
    import subprocess

    seen = {}

    def fake_run(command, **kwargs):  # what torchrun's rank 0 leaves: results.json in hydra.run.dir
        seen["command"] = command
        folder = next(a.split("=", 1)[1] for a in command if a.startswith("hydra.run.dir="))
        with open(f"{folder}/results.json", "w") as out:
            json.dump({"throughput": {"step_seconds": 0.5, "sharding": "fsdp"}, "memory": {"peak_bytes": 2**30}}, out)
        return subprocess.CompletedProcess(command, 0, "", "")

    row = doctor.check_fsdp(2, gpus=4, run=fake_run)
    assert (row.status, row.step_s, row.peak_mib) == ("ok", 0.5, 1024) and "4 ranks" in row.note
    command = seen["command"]
    assert "--nproc-per-node=4" in command and "train.sharding=fsdp" in command and "device=cuda" in command
    failed = doctor.check_fsdp(2, gpus=2, run=lambda c, **k: subprocess.CompletedProcess(c, 1, "", "boom\nNCCL error"))
    assert failed.status == "error" and failed.note.endswith("NCCL error")
