"""Fixture text datasets in the hub's field layout (written as <split>.jsonl for dataset.path)."""

from __future__ import annotations

import json
import random
from pathlib import Path

GOOD = ["wonderful", "delightful", "moving", "brilliant", "charming"]
BAD = ["awful", "boring", "dull", "clumsy", "tedious"]


def _sentiment(rng, label: int, classes: int) -> str:
    words = GOOD if label >= classes / 2 else BAD
    return f"the film is {rng.choice(words)} and {rng.choice(words)} ."


def rows(name: str, n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if name in ("sst2", "sst5"):
            classes = 2 if name == "sst2" else 5
            label = i % classes
            out.append({"sentence" if name == "sst2" else "text": _sentiment(rng, label, classes), "label": label})
        elif name in ("snli", "mnli"):
            label = i % 3
            hyp = ["A man sleeps.", "A man is outside.", "A woman sings."][label]
            out.append({"premise": "A man walks a dog in the park.", "hypothesis": hyp, "label": label})
        elif name == "rte":
            label = i % 2
            out.append({"sentence1": "Paris is the capital of France.", "sentence2": ["Paris is in France.", "Rome is in Spain."][label], "label": label})
        elif name == "trec":
            label = i % 6
            out.append({"text": ["What does NASA stand for ?", "What animal barks ?", "What is love ?",
                                 "Who wrote Hamlet ?", "Where is Paris ?", "How many legs has a cat ?"][label],
                        "coarse_label": label, "fine_label": 0})
        elif name == "boolq":
            answer = i % 2 == 0
            out.append({"question": "is the sky blue" if answer else "is the sky green",
                        "passage": "The sky is blue on a clear day.", "answer": answer})
        elif name == "squad":
            colour = rng.choice(["red", "blue", "green"])
            out.append({"id": str(i), "title": "Cars", "context": f"The car is {colour}.",
                        "question": "What colour is the car?",
                        "answers": {"text": [colour, f"{colour} car"], "answer_start": [11, 11]}})
        elif name == "drop":
            count = rng.choice(["two", "three", "four"])
            out.append({"section_id": "s", "query_id": str(i), "passage": f"He scored {count} goals.",
                        "question": "How many goals did he score?",
                        "answers_spans": {"spans": [count], "types": ["number"]}})
    return out


TEST_SPLIT = {"sst2": "validation", "sst5": "test", "snli": "validation", "mnli": "validation_matched",
              "rte": "validation", "trec": "test", "boolq": "validation", "squad": "validation", "drop": "validation"}


def write_dataset(folder: Path, name: str, n_train: int = 48, n_test: int = 16) -> Path:
    folder = Path(folder) / name
    folder.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", n_train, 0), (TEST_SPLIT[name], n_test, 1)):
        with open(folder / f"{split}.jsonl", "w") as f:
            for row in rows(name, n, seed):
                f.write(json.dumps(row) + "\n")
    return folder
