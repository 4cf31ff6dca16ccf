"""train.precision=bf16|fp16: the forward under autocast, while norms, clipped sums and noise stay
fp32 (so clipping still enforces the stated sensitivity); fp16's loss scale is divided out before
any norm; what cannot run in low precision is refused."""

from __future__ import annotations

import pytest
import torch
from helpers.algorithms import build_algorithm, tiny_model
from helpers.config import TINY, compose

from dpbench.errors import UserError
from dpbench.algorithms import algorithm_class
from dpbench.precision import Precision
from dpbench.run import run_job


@pytest.mark.parametrize("algo", ["dpsgd", "grape", "dcdpsgd", "dpdr"])
def test_bf16_forward_keeps_fp32_sums_and_the_clipping_bound(algo):
    algorithm, task, _ = build_algorithm(algo, sigma=0.0, clip=0.05)
    algorithm.precision = Precision("bf16", "cpu")
    images, labels = task.batch(list(range(16)))
    with algorithm.precision.autocast(), torch.no_grad():  # no_grad: Opacus's hooks capture nothing
        assert algorithm.model(images).dtype == torch.bfloat16  # the forward really is bf16
    without, _ = algorithm.clip_and_accumulate([(images[1:], labels[1:])])
    added, tally = algorithm.clip_and_accumulate([(images, labels)])  # + one example (norm >> C = 0.05)
    assert all(s.dtype == torch.float32 for s in added) and tally.count == 16
    moved = torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, without)))
    assert 0.5 * 0.05 <= moved <= algorithm.gradient_sensitivity() * (1 + 1e-3)  # it counts, within its bound


@pytest.mark.slow  # trains end to end (the slow tier)
def test_bf16_run_learns_and_spends_the_same_epsilon(tmp_path):
    overrides = TINY + ["algo=dpadam", "train.batch_size=64", "train.steps=25", "train.lr=0.05",
                        "privacy.noise_multiplier=0.5"]
    fp32 = run_job(compose(overrides), tmp_path / "fp32", show_progress=False)
    bf16 = run_job(compose(overrides + ["train.precision=bf16"]), tmp_path / "bf16", show_progress=False)
    assert bf16.privacy.epsilon == pytest.approx(fp32.privacy.epsilon)
    assert bf16.privacy.ledger == fp32.privacy.ledger
    assert bf16.metrics.test_accuracy > 0.25 + 0.15  # 4 classes; fp32 and bf16 reach 0.47-0.79


def _tiny_gradient_sums(precision: str, tiny: float, loss_scale: float | None = None) -> torch.Tensor:
    """Unclipped per-example gradient sum of 16 examples whose losses are scaled by `tiny`."""
    algorithm, task, _ = build_algorithm("dpsgd", sigma=0.0, clip=1e6)
    loss = task.per_sample_loss
    task.per_sample_loss = lambda model, batch: loss(model, batch) * tiny
    if precision != "fp32":
        algorithm.use_precision(Precision(precision, "cpu"))
    if loss_scale is not None:
        algorithm.engine.loss_scale = loss_scale
    sums, _ = algorithm.clip_and_accumulate([task.batch(list(range(16)))])
    return torch.cat([s.flatten() for s in sums])


def test_fp16_loss_scale_keeps_small_per_example_gradients():
    reference = _tiny_gradient_sums("fp32", 1e-6)
    error = lambda sums: float((sums - reference).norm() / reference.norm())  # noqa: E731
    assert error(_tiny_gradient_sums("fp16", 1e-6)) < 5e-3
    assert error(_tiny_gradient_sums("fp16", 1e-6, loss_scale=1.0)) > 5 * error(_tiny_gradient_sums("fp16", 1e-6))


def test_fp16_non_private_gradient_is_unscaled_before_the_step():
    _, task, cfg = build_algorithm("sgd")
    grads = {}
    for precision in ("fp32", "fp16"):
        algorithm = algorithm_class("sgd")(tiny_model(), task, cfg.algo, 0.1, None)
        algorithm.use_precision(Precision(precision, "cpu"))
        algorithm.backward_mean_loss([task.batch(list(range(16)))])
        grads[precision] = torch.cat([p.grad.flatten() for p in algorithm.params])
    assert torch.allclose(grads["fp16"], grads["fp32"], rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["train.precision=fp16", "algo=dpadam", "algo.per_sample=ghost"], "per_sample=materialize"),
     (["train.precision=fp64"], "not known"),
     (["algo=dpzero", "train.precision=bf16"], "first-order")],
)
def test_unsupported_precision_is_one_line_error(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        run_job(compose(TINY + overrides), tmp_path, show_progress=False)
