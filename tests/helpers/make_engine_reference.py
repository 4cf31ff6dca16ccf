"""The per-example engines' outputs before the split of dpbench/privacy/bookkeeping.py into pieces,
layer catalogue and engine: tests/fixtures/engine_reference.pt, read by tests/privacy/test_engine_reference.py.

This script was run once, at commit 0b73ecf (the commit before the re-cut), with that commit's
dpbench first on the path (a copy of the script outside tests/helpers, run from the worktree):

    git -C /work/main worktree add /tmp/pre_recut 0b73ecf
    cd /tmp/pre_recut && PYTHONPATH=/tmp/pre_recut python /tmp/w/make_engine_reference.py engine_reference.pt

Do not re-run it to "fix" a failing tests/privacy/test_engine_reference.py: the fixture records what the
engines did before the re-cut, and a failure means the current code computes something else. The
test imports the cases below (models, inputs, the clip rule) and recomputes them with the current
code; edit a case only together with a fixture regenerated at that same old commit.

For every case and engine (`algo.per_sample` = materialize | ghost | bk), noise off, two calls of
`clipped_sum` on the same batch (ghost and bk check their coverage in the first and take the
layer-output backward in the second): the per-example norms the clip rule sees, a digest of the
clipped sums (`digest`: small tensors whole, larger ones as their norm and 8 seeded random projections), and
the engine's `peak_bytes`.
"""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import dpbench  # noqa: F401  (before timm: torchvision's compatibility shim)
from dpbench.privacy.clipping import clip_factors
from dpbench.privacy.engines import build_engine

ENGINES = ("materialize", "ghost", "bk")
CALLS = 2
FULL = 16  # tensors up to this many entries are kept whole
PROJECTIONS = 8


# --- models ----------------------------------------------------------------------------------
class TokenLinears(nn.Module):
    """x [B, T, 6]: a Linear over tokens, one Linear called twice (its calls merge), two Linears
    reading one input (the shared input is counted once), a narrow Linear whose T² ≥ in·out (the
    instantiated norm), a head over the mean token."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mix = nn.Linear(8, 8)
        self.left, self.right = nn.Linear(8, 5), nn.Linear(8, 5, bias=False)
        self.narrow = nn.Linear(5, 2)
        self.head = nn.Linear(2, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mix(h)) + 0.5 * self.mix(torch.sin(h)).flip(1)
        h = torch.tanh(self.left(h) * self.right(h))
        return self.head(torch.tanh(self.narrow(h))).mean(dim=1)


class ProjectedPair:
    """A fixed linear map of a Linear layer's per-example weight gradients (DP-GRAPE's form):
    `pair` for ghost and bk, the Opacus grad-sampler signature for materialize."""

    def __init__(self, projector: torch.Tensor, side: str):
        self.projector, self.side = projector, side

    def pair(self, x, delta):
        projector = self.projector.to(delta.dtype)
        x = x.to(delta.dtype)
        return (x, delta @ projector) if self.side == "left" else (x @ projector, delta)

    def __call__(self, module, activations, backprops):
        a, g = self.pair(activations[0], backprops)
        grads = {module.weight: torch.einsum("b...o,b...i->boi", g, a)}
        if module.bias is not None and module.bias.requires_grad:
            grads[module.bias] = torch.einsum("b...o->bo", backprops)
        return grads

    def map_gradient(self, param, gradient):
        if param.dim() != 2:
            return gradient
        return self.projector.t() @ gradient if self.side == "left" else gradient @ self.projector


class Rows(nn.Module):
    """Token ids [R, T] -> Embedding (padding row 0) -> Linear -> LayerNorm -> output Linear,
    optionally tied to the embedding table; a score per row."""

    def __init__(self, tied: bool, vocab=11, dim=6):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.out.weight = self.embed.weight

    def forward(self, ids):
        h = self.norm(torch.tanh(self.mix(self.embed(ids))))
        return self.out(h).logsumexp(-1).mean(-1)


class WideHead(nn.Module):
    """x [B, 12, 8] -> Linear(8, 16000): γ_width · T over the fp32 limit, so ghost's Gram of the
    output side takes the |g| bound and book-keeping instantiates."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16000)

    def forward(self, x):
        return self.head(torch.tanh(self.proj(x))).logsumexp(-1).mean(-1)


def tiny_cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh(), nn.AvgPool2d(2),
        nn.Conv2d(4, 6, 3, padding=1), nn.GroupNorm(2, 6), nn.Tanh(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 3),
    )


def tiny_vit():
    from dpbench.models.vit import DPViT

    return DPViT(img_size=8, patch_size=2, in_chans=1, num_classes=3, embed_dim=16, depth=2, num_heads=2,
                 mlp_ratio=3.0, global_pool="token")


def tiny_opt():
    import transformers

    from dpbench.models import apply_opacus_fixes

    config = transformers.OPTConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, ffn_dim=32, word_embed_proj_dim=16,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return apply_opacus_fixes(transformers.OPTForCausalLM(config), "opt")


# --- cases -----------------------------------------------------------------------------------
@dataclass
class Case:
    model: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], tuple]  # the inputs, from a generator seeded with `seed`
    loss: Callable[[nn.Module, tuple], torch.Tensor]  # per-example losses [B]
    seed: int
    dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None  # the forward under CPU autocast
    overrides: Callable[[nn.Module, torch.Generator], dict] | None = None


def _classify(model, batch):
    x, y, w = batch
    return w * F.cross_entropy(model(x), y, reduction="none")


def _tokens(generator, weights=None):
    x = torch.randn(5, 4, 6, generator=generator)
    return x, torch.randint(0, 3, (5,), generator=generator), torch.ones(5) if weights is None else weights


def _one_infinite(generator):
    weights = torch.ones(5)
    weights[2] = math.inf
    return _tokens(generator, weights)


def _projected(model, generator):
    """mix (8 -> 8) projected on the left, left (8 -> 5) on the right, rank 3."""
    return {model.mix: ProjectedPair(torch.randn(8, 3, generator=generator) / math.sqrt(3), "left"),
            model.left: ProjectedPair(torch.randn(8, 3, generator=generator) / math.sqrt(3), "right")}


def _rows_batch(generator):  # 4 examples of 3 candidate rows of 5 tokens (id 0 pads)
    return torch.randint(0, 11, (4, 3, 5), generator=generator), torch.randint(0, 3, (4,), generator=generator)


def _rows_loss(model, batch):
    ids, labels = batch
    scores = model(ids.reshape(-1, ids.shape[-1])).view(ids.shape[0], ids.shape[1])  # example-major rows
    return F.cross_entropy(scores.float(), labels, reduction="none")


def _image_batch(generator):
    return torch.randn(4, 1, 8, 8, generator=generator), torch.randint(0, 3, (4,), generator=generator), torch.ones(4)


def _wide_batch(generator):
    return (torch.randn(3, 12, 8, generator=generator),)


def _wide_loss(model, batch):
    return model(batch[0])


def _token_batch(generator):
    ids = torch.randint(3, 40, (3, 6), generator=generator)
    return ids, torch.randint(3, 40, (3, 6), generator=generator)


def _lm_loss(model, batch):
    ids, targets = batch
    logits = model(input_ids=ids).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none").view(len(ids), -1).mean(1)


CASES: dict[str, Case] = {
    "token_linears": Case(TokenLinears, _tokens, _classify, seed=11),
    "token_linears_fp64": Case(TokenLinears, _tokens, _classify, seed=12, dtype=torch.float64),
    "token_linears_one_infinite": Case(TokenLinears, _one_infinite, _classify, seed=13),
    "token_linears_projected": Case(TokenLinears, _tokens, _classify, seed=14, overrides=_projected),
    "rows_embedding_layer_norm": Case(lambda: Rows(tied=False), _rows_batch, _rows_loss, seed=15),
    "rows_tied": Case(lambda: Rows(tied=True), _rows_batch, _rows_loss, seed=16),
    "rows_tied_bf16": Case(lambda: Rows(tied=True), _rows_batch, _rows_loss, seed=17, autocast=torch.bfloat16),
    "wide_head": Case(WideHead, _wide_batch, _wide_loss, seed=18),
    "cnn_conv_group_norm": Case(tiny_cnn, _image_batch, _classify, seed=19),
    "vit": Case(tiny_vit, _image_batch, _classify, seed=20),
    "opt": Case(tiny_opt, _token_batch, _lm_loss, seed=21),
}


# --- running and digesting -------------------------------------------------------------------
def run(name: str, engine_name: str, seed: int | None = None) -> dict:
    """One case through one engine: {"norms": [CALLS × B], "sums": [a digest per call], "peak_bytes"}."""
    case = CASES[name]
    seed = case.seed if seed is None else seed
    torch.manual_seed(seed)
    model = case.model().to(case.dtype).train()
    generator = torch.Generator().manual_seed(seed)
    batch = tuple(t.to(case.dtype) if t.is_floating_point() else t for t in case.batch(generator))
    overrides = case.overrides(model, generator) if case.overrides else {}
    engine = build_engine(engine_name, model, overrides, unprobed=True)
    if case.autocast is not None and hasattr(engine, "tolerance"):
        engine.tolerance = 2e-2  # as a run under autocast sets it (dpbench/algorithms/base.py)
    norms, sums = [], []

    def factors(values):
        norms.append(values.detach().double().clone())
        finite = values[torch.isfinite(values)]
        return clip_factors(values, float(finite.median()))  # about half the examples clipped

    try:
        for _ in range(CALLS):
            if case.autocast is not None:
                with torch.autocast("cpu", dtype=case.autocast):
                    losses = case.loss(model, batch)
            else:
                losses = case.loss(model, batch)
            sums.append(digest(engine.clipped_sum(losses, factors)))
    finally:
        engine.detach()
    return {"norms": torch.stack(norms), "sums": sums, "peak_bytes": int(engine.peak_bytes)}


def digest(tensors: list[torch.Tensor]) -> dict:
    """The sums in one float64 vector: per tensor its entries if it has at most FULL, else
    [‖t‖, its projections on PROJECTIONS seeded unit directions]; `sizes` the tensors' numels."""
    parts, sizes = [], []
    for index, t in enumerate(tensors):
        flat = t.detach().double().flatten()
        sizes.append(flat.numel())
        if flat.numel() <= FULL:
            parts.append(flat)
            continue
        directions = torch.randn(PROJECTIONS, flat.numel(), generator=torch.Generator().manual_seed(1000 + index),
                                 dtype=torch.float64)
        directions /= directions.norm(dim=1, keepdim=True)
        parts.append(torch.cat([flat.norm().view(1), directions @ flat]))
    return {"values": torch.cat(parts), "sizes": sizes}


def segments(sizes: list[int]):
    """(start, end, whole) of each tensor's part of a digest's `values`."""
    start = 0
    for size in sizes:
        length = size if size <= FULL else 1 + PROJECTIONS
        yield start, start + length, size <= FULL
        start += length


def main(path: str) -> None:
    import dpbench.privacy.bookkeeping as engine_module

    results = {name: {engine: run(name, engine) for engine in ENGINES} for name in CASES}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                            cwd=Path(engine_module.__file__).parent).stdout.strip()
    payload = {
        "seeds": {name: case.seed for name, case in CASES.items()},
        "results": results,
        "made_with": {"commit": commit, "torch": torch.__version__, "engine_module": engine_module.__file__,
                      "full": FULL, "projections": PROJECTIONS, "calls": CALLS},
    }
    torch.save(payload, path)
    print(f"{path}: {Path(path).stat().st_size} bytes, commit {commit}, dpbench from {engine_module.__file__}")


if __name__ == "__main__":
    main(sys.argv[1])
