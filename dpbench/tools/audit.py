"""`dpbench-audit`: an empirical self-check of a private algorithm's privacy claims.

    dpbench-audit algo=grape model=cnn        # same config and overrides as `dpbench`

It runs the algorithm as a run builds it (`dpbench.run.setup`: train.precision, algo.per_sample,
train.physical_batch_size and every other override apply) and observes every noisy release
through `Algorithm.gaussian_release`. The checks compare what ran with what the run's PLAN
declares (the mechanisms `planned(step)` the accountant composes into the reported epsilon), never
only with what the algorithm says it drew:

  noise         in two fresh jobs, the noise each release actually added has, step by step, the
                std the plan declares for that step and release: the planned noise multiplier x the
                release's stated sensitivity (two-sided chi-square test). Each audited step has >= 4
                physical chunks, and where the algorithm runs DPFirstOrderAlgorithm's phases the
                noise is the step's TOTAL (the release minus the clipped sums the engine formed,
                chunk by chunk), else the release's noisy - noiseless;
  noise across runs  the two fresh jobs (same config, same seed) draw different noise: the pooled
                correlation of their noise at the same step is within z / sqrt(n) of 0;
  independence  that noise is independent across steps: the pooled correlation of the
                (plan-normalised) noise of steps t and t+lag is within z / sqrt(n) of 0 for n
                coordinate pairs (z: the normal quantile at audit.alpha, Bonferroni-corrected over
                the lags); noise repeated every step fails;
  sensitivity   with the noise off, neighbouring batches (one example added, removed or replaced;
                every loss scaled up so that every example is clipped, the neighbour's gradient
                pointing either way) move each released quantity by at most the sensitivity the
                ledger assumes (2x for a replacement); for DC-DPSGD the added example can take the
                tail from another one; an added record whose loss is NaN never halts a step; an
                added copy of an example, against it, outweighing the whole batch (clipping the sum
                instead of each example moves it by up to 2x);
  release → update  at every audited step of the noise check, the optimizer's input is the recorded
                noisy release / the expected batch size (public post-processing only), and for a
                plain SGD the parameter change is -lr x it (DPFirstOrderAlgorithm's phases: dpsgd,
                dpadam; "not applicable" for algorithms that override them); and, for every
                algorithm, no model buffer changes during a step (no dpbench algorithm writes a
                buffer from its release, so a change is un-noised batch data in the model:
                BatchNorm's running statistics);
  sampler       the run's sampler, built as the run builds it: Poisson sizes ~ Binomial(n, q) and
                independent inclusions across steps where Poisson is accounted (shuffled: batches
                of B, disjoint within an epoch), and two fresh samplers of one seed draw differently;
  accounting    a step's releases (which read one sampled batch) are planned as ONE mechanism; every
                audited step's ledger entries (the mechanisms derived from the released std
                and stated sensitivity) are its planned ones (the trainer's per-step check), and
                the planned ledger's epsilon, recomputed with Google's dp-accounting (RDP and PLD)
                apart from the configured accountant, is not above the epsilon the run reports.

The statistical checks (noise, independence, noise across runs, sampler) are one family: each of
its k tests passes when its p-value is above audit.alpha / k (Bonferroni, `family_corrected`), so
a clean run fails one of them with probability at most audit.alpha.

Prints a table, writes audit.json in the run folder, exits 0 when every check holds, else 1.
`audit.seeded_bug=NAME|all` runs the audit under seeded bugs instead (dpbench/tools/seeded_bugs.py).
The sensitivity check turns dropout layers off so that the two neighbouring runs differ only in
the neighbour; the per-example clipping of recomputed gradients under dropout is covered by the
test suite. Under train.precision=fp16 it scales the losses only as far as fp16's range allows
(see `sensitivity_check`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dpbench.errors import DivergedError, UserError
from dpbench.privacy.mechanisms import (
    GaussianMechanism, SeveralMechanismsPerBatchError, one_batch_mechanism, same_mechanisms,
)
from dpbench.tools.audit_report import CHECK_ORDER, UPDATE, AuditReport, Check, family_corrected
from dpbench.tools.one_run import one_run_audit


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

    def batch(self, indices, weights):
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
        before = self.reference if self.reference is not None and part == 0 else self.noiseless[part]
        return torch.cat([(b - a).flatten() for a, b in zip(before, self.noisy[part])])


class ReleaseRecorder:
    """Observer of an algorithm's releases, and of the mechanisms each step put in the ledger."""

    def __init__(self) -> None:
        self.releases: list[Release] = []
        self.ledger: dict[int, list[GaussianMechanism]] = {}  # step -> StepResult.mechanisms
        self.step = 0
        # DPFirstOrderAlgorithm's own phases (`_observe_phases`): per step, the engine's clipped sums
        # added over the physical chunks (float64), how many chunks, and what the optimizer received
        self.phases = False
        self.clipped: dict[int, list[torch.Tensor]] = {}
        self.chunks: dict[int, int] = {}
        self.updates: dict[int, Update] = {}
        self.buffers: dict[int, dict[str, float]] = {}  # step -> buffer -> relative change by the step

    def __call__(self, name, parts, noisy, mechanism) -> None:
        noiseless = [[v.detach().double().clone() for v in part.values] for part in parts]
        noisy = [[v.detach().double().clone() for v in values] for values in noisy]
        self.releases.append(Release(self.step, name, list(parts), noiseless, noisy, mechanism))

    def of_step(self, step: int) -> list[Release]:
        return [r for r in self.releases if r.step == step]


def _audited_job(cfg, zero_noise: bool):
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


# DPFirstOrderAlgorithm's phases (clip_and_accumulate -> add_noise -> scale_grad -> apply_update): an
# algorithm that overrides none of them releases the clipped sum of the engine and updates with
# release / expected batch size, which the audit checks (`update_checks`, total noise).
BASE_PHASES = ("step", "privatize", "clip_and_accumulate", "add_noise", "scale_grad", "apply_update")


def base_phases(algorithm) -> bool:
    """Whether `algorithm` runs DPFirstOrderAlgorithm's own phases (dpsgd, dpadam)."""
    from dpbench.algorithms.base import DPFirstOrderAlgorithm

    if not isinstance(algorithm, DPFirstOrderAlgorithm):
        return False
    owner = {name: next(c for c in type(algorithm).__mro__ if name in vars(c)) for name in BASE_PHASES}
    return all(c is DPFirstOrderAlgorithm for c in owner.values())


@dataclass
class Update:
    """What the optimizer received at one step: the parameters' .grad, and the parameters before
    and after its step (float64)."""

    grads: list[torch.Tensor | None]
    before: list[torch.Tensor]
    after: list[torch.Tensor]


def _observe_phases(algorithm, recorder: ReleaseRecorder) -> None:
    """Seams on one algorithm instance: its engine's clipped sum of each physical chunk (before
    anything else touches it), and its optimizer's input and effect."""
    recorder.phases = True
    engine_sum, optimizer_step = algorithm.engine.clipped_sum, algorithm.optimizer.step

    def clipped_sum(*args, **kwargs):
        contribution = engine_sum(*args, **kwargs)
        copy = [c.detach().double().clone() for c in contribution]  # the caller adds into it in place
        total = recorder.clipped.get(recorder.step)
        recorder.clipped[recorder.step] = copy if total is None else [t + c for t, c in zip(total, copy)]
        recorder.chunks[recorder.step] = recorder.chunks.get(recorder.step, 0) + 1
        return contribution

    def step(*args, **kwargs):
        params = algorithm.params
        grads = [None if p.grad is None else p.grad.detach().double().clone() for p in params]
        before = [p.detach().double().clone() for p in params]
        out = optimizer_step(*args, **kwargs)
        recorder.updates[recorder.step] = Update(grads, before, [p.detach().double().clone() for p in params])
        return out

    algorithm.engine.clipped_sum = clipped_sum
    algorithm.optimizer.step = step


def _physical(job, indices: list[int], weights: list[float], size: int | None = None) -> list:
    """The logical batch in the trainer's physical chunks (`Trainer._physical_batches`'s rule;
    `size`: chunks of that many examples instead)."""
    task = job.algorithm.task
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


def _train_step(job, recorder: ReleaseRecorder, batches: list, step: int) -> None:
    recorder.step = step
    before = _buffers(job.model)
    result = job.algorithm.train_step(batches, step)
    recorder.ledger[step] = list(result.mechanisms)
    recorder.buffers[step] = _buffer_changes(before, _buffers(job.model))


def _chi_square_p_value(sum_of_squares: float, dof: int) -> float:
    from scipy.stats import chi2

    lower = chi2.cdf(sum_of_squares, dof)
    return float(2 * min(lower, 1 - lower))


SCALAR_DRAWS = 200  # empty-batch steps added when a release is one number per step
MAX_LAGS = 8  # independence across steps: steps t and t+lag for lag 1..MAX_LAGS


def planned_stds(releases: list[Release], planned: list[GaussianMechanism]) -> list[list[float]] | None:
    """Per release and part, the noise std the PLAN declares (None: releases the plan cannot cover).

    All releases of a step read its one sampled batch and make ONE planned mechanism
    (`one_batch_mechanism`), so the plan fixes the multiplier of all their parts whitened together:
    each part keeps the proportions the algorithm stated and the scale the plan declares."""
    if not planned or len(planned) > 1:
        return [] if not planned and not releases else None
    plan, parts = planned[0], [part for release in releases for part in release.parts]
    stated = one_batch_mechanism([release.mechanism for release in releases])
    if stated and stated[0].noise_multiplier > 0:
        factor = plan.noise_multiplier / stated[0].noise_multiplier
        return [[part.noise_std * factor for part in release.parts] for release in releases]
    # releases that state no noise: the plan's multiplier spread evenly over their parts
    return [[plan.noise_multiplier * part.sensitivity * math.sqrt(len(parts)) for part in release.parts]
            for release in releases]


def _normal_quantile(alpha: float, tests: int) -> float:
    """|z| a standard normal exceeds with probability alpha / tests (Bonferroni)."""
    from scipy.stats import norm

    return float(norm.isf(alpha / (2 * max(1, tests))))


def pooled_correlation(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
    """sum <a, b> / sqrt(sum |a|^2 sum |b|^2) over paired noise vectors, and n, the number of
    coordinate pairs: for independent zero-mean noise of equal std, sqrt(n) x it is ~ N(0, 1)."""
    dot = sum(float(a @ b) for a, b in pairs)
    norms = sum(float(a @ a) for a, _ in pairs) * sum(float(b @ b) for _, b in pairs)
    return (dot / math.sqrt(norms) if norms > 0 else 0.0), sum(a.numel() for a, _ in pairs)


def _independence_check(key: str, across: str, statistics: list[tuple[str, float, int]], alpha: float,
                        name: str = "independence") -> Check:
    """One check over (what, correlation, n) statistics: every |corr| <= z / sqrt(n)."""
    z = _normal_quantile(alpha, len(statistics))
    release = f"{key} across {across}" if name == "independence" else key
    if not statistics:
        return Check(name, release, 0.0, 0.0, True,
                     f"released at one step only: nothing to compare across {across} (raise audit.noise_steps)")
    what, corr, n = max(statistics, key=lambda s: abs(s[1]) * math.sqrt(s[2]))
    bound = z / math.sqrt(n)
    p_value = min(1.0, len(statistics) * _two_sided_normal(abs(corr) * math.sqrt(n)))  # Bonferroni over them
    return Check(
        name, release, abs(corr), bound, abs(corr) <= bound,
        f"largest |corr| of the noise {what} = {abs(corr):.4f} over n = {n} coordinate pairs; independent noise "
        f"stays within z/sqrt(n) = {z:.2f}/sqrt({n}) = {bound:.4f} (z at alpha {alpha:g} over {len(statistics)} "
        f"correlations, Bonferroni)",
        p_value=p_value,
    )


@dataclass
class DrawnNoise:
    """The noise two fresh jobs drew, measured against their plan."""

    # release part -> [sum (noise / planned std)^2, draws, planned stds, stated stds]
    squares: dict[str, list] = field(default_factory=dict)
    # per job: size -> step -> that step's noise / planned std. Release parts of one size are
    # compared across steps whatever their name (DPDR's step-0 gradient, then its decomposed one).
    by_size: list[dict[int, dict[int, torch.Tensor]]] = field(default_factory=list)
    names: dict[int, set[str]] = field(default_factory=dict)  # size -> the release parts of that size
    unplanned: dict[int, str] = field(default_factory=dict)  # step -> why its releases are not its plan's
    ledger_mismatches: list[str] = field(default_factory=list)  # steps whose ledger is not their plan
    steps: int = 0  # audited steps, over both jobs
    chunks: dict[str, set[int]] = field(default_factory=dict)  # release part -> physical chunks of its total-noise steps

    def add_job(self, plan, recorder: ReleaseRecorder) -> None:
        series: dict[int, dict[int, list[torch.Tensor]]] = {}
        for step in sorted(recorder.ledger):
            self.steps += 1
            releases, planned = recorder.of_step(step), plan.planned(step)
            if not same_mechanisms(recorder.ledger[step], planned):
                self.ledger_mismatches.append(
                    f"step {step} ran {_describe(recorder.ledger[step])}, its plan {_describe(planned)}")
            clipped = recorder.clipped.get(step)
            if (recorder.phases and clipped is not None and len(releases) == 1 and len(releases[0].parts) == 1
                    and [v.shape for v in clipped] == [v.shape for v in releases[0].noisy[0]]):
                releases[0].reference = clipped  # the step's total noise: release - the engine's clipped sum
                self.chunks.setdefault(releases[0].key(0), set()).add(recorder.chunks[step])
            stds = planned_stds(releases, planned)
            if stds is None:
                self.unplanned[step] = (f"step {step} made {len(releases)} releases but its plan declares "
                                        f"{len(planned)} mechanisms (a step's releases are one mechanism)")
                continue
            for release, part_stds in zip(releases, stds):
                for k, std in enumerate(part_stds):
                    noise, key = release.noise(k), release.key(k)
                    entry = self.squares.setdefault(key, [0.0, 0, set(), set()])
                    entry[1] += noise.numel()
                    entry[2].add(std)
                    entry[3].add(release.parts[k].noise_std)
                    if std == 0:  # a noiseless plan: any drawn noise is a mismatch
                        entry[0] += math.inf if bool((noise != 0).any()) else 0.0
                        continue
                    entry[0] += float((noise / std).pow(2).sum())
                    series.setdefault(noise.numel(), {}).setdefault(step, []).append(noise / std)
                    self.names.setdefault(noise.numel(), set()).add(key)
        self.by_size.append({size: {step: torch.cat(noise) for step, noise in by_step.items()}
                             for size, by_step in series.items()})

    def std_checks(self, alpha: float, expected_batch_size: float) -> list[Check]:
        checks = [Check("noise", f"step {step}", 0.0, 0.0, False, why) for step, why in sorted(self.unplanned.items())]
        for key, (total, count, planned, stated) in self.squares.items():
            if math.isinf(total):
                checks.append(Check("noise", key, math.inf, 1.0, False, "the plan declares no noise but noise was drawn"))
                continue
            p_value = _chi_square_p_value(total, count)
            ratio = math.sqrt(total / count)
            chunks = self.chunks.get(key)
            measured = (f"each step's total noise (the release - the clipped sums of its {_values(chunks)} physical chunks, "
                        "as the engine formed them)" if chunks else "the noise drawn (noisy - noiseless)")
            checks.append(Check(
                "noise", key, ratio, 1.0, p_value > alpha,
                f"{measured}: std / planned std = {ratio:.4f} over {count} draws in 2 fresh jobs; planned std (the plan's "
                f"noise multiplier x the stated sensitivity) {_values(planned)}, the release stated {_values(stated)} "
                f"(update std {_values(s / expected_batch_size for s in planned)}); chi-square p = {p_value:.3g}",
                p_value=p_value,
            ))
        return checks

    def independence_checks(self, alpha: float) -> list[Check]:
        checks = []
        for size in sorted(self.names, key=lambda size: sorted(self.names[size])):
            label = ", ".join(sorted(self.names[size]))
            across_steps = []
            for j, series in enumerate(self.by_size):
                noise = series.get(size, {})
                for lag in range(1, MAX_LAGS + 1):
                    pairs = [(noise[t], noise[t + lag]) for t in noise if t + lag in noise and noise[t].shape == noise[t + lag].shape]
                    if pairs:
                        across_steps.append((f"of steps t and t+{lag} (job {j + 1})", *pooled_correlation(pairs)))
            checks.append(_independence_check(label, "steps", across_steps, alpha))
            first, second = (series.get(size, {}) for series in self.by_size)
            pairs = [(first[t], second[t]) for t in first if t in second and first[t].shape == second[t].shape]
            across_jobs = [("of two fresh jobs (same config, same seed) at the same step", *pooled_correlation(pairs))] if pairs else []
            checks.append(_independence_check(label, "jobs", across_jobs, alpha, name="noise across runs"))
        return checks

    def ledger_check(self) -> Check:
        """The trainer's per-step check (`PrivacyPlan.check_step`) over the audited steps."""
        mismatches = self.ledger_mismatches
        detail = ("; ".join(mismatches[:2]) + (f" (and {len(mismatches) - 2} more)" if len(mismatches) > 2 else "")
                  if mismatches else f"each of the {self.steps} audited steps put its planned mechanisms in the ledger")
        return Check("accounting", "ledger vs plan", len(mismatches), 0.0, not mismatches, detail)


def noise_check(cfg) -> list[Check]:
    """Noise drawn vs the planned std, its independence across steps and across two fresh jobs,
    and each step's ledger vs its plan, over `audit.noise_steps` ordinary steps."""
    steps = int(cfg.audit.noise_steps)
    if steps < 2:
        raise UserError(f"audit.noise_steps={steps} must be at least 2 (independence compares steps); raise it")
    jobs = [_audited_job(cfg, zero_noise=False) for _ in range(2)]  # two fresh runs: their noise must differ
    n, batch = jobs[0][0].task.train_size, int(cfg.audit.batch)
    generator = torch.Generator().manual_seed(0)
    # realised sizes batch and batch + 1 (never both the expected size: `update_checks`), in chunks
    # of at most batch // 4, so that each step has >= 4 physical chunks (the noise is each step's total)
    schedule = [torch.randperm(n, generator=generator)[:batch + step % 2].tolist() for step in range(steps)]
    chunk = max(1, batch // 4)
    if cfg.train.physical_batch_size:
        chunk = min(chunk, int(cfg.train.physical_batch_size))
    for job, recorder in jobs:
        for step, indices in enumerate(schedule):
            _train_step(job, recorder, _physical(job, indices, [1.0] * len(indices), chunk), step)
    if any(sum(v.numel() for part in r.noiseless for v in part) == 1 for r in jobs[0][1].releases):
        for job, recorder in jobs:  # a scalar release (DPZero): more draws from empty Poisson batches (pure noise, cheap)
            for step in range(steps, steps + SCALAR_DRAWS):
                _train_step(job, recorder, _physical(job, [], []), step)
    drawn = DrawnNoise()
    for job, recorder in jobs:
        drawn.add_job(job.privacy, recorder)
    alpha = float(cfg.audit.alpha)
    return [*drawn.std_checks(alpha, jobs[0][0].privacy.setup.expected_batch_size),
            *drawn.independence_checks(alpha), drawn.ledger_check(), update_check(jobs), buffer_check(jobs)]


def _relative(values: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """|values - reference| / |reference| over a list of tensors (inf when a value is missing)."""
    if any(v is None for v in values) or [v.shape for v in values] != [r.shape for r in reference]:
        return math.inf
    difference = math.sqrt(sum(float((v - r).pow(2).sum()) for v, r in zip(values, reference)))
    norm = math.sqrt(sum(float(r.pow(2).sum()) for r in reference))
    return difference / norm if norm > 0 else (0.0 if difference == 0 else math.inf)


def _plain_sgd(optimizer) -> float | None:
    """The learning rate of an SGD without momentum, weight decay or maximize (its parameter change is
    -lr x the gradient), else None."""
    if type(optimizer) is not torch.optim.SGD or len(optimizer.param_groups) != 1:
        return None
    group = optimizer.param_groups[0]
    plain = not group.get("momentum") and not group.get("weight_decay") and not group.get("maximize")
    return float(group["lr"]) if plain else None


UPDATE_TOLERANCE = 1e-4  # relative: float32 rounding is ~1e-7; a broken update path is off by O(1)


def update_check(jobs) -> Check:
    """release -> update: at every audited step of the noise check's two jobs, the optimizer's input
    (the parameters' .grad at its step) is the step's recorded noisy release / the expected batch
    size (public post-processing only), and for a plain SGD the parameter change is -lr x that."""
    job, recorder = jobs[0]
    name = type(job.algorithm).__name__
    if not recorder.phases:
        return Check(UPDATE, "optimizer input", 0.0, UPDATE_TOLERANCE, True,
                     f"not applicable: {name} overrides DPFirstOrderAlgorithm's phases (its update is not release / "
                     "expected batch size); the check covers the algorithms that run them (dpsgd, dpadam)")
    expected_size = job.privacy.setup.expected_batch_size
    worst_grad, worst_change, steps, problems = 0.0, 0.0, 0, []
    sgd_lr = _plain_sgd(job.algorithm.optimizer)
    fp32 = all(p.dtype in (torch.float32, torch.float64) for p in job.algorithm.params)
    for _, rec in jobs:
        for step in sorted(rec.ledger):
            releases = rec.of_step(step)
            if len(releases) != 1 or len(releases[0].parts) != 1:
                problems.append(f"step {step} made {len(releases)} releases")
                continue
            steps += 1
            target = [v / expected_size for v in releases[0].noisy[0]]
            update = rec.updates.get(step)
            if update is None:
                worst_grad = math.inf
                problems.append(f"the optimizer did not step at step {step}")
                continue
            worst_grad = max(worst_grad, _relative(update.grads, target))
            if sgd_lr is not None and fp32:
                change = [a - b for a, b in zip(update.after, update.before)]
                worst_change = max(worst_change, _relative(change, [-sgd_lr * t for t in target]))
    worst = max(worst_grad, worst_change)
    change = (f"; the parameter change vs -lr x it: {worst_change:.3g}" if sgd_lr is not None and fp32
              else "; (the optimizer is not a plain SGD: its parameter change is not checked)")
    detail = (f"at each of the {steps} audited steps (2 fresh jobs, realised batch sizes differing from the expected "
              f"{expected_size:g}), the optimizer's gradient vs the recorded noisy release / {expected_size:g}: largest "
              f"relative deviation {worst_grad:.3g}{change}; anything but public post-processing of the release "
              f"(an un-noised sum, the realised batch size) deviates by O(1)")
    if problems:
        detail = "; ".join(problems[:2]) + "; " + detail
    return Check(UPDATE, "optimizer input", worst, UPDATE_TOLERANCE, worst <= UPDATE_TOLERANCE and not problems, detail)


def buffer_check(jobs) -> Check:
    """release → update on the model's buffers: at every audited step of the noise check's two jobs,
    no buffer changed. A step's only private output is its release; no dpbench algorithm writes a
    buffer from it, so a buffer the step wrote (BatchNorm's running mean and variance) carries the
    batch's un-noised statistics into the model."""
    names = [name for name, _ in jobs[0][0].model.named_buffers()]
    changed: dict[str, list] = {}  # buffer -> [largest relative change, the steps that changed it]
    steps = 0
    for _, recorder in jobs:
        for step, changes in sorted(recorder.buffers.items()):
            steps += 1
            for name, change in changes.items():
                entry = changed.setdefault(name, [0.0, set()])
                entry[0], entry[1] = max(entry[0], change), entry[1] | {step}
    worst = max((change for change, _ in changed.values()), default=0.0)
    if not names:
        detail = f"the model has no buffers: nothing a step could write besides its parameters ({steps} audited steps)"
    elif not changed:
        detail = f"none of the model's {len(names)} buffers changed at any of the {steps} audited steps (2 fresh jobs)"
    else:
        shown = sorted(changed.items(), key=lambda item: -item[1][0])
        listed = ", ".join(f"{name} (relative change {c:.3g}, steps {_values(s)})" for name, (c, s) in shown[:3])
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        detail = (f"{len(changed)} of the model's {len(names)} buffers changed during private steps: {listed}{more}; "
                  "a buffer written from the batch (BatchNorm's running statistics) is un-noised batch data in "
                  "the model, which no release covers")
    return Check(UPDATE, "buffers", worst, 0.0, not changed, detail)


SAMPLER_DRAWS = 200  # batches drawn from each of two fresh samplers (no training: cheap)


def _run_sampler(cfg, job):
    """The private run's sampler, built as `dpbench.run` builds it (fresh entropy, not the seed): over
    the training part, at the planned (accounted) sample rate and epoch length."""
    from dpbench.privacy.sampling import build_sampler

    return build_sampler(str(cfg.privacy.sampling), job.task.train_size, int(cfg.train.batch_size), int(cfg.seed), True,
                         job.privacy.batches_per_epoch, sample_rate=float(job.privacy.setup.sample_rate),
                         relation=str(cfg.privacy.get("neighboring", "add_remove")))


def _two_sided_normal(z: float) -> float:
    from scipy.stats import norm

    return float(2 * norm.sf(abs(z)))


def sampler_check(cfg, job) -> list[Check]:
    """sampler: the private batch selection is the one the plan accounts. Under Poisson sampling the
    realised sizes are Binomial(n, q) (two-sided tests of their mean and dispersion) and inclusions
    are independent across steps (the overlap of consecutive batches vs n q^2); shuffled batches are
    of size B and disjoint within an epoch; either way two fresh samplers with the same seed draw
    different batches."""
    import itertools

    n, alpha = job.task.train_size, float(cfg.audit.alpha)
    draws = [list(itertools.islice(iter(_run_sampler(cfg, job)), SAMPLER_DRAWS)) for _ in range(2)]
    first = draws[0]
    identical = sum(a == b for a, b in zip(*draws))
    checks = []
    if job.privacy.batches_per_epoch is None:  # Poisson accounted
        q = float(job.privacy.setup.sample_rate)
        sizes = torch.tensor([len(b) for b in first], dtype=torch.float64)
        mean, var, S = n * q, n * q * (1 - q), len(first)
        if var == 0:  # q = 1: every batch is the whole set, a size off n is impossible
            z_mean, dispersion = 0.0, float((sizes - mean).pow(2).sum())
            p_sizes = 1.0 if dispersion == 0 else 0.0
        else:
            z_mean = float(sizes.sum() - S * mean) / math.sqrt(S * var)
            dispersion = float((sizes - mean).pow(2).sum()) / var  # ~ chi-square with S degrees of freedom
            p_sizes = min(1.0, 3 * min(_two_sided_normal(z_mean), _chi_square_p_value(dispersion, S)))
        checks.append(Check(
            "sampler", "batch sizes ~ Binomial(n, q)", dispersion / S, 1.0, p_sizes > alpha,
            f"{S} batches of the run's sampler: mean size {float(sizes.mean()):.2f} (n q = {mean:.2f}, z = {z_mean:.2f}), "
            f"variance / n q (1 - q) = {dispersion / S:.3f} (two-sided chi-square); p = {p_sizes:.3g} (Bonferroni over "
            "3); fixed-size batches have variance 0", p_value=p_sizes))
        overlap = sum(len(set(a) & set(b)) for a, b in itertools.pairwise(first))
        expected = (S - 1) * n * q * q
        variance = (S - 1) * n * q * q * (1 - q * q) + 2 * (S - 2) * n * (q ** 3 - q ** 4)
        z = (overlap - expected) / math.sqrt(variance) if variance > 0 else 0.0
        p_overlap = min(1.0, 3 * _two_sided_normal(z))
        checks.append(Check(
            "sampler", "inclusions across steps", overlap / expected if expected else 0.0, 1.0, p_overlap > alpha,
            f"examples in both of two consecutive batches: {overlap} vs (S - 1) n q^2 = {expected:.1f} for independent "
            f"inclusions (z = {z:.2f}, p = {p_overlap:.3g}); an epoch's disjoint batches give fewer", p_value=p_overlap))
    else:  # shuffled batches, accounted per epoch
        per_epoch, size = job.privacy.batches_per_epoch, int(cfg.train.batch_size)
        bad = [t for t, b in enumerate(first) if len(b) != size or len(set(b)) != size]
        epochs = [first[i:i + per_epoch] for i in range(0, len(first), per_epoch)]
        repeated = sum(sum(map(len, e)) - len(set(itertools.chain.from_iterable(e))) for e in epochs)
        checks.append(Check(
            "sampler", "shuffled epochs", float(len(bad) + repeated), 0.0, not bad and not repeated,
            f"{len(first)} batches: {len(bad)} not of size {size}, {repeated} examples repeated within an epoch of "
            f"{per_epoch} batches"))
    checks.append(Check(
        "sampler", "two fresh runs", identical / len(first), 1.0, identical < len(first),
        f"two fresh samplers of one config (seed {cfg.seed}) drew {identical} identical batches of {len(first)}; "
        "a selection seeded from `seed` repeats every batch"))
    return checks


def _describe(mechanisms: list[GaussianMechanism]) -> str:
    return "[" + ", ".join(f"sigma {m.noise_multiplier:.4g} q {m.sample_rate:.4g} {m.neighboring}" for m in mechanisms) + "]"


def _values(values) -> str:
    values = sorted(set(values))
    return f"{values[0]:.4g}" if len(values) == 1 else f"{values[0]:.4g}..{values[-1]:.4g}"


def _dropout_off(model: torch.nn.Module) -> None:
    """Dropout layers to eval mode (the rest stays in train mode: Opacus's hooks need it), so that
    two neighbouring runs differ in the neighbour only, not in their dropout masks."""
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.eval()


def _difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """L2 distance of two releases; per-example vectors of neighbouring batches align on their
    common prefix (the neighbour is the last example)."""
    if a.shape == b.shape:
        return float((a - b).norm())
    longer, shorter = (a, b) if a.shape[0] > b.shape[0] else (b, a)
    if a.dim() == 0 or a.shape[1:] != b.shape[1:] or longer.shape[0] - shorter.shape[0] != 1:
        raise RuntimeError(f"cannot compare releases of shapes {tuple(a.shape)} and {tuple(b.shape)}")
    common = shorter.shape[0]
    return float(torch.cat([(longer[:common] - shorter).flatten(), longer[common:].flatten()]).norm())


def _release_differences(first: ReleaseRecorder, second: ReleaseRecorder) -> list[tuple[str, float, float]]:
    """(release part, distance, add/remove sensitivity) for the releases of one step."""
    out = []
    for a, b in zip(first.releases, second.releases):
        for k, (part, values_a, values_b) in enumerate(zip(a.parts, a.noiseless, b.noiseless)):
            distance = math.sqrt(sum(_difference(x, y) ** 2 for x, y in zip(values_a, values_b)))
            out.append((a.key(k), distance, part.sensitivity))
    return out


def sensitivity_check(cfg) -> list[Check]:
    """Neighbouring batches with the noise off: each release moves by at most its sensitivity.

    Every loss is scaled by audit.loss_scale so that every example hits its clipping bound. Under
    train.precision=fp16 the backward already multiplies the loss by FP16_LOSS_SCALE and fp16
    overflows at 65504, so the audit's scale starts at what that range leaves (65504 /
    FP16_LOSS_SCALE, rounded down to a power of 2) and is divided by 4 whenever a per-example
    gradient overflows; the scale used is in the detail. A smaller scale can leave some examples unclipped: the check stays
    sound (the bound must hold for any weights), it is only less sharp."""
    from dpbench.precision import FP16_LOSS_SCALE

    scale = float(cfg.audit.loss_scale)
    if str(cfg.train.precision) != "fp16":
        return _sensitivity_checks(cfg, scale, f"losses x {scale:g}")
    scale = min(scale, 2.0 ** math.floor(math.log2(torch.finfo(torch.float16).max / FP16_LOSS_SCALE)))
    while True:
        try:
            return _sensitivity_checks(cfg, scale, f"losses x {scale:g}, capped so that fp16 gradients stay in range")
        except DivergedError:
            if scale <= 1:
                raise UserError("an fp16 per-example gradient overflowed even at the run's own loss scale: "
                                "audit with train.precision=bf16 or fp32") from None
            scale = max(1.0, scale / 4)


OUTWEIGH = 100  # the outweighing neighbour's loss weight, x the batch size x the other examples' weight


def _sensitivity_checks(cfg, scale: float, scaling: str) -> list[Check]:
    batch = int(cfg.audit.batch)
    worst: dict[str, tuple[float, float, str]] = {}  # part -> (ratio, distance, how)
    generator = torch.Generator().manual_seed(1)
    halted: list[str] = []  # steps a non-finite record halted
    for step in range(int(cfg.audit.sensitivity_steps)):
        for trial in range(int(cfg.audit.trials) + 2):
            if trial >= int(cfg.audit.trials) and step < int(cfg.audit.sensitivity_steps) - 1:
                continue  # the non-finite and outweighing records: at the last audited step only (every step kind by then)
            pair = [_audited_job(cfg, zero_noise=True) for _ in range(2)]
            n = pair[0][0].task.train_size
            order = torch.randperm(n, generator=generator).tolist()
            base, outsider = order[:batch], order[batch]
            sign = 1.0 if trial % 2 == 0 else -1.0
            for (job, _) in pair:
                _dropout_off(job.model)
            for warm in range(step):  # identical history up to the audited step
                for (job, recorder) in pair:
                    torch.manual_seed(warm)
                    _train_step(job, recorder, _physical(job, base, [scale] * batch), warm)
            neighbours = {
                "add": (base + [outsider], [scale] * batch + [sign * scale]),
                "remove": (base[:-1], [scale] * (batch - 1)),
                "replace": (base[:-1] + [outsider], [scale] * (batch - 1) + [sign * scale]),
            }
            # the last trial adds a record whose loss is NaN: it must contribute nothing and never halt
            neighbours["add non-finite"] = (base + [outsider], [scale] * batch + [math.nan])
            # and then a copy of the batch's first example (a record may repeat) whose loss, against its own,
            # outweighs the whole batch: clipping the SUM instead of each example moves the release by up
            # to 2x the sensitivity (the clipped sum turns round), per-example clipping by at most 1x
            neighbours["add outweighing"] = (base + [base[0]], [scale] * batch + [-OUTWEIGH * batch * scale])
            kind = ("add non-finite" if trial == int(cfg.audit.trials) else "add outweighing" if trial > int(cfg.audit.trials)
                    else ("add", "remove", "replace")[trial % 3])
            try:
                for (job, recorder), (indices, weights) in zip(pair, [(base, [scale] * batch), neighbours[kind]]):
                    recorder.releases.clear()
                    torch.manual_seed(10_000 + step)
                    _train_step(job, recorder, _physical(job, indices, weights), step)
            except DivergedError as error:
                if kind != "add non-finite":
                    raise
                halted.append(f"step {step}: {error}")
                continue
            factor = 2.0 if kind == "replace" else 1.0
            for part, distance, sensitivity in _release_differences(pair[0][1], pair[1][1]):
                ratio = distance / (factor * sensitivity)
                if part not in worst or ratio > worst[part][0]:
                    worst[part] = (ratio, distance, f"{kind} at step {step}")
    tolerance = 1 + 1e-4
    checks = [
        Check("sensitivity", part, ratio, 1.0, ratio <= tolerance,
              f"largest change {distance:.4g} = {ratio:.4f} x the stated sensitivity ({how}; {scaling})")
        for part, (ratio, distance, how) in sorted(worst.items())
    ]
    return checks + [Check(
        "sensitivity", "a non-finite record", float(len(halted)), 0.0, not halted,
        "; ".join(halted) if halted else "a record with a NaN loss never halted a step (its clip factor is 0; "
        "the releases it moved are in the rows above)")]


def _dp_accounting_epsilons(ledger, delta: float) -> dict[str, float]:
    """epsilon of the ledger by dp-accounting's RDP and PLD accountants (independent of ours)."""
    import dp_accounting as dpa

    from dpbench.study import ledger_dp_event  # the one ledger -> dp-accounting conversion

    replace_one = all(m.neighboring == "replace_one" for m, _ in ledger.items())
    relation = dpa.NeighboringRelation.REPLACE_ONE if replace_one else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    event = ledger_dp_event(ledger, exact_replace_one=replace_one)
    out = {}
    pld = dpa.pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=1e-3)
    out["pld"] = float(pld.compose(event).get_epsilon(delta))
    try:
        rdp = dpa.rdp.RdpAccountant(neighboring_relation=relation)
        out["rdp"] = float(rdp.compose(event).get_epsilon(delta))
    except Exception:  # dp-accounting's RDP has no replace-one Poisson analysis: add/remove at sigma/2
        halved = ledger_dp_event(ledger)
        out["rdp"] = float(dpa.rdp.RdpAccountant().compose(halved).get_epsilon(delta))
    return out


def several_mechanisms_check(error: Exception) -> Check:
    """A plan that charges a step's releases as several independent mechanisms: refused."""
    return Check("accounting", "one mechanism per sampled batch", 2.0, 1.0, False,
                 f"{error} (charging them as independent understates epsilon)")


def accounting_check(job) -> list[Check]:
    """The planned ledger's epsilon by dp-accounting vs the epsilon the configured accountant reports."""
    plan = job.privacy
    try:
        ledger = plan.planned_ledger(job.steps, final=True)  # Poisson steps or a shuffled run's epochs, the validation score
    except SeveralMechanismsPerBatchError as error:
        return [several_mechanisms_check(error)]
    if not ledger:
        return [Check("accounting", "ledger", 0.0, 0.0, True, "the planned run releases nothing")]
    reported = plan.epsilon(ledger)
    independent = _dp_accounting_epsilons(ledger, plan.delta)
    tight = independent["pld"]
    passed = reported >= tight * (1 - 2e-3) - 1e-3
    return [
        Check("accounting", f"{job.steps} planned steps", reported, tight, passed,
              f"{plan.accountant.computed_by} reports eps = {reported:.4f}; dp-accounting gives PLD {tight:.4f}, "
              f"RDP {independent['rdp']:.4f} at delta {plan.delta:g} (sigma {plan.setup.noise_multiplier:.4f})")
    ]


def run_audit(cfg, run_dir: Path) -> AuditReport:
    """Run every check (with audit.one_run, the one-run canary audit instead); write audit.json; return
    the report (`passed` says whether all checks held)."""
    if cfg.audit.get("one_run", False):  # a lower bound on epsilon from one run with canaries (dpbench/tools/one_run.py)
        return _written(one_run_audit(cfg), run_dir)
    import logging
    import warnings

    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
        try:
            job, _ = _audited_job(cfg, zero_noise=False)  # calibrates sigma (if asked to) once
        except SeveralMechanismsPerBatchError as error:  # calibration composed the plan's ledger
            return _written(AuditReport(cfg.algo.name, cfg.model.name, cfg.dataset.name,
                                        [several_mechanisms_check(error)]), run_dir)
        accounting = accounting_check(job)
        if not accounting[0].passed and accounting[0].release == "one mechanism per sampled batch":
            return _written(AuditReport(cfg.algo.name, cfg.model.name, cfg.dataset.name, accounting), run_dir)
        # the other checks build many jobs: at the calibrated sigma they skip calibration
        fixed = cfg.copy()
        OmegaConf.update(fixed, "privacy.noise_multiplier", float(job.privacy.setup.noise_multiplier))
        derived = job.privacy.setup.derived  # an algorithm's own calibration (DC-DPSGD's EpsilonSplit: sigma_tr)
        for key, value in (derived.fixed_noise_options() if derived is not None else {}).items():
            OmegaConf.update(fixed, f"algo.{key}", value)
        checks = [*noise_check(fixed), *sensitivity_check(fixed), *sampler_check(fixed, job), *accounting]
    family_corrected(checks, float(cfg.audit.alpha))  # the audit's false-alarm rate is at most audit.alpha
    checks.sort(key=lambda c: CHECK_ORDER.index(c.name))  # stable: each kind's rows keep their order
    return _written(AuditReport(cfg.algo.name, cfg.model.name, cfg.dataset.name, checks), run_dir)


def _written(report: AuditReport, run_dir: Path) -> AuditReport:
    from dpbench.paths import atomic_write

    atomic_write(Path(run_dir) / "audit.json", lambda handle: json.dump(report.to_json(), handle, indent=2))
    return report


def audit_table(report: AuditReport):
    from rich.table import Table

    table = Table(title=f"dpbench-audit · {report.algo} · {report.model} · {report.dataset}")
    for column in ("check", "release", "measured / bound", "result", "detail"):
        table.add_column(column, overflow="fold")
    for c in report.checks:
        table.add_row(
            c.name, c.release, f"{c.measured:.4g} / {c.bound:.4g}",
            "[green]pass[/]" if c.passed else "[bold red]FAIL[/]", c.detail,
        )
    return table
