"""The noise checks of `dpbench-audit` (dpbench/tools/audit/runner.py): the noise each release added against
the plan's std (chi-square), its independence across steps and across two fresh runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dpbench.errors import UserError
from dpbench.privacy.mechanisms import (
    GaussianMechanism,
    one_batch_mechanism,
    same_mechanisms,
)
from dpbench.tools.audit.harness import (
    Release,
    ReleaseRecorder,
    audited_job,
    audited_step,
    chi_square_p_value,
    describe_mechanisms,
    normal_quantile,
    physical_chunks,
    two_sided_normal,
    value_range,
)
from dpbench.tools.audit.report import (
    Check,
)
from dpbench.tools.audit.precision import merged, merged_nulls, null_checks, precision_checks
from dpbench.tools.audit.update import buffer_check, update_check

SCALAR_DRAWS = 200  # empty-batch steps added when a release is one number per step


MAX_LAGS = 8  # independence across steps: steps t and t+lag for lag 1..MAX_LAGS
OWN_ROW = 256  # a tensor of this many entries gets its own std row; the smaller ones of a part are pooled


def tensor_groups(key: str, tensors: list[torch.Tensor]) -> list[tuple[str, list[int]]]:
    """The std rows of one release part: (row name, tensor indices), one per tensor of >= OWN_ROW
    entries and one pooling the rest; the part's own name where that makes one row."""
    large = [i for i, t in enumerate(tensors) if t.numel() >= OWN_ROW]
    small = [i for i, t in enumerate(tensors) if t.numel() < OWN_ROW]
    groups = [(f"{key} tensor {i} {list(tensors[i].shape)}", [i]) for i in large]
    if small:
        groups.append((f"{key} {len(small)} tensors of < {OWN_ROW} entries", small))
    return [(key, list(range(len(tensors))))] if len(groups) == 1 else groups


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


def pooled_correlation(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[float, int]:
    """sum <a, b> / sqrt(sum |a|^2 sum |b|^2) over paired noise vectors, and n, the number of
    coordinate pairs: for independent zero-mean noise of equal std, sqrt(n) x it is ~ N(0, 1)."""
    dot = sum(float(a @ b) for a, b in pairs)
    norms = sum(float(a @ a) for a, _ in pairs) * sum(float(b @ b) for _, b in pairs)
    return (dot / math.sqrt(norms) if norms > 0 else 0.0), sum(a.numel() for a, _ in pairs)


def _independence_check(key: str, across: str, statistics: list[tuple[str, float, int]], alpha: float,
                        name: str = "independence") -> Check:
    """One check over (what, correlation, n) statistics: every |corr| <= z / sqrt(n)."""
    z = normal_quantile(alpha, len(statistics))
    release = f"{key} across {across}" if name == "independence" else key
    if not statistics:
        return Check(name, release, 0.0, 0.0, True,
                     f"released at one step only: nothing to compare across {across} (raise audit.noise_steps)")
    what, corr, n = max(statistics, key=lambda s: abs(s[1]) * math.sqrt(s[2]))
    bound = z / math.sqrt(n)
    p_value = min(1.0, len(statistics) * two_sided_normal(abs(corr) * math.sqrt(n)))  # Bonferroni over them
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
    chunks: dict[str, set[int]] = field(default_factory=dict)  # noise row -> physical chunks of its total-noise steps

    def add_job(self, plan, recorder: ReleaseRecorder) -> None:
        series: dict[int, dict[int, list[torch.Tensor]]] = {}
        for step in sorted(recorder.ledger):
            self.steps += 1
            releases, planned = recorder.of_step(step), plan.planned(step)
            if not same_mechanisms(recorder.ledger[step], planned):
                self.ledger_mismatches.append(
                    f"step {step} ran {describe_mechanisms(recorder.ledger[step])}, its plan {describe_mechanisms(planned)}")
            clipped, total_noise_key = recorder.clipped.get(step), None
            if (recorder.phases and clipped is not None and len(releases) == 1 and len(releases[0].parts) == 1
                    and [v.shape for v in clipped] == [v.shape for v in releases[0].noisy[0]]):
                releases[0].reference = clipped  # the step's total noise: release - the engine's clipped sum
                total_noise_key = releases[0].key(0)
            stds = planned_stds(releases, planned)
            if stds is None:
                self.unplanned[step] = (f"step {step} made {len(releases)} releases but its plan declares "
                                        f"{len(planned)} mechanisms (a step's releases are one mechanism)")
                continue
            for release, part_stds in zip(releases, stds):
                for k, std in enumerate(part_stds):
                    tensors, key = release.tensor_noise(k), release.key(k)
                    noise = torch.cat(tensors)
                    for row, indices in tensor_groups(key, release.noisy[k]):  # per tensor (>= 256 entries), and the rest pooled
                        drawn = torch.cat([tensors[i] for i in indices])
                        entry = self.squares.setdefault(row, [0.0, 0, set(), set()])
                        if key == total_noise_key:  # each of the part's rows reads the step's total noise
                            self.chunks.setdefault(row, set()).add(recorder.chunks[step])
                        entry[1] += drawn.numel()
                        entry[2].add(std)
                        entry[3].add(release.parts[k].noise_std)
                        if std == 0:  # a noiseless plan: any drawn noise is a mismatch
                            entry[0] += math.inf if bool((drawn != 0).any()) else 0.0
                        else:
                            entry[0] += float((drawn / std).pow(2).sum())
                    if std == 0:
                        continue
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
            p_value = chi_square_p_value(total, count)
            ratio = math.sqrt(total / count)
            chunks = self.chunks.get(key)
            measured = (f"each step's total noise (the release - the clipped sums of its {value_range(chunks)} physical chunks, "
                        "as the engine formed them)" if chunks else "the noise drawn (noisy - noiseless)")
            checks.append(Check(
                "noise", key, ratio, 1.0, p_value > alpha,
                f"{measured}: std / planned std = {ratio:.4f} over {count} draws in 2 fresh jobs; planned std (the plan's "
                f"noise multiplier x the stated sensitivity) {value_range(planned)}, the release stated {value_range(stated)} "
                f"(update std {value_range(s / expected_batch_size for s in planned)}); chi-square p = {p_value:.3g}",
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
    jobs = [audited_job(cfg, zero_noise=False) for _ in range(2)]  # two fresh runs: their noise must differ
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
            audited_step(job, recorder, physical_chunks(job, indices, [1.0] * len(indices), chunk), step)
    if any(sum(v.numel() for part in r.noiseless for v in part) == 1 for r in jobs[0][1].releases):
        for job, recorder in jobs:  # a scalar release (DPZero): more draws from empty Poisson batches (pure noise, cheap)
            for step in range(steps, steps + SCALAR_DRAWS):
                audited_step(job, recorder, physical_chunks(job, [], []), step)
    drawn = DrawnNoise()
    for job, recorder in jobs:
        drawn.add_job(job.privacy, recorder)
    alpha = float(cfg.audit.alpha)
    return [*drawn.std_checks(alpha, jobs[0][0].privacy.setup.expected_batch_size),
            *precision_checks(merged(recorder for _, recorder in jobs)),
            *null_checks(merged_nulls(recorder for _, recorder in jobs)),
            *drawn.independence_checks(alpha), drawn.ledger_check(), update_check(jobs), buffer_check(jobs)]
