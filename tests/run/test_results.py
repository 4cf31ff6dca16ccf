"""The results contract: results.json keeps its keys, old files read the same, and the console
table, the W&B summary and the report read one summary."""

import copy
import json

import pytest
from helpers.config import TINY, compose
from rich.console import Console

from dpbench.logging.console import summary_table
from dpbench.logging.results import (
    SCHEMA_VERSION, EvalRecord, RunResults, epsilon_covers, eval_summary, read_results, write_results,
)
from dpbench.privacy.plan import PRIVATE_STATISTIC_FIGURES
from dpbench.tools.report import load_rows
from dpbench.run import run_job

# results.json of schema version 5 as readers know it, in the order it is written (pinned here
# so that a renamed or dropped key fails; adding one means a new schema version).
TOP = ["schema_version", "status", "algo", "model", "dataset", "seed", "privacy", "metrics", "memory",
       "throughput", "compute", "resumed_from_step", "algorithm", "history", "notes", "versions", "config", "epsilon_covers"]
PRIVATE = ["private", "epsilon", "epsilon_is_upper_bound", "target_epsilon", "delta", "noise_multiplier",
           "clip_norm", "sample_rate", "expected_batch_size", "steps", "planned_steps", "accountant",
           "requested_accountant", "neighboring", "log_private_stats", "ledger", "sampling", "bound",
           "epsilon_lower", "epsilon_upper", "pld_interval", "dp_events"]
NON_PRIVATE = [k for k in PRIVATE if k not in ("epsilon_is_upper_bound", "requested_accountant", "log_private_stats", "bound",
                                               "epsilon_lower", "epsilon_upper", "pld_interval", "dp_events")]
METRICS = ["metric", "test_accuracy", "best_test_accuracy", "train_loss", "test_loss", "train_accuracy"]
CPU_MEMORY = ["peak_bytes", "kind", "start_bytes", "warmed_up", "per_sample_grad_bytes", "optimizer_state_bytes", "parameter_bytes"]
THROUGHPUT = ["samples_per_s", "measured_steps", "wall_s", "world_size"]
COMPUTE = ["forward_equivalents", "per_example", "forwards", "backwards", "examples", "planned_per_example",
           "planned_forward_equivalents"]
COMPUTE_ROW = ("forward_equivalents", "compute_per_example", "planned_forward_equivalents", "planned_per_example")
ADDED_IN_2 = ("epsilon_is_upper_bound", "requested_accountant", "log_private_stats")
ADDED_IN_3 = ("world_size",)
ADDED_IN_4 = ("bound",)
ADDED_IN_8 = ("epsilon_lower", "epsilon_upper", "pld_interval", "dp_events")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A private and a non-private run, as results.json holds them."""
    folder = tmp_path_factory.mktemp("runs")
    out = {}
    for algo in ("dpsgd", "adam"):
        run_job(compose(TINY + [f"algo={algo}"]), folder / algo, show_progress=False)
        out[algo] = (folder / algo, read_results(folder / algo))
    return out


@pytest.mark.parametrize("algo,privacy_keys", [("dpsgd", PRIVATE), ("adam", NON_PRIVATE)])
def test_results_json_keeps_its_keys_and_reads_back_exactly(runs, algo, privacy_keys):
    _, stored = runs[algo]
    assert list(stored) == TOP and stored["schema_version"] == SCHEMA_VERSION == 9
    assert list(stored["privacy"]) == privacy_keys
    assert list(stored["metrics"]) == METRICS
    assert list(stored["memory"]) == CPU_MEMORY and list(stored["throughput"]) == THROUGHPUT
    assert list(stored["compute"]) == COMPUTE
    assert RunResults.from_json(stored).to_json() == stored


def older_version(results: dict, version: int) -> dict:
    """The same run as a file of an earlier schema version held it."""
    old = copy.deepcopy(results)
    for key in ADDED_IN_4 + ADDED_IN_8:
        del old["privacy"][key]
    for key in ADDED_IN_3:
        del old["throughput"][key]
    del old["resumed_from_step"]
    del old["epsilon_covers"]
    del old["compute"]  # added in 9
    old["schema_version"] = 2
    if version == 1:
        del old["schema_version"]
        for key in ADDED_IN_2:
            del old["privacy"][key]
    return old


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_file_reads_like_the_same_run_written_today(runs, tmp_path, version):
    _, stored = runs["dpsgd"]
    old = older_version(stored, version)
    for name, results in (("new", stored), ("old", old)):
        write_results(tmp_path / name, results)
    new_row, old_row = (row for row in sorted(load_rows(tmp_path), key=lambda r: r["path"]))
    unknown = dict.fromkeys(COMPUTE_ROW)  # compute: unknown in a file from before version 9
    assert {**old_row, "path": None} == {**new_row, "path": None, **unknown}
    read = RunResults.from_json(old)
    assert read.schema_version == version and read.throughput.world_size is None
    assert read.compute.forward_equivalents is None and read.compute.planned_per_example is None  # unknown
    assert (read.privacy.requested_accountant is None) == (version == 1)
    assert read.privacy.epsilon == stored["privacy"]["epsilon"]
    written = read.to_json()  # every key of the old file is written back unchanged
    for key, value in old.items():
        kept = {k: written[key][k] for k in value} if key in ("privacy", "metrics", "memory", "throughput", "compute") \
            else written[key]
        assert kept == value, key
    sparse = RunResults.from_json({"algo": "dpadam", "privacy": {"epsilon": 3.0}})  # missing keys: None
    assert sparse.privacy.is_private and sparse.metrics.test_accuracy is None and sparse.config is None
    assert sparse.summary()["memory/peak_bytes"] is None


def test_results_json_holds_the_compute_the_steps_ran(runs):
    """DP-SGD (materialize) and Adam: a forward and a backward per example, 3 forward-pass equivalents,
    over the examples the 3 steps trained on; the plan is 3 x the expected batch (32) x 3 steps."""
    for algo in ("dpsgd", "adam"):
        compute = runs[algo][1]["compute"]
        assert compute["forwards"] == compute["backwards"] == compute["examples"] > 0
        assert compute["forward_equivalents"] == 3 * compute["examples"] and compute["per_example"] == 3.0
        assert compute["planned_per_example"] == 3.0 and compute["planned_forward_equivalents"] == 3.0 * 32 * 3


def test_epsilon_covers_says_which_figures_epsilon_covers(runs):
    """A private run lists its releases as covered and, as it logs private statistics (the default),
    its un-noised figures as outside; a non-private run covers nothing."""
    private = runs["dpsgd"][1]["epsilon_covers"]
    assert {"metrics.test_accuracy", "metrics.validation_score", "history[].test_accuracy"} <= set(private["covered"])
    assert {"metrics.train_loss", "memory.peak_bytes", "throughput.samples_per_s", "status"} <= set(private["outside_epsilon"])
    assert not set(private["covered"]) & set(private["outside_epsilon"])
    public = runs["adam"][1]["epsilon_covers"]
    assert public["covered"] == [] and "metrics.test_accuracy" in public["outside_epsilon"]


def test_without_private_statistics_nothing_outside_epsilon_is_written(tmp_path):
    """privacy.log_private_stats=false: the list of outside figures is empty and every figure it
    would name is absent (null) in the file."""
    run_job(compose(TINY + ["algo=dpsgd", "privacy.log_private_stats=false"]), tmp_path, show_progress=False)
    stored = read_results(tmp_path)
    assert stored["epsilon_covers"]["outside_epsilon"] == []
    logged = RunResults.from_json(stored)
    withheld = epsilon_covers(logged, True, (), PRIVATE_STATISTIC_FIGURES)  # what a run that logs them would list
    for key in withheld["outside_epsilon"]:
        if key in ("status",) or key.startswith(("history[]", "algorithm.")):
            continue
        section, name = key.split(".")
        assert stored[section].get(name) is None, key
    assert all(record.get("train_loss") is None for record in stored["history"])


def test_keys_of_a_newer_file_survive_a_round_trip():
    newer = {"schema_version": 10, "status": "completed", "privacy": {"epsilon": 1.0, "future_bound": 0.9},
             "checkpoint": {"step": 4}}
    written = RunResults.from_json(newer).to_json()
    assert written["checkpoint"] == {"step": 4} and written["privacy"]["future_bound"] == 0.9
    assert written["schema_version"] == 10


def test_console_table_shows_the_summary(runs):
    for algo in ("dpsgd", "adam"):
        results = RunResults.from_json(runs[algo][1])
        figures = results.summary()
        console = Console(width=200, record=True)
        console.print(summary_table(results))
        text = console.export_text()
        assert f"{figures['test/accuracy']:.4f}" in text and f"{figures['throughput/wall_s']:.1f} s" in text
        assert f"{figures['memory/peak_bytes'] / 2**20:.0f} MiB" in text
        if algo == "dpsgd":
            assert figures["privacy/private"] and f"{figures['privacy/epsilon']:.3f}" in text
        else:
            assert not figures["privacy/private"] and "∞" in text
        assert "validation" not in text  # no validation split: no column
    scored = RunResults.from_json({**runs["dpsgd"][1], "metrics": {**runs["dpsgd"][1]["metrics"], "validation_score": 0.4321}})
    console = Console(width=200, record=True)
    console.print(summary_table(scored))
    text = console.export_text()
    assert "validation (noisy)" in text and "0.4321" in text
    assert scored.summary()["validation/score"] == 0.4321  # W&B's run summary carries it too


def test_report_rows_hold_the_summary_figures(runs):
    folder, stored = runs["dpsgd"]
    (row,) = load_rows(folder)
    figures = RunResults.from_json(stored).summary()
    assert row["final"] == figures["test/accuracy"] == stored["metrics"]["test_accuracy"]
    assert row["epsilon"] == figures["privacy/epsilon"] == stored["privacy"]["epsilon"]
    assert row["peak_mib"] * 2**20 == figures["memory/peak_bytes"] == stored["memory"]["peak_bytes"]


def test_an_evaluation_is_logged_under_the_summary_names():
    record = EvalRecord(step=4, train_loss=0.5, test_accuracy=0.75, test_loss=None, epsilon=1.5)
    assert eval_summary(record) == {"test/accuracy": 0.75, "train/loss": 0.5, "privacy/epsilon": 1.5}
    names = set(RunResults().summary())
    assert set(eval_summary(record)) <= names | {"train/accuracy"}


def test_run_job_returns_the_typed_results_it_wrote(runs):
    folder, stored = runs["dpsgd"]
    results = run_job(compose(TINY + ["algo=dpsgd", "resume=true"]), folder, show_progress=False)  # the stored run
    assert isinstance(results, RunResults) and results.to_json() == stored
    assert all(isinstance(record, EvalRecord) for record in results.history)
    assert results.metrics.test_accuracy == results.history[-1].test_accuracy == stored["history"][-1]["test_accuracy"]
    assert "train_accuracy" not in stored["history"][-1]  # an evaluation writes only what it measured


def test_a_file_with_prose_values_of_older_versions_reads_and_writes_back(runs, tmp_path):
    """Old DPDR and DC-DPSGD runs stored explanations as values (algorithm.true_epsilon,
    algorithm.composed_epsilon); today's runs put them in the notes. Old files still read the same."""
    _, stored = runs["dpsgd"]
    old = copy.deepcopy(stored)
    old["algorithm"] = {"sigma_eff": 1.2, "true_epsilon": "privacy.epsilon (decomposition steps at sigma_eff)",
                        "composed_epsilon": "privacy.epsilon (both mechanisms, composed by the accountant)"}
    write_results(tmp_path, old)
    read = RunResults.from_json(read_results(tmp_path))
    assert read.algorithm == old["algorithm"] and read.to_json() == old
    (row,) = load_rows(tmp_path)
    assert row.epsilon == stored["privacy"]["epsilon"]


def test_written_file_is_json_with_nan_as_null(tmp_path):
    results = RunResults(status="completed")
    results.metrics.test_loss = float("nan")
    write_results(tmp_path, results)
    assert json.loads((tmp_path / "results.json").read_text())["metrics"]["test_loss"] is None


@pytest.mark.parametrize("overrides", [
    ["algo=dcdpsgd", "algo.budget_split=epsilon", "algo.subspace_dim=null"],  # calibrated: an EpsilonSplit
    ["algo=dpdr", "algo.paper_accounting=true", "algo.sigma_perp=0.59", "algo.sigma_alpha=0.8",
     "algo.claimed_epsilon=8", "privacy.noise_multiplier=0.59"],
])
@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
def test_algorithm_facts_are_values_and_their_meaning_is_in_the_notes(overrides):
    """results.json `algorithm` holds numbers, flags and names; an explanation of what a figure
    means goes to the run's notes (DPDR's claimed epsilon, DC-DPSGD's epsilon split)."""
    from dpbench.run import setup

    job = setup(compose(TINY + overrides))
    facts = job.algorithm.extra_results()
    prose = {key: value for key, value in facts.items() if isinstance(value, str) and " " in value}
    assert not prose
    assert job.privacy.recorded_notes()  # what the figures mean (paper accounting, the split)
    if "algo=dpdr" in overrides:
        assert facts["claimed_epsilon"] == 8 and "true_epsilon" not in facts
        assert any("algorithm.claimed_epsilon" in note for note in job.privacy.notes)
    else:
        assert "composed_epsilon" not in facts and facts["epsilon_tr_plus_dp"] >= facts["epsilon_tr"] > 0
