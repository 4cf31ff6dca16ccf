"""Largest batch size that fits a memory budget (the DP-GRAPE paper's "batch 165 vs 50 in 24 GB").

    python -m dpbench.tools.benchmarks.max_batch --budget-mib 4096 -- experiment=memory_vs_batch_vit algo=grape algo.per_sample=bk
    python -m dpbench.tools.benchmarks.max_batch --predicted --budget-mib 24576 -- model=vit model.size=base algo=grape
    python -m dpbench.tools.benchmarks.max_batch --budget-mib 24576 -- experiment=memory_vs_batch_vit \
        model.embed_dim=768 model.num_heads=12 algo=dpadam device=cuda

`--predicted` runs no probe: it bisects on the traced prediction of the GPU's reserved memory
(memory_trace.py: dpbench's own step on fake tensors; docs/memory-prediction.md).

Each probe is a separate `python -m dpbench.cli` process running a few steps (`--steps`, the
first ones are throughput warm-up) at one exact batch size (shuffle sampling: a memory probe, not
a private run), so no probe inherits another's heap. The batch size doubles until a probe fails,
then bisects. A probe fits when it exits cleanly and its memory stays within the budget:

* on a GPU (`device=cuda`, or `auto` where CUDA is visible) by reserved memory
  (torch.cuda.max_memory_reserved, the papers' figure: what the card must hold), with the
  process capped at the budget (torch.cuda.set_per_process_memory_fraction), so the caching
  allocator frees and retries as it would on a card of that size and an out-of-memory error ends
  the probe: too big. Peak allocated memory is reported beside it;
* on the CPU by the run's own peak (peak RSS minus the resident size at the start of the run). A
  CPU probe whose resident size passes budget + --baseline-mib (interpreter and libraries) is
  killed, so a search never swaps the machine (a GPU probe's resident size is host memory, not
  the budget: no such rule there). CPU probes run with MALLOC_MMAP_THRESHOLD_=131072 (see `probe`).
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

from dpbench.runtime.metering import own_peak_bytes
from dpbench.tools.benchmarks.memory_trace import predicted_search  # --predicted's bisection, beside the trace it runs

MIB = 2**20


def probe_on_cuda(overrides: list[str], cuda_available: bool | None = None) -> bool:
    """Whether the probes run on a GPU: the `device=` override (last one wins), `auto` by default."""
    device = "auto"
    for override in overrides:
        key, _, value = override.lstrip("+").partition("=")
        if key == "device":
            device = value
    if device == "auto":
        import torch

        return torch.cuda.is_available() if cuda_available is None else cuda_available
    return device.startswith("cuda")


def rss_limit_mib(on_cuda: bool, budget_mib: float, baseline_mib: float) -> float | None:
    """Resident size at which a probe is killed: CPU probes only (on a GPU the budget is device memory)."""
    return None if on_cuda else budget_mib + baseline_mib


def probe_command(cli_args: list[str], on_cuda: bool, budget_mib: float) -> list[str]:
    """The probe process: dpbench's CLI, on a GPU under a memory cap of the budget."""
    if on_cuda:
        return [sys.executable, "-m", "dpbench.tools.benchmarks.max_batch", "--capped-probe", "--budget-mib", str(budget_mib),
                "--", *cli_args]
    return [sys.executable, "-m", "dpbench.cli", *cli_args]


def memory_fit(memory: dict, budget_mib: float) -> dict:
    """Whether a finished probe's memory (results.json's memory section) fits, and its figures."""
    figures = {"peak_mib": memory["peak_bytes"] / MIB, "per_sample_mib": (memory.get("per_sample_grad_bytes") or 0) / MIB}
    if memory.get("kind", "").startswith("cuda"):
        reserved = memory["peak_bytes"] / MIB
        allocated = (memory.get("cuda_max_allocated") or 0) / MIB
        return {"fits": reserved <= budget_mib, "reserved_mib": reserved, "allocated_mib": allocated, **figures}
    own = own_peak_bytes(memory) / MIB  # the one rule of every table
    return {"fits": own <= budget_mib, "own_mib": own, **figures}


def probe(batch: int, overrides: list[str], budget_mib: float, baseline_mib: float, workdir: Path, timeout_s: float,
          steps: int = 6, on_cuda: bool | None = None) -> dict:
    on_cuda = probe_on_cuda(overrides) if on_cuda is None else on_cuda
    run_dir = workdir / f"batch_{batch}"
    cli_args = [
        *overrides, f"train.batch_size={batch}", f"train.steps={steps}", f"train.eval_every={steps}",
        "privacy.sampling=shuffle", f"++dataset.train_size={max(512, 2 * batch)}", "logger=none",
        f"hydra.run.dir={run_dir}",
    ]
    started = time.monotonic()
    # A fixed mmap threshold makes glibc return every large freed block to the OS at once, so the
    # CPU peak RSS follows live tensor memory (glibc's adaptive threshold keeps freed blocks on
    # the heap; the same run's peak then varies by hundreds of MiB).
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", **os.environ}
    process = subprocess.Popen(probe_command(cli_args, on_cuda, budget_mib), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env)
    limit_mib = rss_limit_mib(on_cuda, budget_mib, baseline_mib)
    killed = None
    watched = psutil.Process(process.pid)
    while process.poll() is None:
        try:
            rss_mib = watched.memory_info().rss / MIB
        except psutil.NoSuchProcess:
            break
        if limit_mib is not None and rss_mib > limit_mib:
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
    results = json.loads(results_file.read_text())
    return {**result, **memory_fit(results["memory"], budget_mib),
            "samples_per_s": results.get("throughput", {}).get("samples_per_s"),
            "measured_steps": results.get("throughput", {}).get("measured_steps")}


def run_capped_probe(budget_mib: float, cli_args: list[str], cuda=None) -> None:
    """A GPU probe's process: cap the caching allocator at the budget, then run dpbench's CLI."""
    import torch

    cuda = torch.cuda if cuda is None else cuda
    total = cuda.get_device_properties(cuda.current_device()).total_memory
    cuda.set_per_process_memory_fraction(min(1.0, budget_mib * MIB / total))
    from dpbench import cli

    sys.argv = ["dpbench", *cli_args]
    cli.main()


def search(overrides, budget_mib, baseline_mib, start, limit, workdir, timeout_s, report=print,
           tolerance: float = 0.0, steps: int = 6) -> tuple[int, list[dict]]:
    """Double from `start` until a probe fails (or `limit`), then bisect until the failing size is
    within `tolerance` (relative) of the largest size that fits (0: exact)."""
    probes = []

    def fits(batch):
        outcome = probe(batch, overrides, budget_mib, baseline_mib, workdir, timeout_s, steps)
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
    parser.add_argument("--budget-mib", type=float, required=True,
                        help="memory budget (GPU: peak reserved; CPU: the run's own peak RSS)")
    parser.add_argument("--baseline-mib", type=float, default=1024, help="CPU: resident size of the bare process")
    parser.add_argument("--start", type=int, default=8)
    parser.add_argument("--limit", type=int, default=4096)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--tolerance", type=float, default=0.0, help="stop bisecting within this fraction")
    parser.add_argument("--steps", type=int, default=6, help="steps per probe (half, at most 3, are warm-up)")
    parser.add_argument("--capped-probe", action="store_true", help=argparse.SUPPRESS)  # a GPU probe's process
    parser.add_argument("--sharding", action="store_true",
                        help="print the memory model's per-rank table (no probes; dpbench/tools/benchmarks/memory_model.py)")
    parser.add_argument("--world-size", type=int, nargs="+", default=[1], help="with --sharding: K ranks")
    parser.add_argument("--predicted", action="store_true",
                        help="no probes: bisect on the traced GPU prediction (reserved) of one step (memory_trace.py)")
    parser.add_argument("overrides", nargs="*", help="dpbench overrides (after --)")
    args = parser.parse_args(argv)
    if args.predicted:
        best, traces = predicted_search(args.overrides, args.budget_mib, args.start, args.limit)
        print(json.dumps({"max_batch_size": best, "budget_mib": args.budget_mib, "overrides": args.overrides,
                          "traces": traces, "predicted": True}))
        return None
    if args.sharding:
        from dpbench.tools.benchmarks import memory_model

        for k in args.world_size:
            print(memory_model.table(memory_model.estimate(args.overrides, k), args.budget_mib / 1024) + "\n")
        if 1 in args.world_size:  # one process: the traced step's own largest batch (the table's is linear)
            print(memory_model.traced_max_batch_line(args.overrides, args.budget_mib / 1024))
        return None
    if args.capped_probe:
        return run_capped_probe(args.budget_mib, args.overrides)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is warm-up)")
    os.environ.setdefault("WANDB_MODE", "disabled")
    with tempfile.TemporaryDirectory(prefix="max_batch_") as workdir:
        best, probes = search(args.overrides, args.budget_mib, args.baseline_mib, args.start, args.limit,
                              Path(workdir), args.timeout_s, tolerance=args.tolerance, steps=args.steps)
    print(json.dumps({"max_batch_size": best, "budget_mib": args.budget_mib, "overrides": args.overrides,
                      "probes": len(probes)}))


if __name__ == "__main__":
    main()
