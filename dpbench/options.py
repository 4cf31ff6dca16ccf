"""The option vocabulary of dpbench's config: choices and the dataclasses that type conf/*.yaml.

A leaf: it imports the registries its choices are generated from (clipping rules, accountants,
neighbouring relations, precisions) and nothing that imports it back, so an algorithm's module can
declare its options here-derived (`class GrapeOptions(AlgoOptions)`) without a cycle. The Hydra
machinery that stores these in the ConfigStore and checks a composed config is dpbench/schema.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, Iterable, List, Optional

from omegaconf import MISSING

from dpbench.precision import DTYPES
from dpbench.privacy.accountants import ACCOUNTANTS
from dpbench.privacy.clipping import CLIPPING_RULES, LAYER_THRESHOLDS
from dpbench.privacy.mechanisms import NEIGHBORING_RELATIONS


class Choice(str, Enum):
    """A choice-valued key. Hydra rejects any other value at composition; a member is its plain
    string everywhere else (==, dict lookups, f-strings, results.json), so code compares
    `cfg.privacy.clipping == "flat"` and never sees the enum."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)


def choice_of(name: str, values: Iterable[str], module: str) -> type[Choice]:
    """The Choice named `name` whose members are `values` (the names of a registry), defined in
    `module` (as `Name = choice_of("Name", ..., __name__)` there: copies and pickles find it)."""
    return Choice(name, [(value, value) for value in sorted(values)], module=module, qualname=name)


# From the registries they select from: a rule, accountant or relation added there is a choice here.
Clipping = choice_of("Clipping", CLIPPING_RULES, __name__)
LayerThresholds = choice_of("LayerThresholds", LAYER_THRESHOLDS, __name__)  # privacy.clipping=per_layer's C_l
AccountantName = choice_of("AccountantName", ACCOUNTANTS.names(), __name__)
Neighboring = choice_of("Neighboring", NEIGHBORING_RELATIONS, __name__)
PrecisionName = choice_of("PrecisionName", DTYPES, __name__)  # the forward's autocast dtype
# dpbench-audit audit.one_run=true: white-box canaries in the clipped sum, or mislabeled input examples
CanaryKind = choice_of("CanaryKind", ("gradient", "input"), __name__)
# report.selected_on: what a preset's hyperparameters were chosen on (test: flagged by dpbench-report)
SelectedOn = choice_of("SelectedOn", ("test", "validation", "none"), __name__)


# No registry to generate these from: members named as users type them.
class LrFamily(Choice):  # an update's scale: which entry of a data set's train_defaults.lr applies
    adam = "adam"                  # Adam-like: steps of about lr whatever the gradient's size
    sgd = "sgd"                    # SGD-like: steps of lr x the (clipped, noisy) gradient
    zeroth_order = "zeroth_order"  # two-point estimates along random directions (DPZero, MeZO)


class ValidationComposition(Choice):  # dpbench/privacy/plan.py PrivacyPlan.epsilon
    sequential = "sequential"
    parallel = "parallel"


class Sampling(Choice):  # dpbench/privacy/sampling.py build_sampler
    poisson = "poisson"
    shuffle = "shuffle"


class Device(Choice):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Sharding(Choice):  # dpbench/runtime/sharding.py
    none = "none"
    fsdp = "fsdp"


class WandbMode(Choice):
    disabled = "disabled"
    offline = "offline"
    online = "online"


class ReportMetric(Choice):
    best = "best"
    final = "final"


# ---------------------------------------------------------------------------- top level


@dataclass
class PrivacyOptions:
    epsilon: Optional[float] = None  # null: dpbench.run_config.DEFAULT_EPSILON unless noise_multiplier is set
    delta: float = 1.0e-5
    noise_multiplier: Optional[float] = None
    clip_norm: float = 1.0
    clipping: Clipping = Clipping.flat
    clipping_gamma: float = 0.01
    per_layer_thresholds: LayerThresholds = LayerThresholds.equal
    sampling: Sampling = Sampling.poisson
    neighboring: Neighboring = Neighboring.add_remove
    secure_rng: bool = False
    log_private_stats: bool = True
    allow_approximate_accountant: bool = False
    # sigma_v: noise std on the validation count (dataset.validation_fraction > 0), sensitivity 1
    validation_noise_multiplier: float = 10.0
    # how the validation score composes with training: sequential (always valid), or parallel (add/remove
    # only: the parts are disjoint, so epsilon is the larger of the two parts')
    validation_composition: ValidationComposition = ValidationComposition.sequential


@dataclass
class TrainOptions:
    batch_size: int = 256
    physical_batch_size: Optional[int] = None
    epochs: Optional[float] = 30.0  # fractional epochs are allowed
    steps: Optional[int] = None
    # forward-pass equivalents per training example (3: an epoch of forward and backward); set, it
    # sets the steps from the algorithm's declared cost per example (algorithms/compute.py)
    compute_budget: Optional[float] = None
    lr: float = 2.0e-2
    head_lr_scale: float = 1.0  # the declared head's learning rate / lr (algorithms/learning_rates.py)
    precision: PrecisionName = PrecisionName.fp32
    eval_every: int = 20
    train_eval_size: int = 0
    checkpoint: bool = True  # checkpoint.pt after each evaluation, so that a rerun resumes (false: none)
    checkpoint_every: Optional[int] = None
    sharding: Sharding = Sharding.none
    evaluate_test: bool = True  # false: no test evaluation; the final model is saved (model.safetensors)
    save_model: bool = True  # model.safetensors at the end of a completed run


@dataclass
class AuditOptions:
    batch: int = 8
    noise_steps: int = 5
    sensitivity_steps: int = 2
    trials: int = 6
    loss_scale: float = 1.0e4
    alpha: float = 1.0e-3
    one_run: bool = False
    canaries: int = 1000
    guesses: int = 800
    confidence: float = 0.95
    canary: CanaryKind = CanaryKind.gradient
    seeded_bug: Optional[str] = None


@dataclass
class ReportOptions:
    paper: Optional[str] = None
    table: Optional[str] = None
    column: Optional[str] = None
    compare_as: Dict[str, Any] = field(default_factory=dict)
    metric: ReportMetric = ReportMetric.final
    expect: List[str] = field(default_factory=list)
    selected_on: Optional[SelectedOn] = None
    # a tuned benchmark's paper-hyperparameter counterpart (its multirun folder): the leaderboard of
    # private studies shows each method's rank there beside its tuned rank
    compare_with: Optional[str] = None


@dataclass
class AccountantOptions:
    name: AccountantName = MISSING


@dataclass
class LoggerOptions:
    name: str = "none"


@dataclass
class WandbOptions(LoggerOptions):
    name: str = "wandb"
    mode: WandbMode = WandbMode.offline
    project: str = "dpbench"
    entity: Optional[str] = None
    group: Optional[str] = None
    run_name: Optional[str] = None
    log_every: int = 10


@dataclass
class AlgoOptions:
    """What every algorithm's options share; each algorithm derives its own."""

    name: str = MISSING
    # What `dpbench algo=X` trains with unless told otherwise (conf/config.yaml): train.lr is, in
    # order, the command line's, the data set's train_defaults.lr (one rate, or one per lr_family),
    # then default_lr; privacy.clip_norm is the command line's, then default_clip_norm. Each
    # algorithm's YAML says where its values come from (its paper, or digits' validation part).
    default_lr: float = 2.0e-2
    lr_family: LrFamily = LrFamily.adam
    default_clip_norm: float = 1.0
    # The budget where neither the command line nor the data set's train_defaults gives one:
    # train.steps = default_steps (train.epochs is then null) and train.batch_size =
    # default_batch_size; None: 30 epochs at B = 256 (conf/config.yaml). Zeroth-order methods
    # declare their papers' many cheap steps.
    default_steps: Optional[int] = None
    default_batch_size: Optional[int] = None


@dataclass
class Config:
    name: str = "default"
    seed: int = 0
    device: Device = Device.auto
    resume: bool = True
    threads: Optional[int] = None
    optimize: str = "test_accuracy"
    report: ReportOptions = field(default_factory=ReportOptions)
    privacy: PrivacyOptions = field(default_factory=PrivacyOptions)
    audit: AuditOptions = field(default_factory=AuditOptions)
    train: TrainOptions = field(default_factory=TrainOptions)
    dataset: Any = MISSING  # plain YAML: see the module docstring
    model: Any = MISSING
    algo: AlgoOptions = MISSING
    accountant: AccountantOptions = MISSING
    logger: LoggerOptions = MISSING
    paper_setting: Any = None  # lookup tables of paper presets (conf/experiment), read by interpolation
    # a private study's search space, {key: "tag(log, interval(a, b))" | "choice(a, b)" | ...}, read by
    # hydra/sweeper=private_search beside its params and the command line (a tuned preset: one per algo)
    search_space: Any = None


DEFAULT_EPSILON = 8.0


def target_epsilon(cfg) -> float | None:
    """The epsilon a private run's sigma is calibrated to: privacy.epsilon, DEFAULT_EPSILON when
    neither it nor privacy.noise_multiplier is given, None when sigma is given (epsilon is computed)."""
    p = cfg.privacy
    if p.noise_multiplier is not None:
        return None
    return DEFAULT_EPSILON if p.epsilon is None else float(p.epsilon)
