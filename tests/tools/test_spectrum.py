"""dpbench-spectrum: clipped layer-gradient sums against per-example autograd, the noise's
scale, and the command writing its plot and JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from scipy import stats

from dpbench.models.vit import DPViT
from dpbench.privacy.noise import GaussianNoise
from dpbench.tools.spectrum import clipped_layer_sums, main, noisy_mean, settings

# the reference per-example autograd calls fire Opacus hooks on inputs without grad: harmless
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


class TensorTask:
    def __init__(self, n=10):
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 1, 8, 8, generator=generator), torch.randint(0, 3, (n,), generator=generator)
        self.train_size = n

    def batch(self, indices):
        return self.x[indices], self.y[indices]

    def per_sample_loss(self, model, batch):
        return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def test_clipped_sums_equal_per_example_autograd_with_flat_clipping():
    torch.manual_seed(0)
    model = DPViT(img_size=8, patch_size=2, in_chans=1, num_classes=3, embed_dim=16, depth=1, num_heads=2, global_pool="token")
    task = TensorTask()
    layers = {"blocks.0.mlp.fc1": model.blocks[0].mlp.fc1, "blocks.0.attn.qkv": model.blocks[0].attn.qkv}
    params = [p for p in model.parameters() if p.requires_grad]
    expected = {math.inf: {n: 0 for n in layers}, 0.05: {n: 0 for n in layers}}
    for i in range(10):
        loss = task.per_sample_loss(model, task.batch([i])).sum()
        grads = dict(zip(map(id, params), torch.autograd.grad(loss, params)))
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))  # over ALL parameters
        for name, module in layers.items():
            expected[math.inf][name] = expected[math.inf][name] + grads[id(module.weight)]
            expected[0.05][name] = expected[0.05][name] + grads[id(module.weight)] * min(1.0, 0.05 / norm)
    sums = clipped_layer_sums(model, task, layers, list(range(10)), physical=4, clips=[math.inf, 0.05])
    for clip in expected:
        for name in layers:
            assert torch.allclose(sums[clip][name], expected[clip][name], atol=1e-5), (clip, name)


def test_noise_has_std_sigma_c_over_b_and_needs_a_finite_clip():
    values = noisy_mean(torch.zeros(64, 48), clip=0.5, sigma=2.0, batch_size=4, noise=GaussianNoise("cpu"))
    statistic = values.pow(2).sum().item() / (2.0 * 0.5 / 4) ** 2  # ~ chi2(64 * 48)
    low, high = stats.chi2.ppf([1e-4, 1 - 1e-4], values.numel())
    assert low < statistic < high
    assert settings([math.inf, 1.0], [0.0, 0.5, 2.0]) == [(math.inf, 0.0), (1.0, 0.0), (1.0, 0.5), (1.0, 2.0)]


def test_command_writes_the_plot_and_noise_flattens_the_spectrum(tmp_path):
    assert main(["dataset=synthetic", "--batch", "64", "--physical", "32", "--top-k", "16", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "spectrum.png").stat().st_size > 10_000
    payload = json.loads((tmp_path / "spectrum.json").read_text())
    curves = {(c["clip"], c["sigma"]): c["mean"] for c in payload["curves"]}
    assert set(curves) == {(None, 0.0), (1.0, 0.0), (1.0, 0.5), (1.0, 2.0)}
    assert len(payload["layers"]) == 8 and all(len(v) == 16 for v in curves.values())
    flatness = {key: values[-1] / values[0] for key, values in curves.items()}  # s_16 / s_1
    assert flatness[(1.0, 2.0)] > 10 * flatness[(1.0, 0.0)]
    assert main(["dataset=synthetic", "--layers", "nothing.*", "--out", str(tmp_path)]) == 2
