"""Ghost clipping's memory over non-private SGD, dpbench's engine against Opacus's own, on one model.

    python -m dpbench.tools.benchmarks.ghost_memory                        # traced: B = 32, 128, 512, 1024
    python -m dpbench.tools.benchmarks.ghost_memory --real --batches 8,16,32
    python -m dpbench.tools.benchmarks.ghost_memory --format markdown -- model=minilm dataset=rt_snippets

The setting of Opacus's clipping write-up (BERT-base, one trained block with the classifier head,
T = 128) unless overrides follow `--`. For each batch size B, three steps of the same model on the same
batch: dpbench's `algo=sgd` (non-private), dpbench's DP-SGD with `algo.per_sample=ghost`, and Opacus
1.6's ghost clipping (`GradSampleModuleFastGradientClipping` with its optimizer and its two-pass
loss, `DPTensorFastGradientClipping`). Each peak is MemTracker's largest sum of live tensors (what
`torch.cuda.max_memory_allocated` reports on a GPU), on fake tensors by default (any size, no
storage; memory_trace.py) or on real ones with `--real` (small B on the CPU). The table gives each
method's excess over SGD and, fitted over B, its bytes per example; dpbench's ratio to Opacus's.

Written by hand because Opacus ships no memory comparison of its own modes; the steps are Opacus's own
classes, not re-implementations. Benchmarks are run by hand, never inside the fast tests.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

GB = 1e9
BERT_BLOCK = ("model=bert", "+model.size=base", "model.trained_blocks=1", "dataset=rt_snippets")
METHODS = ("sgd", "dpbench_ghost", "opacus_ghost")


def _opacus_ghost_step(step):
    """Opacus's ghost clipping on the model and batch of `step` (built for algo=sgd): one train step."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    model, task, batch = step.model, step.algorithm.task, step.batch
    trainable = [p for p in model.parameters() if p.requires_grad]
    wrapped = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean", max_grad_norm=1.0,
                                                   use_ghost_clipping=True)
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD(trainable, lr=0.1), noise_multiplier=1.0,
                                                max_grad_norm=1.0, expected_batch_size=step.batch_size,
                                                loss_reduction="mean")

    def train_step(batches, index):
        losses = task.per_sample_loss(wrapped, batches[0])
        DPTensorFastGradientClipping(wrapped, optimizer, losses, "mean").backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return train_step


def peak(method: str, overrides: list[str], batch: int, seq_len: int, fake: bool) -> int:
    """Peak live bytes of two steps of `method` at batch size `batch`."""
    from dpbench.tools.benchmarks.memory_trace import build_step, fake_safe_engines, measure, tracing_mode

    algo = {"sgd": ["algo=sgd"], "dpbench_ghost": ["algo=dpsgd", "algo.per_sample=ghost"],
            "opacus_ghost": ["algo=sgd"]}[method]
    points = [*overrides, *algo, f"train.batch_size={batch}", f"train.physical_batch_size={batch}"]
    with tracing_mode() if fake else contextlib.nullcontext(), fake_safe_engines():
        step = build_step(points, batch, seq_len)
        if method == "opacus_ghost":
            step.algorithm.train_step = _opacus_ghost_step(step)
        return measure(step)["allocated_bytes"]


def slope(batches: list[int], values: list[float]) -> float:
    """Least-squares bytes per example of `values` over `batches`."""
    mean_b, mean_v = sum(batches) / len(batches), sum(values) / len(values)
    spread = sum((b - mean_b) ** 2 for b in batches)
    return sum((b - mean_b) * (v - mean_v) for b, v in zip(batches, values)) / spread if spread else 0.0


def run(overrides: list[str], batches: list[int], seq_len: int, fake: bool, report=print) -> dict:
    peaks: dict[str, list[int]] = {m: [] for m in METHODS}
    for batch in batches:
        for method in METHODS:
            started = time.perf_counter()
            peaks[method].append(peak(method, overrides, batch, seq_len, fake))
            report(f"  {method} B={batch}: {peaks[method][-1] / GB:.3f} GB ({time.perf_counter() - started:.0f} s)")
    excess = {m: [p - s for p, s in zip(peaks[m], peaks["sgd"])] for m in METHODS[1:]}
    return {"batches": batches, "peaks": peaks, "excess": excess,
            "per_example": {m: slope(batches, excess[m]) for m in excess}}


def render(result: dict, fmt: str, title: str) -> str:
    head = ["B", "SGD (GB)", "dpbench ghost (GB)", "Opacus ghost (GB)", "dpbench excess", "Opacus excess",
            "dpbench ÷ (1.2 Opacus + 0.1 GB)"]
    rows = []
    for i, batch in enumerate(result["batches"]):
        ours, theirs = result["excess"]["dpbench_ghost"][i], result["excess"]["opacus_ghost"][i]
        rows.append([str(batch), f"{result['peaks']['sgd'][i] / GB:.3f}", f"{result['peaks']['dpbench_ghost'][i] / GB:.3f}",
                     f"{result['peaks']['opacus_ghost'][i] / GB:.3f}", f"{ours / GB:.3f}", f"{theirs / GB:.3f}",
                     f"{ours / (1.2 * max(theirs, 0) + 0.1 * GB):.2f}"])
    per = result["per_example"]
    ratio = per["dpbench_ghost"] / per["opacus_ghost"] if per["opacus_ghost"] > 0 else float("inf")
    tail = (f"per-example excess, fitted over B: dpbench {per['dpbench_ghost'] / 1e6:.2f} MB, Opacus "
            f"{per['opacus_ghost'] / 1e6:.2f} MB (ratio {ratio:.2f})")
    if fmt == "markdown":
        lines = [f"**{title}**", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join([*lines, "", tail])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([*lines, tail])


def main(argv: list[str] | None = None) -> int:
    import warnings

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (traced: 32,128,512,1024; "
                                                        "--real: 8,16,32)")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--real", action="store_true", help="real tensors on the CPU instead of fake ones")
    parser.add_argument("--format", choices=("text", "markdown"), default="text")
    parser.add_argument("overrides", nargs="*", help="dpbench overrides after --, instead of BERT-base's block")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    batches = [int(b) for b in (args.batches or ("8,16,32" if args.real else "32,128,512,1024")).split(",")]
    overrides = list(args.overrides or BERT_BLOCK)
    result = run(overrides, batches, args.seq_len, fake=not args.real)
    title = (f"ghost clipping over SGD, {'real' if args.real else 'traced'} peaks, T = {args.seq_len}: "
             f"{' '.join(overrides)}")
    print(render(result, args.format, title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
