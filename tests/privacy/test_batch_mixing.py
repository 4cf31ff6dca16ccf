"""Models that mix the examples of a batch only where a probe of three records cannot see it: the
layout probe and the norm check also run at the run's largest chunk (`LayoutProbe.largest`) and at
a random size below it, the replaced record at a random position, of the same class, of another and
an outlier, so each is refused in one line in every engine; an ordinary per-example model passes
at those sizes. `build_engine` without a probe refuses (or warns, when told `unprobed=True`).

Every refusal here holds whatever the sizes and positions drawn: the largest chunk is even (a flip
pairs no row with itself) and above 4 (the centring switches on), the outlier tops some feature's
batch maximum (every record of the pool has a feature above -0.9), and a batch of 8 holds other
examples of the classes a replacement of another class swaps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from helpers.toy_modules import SequenceFirst

from dpbench.errors import UserError
from dpbench.models.user_checks import check_norms
from dpbench.privacy.engines import build_engine
from dpbench.privacy.layout import LayoutProbe

ENGINES = ("materialize", "ghost", "bk")
POOL, LARGEST, FEATURES, CLASSES = 24, 8, 6, 3


class PerExample(nn.Module):
    """An ordinary model: each example computed alone (dropout, LayerNorm and GroupNorm included)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.norm, self.group = nn.Linear(FEATURES, 8), nn.LayerNorm(8), nn.GroupNorm(2, 8)
        self.drop, self.head = nn.Dropout(0.2), nn.Linear(8, CLASSES)

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward(self, x):
        return self.head(self.drop(self.group(self.norm(torch.tanh(self.first(self.mix(x)))))))


class CentresLargeBatches(PerExample):
    """Centres its batch only when it holds more than 4 examples (the probe's first 3 pass)."""

    def mix(self, x):
        return x - x.mean(0, keepdim=True) if x.shape[0] > 4 else x


class FlipMixes(PerExample):
    """Mixes each example with its mirror in the batch: the middle of three records stays put."""

    def mix(self, x):
        return x + 0.1 * x.flip(0)


class BatchMaximum(PerExample):
    """Adds the batch's maximum of each feature: only a record that tops a feature moves the others."""

    def mix(self, x):
        return x + 0.1 * x.max(0).values


def untrained_batch_norm():
    """BatchNorm in train mode without running statistics: every example normalised by the batch."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8, track_running_stats=False), nn.Linear(8, CLASSES))


MIXING = {"centres batches above 4": CentresLargeBatches, "flip": FlipMixes, "batch maximum": BatchMaximum,
          "batch norm without running stats": untrained_batch_norm}


def cross_entropy(model, batch):
    return F.cross_entropy(model(batch[0]), batch[1], reduction="none")


def class_balanced(model, batch):
    """Each loss weighted by 1 / its class's count in the batch: a loss that mixes examples by label."""
    x, y = batch
    counts = torch.bincount(y, minlength=CLASSES).to(x.dtype)
    return F.cross_entropy(model(x), y, reduction="none") / counts[y]


def probe(largest: int | None = LARGEST, losses=cross_entropy, sizes: list | None = None, classes: int = CLASSES):
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(POOL, FEATURES, generator=generator), torch.arange(POOL) % classes

    def batch(indices):
        if sizes is not None:
            sizes.append(len(indices))
        return x[list(indices)], y[list(indices)]

    return LayoutProbe(losses, batch, POOL, largest=largest, label=lambda i: int(y[i]))


def one_line(error) -> str:
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", MIXING)
def test_a_batch_mixing_model_is_refused_by_the_probe_in_every_engine(kind, engine):
    model = MIXING[kind]().double()
    with pytest.raises(UserError, match=f"algo.per_sample={engine}: layer .* mixes examples") as refused:
        build_engine(engine, model, probe=probe())
    one_line(refused)


@pytest.mark.parametrize("kind", ["centres batches above 4", "flip"])
def test_three_records_alone_do_not_show_them(kind):
    """Why the larger sizes: at the first three records (no `largest`) both models pass the probe."""
    build_engine("bk", MIXING[kind]().double(), probe=probe(largest=None)).detach()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_norm_check_refuses_them_at_the_runs_sizes(engine):
    """The centring model's norms match on the first 4 records, not in a batch of more."""
    check_norms(CentresLargeBatches(), probe(largest=None), engine, "model=custom")
    with pytest.raises(UserError, match=r"per-example gradient norm of example \d+ in a batch of \d+ differs") as refused:
        check_norms(CentresLargeBatches(), probe(), engine, "model=custom")
    one_line(refused)
    for kind in ("flip", "batch maximum"):  # (the flip: already on the first 4 records, pairs 0-3 and 1-2)
        with pytest.raises(UserError, match=r"per-example gradient norm of example \d+ .*differs"):
            check_norms(MIXING[kind](), probe(), engine, "model=custom")


def test_a_loss_that_weights_by_class_counts_is_refused_by_a_record_of_another_class():
    """Replacing a record by one of its own class moves no other row; one of another class does.
    (Two classes, alternating: the first records' probe replaces record 1 by record 3, its class.)"""
    build_engine("bk", PerExample().double(), probe=probe(None, class_balanced, classes=2)).detach()
    with pytest.raises(UserError, match="mixes examples .* replaced by a record of another class"):
        build_engine("bk", PerExample().double(), probe=probe(losses=class_balanced, classes=2))


@pytest.mark.parametrize("engine", ENGINES)
def test_an_ordinary_model_passes_both_checks_at_the_larger_sizes(engine):
    sizes: list[int] = []
    build_engine(engine, PerExample().double(), probe=probe(sizes=sizes)).detach()
    check_norms(PerExample(), probe(sizes=sizes), engine, "model=custom")
    assert sizes.count(LARGEST) >= 2, sizes  # the probe and the norm check, each at the largest chunk


def test_build_engine_refuses_without_a_probe_and_warns_when_told_to_skip_it():
    pool = torch.randn(POOL, 5, 4, generator=torch.Generator().manual_seed(0))
    sequence_probe = LayoutProbe(lambda m, b: m(b).pow(2).sum(1), lambda i: pool[list(i)].double(), POOL, largest=LARGEST)
    for engine in ENGINES:
        with pytest.raises(UserError, match=r"no probe=LayoutProbe\(.*unprobed=True to skip the check") as refused:
            build_engine(engine, SequenceFirst().double())
        one_line(refused)
        with pytest.raises(UserError, match=r"layer fc \(Linear\): its input .* \(its examples lie along dimension 1\)"):
            build_engine(engine, SequenceFirst().double(), probe=sequence_probe)
    with pytest.warns(UserWarning, match="the layout probe is skipped"):
        build_engine("bk", SequenceFirst().double(), unprobed=True).detach()


def test_a_model_that_cannot_take_the_outlier_is_probed_without_it():
    """Floating inputs read as indices: the outlier's are out of range, so that replacement is skipped
    (not a crash, not a refusal); the other replacements still run."""

    class Indexed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed, self.head = nn.Embedding(10, 4), nn.Linear(4, CLASSES)

        def forward(self, x):
            return self.head(self.embed(x[:, 0].long()))

    pool, labels = torch.arange(POOL, dtype=torch.float64)[:, None] % 10, torch.arange(POOL) % CLASSES
    indexed = LayoutProbe(cross_entropy, lambda i: (pool[list(i)], labels[list(i)]), POOL, largest=LARGEST)
    build_engine("bk", Indexed().double(), probe=indexed).detach()
    check_norms(Indexed(), indexed, "bk", "model=custom")


def test_an_audit_probes_each_model_once_and_still_refuses_another():
    """Inside `layout_verdicts_reused` (one self-audit's jobs) a model identical to one that passed is
    not probed again; a model of another structure still is, and refused; outside, every build probes."""
    from dpbench.privacy.layout import layout_verdicts_reused

    reads: list = []
    with layout_verdicts_reused():
        build_engine("materialize", PerExample().double(), probe=probe(sizes=reads))
        first = len(reads)
        build_engine("materialize", PerExample().double(), probe=probe(sizes=reads))
        assert first > 0 and len(reads) == first
        with pytest.raises(UserError, match="mixes examples"):
            build_engine("materialize", FlipMixes().double(), probe=probe())
    build_engine("materialize", PerExample().double(), probe=probe(sizes=reads))
    assert len(reads) == 2 * first
