"""RoBERTa prompt-based few-shot classification (LM-BFF, as in MeZO / DPZero / DP-GRAPE).

The loss of an example is cross-entropy over the MLM logits of the label words at `<mask>`.
Only the mask position goes through the LM head (as LM-BFF does), so the per-sample gradient of
the (tied) decoder sees activations [B, H], not [B, T, H].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpbench.data.text import k_shot_split, sample_subset
from dpbench.errors import UserError
from dpbench.tasks.base import TASKS
from dpbench.tasks.language import LanguageTask
from dpbench.tasks.prompts import CLS, MASK, MLM_PROMPTS, SEP, MLMPrompt

LM_BFF_TEST_SEED = 42  # LM-BFF subsamples test sets above 1000 with seed 42, whatever the data seed


@dataclass
class MLMBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    mask_positions: torch.Tensor  # [B]
    labels: torch.Tensor  # [B]


def encode_prompt(prompt: MLMPrompt, row: dict, tokenizer, max_length: int | None = None) -> list[int]:
    """LM-BFF encoding: each part tokenised alone, concatenated; sentence limits applied.

    When the result exceeds max_length we shorten the longest sentence from its tail (LM-BFF cuts
    the sequence's tail, which can cut off `<mask>`; keeping the template intact is safer).
    """
    special = {id(CLS): tokenizer.cls_token_id, id(MASK): tokenizer.mask_token_id, id(SEP): tokenizer.sep_token_id}
    pieces, sentence_slots, seen_sentence = [], [], False
    for part, rendered in zip(prompt.parts, prompt.render_parts(row)):
        if id(part) in special:
            pieces.append([special[id(part)]])
            continue
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        if callable(part):
            limit = prompt.other_sent_limit if seen_sentence else prompt.first_sent_limit
            ids = ids[:limit] if limit else ids
            sentence_slots.append(len(pieces))
            seen_sentence = True
        pieces.append(ids)
    max_length = max_length or prompt.max_length
    while sum(map(len, pieces)) > max_length and sentence_slots:
        longest = max(sentence_slots, key=lambda slot: len(pieces[slot]))
        excess = sum(map(len, pieces)) - max_length
        pieces[longest] = pieces[longest][: max(0, len(pieces[longest]) - excess)]
        if not pieces[longest]:
            sentence_slots.remove(longest)
    return [token for piece in pieces for token in piece]


def label_word_ids(prompt: MLMPrompt, tokenizer) -> list[int]:
    """Each label word as ' ' + word must be one token (LM-BFF asserts the same)."""
    ids = []
    for word in prompt.label_words:
        tokens = tokenizer.encode(" " + word, add_special_tokens=False)
        if len(tokens) != 1:
            raise UserError(f"label word {word!r} is {len(tokens)} tokens for this tokenizer; use the model's own tokenizer")
        ids.append(tokens[0])
    return ids


@TASKS.register("prompt_mlm")
class PromptMLMTask(LanguageTask):
    default_data_seed = 42
    prompts = MLM_PROMPTS
    family = "RoBERTa"

    def select(self, train_rows, test_rows):
        classes = len(self.prompt.label_words)
        valid = lambda rows: [r for r in rows if 0 <= int(r[self.prompt.label_field]) < classes]  # noqa: E731
        train_rows, test_rows = valid(train_rows), valid(test_rows)
        labels = [int(r[self.prompt.label_field]) for r in train_rows]
        train, dev = k_shot_split(labels, int(self.cfg.dataset.k_shot), self.data_seed)
        test = sample_subset(len(test_rows), int(self.cfg.dataset.num_test), LM_BFF_TEST_SEED)
        return [train_rows[i] for i in train], [train_rows[i] for i in dev], [test_rows[i] for i in test]

    def public_corpus(self):
        template = "".join(part for part in self.prompt.parts if isinstance(part, str))  # e.g. " It was."
        words = " ".join(" " + w for w in self.prompt.label_words)  # frequent: each label word one token
        return [template] * 50 + [words] * 200

    def prepare(self):
        max_length = int(self.cfg.dataset.get("max_length") or self.prompt.max_length)
        self.label_ids = label_word_ids(self.prompt, self.tokenizer)

        def encode(rows):
            encoded = [encode_prompt(self.prompt, r, self.tokenizer, max_length) for r in rows]
            labels = [int(r[self.prompt.label_field]) for r in rows]
            return encoded, labels

        self.train_ids, self.train_labels = encode(self.train_rows)
        self.eval_ids, self.eval_labels = encode(self.eval_rows)
        self.validation_ids, self.validation_labels = encode(self.validation_rows)

    def _batch(self, sequences, labels) -> MLMBatch:
        ids, mask = self.pad(sequences)
        mask_positions = (ids == self.tokenizer.mask_token_id).long().argmax(dim=1)
        return MLMBatch(ids, mask, mask_positions, torch.as_tensor(labels, dtype=torch.long, device=self.device))

    def batch(self, indices):
        return self._batch([self.train_ids[i] for i in indices], [self.train_labels[i] for i in indices])

    def batch_size(self, batch: MLMBatch) -> int:
        return int(batch.labels.shape[0])

    def label_logits(self, model: nn.Module, batch: MLMBatch) -> torch.Tensor:
        """Logits of the label words at <mask>: [B, classes]."""
        hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
        at_mask = hidden[torch.arange(hidden.shape[0], device=hidden.device), batch.mask_positions]  # [B, H]
        return model.lm_head(at_mask)[:, self.label_ids].float()  # [B, V] -> [B, classes]

    def per_sample_loss(self, model, batch):
        if self.batch_size(batch) == 0:
            return torch.zeros(0, device=self.device)
        return F.cross_entropy(self.label_logits(model, batch), batch.labels, reduction="none")

    def evaluate(self, model):
        correct, loss = self._scores(model, self.eval_ids, self.eval_labels)
        n = len(self.eval_labels)
        return {"accuracy": float(correct.sum()) / n, "loss": loss / n}

    def validation_scores(self, model) -> torch.Tensor:
        """1 for each validation example whose label word scores highest, else 0."""
        return self._scores(model, self.validation_ids, self.validation_labels)[0]

    @torch.no_grad()
    def _scores(self, model, ids, labels) -> tuple[torch.Tensor, float]:
        """(whether each example is predicted correctly [n], the summed loss)."""
        was_training = model.training
        model.eval()
        correct, loss = [], 0.0
        for start in range(0, len(labels), self.eval_batch_size):
            stop = start + self.eval_batch_size
            batch = self._batch(ids[start:stop], labels[start:stop])
            logits = self.label_logits(model, batch)
            loss += F.cross_entropy(logits, batch.labels, reduction="sum").item()
            correct.append((logits.argmax(dim=1) == batch.labels).float())
        model.train(was_training)
        return (torch.cat(correct) if correct else torch.zeros(0, device=self.device)), loss
