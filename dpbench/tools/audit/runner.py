"""`dpbench-audit`: an empirical self-check of a private algorithm's privacy claims.

    dpbench-audit algo=grape model=cnn        # same config and overrides as `dpbench`

It runs the algorithm as a run builds it (`dpbench.run.setup`: train.precision, algo.per_sample,
train.physical_batch_size and every other override apply) and observes every noisy release
through `Algorithm.gaussian_release`. The checks compare what ran with what the run's PLAN
declares (the mechanisms `planned(step)` the accountant composes into the reported epsilon), never
only with what the algorithm says it drew:

  noise         in two fresh jobs, the noise each release actually added has, step by step, the
                std the plan declares for that step and release: the planned noise multiplier x the
                release's stated sensitivity (two-sided chi-square test). Each audited step has >= 4
                physical chunks, and where the algorithm runs DPFirstOrderAlgorithm's phases the
                noise is the step's TOTAL (the release minus the clipped sums the engine formed,
                chunk by chunk), else the release's noisy - noiseless;
  noise precision  the residuals release - value of those releases, in the release's fp32: at most 1%
                of the informative ones exactly representable in bf16 or fp16 (noise rounded to a
                narrow format before it is added lies on its grid; audit/precision.py);
  noise across runs  the two fresh jobs (same config, same seed) draw different noise: the pooled
                correlation of their noise at the same step is within z / sqrt(n) of 0;
  independence  that noise is independent across steps: the pooled correlation of the
                (plan-normalised) noise of steps t and t+lag is within z / sqrt(n) of 0 for n
                coordinate pairs (z: the normal quantile at audit.alpha, Bonferroni-corrected over
                the lags); noise repeated every step fails;
  sensitivity   with the noise off, neighbouring batches (one example added, removed or replaced;
                every loss scaled up so that every example is clipped, the neighbour's gradient
                pointing either way) move each released quantity by at most the sensitivity the
                ledger assumes (2x for a replacement); for DC-DPSGD the added example can take the
                tail from another one; an added record whose loss is NaN never halts a step; an
                added copy of an example, against it, outweighing the whole batch (clipping the sum
                instead of each example moves it by up to 2x);
  two-step sensitivity  for an algorithm that declares `release_carries_state` (DC-DPSGD's threshold,
                DPDR's basis): a record at step t only, step t's release held fixed, step t+1's
                noiseless release must not move (audit/two_step.py);
  release → update  at every audited step of the noise check, the optimizer's input is the recorded
                noisy release / the expected batch size (public post-processing only), and for a
                plain SGD the parameter change is -lr x it (for the algorithms that declare
                `runs_stock_phases`; "not applicable" for those that override them); and, for every
                algorithm, no model buffer changes during a step (no dpbench algorithm writes a
                buffer from its release, so a change is un-noised batch data in the model:
                BatchNorm's running statistics);
  validation score  with a validation split: a training record leaves the final score's noiseless
                count where it was under parallel composition (<= 1 under sequential), a validation
                record moves it by <= 1, and its noise has the planned std (audit/validation.py);
  sampler       the run's sampler, built as the run builds it: Poisson sizes ~ Binomial(n, q) and
                independent inclusions across steps where Poisson is accounted (shuffled: batches
                of B, disjoint within an epoch), and two fresh samplers of one seed draw differently;
  accounting    a step's releases (which read one sampled batch) are planned as ONE mechanism; every
                audited step's ledger entries (the mechanisms derived from the released std
                and stated sensitivity) are its planned ones (the trainer's per-step check), and
                the planned ledger's epsilon, recomputed with Google's dp-accounting (RDP and PLD)
                apart from the configured accountant, is not above the epsilon the run reports.

The statistical checks (noise, independence, noise across runs, sampler) are one family: each of
its k tests passes when its p-value is above audit.alpha / k (Bonferroni, `family_corrected`), so
a clean run fails one of them with probability at most audit.alpha.

Where each lives: audit/harness.py (the jobs, the recorder of releases, the neighbours),
audit/noise.py (noise, independence, noise across runs), audit/precision.py, audit/sensitivity.py,
audit/two_step.py, audit/update.py (release → update, buffers), audit/validation.py,
audit/sampler.py, audit/accounting.py; this module runs them. audit/margins.py measures how often
the catalogue's statistical rows miss.

Prints a table, writes audit.json in the run folder, exits 0 when every check holds, else 1.
`audit.seeded_bug=NAME|all` runs the audit under seeded bugs instead (dpbench/tools/audit/seeded_bugs.py).
The sensitivity check turns dropout layers off so that the two neighbouring runs differ only in
the neighbour; the per-example clipping of recomputed gradients under dropout is covered by the
test suite. Under train.precision=fp16 it scales the losses only as far as fp16's range allows
(see `sensitivity_check`).
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from dpbench.errors import UserError
from dpbench.privacy.mechanisms import SeveralMechanismsPerBatchError
from dpbench.tools.audit.accounting import accounting_check, several_mechanisms_check
from dpbench.tools.audit.harness import audited_job
from dpbench.tools.audit.noise import noise_check
from dpbench.tools.audit.report import CHECK_ORDER, AuditReport, family_corrected
from dpbench.tools.audit.sampler import sampler_check
from dpbench.tools.audit.sensitivity import sensitivity_check
from dpbench.tools.audit.two_step import two_step_checks
from dpbench.tools.audit.validation import validation_checks
from dpbench.tools.audit.one_run import one_run_audit


def check_audit_options(audit) -> None:
    """The self-audit's own settings, before any work: an audit of zero trials or steps would pass
    having checked nothing, and a significance outside (0, 1) fails or passes everything."""
    for key, least in (("batch", 1), ("trials", 1), ("sensitivity_steps", 1), ("noise_steps", 2)):
        if int(audit[key]) < least:
            raise UserError(f"audit.{key}={audit[key]} must be at least {least}"
                            + (" (independence compares steps); raise it" if key == "noise_steps" else ""))
    if not 0 < float(audit.alpha) < 1:
        raise UserError(f"audit.alpha={audit.alpha} must lie strictly between 0 and 1 (the false-alarm rate), e.g. 1e-3")
    if not float(audit.loss_scale) > 0:
        raise UserError(f"audit.loss_scale={audit.loss_scale} must be positive")


def run_audit(cfg, run_dir: Path) -> AuditReport:
    """Run every check (with audit.one_run, the one-run canary audit instead); write audit.json; return
    the report (`passed` says whether all checks held)."""
    if cfg.audit.get("one_run", False):  # a lower bound on epsilon from one run with canaries (dpbench/tools/audit/one_run.py)
        return _written(one_run_audit(cfg), run_dir)
    check_audit_options(cfg.audit)
    import logging
    import warnings

    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
        try:
            job, _ = audited_job(cfg, zero_noise=False)  # calibrates sigma (if asked to) once
        except SeveralMechanismsPerBatchError as error:  # calibration composed the plan's ledger
            return _written(AuditReport(cfg.algo.name, cfg.model.name, cfg.dataset.name,
                                        [several_mechanisms_check(error)]), run_dir)
        accounting = accounting_check(job)
        if not accounting[0].passed and accounting[0].release == "one mechanism per sampled batch":
            return _written(AuditReport(cfg.algo.name, cfg.model.name, cfg.dataset.name, accounting), run_dir)
        # the other checks build many jobs: at the calibrated sigma they skip calibration
        fixed = cfg.copy()
        OmegaConf.update(fixed, "privacy.noise_multiplier", float(job.privacy.setup.noise_multiplier))
        derived = job.privacy.setup.derived  # an algorithm's own calibration (DC-DPSGD's EpsilonSplit: sigma_tr)
        for key, value in (derived.fixed_noise_options() if derived is not None else {}).items():
            OmegaConf.update(fixed, f"algo.{key}", value)
        checks = [*noise_check(fixed), *sensitivity_check(fixed), *two_step_checks(fixed), *validation_checks(fixed),
                  *sampler_check(fixed, job), *accounting]
    family_corrected(checks, float(cfg.audit.alpha))  # the audit's false-alarm rate is at most audit.alpha
    checks.sort(key=lambda c: CHECK_ORDER.index(c.name))  # stable: each kind's rows keep their order
    return _written(AuditReport(cfg.algo.name, cfg.model.name, cfg.dataset.name, checks), run_dir)


def _written(report: AuditReport, run_dir: Path) -> AuditReport:
    """Write audit.json (under torchrun: rank 0 alone; every rank audited the same releases)."""
    from dpbench.runtime import distributed
    from dpbench.paths import atomic_write

    if distributed.is_main_process():
        atomic_write(Path(run_dir) / "audit.json", lambda handle: json.dump(report.to_json(), handle, indent=2))
    return report


def audit_table(report: AuditReport):
    from rich.table import Table

    table = Table(title=f"dpbench-audit · {report.algo} · {report.model} · {report.dataset}")
    for column in ("check", "release", "measured / bound", "result", "detail"):
        table.add_column(column, overflow="fold")
    for c in report.checks:
        table.add_row(
            c.name, c.release, f"{c.measured:.4g} / {c.bound:.4g}",
            "[green]pass[/]" if c.passed else "[bold red]FAIL[/]", c.detail,
        )
    return table
