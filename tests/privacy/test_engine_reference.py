"""The per-example engines compute what they computed before bookkeeping.py was split into
pieces.py, layers.py and the engine: per-example norms, clipped sums and metered bytes of every
engine (materialize, ghost, bk; noise off; two calls) on tiny seeded models covering every layer
kind (Linear over tokens, reused and sharing an input, a gradient map, Embedding, a tied output
layer, LayerNorm, a vocabulary-wide head, Conv2d/GroupNorm, a ViT, OPT; fp32, fp64, bf16 autocast,
a non-finite example), compared with tests/fixtures/engine_reference.pt to 1e-6 relative.

The fixture was made at the commit before the split by tests/helpers/make_engine_reference.py;
a failure here is a change of behaviour, not a stale fixture (see that script's docstring).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.make_engine_reference import CALLS, CASES, ENGINES, FULL, PROJECTIONS, run, segments

FIXTURE = Path(__file__).parents[1] / "fixtures" / "engine_reference.pt"
RTOL = 1e-6


@pytest.fixture(scope="module")
def reference():
    payload = torch.load(FIXTURE, weights_only=False)
    made = payload["made_with"]
    assert (made["full"], made["projections"], made["calls"]) == (FULL, PROJECTIONS, CALLS)
    return payload


def test_the_fixture_covers_every_case():
    payload = torch.load(FIXTURE, weights_only=False)
    assert set(payload["results"]) == set(CASES) and set(payload["seeds"]) == set(CASES)
    assert all(set(by_engine) == set(ENGINES) for by_engine in payload["results"].values())


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("case", list(CASES))
def test_engine_output_equals_the_reference(reference, case, engine, monkeypatch):
    if engine == "materialize":
        # The fixture predates materialize's padding-row correction (Opacus's sampler gave an
        # Embedding's padding row a gradient; the rows_* cases hold one): compared without it here,
        # and proven against autograd one example at a time in test_grad_sample_layers.py.
        from dpbench.privacy import layers, per_sample

        monkeypatch.setattr(per_sample, "opacus_corrections",
                            lambda model, embeddings: layers.opacus_corrections(model, embeddings=False))
    expected = reference["results"][case][engine]
    actual = run(case, engine, seed=reference["seeds"][case])
    where = f"{case}/{engine} (reference made at {reference['made_with']['commit'][:10]})"
    assert_same(actual, expected, where)


@pytest.mark.parametrize("engine", ["ghost", "bk"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_example_at_a_time_gives_the_reference(reference, case, engine, monkeypatch):
    """Per-example work over chunks of examples (pieces.WORK_BYTES, which keeps ghost clipping's
    temporaries from growing with the batch), here the smallest chunk, one example: the same norms,
    sums and metered bytes."""
    from dpbench.privacy import pieces

    chunks = []
    monkeypatch.setattr(pieces, "WORK_BYTES", 1)
    original = pieces._example_chunks
    monkeypatch.setattr(pieces, "_example_chunks", lambda *args: chunks.append(len(original(*args))) or original(*args))
    actual = run(case, engine, seed=reference["seeds"][case])
    assert chunks and max(chunks) > 1, "no piece went through more than one chunk"
    assert_same(actual, reference["results"][case][engine], f"{case}/{engine}, one example a chunk")


def assert_same(actual: dict, expected: dict, where: str) -> None:
    """The engine's norms, sums and metered bytes equal the fixture's (to RTOL)."""
    # norms: [calls, B]; a non-finite example's norm stays non-finite
    norms, reference_norms = actual["norms"], expected["norms"]
    assert norms.shape == reference_norms.shape, where
    assert torch.equal(torch.isfinite(norms), torch.isfinite(reference_norms)), where
    finite = torch.isfinite(reference_norms)
    scale = reference_norms[finite].abs().max()
    assert torch.allclose(norms[finite], reference_norms[finite], rtol=RTOL, atol=RTOL * 1e-3 * scale), \
        f"{where}: norms {norms} vs {reference_norms}"

    assert len(actual["sums"]) == len(expected["sums"]) == CALLS
    for call, (got, want) in enumerate(zip(actual["sums"], expected["sums"])):
        assert got["sizes"] == want["sizes"], f"{where}, call {call}: parameter shapes"
        # Entries to 1e-6 of themselves or of the call's largest quantity (a whole tensor's largest
        # entry, a digest's norm). Not of the tensor's own largest: a tensor that is zero in exact
        # arithmetic holds rounding noise (~1e-11) whose digits follow the CPU's SIMD kernels.
        scale = max(float(want["values"][start:end].abs().max() if whole else want["values"][start])
                    for start, end, whole in segments(want["sizes"]))
        for index, (start, end, whole) in enumerate(segments(want["sizes"])):
            g, w = got["values"][start:end], want["values"][start:end]
            assert torch.allclose(g, w, rtol=RTOL, atol=RTOL * scale + 1e-30), \
                f"{where}, call {call}, tensor {index}: {g} vs {w}"

    assert actual["peak_bytes"] == expected["peak_bytes"], where
