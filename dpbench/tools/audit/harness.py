"""The self-audit's harness (dpbench/tools/audit/runner.py): jobs built as `dpbench` builds them, with
their noisy releases recorded (`ReleaseRecorder`), the phases of DPFirstOrderAlgorithm observed,
weighted neighbours (`WeightedTask`), noise switched off (`ZeroNoise`), and the small statistics
the checks share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpbench.runtime import distributed
from dpbench.errors import UserError
from dpbench.privacy.mechanisms import (
    GaussianMechanism,
)


class ZeroNoise:
    """A noise source that adds nothing: the sensitivity check compares noiseless releases."""

    def __init__(self, device) -> None:
        self.device = torch.device(device)

    def sample(self, shape, std, dtype=torch.float32):
        return torch.zeros(shape, device=self.device, dtype=dtype)


class WeightedTask:
    """A task whose batches carry a per-example loss weight (the audit's adversarial neighbours).

    Scaling an example's loss by w scales its gradient (and DPZero's finite difference) by w: a
    large |w| makes every example's contribution hit its clipping bound, a negative w points it
    the other way. Any weights give a valid dataset, so the bounds must hold for them all.
    """

    def __init__(self, task) -> None:
        self.task = task
        self.train_size = task.train_size

    def batch(self, indices, weights=None):
        """`weights` None: 1 each (train.sharding=fsdp's padding chunk, whose clip factor is 0)."""
        weights = [1.0] * len(indices) if weights is None else weights
        return self.task.batch(list(indices)), torch.as_tensor(weights, dtype=torch.float32)

    def batch_size(self, batch) -> int:
        return self.task.batch_size(batch[0])

    def set_step(self, step: int) -> None:  # the step a task's loss may depend on (LDAM-DRW)
        self.task.set_step(step)

    def per_sample_loss(self, model, batch):
        inner, weights = batch
        losses = self.task.per_sample_loss(model, inner)
        return losses * weights.to(losses.device, losses.dtype)


@dataclass
class Release:
    """One observed noisy release of one step."""

    step: int
    name: str
    parts: list  # the ReleaseParts: stated sensitivity and noise std of each
    noiseless: list[list[torch.Tensor]]  # per part, its values before the noise (float64)
    noisy: list[list[torch.Tensor]]  # per part, the released values (float64)
    mechanism: GaussianMechanism  # the ledger entry derived from the stated std and sensitivity
    # the step's clipped sum as the engine formed it, chunk by chunk (`_observe_phases`): where set,
    # the noise is the release minus it, the TOTAL noise of the step wherever it was added
    reference: list[torch.Tensor] | None = None

    def key(self, part: int) -> str:
        return self.name if len(self.parts) == 1 else f"{self.name}[{part}]"

    def noise(self, part: int) -> torch.Tensor:
        """The noise part `part` actually drew, flattened (float64)."""
        return torch.cat(self.tensor_noise(part))

    def tensor_noise(self, part: int) -> list[torch.Tensor]:
        """The noise part `part` drew, one flat tensor per released tensor (float64)."""
        before = self.reference if self.reference is not None and part == 0 else self.noiseless[part]
        return [(b - a).flatten() for a, b in zip(before, self.noisy[part])]


class ReleaseRecorder:
    """Observer of an algorithm's releases, and of the mechanisms each step put in the ledger."""

    def __init__(self) -> None:
        self.releases: list[Release] = []
        self.ledger: dict[int, list[GaussianMechanism]] = {}  # step -> StepResult.mechanisms
        self.step = 0
        # DPFirstOrderAlgorithm's own phases (`_observe_phases`): per step, the engine's clipped sums
        # added over the physical chunks (float64), how many chunks, and what the optimizer received
        self.phases = False
        self.sharded = False  # the engine's sums are this rank's shard rows (train.sharding=fsdp)
        self.clipped: dict[int, list[torch.Tensor]] = {}
        self.chunks: dict[int, int] = {}
        self.updates: dict[int, Update] = {}
        self.buffers: dict[int, dict[str, float]] = {}  # step -> buffer -> relative change by the step
        self.precision: dict = {}  # release part -> PrecisionTally (audit/precision.py), in the release's dtype
        self.nulls: dict = {}  # release part -> per noised tensor, a NullTally (audit/precision.py)
        self.magnitudes: dict[int, list[torch.Tensor]] = {}  # step -> sum over chunks of |clipped sums| (float64)

    def __call__(self, name, parts, noisy, mechanism) -> None:
        from dpbench.tools.audit.precision import tally_release

        reference = None  # a one-part release of the engine's chunk sums: its step's total noise is measured too
        if self.phases and len(parts) == 1 and self.step in self.clipped and self.step in self.magnitudes \
                and not distributed.is_distributed():
            reference = (self.clipped[self.step], self.magnitudes[self.step])
        tally_release(self.precision, name, parts, noisy, self.nulls, reference)  # before anything is converted to float64
        noiseless = [[v.detach().double().clone() for v in part.values] for part in parts]
        noisy = [[v.detach().double().clone() for v in values] for values in noisy]
        self.releases.append(Release(self.step, name, list(parts), noiseless, noisy, mechanism))
        if self.phases and distributed.is_distributed() and len(noisy) == 1:
            self._combine_clipped(noisy[0])

    def _combine_clipped(self, whole: list[torch.Tensor]) -> None:
        """Under torchrun: the step's clipped sums the engine formed, over every rank's examples and
        whole, like the release the observer sees (`whole`: its noisy values). Sharded: each rank
        holds its rows (gathered); replicated: its own examples' sums (added over the ranks). Every
        rank runs this at the same release (a rank whose engine formed nothing contributes zeros).
        The chunk count stays this rank's (sharded: every rank runs the busiest rank's count)."""
        held = self.clipped.get(self.step)
        if self.sharded:
            held = held or [w.new_zeros(distributed.row_shard_shape(w.shape)) for w in whole]
            self.clipped[self.step] = [distributed.gather_rows(c, w.shape) for c, w in zip(held, whole)]
        else:
            held = held or [torch.zeros_like(w) for w in whole]
            self.clipped[self.step] = distributed.all_reduce_sum([c.clone() for c in held])

    def of_step(self, step: int) -> list[Release]:
        return [r for r in self.releases if r.step == step]


def audited_job(cfg, zero_noise: bool):
    """A job built exactly as `dpbench` builds one (fresh noise generator included)."""
    from dpbench.run import setup

    job = setup(cfg)
    if job.privacy is None:
        raise UserError(f"algo={cfg.algo.name} is not private: there is nothing to audit; pick a private algorithm")
    if zero_noise:
        job.privacy.setup.noise = ZeroNoise(job.device)
    job.algorithm.task = WeightedTask(job.task)
    recorder = ReleaseRecorder()
    job.algorithm.release_observer = recorder
    if base_phases(job.algorithm):
        _observe_phases(job.algorithm, recorder)
    return job, recorder


def base_phases(algorithm) -> bool:
    """Whether `algorithm`'s class declares it runs DPFirstOrderAlgorithm's phases unchanged
    (`runs_stock_phases`): it releases the engine's clipped sum and updates with release / expected
    batch size, which the audit checks (`update_checks`, total noise)."""
    return type(algorithm).runs_stock_phases()


def stock_phase_algorithms() -> list[str]:
    """The registered algorithms whose class runs DPFirstOrderAlgorithm's phases unchanged."""
    from dpbench.algorithms import ALGORITHMS

    return [name for name in ALGORITHMS.names() if ALGORITHMS.get(name).runs_stock_phases()]


@dataclass
class Update:
    """What the optimizer received at one step: the parameters' .grad, and the parameters before
    and after its step (float64)."""

    grads: list[torch.Tensor | None]
    before: list[torch.Tensor]
    after: list[torch.Tensor]


def _observe_phases(algorithm, recorder: ReleaseRecorder) -> None:
    """Observers at the points one algorithm instance declares: its engine's `sum_observer` (each
    physical chunk's clipped sums, before anything else touches them) and its torch optimizer's
    step hooks (what the optimizer received, and the parameters before and after its step)."""
    recorder.phases = True
    recorder.sharded = bool(algorithm.accumulates_shards)
    pending: dict[str, list] = {}

    def clipped(contribution: list[torch.Tensor], reduced: bool) -> None:
        copy = [c.detach().double().clone() for c in contribution]  # the caller adds into it in place
        total = recorder.clipped.get(recorder.step)
        if reduced:  # sharded: the step's running sums of this rank's rows
            recorder.clipped[recorder.step] = copy
            recorder.magnitudes.pop(recorder.step, None)  # of the ranks' sums: not known here
        else:
            recorder.clipped[recorder.step] = copy if total is None else [t + c for t, c in zip(total, copy)]
            size = recorder.magnitudes.get(recorder.step)
            recorder.magnitudes[recorder.step] = ([c.abs() for c in copy] if size is None or total is None
                                                  else [m + c.abs() for m, c in zip(size, copy)])
        recorder.chunks[recorder.step] = recorder.chunks.get(recorder.step, 0) + 1

    def before_step(optimizer, args, kwargs) -> None:
        params = algorithm.params  # sharded (DTensors): read whole, as one process holds them
        pending["grads"] = [None if p.grad is None else whole(p.grad).detach().double().clone() for p in params]
        pending["before"] = [whole(p).detach().double().clone() for p in params]

    def after_step(optimizer, args, kwargs) -> None:
        after = [whole(p).detach().double().clone() for p in algorithm.params]
        recorder.updates[recorder.step] = Update(pending.pop("grads"), pending.pop("before"), after)

    algorithm.engine.sum_observer = clipped
    algorithm.optimizer.register_step_pre_hook(before_step)
    algorithm.optimizer.register_step_post_hook(after_step)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor (FSDP2's DTensor) in full (an all-gather: every rank reads it alike); any
    other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def physical_chunks(job, indices: list[int], weights: list[float], size: int | None = None) -> list:
    """The logical batch in the trainer's physical chunks (`Trainer._physical_batches`'s rule;
    `size`: chunks of that many examples instead). Under torchrun, this rank's share of it, as the
    trainer splits a logical batch (`ShardedBatches`: indices[r::K]); the ranks' releases are sums
    over all their shares, so over the whole logical batch, as in one process."""
    task = job.algorithm.task
    if distributed.is_distributed():
        share = slice(distributed.rank(), None, distributed.world_size())
        indices, weights = list(indices)[share], list(weights)[share]
    size = size or job.cfg.train.physical_batch_size or max(1, len(indices))
    chunks = [task.batch(indices[i : i + size], weights[i : i + size]) for i in range(0, len(indices), size)]
    return chunks or [task.batch([], [])]


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().double().clone() for name, b in model.named_buffers()}


def _buffer_changes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> dict[str, float]:
    """buffer -> |after - before| / max(|before|, |after|) (in [0, 2]) of the buffers that changed."""
    changes = {}
    for name, old in before.items():
        new = after.get(name)
        if new is None or new.shape != old.shape:
            changes[name] = 1.0  # replaced
        elif not torch.equal(old, new):
            changes[name] = float((new - old).norm()) / max(float(old.norm()), float(new.norm()))
    return changes


def audited_step(job, recorder: ReleaseRecorder, batches: list, step: int) -> None:
    recorder.step = step
    before = _buffers(job.model)
    result = job.algorithm.train_step(batches, step)
    recorder.ledger[step] = list(result.mechanisms)
    recorder.buffers[step] = _buffer_changes(before, _buffers(job.model))


def chi_square_p_value(sum_of_squares: float, dof: int) -> float:
    from scipy.stats import chi2

    lower = chi2.cdf(sum_of_squares, dof)
    return float(2 * min(lower, 1 - lower))


def normal_quantile(alpha: float, tests: int) -> float:
    """|z| a standard normal exceeds with probability alpha / tests (Bonferroni)."""
    from scipy.stats import norm

    return float(norm.isf(alpha / (2 * max(1, tests))))


def two_sided_normal(z: float) -> float:
    from scipy.stats import norm

    return float(2 * norm.sf(abs(z)))


def describe_mechanisms(mechanisms: list[GaussianMechanism]) -> str:
    return "[" + ", ".join(f"sigma {m.noise_multiplier:.4g} q {m.sample_rate:.4g} {m.neighboring}" for m in mechanisms) + "]"


def value_range(values) -> str:
    values = sorted(set(values))
    return f"{values[0]:.4g}" if len(values) == 1 else f"{values[0]:.4g}..{values[-1]:.4g}"


def dropout_off(model: torch.nn.Module) -> None:
    """Dropout layers to eval mode (the rest stays in train mode: Opacus's hooks need it), so that
    two neighbouring runs differ in the neighbour only, not in their dropout masks."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.eval()
            module.p = 0.0  # transformers 5 attention reads the module's p with its parent's training flag
