"""SLURM tasks as ranks (conf/hydra/launcher/slurm_fsdp.yaml): the torchrun variables derived from
SLURM's, on the CPU, without a cluster or a process group."""

from __future__ import annotations

import pytest

from dpbench.runtime import distributed
from dpbench.runtime.distributed import adopt_slurm_environment, first_host, slurm_environment

TWO_NODES = {  # task 11 of 16: 2 nodes x 8 GPUs, what srun (and submitit) give each task
    "DPBENCH_RANKS_FROM_SLURM": "1", "SLURM_PROCID": "11", "SLURM_NTASKS": "16", "SLURM_LOCALID": "3",
    "SLURM_NTASKS_PER_NODE": "8(x2)", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_JOB_ID": "4242017",
}


def test_two_nodes_of_eight_derive_rank_world_size_local_rank_and_the_first_host():
    assert slurm_environment(TWO_NODES) == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                                            "MASTER_ADDR": "gpu07", "MASTER_PORT": str(29500 + 17)}


@pytest.mark.parametrize("nodelist, host", [("gpu[03-05,9],cpu1", "gpu03"), ("n12,n13", "n12"), ("node1", "node1"),
                                            ("a[10,2-3]", "a10"), ("rack1-n[001-004]", "rack1-n001")])
def test_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host


def test_nothing_without_the_opt_in_or_outside_a_task_and_torchrun_values_win():
    assert slurm_environment({k: v for k, v in TWO_NODES.items() if k != "DPBENCH_RANKS_FROM_SLURM"}) == {}
    assert slurm_environment({"DPBENCH_RANKS_FROM_SLURM": "1", "SLURM_NTASKS": "8"}) == {}  # salloc shell: no task
    derived = slurm_environment({**TWO_NODES, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "12345"})
    assert "MASTER_ADDR" not in derived and "MASTER_PORT" not in derived and derived["RANK"] == "11"


def test_one_node_without_tasks_per_node_divides_the_tasks(monkeypatch):
    env = {"DPBENCH_RANKS_FROM_SLURM": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0",
           "SLURM_NNODES": "1", "SLURM_NODELIST": "h100-a"}
    assert adopt_slurm_environment(env)["LOCAL_WORLD_SIZE"] == "8" and env["MASTER_ADDR"] == "h100-a"
    assert env["WORLD_SIZE"] == "8" and env["MASTER_PORT"] == "29500"
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "DPBENCH_RANKS_FROM_SLURM"):
        # set, then deleted: monkeypatch records the original (absent) value only for a key it
        # sets, and `launched()` below writes these into os.environ; they must not outlive the test
        monkeypatch.setenv(key, "0")
        monkeypatch.delenv(key)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    assert not distributed.launched()  # no opt-in: a SLURM shell is not a rank
    monkeypatch.setenv("DPBENCH_RANKS_FROM_SLURM", "1")
    for key in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        monkeypatch.setenv(key, "x")  # kept as set; monkeypatch restores them
    assert distributed.launched() and distributed.local_rank() == 0
