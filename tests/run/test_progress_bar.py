"""The progress bar shows ε spent from the first step, and the running training loss only where it
may be shown: never for a private run with privacy.log_private_stats=false, marked as outside ε for a
private run that logs it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dpbench.logging.console import ProgressCallback


def _trainer(private: bool, log_private_stats: bool, loss: float | None):
    spent = iter([0.0, 0.4, 0.7, 0.9])
    return SimpleNamespace(
        privacy=object() if private else None, algorithm=object(),
        config=SimpleNamespace(steps=3, log_private_stats=log_private_stats),
        state=SimpleNamespace(step=0, train_loss=loss),
        epsilon_spent=lambda: next(spent) if private else None,
    )


def _fields(private: bool, log_private_stats: bool, loss: float | None = 0.6931) -> dict:
    trainer, bar = _trainer(private, log_private_stats, loss), ProgressCallback()
    bar.on_fit_start(trainer)
    try:
        trainer.state.step = 1
        bar.on_step(trainer, None)  # the first step: shown at once
        return dict(bar.progress.tasks[0].fields)
    finally:
        bar.on_fit_end(trainer)


def test_epsilon_is_shown_from_the_first_step():
    fields = _fields(private=True, log_private_stats=False, loss=None)
    assert fields["eps"] == "0.40"
    assert fields["loss_label"] == "" and fields["loss"] == ""  # the un-noised loss is not shown


@pytest.mark.parametrize("private, label", [(True, "loss (outside ε) "), (False, "loss ")])
def test_the_running_loss_is_shown_where_it_may_be_and_marked(private, label):
    fields = _fields(private=private, log_private_stats=True)
    assert fields["loss_label"] == label and fields["loss"] == "0.693"
    assert fields["eps"] == ("0.40" if private else "∞")
