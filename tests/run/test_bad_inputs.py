"""Sixty-odd mistakes a new user plausibly makes, across every console script and the Python API: each
is refused before any work with exit status 2 and one line that names the problem, and none prints
a traceback (issue: "the 50 inputs of the review ... no traceback").

Each command is run in-process (tests/helpers/cli.py) from a scratch folder, kept cheap (no W&B, two
steps, the synthetic task) where the mistake allows."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import pytest
from helpers.cli import console_script_in_process, dpbench_in_process, unwritable_folder

from dpbench.errors import UserError

CHEAP = ["logger=none", "train.steps=2", "dataset=synthetic", "train.batch_size=32"]


@dataclass(frozen=True)
class Case:
    """`tool args` (placeholders: {unwritable} a folder this user cannot write, {file} a plain file,
    {empty} an empty folder, {missing} a path that does not exist, {run} a finished run with its saved
    model) and a piece of its one line."""

    tool: str
    args: tuple[str, ...]
    says: str
    status: int = 2
    env: dict = field(default_factory=dict)


def dp(*args: str, says: str, cheap: bool = True, **env: str) -> Case:
    return Case("dpbench", (*(CHEAP if cheap else ()), *args), says, env=env)


CASES = {
    # README commands with a typo or a wrong value
    "algo typo": dp("algo=grpae", says="did you mean algo=grape?"),
    "model typo": dp("model=vitt", says="did you mean model=vit?"),
    "dataset typo": dp("dataset=digts", says="did you mean dataset=digits?"),
    "accountant typo": dp("accountant=rpd", says="accountant=rpd is not an option of accountant"),
    "logger typo": dp("logger=wandbb", says="did you mean logger=wandb?"),
    "unknown key": dp("train.lrr=0.1", says="train.lrr"),
    "top-level key": dp("lr=0.1", says="lr"),
    "argparse habit": dp("--lr", "0.1", says="--lr is not an option of dpbench"),
    "--cfg value typo": Case("dpbench", ("--cfg", "jobs"), "invalid choice: 'jobs'"),
    "lr not a number": dp("train.lr=abc", says="train.lr must be a number"),
    "negative lr": dp("train.lr=-0.1", says="train.lr must be positive"),
    "zero lr": dp("train.lr=0", says="train.lr must be positive"),
    "zero batch": dp("train.batch_size=0", says="train.batch_size must be a positive integer"),
    "fractional batch": dp("train.batch_size=1.5", says="train.batch_size must be an integer"),
    "negative steps": dp("train.steps=-5", says="train.steps must be >= 0"),
    "no steps, zero epochs": dp("train.steps=null", "train.epochs=0", says="set train.steps or a positive train.epochs"),
    "seed not an integer": dp("seed=abc", says="seed must be an integer"),
    "physical > logical batch": dp("train.physical_batch_size=64", says="must lie in 1..train.batch_size=32"),
    "validation fraction 1.5": dp("dataset.validation_fraction=1.5", says="dataset.validation_fraction"),
    "precision typo": dp("train.precision=fp8", says="train.precision"),
    "clipping typo": dp("privacy.clipping=flatt", says="privacy.clipping='flatt' is not known"),
    "sampling typo": dp("privacy.sampling=fixed", says="privacy.sampling='fixed' is not known"),
    "negative eval_every": dp("train.eval_every=-1", says="train.eval_every must be >= 0"),
    "negative threads": dp("threads=-2", says="threads must be a positive integer or null"),
    "negative clipping gamma": dp("privacy.clipping=automatic", "privacy.clipping_gamma=-1",
                                  says="privacy.clipping_gamma must be positive"),
    "per-layer clipping for an algorithm that clips its own": dp("algo=dpdr", "privacy.clipping=per_layer",
                                                                  says="does not take privacy.clipping=per_layer"),
    "per-layer thresholds typo": dp("privacy.clipping=per_layer", "privacy.per_layer_thresholds=init",
                                    says="privacy.per_layer_thresholds='init' is not known"),
    "checkpoint_every zero": dp("train.checkpoint_every=0", says="train.checkpoint_every must be >= 1"),
    "evaluate nothing": dp("train.evaluate_test=false", says="train.evaluate_test=false evaluates no test set"),
    "tilde in a value": dp("dataset.data_dir=~/data", says="cannot parse the override dataset.data_dir=~/data: quote"),
    # privacy settings that contradict each other or are no guarantee
    "zero epsilon": dp("privacy.epsilon=0", says="privacy.epsilon must be positive"),
    "negative epsilon": dp("privacy.epsilon=-1", says="privacy.epsilon must be positive"),
    "epsilon and sigma": dp("privacy.noise_multiplier=1", "privacy.epsilon=3", says="both set the noise: give one"),
    "budget, non-private": dp("algo=adam", "privacy.epsilon=1", says="algo=adam is not private"),
    "infinite epsilon": dp("privacy.epsilon=inf", says="privacy.epsilon=inf is no privacy guarantee"),
    "delta of 1.5": dp("privacy.delta=1.5", says="privacy.delta must lie strictly between 0 and 1"),
    "zero clip norm": dp("privacy.clip_norm=0", says="privacy.clip_norm must be positive"),
    "approximate accountant": dp("accountant=gdp", "privacy.epsilon=3", says="allow_approximate_accountant"),
    # the machine and the folders
    "no CUDA": dp("device=cuda", says="device=cuda but no CUDA GPU is visible"),
    "device typo": dp("device=gpu", says="device"),
    "unwritable output folder": dp("hydra.run.dir={unwritable}", says="is not writable; set hydra.run.dir="),
    "output folder is a file": dp("hydra.run.dir={file}/run", says="is a file, not a folder"),
    "W&B online without login": dp("logger=wandb", "logger.mode=online", says="no W&B login is found", cheap=False,
                                   WANDB_MODE="", WANDB_API_KEY=""),
    "missing real asset": dp("model=minilm", "dataset=rt_snippets", says="dpbench-fetch rt-snippets", cheap=False,
                             DPBENCH_CACHE="{empty}"),
    "language model, image data": dp("model=minilm", "dataset=digits", says="model=minilm is a language model", cheap=False),
    "roberta on digits": dp("model=roberta", "dataset=digits", says="model=roberta is a language model", cheap=False),
    "zero-shot head without a text encoder": dp("+model.head_init=zero_shot", says="needs a text encoder with a classification head"),
    "user builder not importable": dp("model=custom", "model.builder=my_models.nope:build", says="my_models"),
    # presets, grids, searches
    "unknown preset": dp("experiment=dpgrape_t99", says="experiment=dpgrape_t99"),
    "grid and --cfg": Case("dpbench", ("-m", "algo=grape,dpadam", "--cfg", "job"), "-m and --cfg cannot be combined"),
    "grid value typo": Case("dpbench", ("-m", *CHEAP, "algo=grape,grpae"), "did you mean algo=grape?"),
    "grid flag after overrides": Case("dpbench", (*CHEAP, "-m", "algo=grape,grpae"), "did you mean algo=grape?"),
    "search sweeper typo": Case("dpbench", ("-m", *CHEAP, "hydra/sweeper=private_serch"), "did you mean hydra/sweeper=private_search?"),
    "search without validation": Case("dpbench", ("-m", *CHEAP, "hydra/sweeper=private_search",
                                                        "train.lr=interval(0.01,0.1)"), "dataset.validation_fraction"),
    "search of zero trials": Case("dpbench", ("-m", *CHEAP, "hydra/sweeper=private_search", "dataset.validation_fraction=0.2",
                                              "hydra.sweeper.mean_trials=0", "train.lr=interval(0.01,0.1)"),
                                  "hydra.sweeper.mean_trials=0: the mean number of trials must be at least 1"),
    "search shape negative": Case("dpbench", ("-m", *CHEAP, "hydra/sweeper=private_search", "dataset.validation_fraction=0.2",
                                              "hydra.sweeper.shape=-1", "train.lr=interval(0.01,0.1)"),
                                  "hydra.sweeper.shape=-1: the shape of the trial-count distribution must be >= 0"),
    # the other console scripts
    "audit seeded bug typo": Case("dpbench-audit", (*CHEAP, "audit.seeded_bug=no_clip"), "no_clip"),
    "audit of zero trials": Case("dpbench-audit", (*CHEAP, "audit.trials=0"), "audit.trials=0 must be at least 1"),
    "audit significance 2": Case("dpbench-audit", (*CHEAP, "audit.alpha=2"), "audit.alpha=2.0 must lie strictly between 0 and 1"),
    "report of a missing folder": Case("dpbench-report", ("{missing}",), "{missing}"),
    "report of an empty folder": Case("dpbench-report", ("{empty}",), "results.json"),
    "report with an unknown format": Case("dpbench-report", ("{empty}", "--format", "xlsx"), "invalid choice: 'xlsx'"),
    "report without a folder": Case("dpbench-report", (), "required: folder"),
    "evaluate a missing run": Case("dpbench-evaluate", ("{missing}",), "{missing}"),
    "evaluate a folder without a run": Case("dpbench-evaluate", ("{empty}",), "{empty}"),
    "evaluate with a model override": Case("dpbench-evaluate", ("{run}", "model.width=8"), "cannot override 'model.width'"),
    "evaluate with a dataset key typo": Case("dpbench-evaluate", ("{run}", "dataset.test_sise=100"),
                                             "dataset.test_sise is not a key of this run's config"),
    "fetch an unknown asset": Case("dpbench-fetch", ("minilm",), "minilm unknown"),
}

# The Python API: each raises UserError with one line (a piece of it given).
API_CASES = {
    "api run, overrides as a string": (lambda tmp: _api().run("algo=grape", run_dir=tmp / "run"), "list"),
    "api run, lr not a number": (lambda tmp: _api().run([*CHEAP, "train.lr=abc"], run_dir=tmp / "run"), "train.lr"),
    "api grid, algo typo": (lambda tmp: _api().grid(CHEAP, {"algo": ["grpae"]}, tmp / "grid"), "did you mean algo=grape?"),
    "api grid, values as a string": (lambda tmp: _api().grid(CHEAP, {"algo": "grape,dpadam"}, tmp / "grid"), "list"),
    "api run, overrides as a dict": (lambda tmp: _api().run({"algo": "grape"}, run_dir=tmp / "run"), "list"),
    "api grid, an empty sweep": (lambda tmp: _api().grid(CHEAP, {"seed": []}, tmp / "grid"), "non-empty list"),
    "api load_runs, missing folder": (lambda tmp: _api().load_runs(tmp / "missing"), "missing"),
    "api load_model, missing run": (lambda tmp: _api().load_model(tmp / "missing"), "missing is not a folder"),
    "api train_module, a DataLoader": (lambda tmp: _train_module_with_a_loader(), "DataLoader"),
}


def _api():
    import dpbench.api

    return dpbench.api


def _train_module_with_a_loader():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.zeros(8, 4), torch.zeros(8, dtype=torch.long))
    return _api().train_module(torch.nn.Linear(4, 2), DataLoader(data), data, num_classes=2, overrides=CHEAP)


def _main(tool: str):
    """The console script's entry point as its installed wrapper calls it (sys.exit(main()))."""
    if tool == "dpbench":
        return None
    if tool == "dpbench-audit":
        from dpbench.tools.audit.cli import main
    elif tool == "dpbench-report":
        from dpbench.tools.report import main
    elif tool == "dpbench-evaluate":
        from dpbench.tools.evaluate import main
    else:
        from dpbench.tools.fetch import main
    return lambda: sys.exit(main())


def _fill(text: str, places: dict) -> str:
    return text.format(**places)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished run with its saved model, for dpbench-evaluate's cases (one step, no evaluation)."""
    from dpbench.api import run

    folder = tmp_path_factory.mktemp("finished") / "run"
    run([*CHEAP, "train.steps=1", "train.eval_every=0", "privacy.noise_multiplier=1"], run_dir=folder, quiet=True)
    return folder


# Mistakes the config's value checks (dpbench.run_config.validate) refuse: the fast tier checks each of them
# there (below), and runs one of them, "zero clip norm", through the console script; the slow tier runs them all
# through it (about a second each, most of it Hydra composing the config three times).
VALUE_CHECKS = ("negative lr", "zero lr", "zero batch", "negative steps", "no steps, zero epochs",
                "physical > logical batch", "validation fraction 1.5", "negative eval_every", "negative threads",
                "negative clipping gamma", "checkpoint_every zero", "evaluate nothing", "zero epsilon",
                "negative epsilon", "epsilon and sigma", "budget, non-private", "infinite epsilon", "delta of 1.5",
                "zero clip norm", "no CUDA", "zero-shot head without a text encoder", "user builder not importable")
CLI_IN_THE_FAST_TIER = "zero clip norm"


@pytest.mark.parametrize("name", VALUE_CHECKS)
def test_each_value_mistake_is_refused_by_the_config_checks(name, monkeypatch, tmp_path):
    import torch

    from dpbench.api import compose
    from dpbench.run_config import validate

    if name == "no CUDA" and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    monkeypatch.chdir(tmp_path)
    case = CASES[name]
    with pytest.raises(UserError) as raised:
        validate(compose(list(case.args)), grid=False)
    assert "\n" not in str(raised.value) and case.says in str(raised.value), str(raised.value)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow if name in VALUE_CHECKS and name != CLI_IN_THE_FAST_TIER else ())
    for name in CASES])
def test_each_mistake_is_one_line_and_exit_2(name, tmp_path, request):
    import torch

    case = CASES[name]
    if name == "no CUDA" and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    work, empty = tmp_path / "work", tmp_path / "empty"
    work.mkdir()
    empty.mkdir()
    (tmp_path / "file").write_text("not a folder")
    places = {"unwritable": unwritable_folder(tmp_path), "file": tmp_path / "file", "empty": empty,
              "missing": tmp_path / "missing",
              "run": request.getfixturevalue("finished_run") if "{run}" in case.args else None}
    args = [_fill(a, places) for a in case.args]
    env = {k: _fill(v, places) for k, v in case.env.items()}
    if case.tool == "dpbench":
        result = dpbench_in_process(*args, cwd=work, **env)
    else:
        result = console_script_in_process(_main(case.tool), case.tool, *args, cwd=work, **env)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    assert result.returncode == case.status, output[-3000:]
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and _fill(case.says, places) in lines[0], lines
    assert not (work / "outputs").exists(), "a refused command leaves no run folder"


@pytest.mark.parametrize("name", API_CASES)
def test_each_api_mistake_raises_a_one_line_user_error(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    call, says = API_CASES[name]
    with pytest.raises(UserError) as raised:
        call(tmp_path)
    assert "\n" not in str(raised.value) and says in str(raised.value), str(raised.value)
