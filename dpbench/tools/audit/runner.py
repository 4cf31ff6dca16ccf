"""`dpbench-audit`: the self-audit of a private algorithm's privacy claims.

    dpbench-audit algo=grape model=cnn        # same config and overrides as `dpbench`

`run_audit` builds the run as `dpbench.run.setup` does and runs the checks against the run's
privacy PLAN (the mechanisms the accountant composes into the reported epsilon, not what the
algorithm says it drew), one module each on harness.py's jobs: noise.py (noise, independence,
noise across runs), precision.py, sensitivity.py, two_step.py, update.py (release -> update,
buffers), validation.py, sampler.py, accounting.py. docs/auditing.md says what each sees and
cannot see. The statistical checks are one family, corrected together (`family_corrected`), so a
clean run fails one of them with probability at most audit.alpha.

Prints a table, writes audit.json in the run folder, exits 0 when every check holds, else 1.
`audit.seeded_bug=NAME|all` runs the audit under seeded bugs instead (seeded_bugs.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from dpbench.errors import UserError
from dpbench.privacy.layout import layout_verdicts_reused
from dpbench.privacy.mechanisms import SeveralMechanismsPerBatchError
from dpbench.tools.audit.accounting import accounting_check, several_mechanisms_check
from dpbench.tools.audit.harness import audited_job
from dpbench.tools.audit.noise import noise_check
from dpbench.tools.audit.report import CHECK_ORDER, AuditReport, Check, family_corrected
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
    the report (`passed` says whether all checks held). The jobs of one audit share one config, so
    their model's layout is probed once (`layout_verdicts_reused`)."""
    with layout_verdicts_reused():
        return _run_audit(cfg, run_dir)


def _run_audit(cfg, run_dir: Path) -> AuditReport:
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


def check_verdict(check: Check) -> str:
    """A check's verdict in one word. The one-run audit's lower bound can refute a claimed epsilon
    (bound above it), never confirm it: below, it is only consistent with the claim."""
    if check.name == "one_run":
        return "consistent" if check.passed else "REFUTED"
    if check.passed and check.detail.startswith("not applicable"):
        return "n/a"
    return "pass" if check.passed else "FAIL"


def audit_table(report: AuditReport):
    """The console's table: short cells and a verdict per check; why only for what failed (every
    check's detail is in audit.json)."""
    from rich.table import Table

    one_run = any(c.name == "one_run" for c in report.checks)
    caption = "details of every check: audit.json"
    if one_run:
        caption = "a lower bound can refute a claimed ε, not confirm it; " + caption
    table = Table(title=f"dpbench-audit · {report.algo} · {report.model} · {report.dataset}", caption=caption)
    table.add_column("check")
    table.add_column("release", overflow="fold")
    table.add_column("ε lower bound ≤ claimed" if one_run else "measured / bound", justify="right")
    table.add_column("verdict")
    failed = [c for c in report.checks if not c.passed]
    if failed:
        table.add_column("why", overflow="fold", ratio=1)
    for c in report.checks:
        verdict = check_verdict(c)
        style = {"pass": "green", "consistent": "green", "n/a": "dim"}.get(verdict, "bold red")
        figure = f"{c.measured:.3g} {'≤' if c.passed else '>'} {c.bound:.3g}" if c.name == "one_run" else f"{c.measured:.4g} / {c.bound:.4g}"
        cells = [c.name, c.release, "—" if verdict == "n/a" else figure, f"[{style}]{verdict}[/]"]
        table.add_row(*cells, *([c.detail if not c.passed else ""] if failed else []))
    return table
