"""The real tier's data preparation is 1-stable: one row added to (or removed from) the Rotten
Tomatoes file changes the training part by at most one record, as the add/remove accountant assumes
(ARCHITECTURE.md, "the neighbouring relation"). Keep-first de-duplication failed it: a row added
before an existing sentence swapped that record's label and movie (two records)."""

from __future__ import annotations

import bz2
import csv
import random
from collections import Counter

import pytest
from omegaconf import OmegaConf

from dpbench.data.rt_snippets import CORPUS_FILE, DATA_VERSION, load_rt_snippets, snippets
from dpbench.errors import UserError

FIELDS = ["category", "text", "movie_name", "has_plot_and_reviews"]


def corpus(rng: random.Random, rows: int = 60) -> list[dict]:
    """Rows with repeated sentences (several copies, across labels and movies), plot rows and blanks."""
    sentences = [f"Sentence number {i}." for i in range(rows // 2)]
    out = []
    for _ in range(rows):
        text = rng.choice(sentences)
        if rng.random() < 0.2:  # the same sentence spelt otherwise: one normalised text
            text = "  " + text.upper().replace(" ", "\t")
        out.append({"category": rng.choice(["fresh", "rotten", "rotten", "plot"]), "text": text,
                    "movie_name": f"movie {rng.randrange(12)}", "has_plot_and_reviews": "True"})
    return out


def training_part(rows: list[dict], tmp_path) -> Counter:
    path = tmp_path / CORPUS_FILE
    with bz2.open(path, "wt", encoding="utf-8", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    train, _ = load_rt_snippets(OmegaConf.create({"path": str(path), "test_fraction": 0.3, "data_version": DATA_VERSION}))
    return Counter(train)  # a multiset of (text, label, movie) records


def distance(a: Counter, b: Counter) -> int:
    return sum(((a - b) + (b - a)).values())


def test_adding_a_row_before_an_existing_sentence_changes_at_most_one_training_record(tmp_path):
    base = [{"category": "fresh", "text": "A great film.", "movie_name": "m1", "has_plot_and_reviews": "True"},
            {"category": "rotten", "text": "Dull.", "movie_name": "m2", "has_plot_and_reviews": "True"}]
    base += [{"category": "fresh", "text": f"Filler {i}.", "movie_name": f"f{i}", "has_plot_and_reviews": "True"}
             for i in range(20)]  # movies enough for both sides of the split
    added = {"category": "rotten", "text": "a GREAT  film.", "movie_name": "m3", "has_plot_and_reviews": "True"}
    before, after = training_part(base, tmp_path), training_part([added, *base], tmp_path)
    assert distance(before, after) <= 1  # keep-first swapped ("A great film.", fresh, m1) for the added row: 2


@pytest.mark.parametrize("trial", range(4))
def test_every_one_row_neighbour_of_a_random_corpus_is_at_most_one_training_record_away(trial, tmp_path):
    rng = random.Random(trial)
    rows = corpus(rng)
    base = training_part(rows, tmp_path)
    for position in range(0, len(rows) + 1, 3):  # a copy of an existing row's text at every third position
        new = dict(rng.choice(rows), category=rng.choice(["fresh", "rotten"]), movie_name=f"movie {rng.randrange(12)}")
        assert distance(base, training_part([*rows[:position], new, *rows[position:]], tmp_path)) <= 1
    for position in range(0, len(rows), 3):  # and every third row removed
        assert distance(base, training_part(rows[:position] + rows[position + 1:], tmp_path)) <= 1


def test_a_repeated_text_is_left_out_with_every_copy():
    rows = [{"category": "fresh", "text": "Same.", "movie_name": "a"}, {"category": "rotten", "text": " same. ", "movie_name": "b"},
            {"category": "fresh", "text": "Once.", "movie_name": "a"}]
    assert [s.text for s in snippets(rows)] == ["Once."]


def test_another_data_version_is_refused_in_one_line(tmp_path):
    with pytest.raises(UserError, match="data_version=1"):
        load_rt_snippets(OmegaConf.create({"path": str(tmp_path), "test_fraction": 0.2, "data_version": 1}))
