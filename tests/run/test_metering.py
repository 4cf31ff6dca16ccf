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
