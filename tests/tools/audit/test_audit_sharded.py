"""dpbench-audit under torchrun with train.sharding=fsdp (FSDP2 on the CPU, gloo, 2 processes): the
release observer sees the whole global sums and noisy values (`distributed.gather_rows`), the update
check reads the sharded parameters and gradients whole, each rank audits its share of every logical
batch and the sampler check reassembles the whole batch, so that every check passes on every rank
with the verdict of one process, and a seeded bug is still caught. The console script under torchrun:
rank 0 alone prints and writes audit.json, and both ranks exit with its status."""

from __future__ import annotations

import json

import pytest
from helpers.cli import torchrun
from helpers.ranks import spawn_ranks

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from helpers.audit_worker import run

    out = tmp_path_factory.mktemp("sharded_audit")
    return out, spawn_ranks(run, WORLD, out)


def _failed(report: dict) -> list[str]:
    return [f"{c['name']} {c['release']}: {c['detail']}" for c in report["checks"] if not c["passed"]]


@pytest.mark.slow  # starts processes, audits four algorithms
@pytest.mark.parametrize("run_name", ["dpadam_bk", "dpsgd_ghost", "grape_bk", "dpzero"])
def test_every_check_passes_on_every_rank_under_fsdp(ranks, run_name):
    out, results = ranks
    for result in results:
        report = result["reports"][run_name]
        assert report["passed"], _failed(report)
        names = {c["name"] for c in report["checks"]}
        assert {"noise", "independence", "noise across runs", "sensitivity", "release → update", "sampler",
                "accounting"} <= names
    # the ranks audited the same releases: the same rows (statistics of the same whole values)
    assert [c["release"] for c in results[0]["reports"][run_name]["checks"]] == \
        [c["release"] for c in results[1]["reports"][run_name]["checks"]]
    written = json.loads((out / run_name / "audit.json").read_text())  # rank 0's
    assert written == results[0]["reports"][run_name]


@pytest.mark.slow  # starts processes
def test_the_update_check_reads_the_whole_sharded_gradient(ranks):
    """DP-Adam's phases run sharded: the optimizer's input (each rank's rows, read whole) is the
    whole noisy release / the expected batch size, and the noise is each step's total."""
    _, results = ranks
    for result in results:
        (update,) = [c for c in result["reports"]["dpadam_bk"]["checks"] if c["release"] == "optimizer input"]
        assert update["passed"] and update["measured"] < 1e-5 and "not applicable" not in update["detail"]
        noise = [c for c in result["reports"]["dpadam_bk"]["checks"] if c["name"] == "noise"]  # one row per noised tensor
        assert noise and all(c["detail"].startswith("each step's total noise") for c in noise)
        sizes = [c for c in result["reports"]["dpadam_bk"]["checks"] if c["release"] == "batch sizes ~ Binomial(n, q)"]
        assert sizes and sizes[0]["passed"]  # the whole logical batch, not one rank's share


@pytest.mark.slow  # starts processes
def test_seeded_bugs_are_caught_under_fsdp(ranks):
    from helpers.audit_worker import BUGS

    _, results = ranks
    for result in results:
        for bug, check in BUGS.items():
            report, caught = result["bugs"][bug]
            assert caught, (bug, _failed(report))
            assert any(c["name"] == check and not c["passed"] for c in report["checks"])


@pytest.mark.slow  # starts processes
def test_the_one_run_audit_is_refused_under_torchrun_in_one_line(ranks):
    _, results = ranks
    for result in results:
        assert "\n" not in result["one_run"] and result["one_run"].startswith("audit.one_run=true runs in one process")


@pytest.mark.slow  # starts torchrun
def test_torchrun_audit_prints_once_writes_audit_json_and_exits_alike(tmp_path):
    audit = ["train.sharding=fsdp", "algo=dpadam", "algo.per_sample=bk", "model=vit", "device=cpu", "logger=none",
             "dataset=synthetic", "train.batch_size=32", "train.steps=3", "privacy.noise_multiplier=1.0",
             "audit.noise_steps=3", "audit.trials=3", "audit.alpha=1e-6"]
    result = torchrun(*audit, cwd=tmp_path, module="dpbench.tools.audit.cli")
    assert result.returncode == 0, result.stderr[-3000:]
    output = result.stdout + result.stderr
    assert output.count("dpbench-audit · dpadam") == 1 and output.count("every check holds") == 1
    (written,) = tmp_path.glob("outputs/runs/*/audit.json")
    assert json.loads(written.read_text())["passed"]
    # a combination the audit cannot run under torchrun: one line (rank 0's), exit 2, no hang (torchrun
    # itself exits 1 when a rank failed, naming rank 0's status)
    refused = torchrun(*audit, "audit.one_run=true", cwd=tmp_path, module="dpbench.tools.audit.cli", timeout=120)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "exitcode  : 2" in output, output[-3000:]
    assert output.count("error: audit.one_run=true runs in one process") == 1


def test_the_sampler_check_reassembles_the_ranks_shares():
    """One process: `_logical_batches` is the sampler's batches as they are."""
    from dpbench.tools.audit.sampler import _logical_batches

    assert _logical_batches(iter([[3, 1, 2], [5]]), 2) == [[3, 1, 2], [5]]
