"""The two-step sensitivity check of `dpbench-audit` (dpbench/tools/audit/runner.py), for algorithms whose
release sets state the next step reads (`Algorithm.release_carries_state`: DC-DPSGD's threshold,
DPDR's basis).

The one-step sensitivity check holds the state fixed, so it cannot see state taken from the
un-noised batch. Here a record is added (removed, replaced) at step t only, and step t's RELEASE is
held fixed: the neighbouring run's noisy values are replaced by the first run's, which is the
coupling the privacy argument rests on (a neighbour that releases the same values must go on
exactly alike; holding only the noise fixed would let a sound algorithm carry the record's
contribution forward through its release). Both runs then make step t+1 on one batch without the
record, noise off: a state set from the releases alone gives the same noiseless release, bit for
bit, so the change, in units of the declared sensitivity, must be 0 (float tolerance). State set
from the un-noised batch (a threshold from the un-noised score histogram) moves it.
"""

from __future__ import annotations

import math

import torch

from dpbench.tools.audit.harness import audited_job, audited_step, dropout_off, physical_chunks
from dpbench.tools.audit.report import TWO_STEP, Check
from dpbench.tools.audit.sensitivity import _release_differences

NEXT_BATCH = 8  # step t+1's batch, x audit.batch: many examples near a threshold that state could move
TOLERANCE = 1e-6  # of the declared sensitivity: two runs of one state differ by nothing at all


class _HeldRelease:
    """An algorithm's `gaussian_release`, recording its noisy values (`held` None) or replacing them
    with held ones, in the same order (a per-example vector of another length: the common rows)."""

    def __init__(self, algorithm) -> None:
        self.release, self.recorded, self.held = algorithm.gaussian_release, [], None
        algorithm.gaussian_release = self

    def __call__(self, name, *parts, **kwargs):
        noisy = self.release(name, *parts, **kwargs)
        if self.held is None or not self.held:  # recording (or more releases than the first run made: left as drawn)
            self.recorded.append([[v.detach().clone() for v in values] for values in noisy])
            return noisy
        for values, held in zip(noisy, self.held.pop(0)):
            for value, kept in zip(values, held):
                if value.shape == kept.shape:
                    value.copy_(kept)
                else:
                    rows = min(value.shape[0], kept.shape[0])
                    value[:rows].copy_(kept[:rows])
        return noisy


def two_step_checks(cfg) -> list[Check]:
    from dpbench.algorithms import algorithm_class

    cls = algorithm_class(cfg.algo.name)
    if not cls.release_carries_state:
        return [Check(TWO_STEP, "state across steps", 0.0, TOLERANCE, True,
                      f"not applicable: {cls.__name__} declares no state set by a release that the next step reads "
                      "(release_carries_state); its parameters are covered by release → update")]
    batch, trials = int(cfg.audit.batch), min(3, int(cfg.audit.trials))  # add, remove, replace: the state's neighbours
    scale = 1.0 if str(cfg.train.precision) == "fp16" else float(cfg.audit.loss_scale)  # every example clipped
    generator = torch.Generator().manual_seed(3)
    worst: dict[str, tuple[float, float, str]] = {}
    for step in range(int(cfg.audit.sensitivity_steps)):
        # the neighbours of the sensitivity check, and a record added to an EMPTY batch (Poisson batches
        # can be empty): alone in the step's statistics, it moves any state read from them the most;
        # its loss weight 0 (a zero gradient, so it scores 0 in DC-DPSGD) or the full scale
        kinds = [("add", "remove", "replace")[trial % 3] for trial in range(trials)] + ["add to empty", "add to empty"]
        for trial, kind in enumerate(kinds):
            pair = [audited_job(cfg, zero_noise=True) for _ in range(2)]
            n = pair[0][0].task.train_size
            order = torch.randperm(n, generator=generator).tolist()
            base, outsider = order[:batch], order[batch]
            following = order[batch + 1: batch + 1 + NEXT_BATCH * batch] or base
            sign = 1.0 if trial % 2 == 0 else -1.0
            first = (base, [scale] * batch)
            if kind == "add to empty":
                first = ([], [])
                neighbour = ([outsider], [0.0 if trial == trials else sign * scale])
            else:
                neighbour = {"add": (base + [outsider], [scale] * batch + [sign * scale]),
                             "remove": (base[:-1], [scale] * (batch - 1)),
                             "replace": (base[:-1] + [outsider], [scale] * (batch - 1) + [sign * scale])}[kind]
            for job, _ in pair:
                dropout_off(job.model)
            for warm in range(step):  # identical history up to step t
                for job, recorder in pair:
                    torch.manual_seed(warm)
                    audited_step(job, recorder, physical_chunks(job, base, [scale] * batch), warm)
            held = [_HeldRelease(job.algorithm) for job, _ in pair]
            for (job, recorder), (indices, weights) in zip(pair, [first, neighbour]):
                torch.manual_seed(10_000 + step)
                audited_step(job, recorder, physical_chunks(job, indices, weights), step)
                held[1].held = held[0].recorded  # the neighbour releases what the first run released
            for (job, recorder), replay in zip(pair, held):
                job.algorithm.gaussian_release = replay.release  # step t+1: the algorithm's own release again
                recorder.releases.clear()
                torch.manual_seed(20_000 + step)
                audited_step(job, recorder, physical_chunks(job, following, [scale] * len(following)), step + 1)
            for part, distance, sensitivity in _release_differences(pair[0][1], pair[1][1]):
                ratio = distance / sensitivity if sensitivity > 0 else (math.inf if distance > 0 else 0.0)
                if part not in worst or ratio > worst[part][0]:
                    weight = f", loss weight {neighbour[1][-1]:g}" if kind == "add to empty" else ""
                    worst[part] = (ratio, distance, f"{kind}{weight} at step {step}, step {step + 1}'s release")
    return [Check(TWO_STEP, part, ratio, TOLERANCE, ratio <= TOLERANCE,
                  f"largest change {distance:.4g} = {ratio:.4g} x the declared sensitivity ({how}; step t's release held "
                  f"fixed, step t+1 on {NEXT_BATCH} x audit.batch examples without the record): a state set from the "
                  "releases alone leaves it unchanged")
            for part, (ratio, distance, how) in sorted(worst.items())]
