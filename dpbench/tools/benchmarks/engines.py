"""Per-example engines against non-private training and Opacus's own PrivacyEngine, in one run.

    python -m dpbench.tools.benchmarks.engines                               # ViT shape, batch 64
    python -m dpbench.tools.benchmarks.engines --shape opt --batch 16 --format markdown
    python -m dpbench.tools.benchmarks.engines --shape roberta --batch 16
    python -m dpbench.tools.benchmarks.engines --methods adam,opacus_hooks,dpadam:bk --repeats 5

Every method trains the same randomly initialised model on the same synthetic batch: non-private
Adam, Opacus 1.6's `PrivacyEngine` (per-sample hooks, and ghost clipping), dpbench's DP-Adam and
DP-GRAPE with each `algo.per_sample` engine (materialize, ghost, bk) and DPZero. Each measurement
runs in its own process (memory peaks do not mix), the methods alternate within every repeat (a
slow spell of the machine hits all of them), and the table gives the median samples/s and the
run's own peak memory (peak minus the process's memory before the model was built; on CUDA the
allocated and reserved peaks, with every step synchronised), each also as a ratio to non-private
Adam and to Opacus's hooks. On CPU two more figures separate the method's working set from what
glibc's heap keeps after frees (its mmap threshold rises with every large tensor freed, so later
ones come from a heap that is not returned, and the RSS peak then depends on the order of
allocations): the own peak of a second, untimed process per method with glibc's mmap threshold
fixed at 128 KiB (`MALLOC_MMAP_THRESHOLD_`: every large tensor is returned to the OS when freed,
too slow to time with, as in the memory-vs-batch tables), and the tensor peak (live tensors during
one more, profiled step: CUDA's max_allocated on CPU). Benchmarks are run by hand on an idle
machine, never inside the tests.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

MIB = 2**20
METHODS = ("adam", "opacus_hooks", "opacus_ghost", "dpadam:materialize", "dpadam:ghost", "dpadam:bk",
           "grape:materialize", "grape:ghost", "grape:bk", "dpzero")


@dataclass(frozen=True)
class Shape:
    """A model and its synthetic batch: `vit` (DP-ViT on 3×32×32 images, patch 4: 65 tokens) or a
    language model with tied embeddings and learned positions: `opt` (causal, OPT-shaped) or
    `roberta` (masked LM, RoBERTa-shaped: token types, LM head with its own dense + LayerNorm)."""

    kind: str
    width: int
    depth: int
    heads: int
    tokens: int = 0  # language shapes: sequence length
    vocab: int = 0

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        if self.kind == "vit":
            from dpbench.models.vit import DPViT

            return DPViT(img_size=32, patch_size=4, in_chans=3, num_classes=10, embed_dim=self.width,
                         depth=self.depth, num_heads=self.heads, mlp_ratio=4.0, global_pool="token")
        import transformers

        from dpbench.models import apply_opacus_fixes

        if self.kind == "roberta":  # position ids start after the padding index (1)
            config = transformers.RobertaConfig(vocab_size=self.vocab, hidden_size=self.width,
                                                num_hidden_layers=self.depth, num_attention_heads=self.heads,
                                                intermediate_size=4 * self.width, type_vocab_size=1,
                                                max_position_embeddings=self.tokens + 2, pad_token_id=1)
            return apply_opacus_fixes(transformers.RobertaForMaskedLM(config), "roberta")
        config = transformers.OPTConfig(vocab_size=self.vocab, hidden_size=self.width, num_hidden_layers=self.depth,
                                        num_attention_heads=self.heads, ffn_dim=4 * self.width,
                                        max_position_embeddings=self.tokens + 2, word_embed_proj_dim=self.width)
        return apply_opacus_fixes(transformers.OPTForCausalLM(config), "opt")

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        if self.kind == "vit":
            return torch.randn(size, 3, 32, 32, generator=g), torch.randint(0, 10, (size,), generator=g)
        ids = torch.randint(4, self.vocab, (size, self.tokens), generator=g)
        return ids, ids

    def logits_and_targets(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
        """[N, classes] logits and [N] targets, N = examples (vit) or examples × predicted tokens."""
        if self.kind == "vit":
            return model(inputs), targets
        if self.kind == "roberta":  # every position scored (a masked LM's cost at 100 % masking)
            logits = model(input_ids=inputs).logits
            return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        logits = model(input_ids=inputs).logits[:, :-1]
        return logits.reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1)

    def per_example_loss(self, model, inputs, targets) -> torch.Tensor:
        logits, flat_targets = self.logits_and_targets(model, inputs, targets)
        return F.cross_entropy(logits.float(), flat_targets, reduction="none").view(inputs.shape[0], -1).mean(dim=1)


SHAPES = {
    "vit": Shape("vit", width=192, depth=6, heads=3),
    "opt": Shape("opt", width=256, depth=4, heads=4, tokens=128, vocab=8192),
    "roberta": Shape("roberta", width=256, depth=4, heads=4, tokens=128, vocab=8192),
    # the published models' widths (random weights): the GPU check (dpbench/tools/gpu_check)
    "vit-base": Shape("vit", width=768, depth=12, heads=12),
    "roberta-base": Shape("roberta", width=768, depth=12, heads=12, tokens=128, vocab=50265),
}


class _Task:
    """The dpbench Task seam over the one synthetic batch."""

    def __init__(self, shape: Shape, inputs, targets):
        self.shape, self.inputs, self.targets = shape, inputs, targets
        self.train_size = len(inputs)

    def batch(self, indices):
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return self.inputs[index], self.targets[index]

    def batch_size(self, batch) -> int:
        return int(batch[0].shape[0])

    def per_sample_loss(self, model, batch) -> torch.Tensor:
        return self.shape.per_example_loss(model, *batch)

    def set_step(self, step: int) -> None: ...


def _dpbench_step(name: str, engine: str | None, model, shape: Shape, inputs, targets, device):
    from hydra import compose, initialize_config_dir

    from dpbench.algorithms import algorithm_class
    from dpbench.paths import config_dir
    from dpbench.privacy.noise import GaussianNoise
    from dpbench.privacy.plan import PrivacySetup
    from dpbench.schema import register

    register()
    overrides = [f"algo={name}", "logger=none"] + ([f"algo.per_sample={engine}"] if engine else [])
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    task = _Task(shape, inputs, targets)
    setup = PrivacySetup(noise_multiplier=1.0, clip_norm=1.0, expected_batch_size=float(len(inputs)),
                         sample_rate=0.01, noise=GaussianNoise(device))
    algorithm = algorithm_class(name)(model, task, cfg.algo, 1e-4, setup)
    batch = [task.batch(range(len(inputs)))]
    steps = iter(range(10**9))
    return lambda: algorithm.train_step(batch, next(steps))


def _opacus_step(mode: str, model, shape: Shape, inputs, targets):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=len(inputs))
    engine = PrivacyEngine(accountant="rdp")
    if mode == "ghost":
        model, optimizer, criterion, _ = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            poisson_sampling=False, criterion=nn.CrossEntropyLoss(reduction="mean"), grad_sample_mode="ghost")

        def step():
            logits, flat = shape.logits_and_targets(model, inputs, targets)
            loss = criterion(logits.float(), flat, shape=(len(inputs), -1)) if shape.kind != "vit" else criterion(logits, flat)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step
    model, optimizer, _ = engine.make_private(module=model, optimizer=optimizer, data_loader=loader,
                                              noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)

    def step():
        shape.per_example_loss(model, inputs, targets).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _adam_step(model, shape: Shape, inputs, targets):
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)

    def step():
        shape.per_example_loss(model, inputs, targets).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _import_every_method() -> None:
    """Import what any method imports (Hydra, dpbench's algorithms and engines, Opacus) before the
    memory baseline is read: otherwise the dpbench and Opacus rows pay tens of MiB of Python
    modules that non-private Adam never loads."""
    import hydra  # noqa: F401
    import opacus  # noqa: F401

    import dpbench.algorithms  # noqa: F401
    import dpbench.privacy.engines  # noqa: F401
    from dpbench.algorithms import algorithm_class

    for name in ("dpadam", "grape", "dpzero"):
        algorithm_class(name)


def measure(method: str, shape: Shape, batch: int, steps: int, warmup: int, device: torch.device) -> dict:
    """One method in this process: samples/s over `steps` synchronised steps after `warmup`, and peaks."""
    from dpbench.runtime.metering import PeakMemory, own_peak_bytes

    _import_every_method()  # the own peak is the method's tensors, not the code it imports
    memory = PeakMemory(device)
    memory.reset()
    model = shape.model().to(device)
    inputs, targets = (t.to(device) for t in shape.batch(batch))
    name, _, engine = method.partition(":")
    if method == "adam":
        step = _adam_step(model, shape, inputs, targets)
    elif name.startswith("opacus_"):
        step = _opacus_step(name.removeprefix("opacus_"), model, shape, inputs, targets)
    else:
        step = _dpbench_step(name, engine or None, model, shape, inputs, targets, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    # The peak of the timed steps only (a first step may check or compile once), still measured
    # from the process's memory before the model was built.
    start = memory.start_bytes
    memory.reset()
    memory.start_bytes = start
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    elapsed = time.perf_counter() - started
    peaks = memory.read()
    own = own_peak_bytes(peaks)
    result = {"method": method, "samples_per_s": batch * steps / elapsed, "own_peak_bytes": own,
              "peak_bytes": peaks["peak_bytes"], "memory_kind": peaks["kind"]}
    if device.type == "cpu":  # after the timed steps: the profiler slows the step it watches
        result["tensor_peak_bytes"] = tensor_peak_bytes(step)
    return result


def tensor_peak_bytes(step) -> int | None:
    """Peak bytes of live tensors during one step (those the step reads, like parameters and
    optimizer state, included), from the profiler's memory timeline: the CPU counterpart of
    CUDA's max_allocated. The RSS peak also holds what glibc's heap keeps after frees (its mmap
    threshold rises with the tensors freed), which depends on the order of allocations more than
    on their sizes. None where the profiler's (private) timeline is unavailable."""
    try:
        from torch.profiler import ProfilerActivity, profile
        from torch.profiler._memory_profiler import Action

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
            step()
        live, current, peak = {}, 0, 0
        for _, action, (key, _version), size in prof._memory_profile().timeline:
            if key.device.type != "cpu":
                continue
            if action in (Action.PREEXISTING, Action.CREATE) and key not in live:
                live[key] = size
                current += size
            elif action == Action.DESTROY and key in live:
                current -= live.pop(key)
            peak = max(peak, current)
        return peak
    except Exception:  # noqa: BLE001 - a private API: the column is left empty, the run goes on
        return None


FIXED_MMAP_THRESHOLD = 128 * 1024  # bytes: glibc returns every larger block to the OS when it is freed


def _worker(args, method: str, steps: int, warmup: int, env=None) -> dict:
    command = [sys.executable, "-m", "dpbench.tools.benchmarks.engines", "--worker", method, "--shape", args.shape,
               "--batch", str(args.batch), "--steps", str(steps), "--warmup", str(warmup),
               "--device", args.device] + (["--threads", str(args.threads)] if args.threads else [])
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_all(args) -> dict[str, list[dict]]:
    """Each method in its own process, alternating: repeat r runs the methods rotated by r. On CPU,
    each method's first repeat also runs one untimed step in a process whose glibc returns freed
    tensors at once (`own_peak_freed_bytes`)."""
    methods = list(args.methods)
    results: dict[str, list[dict]] = {m: [] for m in methods}
    freed_env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(FIXED_MMAP_THRESHOLD)}
    for repeat in range(args.repeats):
        for method in methods[repeat % len(methods):] + methods[: repeat % len(methods)]:
            result = _worker(args, method, args.steps, args.warmup)
            if repeat == 0 and args.device == "cpu" and "error" not in result and not getattr(args, "no_freed", False):
                freed = _worker(args, method, 1, 1, env=freed_env)
                result["own_peak_freed_bytes"] = freed.get("own_peak_bytes")
            results[method].append(result)
            print(f"  {method} (repeat {repeat + 1}/{args.repeats}): "
                  f"{_short(results[method][-1])}", file=sys.stderr, flush=True)
    return results


def _short(result: dict) -> str:
    if "error" in result:
        return f"error: {result['error']}"
    return f"{result['samples_per_s']:.1f} samples/s, own peak {result['own_peak_bytes'] / MIB:.0f} MiB"


def _median_or_none(values):
    values = [v / MIB for v in values if v is not None]
    return statistics.median(values) if values else None


def table_rows(results: dict[str, list[dict]]) -> list[dict]:
    """Medians per method, with ratios to non-private Adam and to Opacus's hooks."""
    medians = {}
    for method, runs in results.items():
        ok = [r for r in runs if "error" not in r]
        medians[method] = ({"speed": statistics.median(r["samples_per_s"] for r in ok),
                            "own": statistics.median(r["own_peak_bytes"] for r in ok) / MIB,
                            "freed": _median_or_none([r.get("own_peak_freed_bytes") for r in ok]),
                            "tensors": _median_or_none([r.get("tensor_peak_bytes") for r in ok])}
                           if ok else {"error": runs[-1]["error"] if runs else "not run"})

    def ratio(method, reference, key):
        a, b = medians.get(method, {}), medians.get(reference, {})
        return a[key] / b[key] if a.get(key) is not None and b.get(key) else None

    return [{"method": m, **medians[m],
             "speed_vs_adam": ratio(m, "adam", "speed"), "speed_vs_opacus": ratio(m, "opacus_hooks", "speed"),
             "own_vs_adam": ratio(m, "adam", "own"), "own_vs_opacus": ratio(m, "opacus_hooks", "own"),
             "freed_vs_adam": ratio(m, "adam", "freed"), "freed_vs_opacus": ratio(m, "opacus_hooks", "freed"),
             "tensors_vs_adam": ratio(m, "adam", "tensors"), "tensors_vs_opacus": ratio(m, "opacus_hooks", "tensors")}
            for m in medians]


def render(rows: list[dict], fmt: str, title: str) -> str:
    def x(value):
        return "–" if value is None else f"{value:.2f}×"

    def mib(value):
        return "–" if value is None else f"{value:.0f}"

    header = ["method", "samples/s", "÷ Adam", "÷ Opacus hooks", "own peak MiB", "÷ Adam", "÷ Opacus hooks",
              "own peak, freed at once MiB", "÷ Adam", "÷ Opacus hooks", "tensor peak MiB", "÷ Adam", "÷ Opacus hooks"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["method"], f"error: {r['error']}"] + [""] * (len(header) - 2))
        else:
            body.append([r["method"], f"{r['speed']:.1f}", x(r["speed_vs_adam"]), x(r["speed_vs_opacus"]),
                         f"{r['own']:.0f}", x(r["own_vs_adam"]), x(r["own_vs_opacus"]),
                         mib(r.get("freed")), x(r.get("freed_vs_adam")), x(r.get("freed_vs_opacus")),
                         mib(r.get("tensors")), x(r.get("tensors_vs_adam")), x(r.get("tensors_vs_opacus"))])
    if fmt == "markdown":
        lines = [f"**{title}**", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in header:
        table.add_column(column, justify="left" if column == "method" else "right")
    for row in body:
        table.add_row(*row)
    console = Console(record=True, width=220, file=io.StringIO())
    console.print(table)
    return console.export_text()


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="vit")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    parser.add_argument("--format", choices=["rich", "markdown"], default="rich")
    parser.add_argument("--no-freed", action="store_true", help="CPU: leave out the freed-at-once process per method")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shape, device = SHAPES[args.shape], torch.device(args.device)
    if args.worker:
        import warnings

        warnings.filterwarnings("ignore")
        print(json.dumps(measure(args.worker, shape, args.batch, args.steps, args.warmup, device)))
        return 0
    results = run_all(args)
    title = (f"{args.shape} ({shape.depth} blocks × {shape.width}), batch {args.batch}, {device.type}, "
             f"{torch.get_num_threads()} threads: median of {args.repeats}")
    print(render(table_rows(results), args.format, title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
