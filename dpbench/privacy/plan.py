"""The privacy plan of a run: calibrated noise, what each step may release, and what ran.

`plan_privacy` turns the config into a `PrivacyPlan`: the accountant, the noise multiplier
(calibrated for the planned run or given), the `PrivacySetup` handed to the algorithm, and the
one planning function `planned(step)` that both calibration and the per-step check use. The
trainer composes the mechanisms each step actually released into the ledger; `results()` is the
`privacy` section of results.json, and every fact that changes what the reported epsilon means
is written to the run's notes there, never only to the console.

`privacy.sampling` picks the bound (`BOUNDS`): Poisson batches are subsampled Gaussians, one per
step; shuffled fixed-size batches have no amplification and are charged one full-batch Gaussian
per epoch (`dpbench.privacy.mechanisms.ShuffledLedger`, which says why and under which relation).
Calibration, the per-step check and the trainer's ledger all compose through the same ledger.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

import torch
from omegaconf import OmegaConf

from dpbench.errors import UserError
from dpbench.logging.results import PrivacyResults
from dpbench.privacy.accountants import Accountant, build_accountant, calibrate_noise_multiplier, ledger_of_plan
from dpbench.privacy.mechanisms import GaussianMechanism, Ledger, new_ledger, same_mechanisms, split_off, under_relation
from dpbench.privacy.noise import GaussianNoise
from dpbench.privacy.release import ReleasePart, release_mechanism
from dpbench.privacy.sampling import batches_per_epoch


# The validation score (dataset.validation_fraction > 0) releases a count of correct predictions
# on the validation part (per-example scores in [0, 1]): adding, removing or replacing one example
# moves it by at most 1. A `ReleasePart` states its sensitivity under add/remove-one and a
# replace-one mechanism is accounted at twice that (`GaussianMechanism.add_remove_noise_multiplier`),
# so the count's part sensitivity is 1 under add/remove and 1/2 under replace-one: under either
# relation one Gaussian of std sigma_v at sensitivity 1, read from the whole part (sample rate 1).
COUNT_SENSITIVITY = {"add_remove": 1.0, "replace_one": 0.5}
DEFAULT_VALIDATION_NOISE_MULTIPLIER = 10.0  # dpbench.options.PrivacyOptions.validation_noise_multiplier


def validation_noise_multiplier(cfg) -> float:
    """sigma_v: the std of the noise on the validation count (privacy.validation_noise_multiplier)."""
    return float(cfg.privacy.get("validation_noise_multiplier", DEFAULT_VALIDATION_NOISE_MULTIPLIER))


def validation_mechanism(sigma_v: float, relation: str) -> GaussianMechanism:
    """The mechanism the validation score's release is (`release_mechanism` of its one part)."""
    return release_mechanism([ReleasePart([], COUNT_SENSITIVITY[relation], sigma_v)], 1.0, relation)


def has_validation_split(cfg) -> bool:
    from dpbench.data.validation import validation_fraction

    return validation_fraction(cfg.dataset) > 0


class CalibratedNoises(Protocol):
    """What an algorithm's own `calibrate_noise` derived beside sigma (DC-DPSGD's `EpsilonSplit`):
    a small dataclass the algorithm reads as attributes, typed by the algorithm that owns it."""

    def fixed_noise_options(self) -> dict:
        """The algo options that give these noises with sigma fixed, without calibrating (the
        audit's fixed-sigma jobs): e.g. {"score_noise_multiplier": sigma_tr}."""
        ...


@dataclass
class PrivacySetup:
    """What a private algorithm needs to privatise its releases."""

    noise_multiplier: float  # sigma: noise std = sigma * clip_norm on the clipped sum
    clip_norm: float  # C: per-example L2 bound, the sum's sensitivity (add/remove one)
    expected_batch_size: float  # public B = q * n; the clipped noisy sum is divided by it
    sample_rate: float  # q
    noise: GaussianNoise  # entropy-seeded generator (dpbench.privacy.noise)
    clipping: str = "flat"  # rule in dpbench.privacy.clipping.CLIPPING_RULES
    clipping_gamma: float = 0.01
    per_layer_thresholds: str = "equal"  # clipping=per_layer: how C splits into C_l (clipping.LAYER_THRESHOLDS)
    neighboring: str = "add_remove"  # add_remove | replace_one: the relation epsilon is stated for
    # what an algorithm's own calibration derived (`calibrate_noise`, e.g. DC-DPSGD's EpsilonSplit
    # with sigma_tr); None for the one-sigma calibration. Planning and the algorithm read it as is:
    # the run's config stays as given, so results.json and resume see what the user set.
    derived: CalibratedNoises | None = None


class PlanMismatchError(RuntimeError):
    """A step released other mechanisms than its plan: a privacy bug, never the user's input."""


def neighboring(cfg) -> str:
    """The neighbouring relation epsilon is stated for (configs without the key: add_remove)."""
    return str(cfg.privacy.get("neighboring", "add_remove"))


# privacy.sampling -> the bound its epsilon is (results.json privacy.bound)
BOUNDS = {
    "poisson": "poisson_subsampled_gaussian",  # each step: a Poisson-subsampled Gaussian (amplification)
    "shuffle": "full_batch_gaussian_per_epoch",  # each epoch: its worst step at q = 1 (no amplification)
}


# Releases no noise covers, made when privacy.log_private_stats=true (research default).
UNNOISED_RELEASES = (
    "per-step training loss and its running mean (history/metrics train_loss, W&B train/*)",
    "training-set accuracy on a fixed subset (train.train_eval_size > 0)",
    "realised Poisson batch sizes (W&B train/batch_size)",
    "algorithm statistics of the private batch (e.g. DC-DPSGD mean_tail_fraction)",
    "halting on a non-finite training loss (status: diverged)",
    "peak memory, the per-example working set, throughput and wall time (memory.*, throughput.*: they "
    "depend on the realised batch sizes and the longest sampled record), and W&B's system metrics",
)

# results.json figures withheld (None) unless log_private_stats: those that depend on realised batch
# sizes, and start_bytes, the process's size when the run began (what ran before it in the process:
# a private study's first trial starts smaller than its later ones, which tells K)
PRIVATE_STATISTIC_FIGURES = {
    "memory": ("peak_bytes", "cuda_max_allocated", "per_sample_grad_bytes", "start_bytes"),
    "throughput": ("samples_per_s", "wall_s"),
    "compute": ("forward_equivalents", "per_example", "forwards", "backwards", "examples"),  # realised batch sizes
}


@dataclass(frozen=True)
class Calibration:
    """What an algorithm that calibrates its noises itself works with: an optional classmethod
    `calibrate_noise(algo_cfg, calibration, epsilon, delta)` replaces the one-sigma
    calibration (DC-DPSGD's paper-style epsilon split calibrates two mechanisms apart) and returns
    (sigma, derived): a `CalibratedNoises` dataclass of what it derived (a second sigma) or None,
    which `PrivacySetup.derived` hands to planning (`planned_mechanisms(..., derived=)`), the
    per-step check and the algorithm."""

    accountant: Accountant
    steps: int
    sample_rate: float
    clip_norm: float
    neighboring: str
    batches_per_epoch: int | None = None  # shuffled batches (None: Poisson)
    final_releases: tuple[GaussianMechanism, ...] = ()  # made once after training (the validation score)

    def ledger(self, mechanisms_for_step: Callable[[int], list[GaussianMechanism]]) -> Ledger:
        """The planned run's ledger, each step's mechanisms stated under the run's relation, and the
        releases made after training."""
        return ledger_of_plan(
            lambda step: under_relation(mechanisms_for_step(step), self.neighboring), self.steps, self.batches_per_epoch,
            self.final_releases,
        )

    def epsilon(self, mechanisms_for_step: Callable[[int], list[GaussianMechanism]], delta: float) -> float:
        return self.accountant.epsilon(self.ledger(mechanisms_for_step), delta)

    def noise_multiplier(
        self, mechanisms: Callable[[float, int], list[GaussianMechanism]], epsilon: float, delta: float
    ) -> float:
        """Smallest sigma whose planned run (`mechanisms(sigma, step)` at each step) meets (epsilon, delta)."""
        return calibrate_noise_multiplier(
            self.accountant, lambda s: self.ledger(lambda step: mechanisms(s, step)), epsilon, delta
        )


@dataclass
class PrivacyPlan:
    accountant: Accountant
    delta: float
    setup: PrivacySetup
    target_epsilon: float | None  # None when sigma was given
    planned: Callable[[int], list[GaussianMechanism]]  # mechanisms step i may release
    log_private_stats: bool
    notes: list[str] = field(default_factory=list)
    sampling: str = "poisson"  # privacy.sampling: which bound (BOUNDS) epsilon is
    batches_per_epoch: int | None = None  # shuffled batches per epoch (None: Poisson)
    steps: int | None = None  # planned steps (what sigma was calibrated for)
    algo_config: dict = field(default_factory=dict)  # the algo settings planning read (as given)
    # releases made once after the last step, outside the steps' plan (the validation score's:
    # `validation_mechanism`); calibration composes them with the steps
    final_releases: tuple[GaussianMechanism, ...] = ()
    validation_noise_multiplier: float | None = None  # sigma_v, with a validation split
    # privacy.validation_composition=parallel (add/remove only): the final releases read the validation
    # part, training the disjoint training part, so an added or removed record is in one of them alone:
    # the run is (max(eps_training, eps_final), delta)-DP (`epsilon`)
    parallel_final: bool = False

    def new_ledger(self) -> Ledger:
        """An empty ledger of this run's kind (the trainer's, calibration's and the audit's)."""
        return new_ledger(self.batches_per_epoch)

    def planned_ledger(self, steps: int, final: bool = False) -> Ledger:
        """The ledger the first `steps` steps of the plan compose to; `final`: with the releases made
        after training (what calibration and the reported epsilon of a finished run compose)."""
        return ledger_of_plan(self.planned, steps, self.batches_per_epoch, self.final_releases if final else ())

    def check_final_release(self, ran: GaussianMechanism) -> None:
        """Refuse a release after training that is not one of the plan's `final_releases`."""
        if not any(same_mechanisms([ran], [planned]) for planned in self.final_releases):
            raise PlanMismatchError(f"a release after training ran {ran} but the plan holds {list(self.final_releases)}: "
                                    "the reported epsilon would not be that of the run; this is a bug, please report it")

    def fingerprint(self) -> dict:
        """What every rank of a data-parallel run must agree on (plain, comparable data)."""
        setup = self.setup
        return {
            "noise_multiplier": setup.noise_multiplier, "clip_norm": setup.clip_norm, "sample_rate": setup.sample_rate,
            "expected_batch_size": setup.expected_batch_size, "clipping": setup.clipping,
            "clipping_gamma": setup.clipping_gamma, "per_layer_thresholds": setup.per_layer_thresholds,
            "neighboring": setup.neighboring, "secure_rng": setup.noise.secure,
            "accountant": self.accountant.name, "delta": self.delta, "target_epsilon": self.target_epsilon,
            "sampling": self.sampling, "batches_per_epoch": self.batches_per_epoch, "steps": self.steps,
            "algo": self.algo_config, "derived": asdict(setup.derived) if setup.derived is not None else None,
            "log_private_stats": self.log_private_stats,  # what else the run publishes
            "final_releases": [asdict(m) for m in self.final_releases],
        }

    def check_step(self, step: int, ran: list[GaussianMechanism]) -> None:
        """Refuse to go on when a step released anything but its plan (calibration assumed it)."""
        expected = self.planned(step)
        if not same_mechanisms(ran, expected):
            raise PlanMismatchError(
                f"step {step} released {ran} but its plan was {expected}: the reported epsilon would "
                "not be that of the run; this is a bug in the algorithm, please report it"
            )

    def epsilon(self, ledger: Ledger) -> float:
        if not self.parallel_final:
            return self.accountant.epsilon(ledger, self.delta)
        training, final = split_off(ledger, self.final_releases)
        return max(self.accountant.epsilon(training, self.delta), self.accountant.epsilon(final, self.delta))

    def bounds(self, ledger: Ledger) -> tuple[float | None, float | None]:
        """(lower, upper) epsilon where the accountant gives them; parallel parts: the larger of each."""
        if not self.parallel_final:
            return self.accountant.bounds(ledger, self.delta)
        parts = [self.accountant.bounds(part, self.delta) for part in split_off(ledger, self.final_releases)]
        lower, upper = zip(*parts)
        return (None if None in lower else max(lower)), (None if None in upper else max(upper))

    def results(self, ledger: Ledger, steps: int, planned_steps: int) -> PrivacyResults:
        """The privacy section of results.json for the mechanisms that ran."""
        from dpbench.privacy.events import events_record

        setup = self.setup
        lower, upper = self.bounds(ledger)
        epsilon = self.epsilon(ledger)
        parts = list(split_off(ledger, self.final_releases)) if self.parallel_final else [ledger]
        if self.accountant.computed_by != self.accountant.name:
            self.note(
                f"accountant={self.accountant.name} failed on this ledger; epsilon was computed by "
                f"{self.accountant.computed_by} instead (privacy.accountant names it)"
            )
        return PrivacyResults(
            private=True,
            epsilon=epsilon,
            epsilon_is_upper_bound=self.accountant.upper_bound,
            target_epsilon=self.target_epsilon,
            delta=self.delta,
            noise_multiplier=setup.noise_multiplier,
            clip_norm=setup.clip_norm,
            sample_rate=setup.sample_rate,
            expected_batch_size=setup.expected_batch_size,
            steps=steps,
            planned_steps=planned_steps,
            accountant=self.accountant.computed_by,
            requested_accountant=self.accountant.name,
            neighboring=setup.neighboring,
            log_private_stats=self.log_private_stats,
            ledger=ledger.as_records(),
            sampling=self.sampling,
            bound=BOUNDS[self.sampling],
            batches_per_epoch=self.batches_per_epoch,
            validation_noise_multiplier=self.validation_noise_multiplier,
            validation_composition=("parallel" if self.parallel_final else "sequential")
            if self.validation_noise_multiplier is not None else None,
            epsilon_lower=lower,
            epsilon_upper=upper,
            pld_interval=getattr(self.accountant, "interval_used", None) if self.accountant.computed_by == "pld" else None,
            dp_events=events_record(parts, parallel=self.parallel_final),
        )

    def recorded_notes(self) -> list[str]:
        """The notes for results.json: the warnings, and what is released without noise."""
        if not self.log_private_stats:
            return list(self.notes)
        unnoised = (
            "privacy.log_private_stats=true: results and W&B hold un-noised statistics of the private "
            "training data that epsilon does not cover (" + "; ".join(UNNOISED_RELEASES) + ")"
        )
        return [*self.notes, unnoised]

    def note(self, message: str) -> None:
        if message not in self.notes:
            self.notes.append(message)


def plan_privacy(cfg, algo_cls, train_size: int, steps: int, device: torch.device) -> PrivacyPlan:
    """Calibrate (or take) sigma for the planned run and build what the algorithm needs."""
    from dpbench.options import target_epsilon  # the one rule for the default target

    p = cfg.privacy
    relation = neighboring(cfg)  # validated with the config (dpbench.run_config.validate)
    accountant = build_accountant(cfg.accountant.name)
    sample_rate = cfg.train.batch_size / train_size
    clip_norm = float(p.clip_norm)
    sampling = str(p.sampling)
    per_epoch = batches_per_epoch(cfg, train_size)
    notes: list[str] = []
    derived = None  # what an algorithm's own calibration derived (CalibratedNoises)
    # `train_size` is the public planning size (with a validation split n (1 - f): Task.planning_size);
    # the validation score is one more release, composed sequentially with the steps
    sigma_v = validation_noise_multiplier(cfg) if has_validation_split(cfg) else None
    final = (validation_mechanism(sigma_v, relation),) if sigma_v is not None else ()
    parallel = bool(final) and str(p.get("validation_composition", "sequential")) == "parallel"
    calibrated_with = () if parallel else final  # parallel: training alone must meet the target

    def planned_for(sigma: float, derived=None) -> Callable[[int], list[GaussianMechanism]]:
        return lambda step: algo_cls.declared_mechanisms(cfg.algo, sigma, sample_rate, step, clip_norm, relation,
                                                         derived=derived)

    if not accountant.upper_bound:
        notes.append(
            f"accountant={accountant.name} is an approximation, not an upper bound: the reported epsilon "
            "may be below the true one (use pld, prv or rdp for a bound)"
        )
    if p.noise_multiplier is not None:
        sigma, target = float(p.noise_multiplier), None
    elif steps == 0:  # zero-shot evaluation: nothing is released, nothing to calibrate
        sigma, target = math.inf, None
    else:
        if not accountant.upper_bound and not p.get("allow_approximate_accountant", False):
            raise UserError(
                f"accountant={accountant.name} can under-report epsilon, so it does not calibrate sigma; "
                "use accountant=pld, prv or rdp, or set privacy.allow_approximate_accountant=true"
            )
        target = target_epsilon(cfg)  # privacy.epsilon, or the default target when neither is given
        if parallel:
            score_alone = accountant.epsilon(ledger_of_plan(lambda step: [], 0, None, final), float(p.delta))
            if score_alone > target:
                raise UserError(f"the validation score alone (noise multiplier {sigma_v:g}) costs epsilon={score_alone:.3f}, "
                                f"above privacy.epsilon={target}: raise privacy.validation_noise_multiplier")
        if algo_cls.calibrate_noise is not None:  # an algorithm that calibrates several noises itself
            calibration = Calibration(accountant, steps, sample_rate, clip_norm, relation, per_epoch, calibrated_with)
            sigma, derived = algo_cls.calibrate_noise(cfg.algo, calibration, target, float(p.delta))
        else:
            sigma = calibrate_noise_multiplier(
                accountant, lambda s: ledger_of_plan(planned_for(s), steps, per_epoch, calibrated_with), target,
                float(p.delta))
    if p.delta >= 1 / train_size:
        notes.append(f"privacy.delta={p.delta} is not below 1/n = {1 / train_size:.2e}; such a delta allows leaking a record")
    if per_epoch is not None:
        notes.append(
            f"privacy.sampling=shuffle: epsilon is the bound for shuffled fixed-size batches without amplification: "
            f"each example is in one of the {per_epoch} batches of each epoch, so each epoch is charged one full-batch "
            "Gaussian (its least noisy step) at sensitivity 2C, whatever the order (Chua et al., ICML 2024); "
            "the ledger lists these epoch mechanisms (sample_rate 1)"
        )
    log_private_stats = bool(p.get("log_private_stats", True))
    setup = PrivacySetup(
        noise_multiplier=sigma,
        clip_norm=clip_norm,
        expected_batch_size=sample_rate * train_size,
        sample_rate=sample_rate,
        noise=GaussianNoise(device, secure=bool(p.secure_rng)),
        clipping=p.clipping,
        clipping_gamma=float(p.clipping_gamma),
        per_layer_thresholds=str(p.get("per_layer_thresholds", "equal")),
        neighboring=relation,
        derived=derived,
    )
    planned = planned_for(sigma, derived)
    if math.isfinite(sigma) and steps > 0:  # a fixed sigma too: one loss-grid interval, chosen for the whole run
        accountant.settle_for(ledger_of_plan(planned, steps, per_epoch, final), float(p.delta))
    plan = PrivacyPlan(accountant, float(p.delta), setup, target, planned, log_private_stats, notes, sampling, per_epoch,
                       steps, OmegaConf.to_container(cfg.algo, resolve=True, enum_to_str=True), final, sigma_v,
                       parallel)
    if sigma_v is not None:
        plan.note(f"dataset.validation_fraction={cfg.dataset.validation_fraction}: the final model's validation score "
                  f"is released with Gaussian noise (std {sigma_v:g} on the count, privacy.validation_noise_multiplier), "
                  + ("composed in parallel with training (disjoint parts, add/remove: epsilon is the larger of the two)"
                     if parallel else "composed sequentially with training in epsilon"))
    for note in algo_cls.privacy_notes(cfg.algo):
        plan.note(note)
    return plan
