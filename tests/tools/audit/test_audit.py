"""dpbench-audit: every private algorithm passes at its defaults, in every precision, engine and
physical batching; broken mechanisms (noise, its independence, the plan, clipping, accounting) fail."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.cli import console_script_in_process
from helpers.config import TINY, compose

from dpbench.algorithms import ALGORITHMS, import_all
from dpbench.algorithms.base import ReleasePart
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm
from dpbench.algorithms.dpsgd import DPSGD
from dpbench.errors import UserError
from dpbench.privacy.mechanisms import GaussianMechanism
from dpbench.tools.audit.runner import run_audit
from dpbench.tools.audit.report import CHECK_ORDER

import_all()
# dplora needs a language model (its adapters target attention projections): audited in
# test_language-sized configs is out of scope here; every other private algorithm is covered.
PRIVATE = sorted(name for name in ALGORITHMS.names() if ALGORITHMS.get(name).private and name != "dplora")
# alpha 1e-6 (z ~ 4.9): ~100 statistical checks in this file stay clear of chance failures, while
# the broken mechanisms below miss their bounds by far more (a correlation of 1 against ~0.02)
AUDIT = ["audit.noise_steps=3", "audit.trials=3", "audit.alpha=1e-6"]


@pytest.mark.slow  # an end-to-end audit per algorithm (the slow tier)
@pytest.mark.parametrize("algo", PRIVATE)
def test_every_private_algorithm_passes_the_audit(algo, tmp_path):
    report = run_audit(compose(TINY + AUDIT + [f"algo={algo}"]), tmp_path)
    failed = [c for c in report.checks if not c.passed]
    assert not failed, failed
    assert [c.name for c in report.checks] == sorted((c.name for c in report.checks), key=CHECK_ORDER.index)
    assert set(CHECK_ORDER) == {c.name for c in report.checks}
    stored = json.loads((tmp_path / "audit.json").read_text())
    assert stored["passed"] is True and len(stored["checks"]) == len(report.checks)


def failed(report) -> list:
    return [c for c in report.checks if not c.passed]


def checks(report, name: str, release: str | None = None) -> list:
    return [c for c in report.checks if c.name == name and (release is None or c.release == release)]


@pytest.mark.parametrize("variant", [
    "algo=dpadam algo.per_sample=ghost", "algo=dpadam algo.per_sample=bk", "algo=grape algo.per_sample=bk",
    "algo=dcdpsgd algo.budget_split=epsilon",
    # any run's overrides: precision (fp16 needs materialize: ghost/bk + fp16 are refused), physical batches
    "algo=dpsgd train.precision=bf16", "algo=dpadam algo.per_sample=bk train.precision=bf16",
    "algo=dpsgd train.precision=fp16", "algo=grape train.precision=fp16 train.physical_batch_size=3",
    "algo=dpsgd train.physical_batch_size=3", "algo=dpadam algo.per_sample=ghost train.physical_batch_size=3",
    "algo=dpadam algo.per_sample=bk train.physical_batch_size=3",
    "algo=dpadam algo.per_sample=ghost train.precision=bf16",  # failed when ghost summed in bf16
    # privacy.clipping=per_layer in the engines that take per-layer norms from pieces (materialize:
    # tests/privacy/test_per_layer_clipping.py)
    "algo=dpsgd algo.per_sample=ghost privacy.clipping=per_layer",
    "algo=grape algo.per_sample=bk privacy.clipping=per_layer privacy.per_layer_thresholds=init_norm",
])
@pytest.mark.slow  # end-to-end audits (the slow tier)
def test_variants_pass_the_audit(variant, tmp_path):
    report = run_audit(compose(TINY + AUDIT + variant.split()), tmp_path)
    assert report.passed, failed(report)


@pytest.mark.slow  # an end-to-end sweep: the slow tier
def test_fp16_audit_scales_losses_within_fp16_range(tmp_path):
    """audit.loss_scale=1e4 overflows fp16 (x 1024 in the backward): the audit lowers it, and still
    clips every example (the largest change is the full stated sensitivity)."""
    report = run_audit(compose(TINY + AUDIT + ["algo=dpsgd", "train.precision=fp16"]), tmp_path)
    (sensitivity,) = checks(report, "sensitivity", "gradient")
    assert sensitivity.passed and sensitivity.measured == pytest.approx(1.0, rel=1e-3)
    assert "fp16 gradients stay in range" in sensitivity.detail


def test_fp16_with_ghost_is_refused_as_in_a_run(tmp_path):
    with pytest.raises(UserError, match="needs algo.per_sample=materialize"):
        run_audit(compose(TINY + AUDIT + ["algo=dpsgd", "algo.per_sample=ghost", "train.precision=fp16"]), tmp_path)


def test_one_noise_step_is_refused(tmp_path):
    with pytest.raises(UserError, match="audit.noise_steps=1 must be at least 2"):
        run_audit(compose(TINY + ["audit.noise_steps=1", "algo=dpsgd"]), tmp_path)


@pytest.mark.slow  # an audit (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_audit_fails_when_the_noise_is_smaller_than_stated(tmp_path, monkeypatch):
    """A generator that draws half the stated std: the chi-square noise check catches it."""
    from dpbench.privacy.noise import GaussianNoise

    original = GaussianNoise.sample
    monkeypatch.setattr(GaussianNoise, "sample", lambda self, shape, std, dtype=None: original(self, shape, std / 2))
    report = run_audit(compose(TINY + AUDIT + ["algo=dpsgd"]), tmp_path)
    noise = checks(report, "noise")
    assert noise and not any(c.passed for c in noise)
    assert report.passed is False


@pytest.mark.slow  # an audit (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_audit_fails_when_every_step_adds_the_same_noise(tmp_path, monkeypatch):
    """Right std, but one noise vector reused every step: independence across steps fails (the
    chi-square may too: a repeated vector is not 3 independent draws)."""
    from dpbench.privacy.noise import GaussianNoise

    original, drawn = GaussianNoise.sample, {}

    def repeated(self, shape, std, dtype=torch.float32):
        key = (self, tuple(shape), std)  # the object, not its id: a collected job's id can be reused
        if key not in drawn:
            drawn[key] = original(self, shape, std, dtype)
        return drawn[key].clone()

    monkeypatch.setattr(GaussianNoise, "sample", repeated)
    report = run_audit(compose(TINY + AUDIT + ["algo=dpsgd"]), tmp_path)
    (steps,) = checks(report, "independence", "gradient across steps")
    assert not steps.passed and steps.measured == pytest.approx(1.0) and steps.bound < 0.05
    # (not "across jobs": with one vector repeated per job, its 3 steps count as 3n coordinate pairs
    # where only n are independent, so that check's bound is sqrt(3) too tight here)
    others = checks(report, "sensitivity")
    assert all(c.passed for c in others), [c for c in others if not c.passed]


@pytest.mark.slow  # an audit (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_audit_fails_when_the_noise_generator_is_seeded_from_the_seed(tmp_path, monkeypatch):
    """Two fresh jobs of one config draw the same noise: independence across jobs fails."""
    monkeypatch.setattr("dpbench.privacy.noise.entropy_seed", lambda: torch.initial_seed())  # = cfg.seed
    report = run_audit(compose(TINY + AUDIT + ["algo=dpsgd"]), tmp_path)
    (jobs,) = checks(report, "noise across runs", "gradient")
    assert not jobs.passed and jobs.measured == pytest.approx(1.0) and "z/sqrt(n)" in jobs.detail
    assert all(c.passed for c in checks(report, "independence", "gradient across steps") + checks(report, "sensitivity"))


class PlanClaimsTwiceTheNoise(DPSGD):
    """Draws sigma C (gradient_noise_std) but plans, so reports, a 2 sigma mechanism."""

    @classmethod
    def planned_mechanisms(cls, cfg, noise_multiplier, sample_rate, step, clip_norm):
        return [GaussianMechanism(2 * noise_multiplier, sample_rate)]


class DrawsTwiceThePlannedNoise(DPSGD):
    """Plans sigma but releases with std 2 sigma C (the reverse mismatch: epsilon is not that of the run)."""

    def gradient_noise_std(self) -> float:
        return 2 * super().gradient_noise_std()


@pytest.mark.slow  # an audit (or a trace) of seconds: the fast tier stays under its 5 minutes
@pytest.mark.parametrize("broken, ratio", [(PlanClaimsTwiceTheNoise, 0.5), (DrawsTwiceThePlannedNoise, 2.0)])
def test_audit_compares_the_drawn_noise_with_the_plan(broken, ratio, tmp_path, monkeypatch):
    """The noise drawn is tested against the plan's multiplier x sensitivity, not the algorithm's own std."""
    monkeypatch.setitem(ALGORITHMS._entries, "dpsgd", broken)  # registered only in this test
    report = run_audit(compose(TINY + AUDIT + ["algo=dpsgd"]), tmp_path)
    # one row per tensor of >= 256 entries (>= 1,536 draws: the std ratio's sd is <= 1.8%, so 10% is 5.5 sd) and
    # one pooling the smaller ones
    noise = checks(report, "noise")
    assert len(noise) > 1 and all(not c.passed and c.measured == pytest.approx(ratio, rel=0.1) for c in noise), noise
    (ledger,) = checks(report, "accounting", "ledger vs plan")
    assert not ledger.passed and "its plan" in ledger.detail
    assert all(c.passed for c in checks(report, "sensitivity") + checks(report, "independence"))


@pytest.mark.slow  # an audit (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_audit_fails_when_clipping_is_weaker_than_the_stated_sensitivity(tmp_path, monkeypatch):
    """A release that claims sensitivity C/2 for a sum clipped at C: the sensitivity check fails."""

    def understated(self, sums):
        p = self.privacy
        (noisy,) = self.gaussian_release("gradient", ReleasePart(sums, p.clip_norm / 2, p.noise_multiplier * p.clip_norm / 2))
        return [s / p.expected_batch_size for s in noisy]

    monkeypatch.setattr(DPFirstOrderAlgorithm, "privatize", understated)
    report = run_audit(compose(TINY + AUDIT + ["algo=dpsgd"]), tmp_path)
    sensitivity = checks(report, "sensitivity")
    assert sensitivity and sensitivity[0].measured == pytest.approx(2.0, rel=1e-3)
    assert not report.passed


@pytest.mark.slow  # six neighbour pairs per step (the slow tier)
def test_audit_flags_the_unproven_tail_clip_model_under_a_tail_swap(tmp_path):
    cfg = compose(TINY + AUDIT + ["algo=dcdpsgd", "algo.tail_selection=rank", "algo.gradient_sensitivity=tail_clip",
                                  "audit.trials=6", "privacy.noise_multiplier=1.0"])  # no calibration: sensitivity only
    report = run_audit(cfg, tmp_path)
    (gradient,) = checks(report, "sensitivity", "gradient")
    assert gradient.measured > 1.2  # the added example takes the tail: c1 + (c1 - c2) > c1
    assert not gradient.passed


@pytest.mark.slow  # an audit (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_audit_flags_the_approximate_gdp_accountant(tmp_path):
    # the point: sigma 1.1, q 0.0445 (1139 examples, batch ~50.7), 40 steps: gdp 1.21 vs PLD 1.79
    cfg = compose(TINY + AUDIT + ["algo=dpsgd", "accountant=gdp", "privacy.noise_multiplier=1.1",
                                  "dataset.train_size=1139", "train.batch_size=51", "train.steps=40"])
    report = run_audit(cfg, tmp_path)
    (accounting,) = checks(report, "accounting", "40 planned steps")
    assert accounting.measured < accounting.bound and not accounting.passed


@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
def test_console_script_exit_codes(tmp_path):
    from dpbench.tools.audit.cli import main

    def audit(*args):
        return console_script_in_process(main, "dpbench-audit", *TINY, *AUDIT, f"hydra.run.dir={tmp_path / 'run'}",
                                         *args, cwd=tmp_path)

    quick = ["audit.trials=1", "audit.sensitivity_steps=1", "privacy.noise_multiplier=1.1"]
    passed = audit("algo=dpzero", *quick)
    assert passed.returncode == 0, passed.stderr[-2000:]
    assert "every check holds" in passed.stderr and (tmp_path / "run" / "audit.json").is_file()
    failed = audit("algo=dpsgd", "accountant=gdp", "train.steps=40", *quick)  # gdp under-reports
    assert failed.returncode == 1 and "FAIL" in failed.stderr
    refused = audit("algo=adam")
    assert refused.returncode == 2 and "not private" in refused.stderr


def test_audit_fails_a_step_charged_as_two_independent_mechanisms(tmp_path, monkeypatch):
    """DC-DPSGD's histogram and gradient read one Poisson batch: planning them as two independently
    subsampled mechanisms (the old charge, 8 reported for 13.5 true at dcdpsgd_mnist) is refused."""
    from dpbench.algorithms import dcdpsgd

    def two_mechanisms(cls, cfg, noise_multiplier, sample_rate, step, clip_norm, derived=None):
        sigma_tr, sigma_dp = dcdpsgd.noise_multipliers(cfg, noise_multiplier, derived)
        return [dcdpsgd.score_mechanism(sigma_tr, sample_rate),
                dcdpsgd.gradient_mechanism(cfg, sigma_dp, sample_rate, clip_norm)]

    monkeypatch.setattr(dcdpsgd.DCDPSGD, "planned_mechanisms", classmethod(two_mechanisms))
    for fixed in ([], ["privacy.noise_multiplier=1.0"]):  # calibrated, and sigma given
        report = run_audit(compose(TINY + AUDIT + ["algo=dcdpsgd", "algo.subspace_dim=8", *fixed]), tmp_path)
        (check,) = checks(report, "accounting", "one mechanism per sampled batch")
        assert not check.passed and not report.passed
    assert json.loads((tmp_path / "audit.json").read_text())["passed"] is False


@pytest.mark.slow  # a run (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_audit_fails_when_a_nan_record_halts_dpdr(tmp_path, monkeypatch):
    """The old DPDR clipped alpha by multiplying with the clip factor: 0 * NaN is NaN, the release is
    NaN and the run halts on one record. The sensitivity check adds such a record."""
    from dpbench.algorithms import dpdr
    from dpbench.privacy.clipping import clip_factors

    from dpbench.privacy.layout import layout_verdicts_reused
    from dpbench.tools.audit.sensitivity import sensitivity_check

    monkeypatch.setattr(dpdr, "clip_alpha", lambda alpha, clip, keep=None: alpha * clip_factors(alpha.norm(dim=1), clip)[:, None])
    # the sensitivity rows alone (what catches it); whole audits of DPDR run in the slow tier
    cfg = compose(TINY + AUDIT + ["algo=dpdr", "privacy.noise_multiplier=1.0", "audit.sensitivity_steps=2"])
    with layout_verdicts_reused():  # as run_audit builds its jobs
        (nonfinite,) = [c for c in sensitivity_check(cfg) if c.release == "a non-finite record"]
        assert not nonfinite.passed and "step 1" in nonfinite.detail
        monkeypatch.undo()
        assert all(c.passed for c in sensitivity_check(cfg))


def test_the_harness_observes_through_declared_hooks_and_patches_nothing():
    """The self-audit reads each chunk's clipped sums through the engine's `sum_observer` and the
    optimizer's input and effect through torch's step hooks: no method of the instance is replaced."""
    from dpbench.tools.audit.harness import audited_job

    job, recorder = audited_job(compose(TINY + ["algo=dpsgd", "privacy.noise_multiplier=1.0"]), zero_noise=False)
    algorithm = job.algorithm
    assert recorder.phases and algorithm.engine.sum_observer is not None
    assert "clipped_sum" not in vars(algorithm.engine) and "step" not in vars(algorithm.optimizer)
    assert len(algorithm.optimizer._optimizer_step_pre_hooks) == len(algorithm.optimizer._optimizer_step_post_hooks) == 1
