"""CUDA-only behaviour checked on the CPU through its seams: a fake `torch.cuda` module and fake
clocks record which CUDA calls are made, on which device, in which order."""

from __future__ import annotations

import json
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from dpbench.tools.benchmarks import max_batch
from dpbench.tools.benchmarks.table import collect, markdown
from dpbench.runtime.metering import PeakMemory, Throughput, cuda_synchronizer, synchronize_active_cuda

CUDA = torch.device("cuda", 0)  # a device object only: nothing is allocated on it


class FakeCuda:
    """The parts of torch.cuda that dpbench calls, recording each call."""

    def __init__(self, initialized: bool = True, reserved: int = 300 * 2**20, allocated: int = 200 * 2**20,
                 bf16_native: bool = True):
        self.calls: list[tuple] = []
        self.initialized, self.reserved, self.allocated, self.bf16_native = initialized, reserved, allocated, bf16_native

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, *args, *kwargs.items()))
            return {
                "is_available": True, "is_initialized": self.initialized, "memory_reserved": 0,
                "max_memory_reserved": self.reserved, "max_memory_allocated": self.allocated,
                "is_bf16_supported": self.bf16_native,
            }.get(name)

        return record

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


# --- synchronisation around each timed step ---------------------------------------------------
def test_cuda_synchronizer_waits_for_the_cuda_device_and_nothing_on_the_cpu():
    cuda = FakeCuda()
    cuda_synchronizer(CUDA, cuda)()
    assert cuda.calls == [("synchronize", CUDA)]
    cuda_synchronizer(torch.device("cpu"), cuda)()
    assert cuda.calls == [("synchronize", CUDA)]  # the CPU is synchronous: no call


def test_default_synchronizer_syncs_only_once_cuda_is_in_use():
    used, unused = FakeCuda(initialized=True), FakeCuda(initialized=False)
    synchronize_active_cuda(used)
    synchronize_active_cuda(unused)
    assert "synchronize" in used.names() and "synchronize" not in unused.names()


def test_each_step_is_timed_between_two_synchronisations():
    """The clock is read after the sync at both boundaries: a step's queued kernels are its own."""
    events, now = [], [0.0]

    def clock():
        events.append("clock")
        return now[0]

    meter = Throughput(warmup_steps=1, synchronize=lambda: events.append("sync"), clock=clock)
    events.clear()
    for seconds in (5.0, 2.0, 2.0):  # the first step is warm-up
        meter.step_started()
        now[0] += seconds  # kernels run until the sync returns
        meter.step_finished(10)
    assert events == ["sync", "clock", "sync", "clock"] * 3
    assert meter.summary()["samples_per_s"] == pytest.approx(20 / 4.0)
    assert meter.step_seconds == pytest.approx(2.0)


def test_trainer_steps_are_synchronised(tmp_path, monkeypatch):
    """The trainer's step boundaries reach the synchroniser (no trainer change needed)."""
    from helpers.config import TINY, compose
    from omegaconf import OmegaConf

    import dpbench.runtime.metering as metering
    from dpbench.logging.wandb_logger import build_logger
    from dpbench.run import fit, setup

    calls = []
    monkeypatch.setattr(metering, "synchronize_active_cuda", lambda: calls.append("sync"))
    job = setup(compose(TINY + ["algo=dpsgd", "train.steps=4"]))
    _, status, _ = fit(job, build_logger(OmegaConf.create({"name": "none"}), tmp_path, "t", {}, []), False)
    assert status == "completed" and len(calls) == 2 * 4  # start and end of every step


# --- peak memory on CUDA ---------------------------------------------------------------------
def test_peak_memory_on_cuda_reads_reserved_and_allocated_of_its_device():
    cuda = FakeCuda(reserved=900 * 2**20, allocated=600 * 2**20)
    meter = PeakMemory(CUDA, cuda)
    meter.reset()
    assert [c for c in cuda.calls if c[0] == "reset_peak_memory_stats"] == [("reset_peak_memory_stats", CUDA)]
    read = meter.read()
    assert cuda.names()[-3:] == ["synchronize", "max_memory_reserved", "max_memory_allocated"]
    assert all(call[1] == CUDA for call in cuda.calls if len(call) > 1)
    assert read["kind"] == "cuda_max_reserved" and read["peak_bytes"] == 900 * 2**20
    assert read["cuda_max_allocated"] == 600 * 2**20


# --- max batch under a memory budget ---------------------------------------------------------
def test_gpu_probes_are_recognised_from_the_device_override():
    assert max_batch.probe_on_cuda(["device=cuda"], cuda_available=False)
    assert max_batch.probe_on_cuda([], cuda_available=True) and not max_batch.probe_on_cuda([], cuda_available=False)
    assert not max_batch.probe_on_cuda(["device=cuda", "device=cpu"], cuda_available=True)
    assert max_batch.rss_limit_mib(True, 1000, 500) is None and max_batch.rss_limit_mib(False, 1000, 500) == 1500


def test_gpu_fit_is_by_reserved_memory_and_reports_both():
    memory = {"kind": "cuda_max_reserved", "peak_bytes": 1100 * 2**20, "cuda_max_allocated": 700 * 2**20,
              "start_bytes": 0, "per_sample_grad_bytes": 0}
    fit = max_batch.memory_fit(memory, budget_mib=1024)
    assert not fit["fits"]  # allocated 700 MiB would fit; the card must hold the reserved 1100 MiB
    assert (fit["reserved_mib"], fit["allocated_mib"]) == (1100, 700)
    assert max_batch.memory_fit({**memory, "peak_bytes": 1000 * 2**20}, 1024)["fits"]
    cpu = {"kind": "cpu_peak_rss", "peak_bytes": 1500 * 2**20, "start_bytes": 600 * 2**20}
    assert max_batch.memory_fit(cpu, 1024) == {"fits": True, "own_mib": 900, "peak_mib": 1500, "per_sample_mib": 0}


def test_gpu_probe_process_is_capped_at_the_budget(monkeypatch, capsys):
    assert max_batch.probe_command(["algo=dpadam"], True, 2048)[1:5] == ["-m", "dpbench.tools.benchmarks.max_batch",
                                                                           "--capped-probe", "--budget-mib"]
    assert max_batch.probe_command(["algo=dpadam"], False, 2048)[1:3] == ["-m", "dpbench.cli"]
    cuda = FakeCuda()
    cuda.current_device = lambda: 0
    cuda.get_device_properties = lambda index: SimpleNamespace(total_memory=8192 * 2**20)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the probe hands its arguments to dpbench's CLI
    with pytest.raises(SystemExit) as stop:  # --version is answered before torch loads, with exit 0
        max_batch.run_capped_probe(2048, ["--version"], cuda)
    assert stop.value.code == 0
    assert ("set_per_process_memory_fraction", 0.25) in cuda.calls  # 2 GiB of an 8 GiB card
    assert "dpbench" in capsys.readouterr().out  # then dpbench's CLI ran (here: --version)


def _fake_probe_process(memory: dict, resident_mib: int):
    """A stand-in for the probe process: holds `resident_mib` of host memory, writes results.json."""

    def command(cli_args, on_cuda, budget_mib):
        run_dir = next(a.split("=", 1)[1] for a in cli_args if a.startswith("hydra.run.dir="))
        results = {"memory": memory, "throughput": {"samples_per_s": 12.5, "measured_steps": 3}}
        script = textwrap.dedent(f"""
            import json, pathlib, time
            block = bytearray({resident_mib} * 2**20)
            for i in range(0, len(block), 4096): block[i] = 1
            time.sleep(1.0)
            folder = pathlib.Path({run_dir!r}); folder.mkdir(parents=True)
            (folder / "results.json").write_text({json.dumps(results)!r})
        """)
        return [sys.executable, "-c", script]

    return command


def test_gpu_probe_is_not_killed_by_the_host_memory_rule(tmp_path, monkeypatch):
    gpu = {"kind": "cuda_max_reserved", "peak_bytes": 800 * 2**20, "cuda_max_allocated": 500 * 2**20, "start_bytes": 0}
    monkeypatch.setattr(max_batch, "probe_command", _fake_probe_process(gpu, resident_mib=300))
    outcome = max_batch.probe(8, [], budget_mib=1024, baseline_mib=0, workdir=tmp_path / "gpu", timeout_s=60, on_cuda=True)
    assert outcome["fits"] and outcome["reserved_mib"] == 800 and outcome["allocated_mib"] == 500
    assert outcome["samples_per_s"] == 12.5 and outcome["measured_steps"] == 3
    # the same host footprint kills a CPU probe (its budget is host memory)
    cpu = {"kind": "cpu_peak_rss", "peak_bytes": 400 * 2**20, "start_bytes": 0}
    monkeypatch.setattr(max_batch, "probe_command", _fake_probe_process(cpu, resident_mib=300))
    outcome = max_batch.probe(8, [], budget_mib=100, baseline_mib=0, workdir=tmp_path / "cpu", timeout_s=60, on_cuda=False)
    assert not outcome["fits"] and "resident" in outcome["reason"]


def test_probe_times_several_steps(tmp_path, monkeypatch):
    seen = {}

    def command(cli_args, on_cuda, budget_mib):
        seen["args"] = cli_args
        return [sys.executable, "-c", "raise SystemExit(1)"]

    monkeypatch.setattr(max_batch, "probe_command", command)
    max_batch.probe(8, [], 1024, 0, tmp_path, 60, on_cuda=False)
    assert "train.steps=6" in seen["args"]  # 3 warm-up steps, 3 timed (one timed step before)


def test_table_reports_allocated_as_own_and_reserved_as_absolute_on_gpu(tmp_path):
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "results.json").write_text(json.dumps({
        "algo": "adam", "config": {"algo": {}, "train": {"batch_size": 8}},
        "memory": {"peak_bytes": 1000 * 2**20, "start_bytes": 0, "kind": "cuda_max_reserved",
                   "cuda_max_allocated": 700 * 2**20},
        "throughput": {"samples_per_s": 3.0},
    }))
    (row,) = collect(tmp_path)
    # own: allocated (dpbench.runtime.metering.own_peak_bytes, one rule for every table); absolute: reserved
    assert row["own_mib"] == 700 and row["peak_mib"] == 1000 and row["allocated_mib"] == 700
    assert "| adam | 8 | 700 | 1000 | 700 |" in markdown([row])


# --- bf16 without bf16 units, TF32, low-precision trainable weights ----------------------------
def test_emulated_bf16_on_a_gpu_stops_with_one_line():
    from dpbench.errors import UserError
    from dpbench.precision import require_native_bf16

    old_card = FakeCuda(bf16_native=False)
    with pytest.raises(UserError, match="no native bfloat16") as error:
        require_native_bf16(CUDA, old_card)
    assert "\n" not in str(error.value)
    assert old_card.calls == [("is_bf16_supported", ("including_emulation", False))]  # emulation does not count
    require_native_bf16(CUDA, FakeCuda(bf16_native=True))
    cpu_check = FakeCuda(bf16_native=False)
    require_native_bf16(torch.device("cpu"), cpu_check)
    assert cpu_check.calls == []  # CPU autocast bf16 is not the GPU's question


@pytest.mark.parametrize(("overrides", "checked"), [(["train.precision=bf16"], True), ([], False)])
def test_setup_checks_bf16_support_of_its_device(monkeypatch, overrides, checked):
    from helpers.config import TINY, compose

    import dpbench.run as run

    seen = []
    monkeypatch.setattr(run, "require_native_bf16", lambda device: seen.append(device))
    run.setup(compose(TINY + ["algo=dpsgd", "device=cpu", *overrides]))
    assert seen == ([torch.device("cpu")] if checked else [])


def _fake_backends():
    return SimpleNamespace(cuda=SimpleNamespace(matmul=SimpleNamespace(allow_tf32=True)),
                           cudnn=SimpleNamespace(allow_tf32=True))


def test_tf32_is_off_for_private_runs_and_restored_for_the_others():
    from dpbench.precision import TF32Switch

    backends, precision = _fake_backends(), ["high"]
    fake_torch = SimpleNamespace(get_float32_matmul_precision=lambda: precision[0],
                                 set_float32_matmul_precision=lambda value: precision.__setitem__(0, value))
    switch = TF32Switch(backends, fake_torch)
    switch.apply(private=True)
    assert (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, precision[0]) == (False, False, "highest")
    switch.apply(private=False)  # a non-private job after it gets the process's settings back
    assert (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32, precision[0]) == (True, True, "high")


@pytest.mark.parametrize(("algo", "private"), [("dpsgd", True), ("adam", False)])
def test_setup_applies_the_tf32_rule(monkeypatch, algo, private):
    from helpers.config import TINY, compose

    from dpbench.precision import TF32
    from dpbench.run import setup

    seen = []
    monkeypatch.setattr(TF32, "apply", lambda private: seen.append(private))  # the process-wide switch setup applies
    setup(compose(TINY + [f"algo={algo}"]))
    assert seen == [private]


def test_trainable_weights_must_be_fp32_frozen_ones_may_be_low():
    from omegaconf import OmegaConf

    from dpbench.errors import UserError
    from dpbench.precision import require_fp32_trainable

    cfg = OmegaConf.create({"model": {"dtype": "bfloat16"}})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    with pytest.raises(UserError, match="model.dtype=bfloat16 leaves 4 trainable tensors .* set model.dtype=float32"):
        require_fp32_trainable(model, cfg)
    model[0].requires_grad_(False)  # a frozen base stays bf16 ...
    model[1].float()  # ... beside fp32 trainable weights
    require_fp32_trainable(model, cfg)
