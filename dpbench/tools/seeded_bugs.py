"""Seeded bugs: broken privacy mechanisms that `dpbench-audit` must catch, each by a named check.

    dpbench-audit audit.seeded_bug=all              # the catalogue: one row per bug, exit 0 iff all caught
    dpbench-audit audit.seeded_bug=noise_half       # one bug: its audit table and its row

Each bug is a small patch (a context manager over `unittest.mock.patch`) of dpbench's own code,
applied only around `run_audit`: the audit builds its jobs as `dpbench` does, so it meets the bug as
a run would. A bug names the check that must catch it (a `Check.name` of dpbench/tools/audit.py);
a SOUND variant (`sound=True`) is a rewrite that keeps the mechanism and must pass every check.
Most bugs patch DPFirstOrderAlgorithm's phases (clip_and_accumulate -> add_noise -> scale_grad ->
apply_update), the noise generator or the sampler, so they apply to the algorithms that run those
phases unchanged (`SeededBug.applies` asks each registered class whether a bug's patch is about it); the catalogue's defaults (`CATALOGUE_DEFAULTS`: dpsgd on
the synthetic data, a small audit) keep it to a couple of minutes on two cores, and any override on
the command line applies on top. A bug that needs more (an engine, a model with BatchNorm, DC-DPSGD)
names it in `SeededBug.overrides`, which its row applies last: what the bug is about wins.
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
import torch.nn.functional as F
from torch import nn

from dpbench.errors import UserError

# dpbench-audit audit.seeded_bug=... composes these first, then the command line's overrides
CATALOGUE_DEFAULTS = ["algo=dpsgd", "dataset=synthetic", "logger=none", "train.batch_size=32", "train.steps=3",
                      "privacy.noise_multiplier=1.0", "audit.noise_steps=3", "audit.trials=3", "audit.alpha=1e-6"]


def _stock_phases(algo_cls) -> bool:
    """The classes whose code most bugs patch: DPFirstOrderAlgorithm's phases, run unchanged."""
    return algo_cls.runs_stock_phases()


def _dcdpsgd(algo_cls) -> bool:
    from dpbench.algorithms.dcdpsgd import DCDPSGD

    return issubclass(algo_cls, DCDPSGD)


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
        from dpbench.tools.audit_harness import ZeroNoise

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


# --------------------------------------------------------------------------- the model's buffers


class _RunningStatsNorm(nn.BatchNorm2d):
    """BatchNorm that normalises with the running statistics of earlier batches (a per-example affine
    map: clipping still bounds the sum) while each training forward updates them from the batch's
    un-noised mean and variance."""

    def forward(self, x):
        self.used = (self.running_mean.clone(), self.running_var.clone())  # what this forward normalises with
        if self.training:
            with torch.no_grad():  # F.batch_norm in training mode updates the running statistics in place
                F.batch_norm(x, self.running_mean, self.running_var, training=True, momentum=self.momentum, eps=self.eps)
        return F.batch_norm(x, *self.used, self.weight, self.bias, training=False, eps=self.eps)


def _batchnorm_grad_sample(layer, activations, backprops):
    """An Opacus-signature grad sampler for BatchNorm, GroupNorm's rule with BatchNorm's statistics:
    each example's row of the normalised input x its output gradient. In train mode the rows are
    normalised with the batch's statistics, so every row depends on every example."""
    x = activations[0]
    running = isinstance(layer, _RunningStatsNorm)
    normed = F.batch_norm(x, *(layer.used if running else (None, None)), training=not running, eps=layer.eps)
    out = {}
    if layer.weight is not None and layer.weight.requires_grad:
        out[layer.weight] = torch.einsum("ni...->ni", normed * backprops)
    if layer.bias is not None and layer.bias.requires_grad:
        out[layer.bias] = torch.einsum("ni...->ni", backprops)
    return out


def _batchnorm(norm: type[nn.BatchNorm2d]):
    """The model's GroupNorm layers replaced by `norm` (in train mode, as the run leaves the model),
    with what stops it lifted: Opacus refuses a trainable layer with buffers (the materialize
    engine's GradSampleModule validation; functorch's `prepare_layer`, where ghost and bk send a
    layer without a grad sampler), so the patch drops the validation and registers a grad sampler;
    dpbench's layout probe (privacy/layout.py) refuses the model before training, as rows of one
    example change with another's, so the patch turns the probe off too: the rows below show the
    audit's own checks catch the bug behind the probe (tests/privacy/test_grad_sample_layers.py
    shows the probe refuses it on its own)."""

    def patch(cfg):
        from opacus.grad_sample import GradSampleModule

        import dpbench.models as models

        build = models.build_model

        def with_batchnorm(model_cfg, spec):
            model, replaced = build(model_cfg, spec), 0
            for module in list(model.modules()):
                for name, child in list(module.named_children()):
                    if isinstance(child, nn.GroupNorm):
                        setattr(module, name, norm(child.num_channels))
                        replaced += 1
            if not replaced:
                raise UserError(f"this seeded bug swaps GroupNorm for BatchNorm: model={model_cfg.name} has no GroupNorm; "
                                "use model=cnn")
            return model

        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(models, "build_model", with_batchnorm))
        stack.enter_context(mock.patch.object(GradSampleModule, "validate",
                                              classmethod(lambda cls, module, *, strict=False: [])))
        stack.enter_context(mock.patch.dict(GradSampleModule.GRAD_SAMPLERS, {norm: _batchnorm_grad_sample}))
        stack.enter_context(mock.patch("dpbench.privacy.engines.check_layout", lambda *args, **kwargs: None))
        return stack

    return patch


# ------------------------------------------------------------------------------------- DC-DPSGD


class _MixtureNoise:
    """The DC-DPSGD reference code's gradient noise (main.py: (k/B) N(0, sigma c1 / B) + (1 - k/B)
    N(0, sigma c2 / B) on the mean, k tail examples of B) on the sum: p N(0, (sigma c1)^2) +
    (1 - p) N(0, (sigma c2)^2), p = k/B, drawn where N(0, (sigma c1)^2) is stated; every other
    draw (the scores' noise) unchanged."""

    def __init__(self, noise, std: float, tail_fraction: float, body_ratio: float) -> None:
        self.noise, self.std, self.p, self.body_ratio = noise, std, tail_fraction, body_ratio
        self.device = getattr(noise, "device", None)

    def sample(self, shape, std, dtype=torch.float32):
        if std != self.std:
            return self.noise.sample(shape, std, dtype)
        tail, body = self.noise.sample(shape, std, dtype), self.noise.sample(shape, std * self.body_ratio, dtype)
        return tail.mul_(self.p).add_(body, alpha=1 - self.p)


def _dcdpsgd_mixture_noise(cfg):
    from dpbench.algorithms.dcdpsgd import DCDPSGD

    release = DCDPSGD.gaussian_release

    def mixture_release(self, name, *parts, **kwargs):
        tail = self.last_tail  # this step's tail (threshold mode: chosen before the release)
        p = float(tail.float().mean()) if tail is not None and tail.numel() else 0.0
        noise = self.privacy.noise
        self.privacy.noise = _MixtureNoise(noise, self.gradient_noise_std(), p, self.body_clip / self.tail_clip)
        try:
            return release(self, name, *parts, **kwargs)
        finally:
            self.privacy.noise = noise

    return mock.patch.object(DCDPSGD, "gaussian_release", mixture_release)


# ----------------------------------------------- the noise's precision, the validation score, DC-DPSGD's state


def _noise_bf16_rounded(cfg):
    """Noise drawn in fp32 and rounded to bfloat16 before it is added (back in fp32): its std is right,
    but release - value lies on bf16's grid."""
    from dpbench.privacy.noise import GaussianNoise

    original = GaussianNoise.sample
    return mock.patch.object(GaussianNoise, "sample", lambda self, shape, std, dtype=torch.float32:
                             original(self, shape, std, dtype).to(torch.bfloat16).to(dtype))


def _validation_on_training(cfg):
    """The validation score's per-example scores taken from the training part (the image task's
    correct predictions on its training images) while the validation part stays aside."""
    from dpbench.tasks.image import ImageClassificationTask

    @torch.no_grad()
    def on_training(self, model):
        was_training = model.training
        model.eval()
        images, labels = self.data.train_images.to(self.device), self.data.train_labels.to(self.device)
        correct = (model(images).argmax(dim=1) == labels).float()
        model.train(was_training)
        return correct

    return mock.patch.object(ImageClassificationTask, "validation_scores", on_training)


def _dcdpsgd_threshold_unnoised(cfg):
    """DC-DPSGD's threshold tau_{t+1} from the un-noised score histogram; the noisy one is still
    released (and charged) with the gradient."""
    from dpbench.algorithms.dcdpsgd import DCDPSGD, HISTOGRAM_DECAY

    add_noise = DCDPSGD.add_noise

    def unnoised_average(self, sums):
        histogram = self.pending_histogram
        before = None if self.score_histogram_average is None else self.score_histogram_average.clone()
        noisy = add_noise(self, sums)  # releases the noisy histogram and the gradient
        if self.threshold_selection and histogram is not None:
            clean = histogram.detach().float()
            self.score_histogram_average = clean if before is None else \
                before.mul_(HISTOGRAM_DECAY).add_(clean, alpha=1 - HISTOGRAM_DECAY)
        return noisy

    return mock.patch.object(DCDPSGD, "add_noise", unnoised_average)


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
              _clipping_off),
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
    from dpbench.tools.audit import run_audit

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
