"""OPT causal-LM tasks as in MeZO / DPZero / DP-GRAPE.

Classification (SST-2, BoolQ): each candidate continuation is scored by the mean log-likelihood
of its tokens; the training loss is cross-entropy over the candidates with logits = -mean NLL
(MeZO's `train_as_classification`). An example is K rows (one per candidate), laid out
example-major; the per-sample-gradient engine sums the K rows' gradients, so the privacy unit
and the clipping are per example, not per row.
Generation (SQuAD, DROP): the loss is the mean NLL of the gold answer's tokens (per example, never a
batch mean: a batch mean would mix examples inside one clipped term); evaluation decodes greedily (<= 50 new tokens,
stopping at a newline) and scores SQuAD F1 against every gold answer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dpbench.data.text import sample_subset
from dpbench.tasks.base import TASKS
from dpbench.tasks.language import LanguageTask
from dpbench.tasks.prompts import CAUSAL_PROMPTS
from dpbench.tasks.qa_metrics import exact_match, squad_f1


@dataclass
class CausalBatch:
    input_ids: torch.Tensor  # [R, T], R = B * rows_per_example, example-major
    attention_mask: torch.Tensor  # [R, T]
    target_mask: torch.Tensor  # [R, T]: 1 where the token is scored (predicted from t-1)
    labels: torch.Tensor  # [B] gold candidate (classification) or zeros
    rows_per_example: int
    # Every row's scored tokens are among its last `scored_span` tokens (its candidate or answer);
    # None: anywhere. `row_nll` computes logits for those positions only.
    scored_span: int | None = None


class _PlaceholderRow(dict):
    """A row whose every field reads "text": renders a template without reading any data."""

    def __missing__(self, key):
        return "text"


@contextlib.contextmanager
def _head_reads(head: nn.Module, positions: torch.Tensor):
    """While it holds, the LM head reads only `positions` [R, P] of its input [R, T, d] (a gather
    in front of it; transformers' `logits_to_keep` keeps the same positions for every row, which
    right-padded rows of different lengths do not share)."""
    def gather(module, args):
        hidden = args[0]
        index = positions.to(hidden.device)[..., None].expand(-1, -1, hidden.shape[-1])
        return (hidden.gather(1, index), *args[1:])

    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


@TASKS.register("causal_lm")
class CausalLMTask(LanguageTask):
    default_data_seed = 0
    prompts = CAUSAL_PROMPTS
    family = "OPT"

    @property
    def metric_name(self) -> str:  # generation is scored by SQuAD F1
        return "f1" if self.prompt.generation else "accuracy"

    def select(self, train_rows, test_rows):
        data = self.cfg.dataset
        num_train, num_dev = int(data.num_train), int(data.num_dev)
        picked = sample_subset(len(train_rows), num_train + num_dev, self.data_seed)
        train = [train_rows[i] for i in picked[:num_train]]
        dev = [train_rows[i] for i in picked[num_train:]]
        test = [test_rows[i] for i in sample_subset(len(test_rows), int(data.num_test), self.data_seed)]
        return train, dev, test

    def public_corpus(self):
        # The template rendered on a placeholder row (every field the word "text"), with each
        # fixed candidate continuation; a generation task's answers are data, so none is added.
        row = _PlaceholderRow()
        prompt = self.prompt.prompt(row)
        continuations = [] if self.prompt.generation else self.prompt.candidates(row)
        return [prompt + c for c in continuations or [""]] * 50

    # --- encoding -------------------------------------------------------------------------
    def encode(self, prompt: str, continuation: str) -> tuple[list[int], int]:
        """Token ids of prompt + continuation (with BOS) and how many trailing ones are scored.

        The continuation is the suffix of the jointly tokenised text when the prompt's tokens are
        a prefix of it (as MeZO does); otherwise it is tokenised alone. The prompt is cut from the
        left (after BOS) to fit max_length, as MeZO truncates from the left.
        """
        tok = self.tokenizer
        prompt_ids = tok(prompt)["input_ids"]
        full = tok(prompt + continuation)["input_ids"]
        if full[: len(prompt_ids)] == prompt_ids and len(full) > len(prompt_ids):
            option = full[len(prompt_ids):]
        else:
            option = tok.encode(continuation, add_special_tokens=False)
        return self.fit(prompt_ids, option), len(option)

    def fit(self, prompt_ids: list[int], option: list[int]) -> list[int]:
        room = self.max_length - len(option)
        if len(prompt_ids) > room:
            prompt_ids = prompt_ids[:1] + prompt_ids[len(prompt_ids) - room + 1:]
        return prompt_ids + option

    def prepare(self):
        limit = getattr(self.tokenizer, "model_max_length", None) or 10**9  # the model's positions
        self.max_length = int(min(int(self.cfg.dataset.get("max_length") or 2048), limit))
        self.max_new_tokens = int(self.cfg.dataset.get("max_new_tokens", 50))
        if self.prompt.generation:
            # Train on the first gold answer (MeZO); evaluate against all of them.
            self.train_encoded = [[self.encode(self.prompt.prompt(r), self.prompt.answers(r)[0])] for r in self.train_rows]
            self.train_gold = [0] * len(self.train_rows)
            self.eval_prompts = [self.fit(self.tokenizer(self.prompt.prompt(r))["input_ids"], [])[: self.max_length]
                                 for r in self.eval_rows]
            self.eval_answers = [[a.strip() for a in self.prompt.answers(r)] for r in self.eval_rows]
            self.validation_prompts = [self.fit(self.tokenizer(self.prompt.prompt(r))["input_ids"], [])[: self.max_length]
                                       for r in self.validation_rows]
            self.validation_answers = [[a.strip() for a in self.prompt.answers(r)] for r in self.validation_rows]
        else:
            def encode_rows(rows):
                return [[self.encode(self.prompt.prompt(r), c) for c in self.prompt.candidates(r)] for r in rows]

            self.train_encoded, self.train_gold = encode_rows(self.train_rows), [self.prompt.gold(r) for r in self.train_rows]
            self.eval_encoded, self.eval_gold = encode_rows(self.eval_rows), [self.prompt.gold(r) for r in self.eval_rows]
            self.validation_encoded = encode_rows(self.validation_rows)
            self.validation_gold = [self.prompt.gold(r) for r in self.validation_rows]

    def _batch(self, encoded: list[list[tuple[list[int], int]]], gold: list[int]) -> CausalBatch:
        rows_per_example = len(encoded[0]) if encoded else 1
        pairs = [pair for example in encoded for pair in example]
        ids, attention = self.pad([seq for seq, _ in pairs])
        target = torch.zeros_like(attention)
        for row, (seq, scored) in enumerate(pairs):
            target[row, len(seq) - scored: len(seq)] = 1
        span = max((scored for _, scored in pairs), default=0)
        return CausalBatch(ids, attention, target, torch.as_tensor(gold, dtype=torch.long, device=self.device),
                           rows_per_example, span)

    def batch(self, indices):
        return self._batch([self.train_encoded[i] for i in indices], [self.train_gold[i] for i in indices])

    def batch_size(self, batch: CausalBatch) -> int:
        return int(batch.labels.shape[0])

    # --- losses ---------------------------------------------------------------------------
    def row_nll(self, model: nn.Module, batch: CausalBatch) -> torch.Tensor:
        """Mean NLL of each row's scored tokens: [R]. Logits only where the loss reads them: the LM
        head sees each row's last S + 1 positions (S = the batch's longest scored span), so no
        [R, T, V] table, nor its fp32 copy, exists (a candidate is a token or two; T is the prompt).
        Rows stay right-padded: each row's tokens sit where they would alone, whatever the batch's
        width, so a row's loss does not depend on the other rows (not even by rounding)."""
        width = batch.input_ids.shape[1]
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        span = width - 1 if batch.scored_span is None or head is None else min(int(batch.scored_span), width - 1)
        if span + 1 >= width:  # every position: the plain forward
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            tokens, scored = batch.input_ids[:, 1:], batch.target_mask[:, 1:].float()  # [R, T-1]
        else:
            # row r's positions len_r - S - 1 .. len_r - 1; those before the row's start are not scored
            offsets = torch.arange(-span - 1, 0, device=batch.input_ids.device)
            starts = batch.attention_mask.sum(dim=1, keepdim=True) + offsets  # [R, S+1]
            positions = starts.clamp(min=0)
            with _head_reads(head, positions):
                logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False).logits
            predicted = positions[:, :-1] + 1  # [R, S]: the tokens the kept positions predict
            tokens = batch.input_ids.gather(1, predicted)
            scored = batch.target_mask.gather(1, predicted).float() * (starts[:, :-1] >= 0)
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # each position predicts the next token
        nll = -log_probs.gather(-1, tokens[..., None]).squeeze(-1)
        return (nll * scored).sum(dim=1) / scored.sum(dim=1).clamp(min=1)

    def per_sample_loss(self, model, batch):
        if self.batch_size(batch) == 0:
            return torch.zeros(0, device=self.device)
        nll = self.row_nll(model, batch)
        if self.prompt.generation:
            return nll  # [B]
        return F.cross_entropy(-nll.view(-1, batch.rows_per_example), batch.labels, reduction="none")  # [B]

    # --- evaluation -----------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model):
        was_training = model.training
        model.eval()
        try:
            return self._evaluate_generation(model) if self.prompt.generation else self._evaluate_scoring(model)
        finally:
            model.train(was_training)

    @torch.no_grad()
    def validation_scores(self, model) -> torch.Tensor:
        """Per validation example: 1 if its gold candidate scores highest (classification), or its
        best SQuAD F1 over the gold answers (generation), both in [0, 1]."""
        was_training = model.training
        model.eval()
        try:
            if self.prompt.generation:
                scores = self._generation_scores(model, self.validation_prompts, self.validation_answers)[0]
            else:
                scores = self._scoring(model, self.validation_encoded, self.validation_gold)[0]
        finally:
            model.train(was_training)
        return torch.as_tensor(scores, dtype=torch.float32).clamp(0, 1)

    def _evaluate_scoring(self, model):
        correct, loss = self._scoring(model, self.eval_encoded, self.eval_gold)
        n = len(self.eval_gold)
        return {"accuracy": sum(correct) / n, "loss": loss / n}

    def _scoring(self, model, encoded, gold) -> tuple[list[float], float]:
        """(1.0 or 0.0 per example: its gold candidate scores highest, the summed loss)."""
        correct, loss = [], 0.0
        for start in range(0, len(gold), self.eval_batch_size):
            stop = start + self.eval_batch_size
            batch = self._batch(encoded[start:stop], gold[start:stop])
            logits = -self.row_nll(model, batch).view(-1, batch.rows_per_example)  # [B, K]
            loss += F.cross_entropy(logits, batch.labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == batch.labels).float().tolist()
        return correct, loss

    def _evaluate_generation(self, model):
        f1, em = self._generation_scores(model, self.eval_prompts, self.eval_answers)
        n = len(self.eval_prompts)
        return {"accuracy": sum(f1) / n, "f1": sum(f1) / n, "exact_match": sum(em) / n}

    def _generation_scores(self, model, all_prompts, all_answers) -> tuple[list[float], list[float]]:
        """(best F1, best exact match) per example of greedy decoding against its gold answers."""
        tok = self.tokenizer
        stop_ids = [tok.encode("\n", add_special_tokens=False)[-1], tok.eos_token_id]
        f1_scores, em_scores = [], []
        for start in range(0, len(all_prompts), self.eval_batch_size):
            prompts = all_prompts[start : start + self.eval_batch_size]
            ids, attention = self.pad(prompts, left=True)  # left padding: generation appends on the right
            generated = model.generate(
                input_ids=ids, attention_mask=attention, do_sample=False, num_beams=1,
                max_new_tokens=self.max_new_tokens, eos_token_id=stop_ids, pad_token_id=tok.pad_token_id,
            )
            for row, golds in zip(generated[:, ids.shape[1]:], all_answers[start : start + self.eval_batch_size]):
                text = tok.decode(row, skip_special_tokens=True).split("\n")[0].strip()
                f1_scores.append(max(squad_f1(text, gold) for gold in golds))
                em_scores.append(max(exact_match(text, gold) for gold in golds))
        return f1_scores, em_scores
