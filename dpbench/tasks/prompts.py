"""Prompt templates and label words of the ten language tasks, as MeZO / DPZero / DP-GRAPE use them.

RoBERTa (LM-BFF templates, MeZO medium_models/run_fewshot.sh) is a list of parts that are
tokenised one by one and concatenated (as LM-BFF does); `MASK`, `CLS`, `SEP` are special tokens.
LM-BFF notation: `*sent_0*` sentence 0; `*sent-_0*` it without its last character (the final
punctuation); `*+sentl_1*` a space and sentence 1 with its first letter lower-cased; `_` a space.
OPT (MeZO large_models/templates.py) is plain text: a prompt and, for classification, one
continuation per candidate; for generation the gold answer follows the prompt.
Text fields are stripped of surrounding whitespace first (HF GLUE SST-2 sentences end in a
space, which `*sent-_0*` would otherwise drop instead of the punctuation).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

CLS, MASK, SEP = object(), object(), object()
SPECIAL_TEXT = {id(CLS): "<s>", id(MASK): "<mask>", id(SEP): "</s>"}


def sent(field: str) -> Callable[[dict], str]:  # *sent_i*
    return lambda row: row[field].strip()


def sent_no_last(field: str) -> Callable[[dict], str]:  # *sent-_i*
    return lambda row: row[field].strip()[:-1]


def space_sent(field: str) -> Callable[[dict], str]:  # *+sent_i*
    return lambda row: " " + row[field].strip()


def space_sent_lower(field: str) -> Callable[[dict], str]:  # *+sentl_i*
    def render(row):
        text = row[field].strip()
        return " " + text[:1].lower() + text[1:]

    return render


@dataclass(frozen=True)
class MLMPrompt:
    """An LM-BFF template: parts (CLS/MASK/SEP, literal text, or a sentence function)."""

    parts: tuple
    label_field: str
    label_words: tuple[str, ...]  # indexed by the dataset's integer label
    max_length: int = 128
    first_sent_limit: int | None = None  # tokens kept of the first sentence (LM-BFF flags)
    other_sent_limit: int | None = None

    def render_parts(self, row: dict) -> list:
        """Each part as a string or special-token marker; sentence functions are evaluated."""
        return [p if (p in (CLS, MASK, SEP) or isinstance(p, str)) else p(row) for p in self.parts]

    def render(self, row: dict) -> str:
        """The prompt as one string, special tokens written as <s>, <mask>, </s>."""
        return "".join(SPECIAL_TEXT[id(p)] if p in (CLS, MASK, SEP) else p for p in self.render_parts(row))


SST_TEMPLATE = (CLS, sent("sentence"), " It was", MASK, ".", SEP)  # *cls**sent_0*_It_was*mask*.*sep+*
NLI_TEMPLATE = (CLS, sent_no_last("premise"), "?", MASK, ",", space_sent_lower("hypothesis"), SEP)
RTE_TEMPLATE = (CLS, sent_no_last("sentence1"), "?", MASK, ",", space_sent_lower("sentence2"), SEP)

MLM_PROMPTS: dict[str, MLMPrompt] = {
    "sst2": MLMPrompt(SST_TEMPLATE, "label", ("terrible", "great")),
    "sst5": MLMPrompt(
        (CLS, sent("text"), " It was", MASK, ".", SEP), "label",
        ("terrible", "bad", "okay", "good", "great"), first_sent_limit=110, other_sent_limit=20,
    ),
    # HF snli / glue mnli labels: 0 entailment, 1 neutral, 2 contradiction.
    "snli": MLMPrompt(NLI_TEMPLATE, "label", ("Yes", "Maybe", "No"), max_length=256),
    "mnli": MLMPrompt(NLI_TEMPLATE, "label", ("Yes", "Maybe", "No"), max_length=256, first_sent_limit=240),
    # glue rte labels: 0 entailment, 1 not_entailment.
    "rte": MLMPrompt(RTE_TEMPLATE, "label", ("Yes", "No"), max_length=256, first_sent_limit=240),
    # CogComp/trec coarse_label: ABBR, ENTY, DESC, HUM, LOC, NUM (LM-BFF: Expression = ABBR).
    "trec": MLMPrompt(
        (CLS, MASK, ":", space_sent("text"), SEP), "coarse_label",
        ("Expression", "Entity", "Description", "Human", "Location", "Number"), first_sent_limit=110,
    ),
}


@dataclass(frozen=True)
class CausalPrompt:
    """A MeZO OPT template. Classification: `candidates(row)` continuations and `gold(row)`
    their index. Generation: `answers(row)` the gold answers; the first is trained on."""

    prompt: Callable[[dict], str]
    candidates: Callable[[dict], list[str]] | None = None
    gold: Callable[[dict], int] | None = None
    answers: Callable[[dict], list[str]] | None = None

    @property
    def generation(self) -> bool:
        return self.answers is not None

    def verbalize(self, row: dict, answer: str) -> str:
        """prompt + answer, as trained on (MeZO's `verbalize`)."""
        return self.prompt(row) + answer


def _boolq_prompt(row: dict) -> str:  # BoolQTemplateV3
    question = row["question"].strip()
    if not question.endswith("?"):
        question = question + "?"
    question = question[0].upper() + question[1:]
    return f"{row['passage']} {question}\n"


CAUSAL_PROMPTS: dict[str, CausalPrompt] = {
    # SST2Template: "{sentence} It was {terrible|great}"
    "sst2": CausalPrompt(
        prompt=lambda row: f"{row['sentence'].strip()} It was",
        candidates=lambda row: [" terrible", " great"],
        gold=lambda row: int(row["label"]),
    ),
    "boolq": CausalPrompt(
        prompt=_boolq_prompt,
        candidates=lambda row: ["Yes", "No"],
        gold=lambda row: 0 if row["answer"] else 1,
    ),
    # SQuADv2Template (MeZO's name; used on SQuAD v1.1): answer " {answer}\n"
    "squad": CausalPrompt(
        prompt=lambda row: (
            f"Title: {row['title']}\nContext: {row['context']}\nQuestion: {row['question'].strip()}\nAnswer:"
        ),
        answers=lambda row: [f" {a}\n" for a in row["answers"]["text"]],
    ),
    "drop": CausalPrompt(
        prompt=lambda row: f"Passage: {row['passage']}\nQuestion: {row['question'].strip()}\nAnswer:",
        answers=lambda row: [f" {a}\n" for a in row["answers_spans"]["spans"]],
    ),
}
