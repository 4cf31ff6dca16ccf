"""dpbench-audit: every private algorithm passes at its defaults; broken variants fail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, TINY, compose

from dpbench.algorithms import ALGORITHMS, import_all
from dpbench.algorithms.base import DPFirstOrderAlgorithm, ReleasePart
from dpbench.audit import run_audit

import_all()
# dplora needs a language model (its adapters target attention projections): audited in
# test_language-sized configs is out of scope here; every other private algorithm is covered.
PRIVATE = sorted(name for name in ALGORITHMS.names() if ALGORITHMS.get(name).private and name != "dplora")
AUDIT = ["audit.noise_steps=3", "audit.trials=3"]


@pytest.mark.parametrize("algo", PRIVATE)
def test_every_private_algorithm_passes_the_audit(algo, tmp_path):
    report = run_audit(compose(TINY + AUDIT + [f"algo={algo}"]), tmp_path)
    failed = [c for c in report["checks"] if not c["passed"]]
    assert not failed, failed
    kinds = {c["name"] for c in report["checks"]}
    assert kinds == {"noise", "sensitivity", "accounting"}
    assert json.loads((tmp_path / "audit.json").read_text())["passed"] is True


@pytest.mark.parametrize("variant", ["algo=dpadam algo.per_sample=ghost", "algo=dpadam algo.per_sample=bk",
                                     "algo=grape algo.per_sample=bk", "algo=dcdpsgd algo.budget_split=epsilon"])
def test_variants_pass_the_audit(variant, tmp_path):
    report = run_audit(compose(TINY + AUDIT + variant.split()), tmp_path)
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]


def test_audit_fails_when_the_noise_is_smaller_than_stated(tmp_path, monkeypatch):
    """A generator that draws half the stated std: the chi-square noise check catches it."""
    from dpbench.privacy.noise import GaussianNoise

    original = GaussianNoise.sample
    monkeypatch.setattr(GaussianNoise, "sample", lambda self, shape, std, dtype=None: original(self, shape, std / 2))
    report = run_audit(compose(TINY + AUDIT + ["algo=dpsgd"]), tmp_path)
    noise = [c for c in report["checks"] if c["name"] == "noise"]
    assert noise and not any(c["passed"] for c in noise)
    assert report["passed"] is False


def test_audit_fails_when_clipping_is_weaker_than_the_stated_sensitivity(tmp_path, monkeypatch):
    """A release that claims sensitivity C/2 for a sum clipped at C: the sensitivity check fails."""

    def understated(self, sums):
        p = self.privacy
        (noisy,) = self.gaussian_release("gradient", ReleasePart(sums, p.clip_norm / 2, p.noise_multiplier * p.clip_norm / 2))
        return [s / p.expected_batch_size for s in noisy]

    monkeypatch.setattr(DPFirstOrderAlgorithm, "privatize", understated)
    report = run_audit(compose(TINY + AUDIT + ["algo=dpsgd"]), tmp_path)
    sensitivity = [c for c in report["checks"] if c["name"] == "sensitivity"]
    assert sensitivity and sensitivity[0]["measured"] == pytest.approx(2.0, rel=1e-3)
    assert not report["passed"]


def test_audit_flags_the_unproven_tail_clip_model_under_a_tail_swap(tmp_path):
    cfg = compose(TINY + AUDIT + ["algo=dcdpsgd", "algo.gradient_sensitivity=tail_clip", "audit.trials=6"])
    report = run_audit(cfg, tmp_path)
    gradient = next(c for c in report["checks"] if c["name"] == "sensitivity" and c["release"] == "gradient")
    assert gradient["measured"] > 1.2  # the added example takes the tail: c1 + (c1 - c2) > c1
    assert not gradient["passed"]


def test_audit_flags_the_approximate_gdp_accountant(tmp_path):
    # the point: sigma 1.1, q 0.0445 (1139 examples, batch ~50.7), 40 steps: gdp 1.21 vs PLD 1.79
    cfg = compose(TINY + AUDIT + ["algo=dpsgd", "accountant=gdp", "privacy.noise_multiplier=1.1",
                                  "dataset.train_size=1139", "train.batch_size=51", "train.steps=40"])
    report = run_audit(cfg, tmp_path)
    accounting = next(c for c in report["checks"] if c["name"] == "accounting")
    assert accounting["measured"] < accounting["bound"] and not accounting["passed"]


def test_console_script_exit_codes(tmp_path):
    env = {"WANDB_MODE": "disabled", "PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}

    def audit(*args):
        return subprocess.run(
            [sys.executable, "-m", "dpbench.audit", *TINY, *AUDIT, f"hydra.run.dir={tmp_path / 'run'}", *args],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )

    quick = ["audit.trials=1", "audit.sensitivity_steps=1", "privacy.noise_multiplier=1.1"]
    passed = audit("algo=dpzero", *quick)
    assert passed.returncode == 0, passed.stderr[-2000:]
    assert "every check holds" in passed.stderr and (tmp_path / "run" / "audit.json").is_file()
    failed = audit("algo=dpsgd", "accountant=gdp", "train.steps=40", *quick)  # gdp under-reports
    assert failed.returncode == 1 and "FAIL" in failed.stderr
    refused = audit("algo=adam")
    assert refused.returncode == 2 and "not private" in refused.stderr
