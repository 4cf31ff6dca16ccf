"""One-run privacy auditing (Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run",
NeurIPS 2023): an empirical LOWER bound on epsilon from a single training run.

    dpbench-audit algo=dpsgd audit.one_run=true audit.canaries=1000 privacy.epsilon=2

m canaries are each included with probability 1/2 (fresh OS entropy); the run trains once; each
canary is scored, the G/2 highest scores are guessed "in" and the G/2 lowest "out" (the guess
count fixed before the scores are compared with the inclusions), and v of the G guesses are right.
Under (epsilon, delta)-DP, v is stochastically dominated by a binomial (`one_run_p_value`), so a v
too large for that binomial at confidence 1 - c refutes epsilon: `epsilon_lower_bound` is the
largest epsilon refuted. Even a perfect guesser certifies at most `ceiling(m, r, delta)` (5.78 for
m = r = 1000 at delta 1e-5): a bound far below the claim says little, a bound above it is a bug.

The canaries here are white-box gradient canaries (`GradientCanaries`): canary i is a Dirac
direction of norm C (privacy.clip_norm) at one coordinate of the flattened trained parameters,
added to the clipped sum before the noise, joining each step's batch with the run's Poisson
sample rate; the real gradients are zeroed at those coordinates (a coordinate of the clipped sum
set to 0 cannot raise any example's contribution above C). Its score is the sum over steps of the
parameter's decrease at its coordinate, theta_0 - theta_T: the update along the canary's
direction, optimizer state (DP-Adam's moments, momentum) included.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from dpbench.errors import UserError
from dpbench.tools.audit_report import AuditReport, Check

# Algorithms whose privatised sum is the full parameter gradient, in the parameters' own shapes,
# consumed by DPFirstOrderAlgorithm's step (clip_and_accumulate -> privatize -> apply_update).
SUPPORTED = ("dpsgd", "dpadam")


# ----------------------------------------------------------------------------- the lower bound


def _logistic(epsilon: float) -> float:
    return 1.0 / (1.0 + math.exp(-epsilon))


def one_run_p_value(epsilon: float, delta: float, m: int, r: int, v: int) -> float:
    """P-value of v correct guesses out of r (m canaries) under (epsilon, delta)-DP.

    p = e^eps / (1 + e^eps), beta = P[Binomial(r, p) >= v]; delta = 0: beta; otherwise
    min(1, beta + 2 m delta alpha) with alpha = max_{i=1..v} (P[Binomial(r, p) >= v - i] - beta) / i
    (Steinke, Nasr, Jagielski 2023, Theorem 3.1 / Proposition 5.3)."""
    from scipy.stats import binom

    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= v <= r <= m, got v={v}, r={r}, m={m}")
    p = _logistic(epsilon)
    beta = float(binom.sf(v - 1, r, p))  # P[X >= v]
    if delta == 0 or v == 0:
        return beta
    i = np.arange(1, v + 1)
    alpha = float(np.max((binom.sf(v - i - 1, r, p) - beta) / i))
    return min(1.0, beta + 2 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float = 0.95,
                        tolerance: float = 1e-6) -> float:
    """The largest epsilon whose p-value is still <= 1 - confidence (bisection: the p-value grows
    with epsilon); 0 when even epsilon = 0 is not rejected."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")
    c = 1 - confidence
    if one_run_p_value(0.0, delta, m, r, v) > c:
        return 0.0
    low, high = 0.0, 1.0
    while one_run_p_value(high, delta, m, r, v) <= c:  # bracket: double until epsilon is no longer rejected
        low, high = high, 2 * high
        if high > 1e3:
            return math.inf  # not reached by any r <= m this code is used for
    while high - low > tolerance:
        mid = (low + high) / 2
        low, high = (mid, high) if one_run_p_value(mid, delta, m, r, v) <= c else (low, mid)
    return low


def ceiling(m: int, r: int, delta: float, confidence: float = 0.95) -> float:
    """The bound when all r guesses are right: the most an audit with m canaries and r guesses can certify."""
    return epsilon_lower_bound(m, r, r, delta, confidence)


# ----------------------------------------------------------------------------- the canaries


@dataclass
class Guesses:
    """The guesses made from the scores (fixed before they are compared with the inclusions)."""

    guessed_in: np.ndarray  # canary ids guessed "in": the G/2 highest scores
    guessed_out: np.ndarray  # canary ids guessed "out": the G/2 lowest scores

    @classmethod
    def from_scores(cls, scores: np.ndarray, guesses: int) -> "Guesses":
        order = np.argsort(scores, kind="stable")  # ties broken by canary id, which is independent of inclusion
        half = guesses // 2
        return cls(guessed_in=order[len(order) - half:], guessed_out=order[:half])

    def correct(self, included: np.ndarray) -> int:
        return int(included[self.guessed_in].sum() + (~included[self.guessed_out]).sum())


class GradientCanaries:
    """M white-box canaries on coordinates of an algorithm's privatised gradient sum.

    `install` wraps the algorithm's `clip_and_accumulate` (on the instance: the class and every
    other run are untouched): after the real clipped sum is formed, the canary coordinates are set
    to 0 and each included canary that joins this step's batch (probability q, independently per
    step, like a Poisson-sampled example) adds +C there, before `privatize` adds the noise."""

    def __init__(self, params: list[torch.nn.Parameter], count: int, norm: float, sample_rate: float, seed: int):
        sizes = [p.numel() for p in params]
        total = sum(sizes)
        if count > total:
            raise UserError(f"audit.canaries={count} exceeds the {total} trained parameters (one coordinate each); lower it")
        self.params, self.count, self.norm, self.sample_rate = params, count, float(norm), float(sample_rate)
        # public: the coordinates come from the config's seed; nothing about them is secret
        flat = torch.randperm(total, generator=torch.Generator().manual_seed(int(seed)))[:count]
        starts = torch.tensor([0] + list(np.cumsum(sizes)[:-1]), dtype=torch.long)
        owner = torch.searchsorted(starts, flat, right=True) - 1
        # per parameter: (its index, the canary ids on it, their multi-dimensional index into it)
        self.placements: list[tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]] = []
        for k, p in enumerate(params):
            ids = torch.nonzero(owner == k).flatten()
            if len(ids):
                offsets = flat[ids] - starts[k]
                self.placements.append((k, ids, torch.unravel_index(offsets, p.shape)))
        # secret: inclusion and per-step participation from fresh OS entropy, never the seed
        self._rng = np.random.default_rng(secrets.randbits(128))
        self.included = self._rng.random(count) < 0.5
        self.joins = np.zeros(count, dtype=np.int64)  # steps each canary joined (for the report only)
        self.steps = 0

    def install(self, algorithm) -> None:
        inner = algorithm.clip_and_accumulate

        def clip_and_accumulate(batches):
            sums, tally = inner(batches)
            self.insert(sums)
            return sums, tally

        algorithm.clip_and_accumulate = clip_and_accumulate

    def insert(self, sums: list[torch.Tensor]) -> None:
        """Zero the canary coordinates of the clipped sum and add each joining canary's +C."""
        from dpbench import distributed

        if [tuple(s.shape) for s in sums] != [tuple(p.shape) for p in self.params]:
            raise RuntimeError("the privatised sum is not in the parameters' shapes: this algorithm cannot carry gradient canaries")
        joining = self.included & (self._rng.random(self.count) < self.sample_rate)
        self.joins += joining
        self.steps += 1
        if not distributed.is_main_process():  # data parallel: the ranks' sums are added; rank 0 carries the canaries
            joining = np.zeros_like(joining)
        values = torch.as_tensor(joining, dtype=torch.float32) * self.norm
        for k, ids, index in self.placements:
            s = sums[k]
            s[tuple(i.to(s.device) for i in index)] = values[ids].to(s.device, s.dtype)

    def coordinates(self) -> torch.Tensor:
        """The canary coordinates' current parameter values (float64, by canary id)."""
        out = torch.empty(self.count, dtype=torch.float64)
        with torch.no_grad():
            for k, ids, index in self.placements:
                p = self.params[k]
                out[ids] = p[tuple(i.to(p.device) for i in index)].detach().double().cpu()
        return out


# ----------------------------------------------------------------------------- the audit


@dataclass
class OneRunResult:
    claimed_epsilon: float
    epsilon_lower_bound: float
    ceiling: float
    canaries: int
    guesses: int
    correct: int
    confidence: float
    delta: float
    included: int
    steps: int
    noise_multiplier: float
    sample_rate: float
    clip_norm: float


class OneRunReport(AuditReport):
    """An AuditReport with the one-run figures beside its checks (audit.json `one_run`)."""

    def __init__(self, algo: str, model: str, dataset: str, checks: list[Check], result: OneRunResult):
        super().__init__(algo, model, dataset, checks)
        self.result = result

    def to_json(self) -> dict:
        from dataclasses import asdict

        return {**super().to_json(), "one_run": asdict(self.result)}


def one_run_options(cfg) -> tuple[int, int, float]:
    canaries, guesses, confidence = int(cfg.audit.canaries), int(cfg.audit.guesses), float(cfg.audit.confidence)
    if canaries < 2:
        raise UserError(f"audit.canaries={canaries} must be at least 2")
    if guesses < 2 or guesses > canaries or guesses % 2:
        raise UserError(f"audit.guesses={guesses} must be even and lie in 2..audit.canaries={canaries} "
                        "(half guessed in, half out)")
    if not 0 < confidence < 1:
        raise UserError(f"audit.confidence={confidence} must lie strictly between 0 and 1, e.g. 0.95")
    return canaries, guesses, confidence


def one_run_audit(cfg) -> OneRunReport:
    """Train the configured run once with white-box gradient canaries and bound its epsilon from below."""
    from omegaconf import OmegaConf

    from dpbench.logging.wandb_logger import build_logger
    from dpbench.run import fit, setup

    canaries, guesses, confidence = one_run_options(cfg)
    if cfg.algo.name not in SUPPORTED:
        raise UserError(f"audit.one_run=true supports algo={' | '.join(SUPPORTED)} (their noisy sum is the full "
                        f"parameter gradient); algo={cfg.algo.name} is not supported yet")
    if cfg.privacy.sampling != "poisson":
        raise UserError("audit.one_run=true needs privacy.sampling=poisson (the canaries join each step's batch "
                        "with the run's sample rate)")
    if cfg.get("threads"):  # as `dpbench` runs the job (run_job)
        torch.set_num_threads(int(cfg.threads))
    job = setup(cfg)
    setup_ = job.privacy.setup
    marks = GradientCanaries(job.algorithm.params, canaries, setup_.clip_norm, setup_.sample_rate, int(cfg.seed))
    marks.install(job.algorithm)
    before = marks.coordinates()
    trainer, _, failure = fit(job, build_logger(OmegaConf.create({"name": "none"}), None, "", {}), show_progress=False)
    if failure is not None:
        raise failure
    scores = (before - marks.coordinates()).numpy()  # sum over steps of theta_{t-1} - theta_t: inclusion raises it
    guessed = Guesses.from_scores(scores, guesses)  # fixed before the inclusions are looked at
    correct = guessed.correct(marks.included)
    delta = float(job.privacy.delta)
    claimed = float(job.privacy.epsilon(trainer.state.ledger))
    bound = epsilon_lower_bound(canaries, guesses, correct, delta, confidence)
    top = ceiling(canaries, guesses, delta, confidence)
    result = OneRunResult(claimed, bound, top, canaries, guesses, correct, confidence, delta,
                          int(marks.included.sum()), trainer.state.step, float(setup_.noise_multiplier),
                          float(setup_.sample_rate), float(setup_.clip_norm))
    check = Check(
        "one_run", f"{canaries} gradient canaries", bound, claimed, bound <= claimed,
        f"eps lower bound {bound:.3f} (ceiling {top:.3f} for m={canaries}, r={guesses}) vs the reported eps "
        f"{claimed:.3f}: {correct}/{guesses} guesses right ({marks.included.sum()} canaries included, "
        f"{trainer.state.step} steps, q {setup_.sample_rate:.4g}, sigma {setup_.noise_multiplier:.4g}, "
        f"confidence {confidence:g}, delta {delta:g})",
    )
    return OneRunReport(cfg.algo.name, cfg.model.name, cfg.dataset.name, [check], result)
