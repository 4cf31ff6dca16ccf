"""One training loop for every algorithm: sampling, logical vs physical batches, evaluation,
privacy ledger, metering and logging callbacks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dpbench.algorithms import Algorithm
from dpbench.errors import DivergedError
from dpbench.logging.console import training_progress
from dpbench.metering import Throughput
from dpbench.privacy.accountants import Accountant
from dpbench.privacy.mechanisms import Ledger
from dpbench.tasks import Task


@dataclass
class TrainingState:
    step: int = 0
    ledger: Ledger = field(default_factory=Ledger)
    train_loss: float = float("nan")  # mean over the last logging window
    last_eval: dict = field(default_factory=dict)
    best_accuracy: float | None = None
    history: list[dict] = field(default_factory=list)
    diverged: bool = False


class Trainer:
    def __init__(
        self,
        task: Task,
        algorithm: Algorithm,
        sampler,
        steps: int,
        physical_batch_size: int | None,
        eval_every: int,
        accountant: Accountant | None,
        delta: float | None,
        logger,
        show_progress: bool = True,
    ):
        self.task = task
        self.algorithm = algorithm
        self.sampler = sampler
        self.steps = steps
        self.physical_batch_size = physical_batch_size
        self.eval_every = max(1, eval_every)
        self.accountant = accountant
        self.delta = delta
        self.logger = logger
        self.show_progress = show_progress
        self.state = TrainingState()
        self.throughput = Throughput(warmup_steps=min(3, steps // 2))

    def epsilon_spent(self) -> float | None:
        if self.accountant is None:
            return None
        return self.accountant.epsilon(self.state.ledger, self.delta)

    def _physical_batches(self, indices: list[int]) -> list:
        chunk = self.physical_batch_size or max(1, len(indices))
        return [self.task.batch(indices[i : i + chunk]) for i in range(0, len(indices), chunk)] or [
            self.task.batch([])
        ]

    def _evaluate(self) -> dict:
        metrics = self.task.evaluate(self.algorithm.model)
        state = self.state
        accuracy = metrics["accuracy"]
        state.best_accuracy = accuracy if state.best_accuracy is None else max(state.best_accuracy, accuracy)
        state.last_eval = metrics
        record = {
            "step": state.step,
            "train_loss": state.train_loss,
            "test_accuracy": accuracy,
            "test_loss": metrics.get("loss"),
            "epsilon": self.epsilon_spent(),
        }
        state.history.append(record)
        self.logger.log_step(
            state.step,
            {
                "train/loss": state.train_loss,
                "test/accuracy": accuracy,
                "test/loss": metrics.get("loss"),
                **({"privacy/epsilon": record["epsilon"]} if record["epsilon"] is not None else {}),
            },
        )
        return record

    def fit(self) -> TrainingState:
        state = self.state
        batches = iter(self.sampler)
        window_loss, window_count = 0.0, 0
        with training_progress() as progress:
            bar = progress.add_task(
                type(self.algorithm).__name__, total=self.steps, loss="—", acc="—", eps="0" if self.accountant else "∞"
            ) if self.show_progress else None
            while state.step < self.steps:
                indices = next(batches)
                physical = self._physical_batches(indices)
                self.throughput.step_started()
                result = self.algorithm.step(physical)
                self.throughput.step_finished(result.batch_size)
                state.ledger.extend(self.algorithm.mechanisms_for_step(state.step))
                state.step += 1
                if result.batch_size > 0:
                    if not math.isfinite(result.loss):
                        state.diverged = True
                        raise DivergedError(
                            f"training loss became {result.loss} at step {state.step}: lower train.lr "
                            "or privacy.clip_norm; results so far are in results.json"
                        )
                    window_loss += result.loss * result.batch_size
                    window_count += result.batch_size
                    state.train_loss = window_loss / window_count
                if state.step % self.eval_every == 0 or state.step == self.steps:
                    record = self._evaluate()
                    window_loss, window_count = 0.0, 0
                    if bar is not None:
                        eps = record["epsilon"]
                        progress.update(
                            bar,
                            loss=f"{record['train_loss']:.3f}",
                            acc=f"{record['test_accuracy']:.3f}",
                            eps="∞" if eps is None else f"{eps:.2f}",
                        )
                if bar is not None:
                    progress.advance(bar)
        return state
