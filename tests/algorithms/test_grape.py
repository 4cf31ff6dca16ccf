"""DP-GRAPE, naive DP-GaLore and GaLore: projected per-sample gradients against torch.func,
projector bookkeeping, sensitivity, noise, equivalence with DP-Adam, and the Table 2 memory."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.config import TINY, compose
from helpers.projected import TensorTask, build, image_task, tiny_vit
from torch import nn

from dpbench.algorithms.projected_adam import project, select_projected_modules
from dpbench.logging.results import read_results
from dpbench.run import run_job


# --- projected per-sample gradients ------------------------------------------------------------


class LinearNet(nn.Module):
    """`lin` is the projected layer; `reuse` applies it twice (Opacus must accumulate)."""

    def __init__(self, d_in, d_out, reuse=False):
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.head = nn.Linear(d_out, 2)
        self.reuse = reuse

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.reuse:
            h = torch.tanh(self.lin(h))
        out = self.head(h)
        return out.mean(1) if out.dim() == 3 else out


@pytest.mark.parametrize("seq_len", [None, 5])
@pytest.mark.parametrize("d_in,d_out,reuse", [(7, 3, False), (3, 7, False), (6, 6, True)])
def test_projected_per_sample_grads_equal_projection_of_reference(seq_len, d_in, d_out, reuse):
    torch.manual_seed(0)
    model = LinearNet(d_in, d_out, reuse)
    reference = copy.deepcopy(model)
    batch = 4
    x = torch.randn(batch, *((seq_len,) if seq_len else ()), d_in)
    y = torch.randn(batch, 2)
    task = TensorTask(x, y, loss="mse")
    algo = build("grape", model, task, rank=2, projected_modules=["lin"])
    projection = algo.projections[model.lin.weight]
    assert projection.side == ("left" if d_out <= d_in else "right")

    per_sample = algo.engine.backward_per_sample(task.per_sample_loss(model, task.batch(range(batch))))
    got = dict(zip(algo.params, per_sample))

    params = {k: v.detach() for k, v in reference.named_parameters()}

    def loss_one(p, xi, yi):
        out = torch.func.functional_call(reference, p, (xi.unsqueeze(0),))
        return (out - yi.unsqueeze(0)).pow(2).sum()

    expected = torch.func.vmap(torch.func.grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    projector = algo.projector(projection, "cpu")
    want = project(expected["lin.weight"], projector, projection.side)
    assert got[model.lin.weight].shape == (batch, *projection.projected_shape)
    torch.testing.assert_close(got[model.lin.weight], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[model.lin.bias], expected["lin.bias"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[model.head.weight], expected["head.weight"], rtol=1e-5, atol=1e-6)


def test_default_patterns_pick_transformer_block_linears_only():
    from transformers import OPTConfig, OPTForSequenceClassification, RobertaConfig, RobertaForSequenceClassification

    vit = select_projected_modules(tiny_vit(), None)
    assert sorted(vit) == sorted(f"blocks.{i}.{n}" for i in range(2) for n in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"))
    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50)
    roberta = select_projected_modules(RobertaForSequenceClassification(RobertaConfig(**small)), None)
    assert sorted(n.split("layer.0.")[1] for n in roberta) == sorted(
        ["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
         "intermediate.dense", "output.dense"]
    )
    opt = OPTForSequenceClassification(
        OPTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32, vocab_size=50,
                  word_embed_proj_dim=16, max_position_embeddings=32)
    )
    names = select_projected_modules(opt, None)
    assert sorted(n.split("layers.0.")[1] for n in names) == sorted(
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj", "fc1", "fc2"]
    )


# --- projectors: identical in hook and update, refreshed exactly every F steps -----------------------


def test_projector_in_update_is_the_hooks_and_changes_exactly_every_F_steps():
    model, task = tiny_vit(), image_task()
    algo = build("grape", model, task, update_interval=3, rank=3)
    calls = []  # (step, phase, layer, P)
    phase = {"now": "hook"}
    original_projector, original_apply = algo.projector, algo.apply_update

    def recording_projector(projection, device, window=None):
        P = original_projector(projection, device, window)
        calls.append((algo.window_step, phase["now"], projection.index, P.clone()))
        return P

    def recording_apply(gradients):
        phase["now"] = "update"
        before = {p: p.detach().clone() for p in algo.projections}
        original_apply(gradients)
        phase["now"] = "hook"
        for p, projection in algo.projections.items():  # the update lies in the span of the hook's P
            P = next(c[3] for c in calls if c[0] == algo.window_step and c[1] == "hook" and c[2] == projection.index)
            delta = (p.detach() - before[p]).double()
            P = P.double()
            residual = delta - P @ torch.linalg.pinv(P) @ delta if projection.side == "left" else delta - delta @ torch.linalg.pinv(P).T @ P.T
            assert residual.norm() <= 1e-6 * delta.norm() and delta.norm() > 0

    algo.projector, algo.apply_update = recording_projector, recording_apply
    batches = [task.batch(range(0, 6)), task.batch(range(6, 12))]  # two physical batches per step
    for step in range(7):
        algo.window_step = step
        algo.train_step(batches, step)

    per_step = {}
    for step, ph, layer, P in calls:
        per_step.setdefault((step, layer), []).append((ph, P))
    for (step, layer), entries in per_step.items():
        assert {ph for ph, _ in entries} == {"hook", "update"}
        assert all(torch.equal(entries[0][1], P) for _, P in entries)  # bit-identical
    layer0 = [per_step[(s, 0)][0][1] for s in range(7)]
    changed = [s for s in range(1, 7) if not torch.equal(layer0[s], layer0[s - 1])]
    assert changed == [3, 6]
    # entries N(0, 1/r): column norms² average to rows/r
    P = layer0[0]
    assert P.shape[1] == 3


def test_gaussian_projector_has_variance_one_over_r():
    algo = build("grape", tiny_vit(), image_task(), rank=8)
    projection = next(iter(algo.projections.values()))
    samples = torch.cat([algo.projector(projection, "cpu", window=w).flatten() for w in range(200)])
    assert abs(samples.mean()) < 5 / math.sqrt(samples.numel() * 8)
    assert abs(samples.var().item() * 8 - 1) < 0.03


# --- privacy: sensitivity and noise ------------------------------------------------------------------


def test_one_huge_sample_moves_the_privatised_projected_gradient_by_at_most_C_over_B():
    clip, expected_batch = 0.5, 8.0
    weights = torch.ones(9)
    weights[8] = 1e6
    task = image_task(n=9, weights=weights)
    model = tiny_vit()
    algo = build("grape", model, task, clip=clip, batch=expected_batch)
    without, _ = algo.clip_and_accumulate([task.batch(range(8))])
    with_huge, _ = algo.clip_and_accumulate([task.batch(range(9))])
    shapes = algo.noise_shapes()
    assert [s.shape for s in with_huge] == list(shapes)
    assert any(s != p.shape for s, p in zip(shapes, algo.params))  # some coordinates are projected
    a, b = algo.privatize(without), algo.privatize(with_huge)  # sigma = 0
    moved = torch.sqrt(sum((x - y).pow(2).sum() for x, y in zip(a, b)))
    assert moved <= clip / expected_batch * (1 + 1e-4)
    assert moved >= 0.99 * clip / expected_batch  # the huge sample is clipped to norm C, not dropped


@pytest.mark.parametrize("name", ["grape", "galore_naive"])
def test_noise_std_in_the_released_space_is_sigma_C_over_B(name):
    sigma, clip, expected_batch = 2.0, 0.5, 10.0
    task = image_task()
    algo = build(name, tiny_vit(), task, sigma=sigma, clip=clip, batch=expected_batch)
    sums, tally = algo.clip_and_accumulate([task.batch([])])  # empty Poisson batch: pure noise
    assert tally.count == 0 and all(s.abs().sum() == 0 for s in sums)
    noisy = algo.privatize(sums)
    assert [n.shape for n in noisy] == list(algo.noise_shapes())
    values = torch.cat([n.flatten() for n in noisy]).double()
    k = values.numel()
    chi2 = (values / (sigma * clip / expected_batch)).pow(2).sum().item()
    assert abs(chi2 - k) < 5 * math.sqrt(2 * k), (chi2, k)
    if name == "grape":
        assert k == sum(torch.Size(s).numel() for s in algo.noise_shapes()) < sum(p.numel() for p in algo.params)


class SomeChunksSkipTheBlocks(TensorTask):
    """Examples from index `skip_from` on reach the patch embedding alone, no projected layer (as the
    one-run audit's canary chunk reaches its own layer alone)."""

    def __init__(self, inputs, labels, skip_from: int):
        super().__init__(inputs, labels)
        self.skip_from = skip_from

    def batch(self, indices):
        indices = list(indices)
        return (*super().batch(indices), bool(indices) and min(indices) >= self.skip_from)

    def per_sample_loss(self, model, batch):
        x, y, w, skip = batch
        if skip:
            return w * model.patch_embed(x).pow(2).flatten(1).sum(1)
        return super().per_sample_loss(model, (x, y, w))


@pytest.mark.parametrize("engine", ["materialize", "bk", "ghost"])
def test_a_chunk_that_reaches_no_projected_layer_sums_zeros_of_the_projected_shape(engine):
    """Every engine gives a projected layer no hook reached zeros of its projected shape
    (ProjectedLinear.sum_shape), so chunks add up in either order (full-shape zeros crashed the
    one-run audit of DP-GRAPE: "size of tensor a (16) must match ... (64)")."""
    plain = image_task(n=12)
    task = SomeChunksSkipTheBlocks(plain.inputs, plain.labels, skip_from=8)
    algo = build("grape", tiny_vit(), task, per_sample=engine)
    reached, skipped = task.batch(range(4)), task.batch(range(8, 12))
    projected = [i for i, p in enumerate(algo.params) if p in algo.projections]
    assert projected and all(algo.noise_shapes()[i] != algo.params[i].shape for i in projected)
    alone, _ = algo.clip_and_accumulate([skipped])
    assert [s.shape for s in alone] == list(algo.noise_shapes())
    assert all(alone[i].abs().sum() == 0 for i in projected)
    first, _ = algo.clip_and_accumulate([reached])
    for order in ([reached, skipped], [skipped, reached]):
        sums, _ = algo.clip_and_accumulate(order)
        assert [s.shape for s in sums] == list(algo.noise_shapes())
        for i in projected:
            assert torch.allclose(sums[i], first[i], atol=1e-6)
    noisy = algo.privatize(sums)  # sigma 0: the update takes them as they are
    algo.apply_update(noisy)


# --- equivalence with DP-Adam -------------------------------------------------------------------------


def test_full_rank_orthonormal_projector_reproduces_dpadam():
    task = image_task(n=16)
    model_grape = tiny_vit(seed=3)
    model_adam = copy.deepcopy(model_grape)
    # One subspace for the whole run: moments are kept across subspace changes (as in GaLore), so
    # after a change they live in the old coordinates and the equivalence no longer holds.
    grape = build("grape", model_grape, task, clip=0.3, rank=1000, projector="signed_permutation", update_interval=100, eps=1e-4)
    # eps=1e-4: the attention key bias has an exactly-zero true gradient, so its computed gradient is
    # rounding noise that Adam with eps=1e-8 would blow up to ±lr in either implementation.
    dpadam = build("dpadam", model_adam, task, clip=0.3, eps=1e-4)
    assert all(
        proj.rank == proj.projected_dim for proj in grape.projections.values()
    )  # rank clamped to the full projected side
    batches = [task.batch(range(0, 10)), task.batch(range(10, 16))]
    for step in range(4):
        grape.train_step(batches, step)
        dpadam.train_step(batches, step)
    for (name, a), b in zip(model_grape.named_parameters(), model_adam.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(model_grape.blocks[0].mlp.fc1.weight, tiny_vit(seed=3).blocks[0].mlp.fc1.weight)


# --- memory: the paper's Table 2 ------------------------------------------------------------------------


def table2_counts(model, rank):
    projected = [m for n, m in model.named_modules() if isinstance(m, nn.Linear) and n.startswith("blocks.")]
    sum_n = sum(max(m.weight.shape) for m in projected)  # n_ℓ = larger side
    full = sum(p.numel() for p in model.parameters()) - sum(m.weight.numel() for m in projected)
    return rank * sum_n, full, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["grape", "galore_naive", "dpadam", "galore"])
def test_memory_follows_table_2(name):
    rank, batch = 4, 6
    task = image_task(n=batch)
    model = tiny_vit()
    algo = build(name, model, task, rank=rank)
    algo.train_step([task.batch(range(batch))], 0)
    r_sum_n, full, d = table2_counts(model, rank)
    per_sample = {"grape": batch * (r_sum_n + full), "galore_naive": batch * d, "dpadam": batch * d, "galore": 0}
    state = {"dpadam": 2 * d}.get(name, 2 * r_sum_n + 2 * full)
    assert algo.per_sample_grad_bytes == 4 * per_sample[name]
    assert algo.optimizer_state_bytes() == 4 * state


# --- naive DP-GaLore's SVD subspace ---------------------------------------------------------------------


def test_naive_galore_uses_top_r_singular_vectors_of_the_noisy_gradient_refreshed_every_F():
    task = image_task()
    algo = build("galore_naive", tiny_vit(), task, sigma=1.0, update_interval=2, rank=3)
    seen = []
    original = algo.apply_update

    def recording(gradients):
        seen.append([g.clone() for g in gradients])
        original(gradients)
        seen[-1].append({p: P.clone() for p, P in algo.subspaces.projectors.items()})

    algo.apply_update = recording
    for step in range(4):
        algo.train_step([task.batch(range(12))], step)
    weight = next(iter(algo.subspaces.projections))
    index = next(i for i, p in enumerate(algo.params) if p is weight)
    projection = algo.subspaces.projections[weight]
    for step, record in enumerate(seen):
        P = record[-1][weight]
        source = seen[step - step % 2][index]  # the noisy gradient of the last refresh step (0, 2)
        u, _, vh = torch.linalg.svd(source, full_matrices=False)
        basis = u[:, :3] if projection.side == "left" else vh[:3].T
        torch.testing.assert_close(P.abs(), basis.abs(), rtol=1e-4, atol=1e-5)
    assert not torch.equal(seen[1][-1][weight], seen[2][-1][weight])


# --- end to end --------------------------------------------------------------------------------------------


@pytest.mark.slow  # three whole runs (the fast tier's five minutes)
@pytest.mark.parametrize("name", ["grape", "galore_naive", "galore"])
def test_a_run_writes_results(name, tmp_path):
    run_job(compose([*TINY, f"algo={name}", "train.steps=4"]), tmp_path, show_progress=False)
    results = read_results(tmp_path)
    assert results["status"] == "completed" and results["algo"] == name
    assert results["privacy"]["private"] == (name != "galore")
    assert results["algorithm"]["projected_layers"] and results["memory"]["optimizer_state_bytes"] > 0
    if name != "galore":
        assert 0 < results["privacy"]["epsilon"] <= 8.0 + 1e-6


def test_grape_with_no_projected_layer_says_so_in_the_run_notes():
    from dpbench.run import setup

    job = setup(compose(TINY + ["algo=grape", "model=cnn", "privacy.noise_multiplier=1.0", "device=cpu"]))
    assert not job.algorithm.projected_modules
    assert any("ran as DP-Adam" in note for note in job.privacy.recorded_notes())
    vit = setup(compose(TINY + ["algo=grape", "privacy.noise_multiplier=1.0", "device=cpu"]))
    assert not any("ran as DP-Adam" in note for note in vit.privacy.recorded_notes())
