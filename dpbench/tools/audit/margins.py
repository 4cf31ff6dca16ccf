"""How often each statistical row of the seeded-bug catalogue misses, measured by repetition.

    python -m dpbench.tools.audit.margins                  # every statistical row x 20 (slow ones x 10)
    python -m dpbench.tools.audit.margins --repeats 5 --rows noise_half dcdpsgd_mixture_noise

A statistical row is a catalogue bug (dpbench/tools/audit/seeded_bugs.py) caught by a check whose verdict
depends on random draws (`STATISTICAL`: noise, noise precision, noise across runs, independence,
sampler); a miss is an audit that does not fail that check. A sound variant's miss is an audit that
fails any check, and so is a clean audit's (`CLEAN`: the catalogue's algorithms with no bug, the
false-alarm count). Each audit runs at the catalogue's own sizes (`CATALOGUE_DEFAULTS` and the
bug's overrides), exactly as `dpbench-audit audit.seeded_bug=NAME` runs it.

Time budget: at most 45 minutes on two idle CPU cores (about 10 s an audit, 20 repeats of 13
rows). A row whose first audit takes longer than its share of the budget (45 min / rows / 20) is
repeated 10 times instead. It prints the miss table (markdown, as docs/auditing.md holds it) and
writes it with every audit's figure to --out (audit_margins.json).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

BUDGET_S = 45 * 60
STATISTICAL = ("noise", "noise precision", "noise across runs", "independence", "sampler")
# clean audits of the catalogue's algorithms (no bug): every check must pass
CLEAN = {
    "clean dpsgd": [],
    "clean dpadam": ["algo=dpadam"],
    "clean dcdpsgd": ["algo=dcdpsgd"],
    "clean dpsgd, validation split (parallel)": ["dataset.validation_fraction=0.2", "privacy.validation_composition=parallel"],
}


def statistical_rows() -> list[str]:
    from dpbench.tools.audit.seeded_bugs import CATALOGUE

    return [name for name, bug in CATALOGUE.items() if bug.check in STATISTICAL]


def one_audit(row: str, run_dir: Path) -> tuple[bool, str]:
    """(missed, figure) of one audit of `row` at the catalogue's sizes."""
    from dpbench.api import compose
    from dpbench.tools.audit.runner import run_audit
    from dpbench.tools.audit.seeded_bugs import CATALOGUE_DEFAULTS, run_bug

    if row in CLEAN:
        report = run_audit(compose(CATALOGUE_DEFAULTS + CLEAN[row]), run_dir)
        failed = [f"{c.name}: {c.release}" for c in report.checks if not c.passed]
        return bool(failed), "; ".join(failed) or "passed"
    _, result = run_bug(compose(CATALOGUE_DEFAULTS), row, run_dir)
    return not result.ok, result.figure


def measure(rows: list[str], repeats: int) -> list[dict]:
    import logging
    import warnings

    logging.getLogger("absl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    share = BUDGET_S / max(1, len(rows)) / repeats  # seconds an audit may take for a row to get `repeats`
    table = []
    with tempfile.TemporaryDirectory() as scratch:
        for row in rows:
            started, outcomes = time.perf_counter(), []
            count = repeats
            for i in range(repeats):
                t = time.perf_counter()
                outcomes.append(one_audit(row, Path(scratch) / f"{row}-{i}"))
                if i == 0 and time.perf_counter() - t > share:
                    count = min(repeats, 10)  # a row too slow for the budget
                if i + 1 >= count:
                    break
            misses = sum(missed for missed, _ in outcomes)
            table.append({"row": row, "audits": len(outcomes), "misses": misses,
                          "seconds_per_audit": (time.perf_counter() - started) / len(outcomes),
                          "figures": [figure for _, figure in outcomes]})
            print(f"{row}: {misses} / {len(outcomes)} missed", flush=True)
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| row | audits | missed (bug not caught; sound or clean: a false alarm) | s / audit |",
             "| --- | --- | --- | --- |"]
    lines += [f"| `{r['row']}` | {r['audits']} | {r['misses']} | {r['seconds_per_audit']:.0f} |" for r in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", nargs="*", help="catalogue rows or clean audits (default: every statistical row, "
                                                  "then the clean audits)")
    parser.add_argument("--out", type=Path, default=Path("audit_margins.json"))
    args = parser.parse_args(argv)
    rows = args.rows or [*statistical_rows(), *CLEAN]
    table = measure(rows, args.repeats)
    args.out.write_text(json.dumps(table, indent=2))
    print(markdown(table))
    return 0 if all(r["misses"] * 20 <= r["audits"] for r in table) else 1  # no row misses more than 1 in 20


if __name__ == "__main__":
    raise SystemExit(main())
