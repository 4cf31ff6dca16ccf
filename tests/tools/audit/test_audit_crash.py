"""dpbench-audit's exit statuses: a crash (an unexpected exception) is no verdict, exit 3, one line
naming it and where its traceback went; never 1, which says a check failed (a bug caught)."""

from __future__ import annotations

import pytest
from helpers.cli import console_script_in_process

from dpbench.tools.audit import cli


def _boom(*_args, **_kwargs):
    raise RuntimeError("The size of tensor a (16) must match the size of tensor b (64)")


@pytest.mark.parametrize("where, args", [
    ("run_audit", ["algo=dpsgd"]),  # the self-audit and the one-run audit
    ("run_bug", ["algo=dpsgd", "audit.seeded_bug=clipping_off"]),  # one seeded bug
])
def test_a_crash_exits_3_with_one_line_and_its_traceback_kept(where, args, tmp_path, monkeypatch):
    target = cli if where == "run_audit" else cli.seeded_bugs
    monkeypatch.setattr(target, where, _boom)
    run_dir = tmp_path / "run"
    result = console_script_in_process(cli.main, "dpbench-audit", "dataset=synthetic", "logger=none", *args,
                                       f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert result.returncode == cli.EXIT_CRASHED == 3, result.stderr[-2000:]
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if "crashed" in line]
    assert len(lines) == 1 and "no verdict" in lines[0] and "RuntimeError: The size of tensor a (16)" in lines[0]
    assert "Traceback" not in output and str(run_dir / "error.txt") in lines[0]
    kept = (run_dir / "error.txt").read_text()
    assert kept.startswith("crashed: RuntimeError") and "Traceback" in kept and "_boom" in kept
