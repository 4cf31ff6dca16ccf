"""Largest batch size that fits a memory budget (the DP-GRAPE paper's "batch 165 vs 50 in 24 GB").

    python -m dpbench.benchmarks.max_batch --budget-mib 4096 -- experiment=memory_vs_batch_vit algo=grape algo.per_sample=bk
    python -m dpbench.benchmarks.max_batch --budget-mib 24576 -- experiment=memory_vs_batch_vit \
        model.embed_dim=768 model.num_heads=12 algo=dpadam device=cuda

Each probe is a separate `python -m dpbench.cli` process running two steps at one exact batch size
(shuffle sampling: a memory probe, not a private run), so
no probe inherits another's heap. The batch size doubles until a probe fails, then bisects. A
probe fits when it exits cleanly and its memory stays within the budget: on a GPU
`cuda_max_allocated` (a CUDA out-of-memory error ends the probe: too big); on the CPU the run's
own peak (peak RSS minus the resident size at the start of the run). A CPU probe whose resident
size passes budget + --baseline-mib (interpreter and libraries) is killed, so a search never
swaps the machine. CPU probes run with MALLOC_MMAP_THRESHOLD_=131072 (see `probe`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

MIB = 2**20


def probe(batch: int, overrides: list[str], budget_mib: float, baseline_mib: float, workdir: Path, timeout_s: float) -> dict:
    run_dir = workdir / f"batch_{batch}"
    command = [
        sys.executable, "-m", "dpbench.cli", *overrides, f"train.batch_size={batch}", "train.steps=2",
        "train.eval_every=2", "privacy.sampling=shuffle", f"++dataset.train_size={max(512, 2 * batch)}", "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.monotonic()
    # A fixed mmap threshold makes glibc return every large freed block to the OS at once, so the
    # CPU peak RSS follows live tensor memory (glibc's adaptive threshold keeps freed blocks on
    # the heap; the same run's peak then varies by hundreds of MiB).
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    killed = None
    watched = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            rss_mib = watched.memory_info().rss / MIB
        except psutil.NoSuchProcess:
            break
        if rss_mib > budget_mib + baseline_mib:
            killed = f"resident {rss_mib:.0f} MiB > budget + baseline"
        elif time.monotonic() - started > timeout_s:
            killed = f"over {timeout_s:.0f} s"
        if killed:
            process.kill()
            break
        time.sleep(0.1)
    output = process.communicate()[0]
    result = {"batch_size": batch, "returncode": process.returncode, "fits": False}
    if killed:
        return {**result, "reason": killed}
    results_file = run_dir / "results.json"
    if process.returncode != 0 or not results_file.exists():
        oom = "out of memory" in output.lower()
        return {**result, "reason": "out of memory" if oom else output.strip().splitlines()[-1:] or "failed"}
    memory = json.loads(results_file.read_text())["memory"]
    cuda = memory["kind"].startswith("cuda")
    own = memory["cuda_max_allocated"] if cuda else memory["peak_bytes"] - memory["start_bytes"]
    return {**result, "fits": own / MIB <= budget_mib, "own_mib": own / MIB, "peak_mib": memory["peak_bytes"] / MIB,
            "per_sample_mib": memory["per_sample_grad_bytes"] / MIB}


def search(overrides, budget_mib, baseline_mib, start, limit, workdir, timeout_s, report=print,
           tolerance: float = 0.0) -> tuple[int, list[dict]]:
    """Double from `start` until a probe fails (or `limit`), then bisect until the failing size is
    within `tolerance` (relative) of the largest size that fits (0: exact)."""
    probes = []

    def fits(batch):
        outcome = probe(batch, overrides, budget_mib, baseline_mib, workdir, timeout_s)
        probes.append(outcome)
        report(json.dumps(outcome))
        return outcome["fits"]

    if not fits(start):
        return 0, probes
    good, bad = start, None
    while bad is None and good < limit:
        candidate = min(2 * good, limit)
        if fits(candidate):
            good = candidate
        else:
            bad = candidate
    while bad is not None and bad - good > max(1, int(tolerance * good)):
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good, probes


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-mib", type=float, required=True, help="memory budget (own peak on the CPU)")
    parser.add_argument("--baseline-mib", type=float, default=1024, help="CPU: resident size of the bare process")
    parser.add_argument("--start", type=int, default=8)
    parser.add_argument("--limit", type=int, default=4096)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--tolerance", type=float, default=0.0, help="stop bisecting within this fraction")
    parser.add_argument("overrides", nargs="*", help="dpbench overrides (after --)")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    with tempfile.TemporaryDirectory(prefix="max_batch_") as workdir:
        best, probes = search(args.overrides, args.budget_mib, args.baseline_mib, args.start, args.limit,
                              Path(workdir), args.timeout_s, tolerance=args.tolerance)
    print(json.dumps({"max_batch_size": best, "budget_mib": args.budget_mib, "overrides": args.overrides,
                      "probes": len(probes)}))


if __name__ == "__main__":
    main()
