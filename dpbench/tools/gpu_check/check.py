"""The GPU check's measurements: dpbench-doctor, the engines against Opacus's, three published
points; one JSON and the tables (docs/gpu-check.md describes every key).

A GPU plan fits one 80 GB card in about 10 minutes; the CPU plan runs the same pipeline at tiny
shapes in under 2 minutes on 2 cores (the slow tier's test of it).
"""

from __future__ import annotations

import io
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SCHEMA = 1


@dataclass(frozen=True)
class Plan:
    device: str
    doctor: list[str]  # dpbench-doctor's arguments
    shapes: list[tuple[str, int]]  # engines.py's shape names and batch sizes
    methods: list[str]  # engines.py's methods ("adam" first: every ratio is to it)
    steps: int  # timed steps per engine measurement and per point
    point_batch: int | None  # None: each point's published batch
    threads: int | None = None


GPU = Plan("cuda", ["--algos", "adam,dpadam,grape,dpzero", "--precisions", "fp32,bf16", "--no-fsdp"],
           [("vit-base", 64), ("roberta-base", 16)],
           ["adam", "opacus_hooks", "opacus_ghost", "dpadam:materialize", "dpadam:ghost", "dpadam:bk", "grape:bk", "dpzero"],
           steps=4, point_batch=None)
CPU = Plan("cpu", ["--algos", "dpadam", "--precisions", "fp32", "--no-fsdp", "--steps", "2"],
           [("vit", 4), ("roberta", 2)], ["adam", "opacus_hooks", "dpadam:bk"], steps=1, point_batch=2, threads=1)


def describe_device(device: str) -> dict:
    import torch

    info = {"type": device, "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
            "name": platform.processor() or platform.machine(), "total_memory_bytes": None}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        info.update(name=properties.name, total_memory_bytes=int(properties.total_memory))
    return info


def run_doctor(plan: Plan) -> dict:
    """dpbench-doctor (in this process: its rows are kept as they are)."""
    from dataclasses import asdict

    from rich.console import Console

    from dpbench.tools import doctor

    console = Console(file=sys.stderr, width=160)
    code, rows = doctor.run_doctor(["--device", plan.device, *plan.doctor], console=console)
    return {"exit_code": code, "arguments": plan.doctor, "rows": [asdict(row) for row in rows]}


def engine_rows(results: dict[str, list[dict]], device: str) -> list[dict]:
    """engines.run_all's measurements, median per method, each against non-private Adam. On CUDA
    allocated = max_memory_allocated and reserved = max_memory_reserved (their peaks during the
    timed steps); on the CPU allocated = the profiled tensor peak and reserved = the own peak RSS."""
    medians = {}
    for method, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        if not ok:
            medians[method] = {"error": runs[-1]["error"] if runs else "not run"}
            continue
        if device == "cuda":
            allocated = [r["own_peak_bytes"] for r in ok]  # own_peak_bytes on CUDA is max allocated
            reserved = [r["peak_bytes"] for r in ok]
        else:
            allocated = [r["tensor_peak_bytes"] for r in ok if r.get("tensor_peak_bytes") is not None]
            reserved = [r["own_peak_bytes"] for r in ok]
        medians[method] = {"samples_per_s": statistics.median(r["samples_per_s"] for r in ok),
                           "allocated_bytes": int(statistics.median(allocated)) if allocated else None,
                           "reserved_bytes": int(statistics.median(reserved)) if reserved else None,
                           "memory_kind": ok[0]["memory_kind"]}
    adam = medians.get("adam", {})

    def vs_adam(row, key):
        return row[key] / adam[key] if row.get(key) is not None and adam.get(key) else None

    return [{"method": m, **row, **({} if "error" in row else {
        "samples_per_s_vs_adam": vs_adam(row, "samples_per_s"), "allocated_vs_adam": vs_adam(row, "allocated_bytes"),
        "reserved_vs_adam": vs_adam(row, "reserved_bytes")})} for m, row in medians.items()]


def run_engines(plan: Plan) -> list[dict]:
    """engines.py's workers (one process per method), one repeat per shape."""
    from dpbench.tools.benchmarks import engines

    sections = []
    for shape, batch in plan.shapes:
        argv = ["--shape", shape, "--batch", str(batch), "--steps", str(plan.steps), "--warmup", "1", "--repeats", "1",
                "--methods", ",".join(plan.methods), "--device", plan.device, "--no-freed"]
        argv += ["--threads", str(plan.threads)] if plan.threads else []
        started = time.monotonic()
        results = engines.run_all(engines.parse(argv))
        spec = engines.SHAPES[shape]
        sections.append({"shape": shape, "model": {"kind": spec.kind, "width": spec.width, "depth": spec.depth,
                                                   "heads": spec.heads, "tokens": spec.tokens, "vocab": spec.vocab},
                         "batch": batch, "seconds": time.monotonic() - started,
                         "methods": engine_rows(results, plan.device)})
    return sections


def run_points(plan: Plan, scratch: Path, timeout_s: float) -> list[dict]:
    from dpbench.tools.gpu_check import points

    batch = plan.point_batch or max(p.batch for p in points.POINTS)
    data = points.write_sst2(scratch / "sst2", points.records_needed(batch))
    model = points.write_roberta_large(scratch / "roberta-large") if plan.device == "cuda" else None
    steps = max(2, plan.steps)  # the probe's first steps are throughput warm-up
    return [points.run_point(p, model, data, plan.device, scratch / "runs", timeout_s, steps, plan.point_batch)
            for p in points.POINTS]


def run_check(plan: Plan, out: Path, install: dict | None = None, point_timeout_s: float = 240) -> dict:
    """The whole check; writes `out` (JSON) and returns it."""
    import os

    os.environ.setdefault("WANDB_MODE", "disabled")
    started, clock = time.strftime("%Y-%m-%dT%H:%M:%S%z"), time.monotonic()
    report = {"schema": SCHEMA, "started": started, "mode": "gpu" if plan.device == "cuda" else "cpu",
              "device": describe_device(plan.device), "install": install}
    sections = (("doctor", lambda: run_doctor(plan)), ("engines", lambda: run_engines(plan)))
    for name, section in sections:
        print(f"gpu check: {name}", file=sys.stderr, flush=True)
        report[name] = section()
    print("gpu check: published points", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="dpbench_gpu_check_") as scratch:
        report["points"] = run_points(plan, Path(scratch), point_timeout_s)
    report["seconds"] = time.monotonic() - clock
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def _gib(value) -> str:
    return "–" if value is None else f"{value / 2**30:.2f}"


def _x(value) -> str:
    return "–" if value is None else f"{value:.2f}×"


def render(report: dict) -> str:
    """The printed tables: the engines per shape, then the points (doctor prints its own)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(record=True, width=200, file=io.StringIO())
    device = report["device"]
    memory = "GPU allocated / reserved peaks" if report["mode"] == "gpu" else "CPU: tensor peak / own RSS peak"
    for section in report["engines"]:
        table = Table(title=f"{section['shape']}, batch {section['batch']} on {device['name']} ({memory}, GiB)")
        for column in ("method", "samples/s", "÷ Adam", "allocated", "÷ Adam", "reserved", "÷ Adam"):
            table.add_column(column, justify="left" if column == "method" else "right")
        for row in section["methods"]:
            if "error" in row:
                table.add_row(row["method"], f"error: {row['error']}"[:80], "", "", "", "", "")
                continue
            table.add_row(row["method"], f"{row['samples_per_s']:.1f}", _x(row["samples_per_s_vs_adam"]),
                          _gib(row["allocated_bytes"]), _x(row["allocated_vs_adam"]),
                          _gib(row["reserved_bytes"]), _x(row["reserved_vs_adam"]))
        console.print(table)
    table = Table(title="published points (GiB; measured reserved, on the CPU the own RSS peak)")
    for column in ("point", "batch", "published", "measured", "÷ published", "predicted", "÷ measured", "÷ published"):
        table.add_column(column, justify="left" if column in ("point", "published") else "right")
    for point in report["points"]:
        measured, prediction = point["measured"], point["prediction"]
        table.add_row(point["key"], str(point["batch"]), point["published"]["text"],
                      _gib(measured["reserved_bytes"]) if measured["ok"] else f"failed: {measured['reason']}"[:40],
                      _x(point["measured_vs_published"]),
                      _gib(prediction.get("reserved_bytes")) if prediction["status"] == "ok" else prediction["status"],
                      _x(point["predicted_vs_measured"]), _x(point["predicted_vs_published"]))
    console.print(table)
    doctor = report["doctor"]
    failed = sum(row["status"] == "error" for row in doctor["rows"])
    console.print(f"doctor: {len(doctor['rows']) - failed} of {len(doctor['rows'])} rows ok (exit {doctor['exit_code']}); "
                  f"{report['seconds']:.0f} s in all")
    return console.export_text()
