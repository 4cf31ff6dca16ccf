"""One rank of a 2-process gloo run whose rank 1 fails (tests/run/test_distributed.py): it trains a tiny
DP-SGD with the Trainer, rank 1 fails at step 2, and each rank writes what it raised to
<out>/rank<r>.txt before its process exits non-zero with it.

`where` picks the failure: "after_collectives" (rank 1's evaluation, once the step's collectives
are done: the ranks must stop together at that step, and rank 0 must not publish that step's
evaluation, which it records in <out>/published0.txt) or "inside_step" (before the step's first
collective, while rank 0 waits in it: rank 1 gives up after a short patience and closes the
group)."""

from __future__ import annotations

from pathlib import Path

from dpbench.runtime import distributed
from dpbench.privacy.sampling import ShardedBatches, ShuffledBatches
from dpbench.runtime.trainer import Callback, Trainer, TrainerConfig
from helpers.algorithms import build_algorithm
from helpers.ranks import become_rank

FAILING_STEP = 2  # 1-based: the second step


class RecordPublished(Callback):
    """What a rank published: the steps of the evaluations shown to its callbacks."""

    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def on_eval(self, trainer, record) -> None:
        with self.path.open("a") as file:
            file.write(f"{record.step}\n")


def run(rank: int, world: int, port: int, out: str, where: str) -> None:
    become_rank(rank, world, port)
    distributed.init_from_environment()
    distributed.STEP_PATIENCE_S = 5.0  # rank 1's wait for rank 0 (stuck inside the step in "inside_step")
    algorithm, task, _ = build_algorithm("dpsgd", sigma=1.0, clip=1.0, batch=32.0)
    callbacks = [RecordPublished(Path(out) / f"published{rank}.txt")]
    if where == "after_collectives" and rank == 1:
        evaluate = task.evaluate

        def failing_evaluate(model):
            if task.training_step_for_test == FAILING_STEP:
                raise RuntimeError("injected failure after the step's collectives")
            return evaluate(model)

        task.evaluate = failing_evaluate
    elif rank == 1:
        step = algorithm.step

        def failing_step(batches, step_index):
            if step_index == FAILING_STEP - 1:
                raise RuntimeError("injected failure before the step's collectives")
            return step(batches, step_index)

        algorithm.step = failing_step
    sampler = ShardedBatches(ShuffledBatches(task.train_size, 32), rank, world)
    task.training_step_for_test = 0
    set_step = task.set_step

    def counting_set_step(step):
        task.training_step_for_test = step + 1  # 1-based: the step being trained
        set_step(step)

    task.set_step = counting_set_step
    trainer = Trainer(task, algorithm, sampler, TrainerConfig(steps=5, eval_every=1), callbacks=callbacks)
    try:
        trainer.fit()
    except Exception as error:
        (Path(out) / f"rank{rank}.txt").write_text(f"{type(error).__name__}: {error}")
        raise  # the process exits non-zero
    (Path(out) / f"rank{rank}.txt").write_text("completed")
