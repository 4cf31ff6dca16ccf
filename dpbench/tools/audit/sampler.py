"""The sampler check of `dpbench-audit` (dpbench/tools/audit/runner.py): Poisson where Poisson is accounted,
shuffled epochs where shuffling is, and never reproducible from `seed`."""

from __future__ import annotations

import math

import torch

from dpbench.runtime import distributed
from dpbench.tools.audit.harness import chi_square_p_value, two_sided_normal
from dpbench.tools.audit.report import (
    Check,
)

SAMPLER_DRAWS = 200  # batches drawn from each of two fresh samplers (no training: cheap)


def _run_sampler(cfg, job):
    """The private run's sampler, built as `dpbench.run` builds it (fresh entropy, not the seed): over
    the training part, at the planned (accounted) sample rate and epoch length; under torchrun each
    rank's share of rank 0's batches (`_logical_batches` reassembles them)."""
    from dpbench.privacy.sampling import build_sampler

    return build_sampler(str(cfg.privacy.sampling), job.task.train_size, int(cfg.train.batch_size), int(cfg.seed), True,
                         job.privacy.batches_per_epoch, sample_rate=float(job.privacy.setup.sample_rate),
                         relation=str(cfg.privacy.get("neighboring", "add_remove")))


def _logical_batches(sampler, count: int) -> list[list[int]]:
    """`count` logical batches of the run's sampler. Under torchrun it is the trainer's
    (`ShardedBatches`: rank 0 draws, rank r gets indices[r::K]); the ranks' shares are gathered and
    interleaved back into the whole batch the plan accounts, so that the check counts the batch
    every rank trains on together (and fails if the shares do not partition it), not one share."""
    import itertools

    shares = list(itertools.islice(iter(sampler), count))
    if not distributed.is_distributed():
        return shares
    every, world = distributed.all_gather_object(shares), distributed.world_size()
    batches = []
    for t in range(count):
        whole: list = [None] * sum(len(ranks[t]) for ranks in every)
        for r, ranks in enumerate(every):
            whole[r::world] = ranks[t]  # raises if the shares are not indices[r::K] of one batch
        batches.append(whole)
    return batches


def sampler_check(cfg, job) -> list[Check]:
    """sampler: the private batch selection is the one the plan accounts. Under Poisson sampling the
    realised sizes are Binomial(n, q) (two-sided tests of their mean and dispersion) and inclusions
    are independent across steps (the overlap of consecutive batches vs n q^2); shuffled batches are
    of size B and disjoint within an epoch; either way two fresh samplers with the same seed draw
    different batches."""
    import itertools

    n, alpha = job.task.train_size, float(cfg.audit.alpha)
    draws = [_logical_batches(_run_sampler(cfg, job), SAMPLER_DRAWS) for _ in range(2)]
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
            p_sizes = min(1.0, 3 * min(two_sided_normal(z_mean), chi_square_p_value(dispersion, S)))
        checks.append(Check(
            "sampler", "batch sizes ~ Binomial(n, q)", dispersion / S, 1.0, p_sizes > alpha,
            f"{S} batches of the run's sampler: mean size {float(sizes.mean()):.2f} (n q = {mean:.2f}, z = {z_mean:.2f}), "
            f"variance / n q (1 - q) = {dispersion / S:.3f} (two-sided chi-square); p = {p_sizes:.3g} (Bonferroni over "
            "3); fixed-size batches have variance 0", p_value=p_sizes))
        overlap = sum(len(set(a) & set(b)) for a, b in itertools.pairwise(first))
        expected = (S - 1) * n * q * q
        variance = (S - 1) * n * q * q * (1 - q * q) + 2 * (S - 2) * n * (q ** 3 - q ** 4)
        z = (overlap - expected) / math.sqrt(variance) if variance > 0 else 0.0
        p_overlap = min(1.0, 3 * two_sided_normal(z))
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
