"""OPT (causal LM: candidate scoring and generation, MeZO's setup): the family record.

Opacus fix: `OPTLearnedPositionalEmbedding` is an `nn.Embedding` subclass whose forward takes the
attention mask and an int; Opacus looks samplers up by exact type (none registered) and its
activation hook would call `.detach()` on the int. It is swapped for `PositionalEmbedding`, the
same function with the table in a plain `nn.Embedding` child (sharing the same Parameter).
"""

from __future__ import annotations

import torch
from torch import nn

from dpbench.models import OpacusFix
from dpbench.models.language import LanguageFamily, register_language_family


class PositionalEmbedding(nn.Module):
    """OPTLearnedPositionalEmbedding's function, with its table in a plain nn.Embedding child."""

    def __init__(self, original):
        super().__init__()
        self.offset = original.offset
        self.embedding = nn.Embedding(original.num_embeddings, original.embedding_dim, device="meta")
        self.embedding.weight = original.weight  # the same Parameter, not a copy

    def forward(self, attention_mask, past_key_values_length: int = 0, position_ids=None):
        if position_ids is None:  # as in OPTLearnedPositionalEmbedding.forward
            position_ids = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()
            position_ids = position_ids[:, past_key_values_length:]
        return self.embedding(position_ids + self.offset)


def swap_positional_embeddings(model: nn.Module) -> nn.Module:
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is OPTLearnedPositionalEmbedding:
                setattr(module, name, PositionalEmbedding(child))
    return model


def restore_positional_embeddings(model: nn.Module) -> nn.Module:
    from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, PositionalEmbedding):
                original = OPTLearnedPositionalEmbedding(child.embedding.num_embeddings - child.offset,
                                                         child.embedding.embedding_dim)
                original.weight = child.embedding.weight
                setattr(module, name, original)
    return model


register_language_family("opt", LanguageFamily(
    objective="causal",
    language_task="causal_lm",  # MeZO candidate scoring / generation, 1000/500/1000
    model_type="opt",
    hub={s: f"facebook/opt-{s}" for s in ("125m", "350m", "1.3b", "2.7b", "6.7b", "13b")},
    tiny_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128,
                     word_embed_proj_dim=64, max_position_embeddings=512, dropout=0.0, attention_dropout=0.0,
                     pad_token_id=1, bos_token_id=2, eos_token_id=2),
    # Decoder layers' Linears (not the LM head, tied to the input embedding).
    projected_modules=(
        "*layers.*.self_attn.q_proj", "*layers.*.self_attn.k_proj", "*layers.*.self_attn.v_proj",
        "*layers.*.self_attn.out_proj", "*layers.*.fc1", "*layers.*.fc2",
    ),
    lora_targets=("q_proj", "v_proj"),  # MeZO's and the DPZero paper's LoRA baseline
    block_modules=("*decoder.layers.*",),  # train.sharding=fsdp wraps each decoder layer
    opacus_fixes=(OpacusFix(swap_positional_embeddings, restore_positional_embeddings),),
))
