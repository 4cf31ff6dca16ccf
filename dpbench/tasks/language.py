"""What the two language task kinds share: data loading, few-shot splits, tokenizer, model.

`dataset.task: language` picks the kind from the model's family record (`language_task`):
RoBERTa -> prompt_mlm (LM-BFF prompts, k-shot), OPT -> causal_lm (MeZO candidate scoring /
generation, 1000/500/1000).
The privacy unit is an example (a whole sequence, or all candidate sequences of one example).
"""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import nn

from dpbench.data.text import load_text_splits
from dpbench.data.validation import split_training_set, text_rows
from dpbench.errors import UserError
from dpbench.models import language_families, model_family
from dpbench.models.language import load_language_model, load_tokenizer
from dpbench.tasks.base import Task


def language_task_kind(cfg) -> str:
    """The task kind of `dataset.task: language` for cfg.model (its family's `language_task`)."""
    kind = model_family(cfg.model.name).language_task
    if kind is None:
        choices = " or ".join(f"model={name}" for name in language_families())
        raise UserError(f"dataset={cfg.dataset.name} is a language task; use {choices}")
    return kind


class LanguageTask(Task):
    default_data_seed: int
    prompts: dict  # dataset name -> prompt of this task kind
    family: str  # model family, for the error message

    def __init__(self, cfg, device: torch.device):
        name = cfg.dataset.name
        if name not in self.prompts:
            raise UserError(f"dataset={name} has no {self.family} prompt; {self.family} tasks: {', '.join(self.prompts)}")
        self.prompt = self.prompts[name]
        self.cfg = cfg
        self.device = device
        data = cfg.dataset
        self.data_seed = int(data.data_seed if data.get("data_seed") is not None else self.default_data_seed)
        self.eval_batch_size = int(data.get("eval_batch_size", 16))
        if data.get("eval_split", "test") not in ("test", "dev"):
            raise UserError(f"dataset.eval_split={data.eval_split} is not known; use test or dev")
        rows = load_text_splits(data, {"train": data.train_split, "test": data.test_split})
        train, dev, test = self.select(rows["train"], rows["test"])
        self.eval_rows = dev if data.get("eval_split", "test") == "dev" else test
        if not train or not self.eval_rows:
            raise UserError(f"dataset {data.name}: the sampled train or {data.get('eval_split', 'test')} split is empty")
        # dataset.validation_fraction: a keyed hash of each sampled training row's fields (its label
        # among them) picks the validation rows (dpbench/data/validation.py)
        self.split = split_training_set(data, text_rows(train))
        self.validation_rows = [train[i] for i in self.split.validation_indices] if self.split else []
        if self.split is not None:
            train = [train[i] for i in self.split.train_indices]
        self.train_rows = train
        self.train_size = len(train)
        # A tiny model's tokenizer is trained on public text only: the prompt's own text, never
        # the sampled rows (a record's rare word would otherwise become a vocabulary entry).
        self.tokenizer = load_tokenizer(cfg.model, self.public_corpus())
        self.prepare()

    # --- per kind -------------------------------------------------------------------------
    @abstractmethod
    def select(self, train_rows: list[dict], test_rows: list[dict]) -> tuple[list, list, list]:
        """(train, dev, test) rows under the papers' sampling."""

    @abstractmethod
    def public_corpus(self) -> list[str]:
        """Public texts a from-scratch tiny tokenizer learns the task's words from: the template's
        literal text, label words and candidates (dpbench/tasks/prompts.py), read from no row."""

    @abstractmethod
    def prepare(self) -> None:
        """Tokenise the sampled rows, `validation_rows` among them (the tokenizer is ready)."""

    # --- shared -----------------------------------------------------------------------------
    def build_model(self, model_cfg) -> nn.Module:
        return load_language_model(model_cfg, self.tokenizer)

    def pad(self, sequences: list[list[int]], left: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, T] token ids and attention mask, padded with the pad token."""
        width = max((len(s) for s in sequences), default=1)
        ids = torch.full((len(sequences), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            span = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[row, span] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, span] = 1
        return ids.to(self.device), mask.to(self.device)
