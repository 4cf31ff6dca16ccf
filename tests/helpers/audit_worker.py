"""One rank of the 2-process sharded audit test (tests/tools/audit/test_audit_sharded.py), started by
torch.multiprocessing with gloo on the CPU. Each rank runs `dpbench-audit`'s `run_audit` on a micro
ViT under train.sharding=fsdp (every rank the same audits, in the same order: each builds and
shards many jobs), then two seeded bugs, and the torchrun-only refusal, and saves every report to
<out>/rank<r>.pt for the test to compare (rank 0 alone writes audit.json, under <out>/<run>)."""

from __future__ import annotations

from pathlib import Path

import torch

from dpbench.runtime import distributed
from dpbench.errors import UserError
from helpers.config import FIXED_SIGMA, TINY, compose
from helpers.ranks import become_rank

# alpha 1e-6 as in tests/tools/audit/test_audit.py: the seeded bugs miss their bounds by far more
AUDIT = ["audit.noise_steps=3", "audit.trials=3", "audit.alpha=1e-6"]
SHARDED = ["train.sharding=fsdp", "model=vit", "device=cpu", *FIXED_SIGMA]
RUNS = {  # run -> its algorithm overrides
    "dpadam_bk": ["algo=dpadam", "algo.per_sample=bk"],
    "dpsgd_ghost": ["algo=dpsgd", "algo.per_sample=ghost"],
    "grape_bk": ["algo=grape", "algo.per_sample=bk"],
    "dpzero": ["algo=dpzero", "algo.mode=full"],  # every weight: LoRA mode does not shard
}
BUGS = {"noise_half": "noise", "unnoised_update": "release → update"}  # seeded bug -> the check that must catch it


def run(rank: int, world: int, port: int, out: str) -> None:
    from dpbench.tools.audit.runner import run_audit
    from dpbench.tools.audit.cli import _preflight
    from dpbench.tools.audit.seeded_bugs import run_bug

    become_rank(rank, world, port)
    distributed.init_from_environment()
    results: dict = {"reports": {}, "bugs": {}}
    for name, overrides in RUNS.items():
        report = run_audit(compose(TINY + AUDIT + SHARDED + overrides), Path(out) / name)
        results["reports"][name] = report.to_json()
    for bug in BUGS:
        report, result = run_bug(compose(TINY + AUDIT + SHARDED + RUNS["dpadam_bk"]), bug, Path(out) / bug)
        results["bugs"][bug] = (report.to_json(), result.caught)
    try:
        _preflight(compose(TINY + SHARDED + RUNS["dpadam_bk"] + ["audit.one_run=true"]))
    except UserError as error:
        results["one_run"] = str(error)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    distributed.shutdown()
