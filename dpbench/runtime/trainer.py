"""One training loop for every algorithm: sampling, logical vs physical batches, evaluation,
the privacy ledger of what ran, and callbacks that show and log progress."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from dpbench.runtime import distributed
from dpbench.algorithms import Algorithm, StepResult
from dpbench.runtime.algorithm_state import CheckpointMismatch, algorithm_state, load_algorithm_state
from dpbench.runtime.checkpoint import rank_rng_states, restore_rank_rng_states
from dpbench.errors import DivergedError
from dpbench.logging.results import EvalRecord
from dpbench.runtime.metering import Throughput
from dpbench.privacy.mechanisms import Ledger, same_mechanisms
from dpbench.privacy.plan import PrivacyPlan
from dpbench.tasks import Task


@dataclass
class TrainerConfig:
    steps: int
    physical_batch_size: int | None = None  # None: the logical batch in one piece
    eval_every: int = 20  # steps between evaluations; <= 0: evaluate only at the end
    log_private_stats: bool = True  # report un-noised training loss / batch sizes (see PrivacyPlan)
    train_eval_size: int = 0  # > 0: also evaluate on this many training examples (needs log_private_stats)
    replay_sampler: bool = True  # on resume, redraw the batches already used (seeded samplers without a state_dict)
    evaluate_test: bool = True  # false (train.evaluate_test): no test evaluation, periodic or final


@dataclass
class TrainingState:
    step: int = 0  # the one step counter; algorithms receive it
    ledger: Ledger = field(default_factory=Ledger)
    train_loss: float | None = None  # mean over the last evaluation window (None: not reported)
    best_accuracy: float | None = None
    history: list[EvalRecord] = field(default_factory=list)


class Callback:
    """Hooks the trainer calls; the console progress bar and the W&B logger implement them."""

    def on_fit_start(self, trainer: "Trainer") -> None: ...

    def on_step(self, trainer: "Trainer", result: StepResult) -> None: ...

    def on_eval(self, trainer: "Trainer", record: EvalRecord) -> None: ...

    def on_fit_end(self, trainer: "Trainer") -> None: ...


class Trainer:
    def __init__(
        self,
        task: Task,
        algorithm: Algorithm,
        sampler,
        config: TrainerConfig,
        privacy: PrivacyPlan | None = None,
        callbacks: list[Callback] | None = None,
        checkpointer=None,  # dpbench.runtime.checkpoint.Checkpointer: writes checkpoints, stops on signals
    ):
        self.task, self.algorithm, self.sampler = task, algorithm, sampler
        self.config = config
        self.privacy = privacy
        self.callbacks = list(callbacks or [])
        self.checkpointer = checkpointer
        self.resumed_from_step: int | None = None
        self.resume_notes: list[str] = []  # what a resumed run could not restore exactly
        self._sampler_restored = False
        self.state = TrainingState(ledger=privacy.new_ledger() if privacy is not None else Ledger())
        self.throughput = Throughput(warmup_steps=min(3, config.steps // 2))
        self._window_loss, self._window_count = 0.0, 0
        self._slowest_step_s = 0.0  # how long the ranks may legitimately be apart (raise_together)

    def epsilon_spent(self) -> float | None:
        return None if self.privacy is None else self.privacy.epsilon(self.state.ledger)

    def _physical_batches(self, indices: list[int]) -> list:
        chunk = self.config.physical_batch_size or max(1, len(indices))
        return [self.task.batch(indices[i : i + chunk]) for i in range(0, len(indices), chunk)] or [
            self.task.batch([])
        ]

    def _due_for_eval(self) -> bool:
        if not self.config.evaluate_test:
            return False
        every, step = self.config.eval_every, self.state.step
        return step == self.config.steps or (every > 0 and step % every == 0)

    def evaluate(self) -> EvalRecord:
        """Test metrics of the current model, appended to the history (`_publish` shows them)."""
        state = self.state
        metrics = self.task.evaluate(self.algorithm.model)
        accuracy = metrics["accuracy"]
        better = max if self.task.higher_is_better else min
        state.best_accuracy = accuracy if state.best_accuracy is None else better(state.best_accuracy, accuracy)
        record = EvalRecord(step=state.step, train_loss=state.train_loss, test_accuracy=accuracy,
                            test_loss=metrics.get("loss"), epsilon=self.epsilon_spent())
        train_metrics = getattr(self.task, "train_metrics", None)
        if self.config.train_eval_size > 0 and self.config.log_private_stats and train_metrics is not None:
            record.train_accuracy = train_metrics(self.algorithm.model, self.config.train_eval_size)["accuracy"]
        state.history.append(record)
        self._window_loss, self._window_count = 0.0, 0
        return record

    def _publish(self, result: StepResult | None, record: EvalRecord | None) -> None:
        """Show a step and its evaluation (console, W&B) once they are safe to publish: every rank
        finished the step and the checkpoint that covers the evaluation is written, so a rerun
        never redraws a release behind a published figure; a failed step publishes nothing."""
        for callback in self.callbacks:
            if result is not None:
                callback.on_step(self, result)
            if record is not None:
                callback.on_eval(self, record)

    def _record(self, result: StepResult) -> None:
        """Ledger and loss bookkeeping for one finished step."""
        state = self.state
        if self.privacy is not None:
            self.privacy.check_step(state.step, result.mechanisms)
        state.ledger.add_step(result.mechanisms)
        state.step += 1
        if result.batch_size == 0 or not self.config.log_private_stats:
            return
        if not math.isfinite(result.loss):
            raise DivergedError(
                f"training loss became {result.loss} at step {state.step}: lower train.lr "
                "or privacy.clip_norm; results so far are in results.json"
            )
        self._window_loss += result.loss * result.batch_size
        self._window_count += result.batch_size
        state.train_loss = self._window_loss / self._window_count

    def _charge_halted_step(self, mechanisms) -> None:
        """The step whose release halted the run (a non-finite noisy release) is in the ledger, and
        so in the epsilon reported: its outcome is published through status and steps."""
        if self.privacy is not None:
            self.privacy.check_step(self.state.step, mechanisms)
        self.state.ledger.add_step(mechanisms)
        self.state.step += 1

    def fit(self) -> TrainingState:
        """Train for the configured steps (zero steps: evaluate the model as it is).

        Data parallel: after every step the ranks agree whether any of them failed and all stop
        there together (`distributed.raise_together`); one process raises as it always did."""
        for callback in self.callbacks:
            callback.on_fit_start(self)
        try:
            if self.config.steps == 0 and self.config.evaluate_test:
                self._publish(None, self.evaluate())
            batches = iter(self.sampler)
            replay = self.config.replay_sampler and not self._sampler_restored
            for _ in range(self.state.step if replay else 0):
                next(batches)  # a resumed run with a seeded sampler continues its data order
            while self.state.step < self.config.steps:
                step, started, failure, result, record = self.state.step, time.monotonic(), None, None, None
                try:
                    result, record = self._step(batches)
                except Exception as error:  # noqa: BLE001 - every rank stops with it, below
                    failure = error
                self._slowest_step_s = max(self._slowest_step_s, time.monotonic() - started)
                patience = max(distributed.STEP_PATIENCE_S, 3 * self._slowest_step_s)
                distributed.raise_together(failure, f"in step {step + 1}", patience_s=patience)
                if self.checkpointer is not None:
                    self.checkpointer.after_step(self, record is not None)
                self._publish(result, record)
        finally:
            for callback in self.callbacks:
                callback.on_fit_end(self)
        return self.state

    def _step(self, batches) -> tuple[StepResult, EvalRecord | None]:
        """One step: train, record, evaluate when due; `fit` publishes them once they are safe."""
        physical = self._physical_batches(next(batches))
        self.throughput.step_started()
        try:
            result = self.algorithm.train_step(physical, self.state.step)
        except DivergedError as error:  # its release ran and the halt is published: charge it
            if error.mechanisms:
                self._charge_halted_step(error.mechanisms)
            raise
        self.throughput.step_finished(result.batch_size)
        self._record(result)
        return result, (self.evaluate() if self._due_for_eval() else None)

    # --- checkpoints (dpbench/runtime/checkpoint.py) -------------------------------------------------
    def state_dict(self, generators: list[dict] | None = None, algorithm: dict | None = None) -> dict:
        """Everything the loop needs to continue after this step, the algorithm's state included.
        `generators`: every rank's seeded RNG states (`checkpoint.rank_rng_states`, a collective
        the checkpointer runs on all ranks); None gathers them here (one process). `algorithm`:
        the algorithm's entry when the checkpointer wrote it already (a sharded run's DCP folder,
        `algorithm_state.sharded_algorithm_entry`); None: `algorithm_state` here."""
        state, throughput = self.state, self.throughput
        return {
            "step": state.step,
            "ledger": state.ledger.as_records(),
            "train_loss": state.train_loss,
            "best_accuracy": state.best_accuracy,
            "history": [record.to_json() for record in state.history],
            "window": [self._window_loss, self._window_count],
            # realised batch sizes: kept only where they may be reported (log_private_stats)
            "throughput": [throughput.steps, throughput.examples, throughput.measured_time]
            if self.config.log_private_stats else None,
            # the passes counted so far (algorithms/compute.py): realised batch sizes too
            "compute": self.algorithm.compute.state() if self.config.log_private_stats else None,
            "rng": rank_rng_states() if generators is None else generators,
            "sampler": self.sampler.state_dict() if hasattr(self.sampler, "state_dict") else None,
            "algorithm": algorithm_state(self.algorithm, self.config.log_private_stats) if algorithm is None else algorithm,
        }

    def load_state_dict(self, saved: dict) -> None:
        """Continue from `state_dict()`: the ledger goes on from the checkpoint's (never reset)."""
        if not 0 < saved["step"] <= self.config.steps:
            raise CheckpointMismatch(f"it stopped at step {saved['step']} of a run of {self.config.steps} steps")
        load_algorithm_state(self.algorithm, saved["algorithm"])
        state = self.state
        state.step, state.train_loss, state.best_accuracy = saved["step"], saved["train_loss"], saved["best_accuracy"]
        state.history = [EvalRecord.from_json(record) for record in saved["history"]]
        state.ledger = self._ledger_checked_against_plan(Ledger.from_records(saved["ledger"]))
        self._window_loss, self._window_count = saved["window"]
        if saved["throughput"] is not None:
            self.throughput.steps, self.throughput.examples, self.throughput.measured_time = saved["throughput"]
        if saved.get("compute") is not None:  # (a checkpoint from before the count: counted from here)
            self.algorithm.compute.load(saved["compute"])
        if saved.get("sampler") is not None and hasattr(self.sampler, "load_state_dict"):
            self.sampler.load_state_dict(saved["sampler"])
            self._sampler_restored = True
        elif self.privacy is not None and self.privacy.batches_per_epoch is not None:
            raise CheckpointMismatch("it holds no shuffled epoch in progress, which this run's privacy bound needs")
        self.resume_notes = restore_rank_rng_states(saved["rng"])
        self.resumed_from_step = state.step

    def _ledger_checked_against_plan(self, stored: Ledger) -> Ledger:
        """The ledger to go on from: this run's plan for the steps the checkpoint ran, which the
        stored ledger must equal (same sigma, same q, same bound)."""
        if self.privacy is None:
            return stored
        planned = self.privacy.planned_ledger(self.state.step)
        if not same_mechanisms(stored.expanded(), planned.expanded()):
            raise CheckpointMismatch("its privacy ledger is not this run's plan for the steps it ran")
        return planned
