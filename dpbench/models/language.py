"""What the language families (roberta.py, opt.py) share: the record, tokenizer, model loading.

Each family is one file here calling `register_language_family(name, LanguageFamily(...))`, plus
conf/model/<name>.yaml. `model.size` picks a hub checkpoint, or `tiny` for a random-init model
(the record's `tiny_config`) used by tests and CPU smoke runs. `model.path` loads a local folder
(`save_pretrained` layout) instead of the hub. Language models are built by the language tasks
(`Task.build_model`), because the model's vocabulary comes from the task's tokenizer.
`model.dtype` is the dtype the weights load in. Weights that train stay float32 (a run with
bf16/fp16 trainable weights is refused in dpbench/precision.py: they have no fp32 master copy, so small
updates round away; LoRA adapters are made fp32 on a low-precision base): a low dtype is for
frozen weights, and a low-precision forward is `train.precision` (autocast).

transformers is imported inside functions only: importing this package (registry discovery)
must not import it, so that image runs never load it.
Tied input/output embeddings need no handling: Opacus accumulates the per-sample gradients of one
Parameter over every module using it (tests/models/test_language.py checks this).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from dpbench.errors import UserError
from dpbench.models import MODELS, ModelFamily, RegisteredModel, apply_opacus_fixes, language_family

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO_CLASSES = {"masked": "AutoModelForMaskedLM", "causal": "AutoModelForCausalLM",
                "encoder": "AutoModel"}  # encoder: a bare encoder its task puts a head on (bert.py)


@dataclass(frozen=True, kw_only=True)
class LanguageFamily(ModelFamily):
    objective: str  # "masked" | "causal": the Auto class and the tiny tokenizer's template
    hub: dict[str, str] = field(default_factory=dict)  # size -> hub id
    tiny_config: dict = field(default_factory=dict)  # transformers config of the random-init `tiny`
    libraries: tuple[str, ...] = ("transformers", "tokenizers", "datasets")  # loaded lazily (warm-up)


def register_language_family(name: str, family: LanguageFamily) -> None:
    if family.objective not in AUTO_CLASSES or not family.language_task or not family.model_type:
        raise ValueError(f"language family {name!r} needs objective in {list(AUTO_CLASSES)}, language_task and model_type")

    def build_outside_language_task(model_cfg, spec):
        raise UserError(f"model={name} is a language model; use a language dataset (dataset.task: language, e.g. dataset=sst2)")

    MODELS.register(name)(RegisteredModel(build_outside_language_task, family))


# Special tokens of the tiny tokenizers, at RoBERTa's / OPT's ids (<s>=0, <pad>=1, </s>=2).
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def family(model_cfg) -> LanguageFamily:
    return language_family(model_cfg.name)


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


def load_tokenizer(model_cfg, public_texts: Iterable[str] = ()):
    """The model's tokenizer; for a from-scratch tiny model, a byte-level BPE trained on public
    text only (`public_tokenizer_corpus`): `public_texts` (the task's prompt templates, label
    words and candidates) and a fixed list of common English words. Never pass training or test
    records: the vocabulary is released with the model and nothing charges for it."""
    source = _source(model_cfg)
    if source is None:
        return train_tiny_tokenizer(model_cfg.name, public_tokenizer_corpus(public_texts))
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer, source)


SENTENCE_INITIAL_WORDS = 200  # the bundled words also kept bare (sentence-initial, lower-case)


def public_tokenizer_corpus(public_texts: Iterable[str] = ()) -> list[str]:
    """What a tiny tokenizer is trained on: `public_texts` first, then the bundled common-English
    words (dpbench/data/public_text.py) as ' word' (inside a sentence) and 'Word' (capitalised
    at its start), and the first SENTENCE_INITIAL_WORDS of them (the frequent function words)
    also bare, lower-case: every such form is one token (about 3,700 of the 4,096 entries). A fixed function of public text: the vocabulary is the same whatever the
    data splits hold."""
    from dpbench.data.public_text import COMMON_ENGLISH_WORDS

    words = list(dict.fromkeys(COMMON_ENGLISH_WORDS))  # de-duplicated, order kept
    forms = [form for w in words for form in (" " + w, w.capitalize())]
    return [*public_texts, *forms, *words[:SENTENCE_INITIAL_WORDS]]


def train_tiny_tokenizer(name: str, corpus: Iterable[str], vocab_size: int = 4096):
    """Byte-level BPE (RoBERTa's and OPT's scheme) trained on `corpus`, as a transformers tokenizer.

    Runs pass a public corpus only (`load_tokenizer`); every byte is in the initial alphabet, so
    any text encodes. Masked LMs encode `<s> x </s>` (RoBERTa); causal LMs prepend `</s>` as
    their BOS (OPT), as the real tokenizers do.
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
    if language_family(name).objective == "masked":
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
    import transformers

    fam = family(model_cfg)
    dtype = DTYPES.get(str(model_cfg.get("dtype", "float32")))
    if dtype is None:
        raise UserError(f"model.dtype={model_cfg.dtype} is not known; use one of {', '.join(DTYPES)}")
    auto = getattr(transformers, AUTO_CLASSES[fam.objective])
    source = _source(model_cfg)
    if source is None:
        config = transformers.AutoConfig.for_model(fam.model_type, vocab_size=len(tokenizer), **fam.tiny_config)
        model = auto.from_config(config).to(dtype)
    else:
        model = _from_pretrained(auto, source, dtype=dtype)
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but the model only "
                        f"{model.get_input_embeddings().num_embeddings}; load both from the same folder")
    return apply_opacus_fixes(model, model_cfg.name)


def save_tiny(folder, name: str, corpus: Iterable[str]) -> Path:
    """Write a tiny random-init model and its tokenizer in the `from_pretrained` layout (tests)."""
    from omegaconf import OmegaConf

    folder = Path(folder)
    tokenizer = train_tiny_tokenizer(name, corpus)
    model = load_language_model(OmegaConf.create({"name": name, "size": "tiny", "path": None}), tokenizer)
    for fix in reversed(language_family(name).opacus_fixes):
        model = fix.undo(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
