"""train.precision=bf16|fp16: the forward under autocast, while norms, clipped sums and noise stay
fp32 (so clipping still enforces the stated sensitivity); fp16's loss scale is divided out before
any norm; what cannot run in low precision is refused.

Every preset's precision choice trains: on a tiny stand-in model (random init, from config,
offline) with the preset's model.dtype, train.precision, lr, clipping and algorithm options, one
step of each algorithm of its grid changes >= 99% of the trainable weights it should change and
the loss stays finite. Every point of every preset grid composes (`dpbench -m experiment=<name>
--cfg job`)."""

from __future__ import annotations

import functools
import itertools
import json
import math
from pathlib import Path
from unittest import mock

import pytest
import torch
from helpers.algorithms import build_algorithm, tiny_model
from helpers.config import TINY, compose, compose_point
from helpers.text_data import write_dataset
from helpers.tiny_bert import write_corpus, write_tiny_bert
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from omegaconf import OmegaConf, open_dict

from dpbench.algorithms import algorithm_class
from dpbench.errors import UserError
from dpbench.paths import config_dir
from dpbench.precision import Precision
from dpbench.privacy.noise import GaussianNoise
from dpbench.run import run_job, setup
from dpbench.schema import algo_schemas, check_keys, checked_composition


@pytest.mark.parametrize("algo", ["dpsgd", "grape", "dcdpsgd", "dpdr"])
def test_bf16_forward_keeps_fp32_sums_and_the_clipping_bound(algo):
    algorithm, task, _ = build_algorithm(algo, sigma=0.0, clip=0.05)
    algorithm.precision = Precision("bf16", "cpu")
    images, labels = task.batch(list(range(16)))
    with algorithm.precision.autocast(), torch.no_grad():  # no_grad: Opacus's hooks capture nothing
        assert algorithm.model(images).dtype == torch.bfloat16  # the forward really is bf16
    without, _ = algorithm.clip_and_accumulate([(images[1:], labels[1:])])
    added, tally = algorithm.clip_and_accumulate([(images, labels)])  # + one example (norm >> C = 0.05)
    assert all(s.dtype == torch.float32 for s in added) and tally.count == 16
    moved = torch.sqrt(sum((a - b).pow(2).sum() for a, b in zip(added, without)))
    assert 0.5 * 0.05 <= moved <= algorithm.gradient_sensitivity() * (1 + 1e-3)  # it counts, within its bound


@pytest.mark.slow  # trains end to end (the slow tier)
def test_bf16_run_learns_and_spends_the_same_epsilon(tmp_path):
    overrides = TINY + ["algo=dpadam", "train.batch_size=64", "train.steps=25", "train.lr=0.05",
                        "privacy.noise_multiplier=0.5"]
    fp32 = run_job(compose(overrides), tmp_path / "fp32", show_progress=False)
    bf16 = run_job(compose(overrides + ["train.precision=bf16"]), tmp_path / "bf16", show_progress=False)
    assert bf16.privacy.epsilon == pytest.approx(fp32.privacy.epsilon)
    assert bf16.privacy.ledger == fp32.privacy.ledger
    assert bf16.metrics.test_accuracy > 0.25 + 0.15  # 4 classes; fp32 and bf16 reach 0.47-0.79


def _tiny_gradient_sums(precision: str, tiny: float, loss_scale: float | None = None) -> torch.Tensor:
    """Unclipped per-example gradient sum of 16 examples whose losses are scaled by `tiny`."""
    algorithm, task, _ = build_algorithm("dpsgd", sigma=0.0, clip=1e6)
    loss = task.per_sample_loss
    task.per_sample_loss = lambda model, batch: loss(model, batch) * tiny
    if precision != "fp32":
        algorithm.use_precision(Precision(precision, "cpu"))
    if loss_scale is not None:
        algorithm.engine.loss_scale = loss_scale
    sums, _ = algorithm.clip_and_accumulate([task.batch(list(range(16)))])
    return torch.cat([s.flatten() for s in sums])


def test_fp16_loss_scale_keeps_small_per_example_gradients():
    reference = _tiny_gradient_sums("fp32", 1e-6)
    error = lambda sums: float((sums - reference).norm() / reference.norm())  # noqa: E731
    assert error(_tiny_gradient_sums("fp16", 1e-6)) < 5e-3
    assert error(_tiny_gradient_sums("fp16", 1e-6, loss_scale=1.0)) > 5 * error(_tiny_gradient_sums("fp16", 1e-6))


def test_fp16_non_private_gradient_is_unscaled_before_the_step():
    _, task, cfg = build_algorithm("sgd")
    grads = {}
    for precision in ("fp32", "fp16"):
        algorithm = algorithm_class("sgd")(tiny_model(), task, cfg.algo, 0.1, None)
        algorithm.use_precision(Precision(precision, "cpu"))
        algorithm.backward_mean_loss([task.batch(list(range(16)))])
        grads[precision] = torch.cat([p.grad.flatten() for p in algorithm.params])
    assert torch.allclose(grads["fp16"], grads["fp32"], rtol=2e-2, atol=1e-4)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["train.precision=fp16", "algo=dpadam", "algo.per_sample=ghost"], "per_sample=materialize"),
     (["train.precision=fp64"], "not known"),
     (["algo=dpzero", "train.precision=bf16"], "first-order")],
)
def test_unsupported_precision_is_one_line_error(tmp_path, overrides, message):
    with pytest.raises(UserError, match=message):
        run_job(compose(TINY + overrides), tmp_path, show_progress=False)


PRESETS = sorted(p.stem for p in (Path(config_dir()) / "experiment").glob("*.yaml"))
BATCH = 8
SMALL_IMAGES = ["dataset=synthetic", "dataset.image_size=8", "dataset.channels=1", "dataset.patch_size=2",
                "dataset.num_classes=4", "dataset.train_size=64", "dataset.test_size=16"]


@functools.cache
def sweep(name: str) -> dict[str, list[str]]:
    """The preset's grid (hydra.sweeper.params; a tuned preset's private_search: hydra.sweeper.grid,
    its studies' fixed axes) as lists of override values."""
    with checked_composition(), initialize_config_dir(version_base="1.3", config_dir=config_dir()):
        cfg = hydra_compose(config_name="config", overrides=[f"experiment={name}"], return_hydra_config=True)
    axes = {**(cfg.hydra.sweeper.get("params") or {}), **(cfg.hydra.sweeper.get("grid") or {})}
    grid = {key: str(values).split(",") for key, values in axes.items()}
    grid.setdefault("algo", [cfg.algo.name])
    return grid


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("text")
    for name in ("sst2", "sst5", "snli", "mnli", "rte", "trec", "boolq", "squad", "drop"):
        write_dataset(root, name, n_train=32, n_test=8)
    write_tiny_bert(root / "tiny_bert")
    write_corpus(root / "rt_snippets.csv.bz2")
    return root


def stand_in(name: str, algo: str, text_data: Path):
    """The preset's job with its precision, optimisation, privacy and algorithm keys as it runs
    them (resolved first: some depend on the model size or dataset), on a tiny offline model and
    data of the same kind (language: the family's random-init `tiny`; images: a small CNN or the
    micro ViT on synthetic images), a batch of 8 and a fixed noise multiplier (calibrating sigma
    for thousands of steps would dominate the test; any sigma > 0 noises every coordinate)."""
    preset = OmegaConf.to_container(compose([f"experiment={name}", f"algo={algo}"]), resolve=True, enum_to_str=True)
    model = preset["model"]
    validation = float(preset["dataset"].get("validation_fraction") or 0) > 0
    if model["name"] in ("minilm", "bert"):  # the real tier: a tiny random BERT and corpus in the real formats
        swap = [f"model.path={text_data / 'tiny_bert'}", f"dataset.path={text_data / 'rt_snippets.csv.bz2'}",
                "dataset.test_fraction=0.3", "dataset.max_length=8", "model.trained_blocks=1"]
    elif model.get("task_kind") == "language":
        swap = [f"model.dtype={model['dtype']}", "model.size=tiny", "model.path=null",
                # shuffled batches under add/remove leave one example out per epoch: more than a batch
                f"dataset.path={text_data / preset['dataset']['name']}",
                # a validation split (tuned presets) takes a fifth of the k-shot sample: twice as many
                f"dataset.k_shot={(8 if preset['privacy']['sampling'] == 'shuffle' else 4) * (2 if validation else 1)}",
                "dataset.num_train=24",
                "dataset.num_dev=4", "dataset.num_test=4", "dataset.max_new_tokens=3"]
    elif preset["dataset"]["name"] == "quadratic":
        swap = ["dataset.train_size=64", "dataset.test_size=16"]
    elif model["name"] == "vit":  # DP-GRAPE and GaLore project its transformer blocks
        swap = [*SMALL_IMAGES, "model.size=micro", "model.pretrained=null", "model.path=null", "model.embed_dim=null",
                "model.depth=null", "model.num_heads=null", "model.mlp_ratio=null"]
    else:
        swap = [*SMALL_IMAGES, "model=cnn5", "model.widths=[8,16,32]", "model.groups=4", "model.hidden=32"]
    cfg = compose([f"experiment={name}", f"algo={algo}", "logger=none", "device=cpu", *swap])
    train, privacy = preset["train"], preset["privacy"]
    train.update(batch_size=BATCH, physical_batch_size=min(train["physical_batch_size"] or BATCH, BATCH), epochs=None,
                 steps=train["steps"] or 100)
    if privacy["noise_multiplier"] is None:
        privacy.update(noise_multiplier=1.0, epsilon=None)  # sigma instead of the preset's epsilon: both are refused
        if preset["algo"].get("budget_split") == "epsilon":
            preset["algo"]["score_noise_multiplier"] = 1.0  # DC-DPSGD's sigma_tr, calibrated beside sigma_dp
    if not algorithm_class(algo).private:  # the grid's privacy keys are its private jobs' (a single run refuses them)
        privacy.update(noise_multiplier=None, epsilon=None)
    with open_dict(cfg):
        for section in ("train", "privacy", "algo"):
            for key, value in preset[section].items():
                cfg[section][key] = value
    return cfg


def signature(cfg) -> str:
    """What decides the check's outcome: the config without names and report keys."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    return json.dumps({k: v for k, v in plain.items() if k not in ("name", "report", "paper_setting")}, sort_keys=True)


def step_changes(cfg, job=None) -> tuple[float, float, float]:
    """(fraction of the weights that should change that changed, step loss, loss after the step)."""
    job = job or setup(cfg)
    algorithm, task, model = job.algorithm, job.task, job.model
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    # Private releases noise every coordinate and zeroth-order steps move along a dense direction:
    # every trainable weight should change. A non-private first-order step moves what has a gradient.
    should = [torch.ones_like(p, dtype=torch.bool) for p in trainable]
    optimizer = getattr(algorithm, "optimizer", None)
    if not algorithm.private and isinstance(optimizer, torch.optim.Optimizer):
        def has_gradient(*_):
            for i, p in enumerate(trainable):
                should[i] = torch.zeros_like(p, dtype=torch.bool) if p.grad is None else p.grad != 0
        optimizer.register_step_pre_hook(has_gradient)
    physical = cfg.train.physical_batch_size or BATCH
    chunks = [task.batch(list(range(i, min(i + physical, BATCH)))) for i in range(0, BATCH, physical)]
    # A noise draw near 0 leaves a zeroth-order step (lr·scalar·z) below many weights' float
    # resolution (about 1% of draws at the DPZero presets' lr 1e-6): noise of one std everywhere
    # makes "every weight moves" a property of the step, not of the draw.
    with mock.patch.object(GaussianNoise, "sample", lambda self, shape, std, dtype=torch.float32:
                           torch.full(tuple(shape), float(std), dtype=dtype, device=self.device)):
        result = algorithm.train_step(chunks, 0)
    changed = sum(int(((p.detach() != b) & s).sum()) for p, b, s in zip(trainable, before, should))
    expected = sum(int(s.sum()) for s in should)
    with torch.no_grad():
        after = float(sum(algorithm.per_example_losses(c).float().sum() for c in chunks)) / BATCH
    return changed / max(expected, 1), result.loss, after


_checked: dict[str, tuple[float, float, float]] = {}  # presets that share a stand-in job share its check


def check_one_step(name: str, algo: str, text_data: Path) -> None:
    cfg = stand_in(name, algo, text_data)
    key = signature(cfg)
    if key not in _checked:
        _checked[key] = step_changes(cfg)
    changed, loss, after = _checked[key]
    assert changed >= 0.99, f"{name} algo={algo}: only {changed:.1%} of the weights moved"
    assert math.isfinite(loss) and math.isfinite(after), (name, algo, loss, after)


# bench_mini (the CPU preset every algorithm is in) in the fast tier, a test per algorithm. Every other
# preset is slow, one test each over its grid's algorithms: reading a grid composes the preset, and
# composing all 60 to parametrize would cost each test worker about 15 s at collection.
@pytest.mark.parametrize("algo", sweep("bench_mini")["algo"])
def test_one_step_of_each_bench_mini_algorithm_trains_its_weights(algo, text_data):
    check_one_step("bench_mini", algo, text_data)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in PRESETS if name != "bench_mini"])
def test_one_step_of_each_preset_algorithm_trains_its_weights(name, text_data):
    for algo in sweep(name)["algo"]:
        check_one_step(name, algo, text_data)


@pytest.mark.slow  # every point of every grid (tests/run/test_config.py composes each preset's own point, slow too)
@pytest.mark.parametrize("name", PRESETS)
def test_every_point_of_every_preset_grid_composes(name):
    """Hydra composes each combination of the grid's config groups, each algorithm with its own
    schema and no key outside every schema (presets set options of some algorithms for their
    whole grid: algo.rank=64 for grape and dpadam jobs alike); the other keys are set on it (as an
    override would) and every interpolation of the point must resolve."""
    bases = {}
    for point in itertools.product(*[[f"{k}={v}" for v in vs] for k, vs in sweep(name).items()]):
        cfg = compose_point([f"experiment={name}", *point], bases)
        assert OmegaConf.get_type(cfg.algo) is algo_schemas()[cfg.algo.name], (name, point)
        check_keys(cfg)
        OmegaConf.to_container(cfg, resolve=True)  # per-algorithm / per-size interpolations included


def _tiny_opt(text_data: Path, *overrides: str):
    return compose(["model=opt", "model.size=tiny", "dataset=boolq", f"dataset.path={text_data / 'boolq'}",
                    "dataset.num_train=24", "dataset.num_dev=4", "dataset.num_test=4", "logger=none", "device=cpu",
                    f"train.batch_size={BATCH}", "train.steps=10", "privacy.noise_multiplier=1.0", *overrides])


@pytest.mark.parametrize("algo", ["dpadam", "adam", "dpzero"])
def test_low_precision_trainable_weights_are_refused(text_data, algo):
    from dpbench.errors import UserError

    with pytest.raises(UserError, match="model.dtype=float16 leaves .* no fp32 master copy"):
        no_sigma = [] if algorithm_class(algo).private else ["privacy.noise_multiplier=null"]  # refused for a non-private run
        setup(_tiny_opt(text_data, f"algo={algo}", "model.dtype=float16", *no_sigma))


def test_a_frozen_low_precision_base_may_stay_low(text_data):
    """DP-LoRA on a bf16 base: the base stays bf16, its adapters train in fp32."""
    cfg = _tiny_opt(text_data, "algo=dplora", "model.dtype=bfloat16", "train.precision=bf16", "train.lr=1e-3")
    job = setup(cfg)
    dtypes = {(p.requires_grad, p.dtype) for p in job.model.parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}
    changed, loss, after = step_changes(cfg, job)
    assert changed >= 0.99 and math.isfinite(loss) and math.isfinite(after)
