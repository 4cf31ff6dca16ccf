"""results.json: the contract that reports, resumption, the console, W&B and checks read.

`RunResults` is the one definition of its keys: one typed section per block of the file, with
`to_json()` (the file as written), `from_json()` (any version, missing keys read as None) and a
flat `summary()` under the names W&B shows ("test/accuracy", "privacy/epsilon", ...), which the
console table, the W&B run summary and `dpbench-report` read. The file itself is written
atomically.

Schema versions (add keys; never rename them, so that old runs stay readable):
  1  no `schema_version` key.
  2  privacy.epsilon_is_upper_bound, requested_accountant, log_private_stats; versions extended.
  3  throughput.world_size (processes of a data-parallel run; samples_per_s counts all of them);
     resumed_from_step (the checkpoint step a resumed run continued from; null: one go).
  4  privacy.bound (which bound epsilon is: poisson_subsampled_gaussian, or
     full_batch_gaussian_per_epoch for shuffled batches) and privacy.batches_per_epoch (shuffled).
  5  with a validation split (dataset.validation_fraction > 0): metrics.validation_score (the final
     model's noisy validation score), metrics.validation_size (its public divisor n f) and
     privacy.validation_noise_multiplier (sigma_v, private runs); saved_model_test (the test metrics
     `dpbench.api.evaluate_saved` wrote for a run with train.evaluate_test=false); throughput.sharding
     (fsdp for a run with train.sharding=fsdp, whose memory figures are rank 0's shards). Each is
     written only when it has a value, so a run without them keeps version 4's keys.
  6  privacy.validation_composition (sequential | parallel: how the noisy validation score composes
     with training in epsilon; private runs with a validation split only).
  7  epsilon_covers: {"covered": [...], "outside_epsilon": [...]}, which of the file's figures that
     depend on the data epsilon covers (`epsilon_covers`): the releases (noisy, or post-processing of
     the trained model), and the un-noised statistics, listed (outside) only when they are written.
  8  privacy.dp_events (the ledger as dp-accounting events a third party re-accounts:
     dpbench/privacy/events.py), privacy.epsilon_lower / epsilon_upper (the bounds the accountant
     gives: pld optimistic / pessimistic, prv's error bounds) and privacy.pld_interval (the pld loss
     grid's interval); private runs only.
  9  compute: the training's forward-pass equivalents (dpbench/algorithms/compute.py), measured
     (un-noised: realised batch sizes) and planned (the algorithm's declaration, public), and
     compute.budget (train.compute_budget, when set). An older file reads as unknown (None).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

from dpbench.paths import atomic_write

RESULTS_FILE = "results.json"
SCHEMA_VERSION = 9

_OMIT_IF_NONE = "omit_if_none"
_FIGURE = "figure"  # what a data-dependent key is: RELEASE (epsilon covers it) or UNNOISED (it does not)
RELEASE, UNNOISED = "release", "unnoised"


def _only_when_known():
    """A key written only when it has a value (the file has no accountant for a non-private run,
    no CUDA allocator figure for a CPU run): files keep exactly the keys they always had."""
    return field(default=None, metadata={_OMIT_IF_NONE: True})


def _figure(kind: str, omit_if_none: bool = False):
    """A key computed from the private data: RELEASE (noisy, or post-processing of the trained
    model: epsilon covers it) or UNNOISED (written only with privacy.log_private_stats)."""
    return field(default=None, metadata={_FIGURE: kind, _OMIT_IF_NONE: omit_if_none})


@dataclass(kw_only=True)
class Section:
    """One block of results.json: its keys are the fields; keys this version does not know (a
    file from a newer dpbench) are kept in `extra` and written back unchanged."""

    extra: dict = field(default_factory=dict)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "extra"]

    def to_json(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "extra" or (value is None and f.metadata.get(_OMIT_IF_NONE)):
                continue
            out[f.name] = _section_to_json(value)
        return {**out, **self.extra}

    @classmethod
    def from_json(cls, data: dict | None):
        data = data or {}
        known = cls.keys()
        values = {name: data[name] for name in known if name in data}
        for f in fields(cls):  # nested sections read their own block
            section = _SECTIONS.get(f.name)
            if section is not None and f.name in known:
                values[f.name] = section.from_json(data.get(f.name))
            record = _RECORD_LISTS.get(f.name)  # lists of records read each record
            if record is not None and values.get(f.name) is not None:
                values[f.name] = [record.from_json(item) for item in values[f.name]]
        return cls(**values, extra={k: v for k, v in data.items() if k not in known})


def _section_to_json(value):
    if isinstance(value, Section):
        return value.to_json()
    if isinstance(value, list):
        return [item.to_json() if isinstance(item, Section) else item for item in value]
    return value


@dataclass(kw_only=True)
class PrivacyResults(Section):
    """The privacy of what ran: the epsilon of the mechanisms in `ledger`, composed by `accountant`."""

    private: bool | None = None
    epsilon: float | None = None
    epsilon_is_upper_bound: bool | None = _only_when_known()  # false for approximate accountants (gdp)
    target_epsilon: float | None = None
    delta: float | None = None
    noise_multiplier: float | None = None
    clip_norm: float | None = None
    sample_rate: float | None = None
    expected_batch_size: float | None = None
    steps: int | None = None
    planned_steps: int | None = None
    accountant: str | None = None  # the accountant that computed epsilon
    requested_accountant: str | None = _only_when_known()  # the one configured (they differ on a fallback)
    neighboring: str | None = None
    log_private_stats: bool | None = _only_when_known()
    ledger: list | None = None
    sampling: str | None = None
    bound: str | None = _only_when_known()  # privacy.plan.BOUNDS: the bound epsilon is (private runs)
    batches_per_epoch: int | None = _only_when_known()  # shuffled batches: one epoch's (its ledger's unit)
    validation_noise_multiplier: float | None = _only_when_known()  # sigma_v: noise std on the validation count
    validation_composition: str | None = _only_when_known()  # sequential | parallel (privacy.validation_composition)
    epsilon_lower: float | None = _only_when_known()  # a lower bound where the accountant gives one (pld, prv)
    epsilon_upper: float | None = _only_when_known()  # its upper bound (epsilon, for the bounds rdp, prv, pld)
    pld_interval: float | None = _only_when_known()  # the pld loss grid's interval epsilon was computed at
    dp_events: dict | None = _only_when_known()  # the ledger as dp-accounting events (dpbench.privacy.events)

    @property
    def is_private(self) -> bool:
        """Version 1 files may lack `private`: a run with an epsilon was private."""
        return bool(self.private if self.private is not None else self.epsilon is not None)


@dataclass(kw_only=True)
class MetricsResults(Section):
    metric: str | None = None  # what test_accuracy holds: accuracy, f1, ...
    test_accuracy: float | None = _figure(RELEASE)
    best_test_accuracy: float | None = _figure(RELEASE)
    train_loss: float | None = _figure(UNNOISED)
    test_loss: float | None = _figure(RELEASE)
    train_accuracy: float | None = _figure(UNNOISED)  # un-noised: only with privacy.log_private_stats
    # with a validation split: (sum of per-example scores in [0, 1] + N(0, sigma_v^2)) / validation_size,
    # of the final model, computed once (noiseless for a non-private run)
    validation_score: float | None = _figure(RELEASE, omit_if_none=True)
    validation_size: int | None = _only_when_known()  # the public divisor n - round(n (1 - f)), about n f


@dataclass(kw_only=True)
class MemoryResults(Section):
    peak_bytes: int | None = None
    kind: str | None = None  # what peak_bytes measures (cpu_peak_rss, cuda_max_reserved, ...)
    cuda_max_allocated: int | None = _only_when_known()
    start_bytes: int | None = None
    warmed_up: bool | None = None  # runtime/warmup.py ran before the meter's reset (None: a run from before it)
    per_sample_grad_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    parameter_bytes: int | None = None


@dataclass(kw_only=True)
class ThroughputResults(Section):
    samples_per_s: float | None = None  # over all processes of a data-parallel run
    measured_steps: int | None = None
    wall_s: float | None = None
    world_size: int | None = None  # processes that trained (set by the run; None before version 3)
    sharding: str | None = _only_when_known()  # fsdp: parameters and optimizer state sharded (train.sharding)


@dataclass(kw_only=True)
class ComputeResults(Section):
    """What training spent in forward-pass equivalents: an example's forward 1, its backward 2
    (dpbench/algorithms/compute.py), counted as the passes ran, never from wall time."""

    forward_equivalents: float | None = None  # over the steps that ran: forwards + 2 backwards
    per_example: float | None = None  # forward_equivalents / examples
    forwards: int | None = None  # examples forwarded (a recomputed chunk twice, a zeroth-order step's two)
    backwards: int | None = None  # examples backpropagated (ghost clipping's second backward again)
    examples: int | None = None  # examples of the logical batches trained on, each once
    planned_per_example: float | None = None  # the algorithm's declaration for this config (public)
    planned_forward_equivalents: float | None = None  # planned_per_example x expected batch size x planned steps
    budget: float | None = _only_when_known()  # train.compute_budget: per training example, it set the steps


@dataclass(kw_only=True)
class EvalRecord(Section):
    """One evaluation: a record of `history`, what the trainer hands its callbacks (console, W&B)."""

    step: int | None = None
    train_loss: float | None = _figure(UNNOISED)  # mean over the steps since the last evaluation (None: not reported)
    test_accuracy: float | None = _figure(RELEASE)  # the task's headline metric (metrics.metric says which)
    test_loss: float | None = _figure(RELEASE)
    epsilon: float | None = None  # spent so far (None: a non-private run)
    train_accuracy: float | None = _figure(UNNOISED, omit_if_none=True)  # un-noised: only with privacy.log_private_stats


_SECTIONS: dict[str, type[Section]] = {
    "privacy": PrivacyResults, "metrics": MetricsResults, "memory": MemoryResults, "throughput": ThroughputResults,
    "compute": ComputeResults,
}
_RECORD_LISTS: dict[str, type[Section]] = {"history": EvalRecord}  # keys holding a list of records

# The flat summary: W&B name -> (section, key). The step logs use the same names.
SUMMARY_KEYS = {
    "test/accuracy": ("metrics", "test_accuracy"),
    "test/best_accuracy": ("metrics", "best_test_accuracy"),
    "test/loss": ("metrics", "test_loss"),
    "validation/score": ("metrics", "validation_score"),  # noisy, once on the final model (a validation split)
    "train/loss": ("metrics", "train_loss"),
    "privacy/epsilon": ("privacy", "epsilon"),
    "privacy/epsilon_is_upper_bound": ("privacy", "epsilon_is_upper_bound"),
    "privacy/delta": ("privacy", "delta"),
    "privacy/noise_multiplier": ("privacy", "noise_multiplier"),
    "memory/peak_bytes": ("memory", "peak_bytes"),
    "memory/start_bytes": ("memory", "start_bytes"),
    "memory/kind": ("memory", "kind"),
    "memory/per_sample_grad_bytes": ("memory", "per_sample_grad_bytes"),
    "memory/optimizer_state_bytes": ("memory", "optimizer_state_bytes"),
    "throughput/samples_per_s": ("throughput", "samples_per_s"),
    "throughput/wall_s": ("throughput", "wall_s"),
    "compute/forward_equivalents": ("compute", "forward_equivalents"),
    "compute/per_example": ("compute", "per_example"),
    "compute/planned_forward_equivalents": ("compute", "planned_forward_equivalents"),
    "compute/planned_per_example": ("compute", "planned_per_example"),
}
# An evaluation record of `history` (the trainer's) under the same names.
EVAL_KEYS = {
    "test_accuracy": "test/accuracy", "test_loss": "test/loss", "train_loss": "train/loss",
    "train_accuracy": "train/accuracy", "epsilon": "privacy/epsilon",
}


def eval_summary(record: EvalRecord) -> dict:
    """One `history` record as W&B logs it (figures that were not measured are left out)."""
    figures = {name: getattr(record, key) for key, name in EVAL_KEYS.items()}
    return {name: value for name, value in figures.items() if value is not None}


@dataclass(kw_only=True)
class RunResults(Section):
    """The whole of results.json."""

    schema_version: int = SCHEMA_VERSION
    status: str | None = None  # completed | diverged
    algo: str | None = None
    model: str | None = None
    dataset: str | None = None
    seed: int | None = None
    privacy: PrivacyResults = field(default_factory=PrivacyResults)
    metrics: MetricsResults = field(default_factory=MetricsResults)
    memory: MemoryResults = field(default_factory=MemoryResults)
    throughput: ThroughputResults = field(default_factory=ThroughputResults)
    compute: ComputeResults = field(default_factory=ComputeResults)  # version 9
    resumed_from_step: int | None = None  # the checkpoint step it continued from (None: ran in one go)
    algorithm: dict | None = None  # the algorithm's own facts (extra_results)
    history: list[EvalRecord] | None = None  # one record per evaluation
    notes: list | None = None
    versions: dict | None = None  # provenance: packages, device, git commit, command line
    config: dict | None = None  # the resolved config of the run
    # test metrics of the saved final model (train.evaluate_test=false), by dpbench.api.evaluate_saved
    saved_model_test: dict | None = _figure(RELEASE, omit_if_none=True)
    # which data-dependent figures epsilon covers (version 7; `epsilon_covers` fills it)
    epsilon_covers: dict | None = _only_when_known()
    # the folder the run wrote (set by dpbench.api.run; not a key of the file: a path is the reader's)
    run_dir = None

    @classmethod
    def from_json(cls, data: dict | None) -> RunResults:
        results = super().from_json(data)
        if "schema_version" not in (data or {}):
            results.schema_version = 1
        return results

    def summary(self) -> dict:
        """The run's figures under their W&B names, plus its status and whether it was private."""
        figures = {name: getattr(getattr(self, section), key) for name, (section, key) in SUMMARY_KEYS.items()}
        return {"status": self.status, "privacy/private": self.privacy.is_private, **figures}


def _declared(kind: str) -> list[str]:
    """The keys declared `kind` (RELEASE or UNNOISED), as dotted paths ("history[].train_loss")."""
    keys = [f.name for f in fields(RunResults) if f.metadata.get(_FIGURE) == kind]
    for name, section in [*_SECTIONS.items(), *((f"{n}[]", s) for n, s in _RECORD_LISTS.items())]:
        keys += [f"{name}.{f.name}" for f in fields(section) if f.metadata.get(_FIGURE) == kind]
    return keys


def epsilon_covers(results: RunResults, log_private_stats: bool, unnoised_algorithm_keys=(),
                   private_statistic_figures: dict[str, tuple[str, ...]] | None = None) -> dict:
    """results.json's `epsilon_covers`, from the declarations: the RELEASE keys (and the algorithm's
    own facts but its `unnoised_results` and counters) are covered by a private run's epsilon; the
    UNNOISED keys, `private_statistic_figures` (privacy.plan.PRIVATE_STATISTIC_FIGURES, passed by
    the caller: this module imports nothing of the core) and the status (a run halts on a
    non-finite loss) are outside it, listed only when the run writes them (log_private_stats).
    A non-private run: nothing is covered."""
    PRIVATE_STATISTIC_FIGURES = private_statistic_figures or {}
    algorithm = sorted((results.algorithm or {}).keys())
    unnoised = set(unnoised_algorithm_keys)
    covered = [*_declared(RELEASE), *(f"algorithm.{k}" for k in algorithm if k not in unnoised)]
    outside = [*_declared(UNNOISED), *(f"{s}.{k}" for s, keys in PRIVATE_STATISTIC_FIGURES.items() for k in keys),
               *(f"algorithm.{k}" for k in algorithm if k in unnoised), "status"]
    if not results.privacy.is_private:
        return {"covered": [], "outside_epsilon": [*covered, *outside], "note": "a non-private run: no epsilon"}
    return {"covered": covered, "outside_epsilon": outside if log_private_stats else []}


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; null means "not measured"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def write_results(run_dir: Path, results: RunResults | dict) -> Path:
    """Write atomically: a reader sees the old file or the complete new one, never half of it."""
    if isinstance(results, RunResults):
        results = results.to_json()
    return atomic_write(Path(run_dir) / RESULTS_FILE,
                        lambda handle: json.dump(_jsonable(results), handle, indent=2, sort_keys=False))


def read_results(run_dir: Path) -> dict | None:
    """The results.json of a run folder as written (None when there is none); `RunResults.from_json`
    reads it as the contract."""
    path = Path(run_dir) / RESULTS_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())
