"""Each layer kind and option, in every per-example engine (algo.per_sample = materialize | ghost |
bk), against autograd on one example at a time, in float64, in the manner of Opacus's grad-sample
tests: the norms the engine hands the clip rule equal autograd's (1e-6 relative), or the engine
refuses in one line (dpbench's UserError) before it hooks the model. Each case declares which: a
refusal that should be a right answer fails, and so does a right answer where a refusal is due.

The engines are built as a run builds them (`EngineSpec.attach` with the layout probe,
dpbench/privacy/layout.py), so a layer fed [T, B, d] (sequence-first) is refused, not mis-clipped:
the probe replaces one record and finds the rows of every example moved. Also: the probe accepts
the row layouts the engines do handle (OPT's [B·T, d] flattening, K candidate rows per example),
and a training run refuses a sequence-first model before its first step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from opacus.layers import DPGRU, DPLSTM, DPMultiheadAttention
from torch import nn
from helpers.toy_modules import SequenceFirst

from dpbench.errors import UserError
from dpbench.privacy.engines import build_engine
from dpbench.privacy.layers import RULES
from dpbench.privacy.layout import LayoutProbe

ENGINES = ("materialize", "ghost", "bk")
POOL, BATCH = 6, 3  # records the probe and the batch draw from; examples in the checked batch
RIGHT, REFUSED = "right", "refused"


class Layer(nn.Module):
    """The layer under test, called as `call(layer, x)` (attention: x as query, key and value)."""

    def __init__(self, layer: nn.Module, call: Callable | None):
        super().__init__()
        self.layer, self.call = layer, call

    def forward(self, x):
        return self.call(self.layer, x) if self.call else self.layer(x)


def attention(layer, x):
    return layer(x, x, x)[0]


def recurrent(layer, x):
    return layer(x)[0]


def bag(layer, x):  # 1-D ids with offsets: one bag per example
    return layer(x.flatten(), torch.arange(0, x.numel(), x.shape[1]))


def timm_layer_norm():
    from timm.layers.norm import LayerNorm

    return LayerNorm(4)


@dataclass(frozen=True)
class Case:
    """One layer configuration: its input per example (`shape`; token ids below `ids`), the
    dimension its batch lies along (1: sequence-first), and the outcome due in each engine."""

    layer: Callable[[], nn.Module]
    shape: tuple
    expected: dict | str  # engine -> RIGHT | REFUSED, or one outcome for all
    batch_dim: int = 0
    ids: int | None = None
    call: Callable | None = None

    def outcome(self, engine: str) -> str:
        return self.expected if isinstance(self.expected, str) else self.expected[engine]

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return Layer(self.layer(), self.call).double().train()

    def batch(self, indices) -> torch.Tensor:
        g = torch.Generator().manual_seed(3)
        pool = torch.randint(0, self.ids, (POOL, *self.shape), generator=g) if self.ids else \
            torch.randn(POOL, *self.shape, generator=g, dtype=torch.float64)
        return pool[list(indices)].movedim(0, self.batch_dim).contiguous()

    def losses(self, model, x) -> torch.Tensor:
        """Each example's output against a fixed random direction: [B]."""
        out = model(x).movedim(self.batch_dim, 0)
        direction = torch.randn(out.shape[1:], generator=torch.Generator().manual_seed(5), dtype=out.dtype)
        return (out * direction).flatten(1).sum(1)


MATERIALIZE_ONLY = {"materialize": RIGHT, "ghost": REFUSED, "bk": REFUSED}
CASES = {
    "linear[B,d]": Case(lambda: nn.Linear(4, 3), (4,), RIGHT),
    "linear[B,T,d]": Case(lambda: nn.Linear(4, 3), (5, 4), RIGHT),
    "linear_no_bias[B,T,d]": Case(lambda: nn.Linear(4, 3, bias=False), (5, 4), RIGHT),
    "linear[T,B,d]_T=2B": Case(lambda: nn.Linear(4, 3), (6, 4), REFUSED, batch_dim=1),
    "linear[T,B,d]_T=B": Case(lambda: nn.Linear(4, 3), (3, 4), REFUSED, batch_dim=1),
    "linear[T,B,d]_T=5": Case(lambda: nn.Linear(4, 3), (5, 4), REFUSED, batch_dim=1),
    "conv1d": Case(lambda: nn.Conv1d(2, 3, 3, padding=1), (2, 7), RIGHT),
    "conv1d_stride_no_bias": Case(lambda: nn.Conv1d(2, 3, 3, stride=2, bias=False), (2, 7), RIGHT),
    "conv2d": Case(lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1), (2, 6, 6), RIGHT),
    "conv2d_groups_dilation": Case(lambda: nn.Conv2d(2, 4, 3, dilation=2, groups=2, padding=2), (2, 6, 6), RIGHT),
    "conv1d_reflect": Case(lambda: nn.Conv1d(2, 3, 3, padding=1, padding_mode="reflect"), (2, 7), RIGHT),
    **{f"conv2d_{mode}": Case(lambda mode=mode: nn.Conv2d(2, 3, 3, padding=1, padding_mode=mode), (2, 5, 5), RIGHT)
       for mode in ("reflect", "replicate", "circular")},
    "embedding": Case(lambda: nn.Embedding(7, 3), (5,), RIGHT, ids=7),
    "embedding_padding_idx": Case(lambda: nn.Embedding(7, 3, padding_idx=0), (5,), RIGHT, ids=3),
    "embedding_scale_grad_by_freq": Case(lambda: nn.Embedding(7, 3, scale_grad_by_freq=True), (5,), REFUSED, ids=4),
    "layer_norm[B,T,d]": Case(lambda: nn.LayerNorm(4), (5, 4), RIGHT),
    "layer_norm_2d_shape": Case(lambda: nn.LayerNorm((3, 4)), (2, 3, 4), RIGHT),
    "timm_layer_norm": Case(timm_layer_norm, (5, 4), RIGHT),
    "group_norm": Case(lambda: nn.GroupNorm(2, 4), (4, 5), RIGHT),
    "dp_attention_batch_first": Case(lambda: DPMultiheadAttention(4, 2, batch_first=True), (5, 4), RIGHT, call=attention),
    "dp_attention_sequence_first": Case(lambda: DPMultiheadAttention(4, 2, batch_first=False), (5, 4), REFUSED,
                                        batch_dim=1, call=attention),
    "dp_attention_sequence_first_T=B": Case(lambda: DPMultiheadAttention(4, 2, batch_first=False), (3, 4), REFUSED,
                                            batch_dim=1, call=attention),
    "torch_attention": Case(lambda: nn.MultiheadAttention(4, 2, batch_first=True), (5, 4), REFUSED, call=attention),
    "lstm": Case(lambda: nn.LSTM(4, 3, batch_first=True), (5, 4), REFUSED, call=recurrent),
    "gru": Case(lambda: nn.GRU(4, 3, batch_first=True), (5, 4), REFUSED, call=recurrent),
    "rnn": Case(lambda: nn.RNN(4, 3, batch_first=True), (5, 4), REFUSED, call=recurrent),
    "dp_lstm": Case(lambda: DPLSTM(4, 3, batch_first=True), (5, 4), MATERIALIZE_ONLY, call=recurrent),
    "dp_gru": Case(lambda: DPGRU(4, 3, batch_first=True), (5, 4), MATERIALIZE_ONLY, call=recurrent),
    "embedding_bag_2d": Case(lambda: nn.EmbeddingBag(7, 3), (5,), REFUSED, ids=7),
    "embedding_bag_offsets": Case(lambda: nn.EmbeddingBag(7, 3), (5,), REFUSED, ids=7, call=bag),
}
# A representative subset in the fast tier; the rest of the matrix in the slow one.
FAST = {"linear[B,T,d]", "linear[T,B,d]_T=2B", "linear[T,B,d]_T=B", "linear[T,B,d]_T=5", "conv2d_reflect",
        "embedding_padding_idx", "embedding_scale_grad_by_freq", "layer_norm[B,T,d]", "dp_attention_batch_first",
        "dp_attention_sequence_first", "torch_attention", "lstm", "embedding_bag_2d"}


def autograd_norms(case: Case) -> torch.Tensor:
    """Each example's gradient norm from a backward of that example alone."""
    model = case.model()
    params = [p for p in model.parameters() if p.requires_grad]
    norms = []
    for i in range(BATCH):
        grads = torch.autograd.grad(case.losses(model, case.batch([i])).sum(), params, allow_unused=True)
        norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads if g is not None)))
    return torch.stack(norms)


def engine_norms(case: Case, engine: str) -> list[torch.Tensor]:
    """The norms handed to the clip rule, in two calls (ghost and bk check coverage in the first)."""
    model = case.model()
    built = build_engine(engine, model, probe=LayoutProbe(case.losses, case.batch, POOL))
    seen = []
    try:
        for _ in range(2):
            built.clipped_sum(case.losses(model, case.batch(range(BATCH))),
                              lambda norms: seen.append(norms.double()) or torch.ones_like(norms))
    finally:
        built.detach()
    return seen


def tier(name: str):
    return name if name in FAST else pytest.param(name, marks=pytest.mark.slow)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", [tier(name) for name in CASES])
def test_engine_norms_equal_autograd_one_example_at_a_time_or_refuse(name, engine):
    case = CASES[name]
    if case.outcome(engine) == REFUSED:
        with pytest.raises(UserError) as refused:
            engine_norms(case, engine)
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"algo.per_sample={engine}: layer ")
        return
    expected = autograd_norms(case)
    assert expected.min() > 0
    for actual in engine_norms(case, engine):
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)


def test_every_catalogue_rule_has_a_case():
    """The catalogue's layer kinds (layers.py RULES) each appear above."""
    kinds = {type(CASES[name].layer()) for name in CASES}
    for key in RULES:
        if isinstance(key, str):
            assert any(f"{k.__module__}.{k.__qualname__}" == key for k in kinds), key
        else:
            assert key in kinds, key


def test_sequence_first_refusal_names_the_dimension():
    with pytest.raises(UserError, match=r"layer layer \(Linear\): its input \(6, 3, 4\) .*dimension 1"):
        engine_norms(CASES["linear[T,B,d]_T=2B"], "bk")


@pytest.mark.parametrize("engine", ENGINES)
def test_without_the_probe_rows_that_do_not_split_are_refused_not_reshaped(engine):
    """[T, B, d] with T not a multiple of B: each engine's own guard, for an engine built without
    the probe (a sharded model is not probed)."""
    case = CASES["linear[T,B,d]_T=5"]
    model = case.model()
    built = build_engine(engine, model, unprobed=True)
    try:
        with pytest.raises(UserError, match="5 rows along dimension 0 for 3 examples"):
            built.clipped_sum(case.losses(model, case.batch(range(BATCH))), torch.ones_like)
    finally:
        built.detach()


# --- the probe on the row layouts the engines do handle ---------------------------------------------
class RowsModel(nn.Module):
    """K rows per example (candidate scoring, example-major) flattened with their tokens to
    [B·K·T, d] before a Linear (OPT's fc1/fc2), then a LayerNorm over the rows."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.fc, self.norm = nn.Embedding(9, 4), nn.Linear(4, 4), nn.LayerNorm(4)

    def forward(self, ids):  # [B, K, T] -> [B·K, T, d] -> [B·K·T, d] -> [B, K]
        rows = self.embed(ids.flatten(0, 1))
        flat = self.norm(self.fc(rows.flatten(0, 1)))
        return flat.view(*ids.shape, -1).sum((-1, -2))


@pytest.mark.parametrize("engine", ENGINES)
def test_the_probe_accepts_flattened_and_candidate_rows(engine):
    pool = torch.randint(0, 9, (POOL, 2, 3), generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1, 1, 0, 1, 0])
    probe = LayoutProbe(lambda m, b: F.cross_entropy(m(b[0]).double(), b[1], reduction="none"),
                        lambda i: (pool[list(i)], labels[list(i)]), POOL)
    build_engine(engine, RowsModel().double(), probe=probe).detach()


@pytest.mark.parametrize("engine", ENGINES)
def test_the_probe_refuses_batchnorm_in_train_mode(engine):
    """BatchNorm normalises each example with the batch's statistics (and writes them to its buffers):
    every example's rows move with another's, so the probe refuses the model, as Opacus's
    ModuleValidator does (audit.seeded_bug=batchnorm_* lift the probe to show the audit's checks)."""
    pool = torch.randn(POOL, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(16, 2)).double()
    model.train()
    probe = LayoutProbe(lambda m, b: m(b).pow(2).sum(1), lambda i: pool[list(i)].double(), POOL)
    with pytest.raises(UserError, match="mixes examples") as refused:
        build_engine(engine, model, probe=probe)
    assert "\n" not in str(refused.value)


def test_a_private_algorithm_refuses_a_sequence_first_model_before_training():
    """DPFirstOrderAlgorithm builds its engine through the probe: the run stops at setup."""
    from helpers.projected import build

    class Task:
        train_size = POOL
        pool = torch.randn(POOL, 6, 4, generator=torch.Generator().manual_seed(0))

        def batch(self, indices):
            return self.pool[list(indices)]

        def batch_size(self, batch):
            return batch.shape[0]

        def per_sample_loss(self, model, batch):
            return model(batch).pow(2).sum(1)

    with pytest.raises(UserError, match="layer fc"):
        build("dpsgd", SequenceFirst(), Task(), clip=1.0, per_sample="bk")
