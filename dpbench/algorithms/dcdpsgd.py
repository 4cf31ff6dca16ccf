"""DC-DPSGD (Sha et al. 2024, "Clip Body and Tail Separately"): discriminative clipping.

Each step scores every per-example gradient against a fresh public random subspace, clips the
"tail" examples to c1 and the rest ("body") to c2 < c1, and adds one Gaussian to the clipped sum.
Why: a step's score and gradient releases read one Poisson batch, so they are charged as one
mechanism at the sensitivity the tail rule really has. The argument (joint charge, rank coupling,
threshold selection, budget split, physical batches, blocked subspaces) is in docs/privacy.md,
section "DC-DPSGD".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from dpbench.algorithms.learning_rates import lr_groups
from dpbench.algorithms.base import ALGORITHMS, LossTally, ReleasePart
from dpbench.algorithms.first_order import DPFirstOrderAlgorithm
from dpbench.algorithms.dcdpsgd_subspaces import SubWeibullSubspaces, subspace_scores
from dpbench.algorithms.dcdpsgd_tail import HISTOGRAM_DECAY, histogram_threshold, score_histogram, tail_mask
from dpbench.errors import UserError
from dpbench.privacy.mechanisms import GaussianMechanism, one_batch_mechanism
from dpbench.privacy.clipping import clipped_sum, per_sample_norms
from dpbench.privacy.engines import PER_EXAMPLE_GRADIENTS
from dpbench.options import AlgoOptions, Choice, LrFamily


class GradientSensitivity(Choice):
    rank_coupled = "rank_coupled"
    tail_clip = "tail_clip"


class TailSelection(Choice):  # top-p of the batch's noisy scores, or a public threshold
    rank = "rank"
    threshold = "threshold"


class BudgetSplit(Choice):  # how the budget is shared by the score and gradient releases
    renyi = "renyi"
    epsilon = "epsilon"


@dataclass
class DCDPSGDOptions(AlgoOptions):
    name: str = "dcdpsgd"
    default_lr: float = 1.0  # conf/algo/dcdpsgd.yaml says where it comes from
    lr_family: LrFamily = LrFamily.sgd
    subspace_dim: Optional[int] = 200
    theta: float = 2.0
    tail_fraction: float = 0.1
    tail_clip_ratio: float = 2.0  # the paper's 10 stays at chance on the default job (conf/algo/dcdpsgd.yaml)
    tail_clip: Optional[float] = None
    score_budget_fraction: float = 0.5
    budget_split: BudgetSplit = BudgetSplit.renyi
    score_epsilon_fraction: float = 0.5
    score_noise_multiplier: Optional[float] = None
    score_params: Any = "all"  # all | first | a list of name substrings
    gradient_sensitivity: GradientSensitivity = GradientSensitivity.rank_coupled
    tail_selection: TailSelection = TailSelection.threshold
    momentum: float = 0.0

def split_noise_multipliers(sigma: float, score_fraction: float) -> tuple[float, float]:
    """Base sigma -> (sigma_tr, sigma_dp) with sigma_tr^-2 + sigma_dp^-2 = sigma^-2."""
    return sigma / math.sqrt(score_fraction), sigma / math.sqrt(1.0 - score_fraction)


def budget_split(cfg) -> str:
    """`algo.budget_split` (renyi | epsilon: the schema checks the choice), with its fraction checked."""
    split = cfg.budget_split
    key = "score_budget_fraction" if split == "renyi" else "score_epsilon_fraction"
    if not 0 < cfg[key] < 1:
        raise UserError(f"algo.{key}={cfg[key]} must lie strictly between 0 and 1")
    return split


@dataclass(frozen=True)
class EpsilonSplit:
    """A calibrated `algo.budget_split=epsilon` (`DCDPSGD.calibrate_noise`, PrivacySetup.derived):
    sigma_tr / sigma_dp in the paper's ratio (each part alone calibrated to its share of epsilon
    at delta/2), scaled together until the joint mechanism meets the target;
    privacy.noise_multiplier is sigma_dp. epsilon_tr + epsilon_dp is the paper's accounting at
    these sigmas, not a bound (the parts read one batch)."""

    sigma_tr: float  # the scores' noise multiplier
    sigma_dp: float  # the gradient release's
    epsilon_tr: float  # the score part alone, at delta_each (paper accounting)
    epsilon_dp: float  # the gradient part alone, at delta_each (paper accounting)
    delta_each: float

    def fixed_noise_options(self) -> dict:
        """The algo options that give these noises with privacy.noise_multiplier = sigma_dp fixed."""
        return {"score_noise_multiplier": self.sigma_tr}


def noise_multipliers(cfg, noise_multiplier: float, split: EpsilonSplit | None = None) -> tuple[float, float]:
    """(sigma_tr, sigma_dp) of a run whose privacy.noise_multiplier is `noise_multiplier`: the
    base sigma split by Renyi share, or (epsilon split) sigma_dp itself with sigma_tr from the
    calibrated `split` or, with noise given, from algo.score_noise_multiplier."""
    if budget_split(cfg) == "renyi":
        if cfg.score_noise_multiplier is not None:
            raise UserError("algo.score_noise_multiplier is for algo.budget_split=epsilon; with renyi, "
                            "algo.score_budget_fraction sets sigma_tr")
        return split_noise_multipliers(noise_multiplier, cfg.score_budget_fraction)
    if math.isinf(noise_multiplier):  # nothing is released (zero-step run)
        return math.inf, math.inf
    if split is not None:
        return split.sigma_tr, noise_multiplier
    if cfg.score_noise_multiplier is None:
        raise UserError("algo.budget_split=epsilon with a given privacy.noise_multiplier (sigma_dp) needs "
                        "algo.score_noise_multiplier (sigma_tr) too; or set privacy.epsilon to calibrate both")
    return cfg.score_noise_multiplier, noise_multiplier


def joint_mechanism(cfg, sigma_tr: float, sigma_dp: float, sample_rate: float, clip_norm: float) -> list[GaussianMechanism]:
    """A step's one mechanism: its score and gradient releases whitened together (one batch)."""
    return one_batch_mechanism([score_mechanism(sigma_tr, sample_rate),
                                gradient_mechanism(cfg, sigma_dp, sample_rate, clip_norm)])


def score_mechanism(sigma_tr: float, sample_rate: float) -> GaussianMechanism:
    """The noisy scores: sensitivity 1, noise std sigma_tr."""
    return GaussianMechanism(sigma_tr, sample_rate)


def gradient_mechanism(cfg, sigma_dp: float, sample_rate: float, clip_norm: float) -> GaussianMechanism:
    """The clipped sum with noise std sigma_dp * c1, at the sensitivity `gradient_sensitivity_in_c2` states."""
    ratio = tail_to_body_ratio(cfg, clip_norm)  # c1/c2
    return GaussianMechanism(sigma_dp * ratio / gradient_sensitivity_in_c2(cfg, ratio), sample_rate)


def tail_to_body_ratio(cfg, body_clip: float) -> float:
    """c1 / c2 from the config: the absolute `algo.tail_clip` (c1) over c2 = privacy.clip_norm,
    or `algo.tail_clip_ratio`. c1 must exceed c2 (the tail gets the larger threshold)."""
    if cfg.tail_clip is not None:
        ratio, given = cfg.tail_clip / body_clip, f"algo.tail_clip={cfg.tail_clip} with privacy.clip_norm={body_clip}"
    else:
        ratio, given = cfg.tail_clip_ratio, f"algo.tail_clip_ratio={cfg.tail_clip_ratio}"
    if not ratio > 1:
        raise UserError(f"{given} gives c1 <= c2; the tail threshold c1 must exceed the body threshold c2 = privacy.clip_norm")
    return ratio


def tail_selection(cfg) -> str:
    return str(cfg.tail_selection)


def gradient_sensitivity_in_c2(cfg, ratio: float) -> float:
    """L2 sensitivity of the clipped gradient sum in units of c2, for c1 = ratio * c2."""
    if tail_selection(cfg) == "threshold":
        return ratio  # c1: membership depends on each example and a public threshold only (proven)
    if cfg.gradient_sensitivity == "rank_coupled":
        return 2 * ratio - 1.0  # 2 c1 - c2: the added example (c1) and one other crossing the boundary
    return ratio  # tail_clip (the schema admits no third value): c1, the paper's model, not a proven bound


@ALGORITHMS.register("dcdpsgd", options=DCDPSGDOptions)
class DCDPSGD(DPFirstOrderAlgorithm):
    data_parallel = False  # the score release is a per-example vector, not a sum over ranks
    release_carries_state = True  # threshold mode: tau_{t+1} from the released score histograms
    engine_capabilities = frozenset({PER_EXAMPLE_GRADIENTS})  # it scores per-example gradients
    # public projection RNG; threshold selection: the average of the released score histograms
    checkpoint_attributes = ("projection_generator", "tail_fraction_seen", "score_histogram_average")
    private_statistic_attributes = ("tail_fraction_seen",)  # un-noised: reporting only

    def __init__(self, model, task, cfg, lr, privacy):
        if not 0 < cfg.tail_fraction < 1:
            raise UserError(f"algo.tail_fraction={cfg.tail_fraction} must lie strictly between 0 and 1")
        if privacy.clipping != "flat":
            raise UserError("dcdpsgd clips body and tail with flat (Abadi) clipping: set privacy.clipping=flat")
        super().__init__(model, task, cfg, lr, privacy)
        # a calibrated epsilon split (EpsilonSplit) or None: then sigma_tr comes from the config
        self.epsilon_split: EpsilonSplit | None = privacy.derived
        self.sigma_tr, self.sigma_dp = noise_multipliers(cfg, privacy.noise_multiplier, self.epsilon_split)
        self.body_clip = float(privacy.clip_norm)  # c2
        self.tail_clip = tail_to_body_ratio(cfg, self.body_clip) * self.body_clip  # c1
        self.identification = self._identification_indices(cfg.score_params)
        dim = sum(self.params[i].numel() for i in self.identification)
        k = cfg.subspace_dim  # None: the paper's "k = None" (no subspace identification)
        # Public projection randomness on the model's device (the subspace is drawn there):
        # reproducible from the experiment seed (drawn from the seeded global RNG once); the privacy
        # noise never comes from it.
        device = self.params[0].device
        self.projection_generator = torch.Generator(device=device)
        self.projection_generator.manual_seed(int(torch.randint(0, 2**62, (1,)).item()))
        self.subspaces = None if k is None else SubWeibullSubspaces(dim, k, cfg.theta, self.projection_generator, device)
        self.tail_fraction_seen: list[float] = []
        self.last_tail: torch.Tensor | None = None
        self.threshold_selection = tail_selection(cfg) == "threshold"
        self.score_histogram_average: torch.Tensor | None = None  # EMA of released histograms (public)
        self.pending_histogram: torch.Tensor | None = None  # this step's, released with its gradient

    def _identification_indices(self, spec) -> list[int]:
        """Which trainable tensors feed the score: all | first | a list of name substrings."""
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        if spec in (None, "all"):
            return list(range(len(names)))
        if spec == "first":
            return [0]
        wanted = [spec] if isinstance(spec, str) else list(spec)
        chosen = [i for i, n in enumerate(names) if any(w in n for w in wanted)]
        if not chosen:
            raise UserError(f"algo.score_params={spec} matches no parameter; names are e.g. {names[:4]}")
        return chosen

    unnoised_results = ("mean_tail_fraction",)

    @classmethod
    def forward_equivalents_per_example(cls, cfg, chunks: int) -> float:
        """Threshold mode scores and clips each chunk in one pass; rank mode with several physical
        chunks recomputes each chunk's forward and backward in pass 2 (`clip_and_accumulate`), so
        its step costs twice as much."""
        twice = tail_selection(cfg) == "rank" and chunks > 1
        return super().forward_equivalents_per_example(cfg, chunks) * (2 if twice else 1)

    @classmethod
    def privacy_notes(cls, cfg) -> list[str]:
        notes = []
        if budget_split(cfg) == "epsilon":
            notes.append(
                "algo.budget_split=epsilon: privacy.noise_multiplier is sigma_dp (algorithm.sigma_tr is the "
                "score noise), in the paper's ratio and scaled together until the joint mechanism of a step "
                "(both parts read one batch) meets the target; privacy.epsilon is that joint mechanism's; "
                "algorithm.epsilon_tr + epsilon_dp is the paper's accounting, not a bound"
            )
        if cfg.gradient_sensitivity == "tail_clip" and tail_selection(cfg) == "rank":
            notes.append(
                "algo.gradient_sensitivity=tail_clip accounts the gradient release at sensitivity c1, which is "
                "not a proven bound (a tail swap moved the clipped sum by 1.44 c1 in the audit); the reported "
                "epsilon is the paper's model, not a guarantee: use rank_coupled (the default)"
            )
        return notes

    @classmethod
    def planned_mechanisms(cls, cfg, noise_multiplier, sample_rate, step, clip_norm, derived: EpsilonSplit | None = None):
        """ONE mechanism: the score and gradient releases read the same sampled batch."""
        sigma_tr, sigma_dp = noise_multipliers(cfg, noise_multiplier, derived)
        return joint_mechanism(cfg, sigma_tr, sigma_dp, sample_rate, clip_norm)

    @classmethod
    def calibrate_noise(cls, cfg, calibration, epsilon: float, delta: float) -> tuple[float, EpsilonSplit | None]:
        """(privacy.noise_multiplier, what was derived) for a target (epsilon, delta): the base
        sigma and None (renyi split), or sigma_dp and the `EpsilonSplit` with sigma_tr and the
        split's epsilons (epsilon split: each mechanism alone meets its share at delta/2)."""
        q, clip = calibration.sample_rate, calibration.clip_norm
        if budget_split(cfg) == "renyi":
            return calibration.noise_multiplier(
                lambda s, step: cls.planned_mechanisms(cfg, s, q, step, clip), epsilon, delta
            ), None
        if cfg.score_noise_multiplier is not None:
            raise UserError("algo.score_noise_multiplier is calibrated from privacy.epsilon here; give it only "
                            "together with privacy.noise_multiplier (fixed noise), or leave it null")
        f = cfg.score_epsilon_fraction
        score = lambda s, step: [score_mechanism(s, q)]  # noqa: E731
        gradient = lambda s, step: [gradient_mechanism(cfg, s, q, clip)]  # noqa: E731
        # the paper's ratio: each part alone at its share (delta/2 each) ...
        ratio = calibration.noise_multiplier(score, f * epsilon, delta / 2) / \
            calibration.noise_multiplier(gradient, (1 - f) * epsilon, delta / 2)
        # ... then one scale for both, until the joint mechanism (one batch) meets the target
        sigma_dp = calibration.noise_multiplier(
            lambda s, step: joint_mechanism(cfg, ratio * s, s, q, clip), epsilon, delta)
        sigma_tr = ratio * sigma_dp
        return sigma_dp, EpsilonSplit(
            sigma_tr=sigma_tr, sigma_dp=sigma_dp,
            epsilon_tr=calibration.epsilon(lambda step: score(sigma_tr, step), delta / 2),
            epsilon_dp=calibration.epsilon(lambda step: gradient(sigma_dp, step), delta / 2),
            delta_each=delta / 2,
        )

    # --- one step (DPFirstOrderAlgorithm's phases, clip_and_accumulate and the noise changed) ---
    def clip_and_accumulate(self, batches):
        """Scores of every example, the tail set, and the sum of each example's gradient clipped at
        its threshold. Threshold mode (the default) does it in one pass over the physical chunks:
        an example's threshold needs only its own exact score and the public tau_t; the step's
        score histogram is kept for `add_noise`. Rank mode needs every noisy score of the batch
        before any threshold, so it makes two passes: scores, then clipped sums. With several
        physical chunks its pass 2 recomputes per-example gradients (dropout may differ) and clips
        each with its own norm; only the tail/body assignment comes from pass 1."""
        chunks = [b for b in batches if self.task.batch_size(b) > 0]
        basis = None if self.subspaces is None else self.subspaces.draw()
        if self.threshold_selection:
            return self._clip_by_threshold(chunks, basis)
        tally, scores, finite, seen, kept = LossTally(), [], [], [], None
        for batch, losses in self.chunks(chunks, tally):
            per_sample = self.engine.backward_per_sample(losses)
            scores.append(self.example_scores(per_sample, basis))
            norms = per_sample_norms(per_sample)
            finite.append(torch.isfinite(norms))  # a non-finite example is in no release
            seen.append(batch)  # a step hook's extra examples included (`chunks`)
            kept = (per_sample, norms) if len(seen) == 1 else None  # one chunk: reused in pass 2
            del per_sample, norms
        scores_all, finite_all = self._batch_of(scores, torch.float32), self._batch_of(finite, torch.bool)
        tail, thresholds = self.clip_thresholds(self.release_scores(scores_all[finite_all]), finite_all)
        self._record_tail(tally, tail, finite_all)
        sums, start = self.zero_sums(), 0
        for batch in seen:
            if kept is not None:
                per_sample, norms = kept
            else:  # recomputed: clipped with the norms of the gradients it sums
                per_sample = self.engine.backward_per_sample(self.per_example_losses(batch))
                norms = per_sample_norms(per_sample)
            size = per_sample[0].shape[0]
            factors = self.example_factors(norms, thresholds[start : start + size])
            for s, c in zip(sums, clipped_sum(per_sample, factors, overwrite=True)):  # per_sample is dropped next
                s.add_(c)
            start += size
            del per_sample, norms
        return sums, tally

    def _clip_by_threshold(self, chunks, basis):
        """Threshold mode's one pass: each chunk's exact scores against the public tau_t give its
        tail set and thresholds at once, so its gradients are clipped and summed as formed."""
        threshold = self.current_threshold()
        tally, scores, finite, tails, sums = LossTally(), [], [], [], self.zero_sums()
        for _, losses in self.chunks(chunks, tally):
            per_sample = self.engine.backward_per_sample(losses)
            chunk_scores = self.example_scores(per_sample, basis)
            norms = per_sample_norms(per_sample)
            chunk_finite = torch.isfinite(norms)  # a non-finite example is in no release
            tail = (chunk_scores > threshold) & chunk_finite
            factors = self.example_factors(norms, torch.where(tail, self.tail_clip, self.body_clip))
            for s, c in zip(sums, clipped_sum(per_sample, factors, overwrite=True)):  # per_sample is dropped next
                s.add_(c)
            scores.append(chunk_scores)
            finite.append(chunk_finite)
            tails.append(tail)
            del per_sample, norms
        scores_all, finite_all = self._batch_of(scores, torch.float32), self._batch_of(finite, torch.bool)
        self.pending_histogram = score_histogram(scores_all[finite_all])  # released with the sum (`add_noise`)
        self._record_tail(tally, self._batch_of(tails, torch.bool), finite_all)
        return sums, tally

    def _batch_of(self, parts: list[torch.Tensor], dtype) -> torch.Tensor:
        """The step's [B] values from its chunks' (an empty batch: an empty tensor)."""
        return torch.cat(parts) if parts else torch.zeros(0, dtype=dtype, device=self.params[0].device)

    def _record_tail(self, tally: LossTally, tail: torch.Tensor, finite: torch.Tensor) -> None:
        if tally.count:
            self.last_tail = tail  # [B] bool, for diagnostics and tests
            self.tail_fraction_seen.append(tail[finite].float().mean().item() if bool(finite.any()) else 0.0)

    def example_scores(self, per_sample: list[torch.Tensor], basis) -> torch.Tensor:
        # the identification tensors as column pieces of [b, d_id]: no concatenated copy
        pieces = [per_sample[i].reshape(per_sample[i].shape[0], -1).float() for i in self.identification]
        return subspace_scores(pieces, basis)  # [b]; basis: drawn on the model's device

    def release_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores + N(0, sigma_tr^2) (sensitivity 1). Runs on every step: an empty batch releases
        an empty vector."""
        ((noisy,),) = self.gaussian_release("scores", ReleasePart([scores], 1.0, self.sigma_tr))
        return noisy

    def current_threshold(self) -> float:
        """tau_t: from the score histograms released before this step only (+inf before any)."""
        if self.score_histogram_average is None:
            return math.inf
        return histogram_threshold(self.score_histogram_average, self.cfg.tail_fraction)

    def add_noise(self, sums: list[torch.Tensor]) -> list[torch.Tensor]:
        """The gradient release; in threshold mode one release of two parts, the score histogram
        (sensitivity 1, std sigma_tr) and the clipped sum, whose noisy histogram is folded into the
        average that sets tau_{t+1}. Rank mode released its scores before the tail was chosen;
        both releases still make one mechanism (`Algorithm.train_step`)."""
        if not self.threshold_selection:
            return super().add_noise(sums)
        histogram, self.pending_histogram = self.pending_histogram, None
        if histogram is None:  # no scores were formed (a bare privatize): the empty batch's histogram
            histogram = score_histogram(torch.zeros(0, device=self.params[0].device))
        (noisy_histogram,), noisy = self.gaussian_release(
            "scores_and_gradient",
            ReleasePart([histogram], 1.0, self.sigma_tr),
            ReleasePart(sums, self.gradient_sensitivity(), self.gradient_noise_std()),
        )
        released = noisy_histogram.detach().float()
        average = self.score_histogram_average
        self.score_histogram_average = released if average is None else \
            average.mul_(HISTOGRAM_DECAY).add_(released, alpha=1 - HISTOGRAM_DECAY)
        return noisy

    def clip_thresholds(self, noisy_scores: torch.Tensor, finite: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Tail mask (the top-p noisy scores, which are those of the `finite` examples) and [B]
        per-example thresholds: c1 tail, c2 body."""
        tail = tail_mask(noisy_scores, self.cfg.tail_fraction)
        if finite is not None:  # back to the batch's positions; a dropped example is body (its factor is 0)
            tail = torch.zeros_like(finite).masked_scatter(finite, tail)
        return tail, torch.where(tail, self.tail_clip, self.body_clip)

    def gradient_sensitivity(self) -> float:
        """c1 (tail_clip model) or 2 c1 - c2 (rank_coupled): see `gradient_sensitivity_in_c2`."""
        return gradient_sensitivity_in_c2(self.cfg, self.tail_clip / self.body_clip) * self.body_clip

    def gradient_noise_std(self) -> float:
        return self.sigma_dp * self.tail_clip  # one N(0, (sigma_dp c1)^2) vector on the clipped sum

    def build_optimizer(self, params):
        return torch.optim.SGD(lr_groups(params, self.lr), lr=self.lr, momentum=self.cfg.momentum)

    def epsilon_split_results(self) -> dict:
        """The paper-style budget of an epsilon split: eps_tr and eps_dp of each part alone over the
        planned run, at delta/2 each. Their sum is the paper's accounting, NOT a bound (the parts
        read one batch); privacy.epsilon is the joint mechanism's. Empty for a renyi split or noise
        given without them."""
        split = self.epsilon_split
        if budget_split(self.cfg) != "epsilon" or split is None:
            return {}
        if not (math.isclose(split.sigma_tr, self.sigma_tr) and math.isclose(split.sigma_dp, self.sigma_dp)):
            return {}  # a split of other noise multipliers: not this run's
        return {
            "score_epsilon_fraction": self.cfg.score_epsilon_fraction,
            "epsilon_tr": split.epsilon_tr,
            "epsilon_dp": split.epsilon_dp,
            "epsilon_tr_plus_dp": split.epsilon_tr + split.epsilon_dp,  # paper accounting, not a bound (notes)
            "epsilon_split_delta_each": split.delta_each,
        }

    def extra_results(self) -> dict:
        seen = self.tail_fraction_seen
        if budget_split(self.cfg) == "renyi":
            renyi_share = self.cfg.score_budget_fraction
        elif math.isfinite(self.sigma_tr):  # the Renyi share the two calibrated multipliers amount to
            renyi_share = self.sigma_tr**-2 / (self.sigma_tr**-2 + self.sigma_dp**-2)
        else:
            renyi_share = None
        return {
            "sigma_tr": self.sigma_tr,
            "sigma_dp": self.sigma_dp,
            "base_noise_multiplier": self.privacy.noise_multiplier,  # sigma_dp under budget_split=epsilon
            "budget_split": budget_split(self.cfg),
            "score_budget_fraction": renyi_share,
            **self.epsilon_split_results(),
            "body_clip_c2": self.body_clip,
            "tail_clip_c1": self.tail_clip,
            "gradient_sensitivity": "threshold_c1" if self.threshold_selection else self.cfg.gradient_sensitivity,
            "tail_selection": tail_selection(self.cfg),
            "score_dim": sum(self.params[i].numel() for i in self.identification),
            "score_subspace_blocks": None if self.subspaces is None else self.subspaces.blocks,  # > 1: V built in blocks
            "mean_tail_fraction": sum(seen) / len(seen) if seen else None,
        }
