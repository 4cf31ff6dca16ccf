"""`dpbench.api.train_module`: a user's nn.Module and map-style datasets trained from Python with a
dpbench algorithm (the make_private habit), through the same checks as the config route."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from dpbench.api import train_module
from dpbench.errors import UserError

SMALL = ["logger=none", "train.steps=2", "train.batch_size=32", "train.eval_every=2"]


def clusters(n: int, generator: torch.Generator) -> TensorDataset:
    labels = torch.arange(n) % 3
    return TensorDataset(torch.randn(n, 6, generator=generator) + 3 * F.one_hot(labels, 6).float(), labels)


def data():
    generator = torch.Generator().manual_seed(0)
    return clusters(120, generator), clusters(30, generator)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def per_example(outputs, labels):
    return F.cross_entropy(outputs, labels, reduction="none")


@pytest.mark.slow  # a run of seconds: the fast tier stays under its 5 minutes
def test_a_users_module_is_trained_in_place_with_its_own_loss(tmp_path):
    model, (train, test) = mlp(), data()
    before = model[0].weight.detach().clone()
    results = train_module(model, train, test, num_classes=3, overrides=["algo=grape", *SMALL], loss=per_example,
                           trained_modules=["2"], run_dir=tmp_path / "run", quiet=True)
    assert results.status == "completed" and results.model == "module" and 0 < results.privacy.epsilon <= 8
    assert results.algorithm["projected_layers"] == ["0"]  # every Linear outside the declared head
    assert not torch.equal(model[0].weight.detach(), before)  # the caller's module itself was trained


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
         "_load_state_dict_pre_hooks")


def as_handed(model: nn.Module) -> list:
    """What a run could leave on a module besides its weights: layers, hooks, attributes, flags, mode."""
    modules = [(name, type(m), sorted(vars(m)), [len(getattr(m, h, {})) for h in HOOKS], m.training)
               for name, m in model.named_modules()]
    params = [(name, sorted(vars(p)), p.requires_grad, p.dtype, p.device) for name, p in model.named_parameters()]
    return [modules, params]


@pytest.mark.parametrize("algo, families", [
    ("grape", {"trained_modules": ["2"]}),  # an engine's hooks and per-example attributes on the module
    ("dplora", {"lora_targets": ["0"], "trained_modules": ["2"]}),  # peft layers injected, the base frozen
])
def test_train_module_hands_the_module_back_as_it_was_with_its_trained_weights(algo, families, tmp_path):
    """No hooks, no Opacus attributes, no adapters or frozen flags are left on the caller's module:
    another engine is built on it and forms the same clipped sum as on a fresh copy."""
    from dpbench.privacy.engines import build_engine

    model, (train, test) = mlp(), data()
    handed = as_handed(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    train_module(model, train, test, num_classes=3, overrides=[f"algo={algo}", *SMALL], loss=per_example,
                 run_dir=tmp_path / "run", quiet=True, **families)
    assert as_handed(model) == handed
    assert not torch.equal(model[0].weight, before["0.weight"])  # trained (LoRA: the adapters merged into it)
    x, y = train.tensors[0][:5], train.tensors[1][:5]
    fresh = mlp()
    fresh.load_state_dict(model.state_dict())
    for mode in ("materialize", "bk"):
        sums = []
        for module in (model, fresh):
            engine = build_engine(mode, module, unprobed=True)  # an MLP: one row per example
            sums.append(engine.clipped_sum(per_example(module(x), y), lambda norms: torch.ones_like(norms)))
            engine.detach()
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*sums)), mode


def batch_mean(outputs, labels):
    return F.cross_entropy(outputs, labels)


def centred(outputs, labels):
    losses = F.cross_entropy(outputs, labels, reduction="none")
    return losses - losses.mean()  # one example's loss depends on the others


REFUSED = {
    "a DataLoader": (lambda train: {"train": DataLoader(train, batch_size=8)}, {}, [],
                     "train_module: train is a DataLoader; return its map-style dataset"),
    "a model override": (lambda train: {}, {}, ["model=cnn"], "leave model=cnn out of overrides"),
    "a batch-mean loss": (lambda train: {}, {"loss": batch_mean}, [],
                          "returned a scalar; it must return one loss per example"),
    "a loss that mixes examples": (lambda train: {}, {"loss": centred}, [], "mixes examples within the rows"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_train_module_refuses_is_one_line(case, tmp_path):
    splits, keywords, overrides, message = REFUSED[case]
    train, test = data()
    arguments = {"train": train, "test": test, **splits(train)}
    with pytest.raises(UserError, match=message) as refused:
        train_module(mlp(), arguments["train"], arguments["test"], num_classes=3, overrides=["algo=dpsgd", *SMALL, *overrides],
                     run_dir=tmp_path / "run", quiet=True, **keywords)
    assert "\n" not in str(refused.value)
