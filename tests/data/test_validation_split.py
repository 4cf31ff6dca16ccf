"""The validation split (dataset.validation_fraction): a per-record keyed hash, out of the training
set, planned from the public size n (1 - f)."""

import math

import pytest
import torch
from helpers.config import FIXED_SIGMA, OFFLINE, TINY, compose

from dpbench.data.validation import in_validation, split_training_set, tensor_rows, text_rows, unit_hash
from dpbench.errors import UserError


def contents(n: int, seed: int = 0) -> list[bytes]:
    generator = torch.Generator().manual_seed(seed)
    return [bytes(torch.randint(0, 256, (16,), generator=generator, dtype=torch.uint8).tolist()) for _ in range(n)]


def test_adding_or_removing_one_example_moves_no_other_example():
    records = contents(500)
    before = in_validation(records, 0.3)
    added = in_validation([records[0] + b"x", *records], 0.3)  # one more example, anywhere
    assert added[1:] == before
    removed = in_validation(records[:250] + records[251:], 0.3)
    assert removed == before[:250] + before[251:]


def test_the_realised_fraction_is_near_f():
    n, f = 20_000, 0.2
    held = sum(in_validation(contents(n, seed=1), f)) / n
    assert abs(held - f) < 4 * math.sqrt(f * (1 - f) / n)
    assert 0 <= unit_hash(b"any") < 1


def test_the_split_is_a_function_of_content_and_label():
    images = torch.randn(6, 1, 2, 2)
    labels = torch.tensor([0, 1, 2, 0, 1, 2])
    rows = tensor_rows(images, labels)
    assert rows == tensor_rows(images.clone(), labels.clone())
    assert tensor_rows(images, labels + 1) != rows  # the label is part of the record
    assert text_rows([{"b": 1, "a": "x"}]) == text_rows([{"a": "x", "b": 1}])  # field order is not


@pytest.mark.parametrize("fraction", [1.0, -0.1, 1.5, "abc"])
def test_a_fraction_outside_zero_one_is_a_one_line_error(fraction):
    with pytest.raises(UserError, match="dataset.validation_fraction") as error:
        split_training_set({"validation_fraction": fraction}, contents(10))
    assert "\n" not in str(error.value)


def test_an_empty_part_is_a_one_line_error():
    with pytest.raises(UserError, match="dataset.validation_fraction=0.01 leaves an empty"):
        split_training_set({"validation_fraction": 0.01}, contents(3))
    assert split_training_set({"validation_fraction": 0}, contents(3)) is None


@pytest.mark.parametrize("dataset", [["dataset=synthetic"], ["dataset=quadratic", "model=quadratic", "dataset.train_size=300",
                                                             "dataset.test_size=10", "dataset.dimension=4"]])
def test_the_training_part_never_holds_a_validation_example(dataset):
    from dpbench.tasks import build_task

    cfg = compose(dataset + OFFLINE + ["dataset.validation_fraction=0.25"])
    task = build_task(cfg, torch.device("cpu"))
    split = task.split
    train, held = set(split.train_indices), set(split.validation_indices)
    assert not train & held and len(train | held) == split.loaded_size
    assert task.train_size == len(train) and split.planned_train_size == math.floor(split.loaded_size * 0.75 + 0.5)
    if hasattr(task, "data"):
        train_rows = set(tensor_rows(task.data.train_images, task.data.train_labels))
        assert not train_rows & set(tensor_rows(task.validation_images, task.validation_labels))
    else:
        assert not set(tensor_rows(task.train_points)) & set(tensor_rows(task.validation_points))


def test_planning_uses_n_times_one_minus_f():
    from dpbench.run import setup

    cfg = compose(TINY + FIXED_SIGMA + ["algo=dpsgd", "dataset.validation_fraction=0.2", "train.steps=null",
                                        "train.epochs=2"])
    job = setup(cfg)
    planned = math.floor(256 * 0.8 + 0.5)  # synthetic: n = 256
    assert job.task.planning_size == planned == 205  # never the realised part's size (job.task.train_size)
    assert job.privacy.setup.sample_rate == pytest.approx(32 / planned)
    assert job.privacy.setup.expected_batch_size == pytest.approx(32)
    assert job.steps == round(2 * planned / 32)
    assert job.task.split.planned_validation_size == 256 - planned
