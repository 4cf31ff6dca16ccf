"""Every per-example engine (algo.per_sample = materialize | ghost | bk) hands the clipping rule
the per-example gradient norms that brute-force autograd gives (one backward per example, 1e-5
relative), on a tiny float64 model of every registered model family: images (vit, cnn, tanh_cnn,
cnn5, resnet9, resnet18) and language (roberta: masked LM, tied decoder; opt: causal LM, tied
head, rows flattened before fc1/fc2). Also the memory forms behind those norms: materialize forms
per-example, not per-row, gradients; bk keeps a tied head and embedding apart; timm's LayerNorm
has a rule of its own rather than functorch; a shared input counts once.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers.config import REPO
from omegaconf import OmegaConf

from dpbench.models import DataSpec, apply_opacus_fixes, build_model
from dpbench.privacy.engines import build_engine

ENGINES = ["materialize", "ghost", "bk"]
IMAGE = DataSpec(num_classes=3, channels=3, image_size=8, patch_size=2)
IMAGE_MODELS = {  # conf/model/<name>.yaml with these overrides: a few thousand parameters each
    "vit": {"size": "micro", "embed_dim": 16, "depth": 2, "num_heads": 2},
    "cnn": {"width": 8, "groups": 2},
    "tanh_cnn": {"hidden": 8, "group_norm": True},
    "cnn5": {"widths": [4, 8, 8], "groups": 2, "hidden": 8},
    "resnet9": {"width": 4, "groups": 2, "affine": True},
    "resnet18": {"groups": 4},
}
LANGUAGE_MODELS = ("roberta", "opt")
VOCAB, TOKENS, BATCH = 40, 6, 3


def image_model(name: str):
    cfg = OmegaConf.merge(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"), IMAGE_MODELS[name])
    torch.manual_seed(0)
    return build_model(cfg, IMAGE).double().train()


def language_model(name: str):
    import transformers

    from dpbench.models.language import AUTO_CLASSES
    from dpbench.models.language import family as language_family

    family = language_family(OmegaConf.create({"name": name}))
    config = transformers.AutoConfig.for_model(family.model_type, vocab_size=VOCAB, **family.tiny_config)
    torch.manual_seed(0)
    model = getattr(transformers, AUTO_CLASSES[family.objective]).from_config(config)
    return apply_opacus_fixes(model, name).double().train()


def image_batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=g)


def token_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, TOKENS), generator=g)  # no <s>, <pad>, </s>: no padding row
    return ids, torch.randint(3, VOCAB, (BATCH, TOKENS), generator=g)


def per_example_loss(name, model, batch) -> torch.Tensor:
    inputs, targets = batch
    if name not in LANGUAGE_MODELS:
        return F.cross_entropy(model(inputs), targets, reduction="none")
    logits = model(input_ids=inputs).logits  # [B, T, V]; every position predicts a target
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(len(inputs), -1).mean(1)


MODELS = {**{name: image_model for name in IMAGE_MODELS}, **{name: language_model for name in LANGUAGE_MODELS}}


def batch_for(name):
    return token_batch() if name in LANGUAGE_MODELS else image_batch()


@functools.lru_cache(maxsize=None)
def brute_force_norms(name: str) -> torch.Tensor:
    """Each example's gradient norm from its own backward pass."""
    model = MODELS[name](name)
    params = [p for p in model.parameters() if p.requires_grad]
    inputs, targets = batch_for(name)
    norms = []
    for i in range(BATCH):
        loss = per_example_loss(name, model, (inputs[i : i + 1], targets[i : i + 1])).sum()
        grads = torch.autograd.grad(loss, params)
        norms.append(torch.sqrt(sum(g.double().pow(2).sum() for g in grads)))
    return torch.stack(norms)


def engine_norms(name: str, mode: str) -> list[torch.Tensor]:
    """The norms the engine hands the clip rule (the `factors_fn` seam), clip factors all 1, in two
    calls: ghost and bk check their coverage against autograd's full backward in the first and
    backpropagate only to the layers' outputs in every later one."""
    model = MODELS[name](name)
    engine = build_engine(mode, model, unprobed=True)
    seen = []

    def factors(norms):
        seen.append(norms.detach().clone())
        return torch.ones_like(norms)

    try:
        for _ in range(2):
            engine.clipped_sum(per_example_loss(name, model, batch_for(name)), factors)
    finally:
        engine.detach()
    return [norms.double() for norms in seen]


@pytest.mark.parametrize("mode", ENGINES)
@pytest.mark.parametrize("name", list(MODELS))
def test_engine_norms_equal_brute_force_autograd(name, mode):
    expected = brute_force_norms(name)
    assert expected.min() > 0
    calls = engine_norms(name, mode)
    assert len(calls) == 2
    for actual in calls:
        assert actual.shape == expected.shape == (BATCH,)
        assert torch.allclose(actual, expected, rtol=1e-5, atol=0), (actual - expected) / expected


def test_materialize_forms_per_example_not_per_row_gradients(monkeypatch):
    """OPT flattens [B, T, d] to [B·T, d] before fc1/fc2: Opacus's samplers alone form one
    gradient per *row* there, [B·T, out, in] (16 GB at batch 16 on the engines benchmark's OPT
    shape), summed per example only afterwards. Every per-sample buffer has B rows."""
    import opacus.grad_sample.grad_sample_module as gsm

    original, leading = gsm.create_or_accumulate_grad_sample, []

    def recording(*, param, grad_sample, max_batch_len):
        leading.append((grad_sample.shape[0], max_batch_len))
        return original(param=param, grad_sample=grad_sample, max_batch_len=max_batch_len)

    monkeypatch.setattr(gsm, "create_or_accumulate_grad_sample", recording)
    model = language_model("opt")
    engine = build_engine("materialize", model, unprobed=True)
    engine.clipped_sum(per_example_loss("opt", model, token_batch()), torch.ones_like)
    engine.detach()
    assert leading and set(leading) == {(BATCH, BATCH)}
    # the largest set of per-example gradients held: B × (parameters), nothing per token
    assert engine.peak_bytes <= BATCH * sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def test_bk_keeps_a_tied_output_layer_and_embedding_apart(monkeypatch):
    """OPT's head is tied to its input embedding: book-keeping adds the two parts' cross term
    (‖A + E‖² = ‖A‖² + ‖E‖² + 2⟨A, E⟩, exact per the norms test above) instead of forming
    two [B, V, d] per-example tables and their sum (3 × 128 MiB at the OPT shape's batch 16)."""
    from dpbench.privacy.pieces import EmbeddingRows

    formed = []
    original = EmbeddingRows.instantiate
    monkeypatch.setattr(EmbeddingRows, "instantiate", lambda self: formed.append(self) or original(self))
    model = language_model("opt")
    head, table = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert head is table
    engine = build_engine("bk", model, unprobed=True)
    sums = engine.clipped_sum(per_example_loss("opt", model, token_batch()), torch.ones_like)
    engine.detach()
    assert not [rows for rows in formed if rows.num_embeddings == VOCAB]
    # with factors 1 the clipped sum is the plain gradient: both parts of the tie are in it
    model.zero_grad()
    per_example_loss("opt", model, token_batch()).sum().backward()
    index = [p for p in model.parameters() if p.requires_grad].index(table)
    assert torch.allclose(sums[index].double(), table.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ENGINES)
def test_timm_layer_norm_gets_a_layer_norm_rule_not_functorch(mode, monkeypatch):
    """timm's LayerNorm subclass (ViT) went whole through functorch, whose vmap holds a layer
    norm's forward and backward for the batch (245 MiB of the ViT shape's bk peak)."""
    import opacus.grad_sample.grad_sample_module as gsm

    from dpbench.privacy import layers

    seen = []

    def recording(original):
        return lambda layer, *args: seen.append(type(layer).__name__) or original(layer, *args)

    monkeypatch.setattr(layers, "ft_compute_per_sample_gradient", recording(layers.ft_compute_per_sample_gradient))
    monkeypatch.setattr(gsm, "ft_compute_per_sample_gradient", recording(gsm.ft_compute_per_sample_gradient))
    model = image_model("vit")
    assert any(type(m).__module__.startswith("timm") and isinstance(m, torch.nn.LayerNorm) for m in model.modules())
    engine = build_engine(mode, model, unprobed=True)
    engine.clipped_sum(per_example_loss("vit", model, image_batch()), torch.ones_like)
    engine.detach()
    assert "LayerNorm" not in seen and "TokenEmbedding" in seen  # functorch still serves what has no rule


def test_bk_counts_an_input_several_layers_keep_once():
    """q, k and v read one input: keeping (a, g) costs each layer its g and a third of a. At
    T·(in + out) = in·out (OPT's attention at 128 tokens, width 256) that tips the choice from
    [B, out, in] per-example tables to (a, g)."""
    from dpbench.privacy.pieces import Instantiated, OuterProduct

    a, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)  # T·(in + out) = 256 = in·out
    assert isinstance(OuterProduct(a, g).compact(input_readers=1), Instantiated)
    assert isinstance(OuterProduct(a, g).compact(input_readers=3), OuterProduct)
