"""A researcher's own model and dataset, from a package outside the repository, with no edit to
dpbench (docs/bring-your-own.md): found through Hydra's search path, built by import path, trained
by dpbench's algorithms after the per-example checks; what those checks (or the data's shape) refuse
is one line and exit 2, with no run folder left."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from helpers.cli import dpbench, dpbench_in_process
from helpers.config import REPO
from helpers.user_package import write_user_package
from torch import nn

from dpbench.errors import UserError

SMALL = ["logger=none", "train.steps=2", "train.batch_size=32", "train.eval_every=2"]


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    """The user's folder, importable (its `my_dp` package) for this module's in-process runs."""
    folder = write_user_package(tmp_path_factory.mktemp("user"))
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    for name in [m for m in sys.modules if m == "my_dp" or m.startswith("my_dp.")]:
        del sys.modules[name]


def searchpath(folder) -> str:
    return f"hydra.searchpath=[file://{folder / 'my_conf'}]"


def test_the_search_path_finds_a_users_configs_and_the_schema_takes_them(user_folder):
    from dpbench.api import compose

    cfg = compose([searchpath(user_folder), "model=my_mlp", "dataset=my_csv", "algo=grape"])
    assert cfg.model.builder == "my_dp.models:tiny_mlp" and cfg.model.hidden == 16
    assert cfg.dataset.builder == "my_dp.data:csv_data" and cfg.dataset.num_classes == 3
    with pytest.raises(UserError, match="model=my_mlq is not an option of model; did you mean model=my_mlp"):
        compose([searchpath(user_folder), "model=my_mlq"])
    # a preset of the user's own, and the configs found as a package on sys.path (pkg://)
    preset = compose(["hydra.searchpath=[pkg://my_conf]", "experiment=mine"])
    assert (preset.model.name, preset.dataset.name, preset.algo.name, preset.train.batch_size) == ("my_mlp", "my_csv", "grape", 64)


def test_a_users_model_trains_with_its_declared_family(user_folder, tmp_path):
    """DP-GRAPE projects the Linear layer outside the declared head ("3"), and the model is the user's."""
    from dpbench.api import run

    results = run([searchpath(user_folder), "model=my_mlp", "dataset=my_csv", "algo=grape", *SMALL],
                  run_dir=tmp_path / "run", quiet=True)
    assert results.status == "completed" and results.model == "my_mlp" and results.dataset == "my_csv"
    assert results.algorithm["projected_layers"] == ["1"]
    assert 0 < results.privacy.epsilon <= 8


@pytest.mark.slow  # two whole runs (the fast tier's five minutes)
@pytest.mark.parametrize("algo", ["dpadam", "grape"])
def test_a_hugging_face_classifier_on_token_ids_trains_as_a_users_model(algo, user_folder, tmp_path):
    """docs/bring-your-own.md's tiny BERT from a config: int64 token ids reach it unchanged, its
    ModelOutput's logits are read, and it passes the per-example checks (layout probe, norms)."""
    from dpbench.api import run

    results = run(["model=custom", "model.builder=my_dp.hf:tiny_bert", "dataset=custom",
                   "dataset.builder=my_dp.hf:token_data", f"algo={algo}", *SMALL], run_dir=tmp_path / "run", quiet=True)
    assert results.status == "completed" and 0 < results.privacy.epsilon <= 8


def test_token_ids_stay_integers_and_pixels_become_floats():
    from torch.utils.data import TensorDataset

    from dpbench.data.user import load_user_dataset

    def data(x):
        return lambda cfg, seed: {"train": TensorDataset(x, torch.zeros(len(x))), "test": TensorDataset(x, torch.zeros(len(x))),
                                  "num_classes": 2}

    for given, kept in ((torch.arange(12).reshape(3, 4), torch.int64), (torch.ones(3, 4, dtype=torch.int32), torch.int64),
                        (torch.ones(3, 4, dtype=torch.uint8), torch.float32), (torch.ones(3, 4, dtype=torch.float64), torch.float32)):
        sys.modules["_tokens_test"] = type(sys)("_tokens_test")
        sys.modules["_tokens_test"].build = data(given)
        try:
            loaded = load_user_dataset({"builder": "_tokens_test:build"}, 0)
        finally:
            del sys.modules["_tokens_test"]
        assert loaded.train_images.dtype == kept and torch.equal(loaded.train_images, given.to(kept))


REFUSED = {  # overrides -> a piece of the one line
    "batch norm": (["model=custom", "model.builder=my_dp.bad:batch_norm_mlp"],
                   "layer 2 (BatchNorm1d) makes each example's output depend on the other examples"),
    "sequence-first LSTM": (["model=custom", "model.builder=my_dp.bad:lstm_model"],
                            "layer lstm (LSTM) has no per-example gradient rule"),
    "sequence-first attention": (["model=custom", "model.builder=my_dp.bad:sequence_first_attention"],
                                 "mixes examples within the rows of dimension 0 (its examples lie along dimension 1)"),
    "buffer from the batch": (["model=custom", "model.builder=my_dp.bad:running_mean"],
                              "buffer mean changes during a training forward"),
    "centres batches above 4": (["model=custom", "model.builder=my_dp.bad:centre_large_batches"],
                                "in a batch of"),  # the run's largest chunk (or the random size below it)
    "flips its batch": (["model=custom", "model.builder=my_dp.bad:flip_mix"], "mixes examples"),
    "norms against autograd": (["model=custom", "model.builder=my_dp.bad:shared_weight"],
                               "per-example gradient norm of example 0 differs from autograd's on that example alone"),
    "a name of dpbench's": (["model=custom", "model.builder=my_dp.models:tiny_mlp", "model.name=cnn"],
                            "model.name=cnn is one of dpbench's models; give your model another model.name"),
    "no builder": (["model=custom"], "model=custom needs model.builder=package.module:function"),
    "unimportable builder": (["model=custom", "model.builder=my_models.mlp:tiny"],
                             "model.builder=my_models.mlp:tiny: cannot import my_models; put the folder"),
    "misspelt builder": (["model=my_mlp", "model.builder=my_dp.models:tiny_mpl"],
                         "my_dp.models has no tiny_mpl; check the name after the colon"),
    "not an import path": (["model=my_mlp", "model.builder=my_dp.models.tiny_mlp"], "is not an import path"),
    "head pattern typo": (["model=custom", "model.builder=my_dp.models:tiny_mlp", "model.trained_modules=[head]"],
                          "model.trained_modules: 'head' matches no module of model=custom (its modules: 0, 1, 2, 3)"),
    "no dataset builder": (["dataset=custom"], "dataset=custom needs dataset.builder=package.module:function"),
    "a DataLoader": (["dataset.builder=my_dp.bad:loader_data"], "train is a DataLoader; return its map-style dataset"),
    "an IterableDataset": (["dataset.builder=my_dp.bad:iterable_data"],
                           "train is a Stream without __len__ and __getitem__"),
    "labels beyond num_classes": (["dataset.builder=my_dp.bad:too_few_classes"], "labels outside 0..num_classes-1"),
    # the first forward, before any work
    "a first layer that does not fit": (["model=custom", "model.builder=my_dp.bad:wrong_input_mlp"],
                                        "model=custom: its forward on one training example (input (1, 6) float32) "
                                        "failed: RuntimeError: mat1 and mat2 shapes cannot be multiplied (1x6 and 10x8) (in layer 0 (Linear)); "
                                        "make the model's first layer take that input"),
    "more outputs than classes": (["model=custom", "model.builder=my_dp.bad:wrong_output_mlp"],
                                  "returned shape (1, 5), not (1, 3) (batch, num_classes=3); give the last layer"),
    "a dict, not logits": (["model=custom", "model.builder=my_dp.bad:dict_output"],
                           "model=custom: its forward returned a dict; it must return the logits, a tensor of shape (batch, num_classes)"),
    "an exception in the model builder": (["model=custom", "model.builder=my_dp.bad:raising_model"],
                                          "model.builder=my_dp.bad:raising_model failed: ConfigAttributeError: "),
    "brackets in the message": (["model=custom", "model.builder=my_dp.bad:bracketed_error"],
                                "ValueError: expected inputs of shape [batch, features] (at "),
    "an exception in the data builder": (["dataset.builder=my_dp.bad:raising_data"],
                                         "dataset.builder=my_dp.bad:raising_data failed: FileNotFoundError: no such file: "
                                         "data/trian.csv (at "),
    "fractional labels": (["dataset.builder=my_dp.bad:fractional_labels"],
                          "train is labelled with a number with a fractional part at item 1; labels must be class indices"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_user_model_or_dataset_is_one_line_exit_2(case, user_folder, tmp_path):
    overrides, message = REFUSED[case]
    groups = ["model=my_mlp", "dataset=my_csv"]
    groups = [g for g in groups if not any(o.startswith(g.split("=")[0] + "=") for o in overrides)]
    result = dpbench_in_process(searchpath(user_folder), *groups, *overrides, "algo=grape", *SMALL, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "outputs").exists()  # the run folder Hydra made was removed again


@pytest.mark.slow  # two console scripts in fresh processes (about 20 s)
def test_a_user_package_outside_the_repository_trains_with_grape_and_passes_the_audit(tmp_path):
    """The documented route, as a user types it: the package on PYTHONPATH, the configs on Hydra's
    search path, nothing of dpbench changed."""
    folder = write_user_package(tmp_path / "user")
    work = tmp_path / "work"
    work.mkdir()
    path = os.pathsep.join([str(REPO), str(folder)])
    overrides = [searchpath(folder), "model=my_mlp", "dataset=my_csv", "algo=grape", "logger=none"]
    trained = dpbench(*overrides, "train.epochs=2", "train.batch_size=64", cwd=work, PYTHONPATH=path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    (results_file,) = work.glob("outputs/runs/*/results.json")
    results = json.loads(results_file.read_text())
    assert results["status"] == "completed" and results["model"] == "my_mlp"
    assert results["algorithm"]["projected_layers"] == ["1"] and 0 < results["privacy"]["epsilon"] <= 8
    audit = subprocess.run([sys.executable, "-m", "dpbench.tools.audit.cli", *overrides], cwd=work, capture_output=True,
                           text=True, timeout=300, env={**os.environ, "PYTHONPATH": path, "HOME": str(work),
                                                        "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"})
    assert audit.returncode == 0, audit.stdout[-3000:] + audit.stderr[-3000:]
    assert "every check holds" in audit.stdout + audit.stderr


@pytest.mark.slow  # the console script in a fresh process (about 15 s)
@pytest.mark.parametrize("overrides, message", [
    (["model=custom", "model.builder=my_dp.bad:wrong_output_mlp"], "returned shape (1, 5), not (1, 3)"),
    (["dataset.builder=my_dp.bad:fractional_labels"], "labelled with a number with a fractional part at item 1"),
], ids=["output count", "fractional labels"])
def test_the_console_script_refuses_a_mismatched_model_or_labels_with_no_folder(overrides, message, tmp_path):
    folder = write_user_package(tmp_path / "user")
    work = tmp_path / "work"
    work.mkdir()
    refused = dpbench(searchpath(folder), "model=my_mlp", "dataset=my_csv", *overrides, "algo=dpadam", *SMALL, cwd=work,
                      PYTHONPATH=os.pathsep.join([str(REPO), str(folder)]))
    assert refused.returncode == 2, refused.stderr[-3000:]
    lines = [line for line in (refused.stdout + refused.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines
    assert not (work / "outputs").exists()


class SharedWeight(nn.Module):
    """The head also reads the first layer's weight outside that layer's forward."""

    def __init__(self):
        super().__init__()
        self.first, self.head = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.first(x)) @ self.first.weight)


@pytest.mark.parametrize("limit", [2**31, 0], ids=["float64 copy", "own dtype"])
def test_the_norm_check_compares_the_engine_with_autograd_per_example(limit, monkeypatch):
    """Both paths: a float64 copy, and (a model too large for one) a copy in its own dtype."""
    from dpbench.models.user_checks import check_norms
    from dpbench.privacy.layout import LayoutProbe

    monkeypatch.setattr("dpbench.privacy.layout.FLOAT64_COPY_LIMIT", limit)
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=generator), torch.arange(8) % 3
    probe = LayoutProbe(lambda model, b: F.cross_entropy(model(b[0]), b[1], reduction="none"),
                        lambda indices: (x[indices], y[indices]), 8)
    torch.manual_seed(0)
    check_norms(nn.Sequential(nn.Linear(6, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3)), probe, "materialize", "m")
    with pytest.raises(UserError, match="per-example gradient norm of example 0 differs from autograd's"):
        check_norms(SharedWeight(), probe, "materialize", "m")
