"""algo.per_sample=ghost|bk clip with a norm that bounds what is summed, rounding included.

The engines compute per-example norms by Gram identities (‖Σ_t g_tᵀ a_t‖² = Σ_ts (a_t·a_s)(g_t·g_s)),
which cancel catastrophically when an example's tokens nearly cancel: two tokens a and a + δ
(|a| = 1e4, |δ| = 1) with output gradients v and −v have ‖G‖ = ‖v‖ while the fp32 identity gave 0,
and the engines released 99·C for a one-example batch. Every piece form now clips with N̂ + E, E a
bound on |N̂ − ‖G‖²| for the arithmetic used: checked here against exact fp64 norms over random and
adversarial inputs, and end to end (noise off) for a Linear, an embedding, a tied output layer and
embedding, and a LayerNorm, in fp32 and under bf16 autocast.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.projected import TensorTask, build
from torch import nn

from dpbench.privacy.clipping import clip_factors
from dpbench.privacy.engines import build_engine

MODES = ["ghost", "bk"]
CLIP = 1.0
SLACK = 1.0001  # released norm ≤ SLACK · C (fp32 summation of the release itself)
D = 8


# --- models whose per-example loss is linear in the parameters' outputs (exact output gradients) ---
class TwoTokenLinear(nn.Module):
    """x [B, 3, d]: tokens a, a + δ and v. Loss v · (y_0 − y_1): G = v (a − (a + δ))ᵀ = −v δᵀ."""

    def __init__(self, d=D):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, x):
        y = self.lin(x[:, :2])
        return ((y[:, 0] - y[:, 1]) * x[:, 2].to(y.dtype)).sum(-1)


class EqualIdRows(nn.Module):
    """x [B, 2, d + 1]: column 0 the token id (both tokens one id), then w and w − ε per token.
    Loss e[id]·w − e[id]·(w − ε): the row's gradient is ε, the terms ±w cancel."""

    def __init__(self, vocab=16, d=D):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)

    def forward(self, x):
        ids, weights = x[:, :, 0].long(), x[:, :, 1:]
        rows = self.embed(ids)  # [B, 2, d]
        return (rows[:, 0] * weights[:, 0]).sum(-1) - (rows[:, 1] * weights[:, 1]).sum(-1)


class TiedCancelling(nn.Module):
    """An output layer tied to the embedding: x [B, 2, d] holds an input z (with the token id in an
    extra column) and c. Loss logit_id(z) + e[id]·c: G[id] = z + c, with c = −z + ε the parts
    (|z| = 1e4) cancel in the cross term."""

    def __init__(self, vocab=16, d=D):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, x):
        ids = x[:, 0, -1].long().unsqueeze(1)  # [B, 1]
        z, c = x[:, 0:1, :-1], x[:, 1, :-1]
        logits = self.out(z)[:, 0]  # [B, V]
        rows = self.embed(ids)[:, 0]  # [B, d]
        return logits.gather(1, ids)[:, 0] + (rows * c.to(rows.dtype)).sum(-1)


class TokensLayerNorm(nn.Module):
    """A LayerNorm over two equal tokens whose output gradients are w and −w + ε (weight gradient
    x̂ ⊙ ε, bias gradient ε): x [B, 3, d], rows: the token, w, w − ε."""

    def __init__(self, d=D):
        super().__init__()
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        y = self.norm(x[:, :1].expand(-1, 2, -1))
        return (y[:, 0] * x[:, 1].to(y.dtype)).sum(-1) - (y[:, 1] * x[:, 2].to(y.dtype)).sum(-1)


class LossTask(TensorTask):
    """The model's output is the per-example loss."""

    def per_sample_loss(self, model, batch):
        x, _, w = batch
        return w * model(x)


def unit(v: torch.Tensor, norm: float) -> torch.Tensor:
    return v / v.norm() * norm


def two_token_input(seed, scale=1e4, target=99.0, axis=False):
    g = torch.Generator().manual_seed(seed)
    if axis:  # a and a + δ exact in fp32: the fp32 identity cancels to exactly 0
        a, delta = torch.zeros(D), torch.zeros(D)
        a[0], delta[1 + seed % (D - 1)] = scale, 1.0
    else:
        a, delta = unit(torch.randn(D, generator=g), scale), unit(torch.randn(D, generator=g), 1.0)
    v = unit(torch.randn(D, generator=g), target)
    return torch.stack([a, a + delta, v])  # [3, d]: ‖G‖ = ‖v‖ ‖δ‖ = target


def equal_id_input(seed, scale=1e6, target=99.0):
    g = torch.Generator().manual_seed(seed)
    w, eps = unit(torch.randn(D, generator=g), scale), unit(torch.randn(D, generator=g), target)
    token = float(1 + seed % 15)
    return torch.stack([torch.cat([torch.tensor([token]), w]), torch.cat([torch.tensor([token]), w - eps])])


def tied_input(seed, scale=1e4, target=99.0):
    g = torch.Generator().manual_seed(seed)
    z, eps = unit(torch.randn(D, generator=g), scale), unit(torch.randn(D, generator=g), target)
    token = float(seed % 16)
    return torch.stack([torch.cat([z, torch.tensor([token])]), torch.cat([-z + eps, torch.tensor([token])])])


def layer_norm_input(seed, scale=1e4, target=99.0):
    g = torch.Generator().manual_seed(seed)
    x, w, eps = torch.randn(D, generator=g), unit(torch.randn(D, generator=g), scale), unit(torch.randn(D, generator=g), target)
    return torch.stack([x, w, w - eps])


ID_COLUMNS = {"embedding": 0, "tied": -1}


def ordinary(like: torch.Tensor, seed: int, case: str) -> torch.Tensor:
    """An example of the same layout without cancellation: small random entries, its ids kept."""
    x = torch.randn(like.shape, generator=torch.Generator().manual_seed(100 + seed))
    if case in ID_COLUMNS:
        x[:, ID_COLUMNS[case]] = like[:, ID_COLUMNS[case]]
    return x


CASES = {  # model, one adversarial example
    "linear": (TwoTokenLinear, two_token_input),
    "linear_axis": (TwoTokenLinear, lambda seed: two_token_input(seed, axis=True)),
    "embedding": (EqualIdRows, equal_id_input),
    "tied": (TiedCancelling, tied_input),
    "layer_norm": (TokensLayerNorm, layer_norm_input),
}


def exact_norms(model_fn, x) -> torch.Tensor:
    """Each example's gradient norm, autograd in fp64 on the fp32 inputs (exact up to 1e-15)."""
    torch.manual_seed(0)
    model = model_fn().double()
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(model(x[i : i + 1].double()).sum(), params)
        norms.append(torch.sqrt(sum(gr.pow(2).sum() for gr in grads)))
    return torch.stack(norms)


def released(model_fn, x, mode, precision=None):
    """The clipped sum DP-SGD releases before noise (σ = 0), flattened."""
    torch.manual_seed(0)
    task = LossTask(x, torch.zeros(len(x), dtype=torch.long))
    algo = build("dpsgd", model_fn(), task, clip=CLIP, per_sample=mode, momentum=0.0)
    if precision is not None:
        algo.use_precision(precision)
    sums, _ = algo.clip_and_accumulate([task.batch(range(len(x)))])
    return torch.cat([s.double().flatten() for s in sums])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_one_cancelling_example_releases_at_most_c(case, mode):
    """bk and ghost released 99.2·C for the two-token Linear example (fp32 identity ≈ 0)."""
    model_fn, make = CASES[case]
    for seed in range(4):
        x = make(seed).unsqueeze(0)
        assert exact_norms(model_fn, x).item() > 50 * CLIP  # it must be clipped
        norm = released(model_fn, x, mode).norm().item()
        assert norm <= SLACK * CLIP, f"seed {seed}: released {norm / CLIP:.2f}·C"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_each_example_of_a_batch_contributes_at_most_c(case, mode):
    """Adversarial and ordinary examples together: f_i ‖G_i‖ ≤ C for every one (the norms the
    engine hands the clip rule, seen at the factors seam), in two calls (coverage check, then the
    steady path)."""
    model_fn, make = CASES[case]
    x = torch.stack([make(7), *(ordinary(make(seed), seed, case) for seed in range(3)), make(8)])
    expected = exact_norms(model_fn, x)
    torch.manual_seed(0)
    model = model_fn()
    engine = build_engine(mode, model, unprobed=True)
    seen = []

    def factors(norms):
        f = clip_factors(norms, CLIP)
        seen.append(f.detach().double())
        return f

    try:
        for _ in range(2):
            engine.clipped_sum(model(x), factors)
    finally:
        engine.detach()
    for f in seen:
        contributions = f * expected
        assert (contributions <= SLACK * CLIP).all(), contributions


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", ["linear", "linear_axis", "embedding", "tied", "layer_norm"])
def test_bf16_autocast_release_is_clipped(case, mode):
    """Under bf16 autocast the kept inputs and output gradients are bf16; their widening is exact
    and norms and sums run with autocast off, so the fp32 bound holds for what is summed."""
    from dpbench.precision import Precision

    model_fn, make = CASES[case]
    x = make(1).unsqueeze(0)
    norm = released(model_fn, x, mode, Precision("bf16", "cpu")).norm().item()
    assert norm <= SLACK * CLIP, f"released {norm / CLIP:.2f}·C"


# --- the bounds themselves, against exact fp64 norms ------------------------------------------
def exact_outer(a, g):
    """‖Σ_t g_tᵀ a_t‖² per example in fp64, and a bound on that reference's own rounding."""
    instantiated = torch.einsum("bto,bti->boi", g.double(), a.double())
    spread = (a.double().norm(dim=-1) * g.double().norm(dim=-1)).sum(1)
    return instantiated.flatten(1).pow(2).sum(1), 4 * a.shape[1] * 2.0**-53 * spread.pow(2)


def outer_inputs():
    """(a, g) pairs [B, T, in], [B, T, out]: random, cancelling tokens, a common large component,
    huge and tiny scales, and shapes that take the instantiated route (T² ≥ in·out)."""
    g = torch.Generator().manual_seed(0)
    yield torch.randn(4, 6, 5, generator=g), torch.randn(4, 6, 7, generator=g)
    yield torch.randn(3, 17, 16, generator=g) * 3, torch.randn(3, 17, 48, generator=g) * 1e-3
    for seed in range(6):
        x = torch.stack([two_token_input(seed, axis=seed % 2 == 0), two_token_input(seed + 10, scale=1e6)])
        yield x[:, :2], torch.stack([x[:, 2], -x[:, 2]], 1)
    common = torch.randn(1, 1, 12, generator=g) * 1e4
    a = common + torch.randn(2, 10, 12, generator=g)
    sign = torch.tensor([1.0, -1.0] * 5).view(1, 10, 1)
    yield a, sign * torch.randn(2, 1, 9, generator=g) + 1e-3 * torch.randn(2, 10, 9, generator=g)
    yield torch.randn(2, 5, 6, generator=g) * 1e-20, torch.randn(2, 5, 4, generator=g) * 1e-20
    yield torch.randn(2, 9, 3, generator=g) * 1e4, torch.stack([torch.randn(2, 3, generator=g)] * 9, 1) * torch.tensor([1.0, -1.0] * 4 + [0.0]).view(1, 9, 1)


def test_outer_product_bound_covers_the_exact_norm():
    from dpbench.privacy.pieces import OuterProduct

    for a, g in outer_inputs():
        estimate, error, _ = OuterProduct(a, g).bounds()
        exact, reference_error = exact_outer(a, g)
        assert (error >= 0).all()
        assert ((estimate - exact).abs() <= error + reference_error).all(), (estimate, exact, error)
        assert (OuterProduct(a, g).norm_sq() >= exact - reference_error).all()


def test_the_fp32_identity_alone_misses_the_cancelling_norm():
    """The old computation (fp32 Grams, clamped at 0) for the two-token example: ≈ 0 against 99²."""
    x = two_token_input(0, axis=True).unsqueeze(0)
    a, g = x[:, :2], torch.stack([x[:, 2], -x[:, 2]], 1)
    old = (torch.bmm(a, a.transpose(1, 2)) * torch.bmm(g, g.transpose(1, 2))).sum(dim=(1, 2)).clamp(min=0)
    exact, _ = exact_outer(a, g)
    assert old.item() < 0.01 * exact.item()
    from dpbench.privacy.pieces import OuterProduct

    assert OuterProduct(a, g).norm_sq().item() >= exact.item()


def test_typical_norms_are_inflated_by_less_than_a_thousandth():
    """Random ViT-like tokens (65 tokens, 192 -> 576): E stays below 0.1% of ‖G‖²."""
    from dpbench.privacy.pieces import OuterProduct

    g = torch.Generator().manual_seed(0)
    a, grads = torch.randn(4, 65, 192, generator=g), torch.randn(4, 65, 576, generator=g)
    estimate, error, _ = OuterProduct(a, grads).bounds()
    assert (error <= 1e-3 * estimate).all(), error / estimate


def embedding_inputs():
    g = torch.Generator().manual_seed(1)
    yield torch.randint(0, 5, (3, 12), generator=g), torch.randn(3, 12, 6, generator=g)
    for seed in range(4):
        rows = equal_id_input(seed)
        yield rows[:, 0].long().view(1, 2), torch.stack([rows[0, 1:], -rows[1, 1:]]).unsqueeze(0)
    w = torch.randn(1, 1, 6, generator=g) * 1e5
    yield torch.zeros(1, 8, dtype=torch.long), w * torch.tensor([1.0, -1.0] * 4).view(1, 8, 1) + torch.randn(1, 8, 6, generator=g)


def test_embedding_bound_covers_the_exact_norm():
    from dpbench.privacy.pieces import EmbeddingRows

    for ids, g in embedding_inputs():
        rows = EmbeddingRows(ids, g, 16)
        estimate, error, spread = rows.bounds()
        exact = torch.zeros(ids.shape[0], 16, g.shape[2], dtype=torch.float64).scatter_add_(
            1, ids.unsqueeze(-1).expand(-1, -1, g.shape[2]), g.double()).flatten(1).pow(2).sum(1)
        reference_error = 4 * ids.shape[1] * 2.0**-53 * spread
        assert ((estimate - exact).abs() <= error + reference_error).all(), (estimate, exact, error)


def test_tied_cross_term_bound_covers_the_exact_inner_product():
    from dpbench.privacy.pieces import EmbeddingRows, OuterProduct, TiedPieces, _outer_embedding_cross

    g = torch.Generator().manual_seed(2)
    vocab = 16
    cases = [(torch.randn(2, 5, D, generator=g), torch.randn(2, 5, vocab, generator=g),
              torch.randint(0, vocab, (2, 4), generator=g), torch.randn(2, 4, D, generator=g))]
    for seed in range(4):
        x = tied_input(seed)
        token = int(x[0, -1])
        one_hot = torch.zeros(1, 1, vocab)
        one_hot[0, 0, token] = 1.0
        cases.append((x[0:1, :-1].unsqueeze(0), one_hot, torch.tensor([[token]]), x[1:2, :-1].unsqueeze(0)))
    for a, out_g, ids, rows_g in cases:
        outer, rows = OuterProduct(a, out_g), EmbeddingRows(ids, rows_g, vocab)
        cross, error = _outer_embedding_cross(outer, rows)
        parts = [torch.einsum("bto,bti->boi", out_g.double(), a.double()),
                 torch.zeros(a.shape[0], vocab, D, dtype=torch.float64).scatter_add_(
                     1, ids.unsqueeze(-1).expand(-1, -1, D), rows_g.double())]
        exact = (parts[0] * parts[1]).flatten(1).sum(1)
        scale = (a.double().norm(dim=-1).sum(1) * out_g.double().norm(dim=-1).sum(1) * rows_g.double().norm(dim=-1).sum(1))
        assert ((cross - exact).abs() <= error + 1e-12 * scale).all(), (cross, exact, error)
        total = (parts[0] + parts[1]).flatten(1).pow(2).sum(1)
        assert (TiedPieces(outer, rows).norm_sq() >= total * (1 - 1e-12)).all()


def test_instantiated_bound_covers_the_exact_sum_of_squares():
    from dpbench.privacy.pieces import Instantiated

    g = torch.Generator().manual_seed(3)
    for x in (torch.randn(3, 7, generator=g), torch.randn(2, 64, 300, generator=g) * 1e10, torch.randn(2, 4, 3, 3, generator=g),
              torch.randn(2, 5, generator=g).to(torch.bfloat16), torch.randn(2, 6, generator=g) * 1e-30):
        bound = Instantiated(x).norm_sq()
        assert (bound >= x.double().flatten(1).pow(2).sum(1)).all()


def test_reduced_precision_matmul_bound():
    """Under a reduced fp32 matmul mode (TF32 / bf16 passes) the Gram inputs may be rounded to 8
    significant bits: the bound takes ε_n = (1 + 2⁻⁸)² (1 + γ_n) − 1 and still covers a Gram
    formed from bf16-rounded inputs."""
    from dpbench.privacy.pieces import _gram_norm_sq

    previous = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        for a, g in outer_inputs():
            _, error, _ = _gram_norm_sq(a, g)
            rounded_a, rounded_g = a.bfloat16().float(), g.bfloat16().float()
            gram = torch.bmm(rounded_a, rounded_a.transpose(1, 2)).double() * torch.bmm(rounded_g, rounded_g.transpose(1, 2)).double()
            exact, reference_error = exact_outer(a, g)
            assert ((gram.sum(dim=(1, 2)) - exact).abs() <= error + reference_error).all()
    finally:
        torch.set_float32_matmul_precision(previous)


def test_norm_bound_is_rounded_up_to_fp32():
    from dpbench.privacy.rounding import round_down_fp32, round_up_fp32

    x = torch.tensor([1.0 + 2.0**-40, 3.0, 1e-300, math.inf], dtype=torch.float64)
    assert (round_up_fp32(x).double() >= x).all()
    assert (round_down_fp32(x[:3]).double() <= x[:3]).all()
