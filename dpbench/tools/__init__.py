"""dpbench's tools: what reads, checks or measures runs, apart from the core that runs them.

    report/          dpbench-report: tables, plots, leaderboards and checks of finished runs
    audit/           dpbench-audit: an empirical self-check of noise, sensitivity and accounting
    doctor.py        dpbench-doctor: every algorithm a few steps on this machine's device
    spectrum.py      dpbench-spectrum: the gradient spectra behind DP-GRAPE's and DPDR's premises
    plots_synthetic.py  DPZero's synthetic-study figures from a finished grid
    benchmarks/      engines (per-example engines vs Opacus), max_batch and table (memory vs batch)
    gpu_check/       one offline command that installs dpbench on a GPU node and measures it there

The core (run, trainer, algorithms, privacy, models, tasks, logging) never imports these.
"""
