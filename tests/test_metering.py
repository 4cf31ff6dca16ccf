"""Peak memory is reset per run: a job after a memory-hungry one reports its own peak."""

import sys

import pytest
import torch

from dpbench.metering import PeakMemory, Throughput


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
