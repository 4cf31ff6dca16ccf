"""Start-up: what the console script answers before it imports torch (dpbench/startup.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.config import REPO

from dpbench import cli, startup


def test_a_missing_group_option_is_found_without_the_schemas():
    message = startup.missing_group_option(["algo=grpae"], cli.__file__)
    assert message is not None and message.startswith("algo=grpae is not an option of algo; did you mean algo=grape?")
    preset = startup.missing_group_option(["experiment=dpgrape_t66"], cli.__file__)
    assert preset is not None and preset.startswith("experiment=dpgrape_t66 is not an option of experiment")


def test_what_the_stand_ins_cannot_settle_is_left_to_the_real_composition():
    assert startup.missing_group_option(["algo=grape", "train.lr=0.1"], cli.__file__) is None
    assert startup.missing_group_option(["train.lr=abc"], cli.__file__) is None  # a typed value: the schema's
    assert startup.missing_group_option(["-m", "model=glob(*)"], cli.__file__) is None  # the options: Hydra's


def test_a_grid_is_checked_at_every_option_of_its_swept_groups():
    grid = ["-m", "algo=grape,dpadam,grpae", "seed=0,1", "train.lr=interval(0.01,0.1)"]
    assert "algo=grpae is not an option of algo" in startup.missing_group_option(grid, cli.__file__)
    assert startup.missing_group_option(["-m", "algo=grape,dpadam", "seed=range(0,3)", "train.lr=0.1,0.2"],
                                        cli.__file__) is None


def test_the_stand_ins_leave_the_config_store_and_resolvers_as_they_were():
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from dpbench.schema import register

    register()
    before = dict(ConfigStore.instance().repo)
    startup.missing_group_option(["algo=grpae"], cli.__file__)
    assert ConfigStore.instance().repo == before  # the real schemas, not the empty stand-ins
    assert OmegaConf.has_resolver("dpbench_default_lr")


def test_a_ctrl_c_while_starting_is_one_line(monkeypatch, capsys):
    def interrupted_import() -> None:
        raise KeyboardInterrupt  # where the user pressed it: while Python imported torch

    monkeypatch.setattr(cli, "answered_without_torch", interrupted_import)
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "interrupted while starting: nothing ran"


def _python(code: str, cwd) -> subprocess.CompletedProcess:
    environment = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", ""), "HOME": str(cwd)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=environment, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # fresh interpreters: sys.modules of this one holds torch already
def test_importing_the_console_script_imports_no_torch(tmp_path):
    done = _python("import sys, dpbench.cli; print('torch' in sys.modules)", tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize("argv, status, shown", [
    (["--help"], 0, "Config groups"),
    (["algo=grpae"], 2, "did you mean algo=grape?"),
    (["-sc", "query=bash"], 0, ""),
])
def test_help_completion_and_a_refused_option_import_no_torch(argv, status, shown, tmp_path):
    code = ("import sys; from dpbench.cli import main; sys.argv = ['dpbench', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as exit_:\n    code = exit_.code or 0\nelse:\n    code = 0\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch'); sys.exit(code)")
    environment = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
                   "COMP_LINE": "dpbench algo=gr", "COMP_POINT": "15"}
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == status, done.stderr
    assert done.stdout.strip().endswith("no torch")
    assert shown in done.stdout + done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "outputs").exists()
    if status == 2:
        assert len(done.stderr.strip().splitlines()) == 1
