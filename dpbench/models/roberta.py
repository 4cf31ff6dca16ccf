"""RoBERTa (masked LM, prompt-based few-shot classification): the family record.

Opacus fix: `RobertaLMHead` owns `bias` directly, tied to `decoder.bias`. Opacus would hand the
whole head to functorch and count the bias twice; the decoder's Linear sampler already produces
that per-sample gradient, so the head's own sampler returns nothing.
"""

from __future__ import annotations

from torch import nn

from dpbench.errors import UserError
from dpbench.models import OpacusFix
from dpbench.models.language import LanguageFamily, register_language_family


def _lm_head_grad_sample(layer, activations, backprops) -> dict:
    # The head's only own Parameter is `bias`, the very tensor `decoder.bias` is; the decoder's
    # Linear grad sampler produces its per-sample gradient (counting it here would double it).
    if layer.bias is not layer.decoder.bias:
        raise UserError("RobertaLMHead.bias is not tied to decoder.bias; this transformers version is unsupported")
    return {}


def register_lm_head_sampler(model: nn.Module) -> nn.Module:
    # Registered when a RoBERTa is built (not on import): transformers stays unimported until then.
    from opacus.grad_sample import register_grad_sampler
    from transformers.models.roberta.modeling_roberta import RobertaLMHead

    register_grad_sampler(RobertaLMHead)(_lm_head_grad_sample)
    return model


register_language_family("roberta", LanguageFamily(
    objective="masked",
    language_task="prompt_mlm",  # LM-BFF prompts, k-shot
    model_type="roberta",
    hub={"base": "FacebookAI/roberta-base", "large": "FacebookAI/roberta-large"},
    tiny_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                     max_position_embeddings=514, type_vocab_size=1, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2),
    # Encoder layers' Linears (not the LM head's dense/decoder, not a classification head's).
    projected_modules=(
        "*layer.*.attention.self.query", "*layer.*.attention.self.key", "*layer.*.attention.self.value",
        "*layer.*.attention.output.dense", "*layer.*.intermediate.dense", "*layer.*.output.dense",
    ),
    lora_targets=("query", "value"),  # MeZO's and the DPZero paper's LoRA baseline
    block_modules=("*encoder.layer.*",),  # train.sharding=fsdp wraps each encoder layer
    opacus_fixes=(OpacusFix(register_lm_head_sampler),),
))
