"""DP-GRAPE Fig. 3/4-style plots from the traced prediction (docs/memory-prediction.md).

    python -m dpbench.tools.benchmarks.memory_plots --out docs/img
    python -m dpbench.tools.benchmarks.memory_plots --model vit-base --batches 100,500 --ranks ""
    python -m dpbench.tools.benchmarks.memory_plots --model opt-6.7b --batches 1,8 --ranks ""

Fig. 3 style: predicted reserved GPU memory of one step (RoBERTa-large SST-2 at T = 128 by default;
ViT-Base at 224 px; OPT at T = 256) against the physical batch for Adam, DP-Adam, DPZero and
DP-GRAPE, the paper's measured points marked. Fig. 4 style: DP-GRAPE against the batch, one curve
per projection rank r. Every value is a trace (`memory_trace.predict_step_peak`), none measured on
a GPU; the values are also written as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dpbench.tools.benchmarks.published_memory import GB, ROBERTA_SST2, VIT_BASE

METHODS = {"Adam": ["algo=adam"], "DP-Adam": ["algo=dpadam"], "DPZero": ["algo=dpzero"], "DP-GRAPE": ["algo=grape"]}
DEFAULT_RANK = 16  # conf/algo/grape.yaml's: its curve is the DP-GRAPE one of the first plot
# model -> (the overrides of its task, tokens per example (None: images), file prefix, the DP-GRAPE
# paper's measured points {method: (batch, GB reserved)}; its OPT-6.7B figure is a verdict only)
MODELS = {
    "roberta-large": (ROBERTA_SST2, 128, "roberta", {"DP-Adam": (40, 78.1), "DP-GRAPE": (40, 24.4)}),
    "vit-base": (VIT_BASE, None, "vit_base", {"Adam": (500, 63.0), "DP-GRAPE": (500, 70.6), "DP-Adam": (200, 83.9)}),
    **{f"opt-{size}": (["model=opt", f"model.size={size}", "dataset=sst2"], 256, f"opt_{size}", {})
       for size in ("1.3b", "2.7b", "6.7b")},
}


def predicted_gb(extra: list[str], batch: int, seq_len: int | None, task: list[str] = ROBERTA_SST2) -> float:
    from dpbench.tools.benchmarks.memory_trace import predict_step_peak

    return predict_step_peak([*task, *extra], batch=batch, seq_len=seq_len)["reserved_bytes"] / GB


def sweep(batches: list[int], ranks: list[int], seq_len: int | None, log=print, model: str = "roberta-large") -> dict:
    task = MODELS[model][0]
    by_method = {}
    for name, extra in METHODS.items():
        by_method[name] = {b: predicted_gb(extra, b, seq_len, task) for b in batches}
        log(f"{name}: " + ", ".join(f"B={b} {v:.1f} GB" for b, v in by_method[name].items()))
    by_rank = {}
    for rank in ranks:
        by_rank[rank] = by_method["DP-GRAPE"] if rank == DEFAULT_RANK else \
            {b: predicted_gb(["algo=grape", f"algo.rank={rank}"], b, seq_len, task) for b in batches}
        log(f"DP-GRAPE r={rank}: " + ", ".join(f"B={b} {v:.1f} GB" for b, v in by_rank[rank].items()))
    return {"model": model, "seq_len": seq_len, "by_method": by_method, "by_rank": by_rank}


def draw(values: dict, out: Path) -> list[Path]:
    from dpbench.tools.report.plots import pyplot

    model = values.get("model", "roberta-large")
    _, seq_len, prefix, published = MODELS[model]
    plt = pyplot()
    written = []
    for key, title, name in (("by_method", f"{model}: predicted memory vs batch", "method"),
                             ("by_rank", f"{model}, DP-GRAPE: predicted memory vs batch, by rank r", "rank")):
        if not values[key]:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for label, points in values[key].items():
            batches = sorted(int(b) for b in points)
            ax.plot(batches, [points[b] if b in points else points[str(b)] for b in batches], marker="o",
                    label=label if key == "by_method" else f"r = {label}")
            if key == "by_method" and label in published:
                b, gb = published[label]
                ax.scatter([b], [gb], marker="x", s=60, color=ax.lines[-1].get_color(), zorder=3,
                           label=f"{label}, paper (B = {b})")
        ax.set_xlabel(f"physical batch (examples of {seq_len} tokens)" if seq_len else "physical batch (224 px images)")
        ax.set_ylabel("predicted reserved GPU memory (GB)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = out / f"{prefix}_memory_vs_batch_by_{name}.png"
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
    parser.add_argument("--model", choices=sorted(MODELS), default="roberta-large")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per example (default: the model's task's)")
    args = parser.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",") if x]  # noqa: E731
    seq_len = args.seq_len or MODELS[args.model][1]
    values = sweep(ints(args.batches), ints(args.ranks), seq_len, model=args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{MODELS[args.model][2]}_memory_predicted.json").write_text(json.dumps(values, indent=1) + "\n")
    for path in draw(values, args.out):
        print(path)


if __name__ == "__main__":
    main()
