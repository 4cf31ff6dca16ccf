"""model.head_init=zero_shot on a tiny random BERT in the real on-disk format: the head's rows are
the normalised pooled embeddings of the label descriptions (computed here independently, with
transformers' BertModel), the untrained classifier predicts the nearest description, the refusals,
and what results.json records at train.steps=0. The descriptions are the fixture's own sentiment words."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.config import FIXED_SIGMA, OFFLINE, compose
from helpers.tiny_bert import tiny_bert_cfg, write_corpus, write_tiny_bert

from dpbench.errors import UserError
from dpbench.run_config import validate
from dpbench.tasks import build_task

CPU = torch.device("cpu")
DESCRIPTIONS = ["awful", "wonderful"]  # label 0, label 1: words of the fixture's vocabulary


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_bert_zero_shot")
    return write_tiny_bert(folder / "model"), write_corpus(folder / "corpus.csv.bz2")


def zero_shot_cfg(files, *extra):
    return tiny_bert_cfg(files, "model.head_init=zero_shot", f"dataset.label_descriptions=[{','.join(DESCRIPTIONS)}]", *extra)


def mean_pooled(folder, task, sequences) -> torch.Tensor:
    """The reference features: transformers' BertModel on its own (eval), the masked mean by hand."""
    from transformers import BertModel

    encoder = BertModel.from_pretrained(str(folder), add_pooling_layer=False).eval()
    batch = task.make_batch(sequences, [0] * len(sequences))
    with torch.no_grad():
        hidden = encoder(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    mask = batch.attention_mask.unsqueeze(-1).float()
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1)


@pytest.mark.parametrize("trained_blocks", [0, 1])  # the probe on the cached encoder; one layer trained
def test_head_rows_are_the_descriptions_and_the_untrained_model_predicts_the_nearest(files, trained_blocks):
    cfg = zero_shot_cfg(files, f"model.trained_blocks={trained_blocks}")
    validate(cfg)
    task = build_task(cfg, CPU)
    torch.manual_seed(0)
    model = task.build_model(cfg.model).train()
    assert model.prefix_cache is not None  # the frozen part is cached: the head was built beside it
    descriptions = mean_pooled(files[0], task, task.description_ids())  # [2, hidden]
    expected = F.normalize(descriptions, dim=1) / math.sqrt(3.0)
    torch.testing.assert_close(model.classifier.weight.detach(), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(model.classifier.bias.detach(), torch.zeros(2))
    assert model.training  # left as it was found
    # every test sentence, and the descriptions themselves: argmax = the nearest description (cosine)
    sequences = task.eval_ids + task.description_ids()
    features = mean_pooled(files[0], task, sequences)
    nearest = (F.normalize(features, dim=1) @ F.normalize(descriptions, dim=1).T).argmax(dim=1)
    with torch.no_grad():
        batch = task.make_batch(sequences, [0] * len(sequences))
        predicted = model.eval()(batch.input_ids, batch.attention_mask).argmax(dim=1)
    assert torch.equal(predicted, nearest)
    assert predicted[-2:].tolist() == [0, 1]  # each description is its own label


def test_the_refusals_are_one_line(files):
    with pytest.raises(UserError, match="model.head_init=warm is not known; use random or zero_shot"):
        validate(zero_shot_cfg(files, "model.head_init=warm"))
    with pytest.raises(UserError, match="needs dataset.label_descriptions, one non-empty text per class") as error:
        validate(zero_shot_cfg(files, "dataset.label_descriptions=null"))
    assert "\n" not in str(error.value)
    with pytest.raises(UserError, match="has 3 descriptions but dataset=rt_snippets has 2 classes"):
        build_task(zero_shot_cfg(files, "dataset.label_descriptions=[bad,fine,good]"), CPU)
    with pytest.raises(UserError, match=r"needs a text encoder with a classification head \(.*model=minilm.*\); model=vit has none"):
        validate(compose([*OFFLINE, "+model.head_init=zero_shot"]))
    validate(compose([*OFFLINE, "model=minilm", "dataset=rt_snippets"]))  # the default (random) needs no descriptions


def test_zero_steps_report_the_zero_shot_accuracy_and_record_what_was_used(files, tmp_path):
    """train.steps=0: results.json's test accuracy is the untrained zero-shot model's, at epsilon 0
    (no record read), and the config it records names the head and the descriptions."""
    from dpbench.logging.results import read_results
    from dpbench.run import run_job

    cfg = zero_shot_cfg(files, "algo=dpzero", *FIXED_SIGMA, "train.steps=0", "train.batch_size=4",
                         "train.physical_batch_size=4")
    results = run_job(cfg, tmp_path / "run", show_progress=False)
    task = build_task(cfg, CPU)
    assert results.metrics.test_accuracy == task.evaluate(task.build_model(cfg.model))["accuracy"]
    assert results.privacy.steps == 0 and results.privacy.epsilon == 0
    stored = read_results(tmp_path / "run")["config"]
    assert stored["model"]["head_init"] == "zero_shot" and stored["dataset"]["label_descriptions"] == DESCRIPTIONS


def test_resume_and_the_report_tell_zero_shot_runs_apart_and_keep_older_runs():
    """A run stored before head_init existed matches a random-head run (the descriptions are not
    read there); zero-shot runs with other descriptions do not match, and the report names them."""
    from dpbench.resume import config_differences
    from dpbench.tools.report.load import RunRow, flatten, method_name

    older = {"model": {"name": "minilm"}, "dataset": {"name": "rt_snippets"}}
    random_head = {"model": {"name": "minilm", "head_init": "random"},
                   "dataset": {"name": "rt_snippets", "label_descriptions": ["a terrible movie", "a great movie"]}}
    zero_shot = {**random_head, "model": {"name": "minilm", "head_init": "zero_shot"}}
    other_words = {**zero_shot, "dataset": {"name": "rt_snippets", "label_descriptions": ["bad", "good"]}}
    assert config_differences(older, random_head) == []
    assert "model.head_init ('random' -> 'zero_shot')" in config_differences(older, zero_shot)
    assert config_differences(zero_shot, other_words) == [
        "dataset.label_descriptions (['a terrible movie', 'a great movie'] -> ['bad', 'good'])"]
    assert method_name(RunRow(".", algo="dpzero", config=flatten(zero_shot))) == "dpzero_zero_shot"
    assert method_name(RunRow(".", algo="dpzero", config=flatten(random_head))) == "dpzero"


@pytest.mark.slow  # a run (or a trace) of seconds: the fast tier stays under its 5 minutes
def test_the_real_tiers_default_head_follows_the_algorithms_family_and_the_command_line_wins():
    """rt_snippets' train_defaults.head_init: zero-shot for zeroth-order methods (decided on the
    validation part, docs/real-tier.md), the random head for every other family; a typed value wins."""
    from dpbench.algorithms import ALGORITHMS

    real = ["model=minilm", "dataset=rt_snippets"]
    composed = {name: compose([*OFFLINE, *real, f"algo={name}"]) for name in ALGORITHMS.names()}
    heads = {name: cfg.model.head_init for name, cfg in composed.items()}
    assert heads == {name: "zero_shot" if cfg.algo.lr_family == "zeroth_order" else "random"
                     for name, cfg in composed.items()}
    assert {"dpzero", "mezo"} <= {name for name, head in heads.items() if head == "zero_shot"}
    assert {"dpadam", "dpsgd", "grape"} <= {name for name, head in heads.items() if head == "random"}
    assert compose([*OFFLINE, *real, "algo=dpzero", "model.head_init=random"]).model.head_init == "random"
    assert compose([*OFFLINE, *real, "algo=dpadam", "model.head_init=zero_shot"]).model.head_init == "zero_shot"
    assert compose([*OFFLINE, *real, "algo=dpzero", "dataset.train_defaults.head_init=null"]).model.head_init == "random"
