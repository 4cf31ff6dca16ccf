"""dpbench-audit: empirical checks of a private algorithm's noise, sensitivity and accounting.

    cli.py        the console script: the self-audit, the one-run audit or the seeded bugs
    runner.py     the self-audit (`run_audit`), one check per module on harness.py's jobs
    one_run*.py   the one-run canary audit (a lower bound on epsilon from one training run)
    seeded_bugs*  the broken mechanisms the audit must catch; margins.py: how often it does

Nothing outside dpbench/tools imports this package.
"""
