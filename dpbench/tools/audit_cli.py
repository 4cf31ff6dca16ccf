"""`dpbench-audit`: the console script. It composes the config as `dpbench` does and runs the
self-audit (dpbench/tools/audit.py), the one-run canary audit (audit.one_run=true,
dpbench/tools/one_run.py) or the catalogue of seeded bugs (audit.seeded_bug=NAME|all,
dpbench/tools/seeded_bugs.py); apart from them so that the catalogue, which runs the audit, is
not imported back by it."""

from __future__ import annotations

import sys
from pathlib import Path

from dpbench.errors import DivergedError, UserError
from dpbench.tools import seeded_bugs
from dpbench.tools.audit import audit_table, run_audit
from dpbench.tools.seeded_bugs import compose_within_app as _compose_within_app


def _seeded_bugs_main(overrides: list[str], run_dir: Path) -> int:
    """audit.seeded_bug=NAME|all: the audit under each seeded bug, composed from the catalogue's
    defaults and then the command line's overrides (with audit.one_run=true: the command line's
    alone, one bug, caught by the one-run bound). `all`: 0 iff every bug is caught by its named check
    and every sound variant passes; one bug: the audit's own exit status (1 when a check failed)."""
    import time

    from dpbench.logging.console import console

    start = time.perf_counter()
    try:
        cfg = _compose_within_app(overrides)
        one_run = bool(cfg.audit.one_run)
        if one_run and str(cfg.audit.seeded_bug) == "all":
            raise UserError("audit.seeded_bug=all runs the self-audit; with audit.one_run=true name one bug "
                            "(e.g. audit.seeded_bug=unnoised_update)")
        if not one_run:  # the catalogue's small self-audit; a one-run audit trains the run as configured
            cfg = _compose_within_app(seeded_bugs.CATALOGUE_DEFAULTS + overrides)
        report = None
        if str(cfg.audit.seeded_bug) == "all":
            results = seeded_bugs.run_catalogue(cfg, run_dir)
        else:
            report, result = seeded_bugs.run_bug(cfg, str(cfg.audit.seeded_bug), run_dir)
            console.print(audit_table(report))
            results = [result]
    except (UserError, DivergedError) as error:
        console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
        return 2
    console.print(seeded_bugs.catalogue_table(results))
    passed = all(r.ok for r in results)
    verdict = ("every seeded bug is caught by its check and every sound variant passes" if passed
               else "some seeded bugs were MISSED (or a sound variant failed)")
    console.print(f"{verdict} ({time.perf_counter() - start:.0f} s); {run_dir}", soft_wrap=True)
    if report is not None:  # one bug: the audit's own verdict (1: it failed, as it must under an unsound bug)
        return 0 if report.passed else 1
    return 0 if passed else 1


def _main_factory():
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from dpbench.paths import config_dir

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
    def _main(cfg) -> None:
        from dpbench.logging.console import console

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if cfg.audit.get("seeded_bug"):  # the catalogue of seeded bugs (dpbench/tools/seeded_bugs.py)
            sys.exit(_seeded_bugs_main(list(HydraConfig.get().overrides.task), run_dir))
        try:
            report = run_audit(cfg, run_dir)
        except (UserError, DivergedError) as error:
            console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
            sys.exit(2)
        console.print(audit_table(report))
        verdict = "every check holds" if report.passed else "some checks FAILED"
        console.print(f"{verdict}; audit.json: {run_dir / 'audit.json'}", soft_wrap=True)
        sys.exit(0 if report.passed else 1)

    return _main


def main() -> None:
    from dpbench.schema import run_app

    run_app(_main_factory())


if __name__ == "__main__":
    main()
