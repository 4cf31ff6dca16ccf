"""dpbench-audit's seeded bugs (dpbench/tools/seeded_bugs.py): each broken mechanism is caught by
the check it names, the sound variant passes every check, and a clean run passes the new checks
(release → update, sampler, noise across runs, total noise over >= 4 physical chunks)."""

from __future__ import annotations

import json

import pytest
from helpers.cli import console_script_in_process
from helpers.config import compose

from dpbench.tools.audit import run_audit, sampler_check
from dpbench.tools.audit_report import CHECK_ORDER, UPDATE
from dpbench.tools.seeded_bugs import CATALOGUE, CATALOGUE_DEFAULTS, run_bug

# the fast tier (about a second an audit): DPZero's quadratic (a 64-vector model), 2 noise steps and
# one neighbour pair (the bugs below are not about sensitivity)
QUICK = CATALOGUE_DEFAULTS + ["dataset=quadratic", "model=quadratic", "dataset.dimension=64", "dataset.train_size=512",
                              "dataset.test_size=64", "audit.noise_steps=2", "audit.trials=1", "audit.sensitivity_steps=1",
                              "train.steps=2"]


def rows(report, name: str) -> list:
    return [c for c in report.checks if c.name == name]


def test_unnoised_update_is_caught_by_release_to_update(tmp_path):
    report, result = run_bug(compose(QUICK), "unnoised_update", tmp_path)
    (update,) = rows(report, UPDATE)
    assert result.caught and result.ok and not update.passed
    assert update.measured > 0.1 and update.bound == pytest.approx(1e-4)
    assert all(c.passed for c in rows(report, "noise") + rows(report, "sampler"))


def test_the_sound_chunk_noise_passes_and_clean_checks_hold(tmp_path):
    """std sigma C / sqrt(k) in each of k >= 4 chunks: the step's total noise is the planned one,
    and every check (the new ones included) holds."""
    report, result = run_bug(compose(QUICK), "chunk_noise_over_sqrt_chunks", tmp_path)
    assert result.sound and result.ok and report.passed, [c for c in report.checks if not c.passed]
    assert set(CHECK_ORDER) == {c.name for c in report.checks}
    (noise,) = rows(report, "noise")
    assert "total noise" in noise.detail and "4..5 physical chunks" in noise.detail
    (update,) = rows(report, UPDATE)
    assert update.measured < 1e-5 and "parameter change" in update.detail


def test_shuffled_batches_accounted_as_poisson_fail_the_sampler_check():
    cfg = compose(QUICK)
    from dpbench.run import setup

    job = setup(cfg)
    clean = sampler_check(cfg, job)
    assert all(c.passed for c in clean), clean
    with CATALOGUE["shuffle_as_poisson"].patch(cfg):
        broken = sampler_check(cfg, job)
    sizes = next(c for c in broken if c.release.startswith("batch sizes"))
    assert not sizes.passed and sizes.measured == 0.0


@pytest.mark.slow  # one audit per bug (about a minute in all)
@pytest.mark.parametrize("name", list(CATALOGUE))
def test_every_seeded_bug_is_caught_by_its_check(name, tmp_path):
    report, result = run_bug(compose(CATALOGUE_DEFAULTS), name, tmp_path)
    assert result.ok, (result, [c for c in report.checks if not c.passed])
    if CATALOGUE[name].sound:
        assert report.passed
    else:
        assert any(not c.passed for c in rows(report, CATALOGUE[name].check))


@pytest.mark.slow
def test_a_clean_run_passes_the_new_checks(tmp_path):
    report = run_audit(compose(CATALOGUE_DEFAULTS), tmp_path)
    assert report.passed, [c for c in report.checks if not c.passed]
    assert {c.name for c in report.checks} == set(CHECK_ORDER)


@pytest.mark.slow
def test_the_console_script_runs_the_catalogue(tmp_path):
    from dpbench.tools.audit_cli import main

    def audit(*args):
        return console_script_in_process(main, "dpbench-audit", f"hydra.run.dir={tmp_path / 'run'}", *args, cwd=tmp_path)

    one = audit("audit.seeded_bug=noise_half", "audit.trials=1", "audit.sensitivity_steps=1")
    assert one.returncode == 0, one.stderr[-2000:]
    assert "caught" in one.stderr and "every seeded bug is caught" in one.stderr
    unknown = audit("audit.seeded_bug=no_such_bug")
    assert unknown.returncode == 2 and "is not known" in unknown.stderr
    every = audit("audit.seeded_bug=all", "audit.trials=1")
    assert every.returncode == 0, every.stderr[-3000:]
    stored = json.loads((tmp_path / "run" / "seeded_bugs.json").read_text())
    assert [r["bug"] for r in stored] == list(CATALOGUE) and all(r["ok"] for r in stored)
