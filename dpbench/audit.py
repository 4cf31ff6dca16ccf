"""`dpbench-audit`: an empirical self-check of a private algorithm's privacy claims.

    dpbench-audit algo=grape model=cnn        # same config and overrides as `dpbench`

Three checks, each against what the run's ledger assumes (every noisy release goes through
`Algorithm.gaussian_release`, which the audit observes):

  noise        the noise each release actually added (noisy - noiseless values) has the stated
               std: a two-sided chi-square test of sum (noise/std)^2 over a few steps;
  sensitivity  with the noise off, neighbouring batches (one example added, removed or replaced;
               every loss scaled up so that every example is clipped, the neighbour's gradient
               pointing either way) move each released quantity by at most the sensitivity the
               ledger assumes (2x for a replacement); for DC-DPSGD the added example can take the
               tail from another one;
  accounting   the planned ledger is stepwise what each step released (the trainer's check),
               and its epsilon, recomputed with Google's dp-accounting (RDP and PLD) apart from
               the configured accountant, is not above the epsilon the run would report.

Prints a table, writes audit.json in the run folder, exits 0 when every check holds, else 1.
The sensitivity check turns dropout layers off so that the two neighbouring runs differ only in
the neighbour; the per-example clipping of recomputed gradients under dropout is covered by the
test suite.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from omegaconf import OmegaConf

from dpbench.errors import UserError


@dataclass
class Check:
    name: str  # noise | sensitivity | accounting
    release: str  # which release (or ledger) it is about
    measured: float
    bound: float
    passed: bool
    detail: str


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


class ReleaseRecorder:
    """Observer of an algorithm's releases: (name, noiseless parts, noisy parts, mechanism)."""

    def __init__(self) -> None:
        self.releases: list[tuple] = []

    def __call__(self, name, parts, noisy, mechanism) -> None:
        noiseless = [[v.detach().double().clone() for v in part.values] for part in parts]
        noisy = [[v.detach().double().clone() for v in values] for values in noisy]
        self.releases.append((name, parts, noiseless, noisy, mechanism))


def _audited_job(cfg, zero_noise: bool):
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
    """The logical batch in the trainer's physical chunks (two-pass algorithms see several)."""
    task = job.algorithm.task
    size = job.cfg.train.physical_batch_size or max(1, len(indices))
    chunks = [task.batch(indices[i : i + size], weights[i : i + size]) for i in range(0, len(indices), size)]
    return chunks or [task.batch([], [])]


def _chi_square_p_value(sum_of_squares: float, dof: int) -> float:
    from scipy.stats import chi2

    lower = chi2.cdf(sum_of_squares, dof)
    return float(2 * min(lower, 1 - lower))


SCALAR_DRAWS = 200  # empty-batch steps added when a release is one number per step


def noise_check(cfg) -> list[Check]:
    """Noise added by each release vs its stated std, over `audit.noise_steps` ordinary steps."""
    job, recorder = _audited_job(cfg, zero_noise=False)
    n, batch = job.task.train_size, int(cfg.audit.batch)
    generator = torch.Generator().manual_seed(0)
    steps = int(cfg.audit.noise_steps)
    for step in range(steps):
        indices = torch.randperm(n, generator=generator)[:batch].tolist()
        job.algorithm.train_step(_physical(job, indices, [1.0] * len(indices)), step)
    if any(r[3][0][0].numel() == 1 for r in recorder.releases):  # a scalar release (DPZero): more draws
        for step in range(steps, steps + SCALAR_DRAWS):  # empty Poisson batches: pure noise, cheap
            job.algorithm.train_step(_physical(job, [], []), step)
    squares: dict[str, list[float]] = {}  # release/part -> [sum (noise/std)^2, count]
    for name, parts, noiseless, noisy, _ in recorder.releases:
        for k, (part, clean, dirty) in enumerate(zip(parts, noiseless, noisy)):
            key = name if len(parts) == 1 else f"{name}[{k}]"
            entry = squares.setdefault(key, [0.0, 0, part.noise_std])
            for a, b in zip(clean, dirty):
                entry[0] += float(((b - a) / part.noise_std).pow(2).sum())
                entry[1] += a.numel()
    checks = []
    alpha = float(cfg.audit.alpha)
    for key, (total, count, std) in squares.items():
        if count == 0:
            continue
        p_value = _chi_square_p_value(total, count)
        ratio = math.sqrt(total / count)
        checks.append(
            Check("noise", key, ratio, 1.0, p_value > alpha,
                  f"measured std / stated std = {ratio:.4f} over {count} draws (stated std {std:.4g}, "
                  f"update std {std / job.privacy.setup.expected_batch_size:.4g}); chi-square p = {p_value:.3g}")
        )
    return checks


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
    for (name, parts, clean_a, _, _), (_, _, clean_b, _, _) in zip(first.releases, second.releases):
        for k, (part, values_a, values_b) in enumerate(zip(parts, clean_a, clean_b)):
            distance = math.sqrt(sum(_difference(x, y) ** 2 for x, y in zip(values_a, values_b)))
            out.append((name if len(parts) == 1 else f"{name}[{k}]", distance, part.sensitivity))
    return out


def sensitivity_check(cfg) -> list[Check]:
    """Neighbouring batches with the noise off: each release moves by at most its sensitivity."""
    batch = int(cfg.audit.batch)
    scale = float(cfg.audit.loss_scale)
    worst: dict[str, tuple[float, float, str]] = {}  # part -> (ratio, distance, how)
    generator = torch.Generator().manual_seed(1)
    for step in range(int(cfg.audit.sensitivity_steps)):
        for trial in range(int(cfg.audit.trials)):
            pair = [_audited_job(cfg, zero_noise=True) for _ in range(2)]
            n = pair[0][0].task.train_size
            order = torch.randperm(n, generator=generator).tolist()
            base, outsider = order[:batch], order[batch]
            sign = 1.0 if trial % 2 == 0 else -1.0
            for (job, _) in pair:
                _dropout_off(job.model)
            for warm in range(step):  # identical history up to the audited step
                for (job, _) in pair:
                    torch.manual_seed(warm)
                    job.algorithm.train_step(_physical(job, base, [scale] * batch), warm)
            neighbours = {
                "add": (base + [outsider], [scale] * batch + [sign * scale]),
                "remove": (base[:-1], [scale] * (batch - 1)),
                "replace": (base[:-1] + [outsider], [scale] * (batch - 1) + [sign * scale]),
            }
            kind = ("add", "remove", "replace")[trial % 3]
            for (job, recorder), (indices, weights) in zip(pair, [(base, [scale] * batch), neighbours[kind]]):
                recorder.releases.clear()
                torch.manual_seed(10_000 + step)
                job.algorithm.train_step(_physical(job, indices, weights), step)
            factor = 2.0 if kind == "replace" else 1.0
            for part, distance, sensitivity in _release_differences(pair[0][1], pair[1][1]):
                ratio = distance / (factor * sensitivity)
                if part not in worst or ratio > worst[part][0]:
                    worst[part] = (ratio, distance, f"{kind} at step {step}")
    tolerance = 1 + 1e-4
    return [
        Check("sensitivity", part, ratio, 1.0, ratio <= tolerance,
              f"largest change {distance:.4g} = {ratio:.4f} x the stated sensitivity ({how})")
        for part, (ratio, distance, how) in sorted(worst.items())
    ]


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


def accounting_check(job) -> list[Check]:
    """The planned ledger's epsilon by dp-accounting vs the epsilon the configured accountant reports."""
    plan = job.privacy
    ledger = plan.planned_ledger(job.steps)  # Poisson steps, or a shuffled run's epochs
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


def run_audit(cfg, run_dir: Path) -> dict:
    """Run every check; write audit.json; return it (`passed` says whether all checks held)."""
    if cfg.audit.get("canary", False):
        raise UserError(
            "audit.canary=true (one-run canary audit) is not available in this version; run without it"
        )
    import logging
    import warnings

    logging.getLogger("absl").setLevel(logging.ERROR)  # dp-accounting's per-order convergence chatter
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Full backward hook is firing.*")
        job, _ = _audited_job(cfg, zero_noise=False)  # calibrates sigma (if asked to) once
        accounting = accounting_check(job)
        # the other checks build many jobs: at the calibrated sigma they skip calibration
        fixed = cfg.copy()
        OmegaConf.update(fixed, "privacy.noise_multiplier", float(job.privacy.setup.noise_multiplier))
        for key, value in job.privacy.setup.derived.items():  # an algorithm's own calibration (DC-DPSGD's sigma_tr)
            if key in cfg.algo:  # its options only (derived facts for results.json are not config keys)
                OmegaConf.update(fixed, f"algo.{key}", value)
        checks = [*noise_check(fixed), *sensitivity_check(fixed), *accounting]
    report = {
        "algo": cfg.algo.name,
        "model": cfg.model.name,
        "dataset": cfg.dataset.name,
        "passed": all(c.passed for c in checks),
        "checks": [asdict(c) for c in checks],
    }
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "audit.json").write_text(json.dumps(report, indent=2))
    return report


def audit_table(report: dict):
    from rich.table import Table

    table = Table(title=f"dpbench-audit · {report['algo']} · {report['model']} · {report['dataset']}")
    for column in ("check", "release", "measured / bound", "result", "detail"):
        table.add_column(column, overflow="fold")
    for c in report["checks"]:
        table.add_row(
            c["name"], c["release"], f"{c['measured']:.4g} / {c['bound']:.4g}",
            "[green]pass[/]" if c["passed"] else "[bold red]FAIL[/]", c["detail"],
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
        except UserError as error:
            console.print(f"[bold red]error:[/] {error}", soft_wrap=True)
            sys.exit(2)
        console.print(audit_table(report))
        verdict = "every check holds" if report["passed"] else "some checks FAILED"
        console.print(f"{verdict}; audit.json: {run_dir / 'audit.json'}", soft_wrap=True)
        sys.exit(0 if report["passed"] else 1)

    return _main


def main() -> None:
    from dpbench.schema import run_app

    run_app(_main_factory())


if __name__ == "__main__":
    main()
