"""Language tasks: templates, samplings, per-sample gradients of tiny RoBERTa / OPT (tied
embeddings, candidate rows, LoRA adapters) against per-example autograd, SQuAD F1, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.config import compose
from helpers.per_sample import assert_per_sample_grads_match
from helpers.text_data import rows, write_dataset

from dpbench.data.text import k_shot_split, sample_subset
from dpbench.errors import UserError
from dpbench.tasks import build_task
from dpbench.tasks.prompts import CAUSAL_PROMPTS, MLM_PROMPTS
from dpbench.tasks.qa_metrics import exact_match, squad_f1

CPU = torch.device("cpu")


# --- templates and label words (exact strings) -----------------------------------------------
MLM_CASES = {
    "sst2": ({"sentence": "a gripping film . ", "label": 1}, "<s>a gripping film . It was<mask>.</s>"),
    "sst5": ({"text": "a dull film .", "label": 0}, "<s>a dull film . It was<mask>.</s>"),
    "snli": ({"premise": "A man walks.", "hypothesis": "He is outside.", "label": 0},
             "<s>A man walks?<mask>, he is outside.</s>"),
    "mnli": ({"premise": "Cats sleep a lot.", "hypothesis": "Cats rest.", "label": 2},
             "<s>Cats sleep a lot?<mask>, cats rest.</s>"),
    "rte": ({"sentence1": "Paris is in France.", "sentence2": "Paris is French.", "label": 1},
            "<s>Paris is in France?<mask>, paris is French.</s>"),
    "trec": ({"text": "Where is Paris ?", "coarse_label": 4}, "<s><mask>: Where is Paris ?</s>"),
}
LABEL_WORDS = {
    "sst2": ("terrible", "great"), "sst5": ("terrible", "bad", "okay", "good", "great"),
    "snli": ("Yes", "Maybe", "No"), "mnli": ("Yes", "Maybe", "No"), "rte": ("Yes", "No"),
    "trec": ("Expression", "Entity", "Description", "Human", "Location", "Number"),
}


@pytest.mark.parametrize("name", sorted(MLM_CASES))
def test_roberta_templates_and_label_words(name):
    row, expected = MLM_CASES[name]
    prompt = MLM_PROMPTS[name]
    assert prompt.render(row) == expected
    assert prompt.label_words == LABEL_WORDS[name]


def test_opt_templates():
    sst2, boolq, squad, drop = (CAUSAL_PROMPTS[n] for n in ("sst2", "boolq", "squad", "drop"))
    row = {"sentence": "a gripping film . ", "label": 1}
    assert [sst2.prompt(row) + c for c in sst2.candidates(row)] == ["a gripping film . It was terrible", "a gripping film . It was great"]
    assert sst2.gold(row) == 1
    row = {"question": "is the sky blue", "passage": "The sky is blue.", "answer": False}
    assert [boolq.prompt(row) + c for c in boolq.candidates(row)] == ["The sky is blue. Is the sky blue?\nYes", "The sky is blue. Is the sky blue?\nNo"]
    assert boolq.gold(row) == 1
    row = {"title": "Cars", "context": "The car is red.", "question": " What colour is the car? ", "answers": {"text": ["red"], "answer_start": [11]}}
    assert squad.verbalize(row, squad.answers(row)[0]) == "Title: Cars\nContext: The car is red.\nQuestion: What colour is the car?\nAnswer: red\n"
    row = {"passage": "He scored two goals.", "question": "How many goals did he score?", "answers_spans": {"spans": ["two", "2"], "types": []}}
    assert drop.verbalize(row, drop.answers(row)[0]) == "Passage: He scored two goals.\nQuestion: How many goals did he score?\nAnswer: two\n"
    assert drop.answers(row) == [" two\n", " 2\n"]


# --- samplings ------------------------------------------------------------------------------
def test_k_shot_is_deterministic_balanced_and_disjoint():
    labels = [i % 3 for i in range(60)] + [0] * 30  # imbalanced pool
    train, dev = k_shot_split(labels, 8, 13)
    assert (train, dev) == k_shot_split(labels, 8, 13)
    assert k_shot_split(labels, 8, 21)[0] != train
    for split in (train, dev):
        assert sorted(labels[i] for i in split) == sorted([0, 1, 2] * 8)
    assert not set(train) & set(dev)


def test_opt_sampling_is_deterministic_without_replacement():
    picked = sample_subset(100, 30, 29)
    assert picked == sample_subset(100, 30, 29) and len(set(picked)) == 30
    assert picked != sample_subset(100, 30, 83)
    assert sorted(sample_subset(5, 30, 0)) == list(range(5))


# --- SQuAD F1 ---------------------------------------------------------------------------------
def test_squad_f1_known_pairs():
    assert squad_f1("The Eiffel Tower", "eiffel tower") == 1.0  # article and case removed
    assert squad_f1("in Paris, France", "Paris") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert squad_f1("blue car", "red car") == pytest.approx(0.5)
    assert squad_f1("", "red") == 0.0 and squad_f1("red", "") == 0.0
    assert exact_match("The car!", "car") == 1.0 and exact_match("car", "cars") == 0.0


# --- tiny models through the real from_pretrained path ----------------------------------------
@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from dpbench.models.language import save_tiny
    from dpbench.tasks.prompts import MLM_PROMPTS as prompts

    root = tmp_path_factory.mktemp("language")
    corpus = []
    for name in ("sst2", "boolq", "squad"):
        write_dataset(root / "data", name, n_train=24, n_test=8)
        corpus += [str(r) for r in rows(name, 24, 0)]
    words = " ".join(" " + w for p in prompts.values() for w in p.label_words)
    corpus += [words] * 50 + ["\n It was Answer: Title Context Question Passage Yes No"] * 50
    save_tiny(root / "roberta", "roberta", corpus)
    save_tiny(root / "opt", "opt", corpus)
    return root


def task_and_model(root: Path, model: str, dataset: str, *extra):
    cfg = compose([f"dataset={dataset}", f"dataset.path={root / 'data' / dataset}", f"model={model}", "model.size=tiny",
                   f"model.path={root / model}", "dataset.k_shot=4", "logger=none", *extra])
    torch.manual_seed(0)
    task = build_task(cfg, CPU)
    return task, task.build_model(cfg.model).train()


def test_roberta_per_sample_grads_with_tied_embeddings(workspace):
    task, model = task_and_model(workspace, "roberta", "sst2")
    assert model.lm_head.decoder.weight is model.roberta.embeddings.word_embeddings.weight
    params = assert_per_sample_grads_match(task, model)
    assert any(p is model.roberta.embeddings.word_embeddings.weight for p in params)


@pytest.mark.parametrize("dataset", ["boolq", "squad"])  # 2 candidate rows per example; generation
def test_opt_per_sample_grads_with_tied_embeddings(workspace, dataset):
    task, model = task_and_model(workspace, "opt", dataset)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    params = assert_per_sample_grads_match(task, model)
    positions = model.model.decoder.embed_positions.embedding.weight  # learned positions, swapped in
    assert any(p is positions for p in params)


@pytest.mark.parametrize("model_name,dataset", [("roberta", "sst2"), ("opt", "boolq")])
def test_lora_adapter_per_sample_grads(workspace, model_name, dataset):
    from dpbench.models.lora import inject_lora

    task, model = task_and_model(workspace, model_name, dataset)
    model = inject_lora(model, compose(["algo=dplora"]).algo)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # peft starts B at 0, which would make A's gradient vanish
            torch.nn.init.normal_(param, std=0.5)
    assert_per_sample_grads_match(task, model)


# --- end to end ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model_name,dataset,algo",
    [(m, d, a) for m, d in (("roberta", "sst2"), ("opt", "squad")) for a in ("dpadam", "dplora", "grape", "dpzero")],
)
@pytest.mark.slow  # the fast tier's five minutes; CI's slow tier runs it
def test_language_runs_end_to_end(workspace, tmp_path, model_name, dataset, algo):
    from dpbench.run import run_job

    cfg = compose([f"dataset={dataset}", f"dataset.path={workspace / 'data' / dataset}", f"model={model_name}",
                   "model.size=tiny", f"model.path={workspace / model_name}", "dataset.k_shot=4",
                   "dataset.max_new_tokens=5", f"algo={algo}", "logger=none", "train.batch_size=4", "train.steps=2",
                   "train.eval_every=2", "train.lr=1e-3"])
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.status == "completed" and results.privacy.steps == 2
    assert 0 < results.privacy.epsilon <= 8.0
    assert results.metrics.metric == ("f1" if dataset == "squad" else "accuracy")
    assert 0.0 <= results.metrics.test_accuracy <= 1.0


def test_zero_shot_evaluates_once(workspace, tmp_path):
    from dpbench.run import run_job

    cfg = compose(["dataset=boolq", f"dataset.path={workspace / 'data' / 'boolq'}", "model=opt", "model.size=tiny",
                   f"model.path={workspace / 'opt'}", "algo=dpadam", "logger=none", "train.batch_size=4", "train.steps=0"])
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.privacy.steps == 0 and len(results.history) == 1
    assert not results.privacy.epsilon  # nothing released
    assert 0.0 <= results.metrics.test_accuracy <= 1.0


def test_wrong_pairings_are_user_errors(workspace):
    with pytest.raises(UserError, match="RoBERTa tasks"):
        task_and_model(workspace, "roberta", "squad")
    with pytest.raises(UserError, match="model.path"):
        build_task(compose(["dataset=sst2", "model=opt", "model.path=/nonexistent", f"dataset.path={workspace / 'data' / 'sst2'}"]), CPU)


@pytest.mark.parametrize("dataset", ["boolq", "squad"])  # candidate rows; a generation answer
def test_opt_scores_only_the_positions_its_loss_reads_and_each_row_as_it_would_alone(workspace, dataset):
    """row_nll against each row run alone, unpadded, with every position's logits (the textbook
    mean NLL of the row's scored tokens); and the LM head sees only the scored span (+1), not T."""
    task, model = task_and_model(workspace, "opt", dataset)
    model.eval()
    batch = task.batch(list(range(4)))
    heads = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: heads.append(args[0].shape))
    with torch.no_grad():
        nll = task.row_nll(model, batch)
    hook.remove()
    assert heads == [(batch.input_ids.shape[0], batch.scored_span + 1, model.config.hidden_size)]
    assert batch.scored_span + 1 < batch.input_ids.shape[1]  # the prompt is longer than what is scored
    expected = []
    for row in range(batch.input_ids.shape[0]):
        real = batch.attention_mask[row].bool()
        ids, target = batch.input_ids[row, real][None], batch.target_mask[row, real][None]
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.double()
        token_nll = -torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        scored = target[:, 1:].double()
        assert scored.sum() > 0
        expected.append(((token_nll * scored).sum() / scored.sum()).item())
    torch.testing.assert_close(nll.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-4, atol=1e-5)


def test_a_row_shorter_than_the_scored_span_counts_each_token_once(workspace):
    """Rows of 2 and 9 tokens beside one whose answer is 6 tokens long (S = 6): the short rows'
    positions before their start are left out, not read twice; each row as it would score alone."""
    task, model = task_and_model(workspace, "opt", "squad")
    model.eval()
    encoded = [[([2, 40], 1)], [([2, 41, 42, 43, 44, 45, 46, 47, 48], 2)], [([2, 50, 51, 52, 53, 54, 55, 56], 6)]]
    batch = task._batch(encoded, [0, 0, 0])
    assert batch.scored_span == 6
    with torch.no_grad():
        together = task.row_nll(model, batch)
        alone = torch.cat([task.row_nll(model, task._batch([row], [0])) for row in encoded])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)
