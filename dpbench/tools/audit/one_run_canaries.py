"""The one-run audit's canaries (dpbench-audit audit.one_run=true) and the step hook that puts
them where the algorithm declares (`Algorithm.canary_site`, dpbench/algorithms/base.py).

EXAMPLES (every first-order algorithm): canary i is an example whose per-example loss is
s * w_i, linear in its own coordinate w_i of a small layer the audit adds to the model
(`CanaryLayer`, zero at start, read by no forward), with s far above any clip norm. Its gradient
is s e_i; the algorithm's engine forms it and its clipping brings it to C e_i, as it does any
example's; the real examples' gradients are 0 there. So a clipping bug shows: with clipping off a
canary contributes s e_i and every guess is right. Present canaries join the step as one more
physical chunk (`Algorithm.chunks`), as a real example joins under the run's sampling
(`Schedule`); no hook writes into a clipped sum.

CLIPPED_SCALAR (DPZero) and CLIPPED_RELEASE (DPGD0th): the zeroth-order estimate's every
example lies along one shared random direction, where a canary example would share one scalar with
all the real examples and drown; their canaries are written into the clipped sum at the declared
sensitivity instead, so the one-run audit cannot see a clipping bug there (the self-audit's
sensitivity check does).
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
from torch import nn

from dpbench.algorithms.base import CLIPPED_RELEASE, CLIPPED_SCALAR, EXAMPLES
from dpbench.errors import UserError

CANARY_MODULE = "one_run_canaries"  # the canary layer's name in the model (`add_canary_layer`)
LOSS_SCALE = 1.0e4  # s / C: a canary's gradient norm over the clip norm, far above any clipping bound
# what the one-run audit cannot see where canaries are written into a clipped sum
UNSEEN = {CLIPPED_SCALAR: "a clipping bug (its canaries are written into the clipped scalar sum; the self-audit's "
                          "sensitivity check sees clipping)",
          CLIPPED_RELEASE: "a clipping bug (its canaries are written into the clipped sum; the self-audit's "
                           "sensitivity check sees clipping)"}


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

    Canary examples (`own_space=True`, canary_site EXAMPLES): canary i owns coordinate i of the
    canaries' own layer (`CanaryLayer`); `CanaryHook` makes the present ones examples of the step.
    The other kinds are written into a clipped sum (canary_site CLIPPED_SCALAR / CLIPPED_RELEASE):
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
    come from fresh OS entropy, never the seed. (The one-run audit runs in one process.)"""

    def __init__(self, space: list[torch.Size], count: int, schedule_rate: float, steps_per_epoch: int | None,
                 neighboring: str, seed: int, signed: bool = False, own_space: bool = False):
        self.count, self.signed, self.neighboring = count, signed, neighboring
        self.space = [torch.Size(s) for s in space]
        self._rng = np.random.default_rng(secrets.randbits(128))  # secret: inclusion and participation
        self.included = self._rng.random(count) < 0.5
        self.schedule = Schedule(count, schedule_rate, steps_per_epoch, self._rng)
        self._public = np.random.default_rng(int(seed))  # public: coordinates and signs
        self.placements: list[tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]] = []
        if own_space:  # the canaries' own layer: canary i owns its coordinate i
            self.placements.append((0, torch.arange(count), torch.unravel_index(torch.arange(count), self.space[0])))
        elif not signed:
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
        return self._weights * float(norm)

    def present(self) -> tuple[np.ndarray, np.ndarray]:
        """This step's present canaries: their ids and signs (+1 included, -1 excluded under replace-one)."""
        self._once()
        ids = np.flatnonzero(self._weights)
        return ids, self._weights[ids]

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


# ----------------------------------------------------------------------------- canary examples


class CanaryLayer(nn.Embedding):
    """The canaries' own coordinates: one weight w_i per canary, zero at start. An Embedding, so
    every engine forms its per-example gradients with its own rule (a Dirac row per canary)."""

    def __init__(self, count: int):
        super().__init__(count, 1)
        nn.init.zeros_(self.weight)


class CanaryExamples:
    """One physical chunk of canary examples: canary ids[j] with sign signs[j] and the per-example
    loss signs[j] * s * w_{ids[j]} (gradient signs[j] * s * e_{ids[j]}), `OwnLossExamples`."""

    def __init__(self, layer: CanaryLayer, ids: np.ndarray, signs: np.ndarray, scale: float):
        device = layer.weight.device
        self.layer, self.scale = layer, float(scale)
        self.ids = torch.as_tensor(ids, dtype=torch.long, device=device)
        self.signs = torch.as_tensor(signs, dtype=torch.float32, device=device)

    def per_sample_loss(self, model: nn.Module) -> torch.Tensor:
        return self.layer(self.ids)[:, 0].float() * (self.signs * self.scale)


def add_canary_layer(model: nn.Module, count: int, algo_cfg) -> CanaryLayer:
    """The canary layer, added to the model before the algorithm is built (its engine hooks it, its
    optimizer trains it); an algorithm that freezes all but named modules (LoRA's
    algo.train_modules) is told to keep it trained."""
    from omegaconf import open_dict

    from dpbench.algorithms.base import ALGORITHMS
    from dpbench.models import ModelFamily, family_of

    holder, path = _holder(model)
    layer = CanaryLayer(count).to(next(model.parameters()).device)
    holder.add_module(CANARY_MODULE, layer)
    name = f"{path}.{CANARY_MODULE}" if path else CANARY_MODULE
    options = ALGORITHMS.options(str(algo_cfg.name))
    if options is not None and "train_modules" in options.__dataclass_fields__:
        trained = algo_cfg.get("train_modules")
        trained = list(trained) if trained is not None else list((family_of(model) or ModelFamily()).trained_modules)
        with open_dict(algo_cfg):
            algo_cfg.train_modules = [*trained, name]
    return layer


def _holder(model: nn.Module) -> tuple[nn.Module, str]:
    """A module whose forward never runs the canary layer: the root, unless the root calls its
    children in turn (nn.Sequential): then a parameter-free leaf (torch's leaf layers call no children)."""
    if not isinstance(model, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        return model, ""
    for name, m in model.named_modules():  # a leaf without parameters (ReLU, Flatten): the engines hook the canary layer alone
        if name and next(m.children(), None) is None and next(m.parameters(), None) is None:
            return m, name
    raise UserError(f"audit.one_run=true: a {type(model).__name__} model needs a parameter-free layer to hold the canary "
                    "layer; use audit.canary=input")


# ----------------------------------------------------------------------------- the step hook


def _along_direction(algorithm, deltas):
    """DPZero: the step's change along its direction, <theta_{t-1} - theta_t, scale z_t>, a scalar
    from which the released value is read back (the update is lr (g scale z + decay))."""
    seed, scale = algorithm.last_direction
    total = sum(float((d.double() * algorithm.direction_part(p, seed).double()).sum())
                for p, d in zip(algorithm.params, deltas))
    return [torch.tensor(total * scale, dtype=torch.float64)]


class CanaryHook:
    """The step hook (`dpbench.algorithms.base.StepHook`) of a one-run audit: the canaries join
    each step where the algorithm's `canary_site` says; the iterates are read around each step
    (theta_{t-1} - theta_t along each canary: the verdict's scores) and every release through the
    release observer (the optimizer's input, reported beside)."""

    def __init__(self, canaries: Canaries, algorithm, layer: CanaryLayer | None):
        self.canaries, self.site, self.layer = canaries, algorithm.canary_site, layer
        self._before: list[torch.Tensor] | None = None
        self._params = len(algorithm.params)
        self._index = next((k for k, p in enumerate(algorithm.params) if layer is not None and p is layer.weight), None)
        if self.site == EXAMPLES and self._index is None:
            raise UserError(f"algo={algorithm.cfg.name} does not train the canary layer it was given: the one-run "
                            "audit cannot place its canary examples")

    @classmethod
    def attach(cls, canaries: Canaries, algorithm, layer: CanaryLayer | None) -> "CanaryHook":
        hook = cls(canaries, algorithm, layer)
        algorithm.step_hook, algorithm.release_observer = hook, hook.observe_release
        return hook

    def _watched(self, algorithm) -> list[torch.Tensor]:
        return [self.layer.weight] if self.site == EXAMPLES else list(algorithm.params)

    def begin_step(self, algorithm, step_index: int) -> None:
        self.canaries.begin_step(step_index)
        self._before = [p.detach().clone() for p in self._watched(algorithm)]

    def end_step(self, algorithm, step_index: int) -> None:
        with torch.no_grad():
            deltas = [b.sub_(p.detach()) for b, p in zip(self._before, self._watched(algorithm))]
        if self.site == CLIPPED_SCALAR:
            deltas = _along_direction(algorithm, deltas)
        self.canaries.iterate_scores += self.canaries.read(deltas)
        self._before = None

    def extra_examples(self, algorithm) -> list[CanaryExamples]:
        if self.site != EXAMPLES:
            return []
        ids, signs = self.canaries.present()
        scale = LOSS_SCALE * float(algorithm.privacy.clip_norm)
        return [CanaryExamples(self.layer, ids, signs, scale)] if len(ids) else []

    def clipped_sum(self, algorithm, sums: list[torch.Tensor], sensitivity: float) -> list[torch.Tensor]:
        if self.site == CLIPPED_SCALAR:  # the real examples' scalar is masked whole (it would drown the canaries)
            return [self.canaries.signed_total(sensitivity)]
        if self.site == CLIPPED_RELEASE:
            self.canaries.insert(sums, sensitivity)
            return sums
        raise RuntimeError(f"canary_site {self.site!r} writes nothing into a clipped sum")

    def observe_release(self, name, parts, noisy, mechanism) -> None:
        """The optimizer's input read along the canaries (a release in their space)."""
        for part, values in zip(parts, noisy):
            if self.site == EXAMPLES:  # a release aligned with the parameters: the canary layer's entry
                if len(values) == self._params and values[self._index].shape == self.layer.weight.shape:
                    self.canaries.release_scores += self.canaries.read([values[self._index]])
            elif [v.shape for v in part.values] == self.canaries.space:
                self.canaries.release_scores += self.canaries.read(values)
