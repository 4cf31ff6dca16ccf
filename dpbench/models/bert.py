"""BERT-family encoders for sentence classification: the family record and the model.

`model=minilm` is the fetched all-MiniLM-L6-v2 (`dpbench-fetch minilm-l6`, read from dpbench's
asset cache, dpbench/assets.py); `model.path=DIR` loads any local Hugging Face BERT-type folder
(config.json, weights, tokenizer files) instead. Both load offline (transformers' BertModel).

The classifier: a fresh Linear head on the attention-masked mean of the last hidden states
(`model.pooling: mean`, what all-MiniLM-L6-v2 was trained to produce) or on BERT's pooler
(`pooler`: tanh(dense([CLS])); MiniLM's pooler weights are left over from its base model). Single
sentences: token_type_ids all 0. The task (dpbench/tasks/sentence_classification.py) builds it,
because the tokenizer comes from the same folder.

What trains (the same for every algorithm: they train `requires_grad` parameters):
`model.freeze_embeddings` freezes the embedding block (word, position and type embeddings and
their LayerNorm; the word embeddings are half of MiniLM's 22.7M parameters); `model.trained_blocks`
= k trains only the top k encoder layers and the head (the lower layers and the embeddings frozen).

Every module with trainable weights is a Linear, Embedding or LayerNorm, which the per-example
engines (materialize, ghost, bk) all cover without functorch (tests/models/test_bert.py checks them
against one-example-at-a-time autograd). transformers is imported inside functions only.
"""

from __future__ import annotations

import torch
from torch import nn

from dpbench.errors import UserError
from dpbench.models import apply_opacus_fixes
from dpbench.models.language import LanguageFamily, register_language_family

POOLINGS = ("mean", "pooler")

BERT = LanguageFamily(
    objective="encoder",  # a bare encoder (AutoModel) with dpbench's classification head
    language_task="sentence_classification",
    model_type="bert",
    # Encoder layers' Linears (not the pooler, not the head): BertModel's names, as RoBERTa's.
    projected_modules=(
        "*layer.*.attention.self.query", "*layer.*.attention.self.key", "*layer.*.attention.self.value",
        "*layer.*.attention.output.dense", "*layer.*.intermediate.dense", "*layer.*.output.dense",
    ),
    lora_targets=("query", "value"),  # as for RoBERTa (MeZO's and DPZero's LoRA baseline)
    trained_modules=("classifier",),  # the fresh head stays trained beside LoRA adapters
    block_modules=("*encoder.layer.*",),  # train.sharding=fsdp wraps each encoder layer
    zero_shot_head=True,  # model.head_init=zero_shot: the head from the pooled label descriptions
)
# model=bert: any local BERT folder (model.path); model=minilm: the fetched all-MiniLM-L6-v2 (its
# config names the asset). One record: the same architecture, so the same facts.
for name in ("bert", "minilm"):
    register_language_family(name, BERT)


class SentenceClassifier(nn.Module):
    """A BERT encoder and a Linear head on its pooled output: `forward(input_ids, attention_mask)`
    -> logits [B, classes]."""

    def __init__(self, encoder: nn.Module, num_classes: int, pooling: str):
        super().__init__()
        self.bert = encoder
        self.pooling = pooling
        self.classifier = nn.Linear(encoder.config.hidden_size, num_classes)
        self.config = encoder.config  # model_type "bert": family_of finds the record on a copy too
        self.prefix_cache = None  # model.cache_frozen: the frozen lower part's outputs (bert_prefix.py)
        self.lora_targets: list[str] | None = None  # with trained_blocks: the trained layers' query/value only

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooled(input_ids, attention_mask))

    def pooled(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, cached: bool = True) -> torch.Tensor:
        """The sentence features the head reads, [B, hidden] (`cached=False`: the whole encoder runs,
        never the cache: model.head_init=zero_shot's label descriptions are not the task's sentences)."""
        hidden = self._from_cache(input_ids, attention_mask) if cached else None
        if hidden is None:
            # Position ids per example ([B, T], not BertEmbeddings' shared [1, T] buffer): the per-example
            # engines read an Embedding's input as one row per example; a shared row would hand them the
            # batch's summed gradient as if it were one example's (caught by tests/models/test_bert.py).
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                            token_type_ids=torch.zeros_like(input_ids))
            if self.pooling == "pooler":  # BertModel ran its pooler (once: the engines hook each call)
                return out.pooler_output
            hidden = out.last_hidden_state
        elif self.pooling == "pooler":
            return self.bert.pooler(hidden)
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        # masked mean over real tokens; every sequence has [CLS] and [SEP], so the count is >= 1
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1.0)

    def _from_cache(self, input_ids, attention_mask) -> torch.Tensor | None:
        """The last hidden states from the cached frozen part and the trained top layers; None when
        there is no cache or something below the cached depth trains (then the whole encoder runs)."""
        cache = self.prefix_cache
        if cache is None:
            return None
        layers = self.bert.encoder.layer
        below = [self.bert.embeddings, *layers[: cache.depth]]
        if any(p.requires_grad for module in below for p in module.parameters()):
            return None
        hidden = cache.lookup(input_ids, attention_mask)
        if hidden is None:
            return None
        from dpbench.models.bert_prefix import run_layers

        hidden = hidden.to(self.classifier.weight.dtype)  # the probe's float64 copy reads the fp32 cache
        return run_layers(layers[cache.depth:], self.config, hidden, attention_mask)

    def expect(self, sequences: list[list[int]]) -> None:
        """The task's sentences, computed through the cached frozen part up front (no-op without one)."""
        if self.prefix_cache is not None:
            self.prefix_cache.expect(sequences)


def source_folder(model_cfg):
    """The folder to load: `model.path`, else the fetched `model.asset`."""
    from pathlib import Path

    if model_cfg.get("path"):
        folder = Path(str(model_cfg.path)).expanduser()
        if not (folder / "config.json").is_file():
            raise UserError(f"model.path={folder} has no config.json; point it at a Hugging Face BERT folder "
                            "(config.json, model.safetensors, tokenizer.json)")
        return folder
    if not model_cfg.get("asset"):
        raise UserError(f"model={model_cfg.name} needs model.path=DIR (a Hugging Face BERT folder) or model.asset "
                        "(e.g. model=minilm)")
    from dpbench.assets import require_asset

    return require_asset(str(model_cfg.asset))


def load_tokenizer(model_cfg):
    from transformers import AutoTokenizer

    folder = source_folder(model_cfg)
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load a tokenizer from {folder} ({type(error).__name__}); it needs tokenizer.json "
                        "or vocab.txt") from error


def load_classifier(model_cfg, num_classes: int, vocab_size: int) -> SentenceClassifier:
    """The encoder from the folder (float32), a fresh head, and the configured parameters frozen."""
    import transformers

    pooling = str(model_cfg.get("pooling", "mean"))
    if pooling not in POOLINGS:
        raise UserError(f"model.pooling={pooling} is not known; use {' or '.join(POOLINGS)}")
    folder = source_folder(model_cfg)
    config = transformers.AutoConfig.from_pretrained(str(folder))
    if config.model_type != "bert":
        raise UserError(f"{folder} holds a {config.model_type} model, not a BERT; model={model_cfg.name} loads BERT folders")
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()  # MiniLM's unused pooler weights would be reported
    transformers.logging.disable_progress_bar()  # one bar per load in every run's log
    try:
        encoder = transformers.BertModel.from_pretrained(str(folder), dtype=torch.float32,
                                                         add_pooling_layer=pooling == "pooler")
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load a BertModel from {folder} ({type(error).__name__}: {error})") from error
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
    if encoder.get_input_embeddings().num_embeddings < vocab_size:
        raise UserError(f"the tokenizer has {vocab_size} tokens but the model only "
                        f"{encoder.get_input_embeddings().num_embeddings}; load both from the same folder")
    model = SentenceClassifier(encoder, num_classes, pooling)
    depth = freeze(model, bool(model_cfg.get("freeze_embeddings", False)), model_cfg.get("trained_blocks"))
    model = apply_opacus_fixes(model, str(model_cfg.name))
    if model_cfg.get("cache_frozen") and depth is not None:
        from dpbench.models.bert_prefix import prefix_cache

        model.prefix_cache = prefix_cache(folder, model.bert, depth)
    return model


def freeze(model: SentenceClassifier, embeddings: bool, trained_blocks) -> int | None:
    """Freeze the embedding block, and with trained_blocks = k every encoder layer below the top k
    (k = 0: the head alone, on the frozen encoder: the linear probe). Returns how many encoder
    layers are frozen below the trained ones (None: the embeddings train, nothing is frozen below)."""
    layers = model.bert.encoder.layer
    depth = 0
    if trained_blocks is not None:
        k = int(trained_blocks)
        if not 0 <= k <= len(layers):
            raise UserError(f"model.trained_blocks={trained_blocks} must lie in 0..{len(layers)} "
                            "(0: the head alone; null: every layer)")
        embeddings, depth = True, len(layers) - k
        for layer in layers[:depth]:
            layer.requires_grad_(False)
        # DP-LoRA adapts the trained layers only (the frozen ones stay as the checkpoint has them)
        model.lora_targets = [f"bert.encoder.layer.{i}.attention.self.{name}"
                              for i in range(depth, len(layers)) for name in ("query", "value")]
    if embeddings:
        model.bert.embeddings.requires_grad_(False)
        return depth
    return None
