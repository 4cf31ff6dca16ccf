"""Reading results.json files into one flat `RunRow` each (through the `RunResults` contract, so
files of every schema version read the same; keys an old file lacks are None), and the audit.json
that `dpbench-audit` writes into its run folder into one `AuditRow` each (its lower bound on ε and
ceiling join the RunRow of the same folder)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from dpbench.runtime import metering
from dpbench.logging.console import console
from dpbench.logging.results import RESULTS_FILE, RunResults
from dpbench.study.publish import PRIVATE_DIR

MIB = 2**20
AUDIT_FILE = "audit.json"        # what dpbench-audit writes (dpbench.tools.audit.report.AuditReport.to_json)
DEFAULT_ENGINE = "materialize"   # algo.per_sample when a method name carries no engine


def flatten(tree, prefix: str = "") -> dict:
    """{'a': {'b': 1}} -> {'a.b': 1}; lists become tuples so values are hashable."""
    if not isinstance(tree, dict):
        return {prefix: tuple(tree) if isinstance(tree, list) else tree}
    out = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = _hashable(value)
    return out


def _hashable(value):
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def model_label(results: RunResults, config: dict) -> str | None:
    """'vit-base', 'opt-1.3b', 'tanh_cnn': the model name plus its size when the config has one."""
    name = results.model or (config.get("model") or {}).get("name")
    size = (config.get("model") or {}).get("size")
    return f"{name}-{size}" if name and size else name


@dataclass
class RunRow:
    """One run as the report sees it. Every figure may be None (not measured, or an old file).
    Rows also read like dicts (`row["final"]`, `row.get("epsilon")`, `{**row}`): the quantities
    of `report.expect` and the statistics of a group are looked up by name."""

    path: str
    algo: str | None = None
    dataset: str | None = None
    model: str | None = None
    seed: int | None = None
    status: str | None = None
    private: bool = False
    target_epsilon: float | None = None
    epsilon: float | None = None          # spent (None for a non-private run)
    steps: int | None = None
    planned_steps: int | None = None
    accountant: str | None = None
    sampling: str | None = None
    unproven_sampling: bool = False  # a shuffled run from before schema 4 (Poisson accountant's epsilon)
    unproven_bound: bool = False  # a run whose notes say its epsilon is not a proven bound (e.g. tail_clip)
    clipping: str | None = None
    metric_name: str = "accuracy"         # what final/best hold: accuracy, f1, ...
    final: float | None = None
    best: float | None = None
    batch_size: int | None = None
    train_size: int | None = None         # n, from the sample rate q = B / n of a private run
    peak_mib: float | None = None         # absolute peak (max reserved on CUDA, peak RSS on the CPU)
    run_mib: float | None = None          # peak minus the resident size at the start of the run
    own_mib: float | None = None          # the run's own peak: allocated on CUDA, peak - start on the CPU
    memory_kind: str | None = None
    memory_warmed_up: bool | None = None  # the job's imports ran before the meter's reset (runtime/warmup.py)
    per_sample_grad_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    samples_per_s: float | None = None
    wall_s: float | None = None  # the run's wall time (whole job: model, cache, steps, evaluations)
    # training compute in forward-pass equivalents (an example's forward 1, its backward 2; schema 9):
    # measured (None where log_private_stats=false withheld it) and planned (the algorithm's declaration)
    forward_equivalents: float | None = None
    compute_per_example: float | None = None
    planned_forward_equivalents: float | None = None
    planned_per_example: float | None = None
    compute_budget: float | None = None  # train.compute_budget: per training example, it set the steps
    device: str | None = None
    paper_accounting: bool = False
    validation: float | None = None  # noisy validation score (dataset.validation_fraction > 0), a fraction
    # the audit.json of the run's folder (None: not audited; the bounds also None for a checks-only audit)
    audit_claimed_epsilon: float | None = None      # the accountant's ε as the one-run audit read it
    audit_epsilon_lower_bound: float | None = None  # the one-run audit's empirical lower bound on ε
    audit_ceiling: float | None = None              # the most that audit could certify
    audit_passed: bool | None = None
    audit_failed_checks: tuple[str, ...] = ()
    report: dict = field(default_factory=dict)
    algo_config: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the resolved config, flattened ('train.lr': ...)

    def __getitem__(self, name: str):
        return getattr(self, name)

    def get(self, name: str, default=None):
        return getattr(self, name, default)

    def keys(self) -> list[str]:  # with __getitem__: `{**row}` and `dict(row)` work
        return [f.name for f in fields(self)]


@dataclass
class AuditRow:
    """One audit.json: the self-audit's verdict, and for a one-run canary audit (key `one_run`) its
    lower bound on ε beside the ε the accountant claims. Every figure may be None."""

    path: str
    algo: str | None = None
    model: str | None = None
    dataset: str | None = None
    passed: bool = False
    checks: tuple[str, ...] = ()          # the names of its checks, in order
    failed_checks: tuple[str, ...] = ()
    one_run: bool = False
    claimed_epsilon: float | None = None
    epsilon_lower_bound: float | None = None
    ceiling: float | None = None
    canaries: int | None = None
    guesses: int | None = None
    correct: int | None = None
    confidence: float | None = None
    delta: float | None = None
    with_results: bool = False            # its folder holds a results.json too (the run's row carries it)

    @property
    def verdict(self) -> str:
        """'passed' or 'FAILED: <the failed checks>'; a checks-only audit also counts its checks."""
        counted = not self.one_run and self.checks
        if self.passed:
            return "passed" + (f" ({len(self.checks)} checks)" if counted else "")
        return ("FAILED" + (f" ({len(self.failed_checks)} of {len(self.checks)} checks)" if counted else "")
                + (f": {', '.join(self.failed_checks)}" if self.failed_checks else ""))


def _number(value, kind=float):
    return None if value is None else kind(value)


def audit_row(path: Path, folder: Path, data) -> AuditRow:
    """One AuditRow per audit.json; keys beyond algo, model, dataset, passed, checks (and one_run's
    figures) are ignored, and a missing one is None. Malformed content raises TypeError/ValueError."""
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    checks = data.get("checks") or []
    if not isinstance(checks, list) or not all(isinstance(c, dict) for c in checks):
        raise TypeError("'checks' is not a list of objects")
    names = tuple(str(c.get("name")) for c in checks)
    failed = tuple(str(c.get("name")) for c in checks if c.get("passed") is False)
    passed = data.get("passed")
    one_run = data.get("one_run")
    if one_run is not None and not isinstance(one_run, dict):
        raise TypeError("'one_run' is not an object")
    figures = one_run or {}
    return AuditRow(
        path=str(path.parent.relative_to(folder)) or ".",
        algo=data.get("algo"), model=data.get("model"), dataset=data.get("dataset"),
        passed=bool(passed) if passed is not None else not failed,
        checks=names, failed_checks=failed, one_run=one_run is not None,
        claimed_epsilon=_number(figures.get("claimed_epsilon")),
        epsilon_lower_bound=_number(figures.get("epsilon_lower_bound")),
        ceiling=_number(figures.get("ceiling")),
        canaries=_number(figures.get("canaries"), int),
        guesses=_number(figures.get("guesses"), int),
        correct=_number(figures.get("correct"), int),
        confidence=_number(figures.get("confidence")),
        delta=_number(figures.get("delta")),
    )


def _has_engines(algo: str | None) -> bool:
    """Whether the algorithm has a choice of per-example engine (algo.per_sample) at all."""
    from dpbench.schema import algo_schemas  # the typed options of every algorithm

    schema = algo_schemas().get(algo)
    return schema is None or "per_sample" in {f.name for f in fields(schema)}


def method_name(row: RunRow) -> str:
    """'grape', 'dpadam' (materialised), 'dpadam_ghost', 'dpadam_bk', ...; 'dpadam_probe' for the
    frozen-encoder linear probe (model.trained_blocks=0: the head alone trains); '..._zero_shot' for a head
    started from the label descriptions (model.head_init=zero_shot)."""
    engine = row.algo_config.get("per_sample")
    name = str(row.algo)
    if engine and engine != DEFAULT_ENGINE and _has_engines(row.algo):
        name = f"{name}_{engine}"
    name = f"{name}_probe" if row.config.get("model.trained_blocks") == 0 else name
    return f"{name}_zero_shot" if row.config.get("model.head_init") == "zero_shot" else name


def own_peak_bytes(results: RunResults) -> int | None:
    """The run's own peak memory (dpbench.runtime.metering.own_peak_bytes: the rule of every table)."""
    return metering.own_peak_bytes(results.memory)


def unproven_sampling(privacy, config: dict) -> bool:
    """A private shuffled run from before schema 4: it reported the Poisson accountant's epsilon."""
    sampling = privacy.sampling or (config.get("privacy") or {}).get("sampling")
    return bool(privacy.is_private and privacy.bound is None and sampling not in (None, "poisson"))


def unproven_bound(results: RunResults) -> bool:
    """The run noted that its epsilon is not a proven bound (DC-DPSGD's paper accounting, tail_clip)."""
    return any("not a proven bound" in note and "sampling" not in note for note in results.notes or [])


def run_row(path: Path, folder: Path, results: RunResults) -> RunRow:
    """One flat record per results.json; every key may be missing in old files (then None)."""
    config = results.config or {}
    figures, privacy = results.summary(), results.privacy
    private = figures["privacy/private"]
    peak, start, own = figures["memory/peak_bytes"], figures["memory/start_bytes"], own_peak_bytes(results)
    return RunRow(
        path=str(path.parent.relative_to(folder)) or ".",
        algo=results.algo or (config.get("algo") or {}).get("name"),
        dataset=results.dataset or (config.get("dataset") or {}).get("name"),
        model=model_label(results, config),
        seed=results.seed if results.seed is not None else config.get("seed"),
        status=figures["status"],
        private=private,
        target_epsilon=privacy.target_epsilon if private else None,
        epsilon=figures["privacy/epsilon"] if private else None,
        steps=privacy.steps,
        planned_steps=privacy.planned_steps if privacy.planned_steps is not None else privacy.steps,
        accountant=privacy.accountant,
        sampling=privacy.sampling or (config.get("privacy") or {}).get("sampling"),
        unproven_sampling=unproven_sampling(privacy, config),
        unproven_bound=unproven_bound(results),
        clipping=(config.get("privacy") or {}).get("clipping"),
        metric_name=results.metrics.metric or "accuracy",
        final=figures["test/accuracy"],
        validation=results.metrics.validation_score,  # the final model's noisy validation score (schema 5)
        best=figures["test/best_accuracy"],
        batch_size=(config.get("train") or {}).get("batch_size"),
        train_size=round(privacy.expected_batch_size / privacy.sample_rate) if privacy.expected_batch_size and privacy.sample_rate else None,
        peak_mib=peak / MIB if peak is not None else None,
        run_mib=(peak - start) / MIB if peak is not None and start is not None else None,
        own_mib=own / MIB if own is not None else None,
        memory_kind=figures["memory/kind"],
        memory_warmed_up=results.memory.warmed_up,
        per_sample_grad_bytes=figures["memory/per_sample_grad_bytes"],
        optimizer_state_bytes=figures["memory/optimizer_state_bytes"],
        samples_per_s=figures["throughput/samples_per_s"],
        wall_s=figures["throughput/wall_s"],
        forward_equivalents=results.compute.forward_equivalents,
        compute_per_example=results.compute.per_example,
        planned_forward_equivalents=results.compute.planned_forward_equivalents,
        planned_per_example=results.compute.planned_per_example,
        compute_budget=results.compute.budget,
        device=(results.versions or {}).get("device"),
        paper_accounting=bool((config.get("algo") or {}).get("paper_accounting")),
        report=config.get("report") or {},
        algo_config=config.get("algo") or {},
        config=flatten(config) if config else {},
    )


def with_audit(row: RunRow, audit: AuditRow) -> RunRow:
    """The run's row with the figures of the audit.json beside its results.json."""
    audit.with_results = True
    row.audit_claimed_epsilon, row.audit_epsilon_lower_bound = audit.claimed_epsilon, audit.epsilon_lower_bound
    row.audit_ceiling, row.audit_passed, row.audit_failed_checks = audit.ceiling, audit.passed, audit.failed_checks
    return row


def load_audits(folder: Path) -> list[AuditRow]:
    """One AuditRow per audit.json under `folder`, by path (unreadable files are reported and skipped)."""
    audits = []
    for path in sorted(folder.rglob(AUDIT_FILE)):
        try:
            audits.append(audit_row(path, folder, json.loads(path.read_text())))
        except (OSError, ValueError, TypeError, AttributeError) as error:  # JSONDecodeError is a ValueError
            console.print(f"[yellow]warning:[/] skipping {path}: {error}")
    return audits


def load_report(folder: Path) -> tuple[list[RunRow], list[AuditRow]]:
    """The runs under `folder` (one row per results.json, with the audit.json of its folder when there
    is one) and every audit (one row per audit.json: those without a results.json have no run row)."""
    audits = load_audits(folder)
    by_folder = {audit.path: audit for audit in audits}
    rows = []
    for path in sorted(folder.rglob(RESULTS_FILE)):
        if PRIVATE_DIR in path.relative_to(folder).parts:  # a study's unselected trials: outside its epsilon
            continue
        try:
            results = RunResults.from_json(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, TypeError, AttributeError) as error:
            console.print(f"[yellow]warning:[/] skipping {path}: {error}")
            continue
        row = run_row(path, folder, results)
        rows.append(with_audit(row, by_folder[row.path]) if row.path in by_folder else row)
    return sorted(rows, key=lambda r: (str(r.algo), r.batch_size or 0, r.epsilon or 0.0)), audits


def load_rows(folder: Path) -> list[RunRow]:
    """One row per results.json under `folder` (unreadable files are reported and skipped)."""
    return load_report(folder)[0]
