"""`dpbench-audit`: an empirical self-check of a private algorithm's privacy claims.

    dpbench-audit algo=grape model=cnn        # same config and overrides as `dpbench`

It runs the algorithm as a run builds it (`dpbench.run.setup`: train.precision, algo.per_sample,
train.physical_batch_size and every other override apply) and observes every noisy release
through `Algorithm.gaussian_release`. The checks compare what ran with what the run's PLAN
declares (the mechanisms `planned(step)` the accountant composes into the reported epsilon), never
only with what the algorithm says it drew:

  noise         in two fresh jobs, the noise each release actually added (noisy - noiseless) has,
                step by step, the std the plan declares for that step and release: the planned
                noise multiplier x the release's stated sensitivity (two-sided chi-square test);
  independence  that noise is independent across steps and across the two fresh jobs: the pooled
                correlation of the (plan-normalised) noise of steps t and t+lag, and of the two
                jobs at the same step, is within z / sqrt(n) of 0 for n coordinate pairs (z: the
                normal quantile at audit.alpha, Bonferroni-corrected over the lags and jobs);
                noise repeated every step, or seeded from `seed`, fails;
  sensitivity   with the noise off, neighbouring batches (one example added, removed or replaced;
                every loss scaled up so that every example is clipped, the neighbour's gradient
                pointing either way) move each released quantity by at most the sensitivity the
                ledger assumes (2x for a replacement); for DC-DPSGD the added example can take the
                tail from another one; an added record whose loss is NaN never halts a step;
  accounting    a step's releases (which read one sampled batch) are planned as ONE mechanism; every
                audited step's ledger entries (the mechanisms derived from the released std
                and stated sensitivity) are its planned ones (the trainer's per-step check), and
                the planned ledger's epsilon, recomputed with Google's dp-accounting (RDP and PLD)
                apart from the configured accountant, is not above the epsilon the run reports.

Prints a table, writes audit.json in the run folder, exits 0 when every check holds, else 1.
The sensitivity check turns dropout layers off so that the two neighbouring runs differ only in
the neighbour; the per-example clipping of recomputed gradients under dropout is covered by the
test suite. Under train.precision=fp16 it scales the losses only as far as fp16's range allows
(see `sensitivity_check`).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dpbench.errors import DivergedError, UserError
from dpbench.privacy.mechanisms import (
    GaussianMechanism, SeveralMechanismsPerBatchError, one_batch_mechanism, same_mechanisms,
)
from dpbench.tools.audit_report import CHECK_ORDER, AuditReport, Check
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

    def key(self, part: int) -> str:
        return self.name if len(self.parts) == 1 else f"{self.name}[{part}]"

    def noise(self, part: int) -> torch.Tensor:
        """The noise part `part` actually drew, flattened (float64)."""
        return torch.cat([(b - a).flatten() for a, b in zip(self.noiseless[part], self.noisy[part])])


class ReleaseRecorder:
    """Observer of an algorithm's releases, and of the mechanisms each step put in the ledger."""

    def __init__(self) -> None:
        self.releases: list[Release] = []
        self.ledger: dict[int, list[GaussianMechanism]] = {}  # step -> StepResult.mechanisms
        self.step = 0

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
    return job, recorder


def _physical(job, indices: list[int], weights: list[float]) -> list:
    """The logical batch in the trainer's physical chunks (`Trainer._physical_batches`'s rule)."""
    task = job.algorithm.task
    size = job.cfg.train.physical_batch_size or max(1, len(indices))
    chunks = [task.batch(indices[i : i + size], weights[i : i + size]) for i in range(0, len(indices), size)]
    return chunks or [task.batch([], [])]


def _train_step(job, recorder: ReleaseRecorder, batches: list, step: int) -> None:
    recorder.step = step
    result = job.algorithm.train_step(batches, step)
    recorder.ledger[step] = list(result.mechanisms)


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


def _independence_check(key: str, across: str, statistics: list[tuple[str, float, int]], alpha: float) -> Check:
    """One check over (what, correlation, n) statistics: every |corr| <= z / sqrt(n)."""
    z = _normal_quantile(alpha, len(statistics))
    if not statistics:
        return Check("independence", f"{key} across {across}", 0.0, 0.0, True,
                     f"released at one step only: nothing to compare across {across} (raise audit.noise_steps)")
    what, corr, n = max(statistics, key=lambda s: abs(s[1]) * math.sqrt(s[2]))
    bound = z / math.sqrt(n)
    return Check(
        "independence", f"{key} across {across}", abs(corr), bound, abs(corr) <= bound,
        f"largest |corr| of the noise {what} = {abs(corr):.4f} over n = {n} coordinate pairs; independent noise "
        f"stays within z/sqrt(n) = {z:.2f}/sqrt({n}) = {bound:.4f} (z at alpha {alpha:g} over {len(statistics)} "
        f"correlations, Bonferroni)",
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

    def add_job(self, plan, recorder: ReleaseRecorder) -> None:
        series: dict[int, dict[int, list[torch.Tensor]]] = {}
        for step in sorted(recorder.ledger):
            self.steps += 1
            releases, planned = recorder.of_step(step), plan.planned(step)
            if not same_mechanisms(recorder.ledger[step], planned):
                self.ledger_mismatches.append(
                    f"step {step} ran {_describe(recorder.ledger[step])}, its plan {_describe(planned)}")
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
            checks.append(Check(
                "noise", key, ratio, 1.0, p_value > alpha,
                f"drawn std / planned std = {ratio:.4f} over {count} draws in 2 fresh jobs; planned std (the plan's "
                f"noise multiplier x the stated sensitivity) {_values(planned)}, the release stated {_values(stated)} "
                f"(update std {_values(s / expected_batch_size for s in planned)}); chi-square p = {p_value:.3g}",
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
            across_jobs = [("of two fresh jobs at the same step", *pooled_correlation(pairs))] if pairs else []
            checks.append(_independence_check(label, "jobs", across_jobs, alpha))
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
    schedule = [torch.randperm(n, generator=generator)[:batch].tolist() for _ in range(steps)]
    for job, recorder in jobs:
        for step, indices in enumerate(schedule):
            _train_step(job, recorder, _physical(job, indices, [1.0] * len(indices)), step)
    if any(sum(v.numel() for part in r.noiseless for v in part) == 1 for r in jobs[0][1].releases):
        for job, recorder in jobs:  # a scalar release (DPZero): more draws from empty Poisson batches (pure noise, cheap)
            for step in range(steps, steps + SCALAR_DRAWS):
                _train_step(job, recorder, _physical(job, [], []), step)
    drawn = DrawnNoise()
    for job, recorder in jobs:
        drawn.add_job(job.privacy, recorder)
    alpha = float(cfg.audit.alpha)
    return [*drawn.std_checks(alpha, jobs[0][0].privacy.setup.expected_batch_size),
            *drawn.independence_checks(alpha), drawn.ledger_check()]


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


def _sensitivity_checks(cfg, scale: float, scaling: str) -> list[Check]:
    batch = int(cfg.audit.batch)
    worst: dict[str, tuple[float, float, str]] = {}  # part -> (ratio, distance, how)
    generator = torch.Generator().manual_seed(1)
    halted: list[str] = []  # steps a non-finite record halted
    for step in range(int(cfg.audit.sensitivity_steps)):
        for trial in range(int(cfg.audit.trials) + 1):
            if trial == int(cfg.audit.trials) and step < int(cfg.audit.sensitivity_steps) - 1:
                continue  # the non-finite record: at the last audited step only (every step kind by then)
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
            kind = "add non-finite" if trial == int(cfg.audit.trials) else ("add", "remove", "replace")[trial % 3]
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

    items = ledger.items()
    replace_one = all(m.neighboring == "replace_one" for m, _ in items)
    relation = dpa.NeighboringRelation.REPLACE_ONE if replace_one else dpa.NeighboringRelation.ADD_OR_REMOVE_ONE
    sigmas = [m.noise_multiplier if replace_one else m.add_remove_noise_multiplier for m, _ in items]
    event = dpa.ComposedDpEvent([
        dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(m.sample_rate, dpa.GaussianDpEvent(s)), count)
        for (m, count), s in zip(items, sigmas)
    ])
    out = {}
    pld = dpa.pld.PLDAccountant(neighboring_relation=relation, value_discretization_interval=1e-3)
    out["pld"] = float(pld.compose(event).get_epsilon(delta))
    try:
        rdp = dpa.rdp.RdpAccountant(neighboring_relation=relation)
        out["rdp"] = float(rdp.compose(event).get_epsilon(delta))
    except Exception:  # dp-accounting's RDP has no replace-one Poisson analysis: add/remove at sigma/2
        halved = dpa.ComposedDpEvent([
            dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(m.sample_rate, dpa.GaussianDpEvent(m.add_remove_noise_multiplier)), count)
            for m, count in items
        ])
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
        ledger = plan.planned_ledger(job.steps)  # Poisson steps, or a shuffled run's epochs
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
        checks = [*noise_check(fixed), *sensitivity_check(fixed), *accounting]
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


def _main_factory():
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from dpbench.paths import config_dir

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name="config")
    def _main(cfg) -> None:
        from dpbench.logging.console import console

        run_dir = Path(HydraConfig.get().runtime.output_dir)
        try:
            report = run_audit(cfg, run_dir)
        except (UserError, DivergedError) as error:
            console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
            sys.exit(2)
        console.print(audit_table(report))
        verdict = "every check holds" if report.passed else "some checks FAILED"
        console.print(f"{verdict}; audit.json: {run_dir / 'audit.json'}", soft_wrap=True)
        sys.exit(0 if report.passed else 1)

    return _main


def main() -> None:
    from dpbench.schema import run_app

    run_app(_main_factory())


if __name__ == "__main__":
    main()
