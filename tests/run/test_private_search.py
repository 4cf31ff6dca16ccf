"""The private random search (dpbench/study/ and the `private_search` Hydra sweeper).

The study's epsilon is dp-accounting's RepeatAndSelectDpEvent (Papernot & Steinke, ICLR 2022) on
the trial's ledger; K follows dp-accounting's distribution and comes from entropy; the sweeper
refuses swept keys that change the trial's privacy event, keeps equal draws as separate trials,
and resumes an interrupted study without drawing again. One end-to-end run through the console
script is marked slow."""

import json
import math
import random
import types
from pathlib import Path

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting import dp_event
from omegaconf import OmegaConf

from dpbench import study
from dpbench.errors import UserError
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger
from dpbench.study import publish
from dpbench.study import space as study_space
from dpbench.study import trials as study_trials
from hydra.core.override_parser.overrides_parser import OverridesParser
from dpbench.study.space import parse_search_space
from dpbench.study.sweep import StudySweep

DELTA = 1e-5


def _ledger(sigma: float, q: float, steps: int, neighboring: str = "add_remove") -> Ledger:
    ledger = Ledger()
    ledger.add(GaussianMechanism(sigma, q, neighboring), steps)
    return ledger


def _rdp(event) -> float:
    return dpa.rdp.RdpAccountant().compose(event).get_epsilon(DELTA)


def _direct(sigma, q, steps, mean, shape, add_remove_sigma=None):
    """The study by hand: dp-accounting's own events, nothing from dpbench."""
    step = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(add_remove_sigma or sigma))
    return _rdp(dp_event.RepeatAndSelectDpEvent(dpa.SelfComposedDpEvent(step, steps), mean, shape))


# ------------------------------------------------------------------ epsilon


def test_reference_numbers_of_the_brief():
    """q = 0.02, T = 500, sigma = 1, delta = 1e-5: one run 3.14; 10 composed 10.19; K of mean 10:
    logarithmic 5.08, geometric 5.84, Poisson 6.34 (dp-accounting 0.6.0)."""
    event = study.trial_event(_ledger(1.0, 0.02, 500))
    assert study.rdp_epsilon(event, DELTA) == pytest.approx(3.14, abs=0.005)
    assert study.naive_epsilon(event, 10, DELTA) == pytest.approx(10.19, abs=0.005)
    for shape, expected in ((0, 5.08), (1, 5.84), (math.inf, 6.34)):
        assert study.study_epsilon(event, 10, shape, DELTA) == pytest.approx(expected, abs=0.005)
    assert study.study_epsilon(event, 10, 1, DELTA, studies=3) == pytest.approx(13.80, abs=0.005)  # < 3 x 5.84


@pytest.mark.parametrize("shape, mean, sigma", [(0, 5.0, 1.5), (2.5, 20.0, 0.8), (math.inf, 3.0, 2.0)])
def test_study_epsilon_is_dp_accountings_repeat_and_select(shape, mean, sigma):
    ledger = _ledger(sigma, 0.01, 300)
    got = study.study_epsilon(study.trial_event(ledger.as_records()), mean, shape, DELTA)  # results.json's records
    assert got == pytest.approx(_direct(sigma, 0.01, 300, mean, shape), rel=1e-12)
    assert got < study.naive_epsilon(study.trial_event(ledger), math.ceil(mean), DELTA)


def test_replace_one_enters_through_the_add_remove_reduction():
    got = study.study_epsilon(study.trial_event(_ledger(2.0, 0.02, 200, "replace_one")), 10, 1, DELTA)
    assert got == pytest.approx(_direct(2.0, 0.02, 200, 10, 1, add_remove_sigma=1.0), rel=1e-12)


def test_a_validation_score_composes_as_an_unsampled_gaussian():
    sigma_v = 3.0
    ledger = _ledger(1.0, 0.02, 100)
    step = dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(1.0))
    direct = dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(step, 100), dpa.GaussianDpEvent(sigma_v)])
    with_score = study.study_epsilon(study.trial_event(ledger, sigma_v), 5, 1, DELTA)
    assert with_score == pytest.approx(_rdp(dp_event.RepeatAndSelectDpEvent(direct, 5, 1)), rel=1e-12)
    assert with_score > study.study_epsilon(study.trial_event(ledger), 5, 1, DELTA)


def test_a_target_the_score_alone_exceeds_is_refused_in_one_line():
    with pytest.raises(UserError) as error:
        study.per_trial_noise_multiplier_for_budget(lambda s: study.trial_event(_ledger(s, 0.02, 10)), 0.5, DELTA, 10, 1,
                                                    score_alone=0.5)
    assert "\n" not in str(error.value) and "validation score alone" in str(error.value)
    with pytest.raises(UserError):
        study.score_noise_multiplier_for_share(1.0, 3.0, DELTA, 10, 1)


# ------------------------------------------------------------------ K


@pytest.mark.parametrize("shape", [0, 1, math.inf])
def test_trial_count_follows_dp_accountings_distribution(shape):
    mean, n = 10.0, 2000
    ks = np.array([study.draw_trial_count(mean, shape) for _ in range(n)])
    support = np.arange(0, 3000)
    pmf = np.array([study.trial_count_pmf(int(k), mean, shape) for k in support])
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    exact_mean = float((support * pmf).sum())
    assert exact_mean == pytest.approx(mean, rel=1e-6)  # the gamma of dp-accounting's (shape, mean)
    std = math.sqrt(float((support**2 * pmf).sum()) - exact_mean**2)
    assert abs(ks.mean() - exact_mean) < 5 * std / math.sqrt(n)
    p1 = pmf[1]
    assert abs((ks == 1).mean() - p1) < 5 * math.sqrt(p1 * (1 - p1) / n) + 1 / n
    assert ks.min() >= (0 if shape == math.inf else 1)


def test_gamma_is_dp_accountings():
    from dp_accounting.rdp.rdp_privacy_accountant import (
        _gamma_truncated_negative_binomial,
    )

    for shape in (0, 0.5, 1, 3):
        for mean in (1.5, 10, 100):
            assert study.tnb_gamma(shape, mean) == pytest.approx(_gamma_truncated_negative_binomial(shape, mean), rel=1e-12)


def test_trial_count_ignores_every_seed():
    import torch

    draws = []
    for _ in range(20):
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        draws.append(study.draw_trial_count(10, 1))
    assert len(set(draws)) > 1


def test_shape_spellings():
    assert study.parse_shape(".inf") == math.inf and study.parse_shape("inf") == math.inf
    assert study.parse_shape(2) == 2.0
    with pytest.raises(UserError):
        study.parse_shape(-1)


# ------------------------------------------------------------------ the search space


def test_space_parser_draws_within_bounds():
    fixed, dims = parse_search_space([
        "train.lr=tag(log, interval(0.003, 0.1))", "privacy.clip_norm=interval(0.3, 2)", "model=cnn,vit",
        "train.eval_every=choice(5, 10)", "seed=3",
    ])
    assert fixed == ["seed=3"]
    kinds = {d.key: d.kind for d in dims}
    assert kinds == {"train.lr": "log_uniform", "privacy.clip_norm": "uniform", "model": "choice", "train.eval_every": "choice"}
    rng = study.entropy_rng()
    lrs = []
    for _ in range(400):
        values = dict(v.split("=", 1) for v in study_space.draw_values(dims, rng))
        lr, clip = float(values["train.lr"]), float(values["privacy.clip_norm"])
        assert 0.003 <= lr <= 0.1 and 0.3 <= clip <= 2
        assert values["model"] in ("cnn", "vit") and values["train.eval_every"] in ("5", "10")
        lrs.append(lr)
    # log-uniform: half the draws below the geometric mean of the bounds (uniform would put 15% there)
    assert 0.38 < np.mean(np.array(lrs) < math.sqrt(0.003 * 0.1)) < 0.62


@pytest.mark.parametrize("override", [
    "train.batch_size=16,32", "train.steps=choice(5,10)", "train.epochs=interval(1,3)", "privacy.noise_multiplier=1,2",
    "privacy.epsilon=1,8", "privacy.sampling=poisson,shuffle", "dataset=digits,synthetic", "dataset.train_size=100,200",
    "experiment=bench_mini,bench_vit",
])
def test_event_changing_keys_are_refused_in_one_line(override):
    with pytest.raises(UserError) as error:
        parse_search_space([override])
    message = str(error.value)
    assert "\n" not in message and override.split("=")[0] in message and "privacy event" in message


def test_clip_norm_and_fixed_privacy_keys_are_allowed():
    fixed, dims = parse_search_space(["privacy.clip_norm=0.5,1", "privacy.epsilon=3", "train.steps=5"])
    assert [d.key for d in dims] == ["privacy.clip_norm"] and fixed == ["privacy.epsilon=3", "train.steps=5"]


# ------------------------------------------------------------------ the sweeper, with a fake launcher


class _Planner:
    def ledger(self, cfg, sigma, score_sigma=None):
        return _ledger(sigma, 0.02, 5)

    def event(self, cfg, sigma, score_sigma=None):
        return study.trial_event(self.ledger(cfg, sigma, score_sigma))


class _Launcher:
    """Writes each trial's results.json as dpbench would; `fail` trials raise, `stop_at` interrupts."""

    def __init__(self, sweep_dir: Path, fail=(), stop_at=None):
        self.sweep_dir, self.fail, self.stop_at, self.calls = sweep_dir, set(fail), stop_at, []

    def launch(self, batch, initial_job_idx):
        returns = []
        for overrides in batch:
            index = int([o for o in overrides if o.startswith("hydra.sweep.subdir=")][0].rsplit("_", 1)[1])
            self.calls.append((index, list(overrides)))
            if index in self.fail:
                returns.append(types.SimpleNamespace(return_value=float("nan")))
                continue
            folder = self.sweep_dir / [o for o in overrides if o.startswith("hydra.sweep.subdir=")][0].split("=", 1)[1]
            folder.mkdir(parents=True, exist_ok=True)
            results = {"status": "completed", "privacy": {"ledger": _ledger(1.0, 0.02, 5).as_records()},
                       "metrics": {"test_accuracy": 0.5 + index / 100}, "config": {"optimize": "test_accuracy"}}
            (folder / "results.json").write_text(json.dumps(results))
            if index == self.stop_at:
                raise KeyboardInterrupt  # the trial finished, the sweeper never recorded it
            returns.append(types.SimpleNamespace(return_value=0.5 + index / 100))
        return returns


class _Sweeper(StudySweep):
    def __init__(self, sweep_dir: Path, launcher, **options):
        super().__init__(**{"mean_trials": 3, "shape": 1, **options})
        self.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}})
        self.launcher = launcher

    def _compose(self, overrides):
        return OmegaConf.create({"optimize": "test_accuracy", "privacy": {"delta": DELTA, "epsilon": 3.0, "noise_multiplier": 1.0}})

    def _planner(self, base):
        return _Planner()


def _fixed_k(monkeypatch, k):
    monkeypatch.setattr(study_trials, "draw_trial_count", lambda mean, shape, rng=None: k)


def _private_state(folder: Path) -> dict:
    return json.loads((folder / publish.PRIVATE_DIR / publish.STATE_FILE).read_text())


def test_two_trials_with_equal_values_both_run(tmp_path, monkeypatch):
    _fixed_k(monkeypatch, 2)
    launcher = _Launcher(tmp_path)
    _Sweeper(tmp_path, launcher, keep_private=True)._sweep(["train.lr=choice(0.01)", "logger=wandb"])
    (i0, o0), (i1, o1) = launcher.calls
    # a trial publishes nothing itself: no W&B run (the study's logger=wandb is replaced), no un-noised statistic
    assert (i0, i1) == (0, 1) and o0[:-1] == o1[:-1] == ["train.lr=0.01", "train.evaluate_test=false",
                                                         "privacy.log_private_stats=false", "logger=none"]
    assert o0[-1] != o1[-1]  # each in its own folder
    state = _private_state(tmp_path)
    assert state["trials"] == 2 and state["selected_index"] == 1
    assert [o["status"] for o in state["outcomes"].values()] == ["completed", "completed"]
    stored = json.loads((tmp_path / "study.json").read_text())
    assert stored["epsilon_study"] == pytest.approx(_direct(1.0, 0.02, 5, 3, 1), rel=1e-12)
    assert "selected trial" in stored["covers"] and stored["publishable"] is True


def test_the_publishable_files_hold_no_k_and_no_unselected_outcome(tmp_path, monkeypatch, capsys):
    """study.json holds only PUBLISHABLE_KEYS; the selected trial's folder is renamed (a trial number
    would bound K); the private area is gone; the console names the selected trial only."""
    _fixed_k(monkeypatch, 3)
    launcher = _Launcher(tmp_path)
    summary = _Sweeper(tmp_path, launcher)._sweep(["train.lr=choice(0.1, 0.2, 0.3)"])
    stored = json.loads((tmp_path / "study.json").read_text())
    assert tuple(stored) == publish.PUBLISHABLE_KEYS and stored == summary
    assert stored["mean_trials"] == 3 and stored["selected"]["run_dir"] == publish.SELECTED_DIR
    assert stored["selected"]["validation_score"] == pytest.approx(0.52)  # trial 2's: 0.5 + 2/100
    text = json.dumps(stored)
    for leaked in ('"trials"', "outcomes", "trial_", "0.51", "0.5,", "epsilon_naive", "draws", "index"):
        assert leaked not in text, leaked
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun.yaml", publish.SELECTED_DIR, "study.json"]
    assert (tmp_path / publish.SELECTED_DIR / "results.json").is_file()  # the selected run, kept
    printed = capsys.readouterr()
    output = printed.out + printed.err
    assert "0.5200" in output and "K =" not in output and "0.5100" not in output and "0.5000" not in output
    assert "trial_" not in output and "OUTSIDE" not in output


def test_the_private_area_is_kept_or_printed_only_when_asked_and_says_it_is_outside_epsilon(tmp_path, monkeypatch,
                                                                                             capsys):
    _fixed_k(monkeypatch, 3)
    _Sweeper(tmp_path, _Launcher(tmp_path), keep_private=True, print_private=True)._sweep(["train.lr=0.1,0.2"])
    private = tmp_path / publish.PRIVATE_DIR
    state_text = (private / publish.STATE_FILE).read_text()
    assert next(iter(json.loads(state_text))) == "outside_epsilon" and "NOT covered" in json.loads(state_text)["outside_epsilon"]
    assert sorted(p.name for p in private.iterdir()) == [publish.STATE_FILE, "trial_0", "trial_1"]  # trial_2 was selected
    printed = capsys.readouterr()
    output = printed.out + printed.err
    assert "OUTSIDE ε" in output and "K = 3" in output and "0.5100" in output


def test_an_interrupted_study_resumes_without_drawing_again(tmp_path, monkeypatch):
    _fixed_k(monkeypatch, 3)
    args = ["train.lr=tag(log, interval(0.001, 0.1))"]
    first = _Launcher(tmp_path, fail={0}, stop_at=1)
    with pytest.raises(KeyboardInterrupt):
        _Sweeper(tmp_path, first, max_batch_size=1)._sweep(args)
    state = _private_state(tmp_path)  # the state lives in the private area until the study ends
    assert state["trials"] == 3 and list(state["outcomes"]) == ["0"]  # trial 0 failed, recorded
    assert not (tmp_path / "study.json").exists()
    monkeypatch.setattr(study_trials, "draw_trial_count", lambda *a, **k: pytest.fail("K drawn again"))
    second = _Launcher(tmp_path)
    summary = _Sweeper(tmp_path, second, max_batch_size=1, keep_private=True)._sweep(args)
    # trial 0 (failed: -inf) is never rerun; trial 1 goes back to its folder, where dpbench finds its results.json
    assert [i for i, _ in second.calls] == [1, 2]
    assert second.calls[0][1] == first.calls[1][1]  # the same drawn values, the same folder
    after = _private_state(tmp_path)
    assert after["study_id"] == state["study_id"] == summary["study_id"] and after["draws"] == state["draws"]
    assert after["outcomes"]["0"]["status"] == "failed" and after["selected_index"] == 2
    assert summary["selected"]["overrides"] == state["draws"][2]["values"]


def test_a_finished_study_is_shown_again_and_never_rerun(tmp_path, monkeypatch):
    _fixed_k(monkeypatch, 2)
    first = _Sweeper(tmp_path, _Launcher(tmp_path))._sweep(["train.lr=0.1,0.2"])
    monkeypatch.setattr(study_trials, "draw_trial_count", lambda *a, **k: pytest.fail("K drawn again"))
    again = _Launcher(tmp_path)
    assert _Sweeper(tmp_path, again)._sweep(["train.lr=0.1,0.2"]) == first and again.calls == []


def test_other_settings_in_the_same_folder_are_refused(tmp_path, monkeypatch):
    _fixed_k(monkeypatch, 1)
    _Sweeper(tmp_path, _Launcher(tmp_path))._sweep(["train.lr=0.1,0.2"])
    with pytest.raises(UserError, match="other settings"):
        _Sweeper(tmp_path, _Launcher(tmp_path), mean_trials=5)._sweep(["train.lr=0.1,0.2"])


def test_a_study_that_would_log_private_statistics_is_refused(tmp_path):
    with pytest.raises(UserError, match="log_private_stats") as error:
        _Sweeper(tmp_path, _Launcher(tmp_path))._sweep(["train.lr=0.1,0.2", "privacy.log_private_stats=true"])
    assert "\n" not in str(error.value)


def test_poisson_may_draw_no_trial(tmp_path, monkeypatch):
    _fixed_k(monkeypatch, 0)
    launcher = _Launcher(tmp_path)
    summary = _Sweeper(tmp_path, launcher, shape=".inf")._sweep(["train.lr=0.1,0.2"])
    assert launcher.calls == [] and summary["selected"] is None
    assert summary["shape"] == "inf" and summary["epsilon_study"] > 0


@pytest.mark.parametrize("optimize", ["-train_loss", "test_loss", "train_accuracy"])
def test_an_objective_other_than_the_noisy_validation_score_is_refused(tmp_path, optimize):
    class Sweeper(_Sweeper):
        def _compose(self, overrides):
            cfg = super()._compose(overrides)
            cfg.optimize = optimize
            return cfg

    with pytest.raises(UserError, match="noisy validation score") as error:
        Sweeper(tmp_path, _Launcher(tmp_path))._sweep(["train.lr=0.1,0.2"])
    assert "\n" not in str(error.value)


def test_a_study_without_a_validation_split_is_refused_in_one_line():
    from helpers.config import TINY, compose

    from dpbench.study.planner import TrialPlanner

    with pytest.raises(UserError, match="dataset.validation_fraction") as error:
        TrialPlanner(compose([*TINY, "algo=dpsgd", "privacy.noise_multiplier=1.0"]))
    assert "\n" not in str(error.value)


def test_trials_never_evaluate_on_the_test_set(tmp_path, monkeypatch):
    _fixed_k(monkeypatch, 2)
    launcher = _Launcher(tmp_path)
    _Sweeper(tmp_path, launcher)._sweep(["train.lr=0.1,0.2"])
    assert len(launcher.calls) == 2  # both trials launched: the check below is not over an empty list
    assert all("train.evaluate_test=false" in overrides for _, overrides in launcher.calls)


def test_the_sweeper_is_a_discoverable_hydra_plugin():
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins
    from hydra.plugins.sweeper import Sweeper

    assert "PrivateSearchSweeper" in {p.__name__ for p in Plugins.instance().discover(Sweeper)}
    assert "private_search.yaml" in ConfigStore.instance().list("hydra/sweeper")


def test_the_plugin_hands_its_options_and_its_sweep_to_the_study(tmp_path, monkeypatch):
    from hydra_plugins.dpbench_private_search.private_search import PrivateSearchSweeper

    sweeper = PrivateSearchSweeper(mean_trials=4, shape=".inf", studies=2, grid={"seed": "0,1"})
    assert isinstance(sweeper.study, StudySweep)
    assert (sweeper.study.mean_trials, sweeper.study.shape, sweeper.study.studies) == (4.0, math.inf, 2)
    monkeypatch.setattr(StudySweep, "sweep", lambda self, arguments: ("swept", self, arguments))
    assert sweeper.sweep(["train.lr=0.1,0.2"]) == ("swept", sweeper.study, ["train.lr=0.1,0.2"])


# ------------------------------------------------------------------ end to end


STUDY = ("-m", "hydra/sweeper=private_search", "hydra.sweeper.mean_trials=2", "hydra.sweeper.shape=1",
         "train.lr=tag(log, interval(0.003, 0.1))", "privacy.clip_norm=interval(0.3, 2)", "privacy.epsilon=3",
         "train.steps=5", "dataset=synthetic", "dataset.validation_fraction=0.2", "train.batch_size=64", "name=study")


@pytest.mark.slow
def test_a_study_through_the_console_script(tmp_path):
    """The issue's check: the console and the publishable files name no K and no unselected outcome,
    the trials print no bar and keep no un-noised statistic, the selected model is kept, and the
    private area exists only when asked (and says it is outside epsilon)."""
    from helpers.cli import dpbench

    done = dpbench(*STUDY, "hydra.sweeper.keep_private=true", cwd=tmp_path)  # W&B is on by default: trials run without
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = tmp_path / "outputs" / "multirun" / "study"
    summary = json.loads((sweep / "study.json").read_text())
    assert tuple(summary) == publish.PUBLISHABLE_KEYS and summary["epsilon_study"] <= 3.0 + 1e-6
    state = json.loads((sweep / publish.PRIVATE_DIR / publish.STATE_FILE).read_text())
    k = state["trials"]
    assert k >= 1 and next(iter(state)) == "outside_epsilon"
    outcomes = [state["outcomes"][str(i)] for i in range(k)]
    selected = summary["selected"]
    assert selected["validation_score"] == max(o["score"] for o in outcomes if o["score"] is not None)
    assert 0.0 <= selected["test"]["accuracy"] <= 1.0  # the selected model alone, evaluated once
    output = done.stdout + done.stderr
    published = output + (sweep / "study.json").read_text()
    assert f"{selected['validation_score']:.4f}" in output
    for o in outcomes:  # no unselected outcome, no trial folder, no K
        if o["index"] != state["selected_index"] and o["score"] is not None:
            assert f"{o['score']:.4f}" not in published and str(o["score"]) not in published
    assert "trial_" not in published and "K =" not in output and '"trials"' not in published
    assert "━" not in output and "it/s" not in output and "results:" not in output  # no trial's bar or table
    # the selected run is kept beside study.json, without un-noised statistics
    kept = sweep / publish.SELECTED_DIR
    assert (kept / "model.safetensors").is_file()
    results = json.loads((kept / "results.json").read_text())
    assert results["metrics"].get("test_accuracy") is None  # a trial reads no test example
    assert results["privacy"]["log_private_stats"] is False and results["epsilon_covers"]["outside_epsilon"] == []
    assert results["metrics"]["train_loss"] is None and results["memory"]["per_sample_grad_bytes"] is None
    assert results["memory"]["start_bytes"] is None  # no process-level figure: a process's first trial starts smaller
    assert len({path.stat().st_mtime_ns for path in publish.published_paths(sweep)}) == 1  # one time: no trial's own
    assert results["throughput"]["samples_per_s"] is None and results["config"]["logger"]["name"] == "none"
    # every trial (the private area, kept as asked) trained the same way
    trials = sorted((sweep / publish.PRIVATE_DIR).glob("trial_*"))
    assert len(trials) == k - 1
    for folder in trials:
        other = json.loads((folder / "results.json").read_text())
        assert other["metrics"]["train_loss"] is None and other["epsilon_covers"]["outside_epsilon"] == []
    # 5 training steps at the sigma the sweeper chose for the budget, then the noisy validation score
    training, score = sorted(results["privacy"]["ledger"], key=lambda r: r["sample_rate"])
    assert training["count"] == 5 and training["noise_multiplier"] == pytest.approx(summary["noise_multiplier"])
    assert score["count"] == 1 and score["sample_rate"] == 1.0
    step = dpa.PoissonSampledDpEvent(training["sample_rate"], dpa.GaussianDpEvent(training["noise_multiplier"]))
    trial = dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(step, 5), dpa.GaussianDpEvent(score["noise_multiplier"])])
    direct = _rdp(dp_event.RepeatAndSelectDpEvent(trial, 2.0, 1.0))
    assert summary["epsilon_study"] == pytest.approx(direct, abs=0.01)
    # the same command again, without keep_private: the finished study is shown, and its private area removed
    again = dpbench(*STUDY, cwd=tmp_path)
    assert again.returncode == 0 and json.loads((sweep / "study.json").read_text()) == summary
    assert not (sweep / publish.PRIVATE_DIR).exists() and (kept / "model.safetensors").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", [["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10"],
                                      ["hydra/launcher=local_parallel", "hydra.launcher.n_jobs=2"]],
                         ids=["submitit_local", "joblib"])
def test_a_study_runs_on_the_slurm_and_parallel_launchers(tmp_path, launcher):
    """The trials go through the configured launcher (submitit's local executor: the SLURM
    launcher's code path on one machine; joblib: several at once) and the study is the same."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher" if "submitit" in launcher[0] else "hydra_plugins.hydra_joblib_launcher")
    from helpers.cli import dpbench

    done = dpbench("-m", "hydra/sweeper=private_search", *launcher, "hydra.sweeper.mean_trials=2", "hydra.sweeper.shape=1",
                   "hydra.sweeper.keep_private=true",
                   "train.lr=tag(log, interval(0.003, 0.1))", "privacy.epsilon=3", "train.steps=3", "dataset=synthetic",
                   "dataset.validation_fraction=0.2", "train.batch_size=64", "logger=none", "name=study", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    sweep = tmp_path / "outputs" / "multirun" / "study"
    summary = json.loads((sweep / "study.json").read_text())
    state = json.loads((sweep / publish.PRIVATE_DIR / publish.STATE_FILE).read_text())
    assert summary["epsilon_study"] <= 3.0 + 1e-6 and state["trials"] >= 1
    outcomes = list(state["outcomes"].values())
    assert len(outcomes) == state["trials"]  # every trial ran and was recorded (not an empty list)
    assert all(o["status"] == "completed" and o["score"] is not None for o in outcomes)
    folders = [*(sweep / publish.PRIVATE_DIR).glob("trial_*"), sweep / publish.SELECTED_DIR]
    assert len(folders) == state["trials"]
    for folder in folders:
        assert json.loads((folder / "results.json").read_text())["metrics"].get("test_accuracy") is None
    assert 0.0 <= summary["selected"]["test"]["accuracy"] <= 1.0


def test_selection_over_a_basic_grid_is_charged_every_run_composed(tmp_path):
    """A basic grid is a fixed K: selecting by the runs' noisy validation scores costs them all
    composed (each run's ledger, its noisy score included), written beside the grid."""
    from dpbench.cli import SELECTION_FILE, grid_selection_note

    score = GaussianMechanism(10.0, 1.0, "add_remove")
    for i, sigma in enumerate((1.0, 1.5)):
        ledger = _ledger(sigma, 0.02, 50)
        ledger.add_release(score)
        folder = tmp_path / str(i)
        folder.mkdir()
        (folder / "results.json").write_text(json.dumps({
            "metrics": {"validation_score": 0.5}, "privacy": {"private": True, "delta": DELTA, "epsilon": 1.0,
                                                               "ledger": ledger.as_records()}}))
    (tmp_path / "2").mkdir()  # a run without a validation split is not part of the selection
    (tmp_path / "2" / "results.json").write_text(json.dumps({"metrics": {}, "privacy": {"private": True, "delta": DELTA}}))
    note = grid_selection_note(tmp_path)
    direct = _rdp(dpa.ComposedDpEvent([
        dpa.ComposedDpEvent([dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.02, dpa.GaussianDpEvent(s)), 50),
                             dpa.GaussianDpEvent(10.0)]) for s in (1.0, 1.5)]))
    assert note["runs"] == 2 and note["epsilon_naive"] == pytest.approx(direct, rel=1e-9)
    assert "fixed-K" in note["note"] and json.loads((tmp_path / SELECTION_FILE).read_text()) == note


def test_an_uncharged_sweeper_over_private_runs_is_refused_in_one_line():
    from helpers.config import TINY, compose

    from dpbench.cli import ACCOUNTED_SWEEPERS, check_sweeper

    optuna = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    with pytest.raises(UserError, match="private_search") as error:
        check_sweeper(compose([*TINY, "algo=dpsgd"]), optuna)
    assert "\n" not in str(error.value)
    check_sweeper(compose([*TINY, "algo=adam"]), optuna)  # non-private runs: any sweeper
    for accounted in ACCOUNTED_SWEEPERS:
        check_sweeper(compose([*TINY, "algo=dpsgd"]), accounted)


@pytest.mark.slow
def test_selection_is_unchanged_when_the_test_labels_are_permuted(tmp_path, monkeypatch):
    """Two studies with the same entropy (patched to a fixed sequence) select the same trial with the
    same noisy validation scores whether or not the test labels are permuted: no trial reads the
    test set. The selected model's one test evaluation does see the permutation."""
    import itertools

    from helpers.cli import dpbench_in_process

    import dpbench.data as data
    import dpbench.privacy.noise as noise
    import dpbench.privacy.sampling as sampling
    import dpbench.tasks.image as image

    load = data.load_dataset

    def run(folder: Path, permute: bool) -> dict:
        counter = itertools.count(12345)
        for module in (noise, sampling):  # every generator that is seeded from entropy, the same twice
            monkeypatch.setattr(module, "entropy_seed", lambda: next(counter))
        monkeypatch.setattr(study_trials, "entropy_rng", lambda: np.random.default_rng(7))

        def loaded(*args, **kwargs):
            dataset = load(*args, **kwargs)
            if permute:
                dataset.test_labels = dataset.test_labels[torch.randperm(len(dataset.test_labels),
                                                                         generator=torch.Generator().manual_seed(0))]
            return dataset

        monkeypatch.setattr(image, "load_dataset", loaded)
        folder.mkdir()
        done = dpbench_in_process("-m", "hydra/sweeper=private_search", "hydra.sweeper.mean_trials=3", "hydra.sweeper.shape=1",
                                  "train.lr=tag(log, interval(0.003, 0.3))", "privacy.epsilon=3", "train.steps=5",
                                  "dataset=synthetic", "dataset.validation_fraction=0.3", "train.batch_size=64",
                                  "model=cnn", "model.width=8", "model.groups=4", "logger=none", "name=study",
                                  "hydra.sweeper.keep_private=true", cwd=folder)
        assert done.returncode == 0, done.stderr[-3000:]
        sweep = folder / "outputs" / "multirun" / "study"
        return {**json.loads((sweep / "study.json").read_text()),
                "state": json.loads((sweep / publish.PRIVATE_DIR / publish.STATE_FILE).read_text())}

    plain, permuted = run(tmp_path / "plain", False), run(tmp_path / "permuted", True)
    assert plain["state"]["trials"] == permuted["state"]["trials"] >= 1
    assert plain["state"]["outcomes"] and plain["state"]["outcomes"].keys() == permuted["state"]["outcomes"].keys()
    assert ([o["score"] for o in plain["state"]["outcomes"].values()]
            == [o["score"] for o in permuted["state"]["outcomes"].values()])
    assert plain["state"]["selected_index"] == permuted["state"]["selected_index"]
    assert plain["selected"]["overrides"] and plain["selected"]["overrides"] == permuted["selected"]["overrides"]
    assert plain["selected"]["test"] != permuted["selected"]["test"]  # the one test evaluation saw the labels


# ------------------------------------------------------------------ several studies: a tuned benchmark


def test_study_folders_are_the_grids_product_times_the_repetitions():
    assert study_space.study_folders({}, 1) == [("", [])]
    assert study_space.study_folders({}, 2) == [("study_0", []), ("study_1", [])]
    plan = study_space.study_folders({"algo": "dpsgd,grape", "seed": "0"}, 2)
    assert [folder for folder, _ in plan] == ["algo-dpsgd_seed-0/study_0", "algo-dpsgd_seed-0/study_1",
                                               "algo-grape_seed-0/study_0", "algo-grape_seed-0/study_1"]
    assert plan[2][1] == ["algo=grape", "seed=0"]
    for folder, _ in plan:  # a folder Hydra's override grammar reads unquoted
        OverridesParser.create().parse_overrides([f"hydra.sweep.subdir={folder}/trial_0"])


def test_a_configs_search_space_joins_the_sweeps_and_a_key_named_twice_is_refused():
    fixed, dims = parse_search_space(["logger=none", "train.lr=interval(0.1, 1)"])
    more_fixed, more = study_space.with_config_space({"algo.rank": "choice(4, 8)", "model.width": "8"}, fixed, dims)
    assert more_fixed == ["logger=none", "model.width=8"]
    assert [d.key for d in more] == ["train.lr", "algo.rank"] and more[1].choices == ("4", "8")
    with pytest.raises(UserError, match="name it once") as error:
        study_space.with_config_space({"train.lr": "interval(0.2, 2)"}, fixed, dims)
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="changes each trial's privacy event"):
        study_space.with_config_space({"train.batch_size": "choice(32, 64)"}, fixed, dims)


class _GridLauncher(_Launcher):
    """Writes each trial where its hydra.sweep.subdir says (a study's folder below the sweep's)."""

    def launch(self, batch, initial_job_idx):
        returns = []
        for overrides in batch:
            subdir = [o for o in overrides if o.startswith("hydra.sweep.subdir=")][0].split("=", 1)[1]
            self.calls.append((subdir, list(overrides)))
            folder = self.sweep_dir / subdir
            folder.mkdir(parents=True, exist_ok=True)
            results = {"status": "completed", "privacy": {"ledger": _ledger(1.0, 0.02, 5).as_records()}, "metrics": {}}
            (folder / "results.json").write_text(json.dumps(results))
            returns.append(types.SimpleNamespace(return_value=0.5))
        return returns


def test_a_grid_runs_one_independent_study_per_combination_and_repetition(tmp_path, monkeypatch):
    draws = iter([1, 2, 1, 3])
    monkeypatch.setattr(study_trials, "draw_trial_count", lambda mean, shape, rng=None: next(draws))
    launcher = _GridLauncher(tmp_path)
    index = _Sweeper(tmp_path, launcher, grid={"algo": "dpsgd,grape"}, studies=2,
                     keep_private=True)._sweep(["train.lr=interval(0.1, 1)"])
    folders = ["algo-dpsgd/study_0", "algo-dpsgd/study_1", "algo-grape/study_0", "algo-grape/study_1"]
    assert [s["folder"] for s in index] == folders
    assert len({s["study_id"] for s in index}) == 4  # each its own study, K and draws
    assert [_private_state(tmp_path / f)["trials"] for f in folders] == [1, 2, 1, 3]
    assert all((tmp_path / f / "study.json").is_file() for f in folders)
    assert sorted(subdir for subdir, _ in launcher.calls) == sorted(
        f"{f}/{publish.PRIVATE_DIR}/trial_{i}" for f, k in zip(folders, [1, 2, 1, 3]) for i in range(k))
    for subdir, overrides in launcher.calls:  # the combination is fixed for every trial of its study
        assert f"algo={subdir.split('/')[0].split('-', 1)[1]}" in overrides
    stored = json.loads((tmp_path / "studies.json").read_text())
    assert stored["studies_per_combination"] == 2 and "S x epsilon_study" in stored["note"]


def test_a_second_grid_into_the_same_folder_keeps_the_first_grids_studies_in_the_index(tmp_path, monkeypatch):
    """More seeds for some methods, swept later into the benchmark's folder: studies.json lists
    every study there, the redone combination once."""
    monkeypatch.setattr(study_trials, "draw_trial_count", lambda mean, shape, rng=None: 1)
    _Sweeper(tmp_path, _GridLauncher(tmp_path), grid={"algo": "dpsgd,grape", "seed": "0"},
             keep_private=True)._sweep(["train.lr=interval(0.1, 1)"])
    _Sweeper(tmp_path, _GridLauncher(tmp_path), grid={"algo": "grape", "seed": "0,1"},
             keep_private=True)._sweep(["train.lr=interval(0.1, 1)"])
    stored = json.loads((tmp_path / "studies.json").read_text())
    folders = [s["folder"] for s in stored["studies"]]
    assert sorted(folders) == ["algo-dpsgd_seed-0", "algo-grape_seed-0", "algo-grape_seed-1"]
    assert all(s["mean_trials"] == stored["mean_trials"] for s in stored["studies"])
    (tmp_path / "studies.json").write_text("{not json")
    with pytest.raises(UserError, match="studies.json is unreadable") as error:
        _Sweeper(tmp_path, _GridLauncher(tmp_path), grid={"algo": "grape", "seed": "2"},
                 keep_private=True)._sweep(["train.lr=interval(0.1, 1)"])
    assert "\n" not in str(error.value)


@pytest.mark.slow  # composes every method of each tuned preset (seconds): the fast tier stays under its 5 minutes
@pytest.mark.parametrize("preset, methods", [("bench_mini_tuned", 8), ("bench_vit_tuned", 8),
                                             ("bench_roberta_tuned", 6), ("bench_opt_tuned", 6)])
def test_tuned_presets_declare_a_space_for_every_method_they_tune(preset, methods):
    """Every method of a tuned preset's grid has a search space the sweeper accepts (no key that
    changes the privacy event), in budget mode, with a validation split."""
    from helpers.config import compose
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from dpbench.paths import config_dir
    from dpbench.schema import checked_composition

    with checked_composition(), initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        sweeper = hydra_compose("config", [f"experiment={preset}"], return_hydra_config=True).hydra.sweeper
    assert sweeper._target_.endswith("PrivateSearchSweeper") and sweeper.params is None
    assert sweeper.mean_trials == 4 and len(str(sweeper.grid.seed).split(",")) == 3
    names = sweeper.grid.algo.split(",")
    assert "adam" not in names and len(names) == methods
    for method in names:
        job = compose([f"experiment={preset}", f"algo={method}"])
        _, dims = study_space.with_config_space(job.search_space, [], [])
        assert "privacy.clip_norm" in {d.key for d in dims}, method
        assert job.dataset.validation_fraction == 0.2 and job.privacy.noise_multiplier is None
        assert job.privacy.log_private_stats is False  # a published benchmark holds no un-noised statistic
        assert job.report.compare_with == f"outputs/multirun/{preset.removesuffix('_tuned')}"


# ------------------------------------------------------------------ what the published files' times tell


class _TimedLauncher(_Launcher):
    """Each trial takes a simulated minute (its files get that time), scores its train.lr, and writes
    files from its overrides alone: the same drawn values write the same files in any study."""

    def __init__(self, sweep_dir: Path):
        super().__init__(sweep_dir)
        self.clock, self.first_launch_ns = None, None

    def launch(self, batch, initial_job_idx):
        import os
        import time

        self.first_launch_ns = self.first_launch_ns or time.time_ns()
        self.clock = self.clock or time.time_ns()
        returns = []
        for overrides in batch:
            subdir = [o for o in overrides if o.startswith("hydra.sweep.subdir=")][0].split("=", 1)[1]
            own = [o for o in overrides if not o.startswith("hydra.sweep.subdir=")]
            self.calls.append((subdir, own))
            folder = self.sweep_dir / subdir
            (folder / ".hydra").mkdir(parents=True, exist_ok=True)
            (folder / ".hydra" / "overrides.yaml").write_text("\n".join(own) + "\n")
            (folder / "results.json").write_text(json.dumps(
                {"status": "completed", "privacy": {"ledger": _ledger(1.0, 0.02, 5).as_records()}, "overrides": own}))
            self.clock += 60 * 10**9
            for path in [folder, *folder.rglob("*")]:
                os.utime(path, ns=(self.clock, self.clock))
            lr = next(o for o in own if o.startswith("train.lr="))
            returns.append(types.SimpleNamespace(return_value=float(lr.split("=", 1)[1])))
        return returns


def _published_tree(sweep_dir: Path) -> dict:
    """{path: (mtime against multirun.yaml's, size, bytes)} of every file and folder in the sweep folder."""
    reference = (sweep_dir / publish.SWEEP_CONFIG).stat().st_mtime_ns
    tree = {".": (sweep_dir.stat().st_mtime_ns - reference, None, None)}
    for path in sorted(sweep_dir.rglob("*")):
        stat = path.stat()
        tree[path.relative_to(sweep_dir).as_posix()] = (
            stat.st_mtime_ns - reference, *((stat.st_size, path.read_bytes()) if path.is_file() else (None, None)))
    return tree


def test_no_published_time_size_or_byte_depends_on_k(tmp_path, monkeypatch):
    """Two sweeps of two studies each, the same selected trial (train.lr=0.9) forced in every study,
    one with K = 1 and 2, the other with K = 4 and 3 (trials before and after the selected one, each
    a simulated minute): every published file and folder, studies.json and multirun.yaml included,
    has the same time, size and bytes in both, and that time is the sweep's start."""
    import dpbench.api
    import dpbench.study.sweep as sweep_module

    monkeypatch.setattr(sweep_module, "secrets", types.SimpleNamespace(token_hex=lambda n: "ab" * n))
    monkeypatch.setattr(dpbench.api, "evaluate_saved", lambda run_dir: {"metric": "accuracy", "accuracy": 0.5})
    trees = []
    for ks, draws in (((1, 2), [[0.9], [0.1, 0.9]]), ((4, 3), [[0.2, 0.3, 0.9, 0.1], [0.9, 0.4, 0.5]])):
        counts, values = iter(ks), iter(f"train.lr={lr}" for lrs in draws for lr in lrs)
        monkeypatch.setattr(study_trials, "draw_trial_count", lambda mean, shape, rng=None: next(counts))
        monkeypatch.setattr(sweep_module, "draw_values", lambda dimensions, rng: [next(values)])
        folder = tmp_path / f"k{sum(ks)}"
        folder.mkdir()
        monkeypatch.chdir(folder)  # multirun.yaml names the sweep folder: the same relative name in both
        launcher = _TimedLauncher(Path("sweep"))
        _Sweeper(Path("sweep"), launcher, studies=2)._sweep(["train.lr=interval(0.1, 1)"])
        assert len(launcher.calls) == sum(ks)
        sweep = folder / "sweep"
        assert (sweep / publish.SWEEP_CONFIG).stat().st_mtime_ns <= launcher.first_launch_ns  # the sweep's start
        trees.append(_published_tree(sweep))
    few, many = trees
    assert {"studies.json", "multirun.yaml", "study_0/study.json", "study_1/selected_trial/.hydra/overrides.yaml",
            "study_1/selected_trial/results.json"} <= set(few)
    assert few == many
    assert {time for time, _, _ in few.values()} == {0}


def test_a_later_sweep_into_the_folder_keeps_its_first_time(tmp_path, monkeypatch):
    """A resumed or later sweep restamps with the first sweep's time, so no two published times
    span a study's trials."""
    import os

    monkeypatch.setattr(study_trials, "draw_trial_count", lambda mean, shape, rng=None: 2)
    _Sweeper(tmp_path, _TimedLauncher(tmp_path), grid={"seed": "0"})._sweep(["train.lr=interval(0.1, 1)"])
    earlier = (tmp_path / publish.SWEEP_CONFIG).stat().st_mtime_ns - 3600 * 10**9  # as if it ran an hour ago
    publish.stamp_published(tmp_path, earlier)
    _Sweeper(tmp_path, _TimedLauncher(tmp_path), grid={"seed": "1"})._sweep(["train.lr=interval(0.1, 1)"])
    published = publish.published_paths(tmp_path)
    assert {p.relative_to(tmp_path).as_posix() for p in published} >= {
        "seed-0/study.json", "seed-1/selected_trial/results.json", "studies.json", "multirun.yaml"}
    assert {os.stat(p).st_mtime_ns for p in published} == {earlier}
