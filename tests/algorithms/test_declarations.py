"""What a feature needs of an algorithm is declared on its class, and a feature that finds no
declaration refuses it in one line: what it trains (the one-run audit's canary layer), whether it
may be sharded (stated by the class itself, never inherited unstated)."""

from __future__ import annotations

import pytest
from helpers.config import compose
from helpers.toy_algorithms import partial_toy  # noqa: F401 (a fixture)
from omegaconf import open_dict

from dpbench.algorithms import ALGORITHMS
from dpbench.algorithms.dpadam import DPAdam
from dpbench.errors import UserError

SMALL = ["dataset=synthetic", "logger=none", "model.embed_dim=16", "model.depth=1", "model.num_heads=2",
         "privacy.noise_multiplier=1", "privacy.epsilon=null"]


def canary_job(selection: list[str]):
    """(the job of `dpbench <selection>` with a one-run canary layer added, the layer)."""
    from dpbench.run import setup
    from dpbench.tools.audit.one_run_canaries import add_canary_layer

    cfg = compose([*SMALL, *selection])
    layers = []
    job = setup(cfg, prepare_model=lambda model: layers.append(add_canary_layer(model, 4, cfg.algo)))
    return job, layers[0]


def test_the_canary_layer_joins_the_trained_modules_option_the_class_declares(partial_toy, monkeypatch):
    """The toy names what it trains `algo.full_modules`, not LoRA's `train_modules`: its declaration
    (`trained_modules_option`) is what the one-run audit reads."""
    from dpbench.tools.audit.one_run_canaries import CANARY_MODULE, CanaryHook

    job, layer = canary_job(partial_toy)
    assert list(job.cfg.algo.full_modules) == ["head", CANARY_MODULE]  # null: the ViT family's head, then the canaries
    hook = CanaryHook(None, job.algorithm, layer)
    assert job.algorithm.params[hook._index] is layer.weight

    monkeypatch.setattr(ALGORITHMS.get("partial"), "trained_modules_option", None)  # declared nowhere
    job, layer = canary_job(partial_toy)
    with pytest.raises(UserError, match=r"^algo=partial does not train the canary layer it was given: .*"
                                         r"trained_modules_option on its class\)$"):
        CanaryHook(None, job.algorithm, layer)

    monkeypatch.setattr(ALGORITHMS.get("partial"), "trained_modules_option", "train_modules")  # not its option
    with pytest.raises(UserError, match=r"^algo=partial declares trained_modules_option='train_modules', which is "
                                         r"not one of its options \(.*full_modules.*\)"):
        canary_job(partial_toy)


class UnstatedDPAdam(DPAdam):
    """A DP-Adam variant that says nothing about sharding."""


class StatedDPAdam(DPAdam):
    shardable = True


def test_shardable_is_read_from_the_class_itself_and_an_unstated_subclass_is_refused_in_one_line(monkeypatch):
    from dpbench.runtime import sharding

    assert DPAdam.stated("shardable") and UnstatedDPAdam.shardable and not UnstatedDPAdam.stated("shardable")
    assert StatedDPAdam.stated("shardable")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose(["logger=none", "algo=dpadam", "algo.per_sample=bk", "train.sharding=fsdp"])
    for name, cls in (("dpadam_unstated", UnstatedDPAdam), ("dpadam_stated", StatedDPAdam)):
        ALGORITHMS.register(name)(cls)
    try:
        with open_dict(cfg):
            cfg.algo.name = "dpadam_unstated"
        with pytest.raises(UserError, match=r"^algo=dpadam_unstated is not supported \(its class UnstatedDPAdam does "
                                            r"not state shardable = True; its base's does not pass on\): "
                                            r"train.sharding=fsdp supports algo=[a-z_|]+ with"):
            sharding.check_supported(cfg, ALGORITHMS)
        assert "dpadam_unstated" not in sharding.supported(ALGORITHMS)
        with open_dict(cfg):
            cfg.algo.name = "dpadam_stated"
        sharding.check_supported(cfg, ALGORITHMS)
    finally:
        ALGORITHMS.unregister("dpadam_unstated")
        ALGORITHMS.unregister("dpadam_stated")


def keyed_presets() -> list[str]:
    """The presets that look settings up in tables keyed by the algorithm."""
    from pathlib import Path

    from dpbench.paths import config_dir

    return sorted(p.stem for p in (Path(config_dir()) / "experiment").glob("*.yaml") if "${algo.name}" in p.read_text())


@pytest.mark.slow  # composes 20 presets (about 12 s)
def test_every_preset_keyed_by_algorithm_composes_one_its_tables_do_not_list(partial_toy):
    from omegaconf import OmegaConf

    from dpbench.schema import preset_fallbacks

    presets = keyed_presets()
    assert len(presets) >= 20 and "bench_real" in presets
    for preset in presets:
        cfg = compose([f"experiment={preset}", *partial_toy])
        OmegaConf.to_container(cfg, resolve=True)  # every key resolves
        assert preset_fallbacks(cfg), preset


def test_a_preset_runs_an_algorithm_its_tables_do_not_list_at_its_own_defaults_with_a_note(partial_toy):
    """`dpbench experiment=bench_real algo=<new>`: the settings its tables lack are the algorithm's own
    defaults, each with a note, never an InterpolationKeyError; an algorithm the table lists gets its entry."""
    from dpbench.run_config import validate
    from dpbench.schema import preset_fallbacks

    cfg = compose(["experiment=bench_real", *partial_toy])
    own = compose(["dataset=rt_snippets", "model=minilm", *partial_toy]).train.lr  # `dpbench algo=partial` there
    assert cfg.train.lr == own and preset_fallbacks(cfg) == [
        f"train.lr={own}: the preset has no paper_setting.lr.partial, so algo=partial runs at its own default"]
    validate(cfg, grid=False)  # the note printed, nothing refused
    listed = compose(["experiment=bench_real", "algo=dpadam"])
    assert listed.train.lr == 3.0e-3 and preset_fallbacks(listed) == []

    cfg = compose(["experiment=dpgrape_t12", *partial_toy])  # an entry by algorithm, data set and size
    assert cfg.privacy.clip_norm == cfg.algo.default_clip_norm and cfg.train.steps is None
    assert any("paper_setting.clip_norm.partial." in note for note in preset_fallbacks(cfg))
    assert compose(["experiment=bench_mini", "algo=grape"]).algo.rank == 8  # the table's entry


@pytest.mark.slow  # trains two steps
def test_a_run_keeps_the_preset_fallback_note_in_its_results(tmp_path):
    """DIFF has no entry in bench_mini's tables: its run says, in results.json's notes, which settings
    are its own defaults."""
    from dpbench.run import run_job

    cfg = compose(["experiment=bench_mini", "algo=diff", "train.steps=2", "logger=none", "device=cpu",
                   "train.checkpoint=false"])
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.status == "completed"
    assert f"train.lr={cfg.train.lr}: the preset has no paper_setting.lr.diff, so algo=diff runs at its own default" \
        in results.notes
