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

Canaries are white-box (`Canaries`, placed per algorithm by `SITES`): canary i contributes exactly
the declared per-example sensitivity C of the algorithm's clipped sum, joining each step's batch
as a real example would under the run's sampling. Dirac canaries own one coordinate of the sum
(in DP-GRAPE's projected space; the real gradients masked there); a one-dimensional release
(DPZero's scalar) gets signed canaries instead. The verdict scores each canary from the iterates,
the sum over steps of theta_{t-1} - theta_t read along its direction (optimizer state included);
the same guesses from the released values (the optimizer's input) are reported beside it.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from dpbench.errors import UserError
from dpbench.tools.audit_report import AuditReport, Check

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


class Schedule:
    """Which canaries join step t's batch, as a real example would under the run's sampling:
    Poisson (each step independently with probability q) or shuffled (one uniformly random step of
    each epoch of `steps_per_epoch`). Drawn from the canaries' secret generator."""

    def __init__(self, count: int, sample_rate: float, steps_per_epoch: int | None, rng: np.random.Generator):
        self.count, self.sample_rate, self.steps_per_epoch, self._rng = count, sample_rate, steps_per_epoch, rng
        self._slots: np.ndarray | None = None

    def joining(self, step: int) -> np.ndarray:
        if self.steps_per_epoch is None:
            return self._rng.random(self.count) < self.sample_rate
        place = step % self.steps_per_epoch
        if self._slots is None or place == 0:
            self._slots = self._rng.integers(0, self.steps_per_epoch, self.count)
        return self._slots == place


class Canaries:
    """M canaries of one run: who is included, who joins each step, and their scores.

    Dirac canaries (`signed=False`): canary i owns one coordinate of the step's clipped sum (a
    public choice from the config's seed); `insert` sets that coordinate to its contribution, so
    the real gradients are masked there (setting a coordinate of a sum of clipped vectors to 0
    cannot raise any example's contribution above its bound). Signed canaries (`signed=True`, a
    one-dimensional release: DPZero's scalar): every canary adds s_{i,t} x its contribution with a
    public random sign s_{i,t} in {-1, +1} per step, replacing the real examples' sum (the scalar
    is masked whole), and is scored along its signs.

    A contribution is the release's declared per-example sensitivity C: under add/remove an
    included canary that joins adds +C and an excluded one is absent; under replace-one every
    joining canary is present, +C if included, -C if not (S_i = +-1). Inclusion and participation
    come from fresh OS entropy, never the seed. On data-parallel ranks only rank 0 adds them (the
    ranks' sums are added), every rank masks."""

    def __init__(self, space: list[torch.Size], count: int, schedule_rate: float, steps_per_epoch: int | None,
                 neighboring: str, seed: int, signed: bool = False):
        self.count, self.signed, self.neighboring = count, signed, neighboring
        self.space = [torch.Size(s) for s in space]
        self._rng = np.random.default_rng(secrets.randbits(128))  # secret: inclusion and participation
        self.included = self._rng.random(count) < 0.5
        self.schedule = Schedule(count, schedule_rate, steps_per_epoch, self._rng)
        self._public = np.random.default_rng(int(seed))  # public: coordinates and signs
        self.placements: list[tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]] = []
        if not signed:
            self._place(int(seed))
        self.release_scores = np.zeros(count)  # sum over steps of the release, read along each canary
        self.iterate_scores = np.zeros(count)  # sum over steps of theta_{t-1} - theta_t, read along each canary
        self.joins = np.zeros(count, dtype=np.int64)  # steps each canary was present in (report only)
        self.steps = 0
        self._weights: np.ndarray | None = None  # this step: +1 / -1 / 0 per canary
        self._signs: np.ndarray | None = None  # this step's public signs (signed canaries)
        self._inserted = False

    def _place(self, seed: int) -> None:
        sizes = [s.numel() for s in self.space]
        total = sum(sizes)
        if self.count > total:
            raise UserError(f"audit.canaries={self.count} exceeds the {total} coordinates of the privatised sum "
                            "(one canary each); lower it")
        flat = torch.randperm(total, generator=torch.Generator().manual_seed(seed))[: self.count]
        starts = torch.tensor([0] + list(np.cumsum(sizes)[:-1]), dtype=torch.long)
        owner = torch.searchsorted(starts, flat, right=True) - 1
        for k, shape in enumerate(self.space):  # per tensor: its index, its canary ids, their index into it
            ids = torch.nonzero(owner == k).flatten()
            if len(ids):
                self.placements.append((k, ids, torch.unravel_index(flat[ids] - starts[k], shape)))

    # --- one step ------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        joining = self.schedule.joining(step)
        present = joining if self.neighboring == "replace_one" else joining & self.included
        self._weights = present * np.where(self.included, 1.0, -1.0)
        self._signs = self._public.choice((-1.0, 1.0), self.count) if self.signed else None
        self.joins += present
        self.steps += 1
        self._inserted = False

    def _contributions(self, norm: float) -> np.ndarray:
        from dpbench import distributed

        if not distributed.is_main_process():  # data parallel: the ranks' sums are added; rank 0 carries them
            return np.zeros(self.count)
        return self._weights * float(norm)

    def insert(self, sums: list[torch.Tensor], norm: float) -> None:
        """Mask the canary coordinates of this step's clipped sum and write each present canary's
        contribution (Dirac canaries), in place."""
        self._once()
        if [s.shape for s in sums] != self.space:
            raise RuntimeError("the privatised sum is not in the canaries' shapes: this step cannot carry them")
        values = torch.as_tensor(self._contributions(norm), dtype=torch.float32)
        for k, ids, index in self.placements:
            s = sums[k]
            s[tuple(i.to(s.device) for i in index)] = values[ids].to(s.device, s.dtype)

    def signed_total(self, norm: float) -> float:
        """The canaries' part of a scalar clipped sum: sum_i S_i s_{i,t} C over the present ones."""
        self._once()
        return float(np.dot(self._contributions(norm), self._signs))

    def _once(self) -> None:
        if self._weights is None or self._inserted:
            raise RuntimeError("the canaries joined a step twice (or outside a training step)")
        self._inserted = True

    def present_count(self) -> int:
        """Canaries present in this step's batch (on the rank that carries them)."""
        return int(np.count_nonzero(self._contributions(1.0)))

    # --- what the adversary reads --------------------------------------------------------
    def read(self, tensors: list[torch.Tensor]) -> np.ndarray:
        """Each canary's reading of `tensors` (in the canaries' space): its coordinate, or, for
        signed canaries, its sign times the scalar."""
        if self.signed:
            return self._signs * float(tensors[0].detach().double().sum())
        out = np.zeros(self.count)
        for k, ids, index in self.placements:
            t = tensors[k]
            out[ids.numpy()] = t[tuple(i.to(t.device) for i in index)].detach().double().cpu().numpy()
        return out


# ----------------------------------------------------------------------------- where each algorithm's canaries go


Sensitivity = Callable[[object], float]


@dataclass(frozen=True)
class CanarySite:
    """Where an algorithm's canaries join its clipped sum, and how its update is read back.

    `sums` names the methods that return a step's clipped sum first in their result, with the
    per-example sensitivity of that sum (the canary's contribution): the canaries go in right
    after the examples' own clipped gradients are summed, before anything downstream (noise,
    scaling, the optimizer) sees the sum, as an example's gradient would. `in_release` instead
    inserts them into the release of that name (an algorithm that forms its sum inside the
    release). `space` gives the shapes of that sum, `view` maps a step's parameter change
    theta_{t-1} - theta_t into it: the white-box adversary's reading of the iterates."""

    space: Callable[[object], list[torch.Size]]
    view: Callable[[object, list[torch.Tensor]], list[torch.Tensor]]
    sums: tuple[tuple[str, Sensitivity], ...] = ()
    in_release: str | None = None
    signed: bool = False
    install: Callable[["Canaries", object], None] | None = None  # extra wiring (DPZero's scalar, DC-DPSGD's histogram)


def _noise_shapes(algorithm) -> list[torch.Size]:
    return [torch.Size(s) for s in algorithm.noise_shapes()]


def _param_shapes(algorithm) -> list[torch.Size]:
    return [p.shape for p in algorithm.params]


def _identity(algorithm, deltas):
    return deltas


def _projected(algorithm, deltas):
    """DP-GRAPE: each projected layer's change seen through this step's P (P^T dW or dW P), the
    space its noise was added in; the rest as is."""
    from dpbench.algorithms.projected_adam import project

    out = []
    for p, delta in zip(algorithm.params, deltas):
        projection = algorithm.projections.get(p)
        if projection is None:
            out.append(delta)
        else:
            out.append(project(delta.float(), algorithm.projector(projection, delta.device), projection.side))
    return out


def _along_direction(algorithm, deltas):
    """DPZero: the step's change along its direction, <theta_{t-1} - theta_t, scale z_t>, a scalar
    from which the released value is read back (the update is lr (g scale z + decay))."""
    seed, scale = algorithm._canary_direction
    total = sum(float((d.double() * algorithm.direction_part(p, seed).double()).sum())
                for p, d in zip(algorithm.params, deltas))
    return [torch.tensor(total * scale, dtype=torch.float64)]


def _gradient_sensitivity(algorithm) -> float:
    return float(algorithm.gradient_sensitivity())


def _dpzero_install(canaries: Canaries, algorithm) -> None:
    """The scalar clipped sum gets the signed canaries; the step's direction is kept for `view`."""
    estimate, apply_update = algorithm.estimate, algorithm.apply_update

    def canaried_estimate(batches, seed, scale, clip):
        total, loss, count = estimate(batches, seed, scale, clip)
        if clip is not None:  # the private estimate (its bound is C = privacy.clip_norm)
            # the real examples' sum is masked, as a Dirac canary's coordinate is: on one scalar
            # they would drown the canaries (the run then learns from the canaries alone)
            total = canaries.signed_total(algorithm.privacy.clip_norm)
        return total, loss, count

    def recording_update(seed, scale, projected_gradient):
        algorithm._canary_direction = (seed, scale)
        return apply_update(seed, scale, projected_gradient)

    algorithm.estimate, algorithm.apply_update = canaried_estimate, recording_update


def _dcdpsgd_install(canaries: Canaries, algorithm) -> None:
    """Threshold selection releases the step's score histogram with its gradient sum: a present
    canary also counts once in the top bin (a score above any threshold), as a tail example would."""
    clip_and_accumulate = algorithm.clip_and_accumulate  # already canaried (CanarySite.sums)

    def with_histogram(batches):
        result = clip_and_accumulate(batches)
        if getattr(algorithm, "pending_histogram", None) is not None:
            algorithm.pending_histogram[-1] += canaries.present_count()
        return result

    algorithm.clip_and_accumulate = with_histogram


_FIRST_ORDER = (("clip_and_accumulate", _gradient_sensitivity),)
_DIFFERENCES = _FIRST_ORDER + (("difference_sums", lambda a: float(a.difference_clip)),)

SITES: dict[str, CanarySite] = {
    "dpsgd": CanarySite(_noise_shapes, _identity, _FIRST_ORDER),
    "dpadam": CanarySite(_noise_shapes, _identity, _FIRST_ORDER),
    "dplora": CanarySite(_noise_shapes, _identity, _FIRST_ORDER),  # the LoRA factors' gradients
    "galore_naive": CanarySite(_noise_shapes, _identity, _FIRST_ORDER),  # full gradients, then GaLore
    "grape": CanarySite(_noise_shapes, _projected, _FIRST_ORDER),  # in the projected space the noise is added in
    "dcdpsgd": CanarySite(_noise_shapes, _identity, _FIRST_ORDER, install=_dcdpsgd_install),
    "dpdr": CanarySite(_noise_shapes, _identity,
                       _FIRST_ORDER + (("decomposed_sums", lambda a: float(a.cfg.perp_clip)),)),  # g_perp on decomposition steps
    "diff": CanarySite(_noise_shapes, _identity, _DIFFERENCES),
    "diff2": CanarySite(_noise_shapes, _identity, _DIFFERENCES),
    "dpgd0th": CanarySite(_param_shapes, _identity, in_release="gradient"),  # its d-dimensional sum is formed in the release
    "dpzero": CanarySite(lambda a: [torch.Size([])], _along_direction, signed=True, install=_dpzero_install),
}


def _install(canaries: Canaries, algorithm, site: CanarySite) -> None:
    """Wrap the algorithm's methods on the instance (the class and every other run are untouched)."""
    for name, sensitivity in site.sums:
        inner = getattr(algorithm, name)

        def canaried(*args, _inner=inner, _sensitivity=sensitivity, **kwargs):
            result = _inner(*args, **kwargs)
            canaries.insert(result[0], _sensitivity(algorithm))
            return result

        setattr(algorithm, name, canaried)
    if site.install is not None:
        site.install(canaries, algorithm)

    release = algorithm.gaussian_release

    def observed_release(name, *parts, **kwargs):
        if name == site.in_release:
            canaries.insert(parts[0].values, parts[0].sensitivity)
        noisy = release(name, *parts, **kwargs)
        for part, values in zip(parts, noisy):  # the optimizer's input, read along the canaries
            if [v.shape for v in part.values] == canaries.space:
                canaries.release_scores += canaries.read(values)
        return noisy

    algorithm.gaussian_release = observed_release
    train_step = algorithm.train_step

    def step_with_canaries(batches, step_index):
        canaries.begin_step(step_index)
        before = [p.detach().clone() for p in algorithm.params]
        result = train_step(batches, step_index)
        with torch.no_grad():
            deltas = [b.sub_(p.detach()) for b, p in zip(before, algorithm.params)]
            canaries.iterate_scores += canaries.read(site.view(algorithm, deltas))
        return result

    algorithm.train_step = step_with_canaries


# ----------------------------------------------------------------------------- black-box canaries


class InputCanaryTask:
    """The run's image task with M mislabeled training images among its examples (audit.canary=input).

    Canary i is a copy of a training image (a public choice from the config's seed) with a wrong
    label. Under add/remove the included canaries are appended to the training set; under
    replace-one every canary slot holds a record, the mislabeled image if included, else the same
    image with its own label. They are sampled like every other example, at the planned q = B / n
    (n, B and T stay the public, planned ones). The adversary sees only the final model: canary
    i's score is minus its loss at the wrong label, so memorised canaries score high."""

    def __init__(self, task, count: int, neighboring: str, seed: int):
        from dpbench.tasks.image import ImageClassificationTask

        if not isinstance(task, ImageClassificationTask):
            raise UserError(f"audit.canary=input needs an image dataset; {type(task).__name__} has none: use "
                            "audit.canary=gradient")
        data, generator = task.data, torch.Generator().manual_seed(int(seed))
        source = torch.randint(0, task.train_size, (count,), generator=generator)  # public
        classes = int(data.num_classes)
        self.images = data.train_images[source].clone()
        self.true_labels = data.train_labels[source].clone()
        self.labels = (self.true_labels + torch.randint(1, classes, (count,), generator=generator)) % classes
        self.included = np.random.default_rng(secrets.randbits(128)).random(count) < 0.5  # secret
        self.task, self.real = task, task.train_size
        # the records at positions n, n + 1, ...: canary ids, each with its label in the training set
        present = np.arange(count) if neighboring == "replace_one" else np.flatnonzero(self.included)
        self.present = torch.as_tensor(present, dtype=torch.long)
        in_set = torch.as_tensor(self.included[present], dtype=torch.bool)
        self.present_labels = torch.where(in_set, self.labels[self.present], self.true_labels[self.present])
        self.train_size = self.real + len(present)
        self.planning_size = task.planning_size  # public: q, B and T stay as planned

    def __getattr__(self, name):
        return getattr(self.task, name)

    def batch(self, indices: list[int]):
        real = [i for i in indices if i < self.real]
        extra = torch.as_tensor([i - self.real for i in indices if i >= self.real], dtype=torch.long)
        images, labels = self.task.batch(real)
        if not len(extra):
            return images, labels
        device = images.device
        return (torch.cat([images, self.images[self.present[extra]].to(device, images.dtype)]),
                torch.cat([labels, self.present_labels[extra].to(device, labels.dtype)]))

    @torch.no_grad()
    def scores(self, model) -> np.ndarray:
        """Minus each canary's loss at its wrong label under the final model (eval mode)."""
        import torch.nn.functional as F

        was_training = model.training
        model.eval()
        device = next(model.parameters()).device
        logits = model(self.images.to(device))
        model.train(was_training)
        return -F.cross_entropy(logits.float(), self.labels.to(device), reduction="none").double().cpu().numpy()


# ----------------------------------------------------------------------------- the audit


@dataclass
class OneRunResult:
    claimed_epsilon: float
    epsilon_lower_bound: float  # from the iterates' scores: the verdict
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
    # the same guesses from the scores at the optimizer's input (the releases), for comparison
    # (None for input canaries, which only the final model shows)
    epsilon_lower_bound_release: float | None = None
    correct_release: int | None = None
    canary_kind: str = "dirac"  # dirac | signed | input
    sampling: str = "poisson"
    neighboring: str = "add_remove"


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


def canary_site(cfg) -> CanarySite:
    from dpbench.algorithms import algorithm_class

    name = str(cfg.algo.name)
    if not algorithm_class(name).private:
        raise UserError(f"audit.one_run=true audits private algorithms; algo={name} is not private")
    if name not in SITES:
        raise UserError(f"audit.one_run=true has no canary site for algo={name}; supported: {' | '.join(SITES)}")
    if str(cfg.train.get("sharding", "none")) != "none":
        raise UserError("audit.one_run=true runs unsharded: drop train.sharding (the canaries read whole tensors)")
    return SITES[name]


def one_run_audit(cfg) -> OneRunReport:
    """Train the configured run once with canaries and bound its epsilon from below."""
    from omegaconf import OmegaConf

    from dpbench.logging.wandb_logger import build_logger
    from dpbench.privacy.sampling import batches_per_epoch
    from dpbench.run import fit, setup

    count, guesses, confidence = one_run_options(cfg)
    site = canary_site(cfg)
    if cfg.get("threads"):  # as `dpbench` runs the job (run_job)
        torch.set_num_threads(int(cfg.threads))
    cfg = cfg.copy()  # an audit's report is published: it trains without un-noised statistics (docs/results.md)
    OmegaConf.update(cfg, "privacy.log_private_stats", False, force_add=True)
    job = setup(cfg)
    setup_ = job.privacy.setup
    neighboring = str(cfg.privacy.get("neighboring", "add_remove"))
    black_box = str(cfg.audit.get("canary", "gradient")) == "input"
    if black_box:
        marks = job.task = InputCanaryTask(job.task, count, neighboring, int(cfg.seed))
        kind = "input"
    else:
        if site.signed and count > max(2, job.steps // 10):
            raise UserError(f"audit.canaries={count} is too many for algo={cfg.algo.name}'s one-dimensional release "
                            f"over {job.steps} steps: at most about T/10 = {max(2, job.steps // 10)} signed canaries; lower it")
        marks = Canaries(site.space(job.algorithm), count, setup_.sample_rate, batches_per_epoch(cfg, job.task.planning_size),
                         neighboring, int(cfg.seed), signed=site.signed)
        _install(marks, job.algorithm, site)
        kind = "signed" if site.signed else "dirac"
    trainer, _, failure = fit(job, build_logger(OmegaConf.create({"name": "none"}), None, "", {}), show_progress=False)
    if failure is not None:
        raise failure
    delta = float(job.privacy.delta)

    def bound_of(scores: np.ndarray) -> tuple[float, int]:  # guesses fixed from the scores alone
        correct = Guesses.from_scores(scores, guesses).correct(marks.included)
        return epsilon_lower_bound(count, guesses, correct, delta, confidence), correct

    bound, correct = bound_of(marks.scores(job.model) if black_box else marks.iterate_scores)
    bound_release, correct_release = (None, None) if black_box else bound_of(marks.release_scores)
    claimed = float(job.privacy.epsilon(trainer.state.ledger))
    top = ceiling(count, guesses, delta, confidence)
    result = OneRunResult(claimed, bound, top, count, guesses, correct, confidence, delta,
                          int(marks.included.sum()), trainer.state.step, float(setup_.noise_multiplier),
                          float(setup_.sample_rate), float(setup_.clip_norm), bound_release, correct_release,
                          kind, str(cfg.privacy.sampling), neighboring)
    seen = ("from the final model's losses" if black_box else "from the iterates")
    beside = "" if black_box else f"; at the optimizer's input {bound_release:.3f} ({correct_release}/{guesses})"
    check = Check(
        "one_run", f"{count} {dict(dirac='gradient', signed='signed', input='mislabeled input')[kind]} canaries",
        bound, claimed, bound <= claimed,
        f"eps lower bound {bound:.3f} {seen} (ceiling {top:.3f} for m={count}, r={guesses}) vs the reported eps "
        f"{claimed:.3f}: {correct}/{guesses} guesses right{beside}; {marks.included.sum()} canaries included, "
        f"{trainer.state.step} steps, q {setup_.sample_rate:.4g}, sigma {setup_.noise_multiplier:.4g}, "
        f"confidence {confidence:g}, delta {delta:g}",
    )
    return OneRunReport(cfg.algo.name, cfg.model.name, cfg.dataset.name, [check], result)
