"""Models, datasets (real loaders on fixture files in the real formats), LDAM, configs end to end."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.config import FIXED_SIGMA, OFFLINE, compose  # calibration: tested in test_dcdpsgd/test_dpdr
from omegaconf import OmegaConf

from dpbench.data import load_dataset
from dpbench.data.images import long_tail_indices
from dpbench.errors import UserError
from dpbench.models import DataSpec, build_model
from dpbench.paths import config_dir
from dpbench.run import run_job
from dpbench.tasks.image import ldam_margins


# --- fixture files ---------------------------------------------------------------------------
def _write_idx(path: Path, array: np.ndarray, magic: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape))
        f.write(array.astype(np.uint8).tobytes())


def write_mnist(root: Path, folder: str = "MNIST", n_train: int = 40, n_test: int = 20) -> None:
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(root / folder / "raw" / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), 2051)
        _write_idx(root / folder / "raw" / f"{prefix}-labels-idx1-ubyte", np.arange(n) % 10, 2049)


def write_cifar10(root: Path, per_batch: int = 100) -> None:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        entry = {"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8), "labels": list(np.arange(per_batch) % 10)}
        with open(folder / name, "wb") as f:
            pickle.dump(entry, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"c{i}" for i in range(10)]}, f)


WNIDS = ["n01440764", "n02102040", "n02979186", "n03000684", "n03028079",
         "n03394916", "n03417042", "n03425413", "n03445777", "n03888257"]


def write_imagenette(root: Path, per_class: int = 2) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for wnid in WNIDS:
            folder = root / "imagenette2-160" / split / wnid
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (40 + i, 30, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{wnid}_{i}.JPEG")


@pytest.fixture
def skip_md5(monkeypatch):
    """Fixture files cannot match torchvision's md5 sums; everything else is the real reader."""
    import torchvision.datasets.cifar
    import torchvision.datasets.svhn

    for module in (torchvision.datasets.cifar, torchvision.datasets.svhn):
        monkeypatch.setattr(module, "check_integrity", lambda *args, **kwargs: True)


def _dataset_cfg(name: str, tmp_path: Path, **extra):
    cfg = compose([*OFFLINE, f"dataset={name}", f"dataset.data_dir={tmp_path}", "dataset.download=false"]).dataset
    return OmegaConf.merge(cfg, extra)


# --- datasets ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashion_mnist", "FashionMNIST")])
def test_mnist_idx_files_load(tmp_path, name, folder):
    write_mnist(tmp_path, folder)
    data = load_dataset(_dataset_cfg(name, tmp_path), 0)
    assert data.train_images.shape == (40, 1, 28, 28) and data.test_images.shape == (20, 1, 28, 28)
    assert data.train_labels.tolist() == [i % 10 for i in range(40)]


def test_cifar10_and_its_long_tail_load(tmp_path, skip_md5):
    write_cifar10(tmp_path)
    full = load_dataset(_dataset_cfg("cifar10", tmp_path), 0)
    assert full.train_images.shape == (500, 3, 32, 32) and full.test_images.shape == (100, 3, 32, 32)
    lt = load_dataset(_dataset_cfg("cifar10_lt", tmp_path), 0)
    expected = [int(50 * 0.01 ** (c / 9)) for c in range(10)]  # 50, 29, 17, 10, 6, 3, 2, 1, 0, 0
    assert torch.bincount(lt.train_labels, minlength=10).tolist() == expected
    assert lt.test_images.shape == (100, 3, 32, 32)  # the test set stays balanced


def test_svhn_mat_files_load(tmp_path, skip_md5):
    from scipy.io import savemat

    rng = np.random.default_rng(0)
    for split, n in (("train", 30), ("test", 10)):
        savemat(tmp_path / f"{split}_32x32.mat",
                {"X": rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8), "y": (np.arange(n) % 10 + 1)[:, None]})
    data = load_dataset(_dataset_cfg("svhn", tmp_path), 0)
    assert data.train_images.shape == (30, 3, 32, 32) and data.train_labels.max() == 9


def test_imagenette_folder_layout_loads_and_long_tail(tmp_path):
    write_imagenette(tmp_path, per_class=3)
    data = load_dataset(_dataset_cfg("imagenette", tmp_path, size="160px", image_size=16), 0)
    assert data.train_images.shape == (30, 3, 16, 16) and data.test_images.shape == (30, 3, 16, 16)
    assert torch.bincount(data.train_labels).tolist() == [3] * 10
    lt = load_dataset(_dataset_cfg("imagenette_lt", tmp_path, size="160px", image_size=16), 0)
    assert torch.bincount(lt.train_labels, minlength=10).tolist() == [int(3 * 0.01 ** (c / 9)) for c in range(10)]


def test_missing_data_is_a_one_line_user_error(tmp_path):
    with pytest.raises(UserError, match="imagenette"):
        load_dataset(_dataset_cfg("imagenette", tmp_path), 0)


def test_long_tail_profile_matches_the_paper_counts():
    cifar = long_tail_indices(torch.arange(50000) % 10, 10, 0.01, 0)
    assert len(cifar) == 12406 and len(set(cifar.tolist())) == 12406
    assert len(long_tail_indices(torch.arange(9469) % 10, 10, 0.01, 0)) == 2345
    again = long_tail_indices(torch.arange(50000) % 10, 10, 0.01, 0)
    assert np.array_equal(cifar, again)  # fixed seed, fixed subset


# --- loss ---------------------------------------------------------------------------------------
def test_ldam_margins_and_loss():
    margins = ldam_margins(torch.tensor([5000, 500, 50]), 0.5)
    assert margins.tolist() == pytest.approx([0.5 * (5000 / n) ** 0.25 / (5000 / 50) ** 0.25 for n in (5000, 500, 50)])
    cfg = compose([*OFFLINE, "dataset=synthetic", "+dataset.loss=ldam", "model=cnn"])
    from dpbench.tasks import build_task

    task = build_task(cfg, torch.device("cpu"))
    model = build_model(cfg.model, task.model_spec())
    images, labels = task.batch(list(range(8)))
    logits = model(images)
    shifted = logits.clone()
    shifted[torch.arange(8), labels] -= task.margins[labels]
    expected = torch.nn.functional.cross_entropy(30 * shifted, labels, reduction="none")
    assert torch.allclose(task.per_sample_loss(model, (images, labels)), expected, atol=1e-5)


# --- models -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,spec,params", [
    ("tanh_cnn", DataSpec(10, 1, 28), 26010),
    ("cnn5", DataSpec(10, 3, 32), 357258),
    ("resnet9", DataSpec(10, 3, 32), 6568650),
])
def test_model_sizes(name, spec, params):
    model = build_model(OmegaConf.load(Path(config_dir()) / "model" / f"{name}.yaml"), spec)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.zeros(2, spec.channels, spec.image_size, spec.image_size)).shape == (2, 10)


def test_resnet18_has_groupnorm_only():
    model = build_model(OmegaConf.create({"name": "resnet18", "groups": 32, "stem": "cifar"}), DataSpec(10, 3, 32))
    kinds = {type(m).__name__ for m in model.modules()}
    assert "GroupNorm" in kinds and "BatchNorm2d" not in kinds


# --- end to end on synthetic data (slow: a run each) --------------------------------------------
SMALL = ["dataset=synthetic", "train.steps=2", "train.batch_size=8", "train.eval_every=2", "dataset.test_size=16",
         "dataset.train_size=64"]


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [
    ["algo=dcdpsgd", "model=tanh_cnn", "dataset.image_size=28", "train.physical_batch_size=4"],  # calibrated
    ["algo=dpdr", "model=cnn5", "dataset.channels=3", "dataset.image_size=32", "algo.decomposition_steps=2", *FIXED_SIGMA],
    ["algo=dpdr", "model=resnet9", "model.width=8", "dataset.channels=3", "dataset.image_size=16", *FIXED_SIGMA],
    ["algo=dcdpsgd", "model=resnet18", "dataset.channels=3", "dataset.image_size=16", "algo.score_params=first", "train.batch_size=2",
     "train.steps=1", "dataset.image_size=8", *FIXED_SIGMA],
    ["algo=dpsgd", "model=cnn", "privacy.clipping=psac", *FIXED_SIGMA],
    ["algo=dpdr", "model=cnn", "algo.paper_accounting=true", "privacy.noise_multiplier=0.6", "algo.sigma_perp=0.6", "algo.sigma_alpha=0.8", "algo.claimed_epsilon=8"],
])
def test_new_configs_run_end_to_end(tmp_path, overrides):
    cfg = compose([*OFFLINE, *SMALL, *overrides])
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.status == "completed" and results.privacy.epsilon > 0
    if cfg.algo.name == "dcdpsgd":
        assert results.algorithm["sigma_tr"] == pytest.approx(results.algorithm["sigma_dp"])
    if cfg.algo.name == "dpdr" and cfg.algo.paper_accounting:
        assert results.algorithm["claimed_epsilon"] == 8 and results.algorithm["sigma_alpha"] == 0.8


EXPERIMENTS = sorted(
    p.stem for p in (Path(config_dir()) / "experiment").glob("*.yaml") if p.stem.startswith(("dcdpsgd_", "dpdr_"))
)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_experiment_configs_compose(experiment):
    real = compose([*OFFLINE, f"experiment={experiment}"])
    assert real.dataset.name != "synthetic" and real.algo.name in ("dcdpsgd", "dpdr")
    assert real.name == experiment and real.model.name in ("tanh_cnn", "cnn5", "resnet9", "resnet18")
    # the baselines of the paper's tables run on the same experiment config
    assert compose([*OFFLINE, f"experiment={experiment}", "algo=dpsgd", "privacy.clipping=psac"]).algo.name == "dpsgd"


@pytest.mark.parametrize("experiment", ["dcdpsgd_imagenette_lt", "dpdr_svhn"])
def test_experiment_configs_run_on_synthetic(tmp_path, experiment):
    cfg = compose([*OFFLINE, f"experiment={experiment}", *SMALL, "train.steps=1", "dataset.channels=3",
                   "dataset.image_size=16", "train.physical_batch_size=null", "model.name=cnn", *FIXED_SIGMA])
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.status == "completed"
