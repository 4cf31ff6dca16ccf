"""The private validation score: one Gaussian release of the final model's validation count,
charged in the ledger and in calibration; selection returns it; test evaluation can be skipped
and done once afterwards on the saved model."""

import json
import math

import pytest
import torch
from helpers.cli import torchrun
from helpers.config import FIXED_SIGMA, TINY, compose

from dpbench.algorithms import algorithm_class
from dpbench.errors import UserError
from dpbench.logging.results import SCHEMA_VERSION, MetricsResults, PrivacyResults, RunResults
from dpbench.privacy.accountants import build_accountant
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.plan import COUNT_SENSITIVITY, plan_privacy, validation_mechanism
from dpbench.privacy.release import ReleasePart, gaussian_release

SPLIT = ["dataset.validation_fraction=0.2"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    return compose(TINY)


def _with(cfg, **values):
    from omegaconf import OmegaConf

    cfg = cfg.copy()
    for key, value in values.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_the_score_noise_has_std_sigma_v_and_is_the_planned_mechanism(relation):
    """Chi-square test of the noise the real release adds to a fake count (3 correct answers)."""
    from scipy import stats

    sigma_v, draws, noise = 10.0, 2000, GaussianNoise(CPU)
    ledger, values = Ledger(), []
    for _ in range(draws):
        part = ReleasePart([torch.tensor([3.0])], COUNT_SENSITIVITY[relation], sigma_v)
        (noisy,), mechanism = gaussian_release("validation score", [part], noise=noise, sample_rate=1.0,
                                               neighboring=relation)
        values.append(float(noisy[0]) - 3.0)
    statistic = sum(v * v for v in values) / sigma_v**2  # ~ chi2(draws) when the std is sigma_v
    assert stats.chi2.ppf(1e-4, draws) < statistic < stats.chi2.ppf(1 - 1e-4, draws)
    assert mechanism == validation_mechanism(sigma_v, relation)
    ledger.add_release(mechanism)
    # either relation: a Gaussian of std sigma_v at sensitivity 1 (replace-one's count moves by 1 too)
    epsilon = build_accountant("pld").epsilon(ledger, 1e-5)
    reference = build_accountant("pld").epsilon(_one(validation_mechanism(sigma_v, "add_remove")), 1e-5)
    assert epsilon == pytest.approx(reference, rel=2e-3)


def _one(mechanism) -> Ledger:
    ledger = Ledger()
    ledger.add_release(mechanism)
    return ledger


def _plan(base, steps=3, n=205, **values):
    cfg = _with(base, accountant__name="pld", **values)
    return plan_privacy(cfg, algorithm_class("dpsgd"), n, steps, CPU)


def test_the_ledger_charges_the_score_as_dp_accounting_composes_it(tiny):
    import dp_accounting as dpa

    with_split = _plan(tiny, privacy__noise_multiplier=1.0, dataset__validation_fraction=0.2)
    without = _plan(tiny, privacy__noise_multiplier=1.0)
    assert without.final_releases == () and len(with_split.final_releases) == 1
    epsilon = with_split.epsilon(with_split.planned_ledger(3, final=True))
    assert epsilon > without.epsilon(without.planned_ledger(3, final=True))
    # independently: 3 Poisson-subsampled Gaussians (sigma 1, q = 32/205) and one Gaussian of sigma_v
    accountant = dpa.pld.PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(dpa.ComposedDpEvent([
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(32 / 205, dpa.GaussianDpEvent(1.0)), 3),
        dpa.GaussianDpEvent(10.0)]))
    assert epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=5e-3)
    # the steps' plan (the trainer's per-step and resume checks) holds no final release
    assert len(with_split.planned_ledger(3)) == 3


@pytest.mark.parametrize("secure", [False, True])
def test_the_score_draws_from_the_runs_entropy_seeded_noise(tiny, secure):
    """The score's noise comes from the plan's one GaussianNoise (entropy-seeded, privacy.secure_rng
    honoured), the training noise's generator: never from one seeded by `seed`."""
    from types import SimpleNamespace

    from dpbench.privacy.validation import validation_score

    plan = _plan(tiny, privacy__noise_multiplier=1.0, dataset__validation_fraction=0.2, privacy__secure_rng=secure)
    assert plan.setup.noise.secure is secure
    drawn, sample = [], plan.setup.noise.sample
    plan.setup.noise.sample = lambda *args, **kwargs: drawn.append(args) or sample(*args, **kwargs)
    task = SimpleNamespace(split=SimpleNamespace(planned_validation_size=41), validation_scores=lambda model: torch.ones(41))
    scores = [validation_score(task, None, plan, None, None, CPU) for _ in range(2)]
    assert len(drawn) == 2 and scores[0] != scores[1]  # one draw each, from the run's own generator


@pytest.mark.slow  # calibration's bisection over the accountant: seconds
def test_calibration_with_a_split_meets_the_target_epsilon(tiny):
    plan = _plan(tiny, steps=20, privacy__epsilon=2.0, dataset__validation_fraction=0.2)
    plain = _plan(tiny, steps=20, privacy__epsilon=2.0)
    epsilon = plan.epsilon(plan.planned_ledger(20, final=True))
    assert 2.0 - 0.05 < epsilon <= 2.0
    assert plan.setup.noise_multiplier > plain.setup.noise_multiplier  # the score's share of the budget


def test_results_round_trip_the_new_keys_and_read_a_version_4_file(tmp_path):
    results = RunResults(status="completed", privacy=PrivacyResults(private=True, epsilon=1.0, validation_noise_multiplier=10.0),
                         metrics=MetricsResults(test_accuracy=0.5, validation_score=0.4, validation_size=51),
                         saved_model_test={"metric": "accuracy", "accuracy": 0.5})
    stored = results.to_json()
    assert stored["schema_version"] == SCHEMA_VERSION == 9
    assert stored["metrics"]["validation_score"] == 0.4 and stored["privacy"]["validation_noise_multiplier"] == 10.0
    assert RunResults.from_json(json.loads(json.dumps(stored))).to_json() == stored
    old = {"schema_version": 4, "status": "completed", "privacy": {"private": True, "epsilon": 1.0, "bound": "x"},
           "metrics": {"metric": "accuracy", "test_accuracy": 0.5}}
    read = RunResults.from_json(old)
    assert read.schema_version == 4 and read.metrics.validation_score is None and read.saved_model_test is None
    assert read.privacy.validation_noise_multiplier is None
    assert "validation_score" not in read.to_json()["metrics"] and "saved_model_test" not in read.to_json()


def test_selection_returns_the_validation_score_when_optimize_is_left_at_its_default(tiny):
    from dpbench.cli import objective

    results = RunResults(metrics=MetricsResults(test_accuracy=0.9, validation_score=0.7))
    assert objective(_with(tiny, dataset__validation_fraction=0.2), results) == 0.7
    assert objective(tiny, results) == 0.9
    assert objective(_with(tiny, dataset__validation_fraction=0.2, optimize="-test_accuracy"), results) == -0.9


@pytest.mark.parametrize("values", [{"optimize": "test_loss"}, {"optimize": "-test_loss", "dataset__validation_fraction": 0.2},
                                    {}])
def test_skipping_the_test_set_while_optimizing_a_test_metric_is_a_one_line_error(tiny, values):
    from dpbench.run_config import validate

    with pytest.raises(UserError, match="train.evaluate_test=false") as error:
        validate(_with(tiny, train__evaluate_test=False, **values))
    assert "\n" not in str(error.value)
    validate(_with(tiny, train__evaluate_test=False, dataset__validation_fraction=0.2))  # default optimize: validation


@pytest.mark.slow  # two tiny runs end to end: seconds
def test_without_test_evaluation_the_saved_model_is_evaluated_once_afterwards(tmp_path, monkeypatch):
    from dpbench.api import evaluate_saved
    from dpbench.run import run_job
    from dpbench.saved_model import MODEL_FILE
    from dpbench.tasks.image import ImageClassificationTask

    calls = []
    evaluate = ImageClassificationTask.evaluate
    monkeypatch.setattr(ImageClassificationTask, "evaluate", lambda self, model: calls.append(1) or evaluate(self, model))
    results = run_job(compose(TINY + FIXED_SIGMA + SPLIT + ["algo=dpsgd", "train.evaluate_test=false"]), tmp_path,
                      show_progress=False)
    assert calls == [] and results.history == [] and results.metrics.test_accuracy is None
    assert results.metrics.validation_score is not None and (tmp_path / MODEL_FILE).is_file()
    assert len(results.privacy.ledger) == 2  # the steps' mechanism and the score's
    metrics = evaluate_saved(tmp_path)
    assert calls == [1] and 0 <= metrics["accuracy"] <= 1
    assert json.loads((tmp_path / "results.json").read_text())["saved_model_test"] == metrics
    assert evaluate_saved(tmp_path) == metrics and calls == [1]  # asked again (a resumed study): not read again


@pytest.mark.slow  # a non-private run end to end
def test_a_non_private_run_reports_the_exact_validation_score(tmp_path):
    from dpbench.run import run_job

    results = run_job(compose(TINY + SPLIT + ["algo=adam"]), tmp_path, show_progress=False)
    size = results.metrics.validation_size
    assert size == 256 - math.floor(256 * 0.8 + 0.5)
    assert results.metrics.validation_score * size == pytest.approx(round(results.metrics.validation_score * size))
    assert results.privacy.validation_noise_multiplier is None


@pytest.mark.slow  # the console script in a fresh process
def test_the_cli_runs_with_a_validation_split(tmp_path):
    from helpers.cli import dpbench

    done = dpbench("dataset=synthetic", "dataset.validation_fraction=0.2", "logger=none", "train.batch_size=32",
                   "train.steps=3", "algo=dpsgd", "privacy.noise_multiplier=1.0", "hydra.run.dir=run", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    stored = json.loads((tmp_path / "run" / "results.json").read_text())
    assert stored["schema_version"] == SCHEMA_VERSION and stored["metrics"]["validation_size"] == 51
    assert stored["privacy"]["validation_noise_multiplier"] == 10.0
    assert sorted(r["sample_rate"] for r in stored["privacy"]["ledger"]) == pytest.approx([32 / 205, 1.0])


def test_a_non_finite_validation_record_counts_zero_and_never_halts_the_release():
    """A record whose score is NaN or inf (a diverged prediction) must not make the count
    non-finite: the release would halt on one record, which its sensitivity does not cover."""
    from dpbench.privacy.validation import validation_score
    from dpbench.run import setup

    job = setup(compose([*TINY, *FIXED_SIGMA, *SPLIT, "algo=dpsgd", "device=cpu"]))
    size = job.task.split.planned_validation_size
    job.task.validation_scores = lambda model: torch.tensor([float("nan"), float("inf"), 1.0, 0.0])
    ledger = job.privacy.new_ledger()
    score = validation_score(job.task, job.model, job.privacy, ledger.add_release, None, job.device)
    assert math.isfinite(score) and abs(score * size - 2.0) < 12 * job.privacy.validation_noise_multiplier
    assert len(ledger.as_records()) == 1  # charged once


@pytest.mark.slow  # starts processes
def test_under_torchrun_the_score_counts_every_validation_example_once(tmp_path):
    """Two gloo ranks each count their shard of the validation part; the release sums them (one
    noise draw): with the untrained model (no steps) and a negligible sigma_v, the score is one
    process's, and the ledger charges the score once."""
    job = ["dataset=synthetic", "dataset.validation_fraction=0.3", "algo=dpsgd", "train.steps=0", "train.batch_size=32",
           "privacy.validation_noise_multiplier=1e-6", "logger=none", "device=cpu"]
    scores, ledgers = {}, {}
    for world in (1, 2):
        done = torchrun(*job, f"hydra.run.dir=run{world}", cwd=tmp_path, world=world)
        assert done.returncode == 0, done.stderr[-3000:]
        results = json.loads((tmp_path / f"run{world}" / "results.json").read_text())
        assert results["throughput"]["world_size"] == world
        scores[world], ledgers[world] = results["metrics"]["validation_score"], results["privacy"]["ledger"]
    assert scores[2] == pytest.approx(scores[1], abs=1e-5) and 0 < scores[1] < 1
    assert ledgers[2] == ledgers[1] and [r["count"] for r in ledgers[2]] == [1]


# ------------------------------------------------------------------ parallel composition (add/remove)


PARALLEL = {"dataset__validation_fraction": 0.2, "privacy__validation_composition": "parallel"}


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_parallel_composition_reports_the_larger_of_the_two_parts(tiny, accountant):
    """Training reads the training part, the score the validation part; an added or removed record
    is in one of them: epsilon = max(training's, the score's), each by the run's accountant."""
    plan = plan_privacy(_with(tiny, accountant__name=accountant, privacy__noise_multiplier=1.0, **PARALLEL),
                     algorithm_class("dpsgd"), 205, 3, CPU)
    sequential = plan_privacy(_with(tiny, accountant__name=accountant, privacy__noise_multiplier=1.0,
                                    dataset__validation_fraction=0.2), algorithm_class("dpsgd"), 205, 3, CPU)
    full = plan.planned_ledger(3, final=True)
    training, score = build_accountant(accountant).epsilon(plan.planned_ledger(3), 1e-5), \
        build_accountant(accountant).epsilon(_one(plan.final_releases[0]), 1e-5)
    assert plan.epsilon(full) == pytest.approx(max(training, score), rel=1e-12)
    assert plan.epsilon(full) < sequential.epsilon(full)
    assert plan.results(full, 3, 3).validation_composition == "parallel"
    assert sequential.results(full, 3, 3).validation_composition == "sequential"


def test_parallel_composition_in_a_study_is_the_pointwise_maximum_of_the_rdp_curves():
    import dp_accounting as dpa
    import numpy as np
    from dp_accounting import dp_event

    from dpbench import study

    ledger = Ledger()
    ledger.add(GaussianMechanism(1.0, 0.1, "add_remove"), 40)
    event = study.parallel_trial_event(ledger, 12.0)
    orders = np.array(dpa.rdp.rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    training = dpa.rdp.RdpAccountant(orders).compose(
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(1.0)), 40)).rdp
    np.testing.assert_allclose(study.rdp_curve(event), np.maximum(training, orders / (2 * 12.0**2)), rtol=1e-12)
    # the curve path of a study (dp-accounting's repeat-and-select transform) is RepeatAndSelectDpEvent's
    plain = study.trial_event(ledger)
    via_curve = study.study_epsilon(study.ParallelEvent((plain,)), 4, 1, 1e-5)
    direct = dpa.rdp.RdpAccountant().compose(dp_event.RepeatAndSelectDpEvent(plain, 4.0, 1.0)).get_epsilon(1e-5)
    assert via_curve == pytest.approx(direct, rel=1e-9)
    sequential = study.study_epsilon(study.trial_event(ledger, 12.0), 4, 1, 1e-5)
    assert study.study_epsilon(plain, 4, 1, 1e-5) <= study.study_epsilon(event, 4, 1, 1e-5) < sequential
    assert study.naive_epsilon(event, 3, 1e-5) == pytest.approx(
        dpa.rdp.rdp_privacy_accountant.compute_epsilon(orders, 3 * study.rdp_curve(event), 1e-5)[0])


@pytest.mark.slow  # calibration's bisection over the accountant: seconds
def test_parallel_calibration_gives_training_the_whole_budget(tiny):
    parallel = _plan(tiny, steps=20, privacy__epsilon=2.0, **PARALLEL)
    sequential = _plan(tiny, steps=20, privacy__epsilon=2.0, dataset__validation_fraction=0.2)
    epsilon = parallel.epsilon(parallel.planned_ledger(20, final=True))
    assert 2.0 - 0.05 < epsilon <= 2.0
    assert parallel.setup.noise_multiplier < sequential.setup.noise_multiplier


def test_parallel_composition_is_refused_under_replace_one_and_when_the_score_alone_exceeds_the_target(tiny):
    from dpbench.run_config import validate

    with pytest.raises(UserError, match="neighboring=add_remove") as error:
        validate(_with(tiny, privacy__neighboring="replace_one", **PARALLEL))
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="validation score alone") as error:
        _plan(tiny, privacy__epsilon=0.1, privacy__validation_noise_multiplier=1.0, **PARALLEL)
    assert "\n" not in str(error.value)


def test_the_audits_accounting_check_reads_a_parallel_score_as_its_own_part(tiny):
    """dpbench-audit's independent dp-accounting figure follows the composition the run states:
    with the score in parallel it is the larger part's epsilon, and the reported one passes."""
    import types

    from dpbench.tools.audit.accounting import accounting_check

    for composition, passes in (("parallel", True), ("sequential", True)):
        plan = _plan(tiny, steps=3, privacy__noise_multiplier=1.0, dataset__validation_fraction=0.2,
                     privacy__validation_composition=composition)
        (check,) = accounting_check(types.SimpleNamespace(privacy=plan, steps=3))
        assert check.passed is passes and check.measured == pytest.approx(plan.epsilon(plan.planned_ledger(3, final=True)))
    parallel = _plan(tiny, steps=3, privacy__noise_multiplier=1.0, **PARALLEL)
    parallel.parallel_final = False  # a plan that claims sequential composition but ...
    parallel.epsilon = lambda ledger: build_accountant("pld").epsilon(ledger, 1e-5) / 2  # ... under-reports
    (check,) = accounting_check(types.SimpleNamespace(privacy=parallel, steps=3))
    assert not check.passed
