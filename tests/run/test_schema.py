"""The typed config schema (dpbench/schema.py): every YAML option composes against its dataclass,
values arrive typed, and a wrong type, choice or key is one line and exit status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from helpers.cli import dpbench_in_process
from helpers.config import TINY, compose
from omegaconf import OmegaConf

from dpbench.errors import UserError
from dpbench.paths import config_dir
from dpbench.schema import AlgoOptions, Choice, algo_schemas, check_keys, register, schemas

CONF = Path(config_dir())
GROUP_OPTIONS = [(group, p.stem) for group in ("algo", "accountant", "logger") for p in sorted((CONF / group).glob("*.yaml"))]


def schema_name(group: str, option: str) -> str:
    return "accountant_schema" if group == "accountant" else f"{group}_{option}_schema"


@pytest.mark.parametrize("group,option", GROUP_OPTIONS, ids=[f"{g}={o}" for g, o in GROUP_OPTIONS])
def test_every_option_yaml_composes_against_its_schema(group, option):
    raw = yaml.safe_load((CONF / group / f"{option}.yaml").read_text())
    name, known = schema_name(group, option), schemas()
    assert raw.get("defaults") == [f"/{name}@_here_", "_self_"], f"conf/{group}/{option}.yaml must name its schema first"
    assert name in known, f"{group}={option} has no typed options (an algorithm: register it with options=...)"
    schema = known[name]
    composed = compose([f"{group}={option}"])[group]
    assert OmegaConf.get_type(composed) is schema
    # the YAML lists every option (it is what users read) with the dataclass's default
    assert sorted(k for k in raw if k != "defaults") == sorted(f.name for f in schema.__dataclass_fields__.values())
    defaults = OmegaConf.structured(schema)
    for key in defaults:
        if not OmegaConf.is_missing(defaults, key):  # the shared accountant schema leaves the name to the YAML
            assert composed[key] == defaults[key], f"conf/{group}/{option}.yaml: {key}"


def test_every_algorithm_has_a_yaml_and_its_options_registered_with_it():
    from dpbench.algorithms import ALGORITHMS

    assert sorted(p.stem for p in (CONF / "algo").glob("*.yaml")) == ALGORITHMS.names()
    for name, options in algo_schemas().items():
        assert issubclass(options, AlgoOptions) and options().name == name, name


def test_an_algorithm_registered_without_options_is_named_when_the_schemas_are_built():
    from dpbench.algorithms import ALGORITHMS
    from dpbench.algorithms.dpsgd import DPSGD

    ALGORITHMS.register("untyped")(DPSGD)
    try:
        with pytest.raises(TypeError, match=r"algorithm 'untyped' needs its options: @ALGORITHMS.register\('untyped', options="):
            register()
    finally:
        ALGORITHMS.unregister("untyped")


def test_top_level_yaml_values_are_the_schema_defaults():
    from dpbench.schema import Config

    composed, defaults = compose([]), OmegaConf.structured(Config)
    for key in ("privacy", "train", "audit", "report", "name", "seed", "device", "resume", "threads", "optimize"):
        assert composed[key] == defaults[key], key


def test_choices_are_the_names_of_the_registries_they_select_from():
    from dpbench.algorithms.first_order import PerSample
    from dpbench.algorithms.dpzero import DIRECTIONS, Direction
    from dpbench.algorithms.grape import PROJECTORS, Projector
    from dpbench.precision import DTYPES
    from dpbench.privacy.accountants import ACCOUNTANTS
    from dpbench.privacy.clipping import CLIPPING_RULES, LAYER_THRESHOLDS
    from dpbench.privacy.engines import PER_SAMPLE_ENGINES
    from dpbench.privacy.mechanisms import NEIGHBORING_RELATIONS
    from dpbench.privacy.sampling import build_sampler
    from dpbench.options import LayerThresholds
    from dpbench.schema import AccountantName, Clipping, Neighboring, PrecisionName, Sampling

    generated = [(Clipping, CLIPPING_RULES), (LayerThresholds, LAYER_THRESHOLDS), (AccountantName, ACCOUNTANTS.names()), (Neighboring, NEIGHBORING_RELATIONS),
                 (PrecisionName, DTYPES), (PerSample, PER_SAMPLE_ENGINES.names()), (Direction, DIRECTIONS),
                 (Projector, PROJECTORS)]
    for choice, registry in generated:
        assert issubclass(choice, Choice) and list(choice.__members__) == sorted(registry), choice
        assert all(member.value == name and str(member) == name for name, member in choice.__members__.items())
    for kind in Sampling:  # hand-written (no registry): each member still builds a sampler
        assert build_sampler(kind, 10, 2, 0, private=False) is not None


def test_a_generated_choice_is_a_plain_string_that_copies_and_pickles():
    import copy
    import pickle

    from dpbench.algorithms.first_order import PerSample

    cfg = compose(["algo=grape", "algo.per_sample=bk", "algo.projector=signed_permutation"])
    for value in (cfg.algo.per_sample, cfg.algo.projector, cfg.privacy.clipping):
        assert isinstance(value, Choice) and pickle.loads(pickle.dumps(value)) is value and copy.deepcopy(value) is value
    assert cfg.algo.per_sample is PerSample.bk and cfg.algo.per_sample == "bk" and f"{cfg.algo.per_sample}" == "bk"


def test_values_arrive_typed_and_choices_read_as_plain_strings():
    cfg = compose(["privacy.epsilon=3", "train.epochs=2", "algo.rank=8", "privacy.clipping=psac"])
    assert type(cfg.privacy.epsilon) is float and type(cfg.train.epochs) is float and type(cfg.algo.rank) is int
    clipping = cfg.privacy.clipping
    assert isinstance(clipping, Choice) and clipping == "psac" and {"psac": 1}[clipping] == 1
    assert f"{clipping}" == str(clipping) == "psac" and repr(clipping) == "'psac'"
    assert json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True)))["privacy"]["clipping"] == "psac"


def test_an_option_of_another_algorithm_is_ignored_with_a_note_and_an_unknown_one_rejected():
    notes = check_keys(compose(["algo=dpadam", "algo.rank=64"]))
    assert notes == ["algo.rank is not an option of algo=dpadam (it is one of dplora, galore, galore_naive, grape, lora); ignored"]
    assert check_keys(compose([])) == []
    with pytest.raises(UserError, match="algo.nonsense is not a known key; algo=grape takes: name, rank"):
        check_keys(compose(["+algo.nonsense=1"]))
    with pytest.raises(UserError, match="privacy.typo is not a known key; privacy takes: epsilon"):
        check_keys(compose(["+privacy.typo=1"]))
    with pytest.raises(UserError, match="privacy.typo is not a known key; privacy takes: epsilon"):
        compose(["privacy.typo=1"])  # without `+`, Hydra refuses it while composing
    with pytest.raises(UserError, match=r"algo.rank must be an integer, got 'abc'"):
        compose(["algo.rank=abc"])


BAD = [
    (["algo=grape", "algo.rank=abc"], "error: algo.rank must be an integer, got 'abc'"),
    (["algo.per_sample=vmap"], "error: algo.per_sample='vmap' is not known; use one of bk, ghost, materialize"),
    (["+algo.nonsense=1"], "error: algo.nonsense is not a known key; algo=grape takes: name, rank, update_interval"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[o[-1] for o, _ in BAD])
def test_cli_schema_errors_are_one_line_and_exit_2(tmp_path, overrides, message):
    result = dpbench_in_process(*TINY, *overrides, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-2000:]
    assert lines[0].startswith(message)
    assert not (tmp_path / "run" / "results.json").exists()


def test_resume_matches_a_stored_run_that_predates_a_key_left_at_its_default():
    from dpbench.resume import config_differences

    stored = {"train": {"lr": 0.1}, "algo": {"name": "dcdpsgd", "theta": 2.0}}
    current = {"train": {"lr": 0.1, "precision": "fp32"}, "algo": {"name": "dcdpsgd", "theta": 2.0, "budget_split": "renyi"}}
    assert config_differences(stored, current) == []
    changed = {"train": {"lr": 0.1, "precision": "bf16"}, "algo": {**current["algo"], "budget_split": "epsilon"}}
    assert config_differences(stored, changed) == [
        "algo.budget_split ('<absent>' -> 'epsilon')", "train.precision ('<absent>' -> 'bf16')"]
    # an algorithm's default_lr supplies train.lr: the stored run matches while train.lr does
    supplied = {**current, "algo": {**current["algo"], "default_lr": 0.5, "lr_family": "sgd", "default_clip_norm": 1.0}}
    assert config_differences(stored, supplied) == []
    rates = {"dataset": {"train_defaults": {"lr": 1e-3}}}, {"dataset": {"train_defaults": {"lr": {"adam": 1e-3}}}}
    assert config_differences(*rates) == []
    # a preset's lookup tables (and their labels) land in the keys they set, compared there
    labels = {"paper_setting": {"source": {"dcdpsgd": "c1 = 10 c2"}}}, {"paper_setting": {"source": {"dcdpsgd": "c1 = 2 c2"}}}
    assert config_differences(*labels) == []
    assert config_differences(stored, {**supplied, "train": {"lr": 0.5}}) == ["train.lr (0.1 -> 0.5)"]
    # a key whose new default is not what older runs did: a zeroth-order run stored before algo.mode
    # perturbed every weight, so it matches mode=full and not the new default, auto
    zeroth = {"algo": {"name": "dpzero", "smoothing": 1e-3}}
    assert config_differences(zeroth, {"algo": {**zeroth["algo"], "mode": "full"}}) == []
    assert config_differences(zeroth, {"algo": {**zeroth["algo"], "mode": "auto"}}) == ["algo.mode ('full' -> 'auto')"]
    # where train.steps is set, train.epochs changes nothing (an algorithm's default_steps nulls it)
    with_steps = {"train": {"steps": 320, "epochs": 30.0}}
    assert config_differences(with_steps, {"train": {"steps": 320, "epochs": None}}) == []
    assert config_differences({"train": {"epochs": 30.0}}, {"train": {"epochs": 5.0}}) == [
        "train.epochs (30.0 -> 5.0)"]
