"""The typed config schema (dpbench/schema.py): every YAML option composes against its dataclass,
values arrive typed, and a wrong type, choice or key is one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers.cli import dpbench
from helpers.config import TINY, compose
from omegaconf import OmegaConf

from dpbench.errors import UserError
from dpbench.paths import config_dir
from dpbench.schema import ALGO_SCHEMAS, SCHEMAS, Choice, check_keys, register

CONF = Path(config_dir())
GROUP_OPTIONS = [(group, p.stem) for group in ("algo", "accountant", "logger") for p in sorted((CONF / group).glob("*.yaml"))]


def schema_name(group: str, option: str) -> str:
    return "accountant_schema" if group == "accountant" else f"{group}_{option}_schema"


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_option_yaml_composes_against_its_schema(group, option):
    raw = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    name = schema_name(group, option)
    assert raw.get("defaults") == [f"/{name}@_here_", "_self_"], f"conf/{group}/{option}.yaml must name its schema first"
    assert name in SCHEMAS, f"add a dataclass for {group}={option} to dpbench/schema.py"
    schema = SCHEMAS[name]
    composed = compose([f"{group}={option}"])[group]
    assert OmegaConf.get_type(composed) is schema
    # the YAML lists every option (it is what users read) with the dataclass's default
    assert sorted(k for k in raw if k != "defaults") == sorted(f.name for f in schema.__dataclass_fields__.values())
    defaults = OmegaConf.structured(schema)
    for key in defaults:
        if not OmegaConf.is_missing(defaults, key):  # the shared accountant schema leaves the name to the YAML
            assert composed[key] == defaults[key], f"conf/{group}/{option}.yaml: {key}"


def test_every_algorithm_has_a_yaml_and_a_schema():
    from dpbench.algorithms import ALGORITHMS, import_all

    import_all()
    assert sorted(p.stem for p in (CONF / "algo").glob("*.yaml")) == sorted(ALGO_SCHEMAS) == ALGORITHMS.names()


def test_top_level_yaml_values_are_the_schema_defaults():
    from dpbench.schema import Config

    composed, defaults = compose([]), OmegaConf.structured(Config)
    for key in ("privacy", "train", "audit", "report", "name", "seed", "device", "resume", "threads", "optimize"):
        assert composed[key] == defaults[key], key


def test_choices_mirror_the_registries_they_name():
    from dpbench.algorithms.dpzero import DIRECTIONS
    from dpbench.algorithms.grape import PROJECTORS
    from dpbench.privacy.accountants import ACCOUNTANTS
    from dpbench.privacy.mechanisms import NEIGHBORING_RELATIONS
    from dpbench.privacy.clipping import CLIP_FACTORS
    from dpbench.privacy.engines import PER_SAMPLE_ENGINES
    from dpbench.privacy.sampling import build_sampler
    from dpbench.schema import AccountantName, Clipping, Direction, Neighboring, PerSample, Projector, Sampling

    assert set(Clipping.__members__) == set(CLIP_FACTORS)
    assert set(AccountantName.__members__) == set(ACCOUNTANTS.names())
    assert set(Neighboring.__members__) == set(NEIGHBORING_RELATIONS)
    assert set(PerSample.__members__) == set(PER_SAMPLE_ENGINES.names())
    assert set(Direction.__members__) == set(DIRECTIONS)
    assert set(Projector.__members__) == set(PROJECTORS)
    for kind in Sampling:
        assert build_sampler(kind, 10, 2, 0, private=False) is not None


def test_values_arrive_typed_and_choices_read_as_plain_strings():
    cfg = compose(["privacy.epsilon=3", "train.epochs=2", "algo.rank=8", "privacy.clipping=psac"])
    assert type(cfg.privacy.epsilon) is float and type(cfg.train.epochs) is float and type(cfg.algo.rank) is int
    clipping = cfg.privacy.clipping
    assert isinstance(clipping, Choice) and clipping == "psac" and {"psac": 1}[clipping] == 1
    assert f"{clipping}" == str(clipping) == "psac" and repr(clipping) == "'psac'"
    assert json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True)))["privacy"]["clipping"] == "psac"


def test_an_option_of_another_algorithm_is_ignored_with_a_note_and_an_unknown_one_rejected():
    notes = check_keys(compose(["algo=dpadam", "algo.rank=64"]))
    assert notes == ["algo.rank is not an option of algo=dpadam (it is one of galore, galore_naive, grape, lora, dplora); ignored"]
    assert check_keys(compose([])) == []
    with pytest.raises(UserError, match="algo.nonsense is not a known key; algo=grape takes: name, rank"):
        check_keys(compose(["+algo.nonsense=1"]))
    with pytest.raises(UserError, match="privacy.typo is not a known key; privacy takes: epsilon"):
        check_keys(compose(["+privacy.typo=1"]))
    with pytest.raises(UserError, match="privacy.typo is not a known key; privacy takes: epsilon"):
        compose(["privacy.typo=1"])  # without `+`, Hydra refuses it while composing
    with pytest.raises(UserError, match=r"algo.rank must be an integer, got 'abc'"):
        compose(["algo.rank=abc"])


def grid_algorithms(preset: Path) -> list[str]:
    params = ((yaml.safe_load(preset.read_text()).get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    return [a.strip() for a in str(params.get("algo") or "").split(",") if a.strip()]


def test_every_preset_composes_with_every_algorithm_of_its_grid():
    """Presets set options of some algorithms for their whole grid (algo.rank=64 for grape and
    dpadam jobs alike): each grid point composes, and no key lies outside every schema.
    (Each preset with its own algorithm: tests/test_config.py.)"""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    jobs = [(p.stem, algo) for p in sorted((CONF / "experiment").glob("*.yaml")) for algo in grid_algorithms(p)]
    assert len(jobs) > 40
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        for preset, algo in jobs:
            cfg = hydra_compose(config_name="config", overrides=[f"experiment={preset}", f"algo={algo}"])
            assert OmegaConf.get_type(cfg.algo) is ALGO_SCHEMAS[algo], (preset, algo)
            check_keys(cfg)


BAD = [
    (["algo=grape", "algo.rank=abc"], "error: algo.rank must be an integer, got 'abc'"),
    (["algo.per_sample=vmap"], "error: algo.per_sample='vmap' is not known; use one of bk, ghost, materialize"),
    (["+algo.nonsense=1"], "error: algo.nonsense is not a known key; algo=grape takes: name, rank, update_interval"),
]


@pytest.mark.slow  # the console script
@pytest.mark.parametrize("overrides,message", BAD, ids=[o[-1] for o, _ in BAD])
def test_cli_schema_errors_are_one_line_and_exit_2(tmp_path, overrides, message):
    result = dpbench(*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(message)
    assert not (tmp_path / "run" / "results.json").exists()


def test_resume_matches_a_stored_run_that_predates_a_key_left_at_its_default():
    from dpbench.run import config_differences

    stored = {"train": {"lr": 0.1}, "algo": {"name": "dcdpsgd", "theta": 2.0}}
    current = {"train": {"lr": 0.1, "precision": "fp32"}, "algo": {"name": "dcdpsgd", "theta": 2.0, "budget_split": "renyi"}}
    assert config_differences(stored, current) == []
    changed = {"train": {"lr": 0.1, "precision": "bf16"}, "algo": {**current["algo"], "budget_split": "epsilon"}}
    assert config_differences(stored, changed) == [
        "algo.budget_split ('<absent>' -> 'epsilon')", "train.precision ('<absent>' -> 'bf16')"]
