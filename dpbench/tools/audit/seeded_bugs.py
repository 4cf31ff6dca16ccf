"""Seeded bugs: broken privacy mechanisms that `dpbench-audit` must catch, each by a named check.

    dpbench-audit audit.seeded_bug=all              # the catalogue: one row per bug, exit 0 iff all caught
    dpbench-audit audit.seeded_bug=noise_half       # one bug: its audit table and its row

Each bug is a small patch (a context manager over `unittest.mock.patch`, in bug_patches.py) of dpbench's own code,
applied only around `run_audit`: the audit builds its jobs as `dpbench` does, so it meets the bug as
a run would. A bug names the check that must catch it (a `Check.name` of dpbench/tools/audit/runner.py);
a SOUND variant (`sound=True`) is a rewrite that keeps the mechanism and must pass every check.
Most bugs patch DPFirstOrderAlgorithm's phases (clip_and_accumulate -> add_noise -> scale_grad ->
apply_update), the noise generator or the sampler, so they apply to the algorithms that run those
phases unchanged (`SeededBug.applies` asks each registered class whether a bug's patch is about it); the catalogue's defaults (`CATALOGUE_DEFAULTS`: dpsgd on
the synthetic data, a small audit) keep it to a couple of minutes on two cores, and any override on
the command line applies on top. A bug that needs more (an engine, a model with BatchNorm, DC-DPSGD)
names it in `SeededBug.overrides`, which its row applies last: what the bug is about wins.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from dpbench.errors import UserError
from dpbench.tools.audit.bug_patches import (
    _RunningStatsNorm,
    _batchnorm,
    _chunk_noise,
    _clip_after_sum,
    _clipping_off,
    _dcdpsgd_mixture_noise,
    _dcdpsgd_threshold_unnoised,
    _diff_previous_unnoised,
    _normal_bf16_scaled,
    _noise_skipped_small,
    _validation_noise_seeded,
    _noise_bf16_rounded,
    _noise_half,
    _noise_reused,
    _noise_seeded,
    _realised_batch_divisor,
    _shuffle_as_poisson,
    _two_mechanisms_one_batch,
    _unnoised_update,
    _validation_on_training,
)
from dpbench.tools.audit.bug_patches import clips_with_the_shared_rule

# dpbench-audit audit.seeded_bug=... composes these first, then the command line's overrides
CATALOGUE_DEFAULTS = ["algo=dpsgd", "dataset=synthetic", "logger=none", "train.batch_size=32", "train.steps=3",
                      "privacy.noise_multiplier=1.0", "audit.noise_steps=3", "audit.trials=3", "audit.alpha=1e-6"]


def _stock_phases(algo_cls) -> bool:
    """The classes whose code most bugs patch: DPFirstOrderAlgorithm's phases, run unchanged."""
    return algo_cls.runs_stock_phases()


def _dcdpsgd(algo_cls) -> bool:
    from dpbench.algorithms.dcdpsgd import DCDPSGD

    return issubclass(algo_cls, DCDPSGD)


def _diff(algo_cls) -> bool:
    from dpbench.algorithms.diff import DIFF

    return issubclass(algo_cls, DIFF)


@dataclass(frozen=True)
class SeededBug:
    name: str
    check: str  # the audit check that must catch it (Check.name)
    why: str  # one line: why it is unsound (or why the variant is sound)
    patch: Callable[[object], AbstractContextManager]  # cfg -> the patch, active while the audit runs
    sound: bool = False  # a sound variant: every check must pass
    # what the bug needs beyond the catalogue's defaults, as `dpbench` overrides, applied on top of the
    # command line's (`bug_config`): an engine (algo.per_sample=ghost), a model, an algorithm
    overrides: tuple[str, ...] = ()
    # whether the patch is about the code of an algorithm class (asked of the registry's classes)
    applies: Callable[[type], bool] = _stock_phases

    def algorithms(self) -> list[str]:
        """The registered algorithms whose code the patch is about."""
        from dpbench.algorithms import ALGORITHMS

        return [name for name in ALGORITHMS.names() if self.applies(ALGORITHMS.get(name))]


BATCHNORM_MODEL = ("model=cnn",)
# the validation score's bug: a validation split, its score composed in parallel with training
VALIDATION_SPLIT = ("dataset.validation_fraction=0.2", "privacy.validation_composition=parallel")  # the catalogue's model with GroupNorm, which the BatchNorm bugs swap out

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
              _clipping_off, applies=clips_with_the_shared_rule),
    SeededBug("clip_after_sum", "sensitivity",
              "the sum clipped instead of each example: one example can turn the clipped sum around, a change of "
              "up to 2C under add/remove", _clip_after_sum),
    SeededBug("unnoised_update", "release → update",
              "the optimizer gets the clipped sum without its noise while the noisy one is released: the model "
              "(the run's real output) is not private", _unnoised_update),
    SeededBug("realised_batch_divisor", "release → update",
              "divides by the realised batch size: unsound under add/remove, where the size is private (it says "
              "whether the example was sampled); harmless under replace-one, where both sides have one size",
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
    SeededBug("batchnorm_train", "sensitivity",
              "BatchNorm in train mode (ghost clipping) normalises with the batch's statistics: one example moves "
              "every other example's gradient, so clipping each one no longer bounds the sum's change by C",
              _batchnorm(nn.BatchNorm2d), overrides=(*BATCHNORM_MODEL, "algo.per_sample=ghost")),
    SeededBug("batchnorm_train_materialize", "release → update",
              "BatchNorm in train mode (materialize): its running mean and variance, updated from each batch's "
              "un-noised statistics, are part of the model that no release covers", _batchnorm(nn.BatchNorm2d),
              overrides=(*BATCHNORM_MODEL, "algo.per_sample=materialize")),
    SeededBug("batchnorm_running_stats", "release → update",
              "BatchNorm normalising with its running statistics (clipping holds) but updating them from each "
              "batch: only the buffers leak, un-noised batch means in the model", _batchnorm(_RunningStatsNorm),
              overrides=(*BATCHNORM_MODEL, "algo.per_sample=materialize")),
    SeededBug("dcdpsgd_mixture_noise", "noise",
              "the DC-DPSGD code's gradient noise p N(0, (sigma c1)^2) + (1 - p) N(0, (sigma c2)^2) for p = k/B "
              "tail examples: about sigma c1 / 7 at p = 0.1 (sigma c2 before any tail), where sensitivity c1 needs "
              "sigma c1", _dcdpsgd_mixture_noise, overrides=("algo=dcdpsgd",), applies=_dcdpsgd),
    SeededBug("noise_bf16_rounded", "noise precision",
              "noise drawn in fp32 but rounded to bfloat16 before it is added: the std is right, but release - value "
              "lies on bf16's grid, so neighbouring values are told apart (Mironov 2012)", _noise_bf16_rounded),
    SeededBug("validation_on_training", "validation score",
              "the noisy validation score counted on training records while validation_composition=parallel charges "
              "max(training, score): a training record is read by both mechanisms, epsilon is understated",
              _validation_on_training, overrides=VALIDATION_SPLIT),
    SeededBug("dcdpsgd_threshold_unnoised", "two-step sensitivity",
              "DC-DPSGD's next threshold from the un-noised score histogram (the noisy one still released and "
              "charged): the record moves every later step's clipping, which no release covers",
              _dcdpsgd_threshold_unnoised, overrides=("algo=dcdpsgd",), applies=_dcdpsgd),
    SeededBug("noise_skipped_small_tensors", "noise per tensor",
              "no noise on tensors of fewer than 16 entries (the head's bias released exactly): pooled with the "
              "others, the noise's std is still about right", _noise_skipped_small),
    SeededBug("normal_bf16_scaled", "noise precision",
              "the standard normal drawn in bfloat16, then scaled by sigma C in fp32: the right std and an fp32-wide "
              "residual, but residual / std lies on bf16's grid (Mironov 2012)", _normal_bf16_scaled),
    SeededBug("validation_noise_seeded", "noise across runs",
              "the validation score's noise from a generator seeded by `seed`: it repeats in every run of the "
              "config, so the released score gives the exact count away", _validation_noise_seeded,
              overrides=VALIDATION_SPLIT),
    SeededBug("diff_previous_unnoised", "two-step sensitivity",
              "DIFF's previous gradient kept without its noise (the noisy one still released and applied): the next "
              "step's differences read the un-noised batch, which no release covers", _diff_previous_unnoised,
              overrides=("algo=diff",), applies=_diff),
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


def _config_groups() -> frozenset[str]:
    from dpbench.paths import config_dir

    return frozenset(p.name for p in Path(config_dir()).iterdir() if p.is_dir())


def compose_within_app(overrides: list[str]):
    """The config `dpbench <overrides>` would run, composed inside the running Hydra app."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    from dpbench.schema import checked_composition

    if not GlobalHydra.instance().is_initialized():
        from dpbench.api import compose as api_compose

        return api_compose(overrides)
    with checked_composition():
        return compose(config_name="config", overrides=overrides)


def bug_config(cfg, bug: SeededBug):
    """`cfg` with the bug's overrides on top: a config group's option (algo=dcdpsgd) replaces that
    group's node, composed as `dpbench` composes it, unless `cfg` has chosen it already (its own
    keys under it stay); then each key=value sets its key."""
    groups = [o for o in bug.overrides if o.split("=")[0] in _config_groups()]
    groups = [o for o in groups if cfg.get(o.split("=")[0], {}).get("name") != o.split("=", 1)[1]]
    values = [o for o in bug.overrides if o.split("=")[0] not in _config_groups()]
    if not groups and not values:
        return cfg
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf, open_dict

    out = cfg.copy()
    with open_dict(out):
        if groups:
            composed = compose_within_app(groups)  # inside the console script's running Hydra app too
            for override in groups:
                key = override.split("=")[0]
                out[key] = composed[key]
        for override in OverridesParser.create().parse_overrides(values):
            OmegaConf.update(out, override.key_or_group, override.value())
    return out


def run_bug(cfg, name: str, run_dir: Path):
    """The audit of `cfg` with bug `name` (and its overrides) applied: (its AuditReport, its BugResult)."""
    from dpbench.tools.audit.runner import run_audit

    if name not in CATALOGUE:
        raise UserError(f"audit.seeded_bug={name} is not known; use all or one of {', '.join(CATALOGUE)}")
    bug = CATALOGUE[name]
    cfg = bug_config(cfg, bug)
    from dpbench.algorithms import algorithm_class

    if not bug.applies(algorithm_class(str(cfg.algo.name))):
        raise UserError(f"audit.seeded_bug={name} patches the code of algo={' or algo='.join(bug.algorithms())}: "
                        "use that")
    plain = cfg.copy()
    from omegaconf import OmegaConf

    OmegaConf.update(plain, "audit.seeded_bug", None)
    with bug.patch(cfg):
        report = run_audit(plain, run_dir)
    # under audit.one_run=true the canaries' lower bound is the only check, and must catch it
    check = "one_run" if cfg.audit.get("one_run", False) else bug.check
    rows = [c for c in report.checks if c.name == check]
    caught = any(not c.passed for c in rows)
    ok = report.passed if bug.sound else caught
    also = sorted({c.name for c in report.checks if not c.passed and c.name != check})
    return report, BugResult(bug.name, check, bug.sound, caught, ok, _figure(rows), also, bug.why)


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
