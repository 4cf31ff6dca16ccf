"""`dpbench-spectrum`: singular values of layer gradients under clipping and noise (DP-GRAPE Fig. 1).

    dpbench-spectrum                                            # default model and data, batch 256
    dpbench-spectrum model.size=base dataset=cifar10 --batch 1000 --top-k 64 --out fig1
    dpbench-spectrum model=opt model.size=1.3b dataset=sst2 --layers '*layers.*.fc1' --physical 8

At the model's initial (or pretrained) weights, one batch of `--batch` training examples (drawn
with the experiment seed) is read in physical chunks. Each example's gradient is clipped to C
over ALL trainable parameters (flat clipping, as in training; C = inf: no clipping), the clipped
gradients of the chosen layers' weight matrices (`--layers`, fnmatch over module names; default:
the transformer-block Linears DP-GRAPE projects) are summed, N(0, sigma^2 C^2) is added to every
entry and the sum is divided by the batch size. The top-k singular values of each layer's matrix
are averaged over the layers, per index, and plotted for C in --clips and sigma in --sigmas (the
paper: C in {inf, 1}, sigma in {0, 0.5, 2}; sigma > 0 needs a finite C, so C = inf is shown noise
free). Writes spectrum.png and spectrum.json (per-layer values too) into --out.

The noise is a diagnostic, nothing leaves the machine; it is still drawn by
`dpbench.privacy.release.gaussian_release` from an entropy-seeded generator, like every noise
dpbench draws.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from dpbench.errors import UserError
from dpbench.privacy.noise import GaussianNoise


def parse_values(text: str) -> list[float]:
    return [math.inf if v.strip().lower() in ("inf", "infinity", "none") else float(v) for v in text.split(",")]


def settings(clips: list[float], sigmas: list[float]) -> list[tuple[float, float]]:
    """(C, sigma) curves; noise needs a finite C (its std is sigma C)."""
    return [(c, s) for c in clips for s in sigmas if math.isfinite(c) or s == 0]


def clipped_layer_sums(model, task, layers: dict[str, nn.Linear], batch: list[int], physical: int, clips: list[float]):
    """For each C: {layer name: sum_i clip_C(g_i)[layer weight]}, fp32; flat clipping over all parameters."""
    from dpbench.privacy.clipping import clip_factors, per_sample_norms
    from dpbench.privacy.engines import PER_EXAMPLE_GRADIENTS, build_engine
    from dpbench.privacy.layout import LayoutProbe

    engine = build_engine("materialize", model, needs={PER_EXAMPLE_GRADIENTS}, who="dpbench-spectrum",
                          probe=LayoutProbe.of_task(task))
    index = {id(p): i for i, p in enumerate(engine.params)}
    positions = {name: index[id(m.weight)] for name, m in layers.items()}
    sums = {c: {name: torch.zeros_like(m.weight, dtype=torch.float32) for name, m in layers.items()} for c in clips}
    try:
        for start in range(0, len(batch), physical):
            per_sample = engine.backward_per_sample(task.per_sample_loss(model, task.batch(batch[start : start + physical])))
            norms = per_sample_norms(per_sample)
            for c in clips:
                factors = torch.ones_like(norms) if math.isinf(c) else clip_factors(norms, c)
                for name, position in positions.items():
                    sums[c][name] += torch.einsum("b,b...->...", factors, per_sample[position].float())
            del per_sample
    finally:
        engine.detach()
    return sums


def noisy_mean(gradient_sum: torch.Tensor, clip: float, sigma: float, batch_size: int, noise: GaussianNoise) -> torch.Tensor:
    """(sum + N(0, (sigma C)^2)) / B, entrywise, as a DP step would see the layer's gradient: one
    release of the fixed batch (sample rate 1)."""
    from dpbench.privacy.release import ReleasePart, gaussian_release

    std = sigma * clip if sigma > 0 else 0.0
    ((noisy,),), _ = gaussian_release("spectrum", [ReleasePart([gradient_sum], clip, std)], noise=noise,
                                      sample_rate=1.0, neighboring="add_remove")
    return noisy / batch_size


def spectra(sums, batch_size: int, curves: list[tuple[float, float]], top_k: int, noise: GaussianNoise) -> dict:
    """{(C, sigma): {"mean": [k], "layers": {name: [k]}}}: top-k singular values, layer mean per index."""
    results = {}
    for clip, sigma in curves:
        per_layer = {}
        for name, total in sums[clip].items():
            values = torch.linalg.svdvals(noisy_mean(total, clip, sigma, batch_size, noise).double())
            per_layer[name] = values[:top_k].tolist()
        k = min(len(v) for v in per_layer.values())
        mean = [sum(v[i] for v in per_layer.values()) / len(per_layer) for i in range(k)]
        results[(clip, sigma)] = {"mean": mean, "layers": per_layer}
    return results


def label(clip: float, sigma: float) -> str:
    return f"C={'∞' if math.isinf(clip) else format(clip, 'g')}, σ={sigma:g}"


def plot(results: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for (clip, sigma), curve in results.items():
        ax.plot(range(1, len(curve["mean"]) + 1), curve["mean"], label=label(clip, sigma))
    ax.set_yscale("log")
    ax.set_xlabel("singular value index i")
    ax.set_ylabel("s_i (mean over layers)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from dpbench.paths import config_dir
    from dpbench.schema import checked_composition

    with checked_composition(), initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        return hydra_compose(config_name="config", overrides=overrides)


def build(cfg):
    """The task and the model as `dpbench` builds them (same seed: same initial weights)."""
    from dpbench.run import resolve_device, seed_everything
    from dpbench.tasks import build_task

    device = resolve_device(cfg.device)
    seed_everything(cfg.seed)
    task = build_task(cfg, device)
    model = task.build_model(cfg.model)
    return task, model.to(device).train(), device


def run(args) -> dict:
    from dpbench.algorithms.projected_adam import select_projected_modules

    cfg = compose(args.overrides)
    task, model, device = build(cfg)
    layers = select_projected_modules(model, args.layers)
    if not layers:
        raise UserError("no nn.Linear layer matches --layers; list module names with the model's named_modules()")
    if not 0 < args.batch <= task.train_size:
        raise UserError(f"--batch={args.batch} must lie in 1..{task.train_size} (the training set)")
    generator = torch.Generator().manual_seed(int(cfg.seed))
    batch = torch.randperm(task.train_size, generator=generator)[: args.batch].tolist()
    clips, sigmas = parse_values(args.clips), parse_values(args.sigmas)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")  # inputs need no grad
        sums = clipped_layer_sums(model, task, layers, batch, args.physical or args.batch, clips)
    results = spectra(sums, args.batch, settings(clips, sigmas), args.top_k, GaussianNoise(device))
    args.out.mkdir(parents=True, exist_ok=True)
    title = f"{cfg.model.name} on {cfg.dataset.name}: batch {args.batch}, {len(layers)} layers"
    plot(results, args.out / "spectrum.png", title)
    payload = {
        "model": cfg.model.name, "dataset": cfg.dataset.name, "batch_size": args.batch, "top_k": args.top_k,
        "overrides": args.overrides, "layers": list(layers),
        "curves": [{"clip": None if math.isinf(c) else c, "sigma": s, **curve} for (c, s), curve in results.items()],
    }
    (args.out / "spectrum.json").write_text(json.dumps(payload, indent=1))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpbench-spectrum", description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="dpbench config overrides (model=..., dataset=..., seed=...)")
    parser.add_argument("--layers", nargs="+", default=None, help="fnmatch patterns over nn.Linear module names")
    parser.add_argument("--batch", type=int, default=256, help="examples in the batch (the paper: 1000)")
    parser.add_argument("--physical", type=int, default=None, help="examples per backward pass (memory)")
    parser.add_argument("--top-k", type=int, default=64, help="singular values per layer")
    parser.add_argument("--clips", default="inf,1", help="clip norms C, comma separated (inf: no clipping)")
    parser.add_argument("--sigmas", default="0,0.5,2", help="noise multipliers sigma, comma separated")
    parser.add_argument("--out", type=Path, default=Path("outputs/spectrum"), help="folder for spectrum.png/json")
    args = parser.parse_args(argv)
    from dpbench.logging.console import console

    try:
        run(args)
    except UserError as error:
        console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
        return 2
    console.print(f"[dim]wrote {args.out / 'spectrum.png'} and {args.out / 'spectrum.json'}[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
