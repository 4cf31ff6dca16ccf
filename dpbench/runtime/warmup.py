"""The warm-up every job pays alike before its memory is metered.

A job's own peak (dpbench/runtime/metering.py) is the resident size it adds after the meter's reset.
The first job of a process would also pay for what any job does once per process: importing the
libraries its model, data and algorithm load lazily (scikit-learn and pandas for the digits alone
add about 80 MB), and the first call of each kind of kernel. A later job of the same grid finds
them done, so a grid's memory ratios depended on which job ran first (a job that ran first read
2.4x the own peak of the same config run fifth). `warm_up(cfg)` does all of it before the reset,
for every job, so the same config reads the same own peak whether it runs first, fifth or alone.

It reads no data: imports and a few kernels on random public tensors. A component that imports a
library when it runs declares it, so the warm-up finds it here: a model family's `libraries`
(dpbench/models), a data loader's `libraries` attribute, an algorithm class's `libraries`.
"""

from __future__ import annotations

import importlib
import pkgutil

import torch
import torch.nn.functional as F

# What every job may load lazily, whatever its components (accountants, engines, the saved model).
EVERY_JOB = ("opacus.grad_sample", "opacus.accountants.analysis.rdp", "opacus.accountants.analysis.prv",
             "dp_accounting.pld", "dp_accounting.rdp", "scipy.stats", "safetensors.torch",
             "torch.utils.serialization",  # checkpoint.pt's torch.save
             "torch.profiler._cupti_monitor",  # imported by torch on its first profiler use (seen in LoRA and zeroth-order jobs)
             "rich._emoji_codes")  # the console's first print


def libraries_of(cfg) -> list[str]:
    """The libraries the job's model family, data loader and algorithm declare, and EVERY_JOB."""
    from dpbench.algorithms import ALGORITHMS
    from dpbench.data import DATASETS
    from dpbench.models import MODELS

    found = list(EVERY_JOB)
    model, dataset, algo = str(cfg.model.get("name", "")), str(cfg.dataset.get("name", "")), str(cfg.algo.get("name", ""))
    if model in MODELS.names():
        found += MODELS.get(model).family.libraries
    if dataset in DATASETS.names():
        found += getattr(DATASETS.get(dataset), "libraries", ())
    if algo in ALGORITHMS.names():
        found += getattr(ALGORITHMS.get(algo), "libraries", ())
    return list(dict.fromkeys(found))


def import_package(name: str = "dpbench", skip: tuple[str, ...] = ("dpbench.tools",)) -> None:
    """Every module of dpbench's core (the registries' discovery imports them anyway, lazily)."""
    package = importlib.import_module(name)
    for module in pkgutil.walk_packages(package.__path__, f"{name}."):
        if not module.name.startswith(skip):
            try:
                importlib.import_module(module.name)
            except ImportError:  # an optional extra that is not installed: its jobs cannot run here either
                pass


def run_kernels() -> None:
    """One forward and backward of the common kernels, at the job's thread count (set before)."""
    x = torch.randn(8, 4, 32, requires_grad=True)
    weight = torch.randn(32, 32, requires_grad=True)
    y = F.gelu(F.layer_norm(x @ weight, (32,))).softmax(-1)
    images = torch.randn(2, 3, 8, 8, requires_grad=True)
    z = F.group_norm(F.conv2d(images, torch.randn(4, 3, 3, 3, requires_grad=True), padding=1), 2)
    loss = F.cross_entropy(y.mean(1), torch.tensor([1] * 8)) + z.square().mean()
    loss += F.embedding(torch.tensor([[1, 2]]), torch.randn(4, 32, requires_grad=True)).sum()
    loss.backward()


def warm_up(cfg) -> None:
    """Import what the job will import and run the common kernels once, before the meter's reset."""
    import_package()
    for name in libraries_of(cfg):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not installed: the component refuses in its own words when it runs
    run_kernels()
