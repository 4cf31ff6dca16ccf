"""Seeded bugs: broken privacy mechanisms that `dpbench-audit` must catch, each by a named check.

    dpbench-audit audit.seeded_bug=all              # the catalogue: one row per bug, exit 0 iff all caught
    dpbench-audit audit.seeded_bug=noise_half       # one bug: its audit table and its row

Each bug is a small patch (a context manager over `unittest.mock.patch`) of dpbench's own code,
applied only around `run_audit`: the audit builds its jobs as `dpbench` does, so it meets the bug as
a run would. A bug names the check that must catch it (a `Check.name` of dpbench/tools/audit.py);
a SOUND variant (`sound=True`) is a rewrite that keeps the mechanism and must pass every check.
Bugs patch DPFirstOrderAlgorithm's phases (clip_and_accumulate -> add_noise -> scale_grad ->
apply_update), the noise generator or the sampler, so they apply to dpsgd and dpadam; the
catalogue's defaults (`CATALOGUE_DEFAULTS`: dpsgd on the synthetic data, a small audit) keep it
to about a minute on two cores, and any override on the command line applies on top.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from dpbench.errors import UserError

# dpbench-audit audit.seeded_bug=... composes these first, then the command line's overrides
CATALOGUE_DEFAULTS = ["algo=dpsgd", "dataset=synthetic", "logger=none", "train.batch_size=32", "train.steps=3",
                      "privacy.noise_multiplier=1.0", "audit.noise_steps=3", "audit.trials=3", "audit.alpha=1e-6"]
SUPPORTED = ("dpsgd", "dpadam")  # the algorithms that run DPFirstOrderAlgorithm's phases unchanged


@dataclass(frozen=True)
class SeededBug:
    name: str
    check: str  # the audit check that must catch it (Check.name)
    why: str  # one line: why it is unsound (or why the variant is sound)
    patch: Callable[[object], AbstractContextManager]  # cfg -> the patch, active while the audit runs
    sound: bool = False  # a sound variant: every check must pass


def _base():
    from dpbench.algorithms.base import DPFirstOrderAlgorithm

    return DPFirstOrderAlgorithm


# ------------------------------------------------------------------------------------ the noise


def _noise_half(cfg):
    from dpbench.privacy.noise import GaussianNoise

    original = GaussianNoise.sample
    return mock.patch.object(GaussianNoise, "sample",
                             lambda self, shape, std, dtype=torch.float32: original(self, shape, std * 0.5, dtype))


def _noise_reused(cfg):
    from dpbench.privacy.noise import GaussianNoise

    original, drawn = GaussianNoise.sample, {}

    def repeated(self, shape, std, dtype=torch.float32):
        key = (self, tuple(shape), std)
        if key not in drawn:
            drawn[key] = original(self, shape, std, dtype)
        return drawn[key].clone()

    return mock.patch.object(GaussianNoise, "sample", repeated)


def _noise_seeded(cfg):
    seed = int(cfg.seed)
    return mock.patch("dpbench.privacy.noise.entropy_seed", lambda: seed)


def _chunk_noise(per_chunk: Callable[[int], float]):
    """Each non-empty physical chunk adds N(0, (sigma C x per_chunk(k))^2) to its clipped sum (k
    chunks); the step's one release adds no more noise but states sigma C, one mechanism."""

    def patch(cfg):
        from dpbench.algorithms.base import LossTally
        from dpbench.tools.audit import ZeroNoise

        base = _base()
        add_noise = base.add_noise

        def clip_and_accumulate(self, batches):
            k = sum(1 for b in batches if self.task.batch_size(b))
            std = self.gradient_noise_std() * per_chunk(max(1, k))
            tally, sums = LossTally(), None
            for _, losses in self.chunks(batches, tally):
                contribution = self.engine.clipped_sum(losses, self.example_factors)
                contribution = [c + self.privacy.noise.sample(c.shape, std) for c in contribution]
                sums = contribution if sums is None else [s.add_(c) for s, c in zip(sums, contribution)]
            return (self.zero_sums() if sums is None else sums), tally

        def released_without_noise(self, sums):
            noise, self.privacy.noise = self.privacy.noise, ZeroNoise(sums[0].device)
            try:
                return add_noise(self, sums)
            finally:
                self.privacy.noise = noise

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(base, "clip_and_accumulate", clip_and_accumulate))
        stack.enter_context(mock.patch.object(base, "add_noise", released_without_noise))
        return stack

    return patch


# --------------------------------------------------------------------------------- the clipping


def _unclipped_factors(self, norms, clip=None, keep=None):
    kept = torch.isfinite(norms) if keep is None else torch.isfinite(norms) & keep
    return kept.to(norms.dtype)  # every finite example with factor 1: no clipping


def _clipping_off(cfg):
    return mock.patch.object(_base(), "example_factors", _unclipped_factors)


def _clip_after_sum(cfg):
    base = _base()
    original = base.clip_and_accumulate

    def clip_the_sum(self, batches):
        sums, tally = original(self, batches)  # with the factors patched: the unclipped sum
        norm = math.sqrt(sum(float(s.pow(2).sum()) for s in sums))
        factor = min(1.0, self.privacy.clip_norm / norm) if norm > 0 else 1.0
        return [s * factor for s in sums], tally

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(base, "example_factors", _unclipped_factors))
    stack.enter_context(mock.patch.object(base, "clip_and_accumulate", clip_the_sum))
    return stack


# ------------------------------------------------------------------------------ the update path


def _unnoised_update(cfg):
    def privatize(self, sums):
        self.add_noise([s.clone() for s in sums])  # released (and recorded) with its noise ...
        return self.scale_grad(sums)  # ... but the optimizer gets the clipped sum without it

    return mock.patch.object(_base(), "privatize", privatize)


def _realised_batch_divisor(cfg):
    def step(self, batches, step_index):
        sums, tally = self.clip_and_accumulate(batches)
        noisy = self.add_noise(sums)
        self.apply_update([s / max(1, tally.count) for s in noisy])  # the realised size: private
        return tally.result()

    return mock.patch.object(_base(), "step", step)


# ---------------------------------------------------------------------------------- the sampler


def _shuffle_as_poisson(cfg):
    from dpbench.privacy.sampling import PoissonBatches

    def shuffled(self):
        n, generator = self._sampler.num_samples, self._sampler.generator
        size = max(1, round(self.sample_rate * n))
        while True:  # fixed-size batches of a fresh permutation per epoch, still accounted as Poisson
            order = torch.randperm(n, generator=generator)
            for start in range(0, n - size + 1, size):
                yield order[start:start + size].tolist()

    return mock.patch.object(PoissonBatches, "__iter__", shuffled)


# ------------------------------------------------------------------------------- the accounting


def _two_mechanisms_one_batch(cfg):
    """The step releases two halves of the gradient, each with std sqrt(2) sigma C, and the plan
    charges them as two independent Poisson-subsampled mechanisms of multiplier sqrt(2) sigma (the
    old DC-DPSGD charge); one batch, so one mechanism of multiplier sigma is what ran."""
    from dpbench.algorithms import ALGORITHMS
    from dpbench.algorithms.base import ReleasePart
    from dpbench.privacy.mechanisms import GaussianMechanism

    algo_cls, base = ALGORITHMS.get(str(cfg.algo.name)), _base()

    def planned(cls, cfg, noise_multiplier, sample_rate, step, clip_norm):
        return [GaussianMechanism(math.sqrt(2) * noise_multiplier, sample_rate)] * 2

    def add_noise(self, sums):
        half, c = max(1, len(sums) // 2), self.gradient_sensitivity()
        std = math.sqrt(2) * self.gradient_noise_std()
        (first,) = self.gaussian_release("gradient[0]", ReleasePart(sums[:half], c, std))
        (second,) = self.gaussian_release("gradient[1]", ReleasePart(sums[half:], c, std)) if sums[half:] else ([],)
        return [*first, *second]

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(algo_cls, "planned_mechanisms", classmethod(planned)))
    stack.enter_context(mock.patch.object(base, "add_noise", add_noise))
    return stack


CATALOGUE: dict[str, SeededBug] = {bug.name: bug for bug in [
    SeededBug("noise_half", "noise", "noise x 0.5: the run's epsilon is that of sigma / 2, the reported one that of sigma",
              _noise_half),
    SeededBug("noise_reused", "independence",
              "one noise vector drawn once and added every step: T releases share one draw, so averaging them "
              "removes it (composition assumes fresh noise)", _noise_reused),
    SeededBug("noise_seeded", "noise across runs",
              "the noise generator seeded from `seed`: anyone with the config subtracts the noise", _noise_seeded),
    SeededBug("clipping_off", "sensitivity",
              "no per-example clipping: one example moves the sum without bound, the stated sensitivity C is false",
              _clipping_off),
    SeededBug("clip_after_sum", "sensitivity",
              "the sum clipped instead of each example: one example can turn the clipped sum around, a change of "
              "up to 2C under add/remove", _clip_after_sum),
    SeededBug("unnoised_update", "release → update",
              "the optimizer gets the clipped sum without its noise while the noisy one is released: the model "
              "(the run's real output) is not private", _unnoised_update),
    SeededBug("realised_batch_divisor", "release → update",
              "divides by the realised batch size, which is private under add/remove (it reveals whether the "
              "example was sampled); harmless under replace-one, where the size is the same on both sides",
              _realised_batch_divisor),
    SeededBug("shuffle_as_poisson", "sampler",
              "shuffled fixed-size batches accounted as Poisson: the amplification by Poisson subsampling the "
              "epsilon assumes never happened", _shuffle_as_poisson),
    SeededBug("chunk_noise_over_chunks", "noise",
              "each of k physical chunks adds std sigma C / k: the step's total noise is sigma C / sqrt(k)",
              _chunk_noise(lambda k: 1.0 / k)),
    SeededBug("chunk_noise_over_sqrt_chunks", "noise",
              "SOUND: each of k chunks adds std sigma C / sqrt(k), independent draws: the step's total noise is "
              "sigma C, one mechanism, as recorded", _chunk_noise(lambda k: 1.0 / math.sqrt(k)), sound=True),
    SeededBug("two_mechanisms_one_batch", "accounting",
              "two releases of one sampled batch charged as independently subsampled mechanisms: their "
              "amplification is not independent, epsilon is understated", _two_mechanisms_one_batch),
]}


@dataclass
class BugResult:
    bug: str
    check: str  # the check that must catch it
    sound: bool
    caught: bool  # that check failed
    ok: bool  # unsound and caught, or sound and every check passed
    figure: str  # the check's worst row: measured / bound
    also_failed: list[str]
    why: str


def _figure(rows) -> str:
    if not rows:
        return "no row"
    worst = next((c for c in rows if not c.passed), rows[0])
    return f"{worst.release}: {worst.measured:.4g} / {worst.bound:.4g}"


def run_bug(cfg, name: str, run_dir: Path):
    """The audit of `cfg` with bug `name` applied: (its AuditReport, its BugResult)."""
    from dpbench.tools.audit import run_audit

    if name not in CATALOGUE:
        raise UserError(f"audit.seeded_bug={name} is not known; use all or one of {', '.join(CATALOGUE)}")
    if str(cfg.algo.name) not in SUPPORTED:
        raise UserError(f"audit.seeded_bug patches DPFirstOrderAlgorithm's phases: use algo={' or algo='.join(SUPPORTED)}")
    if cfg.audit.get("one_run", False):
        raise UserError("audit.seeded_bug runs the self-audit: drop audit.one_run=true")
    bug = CATALOGUE[name]
    plain = cfg.copy()
    from omegaconf import OmegaConf

    OmegaConf.update(plain, "audit.seeded_bug", None)
    with bug.patch(cfg):
        report = run_audit(plain, run_dir)
    rows = [c for c in report.checks if c.name == bug.check]
    caught = any(not c.passed for c in rows)
    ok = report.passed if bug.sound else caught
    also = sorted({c.name for c in report.checks if not c.passed and c.name != bug.check})
    return report, BugResult(bug.name, bug.check, bug.sound, caught, ok, _figure(rows), also, bug.why)


def run_catalogue(cfg, run_dir: Path) -> list[BugResult]:
    """Every bug of the catalogue (audit.seeded_bug=all), or the one named; writes seeded_bugs.json."""
    from dpbench.paths import atomic_write

    name = str(cfg.audit.seeded_bug)
    names = list(CATALOGUE) if name == "all" else [name]
    results = [run_bug(cfg, bug, Path(run_dir) / bug)[1] for bug in names]
    atomic_write(Path(run_dir) / "seeded_bugs.json",
                 lambda handle: json.dump([r.__dict__ for r in results], handle, indent=2))
    return results


def catalogue_table(results: list[BugResult]):
    from rich.table import Table

    table = Table(title="dpbench-audit · seeded bugs")
    for column in ("bug", "must be caught by", "result", "figure (measured / bound)", "why"):
        table.add_column(column, overflow="fold")
    for r in results:
        if r.sound:
            verdict = "[green]passes (sound)[/]" if r.ok else "[bold red]FAILED a check (sound)[/]"
        else:
            verdict = "[green]caught[/]" if r.caught else "[bold red]MISSED[/]"
        also = f" (also: {', '.join(r.also_failed)})" if r.also_failed else ""
        table.add_row(r.bug, r.check if not r.sound else f"{r.check} (must pass)", verdict + also, r.figure, r.why)
    return table
