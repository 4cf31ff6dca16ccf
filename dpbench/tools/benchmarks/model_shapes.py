"""What the memory model and the trace build a model from, offline: a language model's transformers
config at its real size (a local folder, the hub cache, or the configs of the checkpoints the
presets name), and an image model's input as the run's task gives it (`image_spec`)."""

from __future__ import annotations

# transformers configs of the hub checkpoints the presets name, for when neither a local folder
# nor the hub cache has them (offline). From the hub's config.json of each checkpoint.
_OPT = dict(vocab_size=50272, max_position_embeddings=2048, do_layer_norm_before=True, pad_token_id=1,
            bos_token_id=2, eos_token_id=2)
KNOWN_CONFIGS: dict[str, dict] = {
    "facebook/opt-125m": dict(_OPT, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072,
                              word_embed_proj_dim=768),
    "facebook/opt-350m": dict(_OPT, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096,
                              word_embed_proj_dim=512, do_layer_norm_before=False),
    "facebook/opt-1.3b": dict(_OPT, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192,
                              word_embed_proj_dim=2048),
    "facebook/opt-2.7b": dict(_OPT, hidden_size=2560, num_hidden_layers=32, num_attention_heads=32, ffn_dim=10240,
                              word_embed_proj_dim=2560),
    "facebook/opt-6.7b": dict(_OPT, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384,
                              word_embed_proj_dim=4096),
    "facebook/opt-13b": dict(_OPT, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40, ffn_dim=20480,
                             word_embed_proj_dim=5120),
    "facebook/opt-30b": dict(_OPT, hidden_size=7168, num_hidden_layers=48, num_attention_heads=56, ffn_dim=28672,
                             word_embed_proj_dim=7168),
    "FacebookAI/roberta-base": dict(vocab_size=50265, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                                    intermediate_size=3072, max_position_embeddings=514, type_vocab_size=1,
                                    pad_token_id=1),
    "FacebookAI/roberta-large": dict(vocab_size=50265, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                     intermediate_size=4096, max_position_embeddings=514, type_vocab_size=1,
                                     pad_token_id=1),
    # all-MiniLM-L6-v2's shapes (model=minilm's asset), for the memory tools before `dpbench-fetch minilm-l6`
    "asset:minilm-l6": dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                            intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, pad_token_id=0),
    "google-bert/bert-base-uncased": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                                          num_attention_heads=12, intermediate_size=3072,
                                          max_position_embeddings=512, type_vocab_size=2, pad_token_id=0),
}
# Sizes the memory model and the trace know by shape alone: for families whose runs load only a
# local folder (model=bert loads model.path; `+model.size=base` names BERT-base's shapes here), and
# sizes no run offers (OPT-30B: the zeroth-order inference-memory figure, docs/memory-prediction.md)
SHAPE_ONLY_SIZES: dict[str, dict[str, str]] = {"bert": {"base": "google-bert/bert-base-uncased"},
                                               "opt": {"30b": "facebook/opt-30b"}}  # the zeroth-order memory figure
TINY_VOCAB = 4096  # the tiny models' byte-level BPE (dpbench.models.language.train_tiny_tokenizer)


def language_config(cfg):
    """The transformers config of `cfg.model`: a local folder, the hub cache, `KNOWN_CONFIGS`, or
    the family's tiny config."""
    import transformers

    from dpbench.errors import UserError
    from dpbench.models.language import family

    fam = family(cfg.model)
    size = str(cfg.model.get("size"))
    if size == "tiny" and not cfg.model.get("path"):
        return transformers.AutoConfig.for_model(fam.model_type, vocab_size=TINY_VOCAB, **fam.tiny_config)
    sizes = {**fam.hub, **SHAPE_ONLY_SIZES.get(str(cfg.model.name), {})}
    source = str(cfg.model.path) if cfg.model.get("path") else sizes.get(size)
    if source is None and cfg.model.get("asset") and not cfg.model.get("size"):  # model=minilm: a fetched asset
        from dpbench.assets import asset_dir

        folder = asset_dir(str(cfg.model.asset))
        source = str(folder) if (folder / "config.json").is_file() else f"asset:{cfg.model.asset}"
    if source is None:
        raise UserError(f"model.size={size} is not a size of model={cfg.model.name}; use one of "
                        f"tiny, {', '.join(sizes)}")
    try:
        return transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError):
        if source not in KNOWN_CONFIGS:
            raise UserError(f"no config of {source} offline: set model.path= to a local folder holding its "
                            "config.json") from None
        return transformers.AutoConfig.for_model(fam.model_type, **KNOWN_CONFIGS[source])


def image_spec(cfg):
    """The image model's DataSpec as the run's task gives it: from the config where the data set
    declares its shape (`dataset.image_size`: synthetic at 224 px), else read from the data set
    itself (digits: 1 x 8 x 8, patch 2), loaded outside any fake tensor mode."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from dpbench.data import load_dataset
    from dpbench.models import DataSpec

    data = cfg.dataset
    if data.get("image_size") is not None:
        return DataSpec(num_classes=int(data.get("num_classes") or 10), channels=int(data.get("channels") or 3),
                        image_size=int(data.image_size), patch_size=int(data.get("patch_size") or 4))
    with unset_fake_temporarily():
        loaded = load_dataset(data, int(cfg.get("seed", 0)))
    return DataSpec(num_classes=loaded.num_classes, channels=loaded.channels, image_size=loaded.image_size,
                    patch_size=loaded.patch_size, input_shape=tuple(loaded.train_images.shape[1:]))
