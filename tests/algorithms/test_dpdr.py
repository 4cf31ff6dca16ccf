"""DPDR: exact reconstruction, alpha clipping, base refresh, joint accounting of a decomposition step."""

from __future__ import annotations

import dataclasses

import dp_accounting as dpa
import pytest
import torch
from helpers.algorithms import build_algorithm, record_updates, tiny_model
from helpers.config import OFFLINE, compose

from dpbench.algorithms.base import LossTally
from dpbench.algorithms.dpdr import DPDR, clip_alpha, decompose, effective_noise_multiplier
from dpbench.privacy.accountants import RDPAccountant, ledger_of_plan
from dpbench.privacy.clipping import clip_factors, clipped_sum, per_sample_norms
from dpbench.privacy.noise import GaussianNoise


def _mean_gradient(model, images, labels):
    model.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(images), labels, reduction="mean")
    grads = [g.detach() for g in torch.autograd.grad(loss, list(model.parameters()))]
    for p in model.parameters():  # Opacus's hooks also fired: drop their per-sample tensors
        p.grad_sample = None
    return grads


def test_without_noise_or_clipping_the_reconstruction_is_the_batch_gradient():
    algorithm, task, _ = build_algorithm(
        "dpdr", "algo.decomposition_steps=5", "algo.perp_clip=1e6", "algo.alpha_clip=1e6", clip=1e6, batch=24.0
    )
    algorithm.privacy.noise_multiplier = 0.0
    algorithm.sigma_perp = algorithm.sigma_alpha = 0.0
    recorded = record_updates(algorithm, apply=True)
    images, labels = task.batch(list(range(24)))
    for step in range(3):  # DP-SGD, then two decomposition steps
        expected = _mean_gradient(algorithm.model, images, labels)
        algorithm.train_step([(images[:10], labels[:10]), (images[10:], labels[10:])], step)
        for got, want in zip(recorded[-1], expected):
            assert torch.allclose(got, want, atol=1e-5), step
    assert all(b.norm() == pytest.approx(1.0, abs=1e-5) for b in algorithm.bases)


def test_decomposition_is_exact_and_alpha_clipping_bounds_both_signs():
    generator = torch.Generator().manual_seed(0)
    per_sample = [torch.randn(6, 3, 4, generator=generator), torch.randn(6, 5, generator=generator)]
    bases = [torch.randn(3, 4, generator=generator), torch.randn(5, generator=generator)]
    bases = [b / b.norm() for b in bases]
    per_sample[0][2] = -50 * bases[0]  # a large negative alpha: the paper's max(1, alpha/C) never clips it
    alpha, perps = decompose(per_sample, bases)
    assert alpha.shape == (6, 2) and alpha[2, 0] == pytest.approx(-50.0, rel=1e-5)
    for g, p, b, a in zip(per_sample, perps, bases, alpha.T):
        assert torch.allclose(a[:, None, None] * b if g.dim() == 3 else a[:, None] * b, g - p, atol=1e-5)
        assert torch.allclose((p.reshape(6, -1) @ b.reshape(-1)), torch.zeros(6), atol=1e-4)  # orthogonal to b
    clipped = clip_alpha(alpha, 0.3)
    assert torch.all(clipped.norm(dim=1) <= 0.3 * (1 + 1e-5))
    assert clipped[2, 0] < -0.29  # clipped to the bound, sign kept
    small = alpha * 1e-4
    assert torch.allclose(clip_alpha(small, 0.3), small)  # below the bound: untouched


def _adversarial_gradients(dtype):
    """Per-sample gradients on unit bases: one nearly parallel to b (||g_perp|| ~ 1e-4 ||g||), one
    huge, one tiny, one exactly parallel, one ordinary; a contiguous [B, 3, 4] and a [B, 5] layer."""
    generator = torch.Generator().manual_seed(1)
    bases = [torch.randn(3, 4, generator=generator), torch.randn(5, generator=generator)]
    bases = [b / b.norm() for b in bases]
    layers = []
    for b in bases:
        noise = torch.randn(5, *b.shape, generator=generator)
        layers.append(torch.stack([1e3 * b + 1e-1 * noise[0], 1e18 * noise[1], 1e-18 * noise[2], -7 * b, noise[4]])
                      .to(dtype))
    return layers, bases


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_in_place_decomposition_equals_the_copying_one_and_its_norm_bounds_what_is_summed(dtype):
    per_sample, bases = _adversarial_gradients(dtype)
    alpha, perps = decompose([g.clone() for g in per_sample], bases)
    overwritten = [g.clone() for g in per_sample]
    alpha_fast, perps_fast = decompose(overwritten, bases, overwrite=True)
    assert torch.allclose(alpha_fast, alpha, rtol=1e-6, atol=0)
    for slow, fast in zip(perps, perps_fast):
        assert fast.dtype == torch.float32
        assert torch.allclose(fast, slow, rtol=1e-5, atol=1e-5 * slow.abs().max().item())
    # an fp32 gradient is its own orthogonal part (no per-sample copy); a wider one is left as it was
    for g, original, fast in zip(overwritten, per_sample, perps_fast):
        assert (fast.data_ptr() == g.data_ptr()) == (dtype == torch.float32)
        assert dtype == torch.float32 or torch.equal(g, original)
    # the clip factor's norm is the norm of what is summed: each example's clipped part is within C
    norms = per_sample_norms(perps_fast)
    factors = clip_factors(norms, 0.5)
    for i in range(norms.shape[0]):
        one = clipped_sum([p[i:i + 1] for p in perps_fast], factors[i:i + 1])
        assert per_sample_norms([s.unsqueeze(0) for s in one]).item() <= 0.5  # exact: no rounding margin needed


def test_a_strided_gradient_is_decomposed_from_a_copy_not_through_its_alias():
    generator = torch.Generator().manual_seed(2)
    storage = torch.randn(4, 6, generator=generator)
    strided = storage.t()  # [6, 4], not contiguous: reshape copies, so the copy is overwritten
    base = torch.randn(4, generator=generator)
    base = base / base.norm()
    kept = storage.clone()
    alpha, (perp,) = decompose([strided], [base], overwrite=True)
    assert torch.equal(storage, kept)
    assert torch.allclose(perp, strided - alpha[:, :1] * base, atol=1e-6)


def _copying_decomposed_sums(algorithm, batches):
    """DPDR's sums as first written: g_perp formed as a copy of the gradients and summed from a
    second copy (the reference the in-place form must equal)."""
    perp_sums, alpha_sum, tally = algorithm.zero_sums(), torch.zeros(len(algorithm.params)), LossTally()
    for _, losses in algorithm.chunks(batches, tally):
        alpha, perps = decompose(algorithm.engine.backward_per_sample(losses), algorithm.bases)
        alpha_norms, perp_norms = alpha.norm(dim=1), per_sample_norms(perps)
        keep = torch.isfinite(alpha_norms) & torch.isfinite(perp_norms)
        factors = algorithm.example_factors(perp_norms, algorithm.cfg.perp_clip, keep=keep)
        for s, c in zip(perp_sums, clipped_sum(perps, factors)):
            s.add_(c)
        alpha_sum += clip_alpha(alpha, algorithm.cfg.alpha_clip, keep=keep).sum(dim=0)
    return perp_sums, alpha_sum, tally


def test_decomposed_sums_and_released_updates_equal_the_copying_version():
    """Over three chunks, a NaN example among them; the bounds clip about half the examples."""
    overrides = ("algo.decomposition_steps=3", "algo.perp_clip=4.0", "algo.alpha_clip=1.0")  # some clipped, some not
    fast, task, cfg = build_algorithm("dpdr", *overrides, sigma=0.5, batch=24.0)
    slow = DPDR(tiny_model(), task, cfg.algo, 0.1, dataclasses.replace(fast.privacy, noise=GaussianNoise("cpu")))
    slow.decomposed_sums = lambda batches: _copying_decomposed_sums(slow, batches)
    images, labels = task.batch(list(range(24)))
    images[13] = float("nan")
    batches = [(images[:10], labels[:10]), (images[10:17], labels[10:17]), (images[17:], labels[17:])]
    updates = {}
    for name, algorithm in (("fast", fast), ("slow", slow)):
        algorithm.privacy.noise.generator.manual_seed(0)
        updates[name] = record_updates(algorithm, apply=True)
        algorithm.train_step(batches, 0)  # DP-SGD: b from its noisy gradient
        if name == "fast":  # the same state, both forms of the sums
            perp_fast, alpha_fast, _ = fast.decomposed_sums(batches)
            perp_slow, alpha_slow, _ = _copying_decomposed_sums(fast, batches)
            assert torch.allclose(alpha_fast, alpha_slow, atol=1e-5)
            assert all(torch.allclose(f, s, atol=1e-5) for f, s in zip(perp_fast, perp_slow))
            assert all(torch.isfinite(p).all() for p in perp_fast)
        for step in (1, 2):  # decomposition steps
            algorithm.train_step(batches, step)
    assert slow.nonfinite_examples == 3 and fast.nonfinite_examples == 3 + 2  # dropped alike (fast ran two more sums)
    for got, want in zip(updates["fast"], updates["slow"]):
        assert all(torch.allclose(g, w, atol=1e-5) for g, w in zip(got, want))


def test_base_is_refreshed_from_the_noisy_reconstructed_gradient():
    algorithm, task, _ = build_algorithm("dpdr", "algo.decomposition_steps=3", sigma=0.5, batch=16.0)
    recorded = record_updates(algorithm, apply=True)
    batch = task.batch(list(range(16)))
    algorithm.train_step([batch], 0)  # step 0: DP-SGD initialises b from its noisy gradient
    for b, g in zip(algorithm.bases, recorded[0]):
        assert torch.allclose(b, g / g.norm())
    algorithm.train_step([batch], 1)  # step 1: decomposition; b <- g~ / ||g~|| per layer
    after_step1 = [b.clone() for b in algorithm.bases]
    for b, g in zip(after_step1, recorded[1]):
        assert torch.allclose(b, g / g.norm())
    algorithm.train_step([batch], 2)  # step 2 = s-1: last decomposition; b is no longer needed
    algorithm.train_step([batch], 3)  # step 3: DP-SGD
    assert all(torch.equal(a, b) for a, b in zip(after_step1, algorithm.bases))


def _dp_accounting_epsilon(events, delta):
    accountant = dpa.rdp.RdpAccountant()
    for sigma, q, count in events:
        accountant.compose(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), count)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("sigma,ratio,steps,s", [(0.7, 2.0, 300, 50), (1.1, 1.5, 1000, 200)])
def test_ledger_is_one_joint_mechanism_per_decomposition_step(sigma, ratio, steps, s):
    cfg = compose([*OFFLINE, "algo=dpdr", f"algo.alpha_ratio={ratio}", f"algo.decomposition_steps={s}"]).algo
    q = 0.005
    ledger = ledger_of_plan(lambda step: DPDR.planned_mechanisms(cfg, sigma, q, step, 1.0), steps)
    sigma_eff = (sigma**-2 + (ratio * sigma) ** -2) ** -0.5  # independent of the module's helper
    records = {round(r["noise_multiplier"], 9): r["count"] for r in ledger.as_records()}
    assert records == {round(sigma_eff, 9): s - 1, round(sigma, 9): steps - s + 1}
    ours = RDPAccountant().epsilon(ledger, 1e-5)
    reference = _dp_accounting_epsilon([(sigma_eff, q, s - 1), (sigma, q, steps - s + 1)], 1e-5)
    assert ours == pytest.approx(reference, rel=0.03)


def test_paper_accounting_reproduces_the_digest_overrun():
    """DPDR Table 2, MNIST eps=8: sigma_perp=0.59, sigma_alpha=0.8, sigma_g=0.59, B=256, 20 epochs.
    Jointly accounted, the run spends ~8.47 (spec §4.4), not the claimed 8."""
    cfg = compose([
        *OFFLINE, "algo=dpdr", "algo.paper_accounting=true", "algo.sigma_perp=0.59", "algo.sigma_alpha=0.8"
    ]).algo
    q = 256 / 60000
    steps = int(20 / q)
    ledger = ledger_of_plan(lambda step: DPDR.planned_mechanisms(cfg, 0.59, q, step, 1.0), steps)
    assert effective_noise_multiplier(0.59, 0.8) == pytest.approx(0.4748, abs=1e-3)
    true_epsilon = RDPAccountant().epsilon(ledger, 1e-5)
    assert 8.3 < true_epsilon < 8.65


@pytest.mark.slow  # seconds each: the fast tier stays under its 5 minutes
def test_an_engine_option_dpdr_does_not_declare_is_ignored_as_the_note_says(tmp_path):
    """algo.per_sample reaches DPDR from the command line (grids set it for every algorithm); it is
    not one of DPDR's options, so the run says it is ignored and DPDR keeps every per-example gradient."""
    from helpers.cli import dpbench_in_process
    from helpers.config import FIXED_SIGMA, TINY

    result = dpbench_in_process(*TINY, *FIXED_SIGMA, "algo=dpdr", "algo.per_sample=bk",
                                f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "algo.per_sample is not an option of algo=dpdr" in result.stdout + result.stderr
