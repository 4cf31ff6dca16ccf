"""Single-sentence classification with a BERT-family encoder and a classification head
(`dataset.task: language` with a family whose `language_task` is this, e.g. model=minilm).

The loss of an example is the cross-entropy of the head's logits (dpbench/models/bert.py); the
privacy unit is one sentence. Texts are tokenised once with the checkpoint's own (public)
tokenizer, truncated to `dataset.max_length` (fixed in the dataset's config, never computed from
the records); a batch is padded to its longest sequence, with an attention mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpbench.data.validation import split_training_set
from dpbench.errors import UserError
from dpbench.models.zero_shot_head import check_description_count, head_init, start_from_descriptions
from dpbench.tasks.base import TASKS, Task


def _rt_snippets(dataset_cfg):
    from dpbench.data.rt_snippets import load_rt_snippets

    return load_rt_snippets(dataset_cfg)


# dataset name -> loader of (train, test) items with .text, .label and .movie (the grouping key the
# validation split hashes, so a group never straddles it), and the number of classes
SENTENCE_SETS = {"rt_snippets": (_rt_snippets, 2)}


@dataclass
class SentenceBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    labels: torch.Tensor  # [B]


@TASKS.register("sentence_classification")
class SentenceClassificationTask(Task):
    def __init__(self, cfg, device: torch.device):
        from dpbench.models.bert import load_tokenizer

        data = cfg.dataset
        if data.name not in SENTENCE_SETS:
            raise UserError(f"dataset={data.name} is not a sentence classification data set for model={cfg.model.name}; "
                            f"use {' or '.join(f'dataset={n}' for n in SENTENCE_SETS)}")
        if not data.get("max_length"):
            raise UserError(f"dataset.max_length is not set for dataset={data.name}; set it in its config (e.g. 48)")
        self.cfg, self.device = cfg, device
        loader, self.num_classes = SENTENCE_SETS[data.name]
        if head_init(cfg.model) == "zero_shot":  # before the data load: the count is the config's
            check_description_count(data, self.num_classes)
        train, test = loader(data)
        if data.get("num_test"):  # smoke runs: the first n test examples (file order), not a sample
            test = test[: int(data.num_test)]
        self.eval_batch_size = int(data.get("eval_batch_size", 64))
        # dataset.validation_fraction: the keyed hash of each item's group (a movie) holds groups out
        self.split = split_training_set(data, [item.movie.encode("utf-8") for item in train])
        validation = [train[i] for i in self.split.validation_indices] if self.split else []
        if self.split is not None:
            train = [train[i] for i in self.split.train_indices]
        self.train_size = len(train)
        self.tokenizer = load_tokenizer(cfg.model)
        self.max_length = int(data.max_length)
        self.train_ids, self.train_labels = self.encode(train)
        self.eval_ids, self.eval_labels = self.encode(test)
        self.validation_ids, self.validation_labels = self.encode(validation)

    def encode(self, items) -> tuple[list[list[int]], list[int]]:
        if not items:
            return [], []
        ids = self.tokenizer([item.text for item in items], truncation=True, max_length=self.max_length)["input_ids"]
        return ids, [int(item.label) for item in items]

    def build_model(self, model_cfg) -> nn.Module:
        from dpbench.models.bert import load_classifier

        model = load_classifier(model_cfg, self.num_classes, len(self.tokenizer))
        if head_init(model_cfg) == "zero_shot":  # the head from the label descriptions (public words)
            descriptions = self.make_batch(self.description_ids(), list(range(self.num_classes)))
            start_from_descriptions(model, descriptions.input_ids, descriptions.attention_mask)
        # model.cache_frozen: every sentence of the run through the frozen lower part, once, length-sorted
        model.expect(self.train_ids + self.validation_ids + self.eval_ids)
        return model

    def description_ids(self) -> list[list[int]]:
        """dataset.label_descriptions tokenised as the sentences are (one per class, in label order)."""
        descriptions = [str(d) for d in self.cfg.dataset.label_descriptions]
        return self.tokenizer(descriptions, truncation=True, max_length=self.max_length)["input_ids"]

    def make_batch(self, sequences: list[list[int]], labels: list[int]) -> SentenceBatch:
        width = max((len(s) for s in sequences), default=1)
        ids = torch.full((len(sequences), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        return SentenceBatch(ids.to(self.device), mask.to(self.device),
                             torch.as_tensor(labels, dtype=torch.long, device=self.device))

    def batch(self, indices):
        return self.make_batch([self.train_ids[i] for i in indices], [self.train_labels[i] for i in indices])

    def batch_size(self, batch: SentenceBatch) -> int:
        return int(batch.labels.shape[0])

    def logits(self, model: nn.Module, batch: SentenceBatch) -> torch.Tensor:
        logits = model(batch.input_ids, batch.attention_mask)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))  # a bf16 forward's loss in fp32

    def per_sample_loss(self, model, batch):
        if self.batch_size(batch) == 0:
            return torch.zeros(0, device=self.device)
        return F.cross_entropy(self.logits(model, batch), batch.labels, reduction="none")

    def evaluate(self, model):
        correct, loss = self.scores(model, self.eval_ids, self.eval_labels)
        n = len(self.eval_labels)
        return {"accuracy": float(correct.sum()) / n, "loss": loss / n}

    def validation_scores(self, model) -> torch.Tensor:
        """1 for each validation sentence classified correctly, else 0."""
        return self.scores(model, self.validation_ids, self.validation_labels)[0]

    @torch.no_grad()
    def scores(self, model, ids, labels) -> tuple[torch.Tensor, float]:
        """(whether each example is predicted correctly [n], the summed loss)."""
        was_training = model.training
        model.eval()
        correct, loss = [], 0.0
        for start in range(0, len(labels), self.eval_batch_size):
            batch = self.make_batch(ids[start:start + self.eval_batch_size], labels[start:start + self.eval_batch_size])
            logits = self.logits(model, batch)
            loss += F.cross_entropy(logits, batch.labels, reduction="sum").item()
            correct.append((logits.argmax(dim=1) == batch.labels).float())
        model.train(was_training)
        return (torch.cat(correct) if correct else torch.zeros(0, device=self.device)), loss
