"""train.head_lr_scale: the declared head steps `scale` times as far as it would at train.lr, in
every kind of optimizer dpbench runs (torch's Adam and SGD, DP-GRAPE's projected Adam, DPZero's
update), and the rest of the model exactly as before."""

from __future__ import annotations

import pytest
import torch
from helpers.config import FIXED_SIGMA, TINY, compose

from dpbench.algorithms.learning_rates import lr_groups, lr_scale
from dpbench.errors import UserError
from dpbench.run import setup

SCALE = 10.0
ADAMS = ("dpadam", "grape")


def _updates(algo: str, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The first step's change of the head's weight and of the first block's weights (noise negligible: sigma 1e-9, as the noise cannot be seeded; Adam eps 1e-3 so that coordinates with no gradient stay still)."""
    cfg = compose(TINY + FIXED_SIGMA + [f"algo={algo}", "model=vit", f"train.head_lr_scale={scale}",
                                        "privacy.noise_multiplier=1e-9", "seed=3"]
                  + (["algo.eps=1e-3"] if algo in ADAMS else []))
    job = setup(cfg)
    model = job.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    job.algorithm.step([job.task.batch(list(range(16)))], 0)
    after = dict(model.named_parameters())
    head = torch.cat([(after[n] - before[n]).flatten() for n in before if n.startswith("head.")])
    body = torch.cat([(after[n] - before[n]).flatten() for n in before if n.startswith("blocks.0.")])
    return head, body


@pytest.mark.parametrize("algo", ["dpadam", "dpsgd", "grape", "dpzero"])
def test_head_steps_scale_times_further(algo):
    head1, body1 = _updates(algo, 1.0)
    head_s, body_s = _updates(algo, SCALE)
    assert head1.abs().max() > 0 and body1.abs().max() > 0  # both moved: the comparison can fail
    torch.testing.assert_close(head_s, SCALE * head1, rtol=1e-3, atol=1e-7)
    torch.testing.assert_close(body_s, body1, rtol=1e-3, atol=1e-7)


def test_groups_keep_one_group_without_scales():
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    assert [len(g["params"]) for g in lr_groups(params, 0.1)] == [3]
    setattr(params[1], "dpbench_lr_scale", 4.0)
    groups = lr_groups(params, 0.1)
    assert [(len(g["params"]), g["lr"]) for g in groups] == [(2, 0.1), (1, 0.4)]
    assert lr_scale(params[1]) == 4.0 and lr_scale(params[0]) == 1.0


def test_a_model_without_a_declared_head_is_refused():
    cfg = compose(TINY + FIXED_SIGMA + ["model=cnn", "train.head_lr_scale=5"])
    with pytest.raises(UserError, match="declares no trainable head"):
        setup(cfg)
