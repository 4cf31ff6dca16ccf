"""Peak memory, state bytes and throughput.

Peak memory is reset at the start of every run so each job of a multirun reports its own:
on a GPU through torch.cuda's peak statistics; on the CPU by resetting Linux's resident-set
high-water mark (writing 5 to /proc/self/clear_refs) and reading VmHWM afterwards. Before the CPU
reset, memory freed by an earlier job is handed back to the OS (glibc keeps freed heap pages
otherwise, and the next job's peak would include them). `start_bytes` is the resident size at
the reset (interpreter and libraries), so `peak_bytes - start_bytes` is what the run itself added;
the libraries a job loads lazily are loaded before the reset, by every job alike (runtime/warmup.py).

CUDA runs asynchronously: a kernel launched in one step may still run in the next, so the clock
is read only after `torch.cuda.synchronize()` (step start and end, peak reads). The synchroniser
and the CUDA module are parameters (seams) so that the CPU tests check the CUDA calls are made.
"""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
import time
from pathlib import Path
from typing import Callable

import torch


def cuda_synchronizer(device: torch.device, cuda=torch.cuda) -> Callable[[], None]:
    """Waits for the device's queued kernels on a CUDA device; a no-op on the CPU (synchronous)."""
    if torch.device(device).type == "cuda":
        return lambda: cuda.synchronize(device)
    return lambda: None


def synchronize_active_cuda(cuda=torch.cuda) -> None:
    """Throughput's default synchroniser: the current CUDA device once this process has used CUDA
    (a GPU run), nothing otherwise; so the trainer need not pass its device."""
    if cuda.is_available() and cuda.is_initialized():
        cuda.synchronize()


class PeakMemory:
    def __init__(self, device: torch.device, cuda=torch.cuda):
        self.device = device
        self.cuda = cuda  # seam: a fake module in the CPU tests
        self.start_bytes = 0
        self.warmed_up = False  # whether runtime/warmup.py ran before the reset (the own peak is comparable)

    @property
    def kind(self) -> str:
        if self.device.type == "cuda":
            return "cuda_max_reserved"
        return "cpu_peak_rss" if _can_reset_rss() else "cpu_peak_rss_since_process_start"

    def reset(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            cuda = self.cuda
            cuda.synchronize(self.device)
            cuda.empty_cache()
            cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = int(cuda.memory_reserved(self.device))
        else:
            _release_freed_heap()
            if _can_reset_rss():
                Path("/proc/self/clear_refs").write_text("5")
            self.start_bytes = _cpu_current_rss()

    def read(self) -> dict:
        if self.device.type == "cuda":
            cuda = self.cuda
            cuda.synchronize(self.device)
            return {  # reserved (the papers' figure: what the card must hold) and allocated
                "peak_bytes": int(cuda.max_memory_reserved(self.device)),
                "kind": self.kind,
                "cuda_max_allocated": int(cuda.max_memory_allocated(self.device)),
                "start_bytes": self.start_bytes,
                "warmed_up": self.warmed_up,
            }
        return {"peak_bytes": _cpu_peak_rss(), "kind": self.kind, "start_bytes": self.start_bytes,
                "warmed_up": self.warmed_up}


def _can_reset_rss() -> bool:
    path = Path("/proc/self/clear_refs")
    return sys.platform.startswith("linux") and path.exists()


def _release_freed_heap() -> None:
    """glibc's malloc_trim: return free heap pages to the OS (no-op elsewhere)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _proc_status_bytes(field: str) -> int | None:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in bytes; None off Linux."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    return None


def _cpu_current_rss() -> int:
    return _proc_status_bytes("VmRSS") or 0


def _cpu_peak_rss() -> int:
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


class Throughput:
    """Examples per second over the steps after a warm-up (first steps pay for allocation).

    Each step is timed between two synchronisations (`synchronize`, default: the active CUDA
    device), so its queued kernels are billed to it, not to the next step or to nobody."""

    def __init__(self, warmup_steps: int = 3, synchronize: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.warmup_steps = warmup_steps
        self.synchronize = synchronize_active_cuda if synchronize is None else synchronize
        self.clock = clock
        self.start = clock()
        self.steps = 0
        self.examples = 0
        self.measured_time = 0.0
        self._step_start = 0.0

    def step_started(self) -> None:
        self.synchronize()  # work queued before the step (evaluation, the last step) is not its own
        self._step_start = self.clock()

    def step_finished(self, examples: int) -> None:
        self.synchronize()  # the step's own kernels have run
        elapsed = self.clock() - self._step_start
        self.steps += 1
        if self.steps > self.warmup_steps:
            self.examples += examples
            self.measured_time += elapsed

    @property
    def step_seconds(self) -> float | None:
        """Mean seconds per measured step (None before one was measured)."""
        measured = self.steps - self.warmup_steps
        return self.measured_time / measured if measured > 0 else None

    def summary(self) -> dict:
        return {
            "samples_per_s": self.examples / self.measured_time if self.measured_time > 0 else None,
            "measured_steps": max(0, self.steps - self.warmup_steps),
            "wall_s": self.clock() - self.start,
        }


def own_peak_bytes(memory) -> int | None:
    """The run's own peak memory, the one rule of every table (report, leaderboard, benchmarks,
    doctor): on a GPU the allocator's maximum (`cuda_max_allocated`: what the run's tensors needed;
    the reserved peak adds the caching allocator's slack and stays the absolute figure), else the
    reserved peak; on the CPU the peak resident size minus the resident size at the start of the
    run (the interpreter, torch and the data are not the run's), floored at zero: the resident size
    also moves with pages the kernel reclaims from the interpreter (shared libraries, freed heap),
    so a run that added less than that reads as a negative difference, and it used no memory of
    its own beyond what was measured. `memory`: `PeakMemory.read()`'s dict or results.json's
    memory section (`MemoryResults`)."""
    def field(name: str):
        return memory.get(name) if isinstance(memory, dict) else getattr(memory, name, None)

    peak, start = field("peak_bytes"), field("start_bytes")
    if peak is None:
        return None
    if (field("kind") or "").startswith("cuda"):
        allocated = field("cuda_max_allocated")
        return allocated if allocated is not None else peak
    return max(0, peak - start) if start is not None else None
