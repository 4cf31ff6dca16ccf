"""The predicted GPU peak beside a report's measured figures (`dpbench-report FOLDER --predict-gpu`):
each group's first run traced on fake tensors, as `dpbench <its overrides>` would step on a GPU
(dpbench/tools/benchmarks/memory_trace.py; docs/memory-prediction.md). The overrides are the ones
the run's folder keeps in .hydra/overrides.yaml, so the trace is the run's own config."""

from __future__ import annotations

from pathlib import Path

import yaml

MIB = 2**20


def run_overrides(run_dir: Path) -> list[str] | None:
    """The overrides a run was started with (None: its folder keeps none)."""
    path = Path(run_dir) / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    return [str(o) for o in yaml.safe_load(path.read_text()) or [] if not str(o).startswith("hydra.")]


def predicted_gpu_mib(run_dir: Path, note=print) -> float | None:
    """Predicted reserved GPU memory of one step of the run in `run_dir`, in MiB (None, with a note,
    where it cannot be traced)."""
    from dpbench.tools.benchmarks.memory_trace import predict_step_peak

    overrides = run_overrides(run_dir)
    if overrides is None:
        note(f"{run_dir}: no .hydra/overrides.yaml, no predicted GPU peak")
        return None
    try:
        return predict_step_peak(overrides)["reserved_bytes"] / MIB
    except Exception as error:  # noqa: BLE001 - a run the trace cannot build keeps its measured figures
        note(f"{run_dir}: no predicted GPU peak ({type(error).__name__}: {str(error).splitlines()[0][:160]})")
        return None
