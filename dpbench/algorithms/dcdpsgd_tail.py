"""DC-DPSGD's tail selection (dcdpsgd.py): which examples of a step are the "tail" that gets the
larger clip c1, from their noisy scores (the top round(p B)) or from a threshold read off the
released, averaged score histogram (algo.tail_selection=threshold)."""

from __future__ import annotations

import math

import torch

# Threshold selection: the released score histogram's bins. A score of a d-dim gradient in a
# random k-dim subspace is about k/d, so the bins are log-spaced (1e-6 .. 1, 24 bins, x1.78 each)
# plus one bin for [0, 1e-6). Few bins: each carries N(0, sigma_tr^2), and the tail mass sums them.
SCORE_BIN_EDGES = torch.cat([torch.zeros(1), torch.logspace(-6, 0, 25, dtype=torch.float64).float()])
HISTOGRAM_DECAY = 0.95  # EMA of the released histograms (a ~20-step window): averages their noise down


def tail_count(batch_size: int, tail_fraction: float) -> int:
    return int(math.floor(tail_fraction * batch_size + 0.5))


def tail_mask(noisy_scores: torch.Tensor, tail_fraction: float) -> torch.Tensor:
    """Boolean [B]: the top round(p*B) noisy scores are the tail."""
    mask = torch.zeros_like(noisy_scores, dtype=torch.bool)
    count = tail_count(noisy_scores.shape[0], tail_fraction)
    if count > 0:
        mask[torch.topk(noisy_scores, count).indices] = True
    return mask


def score_histogram(scores: torch.Tensor) -> torch.Tensor:
    """[len(SCORE_BIN_EDGES) - 1] counts of scores in [0, 1] per bin (1 is in the last bin)."""
    edges = SCORE_BIN_EDGES.to(scores.device)
    index = (torch.bucketize(scores.float().clamp(0, 1), edges, right=True) - 1).clamp(0, len(edges) - 2)
    return torch.bincount(index, minlength=len(edges) - 1).to(scores.dtype if scores.is_floating_point() else torch.float32)


def histogram_threshold(histogram: torch.Tensor, tail_fraction: float) -> float:
    """The score above which a fraction `tail_fraction` of the (noisy, averaged) histogram's mass
    lies, log-interpolated inside its bin; +inf when the histogram holds no mass."""
    counts = histogram.double().clamp_min(0).tolist()  # one host sync; the rest is plain Python
    total = sum(counts)
    if total <= 0:
        return math.inf
    needed, edges = tail_fraction * total, SCORE_BIN_EDGES.double().tolist()
    for b in range(len(counts) - 1, -1, -1):
        if counts[b] >= needed and counts[b] > 0:
            low, high, share = edges[b], edges[b + 1], needed / counts[b]
            if low <= 0:
                return high * (1 - share)
            return math.exp(math.log(high) - share * (math.log(high) - math.log(low)))
        needed -= counts[b]
    return 0.0
