"""A new model is one registered record plus a yaml. A toy language family (a tiny random-init
LLaMA) and a toy image model are registered here exactly as their own file in dpbench/models
would register them; task building, DP-GRAPE's projected modules and DP-LoRA's targets pick them
up with no other edit, and both train end to end. Also: discovery never imports transformers for
an image run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers.config import REPO, compose
from helpers.per_sample import assert_per_sample_grads_match
from helpers.text_data import write_dataset
from torch import nn

from dpbench.algorithms.projected_adam import select_projected_modules
from dpbench.errors import UserError
from dpbench.models import MODELS, DataSpec, ModelFamily, build_model, register_model
from dpbench.models.language import LanguageFamily, register_language_family
from dpbench.models.lora import inject_lora
from dpbench.tasks import build_task
from dpbench.tasks.causal_lm import CausalLMTask
from dpbench.tasks.image import ImageClassificationTask

CPU = torch.device("cpu")

# --- what dpbench/models/toyllama.py would hold ------------------------------------------------
LLAMA_BLOCK = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
TOY_LLAMA = LanguageFamily(
    objective="causal",
    language_task="causal_lm",
    model_type="llama",
    tiny_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                     num_key_value_heads=2, max_position_embeddings=256, pad_token_id=1, bos_token_id=2,
                     eos_token_id=2),
    projected_modules=tuple(f"*layers.*.{name}" for name in LLAMA_BLOCK),
    lora_targets=("q_proj", "v_proj"),
)


# --- what dpbench/models/toymlp.py would hold --------------------------------------------------
class ToyMLP(nn.Module):
    def __init__(self, spec: DataSpec, width: int):
        super().__init__()
        self.flatten = nn.Flatten()
        self.body = nn.Sequential(nn.Linear(spec.channels * spec.image_size**2, width), nn.Tanh(),
                                  nn.Linear(width, width), nn.Tanh())
        self.head = nn.Linear(width, spec.num_classes)

    def forward(self, x):
        return self.head(self.body(self.flatten(x)))


def build_toy_mlp(cfg, spec: DataSpec) -> nn.Module:
    return ToyMLP(spec, width=16)


TOY_MLP = ModelFamily(projected_modules=("body.*",), lora_targets=("body.0", "body.2"), trained_modules=("head",))


@pytest.fixture(scope="module", autouse=True)
def toy_families():
    """Register both toys for this module only (the registries' entries are restored afterwards)."""
    saved = {registry: (registry.names(), dict(registry._entries)) for registry in (MODELS,)}
    register_language_family("toyllama", TOY_LLAMA)
    register_model("toymlp", TOY_MLP)(build_toy_mlp)
    yield
    for registry, (_, entries) in saved.items():
        registry._entries = entries


@pytest.fixture(scope="module")
def sst2(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("families"), "sst2", n_train=24, n_test=8)


def toy_llama_cfg(sst2, *extra):
    # conf/model/toyllama.yaml would hold `name: toyllama, size: tiny, path: null, dtype: float32`;
    # here model=opt's yaml with the name swapped stands in for it.
    return compose(["dataset=sst2", f"dataset.path={sst2}", "model=opt", "model.name=toyllama", "model.size=tiny",
                    "logger=none", "train.batch_size=4", "train.steps=2", "train.eval_every=2", "train.lr=1e-3", *extra])


def toy_mlp_cfg(*extra):
    return compose(["dataset=synthetic", "model=cnn", "model.name=toymlp", "logger=none", "train.batch_size=32",
                    "train.steps=3", "train.eval_every=3", *extra])


def trainable(model: nn.Module) -> set[str]:
    return {name for name, p in model.named_parameters() if p.requires_grad}


def test_toy_language_family_builds_its_task_and_model_is_projected_and_adapted(sst2):
    cfg = toy_llama_cfg(sst2)
    torch.manual_seed(0)
    task = build_task(cfg, CPU)
    assert isinstance(task, CausalLMTask)  # the record's language_task, not a table in tasks/
    model = task.build_model(cfg.model)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert_per_sample_grads_match(task, model.train())  # Opacus needs no fix for this family
    projected = select_projected_modules(model, None)
    assert sorted(projected) == sorted(f"model.layers.{i}.{n}" for i in range(2) for n in LLAMA_BLOCK)
    model = inject_lora(model, compose(["algo=dplora"]).algo)
    adapted = {name.rsplit(".lora_", 1)[0] for name in trainable(model)}
    assert adapted == {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")}
    assert all(".lora_" in name for name in trainable(model))


def test_toy_image_model_is_built_projected_and_adapted():
    cfg = toy_mlp_cfg()
    task = build_task(cfg, CPU)
    assert isinstance(task, ImageClassificationTask)
    model = build_model(cfg.model, task.model_spec())
    assert isinstance(model, ToyMLP)
    assert sorted(select_projected_modules(model, None)) == ["body.0", "body.2"]
    model = inject_lora(model, compose(["algo=dplora"]).algo)
    names = trainable(model)
    assert {n for n in names if ".lora_" in n} and all(n.startswith(("body.0.lora_", "body.2.lora_")) for n in names - {"head.weight", "head.bias"})
    assert {"head.weight", "head.bias"} <= names


@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
@pytest.mark.parametrize("algo", ["grape", "dplora"])
def test_toy_families_train_end_to_end(algo, sst2, tmp_path):
    from dpbench.run import run_job

    for name, cfg in (("toyllama", toy_llama_cfg(sst2, f"algo={algo}")), ("toymlp", toy_mlp_cfg(f"algo={algo}"))):
        results = run_job(cfg, tmp_path / name, show_progress=False)
        assert results.status == "completed" and results.model == name
        assert 0 < results.privacy.epsilon <= 8.0
        if algo == "grape":
            assert len(results.algorithm["projected_layers"]) == {"toyllama": 14, "toymlp": 2}[name]
        assert results.metrics.train_loss == results.metrics.train_loss  # not NaN


def test_a_model_used_with_the_wrong_kind_of_dataset_is_a_user_error(sst2):
    with pytest.raises(UserError, match="is a language task; use model=bert or model=minilm or model=opt or model=roberta or model=toyllama"):
        build_task(compose(["dataset=sst2", f"dataset.path={sst2}", "model=vit"]), CPU)
    with pytest.raises(UserError, match="model=roberta is a language model"):
        build_model(compose(["model=roberta"]).model, DataSpec(num_classes=2))


@pytest.mark.slow  # a fresh interpreter
def test_discovering_every_registry_does_not_import_transformers():
    # The default job (an image run) must not import transformers; the registries import every
    # module of their package on first lookup, so each module must keep it inside functions.
    script = (
        "import sys; from dpbench.models import MODELS; from dpbench.tasks import TASKS; "
        "from dpbench.data import DATASETS; from dpbench.algorithms import import_all; import dpbench.run; "
        "import_all(); assert {'opt', 'roberta', 'vit'} <= set(MODELS.names()); "
        "assert {'causal_lm', 'prompt_mlm', 'image_classification'} <= set(TASKS.names()); DATASETS.names(); "
        "print('transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
