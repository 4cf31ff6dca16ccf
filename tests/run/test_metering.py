"""Peak memory is reset per run: a job after a memory-hungry one reports its own peak."""

import sys

import pytest
import torch

from dpbench.runtime.metering import PeakMemory, Throughput


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS high-water mark reset is Linux-only")
def test_cpu_peak_is_reset_between_runs():
    meter = PeakMemory(torch.device("cpu"))
    meter.reset()
    big = torch.ones(64 * 2**20)  # 256 MiB, touched
    first = meter.read()
    assert first["peak_bytes"] - first["start_bytes"] >= 200 * 2**20
    del big
    meter.reset()  # the next job
    small = torch.ones(2**20)  # 4 MiB
    second = meter.read()
    del small
    assert second["kind"] == "cpu_peak_rss"
    assert second["peak_bytes"] < first["peak_bytes"] - 150 * 2**20
    assert second["peak_bytes"] - second["start_bytes"] < 100 * 2**20


def test_throughput_skips_warmup_steps():
    meter = Throughput(warmup_steps=2)
    for examples in (1000, 1000, 10, 10):
        meter.step_started()
        meter.step_finished(examples)
    summary = meter.summary()
    assert summary["measured_steps"] == 2
    assert summary["samples_per_s"] > 0


def test_own_peak_is_one_rule_for_a_read_and_a_results_section():
    from dpbench.logging.results import MemoryResults
    from dpbench.runtime.metering import own_peak_bytes

    cpu = {"kind": "cpu_peak_rss", "peak_bytes": 900, "start_bytes": 300}
    gpu = {"kind": "cuda_max_reserved", "peak_bytes": 1000, "start_bytes": 100, "cuda_max_allocated": 700}
    assert own_peak_bytes(cpu) == 600 and own_peak_bytes(gpu) == 700
    assert own_peak_bytes(MemoryResults(**cpu)) == 600 and own_peak_bytes(MemoryResults(**gpu)) == 700
    assert own_peak_bytes({**gpu, "cuda_max_allocated": None}) == 1000  # older GPU files: the reserved peak
    assert own_peak_bytes({"kind": "cpu_peak_rss", "peak_bytes": None}) is None
    # The kernel reclaimed more of the interpreter's pages than a tiny run added: nothing of its own.
    assert own_peak_bytes({"kind": "cpu_peak_rss", "peak_bytes": 300, "start_bytes": 301}) == 0


WINDOW_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from helpers.config import compose
from dpbench.runtime.metering import PeakMemory
from dpbench.run import run_job

at_reset, reset = {}, PeakMemory.reset
def remembering(self):
    at_reset.update(dict.fromkeys(sys.modules))
    reset(self)
PeakMemory.reset = remembering
run_job(compose(sys.argv[3:]), sys.argv[2], show_progress=False)
new = {name for name in set(sys.modules) - set(at_reset) if name.split(".")[0] not in sys.stdlib_module_names}
print(sorted(name for name in new if not name.startswith("dpbench")))
"""


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["algo=grape"],  # the default job: timm, scikit-learn's digits, the accountant
    ["algo=dpadam", "algo.per_sample=ghost"],
    ["algo=dplora"],
    ["algo=dpzero"],
])
def test_the_first_job_of_a_process_imports_no_library_while_its_memory_is_metered(overrides, tmp_path):
    """What the first job of a process would load alone (2.4x the own peak of the same job run fifth
    in a grid, before the warm-up) is loaded before the meter's reset by every job alike."""
    import subprocess

    from helpers.config import REPO

    out = subprocess.run([sys.executable, "-c", WINDOW_SCRIPT, str(REPO / "tests"), str(tmp_path),
                          "logger=none", "train.steps=2", "train.eval_every=2", *overrides],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", f"imported inside the metered window: {out.stdout.strip().splitlines()[-1]}"


def test_the_warm_up_imports_what_the_jobs_components_declare():
    from helpers.config import compose

    from dpbench.runtime.warmup import EVERY_JOB, libraries_of

    assert libraries_of(compose(["algo=grape"]))[:len(EVERY_JOB)] == list(EVERY_JOB)
    assert {"timm", "sklearn.datasets"} <= set(libraries_of(compose(["algo=grape"])))  # the ViT's and the digits' loader's
    assert "peft" in libraries_of(compose(["algo=dplora"])) and "peft" not in libraries_of(compose(["algo=dpadam"]))
    assert "transformers" in libraries_of(compose(["model=minilm", "dataset=rt_snippets", "algo=dpadam"]))
