"""`dpbench-doctor`: run first on a new machine. Every algorithm trains a few steps on this
machine's device in fp32 and in bf16, on a tiny model and synthetic data (offline, in this
process), one row each: ok or the error, step time, peak memory (reserved on a GPU, the process's
own peak RSS on the CPU) and host syncs per step (torch's CUDA sync debug mode; on the CPU, the calls that would sync a GPU).
Exit status 1 when any row failed.

    dpbench-doctor                            # every algorithm, fp32 and bf16, device=auto
    dpbench-doctor --algos dpadam,grape --precisions bf16 --device cuda

Zeroth-order algorithms evaluate in the model's dtype (no autocast) and train fp32 weights, so
their bf16 rows read n/a.

A last row checks sharded training (train.sharding=fsdp, docs/sharding.md) when the machine has 2 or
more CUDA GPUs: torchrun starts one rank per GPU (nccl) and DP-Adam (bk) trains the micro ViT for a
few steps under FSDP2. With fewer GPUs the row reads n/a and says why (`--no-fsdp` leaves it out).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from dpbench.runtime.host_syncs import count_host_syncs
from dpbench.runtime.metering import own_peak_bytes

MIB = 2**20
SYNC_WARNING = "synchronizing CUDA operation"  # what torch's sync debug mode warns on each host sync


@dataclass
class Row:
    algo: str
    precision: str
    status: str  # ok | error | n/a
    step_s: float | None = None
    peak_mib: float | None = None
    syncs_per_step: float | None = None
    note: str = ""


class SyncCounter:
    """Host syncs inside training steps: on CUDA counted from torch's sync debug mode ("warn": a
    warning on every implicit synchronisation, e.g. `.item()`, a device-to-host copy); on the CPU,
    where nothing waits, the calls that would be syncs on a GPU (dpbench.runtime.host_syncs). `cuda` is a
    seam for tests."""

    def __init__(self, device: torch.device, cuda=torch.cuda):
        self.on_cuda, self.cuda = device.type == "cuda", cuda
        self.syncs, self.steps = 0, 0

    def wrap(self, train_step):
        if not self.on_cuda:
            def counted_on_cpu(*args, **kwargs):
                with count_host_syncs() as syncs:
                    try:
                        return train_step(*args, **kwargs)
                    finally:
                        self.syncs += syncs.count
                        self.steps += 1

            return counted_on_cpu

        def counted(*args, **kwargs):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self.cuda.set_sync_debug_mode("warn")
                try:
                    return train_step(*args, **kwargs)
                finally:
                    self.cuda.set_sync_debug_mode("default")
                    self.syncs += sum(SYNC_WARNING in str(w.message) for w in caught)
                    self.steps += 1

        return counted

    @property
    def per_step(self) -> float | None:
        return self.syncs / self.steps if self.steps else None


def overrides(algo: str, precision: str, device: str, steps: int) -> list[str]:
    """A tiny job: the micro ViT on synthetic 8x8 images; a private algorithm at a fixed noise
    multiplier (no calibration), a non-private one without (a budget for it is refused)."""
    from dpbench.algorithms import algorithm_class

    sigma = ["privacy.noise_multiplier=1.0"] if algorithm_class(algo).private else []
    return ["dataset=synthetic", "model=vit", "model.size=micro", f"algo={algo}", f"train.precision={precision}",
            f"device={device}", "logger=none", "train.batch_size=16", f"train.steps={steps}",
            f"train.eval_every={steps}", *sigma, "privacy.sampling=shuffle"]


def check(algo: str, precision: str, device: torch.device, steps: int) -> Row:
    """Train `algo` for `steps` steps on the tiny job; a failure becomes the row's one-line note."""
    from dpbench.algorithms import algorithm_class
    from dpbench.api import compose
    from dpbench.logging.wandb_logger import build_logger
    from dpbench.runtime.metering import PeakMemory
    from dpbench.run import fit, setup

    if precision != "fp32" and not algorithm_class(algo).autocast_forward:
        return Row(algo, precision, "n/a", note="zeroth-order: no autocast")
    memory = PeakMemory(device)
    memory.reset()
    try:
        job = setup(compose(overrides(algo, precision, device.type, steps)))
        counter = SyncCounter(device)
        job.algorithm.train_step = counter.wrap(job.algorithm.train_step)
        with tempfile.TemporaryDirectory(prefix="dpbench_doctor_") as folder:
            logger = build_logger(OmegaConf.create({"name": "none"}), Path(folder), algo, {}, [])
            trainer, _, failure = fit(job, logger, show_progress=False)
        if failure is not None:
            raise failure
        peak = memory.read()
    except Exception as error:  # noqa: BLE001 - every failure is a row, the others still run
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return Row(algo, precision, "error", note=f"{type(error).__name__}: {message}"[:160])
    own = own_peak_bytes(peak)  # GPU: max allocated
    return Row(algo, precision, "ok", trainer.throughput.step_seconds, own / MIB, counter.per_step)


FSDP_TIMEOUT_S = 600


def fsdp_command(gpus: int, steps: int, run_dir: str) -> list[str]:
    """torchrun with one rank per GPU, training the tiny job sharded (FSDP2, nccl)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", "-m", "dpbench.cli",
            *overrides("dpadam", "fp32", "cuda", steps), "algo.per_sample=bk", "train.sharding=fsdp",
            f"hydra.run.dir={run_dir}"]


def check_fsdp(steps: int, gpus: int | None = None, run=None) -> Row:
    """The FSDP row: a sharded DP-Adam run across every GPU (n/a with fewer than 2). `gpus` and
    `run` (subprocess.run's signature) are seams for tests."""
    import json
    import subprocess
    import time

    from dpbench.runtime import distributed

    gpus = distributed.cuda_device_count() if gpus is None else gpus
    if gpus < 2:
        return Row("fsdp (dpadam bk)", "fp32", "n/a",
                   note=f"skipped: train.sharding=fsdp across GPUs needs 2 or more CUDA GPUs, this machine has {gpus}")
    run = subprocess.run if run is None else run
    with tempfile.TemporaryDirectory(prefix="dpbench_doctor_fsdp_") as folder:
        started = time.monotonic()
        try:
            done = run(fsdp_command(gpus, steps, folder), capture_output=True, text=True, timeout=FSDP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return Row("fsdp (dpadam bk)", "fp32", "error", note=f"{gpus} ranks: no result in {FSDP_TIMEOUT_S} s")
        results = Path(folder) / "results.json"
        if done.returncode != 0 or not results.exists():
            lines = (done.stderr or done.stdout or "").strip().splitlines()
            return Row("fsdp (dpadam bk)", "fp32", "error", note=f"{gpus} ranks, exit {done.returncode}: "
                       f"{lines[-1] if lines else 'no output'}"[:160])
        data = json.loads(results.read_text())
    throughput, memory = data.get("throughput", {}), data.get("memory", {})
    peak = memory.get("cuda_max_allocated") or memory.get("peak_bytes")
    return Row("fsdp (dpadam bk)", "fp32", "ok", throughput.get("step_seconds") or (time.monotonic() - started) / steps,
               None if peak is None else peak / MIB, None, note=f"{gpus} ranks, nccl, sharding: {throughput.get('sharding')}")


def table(rows: list[Row], device: torch.device) -> Table:
    memory = "own peak MiB (allocated)" if device.type == "cuda" else "own peak RSS MiB"
    out = Table(title=f"dpbench-doctor · {describe(device)}")
    for column in ("algorithm", "precision", "status", "step s", memory, "host syncs/step", "note"):
        out.add_column(column, justify="right" if column in ("step s", memory, "host syncs/step") else "left")
    style = {"ok": "green", "error": "bold red", "n/a": "dim"}
    for r in rows:
        out.add_row(
            r.algo, r.precision, f"[{style[r.status]}]{r.status}[/]",
            "n/a" if r.step_s is None else f"{r.step_s:.3f}",
            "n/a" if r.peak_mib is None else f"{r.peak_mib:.0f}",
            "n/a" if r.syncs_per_step is None else f"{r.syncs_per_step:.1f}",
            r.note,
        )
    return out


def describe(device: torch.device) -> str:
    if device.type != "cuda":
        return f"cpu · torch {torch.__version__}"
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    return f"{torch.cuda.get_device_name(device)} · torch {torch.__version__} · native bf16: {'yes' if native else 'no'}"


def run_doctor(argv: list[str] | None = None, console: Console | None = None) -> tuple[int, list[Row]]:
    """(exit status, rows) of `dpbench-doctor argv`, the table printed on `console`."""
    import os

    from dpbench.algorithms import ALGORITHMS, import_all
    from dpbench.run import resolve_device

    parser = argparse.ArgumentParser(prog="dpbench-doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (default: auto)")
    parser.add_argument("--algos", default=None, help="comma-separated algorithms (default: every registered one)")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated train.precision values")
    parser.add_argument("--steps", type=int, default=4, help="steps per algorithm (half are warm-up, untimed)")
    parser.add_argument("--no-fsdp", action="store_true", help="leave out the sharded (FSDP2, 2+ GPUs) row")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "disabled")
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is warm-up)")
    device = resolve_device(args.device)
    import_all()  # every registered algorithm
    algos = args.algos.split(",") if args.algos else sorted(ALGORITHMS.names())
    console = console or Console(width=None if sys.stdout.isatty() else 160)
    rows = []
    with console.status("dpbench-doctor") as status:
        for algo in algos:
            for precision in args.precisions.split(","):
                status.update(f"dpbench-doctor: {algo} {precision}")
                rows.append(check(algo, precision, device, args.steps))
        if not args.no_fsdp:
            status.update("dpbench-doctor: fsdp across GPUs")
            rows.append(check_fsdp(args.steps, gpus=None if device.type == "cuda" else 0))
    console.print(table(rows, device))
    failed = [r for r in rows if r.status == "error"]
    if failed:
        console.print(f"[bold red]{len(failed)} of {len(rows)} checks failed[/]")
    return (1 if failed else 0), rows


def main() -> None:
    code, _ = run_doctor(sys.argv[1:])
    sys.exit(code)


if __name__ == "__main__":
    main()
