"""Reading results.json files into one flat `RunRow` each (through the `RunResults` contract, so
files of every schema version read the same; keys an old file lacks are None)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from dpbench import metering
from dpbench.logging.console import console
from dpbench.logging.results import RESULTS_FILE, RunResults

MIB = 2**20
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
    per_sample_grad_bytes: int | None = None
    optimizer_state_bytes: int | None = None
    samples_per_s: float | None = None
    device: str | None = None
    paper_accounting: bool = False
    report: dict = field(default_factory=dict)
    algo_config: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the resolved config, flattened ('train.lr': ...)

    def __getitem__(self, name: str):
        return getattr(self, name)

    def get(self, name: str, default=None):
        return getattr(self, name, default)

    def keys(self) -> list[str]:  # with __getitem__: `{**row}` and `dict(row)` work
        return [f.name for f in fields(self)]


def _has_engines(algo: str | None) -> bool:
    """Whether the algorithm has a choice of per-example engine (algo.per_sample) at all."""
    from dpbench.schema import algo_schemas  # the typed options of every algorithm

    schema = algo_schemas().get(algo)
    return schema is None or "per_sample" in {f.name for f in fields(schema)}


def method_name(row: RunRow) -> str:
    """'grape', 'dpadam' (materialised), 'dpadam_ghost', 'dpadam_bk', ..."""
    engine = row.algo_config.get("per_sample")
    if engine and engine != DEFAULT_ENGINE and _has_engines(row.algo):
        return f"{row.algo}_{engine}"
    return str(row.algo)


def own_peak_bytes(results: RunResults) -> int | None:
    """The run's own peak memory (dpbench.metering.own_peak_bytes: the rule of every table)."""
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
        best=figures["test/best_accuracy"],
        batch_size=(config.get("train") or {}).get("batch_size"),
        train_size=round(privacy.expected_batch_size / privacy.sample_rate) if privacy.expected_batch_size and privacy.sample_rate else None,
        peak_mib=peak / MIB if peak is not None else None,
        run_mib=(peak - start) / MIB if peak is not None and start is not None else None,
        own_mib=own / MIB if own is not None else None,
        memory_kind=figures["memory/kind"],
        per_sample_grad_bytes=figures["memory/per_sample_grad_bytes"],
        optimizer_state_bytes=figures["memory/optimizer_state_bytes"],
        samples_per_s=figures["throughput/samples_per_s"],
        device=(results.versions or {}).get("device"),
        paper_accounting=bool((config.get("algo") or {}).get("paper_accounting")),
        report=config.get("report") or {},
        algo_config=config.get("algo") or {},
        config=flatten(config) if config else {},
    )


def load_rows(folder: Path) -> list[RunRow]:
    """One row per results.json under `folder` (unreadable files are reported and skipped)."""
    rows = []
    for path in sorted(folder.rglob(RESULTS_FILE)):
        try:
            results = RunResults.from_json(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError, TypeError, AttributeError) as error:
            console.print(f"[yellow]warning:[/] skipping {path}: {error}")
            continue
        rows.append(run_row(path, folder, results))
    return sorted(rows, key=lambda r: (str(r.algo), r.batch_size or 0, r.epsilon or 0.0))
