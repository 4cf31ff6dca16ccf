"""How often the seeded bugs of the audit's blind spots are missed, and how often a clean audit raises a
false alarm, over noise multipliers sigma drawn uniformly from [0.5, 5].

    python -m dpbench.tools.audit.sigma_sweep                       # 20 sigma, the four bugs and the clean audit
    python -m dpbench.tools.audit.sigma_sweep --sigmas 5 --rows noise_skipped_small_tensors clean

Each audit runs at the catalogue's own sizes (`CATALOGUE_DEFAULTS`, the bug's overrides), with
privacy.noise_multiplier set to the drawn sigma, exactly as `dpbench-audit audit.seeded_bug=NAME
privacy.noise_multiplier=SIGMA` runs it. A bug's miss is an audit whose named check does not fail; a
clean audit's false alarm is one that fails any check. The sigmas come from a fresh entropy-seeded
draw (printed), so a rerun tests other values. Writes every audit's figure to --out.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

ROWS = ("noise_skipped_small_tensors", "normal_bf16_scaled", "validation_noise_seeded", "diff_previous_unnoised")
CLEAN = "clean"  # the catalogue's defaults, no bug


def one_audit(row: str, sigma: float, run_dir: Path) -> tuple[bool, str]:
    """(missed or false alarm, figure) of one audit of `row` at noise multiplier `sigma`."""
    from dpbench.api import compose
    from dpbench.tools.audit.runner import run_audit
    from dpbench.tools.audit.seeded_bugs import CATALOGUE_DEFAULTS, run_bug

    cfg = compose(CATALOGUE_DEFAULTS + [f"privacy.noise_multiplier={sigma}"])
    if row == CLEAN:
        failed = [f"{c.name}: {c.release}" for c in run_audit(cfg, run_dir).checks if not c.passed]
        return bool(failed), "; ".join(failed) or "passed"
    _, result = run_bug(cfg, row, run_dir)
    return not result.ok, result.figure


def main(argv: list[str] | None = None) -> int:
    import logging
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sigmas", type=int, default=20)
    parser.add_argument("--rows", nargs="*", default=[*ROWS, CLEAN])
    parser.add_argument("--out", type=Path, default=Path("audit_sigma_sweep.json"))
    args = parser.parse_args(argv)
    logging.getLogger("absl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    sigmas = [round(random.SystemRandom().uniform(0.5, 5.0), 4) for _ in range(args.sigmas)]
    print("sigma:", ", ".join(f"{s:g}" for s in sigmas), flush=True)
    table = []
    with tempfile.TemporaryDirectory() as scratch:
        for row in args.rows:
            started, outcomes = time.perf_counter(), []
            for i, sigma in enumerate(sigmas):
                missed, figure = one_audit(row, sigma, Path(scratch) / f"{row}-{i}")
                outcomes.append({"sigma": sigma, "missed": missed, "figure": figure})
                if missed:
                    print(f"  {row} at sigma {sigma}: {'false alarm' if row == CLEAN else 'MISSED'} ({figure})", flush=True)
            misses = sum(o["missed"] for o in outcomes)
            table.append({"row": row, "audits": len(outcomes), "misses": misses,
                          "seconds_per_audit": (time.perf_counter() - started) / len(outcomes), "outcomes": outcomes})
            print(f"{row}: {misses} / {len(outcomes)} {'false alarms' if row == CLEAN else 'missed'}", flush=True)
            args.out.write_text(json.dumps({"sigmas": sigmas, "rows": table}, indent=2))
    print("| row | audits | missed (clean: false alarms) | s / audit |\n| --- | --- | --- | --- |")
    for r in table:
        print(f"| `{r['row']}` | {r['audits']} | {r['misses']} | {r['seconds_per_audit']:.0f} |")
    return 0 if all(r["misses"] * 20 <= r["audits"] for r in table) else 1  # at most 1 in 20


if __name__ == "__main__":
    raise SystemExit(main())
