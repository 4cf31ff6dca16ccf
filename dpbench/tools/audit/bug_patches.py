"""The seeded bugs' patches (dpbench/tools/audit/seeded_bugs.py holds the catalogue that names them):
each is `cfg -> context manager` over `unittest.mock.patch` of dpbench's own code, active only
while the audit runs, grouped by what they break."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

from dpbench.errors import UserError


def _base():
    from dpbench.algorithms.first_order import DPFirstOrderAlgorithm

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
        from dpbench.tools.audit.harness import ZeroNoise

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


def _unclipped_differences(self, differences, finite_losses, clip):
    kept = finite_losses & torch.isfinite(differences)
    return torch.where(kept, differences, torch.zeros_like(differences))  # every finite s_i whole: no clipping


def _zeroth_order():
    from dpbench.algorithms.dpzero import ZerothOrderAlgorithm

    return ZerothOrderAlgorithm


def clips_with_the_shared_rule(algo_cls) -> bool:
    """The classes `clipping_off` unclips: a first-order algorithm's per-example clip factors
    (DPFirstOrderAlgorithm.example_factors, at C or at its own bound) or a zeroth-order one's clip
    of each two-point difference (ZerothOrderAlgorithm.clip_differences), where not overridden."""
    for base, rule in ((_base(), "example_factors"), (_zeroth_order(), "clip_differences")):
        if algo_cls.private and issubclass(algo_cls, base):
            return next(c for c in algo_cls.__mro__ if rule in vars(c)) is base
    return False


def _clipping_off(cfg):
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(_base(), "example_factors", _unclipped_factors))
    stack.enter_context(mock.patch.object(_zeroth_order(), "clip_differences", _unclipped_differences))
    return stack


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


# ------------------------------------------- blind spots of the pooled rows (small tensors, scaled normals, state)


SMALL_TENSOR = 16  # `_noise_skipped_small`: tensors of fewer entries get no noise


def _noise_skipped_small(cfg):
    """No noise on a tensor of fewer than 16 entries (a head's bias released exactly): pooled with the
    rest, the noise's std is still about right."""
    from dpbench.privacy.noise import GaussianNoise

    original = GaussianNoise.sample

    def sample(self, shape, std, dtype=torch.float32):
        if math.prod(shape) < SMALL_TENSOR:
            return torch.zeros(shape, device=self.device, dtype=dtype)
        return original(self, shape, std, dtype)

    return mock.patch.object(GaussianNoise, "sample", sample)


def _normal_bf16_scaled(cfg):
    """The standard normal drawn in bfloat16, then scaled by sigma C in fp32 (past GaussianNoise's own
    draw, whose dtype it asserts): the right std, a residual of fp32's width, but residual / std on
    bf16's grid."""
    from dpbench.privacy.noise import GaussianNoise

    def sample(self, shape, std, dtype=torch.float32):
        normal = torch.empty(shape, device=self.device, dtype=torch.bfloat16).normal_(generator=self.generator)
        return (normal.float() * std).to(dtype)

    return mock.patch.object(GaussianNoise, "sample", sample)


def _validation_noise_seeded(cfg):
    """The validation score's noise drawn from a generator seeded by `seed` (one per run, like the
    training noise's), while training keeps its entropy-seeded one: the score's noise repeats in every
    run of the config, so its results.json gives the exact count away."""
    from dpbench.privacy import validation
    from dpbench.privacy.noise import GaussianNoise

    release, seeded = validation.gaussian_release, {}

    def seeded_release(name, parts, *, noise, **kwargs):
        if id(noise) not in seeded:  # the run's own noise object -> its seeded twin (held: the id stays its own)
            twin = GaussianNoise(noise.device)
            twin.generator.manual_seed(int(cfg.seed))
            seeded[id(noise)] = (noise, twin)
        return release(name, parts, noise=seeded[id(noise)][1], **kwargs)

    return mock.patch.object(validation, "gaussian_release", seeded_release)


def _diff_previous_unnoised(cfg):
    """DIFF's previous gradient g~_{t-1} kept without its noise (the clipped sums / B, the noisy one still
    released and applied): the next step's differences read the un-noised batch."""
    from dpbench.algorithms.diff import DIFF

    def step(self, batches, step_index):
        if self.previous is None:
            sums, tally = self.clip_and_accumulate(batches)
            clean = [s.detach().float() / self.privacy.expected_batch_size for s in sums]
            gradients = self.privatize(sums)
        else:
            sums, tally = self.difference_sums(batches)
            clean = [p + s.detach().float() / self.privacy.expected_batch_size for p, s in zip(self.previous, sums)]
            gradients = [p + noisy for p, noisy in zip(self.previous, self.privatize_difference(sums))]
        self.previous = clean
        self.apply_update(gradients)
        return tally.result()

    return mock.patch.object(DIFF, "step", step)
