"""`dpbench-audit`: the console script. It composes the config as `dpbench` does and runs the
self-audit (dpbench/tools/audit/runner.py), the one-run canary audit (audit.one_run=true,
dpbench/tools/audit/one_run.py) or the catalogue of seeded bugs (audit.seeded_bug=NAME|all,
dpbench/tools/audit/seeded_bugs.py); apart from them so that the catalogue, which runs the audit, is
not imported back by it.

Exit status: 0 every check holds, 1 a check failed, 2 refused (bad input, one line), 3 crashed (an
unexpected exception: no verdict, one line naming it; its traceback in the run folder's error.txt)."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from dpbench.runtime import distributed
from dpbench.errors import DivergedError, UserError
from dpbench.tools.audit import seeded_bugs
from dpbench.tools.audit.runner import audit_table, run_audit
from dpbench.tools.audit.seeded_bugs import compose_within_app as _compose_within_app

EXIT_PASSED, EXIT_CHECK_FAILED, EXIT_REFUSED, EXIT_CRASHED = 0, 1, 2, 3


def _crashed(error: BaseException, run_dir: Path | None) -> int:
    """An unexpected exception: no verdict (a crash must never read as "caught", exit 1). One line
    naming it; the traceback kept in the run folder's error.txt (rank 0's under torchrun)."""
    from dpbench.cli import ERROR_FILE, _record_failure
    from dpbench.logging.console import console

    where = ""
    if run_dir is not None:
        try:
            _record_failure(run_dir, f"crashed: {type(error).__name__}: {error}",
                            "".join(traceback.format_exception(error)))
            where = f" (traceback in {run_dir / ERROR_FILE})"
        except OSError:  # an unwritable folder: the line alone
            pass
    console.print(f"[bold red]crashed, no verdict:[/] {type(error).__name__}: {error}{where}", soft_wrap=True)
    return EXIT_CRASHED


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
        if distributed.is_distributed() and str(cfg.audit.seeded_bug) == "all":
            raise UserError("audit.seeded_bug=all runs in one process only: under torchrun name one bug "
                            "(e.g. audit.seeded_bug=noise_half), or run the catalogue without torchrun")
        _preflight(cfg)
        report = None
        if str(cfg.audit.seeded_bug) == "all":
            results = seeded_bugs.run_catalogue(cfg, run_dir)
        else:
            report, result = seeded_bugs.run_bug(cfg, str(cfg.audit.seeded_bug), run_dir)
            console.print(audit_table(report))
            results = [result]
    except (UserError, DivergedError) as error:
        console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
        _remove_refused_run_dir(run_dir)
        return EXIT_REFUSED
    except Exception as error:  # noqa: BLE001 - a crash is no verdict, never "caught"
        return _crashed(error, run_dir)
    console.print(seeded_bugs.catalogue_table(results))
    passed = all(r.ok for r in results)
    verdict = ("every seeded bug is caught by its check and every sound variant passes" if passed
               else "some seeded bugs were MISSED (or a sound variant failed)")
    console.print(f"{verdict} ({time.perf_counter() - start:.0f} s); {run_dir}", soft_wrap=True)
    if report is not None:  # one bug: the audit's own verdict (1: it failed, as it must under an unsound bug)
        return EXIT_PASSED if report.passed else EXIT_CHECK_FAILED
    return EXIT_PASSED if passed else EXIT_CHECK_FAILED


def _remove_refused_run_dir(run_dir: Path) -> None:
    """A refused audit leaves no run folder behind, as a refused `dpbench` run (rank 0 removes it)."""
    from dpbench.cli import remove_refused_run_dir

    if distributed.is_main_process():
        remove_refused_run_dir(run_dir)


AUDIT_PATIENCE_S = 120.0  # how long a rank that failed alone waits for the others (raise_together)


def _agreed(status: int) -> int:
    """Rank 0's exit status on every rank (under torchrun: the report printed and written is rank
    0's, and every rank exits as it does)."""
    return int(distributed.broadcast_object(status))


def _preflight(cfg) -> None:
    """What `dpbench.run.run_job` checks before setup under torchrun, and what the audit cannot do
    there: refused in one line on every rank alike (no collective has run yet)."""
    from dpbench.runtime import sharding
    from dpbench.algorithms import ALGORITHMS, algorithm_class
    from dpbench.run import resolve_device

    if not distributed.is_distributed():
        return
    if cfg.audit.get("one_run", False):
        raise UserError("audit.one_run=true runs in one process only: under torchrun dpbench-audit runs the "
                        "self-audit (audit.one_run=false); run the one-run audit without torchrun")
    sharding.check_supported(cfg, ALGORITHMS)  # names what train.sharding=fsdp supports
    distributed.require_data_parallel(algorithm_class(cfg.algo.name), cfg.algo.name)
    distributed.bind_device(resolve_device(cfg.device))  # torchrun + CUDA: this rank's GPU


def _main_factory():
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from dpbench.paths import config_dir

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
    def _main(cfg) -> None:
        from dpbench.logging.console import console

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        if cfg.audit.get("seeded_bug"):  # the catalogue of seeded bugs (dpbench/tools/audit/seeded_bugs.py)
            sys.exit(_agreed(_seeded_bugs_main(list(HydraConfig.get().overrides.task), run_dir)))
        report, failure = None, None
        try:
            _preflight(cfg)
            report = run_audit(cfg, run_dir)
        except Exception as error:  # noqa: BLE001 - torchrun: every rank stops with it, below
            failure = error
        try:  # torchrun: a rank that failed alone stops the others at this point (one process: re-raises)
            distributed.raise_together(failure, "auditing", patience_s=AUDIT_PATIENCE_S)
        except (UserError, DivergedError) as error:
            console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
            _remove_refused_run_dir(run_dir)
            sys.exit(EXIT_REFUSED)
        except Exception as error:  # noqa: BLE001 - every rank raised it together: every rank exits 3
            sys.exit(_crashed(error, run_dir))
        console.print(audit_table(report))  # rank 0's (the console is quiet on the others)
        verdict = "every check holds" if report.passed else "some checks FAILED"
        console.print(f"{verdict}; audit.json: {run_dir / 'audit.json'}", soft_wrap=True)
        sys.exit(_agreed(EXIT_PASSED if report.passed else EXIT_CHECK_FAILED))

    return _main


def main() -> None:
    """Under torchrun every rank joins the process group first (FSDP2's sharding needs it), and
    the ranks share rank 0's run folder; only rank 0 prints and writes audit.json, and every rank
    exits with rank 0's status."""
    from dpbench.schema import run_app

    try:
        if distributed.launched():  # torchrun --nproc_per_node=K: one folder, written by rank 0
            from dpbench.cli import shared_run_dir

            sys.argv = [sys.argv[0], *shared_run_dir(sys.argv[1:])]  # joins the ranks first
        run_app(_main_factory())
    except Exception as error:  # noqa: BLE001 - outside the run (no folder yet): the line alone, still no verdict
        sys.exit(_crashed(error, None))
    finally:
        distributed.shutdown()  # torchrun: leave the process group however the audit ended


if __name__ == "__main__":
    main()
