"""`python -m dpbench.tools.gpu_check {wheelhouse,node,run}` (docs/gpu-check.md).

Imports only the standard library at the top: `node` runs from the dpbench wheel on PYTHONPATH
before dpbench's dependencies are installed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dpbench.tools.gpu_check import wheelhouse


def parse(argv):
    parser = argparse.ArgumentParser(prog="python -m dpbench.tools.gpu_check", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("wheelhouse", help="download dpbench's pinned pure-Python dependencies and its wheel into DIR")
    make.add_argument("folder", type=Path)
    for name, text in (("node", "install from the wheelhouse DIR (offline, keeping the node's torch), then run the check"),
                       ("run", "run the check with dpbench as installed")):
        command = commands.add_parser(name, help=text)
        if name == "node":
            command.add_argument("folder", type=Path)
        command.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON report (default: gpu_check.json)")
        command.add_argument("--cpu", action="store_true", help="the CPU fallback: the same pipeline at tiny shapes")
        command.add_argument("--install-json", help=argparse.SUPPRESS)  # node -> run: what was installed
    return parser.parse_args(argv)


def node(args) -> int:
    """Install, then run the check in a fresh interpreter that imports the installed dpbench."""
    started = time.monotonic()
    command = wheelhouse.install(args.folder.resolve())
    install = {"wheelhouse": str(args.folder), "command": command[1:], "seconds": time.monotonic() - started}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # not the wheel this ran from
    run = [sys.executable, "-m", "dpbench.tools.gpu_check", "run", "--out", str(args.out),
           "--install-json", json.dumps(install)] + (["--cpu"] if args.cpu else [])
    return subprocess.run(run, env=env).returncode


def run(args) -> int:
    import torch

    from dpbench.tools.gpu_check import check

    if not args.cpu and not torch.cuda.is_available():
        print("error: no CUDA GPU is visible to torch; check the driver and CUDA_VISIBLE_DEVICES, "
              "or pass --cpu for the CPU fallback", file=sys.stderr)
        return 2
    plan = check.CPU if args.cpu else check.GPU
    report = check.run_check(plan, args.out, json.loads(args.install_json) if args.install_json else None)
    print(check.render(report))
    print(f"wrote {args.out}")
    return 0


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.command == "wheelhouse":
            pins = wheelhouse.build(args.folder)
            print(f"{args.folder}: dpbench's wheel and {len(pins)} pinned dependencies; on the node run: "
                  f"sh {args.folder / wheelhouse.LAUNCHER}")
            return 0
        if args.command == "node":
            return node(args)
        return run(args)
    except wheelhouse.WheelhouseError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
