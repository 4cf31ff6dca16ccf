"""`model.head_init=zero_shot`: a classification head that classifies before any training step.

The head's row for class c is the encoder's pooled features of the class's label description
(`dataset.label_descriptions`, e.g. "a terrible movie" / "a great movie" for rt_snippets: public
words fixed in the data set's config, never chosen on any data), normalised and scaled, with bias 0.
The untrained classifier then predicts, for each sentence, the label whose description is nearest
in cosine (logit_c = s ||x|| cos(x, d_c): the factor s ||x|| is the same for every class). It is a
sentence encoder's analogue of the prompt-based fine-tuning the papers start from (their label
words already classify at step 0); the head still trains like the random one. No training record
is read, so it costs no privacy; its test accuracy at `train.steps=0` is the zero-shot accuracy.

A family declares that it can (`ModelFamily.zero_shot_head`); the task that builds the head
(dpbench/tasks/sentence_classification.py) tokenises the descriptions and calls
`start_from_descriptions`. `random` (the default) keeps the fresh Linear head.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dpbench.errors import UserError

HEAD_INITS = ("random", "zero_shot")

# Each row's norm: that of the fresh nn.Linear head it replaces (uniform in ±1/sqrt(d), so
# E|row|² = 1/3), so the loss and gradients start at the scale train.lr and train.head_lr_scale were
# calibrated at; only the rows' directions change (the argmax does not depend on the scale).
ROW_NORM = 1.0 / math.sqrt(3.0)


def head_init(model_cfg) -> str:
    return str(model_cfg.get("head_init") or "random")


def check_head_init(cfg) -> None:
    """Before any work: a known `model.head_init`; `zero_shot` needs a family that declares it and
    the data set's label descriptions (their count against the classes: the task, which knows it)."""
    choice = head_init(cfg.model)
    if choice not in HEAD_INITS:
        raise UserError(f"model.head_init={choice} is not known; use {' or '.join(HEAD_INITS)}")
    if choice == "random":
        return
    from dpbench.models import MODELS, model_family

    name = str(cfg.model.name)
    if name not in MODELS.names() or not model_family(name).zero_shot_head:
        able = " or ".join(f"model={n}" for n in MODELS.names() if model_family(n).zero_shot_head)
        raise UserError(f"model.head_init=zero_shot needs a text encoder with a classification head ({able}); "
                        f"model={name} has none")
    descriptions = cfg.dataset.get("label_descriptions")
    if not descriptions or isinstance(descriptions, str) or not all(isinstance(d, str) and d.strip() for d in descriptions):
        raise UserError(f"model.head_init=zero_shot needs dataset.label_descriptions, one non-empty text per class in "
                        f"label order; dataset={cfg.dataset.name} has {descriptions!r}: set e.g. "
                        "dataset.label_descriptions='[a terrible movie,a great movie]'")


def check_description_count(dataset_cfg, num_classes: int) -> None:
    descriptions = list(dataset_cfg.get("label_descriptions") or [])
    if len(descriptions) != num_classes:
        raise UserError(f"dataset.label_descriptions has {len(descriptions)} descriptions but dataset={dataset_cfg.name} "
                        f"has {num_classes} classes; give one per class, in label order")


@torch.no_grad()
def start_from_descriptions(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """Head row c = ROW_NORM * features(description c) / |features|, bias 0. `model.pooled` is the
    classifier's own pooling; the whole encoder runs in eval mode (no dropout: a fixed function of
    the public words), and the run's random state is not drawn from."""
    head = model.classifier
    was_training = model.training
    model.eval()
    try:  # on the model's device (the task's batches are on the run's)
        features = model.pooled(input_ids.to(head.weight.device), attention_mask.to(head.weight.device), cached=False)
    finally:
        model.train(was_training)
    head.weight.copy_(ROW_NORM * F.normalize(features.to(head.weight.dtype), dim=1))
    head.bias.zero_()
