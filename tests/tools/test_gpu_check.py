"""The offline GPU check (python -m dpbench.tools.gpu_check): the wheelhouse it makes and installs
from (a real `pip install --no-index` of wheels made here, nothing downloaded), its one-line
refusals, the oracle's column, the points' figures from the published catalogue, the engine rows' ratios, and (slow) the CPU fallback end to end."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from dpbench.tools.gpu_check import __main__ as cli
from dpbench.tools.benchmarks import memory_trace as ORACLE
from dpbench.tools.gpu_check import check, points, wheelhouse


def make_wheel(folder: Path, name: str, version: str, requires: list[str] = ()) -> Path:
    """A minimal pure-Python wheel: one module `<name>_mod` and its metadata."""
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}_mod.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": "\n".join(["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
                                       *(f"Requires-Dist: {r}" for r in requires)]) + "\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{path},,\n" for path in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


@pytest.fixture
def house(tmp_path) -> Path:
    folder = tmp_path / "house"
    folder.mkdir()
    make_wheel(folder, "gcapp", "1.0", ["gcdep>=1"])
    make_wheel(folder, "gcdep", "1.0")
    make_wheel(folder, "gcdep", "2.0")
    (folder / wheelhouse.NODE_CONSTRAINTS).write_text("gcdep==1.0\n")  # the pin wins over the newer wheel
    return folder


@pytest.mark.slow  # starts pip
def test_install_takes_the_requirement_and_its_pinned_dependency_from_the_wheelhouse_alone(house, tmp_path):
    target = tmp_path / "target"
    command = wheelhouse.install(house, "gcapp", keep_distributions=("torch",), extra=("--target", str(target), "--quiet"))
    assert command[command.index("--find-links") + 1] == str(house) and "--no-index" in command
    assert "-c" in command and str(house / wheelhouse.NODE_CONSTRAINTS) in command
    assert (target / "gcapp_mod.py").exists()
    assert (target / "gcdep_mod.py").read_text() == "VERSION = '1.0'\n"


def test_install_fails_in_one_line_when_a_dependency_is_not_in_the_wheelhouse(house, tmp_path):
    (house / "gcdep-1.0-py3-none-any.whl").unlink()
    (house / "gcdep-2.0-py3-none-any.whl").unlink()
    with pytest.raises(wheelhouse.WheelhouseError, match="could not install gcapp"):
        wheelhouse.install(house, "gcapp", keep_distributions=(), extra=("--target", str(tmp_path / "t"), "--quiet"))


def test_the_node_keeps_its_torch_stack_and_refuses_without_it():
    versions = {"torch": "2.9.0+cu128", "torchvision": "0.24.0+cu128"}

    def version(name):
        if name not in versions:
            raise wheelhouse.importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    assert wheelhouse.kept_pins(("torch", "torchvision"), version) == ["torch==2.9.0+cu128", "torchvision==0.24.0+cu128"]
    del versions["torchvision"]
    with pytest.raises(wheelhouse.WheelhouseError, match="torchvision is not installed"):
        wheelhouse.kept_pins(("torch", "torchvision"), version)


def test_the_closure_leaves_out_the_cuda_stack_and_dpbench():
    report = {"install": [{"metadata": {"name": n, "version": v}} for n, v in [
        ("dpbench", "0.1.0"), ("torch", "2.13.0"), ("torchvision", "0.28.0"), ("triton", "3.5.0"),
        ("nvidia-cublas-cu12", "12.8"), ("nvidia_nccl_cu12", "2.27"), ("Rich", "15.0.0"), ("opacus", "1.6.0")]]}
    assert wheelhouse.closure_pins(report) == ["opacus==1.6.0", "Rich==15.0.0"]


def test_the_wheelhouse_step_builds_resolves_downloads_and_writes_the_node_files(tmp_path):
    folder, calls = tmp_path / "house", []

    def run(command, check):
        calls.append(command)
        if "--no-deps" in command and command[-1] == str(wheelhouse.source_root()):
            make_wheel(folder, "dpbench", "0.1.0")
        if "--report" in command:
            Path(command[command.index("--report") + 1]).write_text(json.dumps({"install": [
                {"metadata": {"name": "torch", "version": "2.13.0"}}, {"metadata": {"name": "rich", "version": "15.0.0"}}]}))

    assert wheelhouse.build(folder, run=run) == ["rich==15.0.0"]
    build, resolve, download = calls
    assert build[3:5] == ["wheel", "--no-deps"]
    assert resolve[resolve.index("-c") + 1] == str(wheelhouse.source_root() / "constraints.txt") and "--dry-run" in resolve
    assert download[-1] == "rich==15.0.0" and "torch==2.13.0" not in download
    assert (folder / wheelhouse.NODE_CONSTRAINTS).read_text().splitlines()[1:] == ["rich==15.0.0"]
    assert "dpbench.tools.gpu_check node" in (folder / wheelhouse.LAUNCHER).read_text()
    assert not (folder / "resolve-report.json").exists()


def test_a_missing_wheelhouse_is_one_line_and_exit_2(tmp_path, capsys):
    assert cli.main(["node", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not exist" in err and "wheelhouse" in err


def test_no_cuda_without_cpu_is_one_line_and_exit_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert cli.main(["run", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--cpu" in err
    assert not (tmp_path / "x.json").exists()


def test_the_points_take_their_figures_from_the_published_catalogue():
    from dpbench.tools.benchmarks.published_memory import POINTS as PUBLISHED

    for point in points.POINTS:
        assert point.published in PUBLISHED and point.algo and point.algo[0].startswith("algo=")
    assert [(p.batch, round(p.published_bytes / 1e9, 1)) for p in points.POINTS[:2]] == [(40, 24.4), (40, 78.1)]


def test_a_point_holds_its_measurement_against_the_published_figure_and_the_oracle(monkeypatch, tmp_path):
    calls = []

    def predict_step_peak(overrides, *, batch=None, seq_len=None):
        calls.append((overrides, batch, seq_len))
        return {"allocated_bytes": 20 * 10**9, "reserved_bytes": 22 * 10**9, "reserved_slack": 0.1,
                "by_category": {}, "assumptions": []}

    monkeypatch.setattr(ORACLE, "predict_step_peak", predict_step_peak)
    monkeypatch.setattr(points, "measure", lambda *a: {"ok": True, "reason": None, "reserved_bytes": 20 * 10**9,
                                                        "allocated_bytes": 18 * 10**9, "samples_per_s": 3.0})
    point = points.POINTS[0]  # DP-GRAPE, 24.4 GB
    row = points.run_point(point, tmp_path / "model", tmp_path / "data", "cuda", tmp_path, 60, 3)
    assert calls == [(row["overrides"], 40, points.SEQ_LEN)]
    assert "algo=grape" in row["overrides"] and f"model.path={tmp_path / 'model'}" in row["overrides"]
    assert row["measured_vs_published"] == pytest.approx(20 / 24.4)
    assert row["predicted_vs_measured"] == pytest.approx(22 / 20)
    assert row["predicted_vs_published"] == pytest.approx(22 / 24.4)
    monkeypatch.setattr(ORACLE, "predict_step_peak", lambda *a, **k: 1 / 0)
    assert points.predict([], 1, 1)["status"].startswith("no prediction (ZeroDivisionError")


def test_engine_rows_read_allocated_and_reserved_and_divide_by_adam():
    def run(speed, own, peak, tensors=None):
        return {"samples_per_s": speed, "own_peak_bytes": own, "peak_bytes": peak, "tensor_peak_bytes": tensors,
                "memory_kind": "cuda_max_reserved"}

    results = {"adam": [run(100, 10, 20, 5)], "opacus_hooks": [run(50, 30, 50, 9)], "grape:bk": [{"error": "boom"}]}
    rows = {r["method"]: r for r in check.engine_rows(results, "cuda")}
    assert rows["opacus_hooks"]["allocated_bytes"] == 30 and rows["opacus_hooks"]["reserved_bytes"] == 50
    assert rows["opacus_hooks"]["samples_per_s_vs_adam"] == 0.5 and rows["opacus_hooks"]["reserved_vs_adam"] == 2.5
    assert rows["grape:bk"] == {"method": "grape:bk", "error": "boom"}
    on_cpu = {r["method"]: r for r in check.engine_rows(results, "cpu")}
    assert on_cpu["opacus_hooks"]["allocated_bytes"] == 9 and on_cpu["opacus_hooks"]["reserved_bytes"] == 30


@pytest.mark.slow
def test_the_cpu_fallback_runs_the_whole_pipeline(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run([sys.executable, "-m", "dpbench.tools.gpu_check", "run", "--cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["mode"] == "cpu" and report["schema"] == check.SCHEMA
    assert report["doctor"]["exit_code"] == 0 and all(r["status"] == "ok" for r in report["doctor"]["rows"])
    assert [s["shape"] for s in report["engines"]] == [shape for shape, _ in check.CPU.shapes]
    for section in report["engines"]:
        rows = {r["method"]: r for r in section["methods"]}
        assert list(rows) == check.CPU.methods and not any("error" in r for r in rows.values())
        assert rows["adam"]["samples_per_s_vs_adam"] == 1.0 and rows["opacus_hooks"]["reserved_bytes"] > 0
    assert [p["key"] for p in report["points"]] == [p.key for p in points.POINTS]
    assert all(p["measured"]["ok"] and p["measured"]["reserved_bytes"] > 0 for p in report["points"])
    assert all(p["prediction"]["status"] for p in report["points"])
    assert "published points" in done.stdout and "opacus_hooks" in done.stdout
