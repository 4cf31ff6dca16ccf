"""Every paper preset composes, opens with the command that runs it, names a stored table, and
carries the paper's hyperparameters (compared with the numbers stored in dpbench/papers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf

from dpbench.papers import PAPERS, load_paper, lookup, table
from dpbench.paths import config_dir
from dpbench.schema import register

register()  # the typed schemas conf/ names (dpbench/schema.py)

EXPERIMENTS = Path(config_dir()) / "experiment"
PAPER_PRESETS = sorted(p.stem for p in EXPERIMENTS.glob("*.yaml") if p.stem.split("_")[0] in PAPERS)
# owned and tested elsewhere (synthetic DPZero study, memory curves)
PAPER_PRESETS = [p for p in PAPER_PRESETS if not p.startswith(("dpzero_t6", "dpzero_fig1", "dpzero_fig2", "memory_vs_batch"))]


def compose(*overrides: str):
    """The job config and its sweep grid (hydra.sweeper.params) for `dpbench -m <overrides>`."""
    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        cfg = hydra_compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    grid = {k: [_number(v) for v in str(vals).split(",")] for k, vals in (cfg.hydra.sweeper.params or {}).items()}
    job = OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)
    return job, grid


def _number(text: str):
    try:
        return float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        return text


def grid_jobs(name: str, keys: tuple[str, ...]):
    """Compose every combination of the preset's grid over `keys` (the others at their first value)."""
    _, grid = compose(f"experiment={name}")
    combos = [[]]
    for key in keys:
        combos = [c + [f"{key}={v}"] for c in combos for v in grid[key]]
    return [compose(f"experiment={name}", *c)[0] for c in combos]


@pytest.mark.parametrize("name", PAPER_PRESETS)
def test_paper_preset_composes_opens_with_its_command_and_names_a_stored_table(name):
    text = (EXPERIMENTS / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    header = [line for line in text.splitlines()[1:8] if line.startswith("#")]
    assert any(f"dpbench -m experiment={name}" in line or f"dpbench experiment={name}" in line for line in header), header
    job, grid = compose(f"experiment={name}")
    assert job["name"] == name and grid, "a preset runs its table as a -m grid"
    report = job["report"]
    assert report["paper"] in PAPERS and report["metric"] in ("final", "best")
    if report["table"] is not None:
        stored = table(report["paper"], report["table"])
        if stored.metric in ("final", "best"):
            assert report["metric"] == stored.metric, f"{name} reports {report['metric']}, the paper {stored.metric}"
    if name.endswith("_mini"):
        assert report["expect"], "a mini table states the ordering it checks"


def test_every_stored_value_is_present_and_typed():
    for paper in PAPERS:
        data = load_paper(paper)
        assert data["paper"] == paper
        for name, spec in data["tables"].items():
            entries = table(paper, name).entries
            assert len(entries) == len(spec["rows"]) * len(spec["columns"]) > 0
            for e in entries:
                assert e.caption and e.row and e.column and e.metric
                assert isinstance(e.value, float) or (e.value is None and e.missing), e
                assert e.pm is None or (isinstance(e.pm, float) and e.pm >= 0)
    # spot checks against the papers
    assert lookup("dpgrape", "T6", {"algo": "grape", "epsilon": 8, "dataset": "cifar100", "model": "vit-base"}).value == 19.0
    cell = lookup("dpgrape", "T3", {"algo": "dpadam", "epsilon": 2, "dataset": "mnli", "model": "roberta-large"})
    assert (cell.value, cell.pm, cell.metric) == (70.3, 0.8, "final")
    assert lookup("dpgrape", "T4", {"algo": "dpadam", "epsilon": 6, "dataset": "sst2", "model": "opt-6.7b"}).value is None
    assert lookup("dpzero", "T5", {"algo": "adam", "steps": 0, "dataset": "drop", "model": "opt-6.7b"}).value == 17.8
    assert lookup("dcdpsgd", "T2", {"algo": "dpsgd", "clipping": "psac", "epsilon": 8, "dataset": "imagenette_lt"}).pm == 1.99
    assert lookup("dpdr", "T1", {"algo": "dpdr", "epsilon": 3, "dataset": "svhn", "model": "resnet18"}).value == 67.44


def test_dpgrape_t3_carries_the_paper_settings():
    s = table("dpgrape", "T3").settings
    _, grid = compose("experiment=dpgrape_t3")
    assert grid["privacy.epsilon"] == s["epsilons"] and grid["seed"] == s["seeds"]
    assert sorted(grid["dataset"]) == sorted(s["clip_norm"])
    for job in grid_jobs("dpgrape_t3", ("dataset",)):
        assert job["privacy"]["clip_norm"] == s["clip_norm"][job["dataset"]["name"]]
        assert (job["train"]["batch_size"], job["train"]["steps"], job["train"]["lr"]) == (s["batch_size"], s["steps"], s["lr"])
        assert (job["algo"]["rank"], job["algo"]["update_interval"]) == (s["rank"], s["update_interval"])
        assert job["privacy"]["delta"] == s["delta"] and job["model"]["size"] == "large"
        assert job["dataset"]["data_seed"] == job["seed"] and job["dataset"]["k_shot"] == s["k_shot"]


@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
@pytest.mark.parametrize("name, quantity_table", [("dpgrape_t4", "T4"), ("dpgrape_t12", "T12")])
def test_dpgrape_opt_presets_carry_table_11_and_the_per_size_settings(name, quantity_table):
    s = table("dpgrape", "T4").settings
    _, grid = compose(f"experiment={name}")
    assert grid["seed"] == s["seeds"] and grid["privacy.epsilon"] == s["epsilons"]
    for job in grid_jobs(name, ("algo", "model.size", "dataset")):
        algo, size, dataset = job["algo"]["name"], job["model"]["size"], job["dataset"]["name"]
        clip = lookup("dpgrape", "T11", {"algo": algo, "dataset": dataset, "model": f"opt-{size}"}, key="privacy.clip_norm")
        if clip.value is not None:  # DP-Adam at 6.7B: OOM in the paper, no C
            assert job["privacy"]["clip_norm"] == clip.value, (algo, size, dataset)
        assert job["train"]["steps"] == s["steps"][algo] and job["train"]["lr"] == s["lr"][algo]
        assert job["algo"]["rank"] == s["rank"][size] and job["algo"]["update_interval"] == s["update_interval"]
        assert job["train"]["batch_size"] == s["batch_size"] and job["dataset"]["data_seed"] == job["seed"]
        assert any(e.match.get("dataset") == dataset for e in table("dpgrape", quantity_table).entries)


@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
def test_dpgrape_t6_carries_table_5_and_delta_one_over_n():
    s = table("dpgrape", "T6").settings
    _, grid = compose("experiment=dpgrape_t6")
    assert grid["privacy.epsilon"] == s["epsilons"]
    n = {"mnist": 60000, "cifar10": 50000, "cifar100": 50000}
    for job in grid_jobs("dpgrape_t6", ("algo", "dataset")):
        algo, dataset = job["algo"]["name"], job["dataset"]["name"]
        ident = {"algo": algo, "dataset": dataset, "model": "vit-base"}
        assert job["privacy"]["clip_norm"] == lookup("dpgrape", "T5", ident, key="privacy.clip_norm").value
        assert job["train"]["lr"] == lookup("dpgrape", "T5", ident, key="train.lr").value
        assert job["privacy"]["delta"] == pytest.approx(1 / n[dataset], rel=1e-4)
        assert (job["train"]["batch_size"], job["train"]["epochs"], job["algo"]["rank"]) == (s["batch_size"], s["epochs"], s["rank"])
        assert job["model"]["size"] == "base" and job["report"]["metric"] == "best"


def test_dpgrape_t7_physical_batches_match_the_paper():
    for job in grid_jobs("dpgrape_t7", ("algo",)):
        stored = lookup("dpgrape", "T7-memory", {"algo": job["algo"]["name"], "dataset": "cifar10", "model": "vit-base"},
                        key="train.physical_batch_size")
        assert job["train"]["physical_batch_size"] == stored.value and job["train"]["batch_size"] == 1000


@pytest.mark.parametrize("name, settings", [("dpzero_t2", "T2"), ("dpzero_t4", "T4"), ("dpzero_t5", "T4")])
def test_dpzero_presets_carry_the_paper_settings(name, settings):
    s = table("dpzero", settings).settings
    job, grid = compose(f"experiment={name}")
    assert grid["privacy.epsilon"] == s["epsilons"] and grid["seed"] == s["seeds"]
    steps = s["steps"]["dpzero"] if isinstance(s["steps"], dict) else s["steps"]
    assert (job["train"]["batch_size"], job["train"]["steps"], job["algo"]["smoothing"]) == (s["batch_size"], steps, s["smoothing"])
    assert job["train"]["lr"] == s["lr"]["dpzero"] if "lr" in s else job["train"]["lr"] in s["lr_grid"]
    assert job["privacy"]["clip_norm"] in s["clip_norm_grid"] and job["privacy"]["delta"] == s["delta"]
    assert job["privacy"]["neighboring"] == "replace_one" and job["algo"]["direction"] == "gaussian"
    assert grid["algo"] == ["dpzero"] and job["dataset"]["data_seed"] == job["seed"]


DCDPSGD_DATASETS = ["mnist", "fashion_mnist", "cifar10", "cifar10_lt", "imagenette", "imagenette_lt"]


@pytest.mark.parametrize("dataset", DCDPSGD_DATASETS)
def test_dcdpsgd_table_2_presets_carry_the_paper_settings(dataset):
    s = table("dcdpsgd", "T2").settings
    job, grid = compose(f"experiment=dcdpsgd_{dataset}")
    assert job["train"]["batch_size"] == s["batch_size"][dataset] and job["train"]["epochs"] == s["epochs"][dataset]
    assert job["privacy"]["clip_norm"] == s["clip_norm"][dataset] and job["privacy"]["delta"] == s["delta"][dataset]
    # c1/c2: the sound default is tuned (dcdpsgd_t2_mini.yaml); the paper's ratio is one override away, in the header
    assert f"algo.tail_clip_ratio={s['tail_clip_ratio']:g} " in (EXPERIMENTS / f"dcdpsgd_{dataset}.yaml").read_text()
    assert job["algo"]["subspace_dim"] == s["subspace_dim"]
    assert sorted(grid["algo.tail_selection"]) == ["rank", "threshold"] and grid["algo.gradient_sensitivity"] == ["tail_clip"]
    assert job["algo"]["theta"] == s["theta"] and job["algo"]["tail_fraction"] == s["tail_fraction"]
    stored_eps = sorted({e.match["epsilon"] for e in table("dcdpsgd", "T2").entries if e.match["dataset"] == dataset})
    assert sorted(grid["privacy.epsilon"]) == stored_eps


@pytest.mark.parametrize("dataset", ["mnist", "cifar10", "svhn"])
def test_dpdr_table_1_presets_carry_the_paper_settings(dataset):
    s = table("dpdr", "T1").settings
    job, grid = compose(f"experiment=dpdr_{dataset}")
    assert job["train"]["epochs"] == s["epochs"] and job["algo"]["decomposition_steps"] == s["decomposition_steps"]
    assert job["privacy"]["delta"] == s["delta"] and sorted(grid["privacy.epsilon"]) == s["epsilons"]
    assert job["train"]["batch_size"] == (128 if dataset == "svhn" else s["batch_size"])  # SVHN: the sigmas fit 128
    model = {"mnist": "tanh_cnn", "cifar10": "cnn5", "svhn": "resnet18"}[dataset]
    assert job["model"]["name"] == model
    assert lookup("dpdr", "T1", {"algo": "dpdr", "epsilon": 8, "dataset": dataset, "model": model}) is not None


def test_dpgrape_t9_carries_table_8_and_a_local_pretrained_checkpoint():
    _, grid = compose("experiment=dpgrape_t9")
    assert grid["privacy.epsilon"] == [1, 2, 4, 8] and set(grid["dataset"]) == {"cifar10", "cifar100"}
    for job in grid_jobs("dpgrape_t9", ("algo", "dataset")):
        ident = {"algo": job["algo"]["name"], "dataset": job["dataset"]["name"], "model": "vit-base-224"}
        assert job["privacy"]["clip_norm"] == lookup("dpgrape", "T8", ident, key="privacy.clip_norm").value
        assert job["train"]["lr"] == lookup("dpgrape", "T8", ident, key="train.lr").value
        assert (job["train"]["batch_size"], job["train"]["epochs"], job["privacy"]["delta"]) == (1000, 20, 2.0e-5)
        assert job["model"]["pretrained"].startswith("vit_base_patch16_224") and job["report"]["metric"] == "best"


def test_dpgrape_t9_without_the_checkpoint_is_one_line(tmp_path):
    from dpbench.errors import UserError
    from dpbench.run import setup

    with initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        cfg = hydra_compose(config_name="config", overrides=["experiment=dpgrape_t9", "dataset=synthetic", "logger=none",
                                                             "privacy.clip_norm=1", "train.lr=1e-3", "train.batch_size=32",
                                                             "train.physical_batch_size=16"])
    with pytest.raises(UserError, match="model.path"):
        setup(cfg)
