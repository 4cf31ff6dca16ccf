"""The layer catalogue (dpbench/privacy/layers.py): one table of piece rules, resolved along the
module class's MRO, each rule with its piece forms and their rounding bounds.

A subclass that runs its base's forward (a plain subclass; the class FSDP2 swaps in) gets its
base's rule; one with a forward of its own (a channels-first LayerNorm, like timm's LayerNorm2d)
gets none and is instantiated, with the same norms either way. Every table entry has an
adversarial case here: its pieces' forms are the ones its rule declares, and their norm bound
covers both the exact per-example gradient (fp64 autograd) and what the clipped sum releases for
the example, however its tokens cancel.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpbench.privacy.engines import build_engine
from dpbench.privacy.layers import (
    EMBEDDING,
    LAYER_NORM,
    LINEAR,
    RULES,
    PieceRule,
    by_functorch,
    hooked_modules,
    is_layer_norm,
    layer_pieces,
    rule_for,
)
from dpbench.privacy.pieces import Piece
from dpbench.privacy.rounding import exact_arithmetic

D = 8
SLACK = 1.0001  # as tests/privacy/test_norm_rounding.py: the fp32 rounding of the release itself


class PlainLinear(nn.Linear):
    """Only adds an attribute: nn.Linear's forward."""

    tag = "plain"


class PlainLayerNorm(nn.LayerNorm):
    pass


class PlainEmbedding(nn.Embedding):
    pass


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """timm's LayerNorm2d: normalises the channels of [B, C, H, W], a forward of its own."""

    def forward(self, x):
        return F.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps).permute(0, 3, 1, 2)


def fsdp_swapped(module: nn.Module) -> nn.Module:
    """The class swap FSDP2's fully_shard does: a new class (FSDPModule, original class), no forward."""
    from torch.distributed.fsdp import FSDPModule

    module.__class__ = type(f"FSDP{type(module).__name__}", (FSDPModule, type(module)), {})
    return module


# --- resolution along the MRO -------------------------------------------------------------------
def test_a_subclass_with_its_base_forward_gets_its_base_rule():
    assert rule_for(nn.Linear(3, 2)) is LINEAR
    assert rule_for(PlainLinear(3, 2)) is LINEAR
    assert rule_for(PlainLayerNorm(4)) is LAYER_NORM and is_layer_norm(PlainLayerNorm(4))
    assert rule_for(PlainEmbedding(5, 3)) is EMBEDDING
    assert rule_for(fsdp_swapped(nn.Linear(3, 2))) is LINEAR
    assert rule_for(fsdp_swapped(PlainLayerNorm(4))) is LAYER_NORM
    assert not by_functorch(PlainLinear(3, 2)) and not by_functorch(fsdp_swapped(nn.LayerNorm(4)))


def test_a_subclass_with_a_forward_of_its_own_gets_no_rule():
    assert rule_for(ChannelsFirstLayerNorm(4)) is None and not is_layer_norm(ChannelsFirstLayerNorm(4))
    assert by_functorch(ChannelsFirstLayerNorm(4))  # Opacus knows no such class either
    assert rule_for(nn.Conv2d(1, 2, 3)) is None and rule_for(nn.GroupNorm(2, 4)) is None


def test_timm_layer_norms_resolve_by_their_forward():
    from timm.layers.norm import LayerNorm, LayerNorm2d
    from timm.layers.norm_act import LayerNormAct

    assert rule_for(LayerNorm(4)) is LAYER_NORM  # listed: F.layer_norm in a forward of its own
    assert rule_for(fsdp_swapped(LayerNorm(4))) is LAYER_NORM
    assert rule_for(LayerNorm2d(4)) is None  # permutes channels first
    assert rule_for(LayerNormAct(4)) is None  # adds an activation after the norm


def test_a_rule_that_does_not_apply_instantiates():
    """An embedding with max_norm has the embedding's table entry but not its pieces."""
    table = nn.Embedding(6, 3, max_norm=1.0)
    assert rule_for(table) is EMBEDDING and not EMBEDDING.applies(table)
    pieces = layer_pieces(table, [torch.tensor([[1, 2], [3, 3]])], torch.randn(2, 2, 3), 2)
    assert [type(p).__name__ for p in pieces.values()] == ["Instantiated"]


def test_the_hooked_walk_reads_the_table():
    """A subclass with a rule is a known leaf; a module without a rule or sampler is handed whole
    to functorch, its children not walked."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(D))
            self.inner = nn.Linear(D, D)

        def forward(self, x):
            return self.inner(x) * self.scale

    model = nn.Sequential(PlainLinear(D, D), fsdp_swapped(nn.LayerNorm(D)), Block())
    found = hooked_modules(model, {})
    assert found == [model[0], model[1], model[2]]  # not model[2].inner


class SubclassModel(nn.Module):
    """Tokens through a Linear subclass, an FSDP-swapped LayerNorm (`swap`), an embedding
    subclass's rows added, a channels-first LayerNorm on a reshaped view, and a head."""

    def __init__(self, swap=True):
        super().__init__()
        torch.manual_seed(0)
        self.embed = PlainEmbedding(7, D)
        self.lin = PlainLinear(D, D)
        self.norm = fsdp_swapped(nn.LayerNorm(D)) if swap else nn.LayerNorm(D)
        self.channels = ChannelsFirstLayerNorm(D)
        self.head = nn.Linear(D, 3)

    def forward(self, batch):
        x, ids = batch
        h = self.norm(torch.tanh(self.lin(x)) + self.embed(ids))  # [B, 4, D]
        h = self.channels(h.transpose(1, 2).reshape(-1, D, 2, 2))  # [B, D, 2, 2]
        return self.head(h.flatten(2).mean(-1))


def brute_force_norms(model, x, ids):
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(x.shape[0]):
        out = model((x[i : i + 1].double(), ids[i : i + 1]))
        grads = torch.autograd.grad(F.cross_entropy(out, torch.tensor([i % 3])), params)
        norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)))
    return torch.stack(norms)


@pytest.mark.parametrize("mode", ["ghost", "bk"])
def test_engines_give_subclasses_their_base_rule_and_the_right_norms(mode, monkeypatch):
    from dpbench.privacy import layers

    instantiated_by_functorch = []
    original = layers.ft_compute_per_sample_gradient
    monkeypatch.setattr(layers, "ft_compute_per_sample_gradient",
                        lambda layer, *args: instantiated_by_functorch.append(type(layer)) or original(layer, *args))
    g = torch.Generator().manual_seed(1)
    x, ids = torch.randn(5, 4, D, generator=g), torch.randint(0, 7, (5, 4), generator=g)
    expected = brute_force_norms(SubclassModel(swap=False).double(), x, ids)  # seeded: the same weights
    model = SubclassModel()
    engine = build_engine(mode, model, unprobed=True)
    seen = []
    try:
        for _ in range(2):  # the coverage check, then the layer-output backward
            losses = F.cross_entropy(model((x, ids)), torch.arange(5) % 3, reduction="none")
            engine.clipped_sum(losses, lambda norms: seen.append(norms.double()) or torch.ones_like(norms))
    finally:
        engine.detach()
    assert set(instantiated_by_functorch) == {ChannelsFirstLayerNorm}
    for norms in seen:
        assert torch.allclose(norms, expected, rtol=1e-5), (norms, expected)


# --- every rule: declared forms, and a rounding bound that covers an adversarial example ---------
def unit(v: torch.Tensor, norm: float) -> torch.Tensor:
    return v / v.norm() * norm


def cancelling_tokens(g: torch.Generator, scale: float, target: float):
    """Two equal (or nearly equal) rows and output gradients w, −w + ε, |w| = scale, |ε| = target."""
    w, eps = unit(torch.randn(D, generator=g), scale), unit(torch.randn(D, generator=g), target)
    return w, eps


def linear_case(g):
    """Tokens a, a + δ (|a| = 1e4, |δ| = 1) with output gradients v, −v: G = −v δᵀ, 99 · 1."""
    a, delta, v = unit(torch.randn(D, generator=g), 1e4), unit(torch.randn(D, generator=g), 1.0), unit(torch.randn(D, generator=g), 99.0)
    x = torch.stack([torch.stack([a, a + delta]), torch.randn(2, D, generator=g)])
    out = torch.stack([torch.stack([v, -v]), torch.randn(2, D, generator=g)])
    return nn.Linear(D, D), x, out


def embedding_case(g):
    """One id twice, output gradients w and −w + ε (|w| = 1e6): the row's gradient is ε."""
    w, eps = cancelling_tokens(g, 1e6, 99.0)
    ids = torch.tensor([[3, 3], [1, 5]])
    out = torch.stack([torch.stack([w, -w + eps]), torch.randn(2, D, generator=g)])
    return nn.Embedding(7, D), ids, out


def layer_norm_case(g, kind=nn.LayerNorm):
    """One input token twice, output gradients w and −w + ε (|w| = 1e4): weight x̂ ⊙ ε, bias ε."""
    w, eps = cancelling_tokens(g, 1e4, 99.0)
    token = torch.randn(D, generator=g)
    x = torch.stack([torch.stack([token, token]), torch.randn(2, D, generator=g)])
    out = torch.stack([torch.stack([w, -w + eps]), torch.randn(2, D, generator=g)])
    return kind(D), x, out


def timm_layer_norm_case(g):
    from timm.layers.norm import LayerNorm

    return layer_norm_case(g, LayerNorm)


ADVERSARIAL = {  # one per table entry (adding a layer kind adds its case here)
    nn.Linear: linear_case,
    nn.Embedding: embedding_case,
    nn.LayerNorm: layer_norm_case,
    "timm.layers.norm.LayerNorm": timm_layer_norm_case,
}


def test_every_table_entry_has_an_adversarial_case():
    assert set(ADVERSARIAL) == set(RULES)


@pytest.mark.parametrize("key", list(RULES), ids=lambda k: k if isinstance(k, str) else k.__name__)
def test_every_rule_declares_forms_whose_norm_bounds_its_rounding(key):
    rule = RULES[key]
    assert isinstance(rule, PieceRule) and callable(rule.pieces) and rule.forms
    for form in rule.forms:  # a concrete piece form: its norm_sq() is N̂ + E
        assert issubclass(form, Piece) and not getattr(form.norm_sq, "__isabstractmethod__", False)

    for seed in range(3):
        torch.manual_seed(seed)
        module, x, out = ADVERSARIAL[key](torch.Generator().manual_seed(seed))
        assert rule_for(module) is rule
        pieces = layer_pieces(module, [x], out, examples=x.shape[0])
        assert pieces and all(type(piece) in rule.forms for piece in pieces.values())
        with exact_arithmetic(out.device):
            bound = sum(piece.norm_sq() for piece in pieces.values())

        # the exact per-example gradient: fp64 autograd of the layer at the example's input
        exact_module = copy.deepcopy(module).double()
        params = [p for p in exact_module.parameters() if p.requires_grad]
        for i in range(x.shape[0]):
            inputs = x[i : i + 1].double() if x.is_floating_point() else x[i : i + 1]
            grads = torch.autograd.grad(exact_module(inputs), params, grad_outputs=out[i : i + 1].double())
            exact = sum(gr.pow(2).sum() for gr in grads)
            # what the clipped sum releases for example i alone (f = e_i)
            one_hot = torch.zeros(x.shape[0])
            one_hot[i] = 1.0
            released = sum(piece.clipped_sum(one_hot).double().pow(2).sum() for piece in pieces.values())
            assert exact.sqrt() <= SLACK * bound[i].sqrt(), (key, seed, i, exact.sqrt(), bound[i].sqrt())
            assert released.sqrt() <= SLACK * bound[i].sqrt(), (key, seed, i, released.sqrt(), bound[i].sqrt())
            if i == 0:  # the cancelling example: a large gradient from much larger, cancelling terms
                assert exact.sqrt() > 50


def test_the_moved_names_stay_importable_from_the_engine_module():
    from dpbench.privacy import bookkeeping, layers, pieces

    for name in ("Instantiated", "OuterProduct", "EmbeddingRows", "TiedPieces"):
        assert getattr(bookkeeping, name) is getattr(pieces, name)
    assert bookkeeping.is_layer_norm is layers.is_layer_norm
    assert bookkeeping.LinearGradientMap is layers.LinearGradientMap
