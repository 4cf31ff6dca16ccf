"""Error against dimension for DPZero's synthetic study (DPZero Figs. 1 and 2).

    python -m dpbench.tools.plots_synthetic outputs/multirun/dpzero_fig1          # -> dpzero_fig1.png, dpzero_fig2.png

Reads every results.json of the quadratic task under the folder and, per spectrum, method and
dimension d, keeps the best (smallest) final test error over the other hyperparameters (learning
rate, clip norm, steps), as the paper plots the best value of its grid search: the test gradient
norm ||grad F_test|| (`metrics.test_accuracy`, Fig. 1) and the test loss (`metrics.test_loss`,
Fig. 2). Diverged or non-finite runs are left out. One panel per spectrum, log-log axes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from dpbench.logging.results import RESULTS_FILE

METHOD_NAMES = {"dpsgd": "DP-GD", "dpzero": "DPZero", "dpgd0th": "DPGD-0th"}
SPECTRUM_TITLES = {"d": "Tr(A) = d", "sqrt_d": "Tr(A) = O(√d)", "log_d": "Tr(A) = O(log d)"}
FIGURES = {  # file stem -> (results.json metric, axis label)
    "dpzero_fig1": ("test_accuracy", "best test gradient norm ‖∇F_test‖"),
    "dpzero_fig2": ("test_loss", "best test loss F_test"),
}


def best_errors(folder: Path, metric: str) -> dict[str, dict[str, dict[int, float]]]:
    """{spectrum: {algo: {d: smallest final metric}}} over the quadratic runs under `folder`."""
    best: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(folder.rglob(RESULTS_FILE)):
        results = json.loads(path.read_text())
        dataset = (results.get("config") or {}).get("dataset", {})
        value = (results.get("metrics") or {}).get(metric)
        if dataset.get("task") != "quadratic" or results.get("status") != "completed":
            continue
        if value is None or not math.isfinite(value):
            continue
        spectrum, algo, d = dataset["spectrum"], results["algo"], int(dataset["dimension"])
        best[spectrum][algo][d] = min(value, best[spectrum][algo].get(d, math.inf))
    return best


def plot(best: dict, ylabel: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spectra = [s for s in SPECTRUM_TITLES if s in best]
    fig, axes = plt.subplots(1, len(spectra), figsize=(4.5 * len(spectra), 3.8), squeeze=False)
    for ax, spectrum in zip(axes[0], spectra):
        for algo, points in sorted(best[spectrum].items()):
            ds = sorted(points)
            ax.plot(ds, [points[d] for d in ds], marker="o", label=METHOD_NAMES.get(algo, algo))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("dimension d")
        ax.set_title(SPECTRUM_TITLES[spectrum])
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    axes[0][0].set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dpbench.tools.plots_synthetic", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="folder searched recursively for results.json")
    parser.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: the folder)")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        print(f"error: {args.folder} is not a folder; pass the multirun folder of the dpzero_fig1 presets", file=sys.stderr)
        return 2
    out = args.out or args.folder
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    for stem, (metric, ylabel) in FIGURES.items():
        best = best_errors(args.folder, metric)
        if not best:
            continue
        print(f"{stem} ({metric}, best per method and d):")
        for spectrum, methods in best.items():
            for algo, points in sorted(methods.items()):
                values = ", ".join(f"d={d}: {points[d]:.4g}" for d in sorted(points))
                print(f"  {spectrum:7s} {METHOD_NAMES.get(algo, algo):9s} {values}")
        print(f"wrote {plot(best, ylabel, out / f'{stem}.png')}")
        written += 1
    if not written:
        print(f"error: no completed quadratic-task results.json under {args.folder}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
