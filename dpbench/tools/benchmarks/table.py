"""Memory and throughput table of a folder of runs, per (algorithm, per-sample mode, batch size).

    dpbench -m experiment=memory_vs_batch_vit
    python -m dpbench.tools.benchmarks.table outputs/multirun/memory_vs_batch_vit

Memory is the run's own peak (dpbench.runtime.metering.own_peak_bytes, the rule of every table: on the
CPU the peak resident size minus what was held at the start of the run, on a GPU the peak
allocated memory) beside the absolute peak (resident size; on a GPU reserved memory,
torch.cuda.max_memory_reserved, the papers' figure: what the card must hold).
Ratios compare each private method with DP-Adam materialising per-sample gradients, DP-Adam with
ghost clipping and non-private Adam at the same batch size. Repeated jobs are averaged.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import defaultdict
from pathlib import Path

from dpbench.runtime.metering import own_peak_bytes

MIB = 2**20
PRIVATE_MODES = ("dpadam", "dpsgd", "grape", "galore_naive")


def method(results: dict) -> str:
    algo = results["algo"]
    mode = results.get("config", {}).get("algo", {}).get("per_sample")
    return f"{algo}:{mode}" if algo in PRIVATE_MODES and mode else algo


def collect(folder: Path) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for path in sorted(folder.rglob("results.json")):
        results = json.loads(path.read_text())
        memory = results["memory"]
        cuda = memory.get("kind", "").startswith("cuda")
        own = own_peak_bytes(memory)  # CPU: resident size - start; GPU: max allocated
        allocated = memory.get("cuda_max_allocated") if cuda else None
        batch = results["config"]["train"]["batch_size"]
        groups[(method(results), batch)].append({
            "own_mib": own / MIB,
            "peak_mib": memory["peak_bytes"] / MIB,
            "allocated_mib": float("nan") if allocated is None else allocated / MIB,
            "per_sample_mib": memory.get("per_sample_grad_bytes", 0) / MIB,
            "optimizer_mib": memory.get("optimizer_state_bytes", 0) / MIB,
            "samples_per_s": results["throughput"].get("samples_per_s") or float("nan"),
        })
    rows = []
    for (name, batch), runs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rows.append({"method": name, "batch_size": batch, "runs": len(runs),
                     **{key: statistics.fmean(run[key] for run in runs) for key in runs[0]}})
    return rows


def ratios(rows: list[dict]) -> list[str]:
    by = {(r["method"], r["batch_size"]): r for r in rows}
    lines = []
    for r in rows:
        if not r["method"].startswith("grape"):
            continue
        for reference in ("dpadam:materialize", "dpadam:ghost", "dpadam:bk", "adam"):
            ref = by.get((reference, r["batch_size"]))
            if ref:
                lines.append(
                    f"B={r['batch_size']} {r['method']} / {reference}: own peak {r['own_mib'] / ref['own_mib']:.2f}x, "
                    f"samples/s {r['samples_per_s'] / ref['samples_per_s']:.2f}x"
                )
    return lines


def markdown(rows: list[dict]) -> str:
    out = ["| method | batch | own peak MiB | absolute peak MiB | allocated MiB | per-sample MiB | optimizer MiB | samples/s | runs |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        allocated = "n/a" if math.isnan(r["allocated_mib"]) else f"{r['allocated_mib']:.0f}"  # GPU runs only
        out.append(f"| {r['method']} | {r['batch_size']} | {r['own_mib']:.0f} | {r['peak_mib']:.0f} | {allocated} | "
                   f"{r['per_sample_mib']:.1f} | {r['optimizer_mib']:.1f} | {r['samples_per_s']:.2f} | {r['runs']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    rows = collect(args.folder)
    print(markdown(rows))
    print("\n".join(ratios(rows)))


if __name__ == "__main__":
    main()
