"""The console script as a user runs it: W&B files, multirun resume, one-line errors, divergence."""

import json

import pytest
from helpers.cli import dpbench_in_process, unwritable_folder
from helpers.config import FIXED_SIGMA, TINY, compose
from helpers.wandb_records import exit_code, summary

from dpbench.errors import DivergedError, UserError
from dpbench.logging.results import read_results
from dpbench.run import run_job
from dpbench.run_config import validate


@pytest.mark.slow  # W&B's service process
def test_wandb_offline_run_holds_accuracy_and_peak_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose([o for o in TINY if not o.startswith("logger")] + ["logger=wandb", *FIXED_SIGMA])
    results = run_job(cfg, tmp_path, show_progress=False)
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    assert exit_code(run_file) == 0  # W&B's service writes the file after finish() returns: wait for its end
    values = summary(run_file)
    assert float(values["test/accuracy"]) == pytest.approx(results.metrics.test_accuracy)
    assert int(values["memory/peak_bytes"]) == results.memory.peak_bytes
    assert float(values["privacy/epsilon"]) == pytest.approx(results.privacy.epsilon)
    assert "epsilon" not in values and "test_accuracy" not in values  # one name per figure
    figures = results.summary()  # the one summary the console and report read too
    assert {name: json.loads(values[name]) for name in figures} == pytest.approx(figures)


def test_logger_none_writes_no_wandb_files(tiny_cfg, tmp_path):
    run_job(tiny_cfg(*FIXED_SIGMA), tmp_path, show_progress=False)
    assert (tmp_path / "results.json").is_file()
    assert not (tmp_path / "wandb").exists()


@pytest.mark.slow  # an end-to-end sweep: the slow tier
def test_multirun_runs_every_job_and_skips_finished_ones_on_resume(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", "algo=adam,dpsgd", "seed=0,1", *TINY, *FIXED_SIGMA, "threads=1", "device=cpu",
            f"hydra.sweep.dir={sweep}"]
    first = dpbench_in_process(*args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    files = sorted(sweep.glob("*/results.json"))
    assert len(files) == 4
    # folders are named by the keys that change a run (RUN_INVARIANT_KEYS, the one list, are left out)
    assert all("device=cpu" in f.parent.name and "threads" not in f.parent.name for f in files)
    assert {json.loads(f.read_text())["algo"] for f in files} == {"adam", "dpsgd"}
    stamps = {f: f.stat().st_mtime_ns for f in files}
    files[0].unlink()  # as if the grid had been interrupted before this job finished
    second = dpbench_in_process(*args, cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    assert second.stderr.count("skipping") == 3
    assert files[0].is_file()
    for f in files[1:]:
        assert f.stat().st_mtime_ns == stamps[f]


BAD_INPUTS = [
    (["privacy.epsilon=0"], "privacy.epsilon must be positive"),
    (["privacy.epsilon=-1"], "privacy.epsilon must be positive"),
    (["privacy.delta=1.5"], "privacy.delta must lie strictly between 0 and 1"),
    (["privacy.delta=0"], "privacy.delta must lie strictly between 0 and 1"),
    (["privacy.clip_norm=-1"], "privacy.clip_norm must be positive"),
    (["train.physical_batch_size=64"], "train.physical_batch_size=64 must lie in 1..train.batch_size=32"),
    (["privacy.sampling=fixed"], "privacy.sampling='fixed' is not known"),
    (["privacy.clipping=flatt"], "privacy.clipping='flatt' is not known; use one of automatic, flat, per_layer, psac"),
    (["privacy.neighboring=swap"], "privacy.neighboring='swap' is not known"),
    (["privacy.epsilon=abc"], "privacy.epsilon must be a number or null, got 'abc'"),
    (["seed=abc"], "seed must be an integer, got 'abc'"),
    (["train.batch_size=1.5"], "train.batch_size must be an integer, got 1.5"),
    (["train.eval_every=abc"], "train.eval_every must be an integer, got 'abc'"),
    (["privacy.delta=true"], "privacy.delta must be a number, got True"),
    (["privacy.noise_multiplier=-2"], "privacy.noise_multiplier must be positive"),
]


@pytest.mark.parametrize("overrides,message", BAD_INPUTS)
def test_bad_input_is_rejected_with_the_fix(overrides, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(".", r"\.")):
        validate(compose(TINY + overrides))


def test_unreachable_epsilon_is_a_user_error(tiny_cfg, tmp_path):
    with pytest.raises(UserError, match="no noise multiplier reaches"):
        run_job(tiny_cfg("privacy.epsilon=1e-9", "train.steps=50"), tmp_path, show_progress=False)


def test_cli_bad_input_prints_one_line_and_exits_nonzero(tmp_path):
    result = dpbench_in_process(*TINY, "privacy.epsilon=0", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: privacy.epsilon must be positive")
    unknown = dpbench_in_process("algo=nope", cwd=tmp_path)
    assert unknown.returncode == 2
    assert "algo=nope is not an option of algo" in unknown.stderr and "dpadam" in unknown.stderr


# The eight bad inputs of issue 43 (a contradiction, a missing part of the machine, a typo) and a
# piece of the one line each prints. `{unwritable}` is filled by `unwritable_folder`.
REFUSED = {
    "sigma and epsilon": (["privacy.noise_multiplier=1", "privacy.epsilon=3"], "both set the noise: give one"),
    "budget, non-private": (["algo=adam", "privacy.epsilon=1"], "algo=adam is not private, so privacy.epsilon=1 would be ignored"),
    "infinite epsilon": (["privacy.epsilon=inf"], "privacy.epsilon=inf is no privacy guarantee"),
    "no CUDA": (["device=cuda"], "device=cuda but no CUDA GPU is visible"),
    "no W&B login": (["logger=wandb", "logger.mode=online"], "logger.mode=online but no W&B login is found"),
    "unwritable folder": (["hydra.run.dir={unwritable}"], "is not writable; set hydra.run.dir="),
    "algo typo": (["algo=grpae"], "algo=grpae is not an option of algo; did you mean algo=grape?"),
    "sweeper typo": (["hydra/sweeper=private_serch"], "did you mean hydra/sweeper=private_search?"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_each_refused_input_is_one_line_exit_2_and_leaves_no_folder(case, tmp_path):
    import torch

    overrides, message = REFUSED[case]
    if case == "no CUDA" and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible")
    overrides = [o.format(unwritable=unwritable_folder(tmp_path)) for o in overrides]
    work = tmp_path / "work"
    work.mkdir()
    # HOME=work (no netrc there) and no WANDB_API_KEY: no W&B login, whatever this machine has
    result = dpbench_in_process(*TINY, *overrides, cwd=work, WANDB_MODE="", WANDB_API_KEY="")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "Warning" not in result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (work / "outputs").exists()  # Hydra's run folder was not made, or was removed again
    assert [p.name for p in work.iterdir()] == []


@pytest.mark.slow  # whole jobs through the console script's entry point (the fast tier's budget)
def test_a_refusal_inside_the_job_removes_the_run_folder_it_made_and_only_that(tmp_path):
    made = tmp_path / "new" / "run"
    refused = dpbench_in_process(*TINY, "privacy.epsilon=1e-9", "train.steps=50", f"hydra.run.dir={made}", cwd=tmp_path)
    assert refused.returncode == 2 and "no noise multiplier reaches" in refused.stderr
    assert not (tmp_path / "new").exists()  # the run folder and the parent Hydra made for it
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    again = dpbench_in_process(*TINY, "privacy.epsilon=1e-9", "train.steps=50", f"hydra.run.dir={kept}", cwd=tmp_path)
    assert again.returncode == 2 and (kept / "notes.txt").read_text() == "mine"  # a folder it did not make is left


def test_a_w_and_b_login_is_found_offline_in_the_key_or_netrc(tmp_path, monkeypatch):
    from dpbench.preflight import wandb_login_found

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert not wandb_login_found()  # no netrc file
    (tmp_path / "netrc").write_text("machine example.org login user password secret\n")
    assert not wandb_login_found()  # an entry for another host
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password secret\n")
    assert wandb_login_found()
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert not wandb_login_found()  # a self-hosted server: its own host's entry
    monkeypatch.setenv("WANDB_API_KEY", "key")
    assert wandb_login_found()


@pytest.mark.parametrize("overrides,message", [
    (["algo=grpae"], "did you mean algo=grape?"),
    (["privacy.noise_multiplier=1", "privacy.epsilon=3"], "both set the noise"),
    (["dataset.data_dir=~/data"], "dataset.data_dir=~/data"),
])
def test_the_python_api_raises_user_errors_in_one_line(overrides, message, tmp_path):
    from dpbench.api import run

    with pytest.raises(UserError, match=message.replace(".", r"\.").replace("?", r"\?")) as raised:
        run(TINY + overrides, run_dir=tmp_path / "run", show_progress=False)
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "run").exists()


def test_the_default_target_applies_only_when_neither_epsilon_nor_sigma_is_given(tiny_cfg):
    from dpbench.run_config import DEFAULT_EPSILON, resolved_config, stored_config, target_epsilon

    default, fixed, typed = tiny_cfg(), tiny_cfg(*FIXED_SIGMA), tiny_cfg("privacy.epsilon=3")
    for cfg in (default, fixed, typed):
        validate(cfg)  # each gives at most one of the two
    assert default.privacy.epsilon is None and target_epsilon(default) == DEFAULT_EPSILON
    assert resolved_config(default)["privacy"]["epsilon"] == DEFAULT_EPSILON  # what results.json records
    assert target_epsilon(fixed) is None and resolved_config(fixed)["privacy"]["epsilon"] is None
    assert target_epsilon(typed) == 3.0
    assert resolved_config(tiny_cfg("algo=adam"))["privacy"]["epsilon"] is None  # nothing to calibrate
    old_fixed = {**resolved_config(fixed), "privacy": {**resolved_config(fixed)["privacy"], "epsilon": 8.0}}
    validate(stored_config(old_fixed))  # stored before the rule: the default epsilon beside a fixed sigma


def test_a_non_private_job_of_a_grid_records_no_privacy_keys(tiny_cfg):
    from dpbench.run_config import resolved_config, stored_config

    config = resolved_config(tiny_cfg("algo=adam", "privacy.epsilon=3"))  # a grid's point (validate(grid=True) notes it)
    assert config["privacy"]["epsilon"] is None and config["privacy"]["noise_multiplier"] is None
    validate(stored_config(config))  # rebuilt outside the grid (a kept model): not refused


def test_a_preset_that_gives_epsilon_contradicts_a_typed_sigma():
    # dpgrape_fig3 sets privacy.epsilon: 6: a sigma typed beside it is refused, and null clears it
    with pytest.raises(UserError, match="both set the noise"):
        validate(compose(["experiment=dpgrape_fig3", "privacy.noise_multiplier=1"]))
    validate(compose(["experiment=dpgrape_fig3", "privacy.noise_multiplier=1", "privacy.epsilon=null"]))


@pytest.mark.slow  # a grid of whole jobs (the fast tier's budget)
def test_a_grid_over_algorithms_keeps_its_budget_for_the_private_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    result = dpbench_in_process("-m", "algo=adam,dpsgd", *TINY, "privacy.epsilon=8", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "algo=adam is not private: privacy.epsilon=8 does not apply to it" in result.stderr
    assert len(list(sweep.glob("*/results.json"))) == 2
    # the grid ends with its table (one row a run: adam's ε ∞, dpsgd's spent) and the report command
    table = result.stderr[result.stderr.index("grid · "):]
    assert "completed" in table and "∞" in table and f"report: dpbench-report {sweep}" in table.replace("\n", "")


def test_a_calibrated_run_spends_at_most_its_typed_epsilon(tiny_cfg, tmp_path):
    results = run_job(tiny_cfg("algo=dpsgd", "privacy.epsilon=3"), tmp_path, show_progress=False)
    assert results.privacy.target_epsilon == 3.0
    assert 0 < results.privacy.epsilon <= 3.0


def test_large_delta_warns(tiny_cfg, tmp_path, capsys):
    results = run_job(tiny_cfg("privacy.delta=0.01", *FIXED_SIGMA), tmp_path, show_progress=False)
    assert any("not below 1/n" in note for note in results.notes)


def test_shuffle_sampling_is_recorded_with_its_bound(tiny_cfg, tmp_path):
    results = run_job(tiny_cfg("privacy.sampling=shuffle"), tmp_path, show_progress=False)
    assert results.privacy.sampling == "shuffle"
    assert results.privacy.bound == "full_batch_gaussian_per_epoch"
    assert any("without amplification" in note for note in results.notes)  # tests/privacy/test_shuffle.py: the bound


def test_nan_loss_stops_the_run_and_still_writes_results(tiny_cfg, tmp_path):
    with pytest.raises(DivergedError, match="training loss became"):
        run_job(tiny_cfg("algo=dpsgd", "train.lr=1e38", "train.steps=20", "train.eval_every=1", *FIXED_SIGMA), tmp_path, show_progress=False)
    results = read_results(tmp_path)
    assert results["status"] == "diverged"
    assert results["privacy"]["steps"] < 20
    assert results["privacy"]["epsilon"] > 0  # the steps that ran were accounted


def test_physical_batches_accumulate_to_the_same_update(tiny_cfg, tmp_path):
    """Gradient accumulation over physical batches privatises exactly the logical batch's sum."""
    import torch

    from dpbench.algorithms import PrivacySetup, algorithm_class
    from dpbench.models import build_model
    from dpbench.privacy.noise import GaussianNoise
    from dpbench.tasks import build_task

    cfg = tiny_cfg()
    task = build_task(cfg, torch.device("cpu"))
    indices = list(range(20))
    updates = []
    for chunk in (20, 6):
        torch.manual_seed(0)
        model = build_model(cfg.model, task.model_spec())
        setup = PrivacySetup(0.0, 1.0, 20.0, 20 / task.train_size, GaussianNoise("cpu"))
        algo = algorithm_class("dpsgd")(model, task, compose(["algo=dpsgd"]).algo, 0.1, setup)
        algo.train_step([task.batch(indices[i : i + chunk]) for i in range(0, 20, chunk)], 0)
        updates.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(updates[0], updates[1], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a grid of whole jobs (the fast tier's budget)
def test_a_bad_job_in_a_grid_is_recorded_and_the_grid_goes_on(tmp_path):
    sweep = tmp_path / "sweep"
    result = dpbench_in_process("-m", "privacy.epsilon=-1,8", *TINY, "algo=dpsgd", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert result.returncode == 1, result.stderr[-2000:]
    (good,) = sweep.glob("*/results.json")
    assert "privacy.epsilon=8" in str(good)
    (error,) = sweep.glob("*/error.txt")
    assert "privacy.epsilon must be positive" in error.read_text()
    assert "1 job(s) of the grid failed" in result.stderr and "Traceback" not in result.stderr


def test_hydra_errors_and_missing_subcommands_exit_2_with_one_line(tmp_path):
    completion = dpbench_in_process("--shell-completion", cwd=tmp_path)
    assert completion.returncode == 2 and "Traceback" not in completion.stderr
    grammar = dpbench_in_process("dataset.data_dir=~/data", cwd=tmp_path)
    assert grammar.returncode == 2
    both = dpbench_in_process("-m", "algo=grape,dpadam", "--cfg", "job", cwd=tmp_path)
    assert both.returncode == 2 and "Traceback" not in both.stderr
    assert "-m and --cfg cannot be combined" in both.stdout + both.stderr


def test_results_json_respects_the_umask(tiny_cfg, tmp_path):
    import os

    old = os.umask(0o022)
    try:
        run_job(tiny_cfg(*FIXED_SIGMA), tmp_path, show_progress=False)
    finally:
        os.umask(old)
    assert (tmp_path / "results.json").stat().st_mode & 0o777 == 0o644


def test_version_and_help_describe_dpbench(tmp_path):
    from dpbench import __version__

    version = dpbench_in_process("--version", cwd=tmp_path)
    assert version.returncode == 0 and version.stdout.strip() == f"dpbench {__version__}"
    help_text = dpbench_in_process("--help", cwd=tmp_path)
    assert help_text.returncode == 0
    assert "differentially private" in help_text.stdout and "algo: " in help_text.stdout
    assert "dpbench-audit" in help_text.stdout


@pytest.mark.slow  # three whole jobs (the fast tier's budget)
def test_resume_skips_only_the_same_config_and_touches_nothing(tmp_path):
    run = tmp_path / "run"
    first = dpbench_in_process(*TINY, *FIXED_SIGMA, f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    stamps = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}
    assert (run / ".hydra" / "overrides.yaml").is_file()
    again = dpbench_in_process(*TINY, *FIXED_SIGMA, "name=renamed", f"hydra.run.dir={run}", cwd=tmp_path)  # name does not change results
    assert "skipping" in again.stderr
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()} == stamps
    changed = dpbench_in_process(*TINY, *FIXED_SIGMA, "train.lr=0.05", f"hydra.run.dir={run}", cwd=tmp_path)
    assert changed.returncode == 0 and "another config (train.lr" in changed.stderr
    assert read_results(run)["config"]["train"]["lr"] == 0.05


def test_the_job_returns_its_objective_to_a_sweeper(tiny_cfg, tmp_path):
    from omegaconf import open_dict

    from dpbench.cli import objective

    cfg = tiny_cfg(*FIXED_SIGMA)
    results = run_job(cfg, tmp_path, show_progress=False)
    assert objective(cfg, results) == results.metrics.test_accuracy
    with open_dict(cfg):
        cfg.optimize = "-test_loss"
    assert objective(cfg, results) == -results.metrics.test_loss
    assert objective(cfg, None) != objective(cfg, None)  # nan for a failed job


def test_python_api_runs_and_records_provenance(tmp_path):
    from dpbench.api import run

    results = run(TINY + FIXED_SIGMA, run_dir=tmp_path, show_progress=False)
    versions = results.versions
    assert {"timm", "transformers", "peft", "hydra_core", "wandb", "dp_accounting", "numpy", "git_commit", "command"} <= set(versions)
    assert versions["dp_accounting"] and versions["hydra_core"]
    again = run(TINY + FIXED_SIGMA + ["train.steps=2"], run_dir=tmp_path, resume=True, show_progress=False)
    assert again.privacy.steps == 2  # another config: not the cached run
