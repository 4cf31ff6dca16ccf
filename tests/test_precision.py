"""train.precision=bf16: the forward under autocast, while norms, clipped sums and noise stay fp32
(so clipping still enforces the stated sensitivity), and what cannot run in bf16 is refused."""

from __future__ import annotations

import pytest
import torch
from algorithm_helpers import build_algorithm
from conftest import TINY, compose

from dpbench.errors import UserError
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


def test_bf16_run_learns_and_spends_the_same_epsilon(tmp_path):
    overrides = TINY + ["algo=dpadam", "train.batch_size=64", "train.steps=25", "train.lr=0.05",
                        "privacy.noise_multiplier=0.5"]
    fp32 = run_job(compose(overrides), tmp_path / "fp32", show_progress=False)
    bf16 = run_job(compose(overrides + ["train.precision=bf16"]), tmp_path / "bf16", show_progress=False)
    assert bf16["privacy"]["epsilon"] == pytest.approx(fp32["privacy"]["epsilon"])
    assert bf16["privacy"]["ledger"] == fp32["privacy"]["ledger"]
    assert bf16["metrics"]["test_accuracy"] > 0.25 + 0.15  # 4 classes; fp32 and bf16 reach 0.47-0.79


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["train.precision=fp16"], "use train.precision=bf16"),
     (["train.precision=fp64"], "not known"),
     (["algo=dpzero", "train.precision=bf16"], "first-order")],
)
def test_unsupported_precision_is_one_line_error(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        run_job(compose(TINY + overrides), tmp_path, show_progress=False)
