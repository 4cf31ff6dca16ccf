"""A tiny random BERT in the real on-disk format (config.json, model.safetensors, tokenizer.json,
as all-MiniLM-L6-v2's folder holds them), and a tiny corpus in the Rotten Tomatoes csv.bz2 layout.

The weights are drawn from this module's own generator (not transformers' initialiser), so no
test depends on how a dependency draws random weights; the WordPiece vocabulary is a fixed list.
"""

from __future__ import annotations

import bz2
import csv
import io
import json
from pathlib import Path

import torch

import dpbench  # noqa: F401  (its torchvision fix runs before transformers imports torchvision)
from helpers.text_data import BAD, GOOD

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "film", "is", "and", "a", "plot", "about", ".", ",", "!", *GOOD, *BAD]
CONFIG = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
              max_position_embeddings=64, type_vocab_size=2, hidden_dropout_prob=0.0,
              attention_probs_dropout_prob=0.0, pad_token_id=0)


def write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": True}))


def write_tiny_bert(folder: Path, seed: int = 0) -> Path:
    """A 2-layer, width-16 BertModel folder that `BertModel.from_pretrained` and `AutoTokenizer` read."""
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = BertConfig(vocab_size=len(SPECIAL) + len(WORDS), **CONFIG)
    shapes = {name: tensor.shape for name, tensor in BertModel(config, add_pooling_layer=True).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if name.endswith("position_ids"):
            continue  # a buffer, rebuilt by BertEmbeddings
        values = 0.2 * torch.randn(shape, generator=generator)
        weights[name] = (1.0 + values if "LayerNorm.weight" in name else values).contiguous()
    save_file(weights, str(folder / "model.safetensors"))
    config.architectures = ["BertModel"]
    config.to_json_file(str(folder / "config.json"))
    write_tokenizer(folder)
    return folder


def corpus_rows(movies: int = 16, per_movie: int = 3) -> list[dict]:
    """Rows of the corpus layout: fresh/rotten snippets, a plot per movie, an empty text, and one
    sentence filed again under another movie (and differently cased) that de-duplication drops."""
    rows = []
    for m in range(movies):
        name = f"Movie {m}"
        rows.append({"category": "plot", "text": f"a plot about film {m} .", "movie_name": name, "has_plot_and_reviews": "True"})
        for j in range(per_movie):
            label = (m + j) % 2
            words = GOOD if label else BAD
            text = f"the film is {words[(m + j) % 5]} and {words[(2 * m + j) % 5]} {'!' * (m + 1)} {j}"
            # a short one (batches get padded), distinct per movie: de-duplication drops every copy of a repeated text
            text = f"{words[m % 5]} {'.' * (m % 3)} {m // 15}" if j == 0 else text
            rows.append({"category": "fresh" if label else "rotten", "text": text, "movie_name": name,
                         "has_plot_and_reviews": "True"})
    rows.append({"category": "fresh", "text": rows[1]["text"].upper() + "  ", "movie_name": "Movie 99", "has_plot_and_reviews": "False"})
    rows.append({"category": "rotten", "text": "", "movie_name": "Movie 98", "has_plot_and_reviews": "False"})
    return rows


def write_corpus(path: Path, rows: list[dict] | None = None) -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["category", "text", "movie_name", "has_plot_and_reviews"])
    writer.writeheader()
    writer.writerows(corpus_rows() if rows is None else rows)
    Path(path).write_bytes(bz2.compress(buffer.getvalue().encode("utf-8")))
    return Path(path)


def tiny_bert_cfg(files: tuple[Path, Path], *extra: str):
    """model=minilm on the tiny BERT folder and dataset=rt_snippets on the tiny corpus (`files`: the
    paths write_tiny_bert and write_corpus return), offline, 8 tokens, half the movies for testing."""
    from helpers.config import OFFLINE, compose

    model, corpus = files
    return compose([*OFFLINE, "model=minilm", f"model.path={model}", "dataset=rt_snippets", f"dataset.path={corpus}",
                    "dataset.test_fraction=0.5", "dataset.max_length=8", *extra])
