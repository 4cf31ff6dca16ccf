"""The sensitivity check of `dpbench-audit` (dpbench/tools/audit/runner.py): with the noise off, neighbouring
batches move each release by at most the sensitivity the ledger assumes."""

from __future__ import annotations

import math

import torch

from dpbench.errors import DivergedError, UserError
from dpbench.tools.audit.harness import (
    ReleaseRecorder,
    audited_job,
    audited_step,
    dropout_off,
    physical_chunks,
)
from dpbench.tools.audit.report import (
    Check,
)


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


def _worst_fit(pair, indices: list[int]) -> int:
    """The record of `indices` with the largest loss on the model as it is (a forward on both jobs, so
    that any running statistics stay identical between them)."""
    per_job = []
    for job, _ in pair:
        with torch.no_grad():
            per_job.append(torch.cat([job.algorithm.per_example_losses(chunk).float()
                                      for chunk in physical_chunks(job, indices, [1.0] * len(indices))]))
    return indices[int(torch.nan_to_num(per_job[0], nan=-math.inf).argmax())]


def _sensitivity_checks(cfg, scale: float, scaling: str) -> list[Check]:
    batch = int(cfg.audit.batch)
    worst: dict[str, tuple[float, float, str]] = {}  # part -> (ratio, distance, how)
    generator = torch.Generator().manual_seed(1)
    halted: list[str] = []  # steps a non-finite record halted
    for step in range(int(cfg.audit.sensitivity_steps)):
        for trial in range(int(cfg.audit.trials) + 3):
            if trial >= int(cfg.audit.trials) and step < int(cfg.audit.sensitivity_steps) - 1:
                continue  # the non-finite and outweighing records: at the last audited step only (every step kind by then)
            pair = [audited_job(cfg, zero_noise=True) for _ in range(2)]
            n = pair[0][0].task.train_size
            order = torch.randperm(n, generator=generator).tolist()
            base, outsider = order[:batch], order[batch]
            sign = 1.0 if trial % 2 == 0 else -1.0
            for (job, _) in pair:
                dropout_off(job.model)
            for warm in range(step):  # identical history up to the audited step
                for (job, recorder) in pair:
                    torch.manual_seed(warm)
                    audited_step(job, recorder, physical_chunks(job, base, [scale] * batch), warm)
            neighbours = {
                "add": (base + [outsider], [scale] * batch + [sign * scale]),
                "remove": (base[:-1], [scale] * (batch - 1)),
                "replace": (base[:-1] + [outsider], [scale] * (batch - 1) + [sign * scale]),
            }
            # the last trial adds a record whose loss is NaN: it must contribute nothing and never halt
            neighbours["add non-finite"] = (base + [outsider], [scale] * batch + [math.nan])
            extra = trial - int(cfg.audit.trials)
            kind = (("add", "remove", "replace")[trial % 3] if extra < 0 else
                    ("add non-finite", "add outweighing, against", "add outweighing, with")[extra])
            # and then a copy of the batch's worst-fit example (a record may repeat; a well-fit one can have an
            # exactly zero gradient) whose loss outweighs the whole batch, against its own and with it: clipping
            # the SUM instead of each example turns the clipped sum from the batch's direction u to ∓ the record's
            # v, a move of C |u ± v|; one of the two is at least √2 C whatever the angle (|u − v|² + |u + v|² = 4),
            # where per-example clipping moves it by at most C
            if kind.startswith("add outweighing"):
                against = -1.0 if kind.endswith("against") else 1.0
                neighbours[kind] = (base + [_worst_fit(pair, base)], [scale] * batch + [against * OUTWEIGH * batch * scale])
            try:
                for (job, recorder), (indices, weights) in zip(pair, [(base, [scale] * batch), neighbours[kind]]):
                    recorder.releases.clear()
                    torch.manual_seed(10_000 + step)
                    audited_step(job, recorder, physical_chunks(job, indices, weights), step)
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
