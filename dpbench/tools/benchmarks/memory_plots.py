"""DP-GRAPE Fig. 3/4-style plots from the traced prediction (docs/memory-prediction.md).

    python -m dpbench.tools.benchmarks.memory_plots --out docs/img

Fig. 3 style: predicted reserved GPU memory of one RoBERTa-large SST-2 step (T = 128) against the
physical batch for Adam, DP-Adam, DPZero and DP-GRAPE, the paper's two measured points marked.
Fig. 4 style: DP-GRAPE against the batch, one curve per projection rank r. Every value is a trace
(`memory_trace.predict_step_peak`), none measured on a GPU; the values are also written as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dpbench.tools.benchmarks.published_memory import GB, ROBERTA_SST2

METHODS = {"Adam": ["algo=adam"], "DP-Adam": ["algo=dpadam"], "DPZero": ["algo=dpzero"], "DP-GRAPE": ["algo=grape"]}
DEFAULT_RANK = 16  # conf/algo/grape.yaml's: its curve is the DP-GRAPE one of the first plot
PUBLISHED = {"DP-Adam": (40, 78.1), "DP-GRAPE": (40, 24.4)}  # the DP-GRAPE paper's text, GB reserved


def predicted_gb(extra: list[str], batch: int, seq_len: int) -> float:
    from dpbench.tools.benchmarks.memory_trace import predict_step_peak

    return predict_step_peak([*ROBERTA_SST2, *extra], batch=batch, seq_len=seq_len)["reserved_bytes"] / GB


def sweep(batches: list[int], ranks: list[int], seq_len: int, log=print) -> dict:
    by_method = {}
    for name, extra in METHODS.items():
        by_method[name] = {b: predicted_gb(extra, b, seq_len) for b in batches}
        log(f"{name}: " + ", ".join(f"B={b} {v:.1f} GB" for b, v in by_method[name].items()))
    by_rank = {}
    for rank in ranks:
        by_rank[rank] = by_method["DP-GRAPE"] if rank == DEFAULT_RANK else \
            {b: predicted_gb(["algo=grape", f"algo.rank={rank}"], b, seq_len) for b in batches}
        log(f"DP-GRAPE r={rank}: " + ", ".join(f"B={b} {v:.1f} GB" for b, v in by_rank[rank].items()))
    return {"seq_len": seq_len, "by_method": by_method, "by_rank": by_rank}


def draw(values: dict, out: Path) -> list[Path]:
    from dpbench.tools.report.plots import pyplot

    plt = pyplot()
    written = []
    for key, title, name in (("by_method", "RoBERTa-large, SST-2: predicted memory vs batch", "method"),
                             ("by_rank", "RoBERTa-large, DP-GRAPE: predicted memory vs batch, by rank r", "rank")):
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, points in values[key].items():
            batches = sorted(int(b) for b in points)
            ax.plot(batches, [points[b] if b in points else points[str(b)] for b in batches], marker="o",
                    label=label if key == "by_method" else f"r = {label}")
            if key == "by_method" and label in PUBLISHED:
                b, gb = PUBLISHED[label]
                ax.scatter([b], [gb], marker="x", s=60, color=ax.lines[-1].get_color(), zorder=3,
                           label=f"{label}, paper (B = {b})")
        ax.set_xlabel("physical batch (examples of 128 tokens)")
        ax.set_ylabel("predicted reserved GPU memory (GB)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = out / f"roberta_memory_vs_batch_by_{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    parser.add_argument("--batches", default="8,40", help="comma-separated physical batch sizes")
    parser.add_argument("--ranks", default="4,16,256", help="comma-separated DP-GRAPE ranks")
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    values = sweep(ints(args.batches), ints(args.ranks), args.seq_len)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "roberta_memory_predicted.json").write_text(json.dumps(values, indent=1) + "\n")
    for path in draw(values, args.out):
        print(path)


if __name__ == "__main__":
    main()
