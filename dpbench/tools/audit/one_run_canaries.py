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

DIRECTION (DPZero, DPGD0th): every example's contribution lies along the step's one public
direction z, so canary i is an example whose two-point difference is S_i s_{i,t} * 1e4 C, with a
public random sign s_{i,t} per step; the estimate clips it to +-C along z (DPGD0th: ||clip(s z)||
<= C) as it clips any example, and it is scored along its signs. The real records would share that
one scalar and drown the canaries: the audit's dataset blanks them (`BlankRecords`, loss 0, so
difference 0), the worst-case dataset of Nasr et al. (2021).
"""

from __future__ import annotations

import secrets

import numpy as np
import torch
from torch import nn

from dpbench.algorithms.base import DIRECTION, EXAMPLES
from dpbench.errors import UserError

CANARY_MODULE = "one_run_canaries"  # the canary layer's name in the model (`add_canary_layer`)
LOSS_SCALE = 1.0e4  # s / C: a canary's gradient norm (or difference) over the clip norm, far above any clipping bound


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
    canaries' own layer (`CanaryLayer`). Signed canaries (`signed=True`, canary_site DIRECTION: a
    one-dimensional release along z): canary i carries a public random sign s_{i,t} in {-1, +1}
    per step and is scored along its signs. `CanaryHook` makes the present ones examples of the step.

    A present canary's sign S_i: under add/remove an included canary that joins is present with
    +1 and an excluded one is absent; under replace-one every joining canary is present, +1 if
    included, -1 if not. Inclusion and participation come from fresh OS entropy, never the seed.
    (The one-run audit runs in one process.)"""

    def __init__(self, space: list[torch.Size], count: int, schedule_rate: float, steps_per_epoch: int | None,
                 neighboring: str, seed: int, signed: bool = False, own_space: bool = False):
        if signed == own_space:
            raise ValueError("canaries are either signed (a scalar release) or own their space (canary examples)")
        self.count, self.signed, self.neighboring = count, signed, neighboring
        self.space = [torch.Size(s) for s in space]
        self._rng = np.random.default_rng(secrets.randbits(128))  # secret: inclusion and participation
        self.included = self._rng.random(count) < 0.5
        self.schedule = Schedule(count, schedule_rate, steps_per_epoch, self._rng)
        self._public = np.random.default_rng(int(seed))  # public: signs
        self.placements: list[tuple[int, torch.Tensor, tuple[torch.Tensor, ...]]] = []
        if own_space:  # the canaries' own layer: canary i owns its coordinate i
            self.placements.append((0, torch.arange(count), torch.unravel_index(torch.arange(count), self.space[0])))
        self.release_scores = np.zeros(count)  # sum over steps of the release, read along each canary
        self.iterate_scores = np.zeros(count)  # sum over steps of theta_{t-1} - theta_t, read along each canary
        self.joins = np.zeros(count, dtype=np.int64)  # steps each canary was present in (report only)
        self.steps = 0
        self._weights: np.ndarray | None = None  # this step: +1 / -1 / 0 per canary
        self._signs: np.ndarray | None = None  # this step's public signs (signed canaries)
        self._joined = False

    # --- one step ------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        joining = self.schedule.joining(step)
        present = joining if self.neighboring == "replace_one" else joining & self.included
        self._weights = present * np.where(self.included, 1.0, -1.0)
        self._signs = self._public.choice((-1.0, 1.0), self.count) if self.signed else None
        self.joins += present
        self.steps += 1
        self._joined = False

    def present(self) -> tuple[np.ndarray, np.ndarray]:
        """This step's present canaries: their ids and signs (S_i: +1 included, -1 excluded under
        replace-one; signed canaries: times this step's public sign s_{i,t})."""
        if self._weights is None or self._joined:
            raise RuntimeError("the canaries joined a step twice (or outside a training step)")
        self._joined = True
        ids = np.flatnonzero(self._weights)
        return ids, self._weights[ids] * (self._signs[ids] if self.signed else 1.0)

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


class CanaryDifferences:
    """One chunk of signed canary examples for a zeroth-order step (canary_site DIRECTION,
    `OwnDifferenceExamples`): canary ids[j]'s two-point difference is signs[j] * scale, far above
    any clip bound, so the estimate's clipping brings it to +-its bound."""

    def __init__(self, signs: np.ndarray, scale: float, device: torch.device):
        self.signs = torch.as_tensor(signs, dtype=torch.float32, device=device)
        self.scale = float(scale)

    def per_sample_differences(self) -> torch.Tensor:
        return self.signs * self.scale


class BlankRecords:
    """The run's task with every real record's loss 0 (its forward still runs: the zeroth-order
    perturbation checks that every parameter is read), the dataset of a DIRECTION one-run audit: a
    real record's two-point difference is 0, so only the canaries move the estimate along z."""

    def __init__(self, task):
        self.task = task

    def __getattr__(self, name):
        return getattr(self.task, name)

    def per_sample_loss(self, model: nn.Module, batch) -> torch.Tensor:
        return self.task.per_sample_loss(model, batch) * 0.0  # a non-finite loss stays non-finite: dropped as before


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
    optimizer trains it); an algorithm that freezes all but named modules is told to keep it trained
    through the option its class declares (`trained_modules_option`: LoRA's algo.train_modules)."""
    from omegaconf import open_dict

    from dpbench.algorithms.base import ALGORITHMS
    from dpbench.models import ModelFamily, family_of

    holder, path = _holder(model)
    layer = CanaryLayer(count).to(next(model.parameters()).device)
    holder.add_module(CANARY_MODULE, layer)
    name = f"{path}.{CANARY_MODULE}" if path else CANARY_MODULE
    option = ALGORITHMS.get(str(algo_cfg.name)).trained_modules_option
    if option is not None:
        declared = getattr(ALGORITHMS.options(str(algo_cfg.name)), "__dataclass_fields__", {})
        if option not in declared:
            raise UserError(f"algo={algo_cfg.name} declares trained_modules_option={option!r}, which is not one of "
                            f"its options ({', '.join(declared) or 'none'}): the one-run audit cannot keep its canary "
                            "layer trained")
        trained = algo_cfg.get(option)  # null: the model family's trained modules, as LoRA reads it
        trained = list(trained) if trained is not None else list((family_of(model) or ModelFamily()).trained_modules)
        with open_dict(algo_cfg):
            algo_cfg[option] = [*trained, name]
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


def _along_direction(algorithm, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A zeroth-order step's parameter-shaped tensors read along its direction, <tensors, scale z_t>:
    a scalar proportional to the step's release along z (the update is lr (g scale z + decay))."""
    seed, scale = algorithm.last_direction
    total = sum(float((t.double() * algorithm.direction_part(p, seed).double()).sum())
                for p, t in zip(algorithm.params, tensors))
    return [torch.tensor(total * scale, dtype=torch.float64)]


class CanaryHook:
    """The step hook (`dpbench.algorithms.base.StepHook`) of a one-run audit: the canaries join
    each step where the algorithm's `canary_site` says; the iterates are read around each step
    (theta_{t-1} - theta_t along each canary: the verdict's scores) and every release through the
    release observer (the optimizer's input, reported beside)."""

    def __init__(self, canaries: Canaries, algorithm, layer: CanaryLayer | None):
        self.canaries, self.site, self.layer, self.algorithm = canaries, algorithm.canary_site, layer, algorithm
        self._before: list[torch.Tensor] | None = None
        self._shapes = [p.shape for p in algorithm.params]
        self._index = next((k for k, p in enumerate(algorithm.params) if layer is not None and p is layer.weight), None)
        if self.site == EXAMPLES and self._index is None:
            raise UserError(f"algo={algorithm.cfg.name} does not train the canary layer it was given: the one-run "
                            "audit cannot place its canary examples (an algorithm that trains named modules only "
                            "declares the option that names them: trained_modules_option on its class)")

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
        if self.site == DIRECTION:
            deltas = _along_direction(algorithm, deltas)
        self.canaries.iterate_scores += self.canaries.read(deltas)
        self._before = None

    def extra_examples(self, algorithm) -> list[CanaryExamples | CanaryDifferences]:
        ids, signs = self.canaries.present()
        if not len(ids):
            return []
        scale = LOSS_SCALE * float(algorithm.privacy.clip_norm)
        if self.site == DIRECTION:
            return [CanaryDifferences(signs, scale, algorithm.params[0].device)]
        return [CanaryExamples(self.layer, ids, signs, scale)]

    def observe_release(self, name, parts, noisy, mechanism) -> None:
        """The optimizer's input read along the canaries (a release in their space)."""
        for part, values in zip(parts, noisy):
            shapes = [v.shape for v in part.values]
            if self.site == EXAMPLES:  # a release aligned with the parameters: the canary layer's entry
                if len(values) == len(self._shapes) and values[self._index].shape == self.layer.weight.shape:
                    self.canaries.release_scores += self.canaries.read([values[self._index]])
            elif shapes == self.canaries.space:  # DPZero's scalar along z
                self.canaries.release_scores += self.canaries.read(values)
            elif shapes == self._shapes:  # DPGD0th's d-dimensional release, read along z
                self.canaries.release_scores += self.canaries.read(_along_direction(self.algorithm, values))
