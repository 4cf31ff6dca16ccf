"""ViT size presets (ViT-Ti/S/B names; micro/mini for the CPU) and pretrained fine-tuning from a
local checkpoint the test writes itself (timm's 371k-parameter `test_vit`, 160x160 inputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.config import compose
from omegaconf import OmegaConf

from dpbench.errors import UserError
from dpbench.models import DataSpec, build_model
from dpbench.models.vit import VIT_SIZES, DPViT
from dpbench.run import run_job

SPEC = DataSpec(num_classes=4, channels=1, image_size=8, patch_size=2)


@pytest.mark.parametrize("size,depth,width,heads", [
    ("micro", 2, 64, 4), ("mini", 6, 192, 3), ("tiny", 12, 192, 3), ("small", 12, 384, 6), ("base", 12, 768, 12),
])
def test_size_presets_follow_the_vit_names(size, depth, width, heads):
    preset = VIT_SIZES[size]
    assert (preset["depth"], preset["embed_dim"], preset["num_heads"]) == (depth, width, heads)


def test_default_model_is_the_fast_micro_preset():
    cfg = compose([])
    assert cfg.model.size == "micro"
    model = build_model(cfg.model, DataSpec(num_classes=10, channels=1, image_size=8, patch_size=2))
    assert len(model.blocks) == 2 and model.embed_dim == 64
    assert sum(p.numel() for p in model.parameters()) < 100_000


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A timm `test_vit` with non-default weights, saved as safetensors and as a torch .pth."""
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    source = timm.create_model("test_vit", num_classes=1000)
    with torch.no_grad():
        for p in source.parameters():
            p.add_(0.01 * torch.randn_like(p))
    state = {k: v.contiguous() for k, v in source.state_dict().items()}
    folder = tmp_path_factory.mktemp("vit")
    save_file(state, str(folder / "model.safetensors"))
    torch.save(state, folder / "model.pth")
    return folder, state


def pretrained_cfg(path):
    return OmegaConf.create({"name": "vit", "size": "micro", "pretrained": "test_vit", "path": str(path), "dropout": 0.0})


@pytest.mark.parametrize("filename", ["model.safetensors", "model.pth"])
def test_pretrained_weights_are_loaded_and_the_head_replaced(checkpoint, filename, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub access would fail
    folder, state = checkpoint
    model = build_model(pretrained_cfg(folder / filename), SPEC)
    assert isinstance(model, DPViT) and model.input_resolution == (160, 160)
    loaded = dict(model.named_parameters())
    for name in ("blocks.0.attn.qkv.weight", "blocks.5.mlp.fc2.bias", "norm.weight"):
        assert torch.equal(loaded[name], state[name])
    assert torch.equal(loaded["token_embedding.cls_token"], state["cls_token"])
    assert torch.equal(loaded["token_embedding.pos_embed"], state["pos_embed"])
    # the dataset has one channel: timm sums the RGB filters of the patch embedding
    assert torch.allclose(loaded["patch_embed.proj.weight"], state["patch_embed.proj.weight"].sum(dim=1, keepdim=True))
    assert model.head.weight.shape == (4, 64)  # a new head for the dataset's classes
    assert all(p.requires_grad for p in model.parameters())


def test_pretrained_forward_is_timm_on_the_resized_images(checkpoint):
    import timm

    folder, state = checkpoint
    model = build_model(pretrained_cfg(folder / "model.safetensors"), SPEC).eval()
    reference = timm.create_model("test_vit", num_classes=4, in_chans=1, dynamic_img_size=False).eval()
    reference_state = {k: v for k, v in state.items() if not k.startswith("head.")}
    reference_state["patch_embed.proj.weight"] = state["patch_embed.proj.weight"].sum(dim=1, keepdim=True)
    reference_state["head.weight"], reference_state["head.bias"] = model.head.weight, model.head.bias
    reference.load_state_dict(reference_state)
    images = torch.randn(3, 1, 8, 8)
    resized = F.interpolate(images, size=(160, 160), mode="bilinear", align_corners=False)
    with torch.no_grad():
        assert torch.allclose(model(images), reference(resized), atol=1e-5)


def test_missing_weights_fail_with_one_line(tmp_path):
    for path in (None, tmp_path / "absent.safetensors"):
        with pytest.raises(UserError, match="model.path") as error:
            build_model(pretrained_cfg(path), SPEC)
        assert "\n" not in str(error.value)


@pytest.mark.slow  # a whole run (the fast tier's five minutes)
def test_pretrained_vit_fine_tunes_end_to_end(checkpoint, tiny_cfg, tmp_path):
    folder, _ = checkpoint
    cfg = tiny_cfg("algo=dpadam", "model.pretrained=test_vit", f"model.path={folder / 'model.safetensors'}",
                   "train.batch_size=8", "dataset.test_size=16", "train.lr=1e-3")
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.status == "completed" and 0 < results.privacy.epsilon <= 8
    assert results.memory.parameter_bytes == 4 * sum(
        v.numel() for k, v in checkpoint[1].items() if not k.startswith(("head.", "patch_embed.proj.weight"))
    ) + 4 * (64 * 4 + 4) + 4 * 64 * 16 * 16
