"""RoBERTa (masked LM) and OPT (causal LM) through `transformers`, made Opacus-compatible.

`model=roberta` / `model=opt` select a family; `model.size` a hub checkpoint, or `tiny` for a
random-init 2-layer model (width 64) used by tests and CPU smoke runs. `model.path` loads a local
folder (`save_pretrained` layout) instead of the hub. Language models are built by the language
tasks (`Task.build_model`), because the model's vocabulary comes from the task's tokenizer.

Two HF modules do not fit Opacus's per-module grad samplers, and are handled here:
* OPT's `OPTLearnedPositionalEmbedding` is an `nn.Embedding` subclass whose forward takes the
  attention mask and an int; Opacus looks samplers up by exact type (none registered) and its
  activation hook would call `.detach()` on the int. We swap it for `PositionalEmbedding`, the
  same function with the table in a plain `nn.Embedding` child (sharing the same Parameter).
* RoBERTa's `RobertaLMHead` owns `bias` directly, tied to `decoder.bias`. Opacus would hand the
  whole head to functorch and count the bias twice; the decoder's Linear sampler already produces
  that per-sample gradient, so the head's own sampler returns nothing.
Tied input/output embeddings (both families) need no handling: Opacus accumulates the per-sample
gradients of one Parameter over every module using it (tests/test_language.py checks this).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from opacus.grad_sample import register_grad_sampler
from torch import nn
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding
from transformers.models.roberta.modeling_roberta import RobertaLMHead

from dpbench.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LanguageFamily:
    kind: str  # "masked" | "causal"
    hub: dict[str, str]  # size -> hub id
    tiny_config: dict


FAMILIES = {
    "roberta": LanguageFamily(
        "masked",
        {"base": "FacebookAI/roberta-base", "large": "FacebookAI/roberta-large"},
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=514, type_vocab_size=1, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2),
    ),
    "opt": LanguageFamily(
        "causal",
        {s: f"facebook/opt-{s}" for s in ("125m", "350m", "1.3b", "2.7b", "6.7b", "13b")},
        dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
             word_embed_proj_dim=64, max_position_embeddings=512, dropout=0.0, attention_dropout=0.0,
             pad_token_id=1, bos_token_id=2, eos_token_id=2),
    ),
}

# Special tokens of the tiny tokenizers, at RoBERTa's / OPT's ids (<s>=0, <pad>=1, </s>=2).
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def family(model_cfg) -> LanguageFamily:
    if model_cfg.name not in FAMILIES:
        raise UserError(f"model={model_cfg.name} is not a language model; use model=roberta or model=opt")
    return FAMILIES[model_cfg.name]


def _source(model_cfg) -> str | None:
    """Local folder or hub id to load from; None for a from-scratch tiny model."""
    if model_cfg.get("path"):
        path = Path(str(model_cfg.path)).expanduser()
        if not path.is_dir():
            raise UserError(f"model.path={path} is not a folder; point it at a save_pretrained/hub download folder")
        return str(path)
    fam = family(model_cfg)
    if model_cfg.size == "tiny":
        return None
    if model_cfg.size not in fam.hub:
        sizes = ", ".join(["tiny", *fam.hub])
        raise UserError(f"model.size={model_cfg.size} is not known for {model_cfg.name}; use one of {sizes}")
    return fam.hub[model_cfg.size]


def _from_pretrained(loader, source: str, **kwargs):
    """from_pretrained, reading only the local cache when the hub is out of reach (no retries)."""
    from dpbench.data.text import hub_offline, use_offline_mode

    offline = not Path(source).is_dir() and hub_offline()
    if offline:
        use_offline_mode()
        kwargs["local_files_only"] = True
    try:
        return loader.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as error:
        where = "offline and not in the local cache" if offline else type(error).__name__
        raise UserError(
            f"cannot load {source!r} ({where}); download it on a machine with access "
            f"(`hf download {source} --local-dir DIR`) and set model.path=DIR"
        ) from error


def load_tokenizer(model_cfg, corpus: Iterable[str] = ()):
    """The model's tokenizer; for a from-scratch tiny model, a byte-level BPE trained on `corpus`."""
    source = _source(model_cfg)
    if source is None:
        return train_tiny_tokenizer(model_cfg.name, corpus)
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, source)


def train_tiny_tokenizer(name: str, corpus: Iterable[str], vocab_size: int = 4096):
    """Byte-level BPE (RoBERTa's and OPT's scheme) trained on `corpus`, as a transformers tokenizer.

    RoBERTa encodes `<s> x </s>`; OPT prepends `</s>` as its BOS, as the real tokenizers do.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    if FAMILIES[name].kind == "masked":
        tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
        bos = "<s>"
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="</s> $A", pair="</s> $A $B", special_tokens=[("</s>", 2)]
        )
        bos = "</s>"
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        mask_token="<mask>", cls_token="<s>", sep_token="</s>", model_max_length=512,
    )


def load_language_model(model_cfg, tokenizer) -> nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM, OPTConfig, RobertaConfig

    fam = family(model_cfg)
    dtype = DTYPES.get(str(model_cfg.get("dtype", "float32")))
    if dtype is None:
        raise UserError(f"model.dtype={model_cfg.dtype} is not known; use one of {', '.join(DTYPES)}")
    auto = AutoModelForMaskedLM if fam.kind == "masked" else AutoModelForCausalLM
    source = _source(model_cfg)
    if source is None:
        config_class = RobertaConfig if fam.kind == "masked" else OPTConfig
        model = auto.from_config(config_class(vocab_size=len(tokenizer), **fam.tiny_config))
        model = model.to(dtype)
    else:
        model = _from_pretrained(auto, source, dtype=dtype)
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model only "
                        f"{model.get_input_embeddings().num_embeddings}; load both from the same folder")
    return make_opacus_compatible(model)


def save_tiny(folder, name: str, corpus: Iterable[str]) -> Path:
    """Write a tiny random-init model and its tokenizer in the `from_pretrained` layout (tests)."""
    from omegaconf import OmegaConf

    folder = Path(folder)
    tokenizer = train_tiny_tokenizer(name, corpus)
    model = load_language_model(OmegaConf.create({"name": name, "size": "tiny", "path": None}), tokenizer)
    undo_opacus_compatible(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# --- Opacus compatibility -------------------------------------------------------------------


class PositionalEmbedding(nn.Module):
    """OPTLearnedPositionalEmbedding's function, with its table in a plain nn.Embedding child."""

    def __init__(self, original: OPTLearnedPositionalEmbedding):
        super().__init__()
        self.offset = original.offset
        self.embedding = nn.Embedding(original.num_embeddings, original.embedding_dim, device="meta")
        self.embedding.weight = original.weight  # the same Parameter, not a copy

    def forward(self, attention_mask, past_key_values_length: int = 0, position_ids=None):
        if position_ids is None:  # as in OPTLearnedPositionalEmbedding.forward
            position_ids = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()
            position_ids = position_ids[:, past_key_values_length:]
        return self.embedding(position_ids + self.offset)


def make_opacus_compatible(model: nn.Module) -> nn.Module:
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is OPTLearnedPositionalEmbedding:
                setattr(module, name, PositionalEmbedding(child))
    return model


def undo_opacus_compatible(model: nn.Module) -> nn.Module:
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, PositionalEmbedding):
                original = OPTLearnedPositionalEmbedding(child.embedding.num_embeddings - child.offset,
                                                         child.embedding.embedding_dim)
                original.weight = child.embedding.weight
                setattr(module, name, original)
    return model


@register_grad_sampler(RobertaLMHead)
def _roberta_lm_head_grad_sample(layer: RobertaLMHead, activations, backprops) -> dict:
    # The head's only own Parameter is `bias`, the very tensor `decoder.bias` is; the decoder's
    # Linear grad sampler produces its per-sample gradient (counting it here would double it).
    if layer.bias is not layer.decoder.bias:
        raise UserError("RobertaLMHead.bias is not tied to decoder.bias; this transformers version is unsupported")
    return {}
