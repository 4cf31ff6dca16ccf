"""Image classification datasets: bundled digits, generated synthetic data, torchvision's sets."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dpbench.data import DATASETS, ImageDataset
from dpbench.errors import UserError


# Per-channel (mean, std) that image inputs are standardised with: fixed constants, never
# statistics of the loaded training set (those would make every input, and so the test loss
# of an untrained model, depend on every training record, uncharged). Each is a published value,
# public information fixed before any run (no record a run loads can change it); one line per
# constant says where it comes from.
PUBLIC_STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    # digits: pixels 0..16 scaled by the format's fixed range (x/16 in [0, 1]), then 0.5/0.5 -> [-1, 1]; no data read.
    "digits": ((0.5,), (0.5,)),
    # MNIST: 0.1307 / 0.3081, the published values of the PyTorch MNIST example (public, fixed).
    "mnist": ((0.1307,), (0.3081,)),
    # Fashion-MNIST: 0.2860 / 0.3530, the per-pixel values widely published for it (public, fixed).
    "fashion_mnist": ((0.2860,), (0.3530,)),
    # CIFAR-10: the widely published per-channel mean and per-pixel std of its train split (public, fixed).
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    # CIFAR-100: the widely published per-channel mean and std of its train split (public, fixed).
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    # SVHN: the widely published per-channel mean and std of its train split (public, fixed).
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
    # ImageNette (an ImageNet subset): torchvision's published ImageNet values (public, fixed).
    "imagenette": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
}


def _normalise(name: str, *splits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-channel standardisation of [N, C, H, W] images in [0, 1] with the public constants of
    `name` (PUBLIC_STATS): a fixed map, the same for every record, read from no data."""
    if name not in PUBLIC_STATS:
        raise KeyError(f"no public normalisation constants for dataset {name!r}; add them to PUBLIC_STATS")
    mean, std = PUBLIC_STATS[name]
    mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1)
    return tuple((split - mean) / std for split in splits)


@DATASETS.register("digits")
def load_digits(cfg, seed: int) -> ImageDataset:
    """scikit-learn's bundled 8x8 digits (1797 images, 10 classes): a fixed stratified 80/20 split."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    digits = sklearn_digits()
    images = digits.images.astype(np.float32)[:, None] / 16.0  # the format's fixed 0..16 range, not a statistic
    train_x, test_x, train_y, test_y = train_test_split(
        images, digits.target, test_size=0.2, stratify=digits.target, random_state=cfg.split_seed
    )
    train, test = _normalise("digits", torch.from_numpy(train_x), torch.from_numpy(test_x))
    return ImageDataset(
        train, torch.from_numpy(train_y).long(), test, torch.from_numpy(test_y).long(), 10, cfg.patch_size
    )


load_digits.libraries = ("sklearn.datasets", "sklearn.model_selection", "sklearn.datasets.data", "sklearn.datasets.descr")  # imported when it runs (runtime/warmup.py)


@DATASETS.register("synthetic")
def load_synthetic(cfg, seed: int) -> ImageDataset:
    """Gaussian class clusters of any shape: learnable, tiny, generated on the spot (for tests)."""
    generator = torch.Generator().manual_seed(cfg.data_seed)
    shape = (cfg.channels, cfg.image_size, cfg.image_size)
    centres = torch.randn((cfg.num_classes, *shape), generator=generator)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.arange(n) % cfg.num_classes
        noise = torch.randn((n, *shape), generator=generator) * cfg.noise
        return centres[labels] + noise, labels

    train_x, train_y = draw(cfg.train_size)
    test_x, test_y = draw(cfg.test_size)
    return ImageDataset(train_x, train_y, test_x, test_y, cfg.num_classes, cfg.patch_size)


# torchvision datasets: (class name, constructor split argument, files expected under data_dir).
TORCHVISION = {
    "mnist": ("MNIST", "train", "MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    "fashion_mnist": ("FashionMNIST", "train", "FashionMNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte"),
    "cifar10": ("CIFAR10", "train", "cifar-10-batches-py/{data_batch_1..5,test_batch,batches.meta}"),
    "cifar100": ("CIFAR100", "train", "cifar-100-python/{train,test,meta}"),
    "svhn": ("SVHN", "split", "{train,test}_32x32.mat"),
}


def _torchvision_split(cfg, train: bool):
    import torchvision

    class_name, split_arg, files = TORCHVISION[cfg.name]
    dataset_class = getattr(torchvision.datasets, class_name)
    root = Path(cfg.data_dir).expanduser()
    kwargs = {"train": train} if split_arg == "train" else {"split": "train" if train else "test"}
    try:
        try:
            return dataset_class(root=str(root), download=False, **kwargs)
        except RuntimeError:
            if not cfg.download:
                raise
            return dataset_class(root=str(root), download=True, **kwargs)
    except Exception as error:  # offline download, missing or corrupt files
        raise UserError(
            f"dataset {cfg.name} is not under {root} (expected {files}) and could not be downloaded "
            f"({type(error).__name__}); copy the files there or set dataset.data_dir=PATH"
        ) from None


def _to_tensors(split) -> tuple[torch.Tensor, torch.Tensor]:
    data = split.data
    data = torch.as_tensor(np.asarray(data))
    if data.dim() == 3:  # MNIST-like [N, H, W]
        data = data[:, None]
    elif data.shape[-1] in (1, 3) and data.shape[1] not in (1, 3):  # CIFAR [N, H, W, C]
        data = data.permute(0, 3, 1, 2)
    labels = getattr(split, "targets", None)
    if labels is None:
        labels = split.labels
    return data.float() / 255.0, torch.as_tensor(np.asarray(labels)).long()


def _load_torchvision(cfg, seed: int) -> ImageDataset:
    train_x, train_y = _to_tensors(_torchvision_split(cfg, train=True))
    test_x, test_y = _to_tensors(_torchvision_split(cfg, train=False))
    train_x, test_x = _normalise(cfg.name, train_x, test_x)
    return ImageDataset(train_x, train_y, test_x, test_y, cfg.num_classes, cfg.patch_size)


for _name in TORCHVISION:
    DATASETS.register(_name)(_load_torchvision)


# --- ImageNette and the long-tailed variants (DC-DPSGD's datasets) ------------------------------


@DATASETS.register("imagenette")
def load_imagenette(cfg, seed: int) -> ImageDataset:
    """fast.ai's ImageNette through torchvision's reader (root/imagenette2[-320|-160]/{train,val}/<wnid>/*.JPEG).

    Every image is resized to dataset.image_size squared (DC-DPSGD's code trains at 32x32) and
    held in memory as one tensor; the val split is the test set (3,925 images).
    """
    import torchvision
    from torchvision import transforms

    root = Path(cfg.data_dir).expanduser()
    size = int(cfg.image_size)
    to_tensor = transforms.Compose([transforms.Resize((size, size)), transforms.PILToTensor()])

    def split(name: str) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            dataset = torchvision.datasets.Imagenette(
                str(root), split=name, size=cfg.size, download=bool(cfg.download), transform=to_tensor
            )
        except Exception as error:  # offline download, missing files
            raise UserError(
                f"dataset imagenette is not under {root} (expected imagenette2{'' if cfg.size == 'full' else '-' + cfg.size}"
                f"/{{train,val}}/<wnid>/*.JPEG) and could not be downloaded ({type(error).__name__}); "
                "copy it there or set dataset.data_dir=PATH"
            ) from None
        images, labels = zip(*(dataset[i] for i in range(len(dataset))))
        return torch.stack(images).float() / 255.0, torch.as_tensor(labels).long()

    train_x, train_y = split("train")
    test_x, test_y = split("val")
    train_x, test_x = _normalise("imagenette", train_x, test_x)
    return ImageDataset(train_x, train_y, test_x, test_y, 10, cfg.patch_size)


def long_tail_indices(labels: torch.Tensor, num_classes: int, imbalance_factor: float, seed: int) -> np.ndarray:
    """Training indices of the exponential long-tail profile of Cao et al. 2019 (LDAM-DRW).

    Class c keeps int(n_max * imbalance^(c/(K-1))) examples, n_max = N/K, chosen by the same
    legacy-numpy shuffle as LDAM-DRW's IMBALANCECIFAR10 (seed 0 gives its subset):
    CIFAR-10-LT at 0.01 has 12,406 images, ImageNette-LT 2,345.
    """
    targets = labels.numpy()
    n_max = len(targets) / num_classes
    rng = np.random.RandomState(seed)
    keep = []
    for c in range(num_classes):
        count = int(n_max * imbalance_factor ** (c / (num_classes - 1.0)))
        idx = np.where(targets == c)[0]
        rng.shuffle(idx)
        keep.append(idx[:count])
    return np.concatenate(keep)


def _load_long_tailed(cfg, seed: int) -> ImageDataset:
    from omegaconf import OmegaConf

    source = OmegaConf.merge(cfg, {"name": cfg.source})
    data = DATASETS.get(cfg.source)(source, seed)
    keep = torch.from_numpy(long_tail_indices(data.train_labels, data.num_classes, float(cfg.imbalance_factor), int(cfg.lt_seed)))
    data.train_images, data.train_labels = data.train_images[keep], data.train_labels[keep]
    return data


for _name in ("cifar10_lt", "imagenette_lt"):
    DATASETS.register(_name)(_load_long_tailed)
