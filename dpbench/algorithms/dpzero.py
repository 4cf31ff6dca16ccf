"""DPZero (Zhang et al., ICML 2024, Algorithm 2 as run in its experiments) and its shared
zeroth-order machinery (MeZO, Malladi et al. 2023, is the same estimator without privacy).

One step, for a logical batch read in physical chunks:
  seed  <- public per-step direction seed (seeded generator: directions are data-independent)
  s_i    = (l_i(theta + lam*z) - l_i(theta - lam*z)) / (2 lam)   per-example scalar, z = z(seed)
  g      = (sum_i clip_C(s_i) + N(0, sigma^2 C^2)) / B           one scalar of noise per step
  theta <- theta - lr * (g * z + wd * theta)                     z regenerated from the seed

Privacy: each example contributes one scalar clipped to [-C, C], so the clipped sum has L2
sensitivity C under add/remove and 2C under replace-one; the direction z is public
(post-processing). The noise comes from `PrivacySetup.noise` (entropy-seeded), never from the
direction seed: the reference code draws it right after `torch.manual_seed(seed)`, which makes it
recomputable from the seed -- not reproduced here.

Memory: no autograd graph, no gradients, no optimizer state, z never stored. Where MeZO adds
+lam z, -2 lam z, +lam z to the weights in place (which does not restore fp32 weights bit for bit
and drifts in fp16), dpbench perturbs just in time: a forward pre-hook on each module that owns
trainable parameters swaps in theta_p +- lam z_p (computed in fp32, cast to the weight dtype) and
the forward hook swaps the untouched original back. The working set is the same as MeZO's (one
parameter-sized z at a time), the weights are never written during the evaluations (exactly
restored in every dtype), and z_p is regenerated from (seed, parameter index), so the order in
which modules run does not matter. Requirement (the same as Opacus's grad samplers): a trainable
parameter is only read inside the forward of a module that owns it; a check enforces that every
trainable parameter was perturbed during each evaluation.

Sharded (train.sharding=fsdp): the scalar release is REPLICATED (summed over the ranks, one draw
on rank 0, broadcast), so every rank steps with the same g. z is generated whole from the shared
seed (checked against rank 0's at start), as in one process, and each rank perturbs and updates
its own shard with its rows of z; the forwards all-gather the perturbed shards. Every rank runs as
many chunks as the busiest (`Algorithm.physical_batches`).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import List, Optional

import torch
from omegaconf import OmegaConf
from torch import nn

from dpbench.algorithms.learning_rates import lr_scale
from dpbench.runtime import distributed, sharding
from dpbench.algorithms.compute import FORWARD
from dpbench.algorithms.base import ALGORITHMS, DIRECTION, Algorithm, OwnDifferenceExamples, ReleasePart, StepResult
from dpbench.errors import UserError
from dpbench.models import FROM_SCRATCH_ATTRIBUTE, family_of
from dpbench.models.lora import inject_lora
from dpbench.options import AlgoOptions, LrFamily, choice_of
from dpbench.tasks import Batch

DIRECTIONS = ("gaussian", "sphere")  # N(0, I_d) (experiments) | uniform on sqrt(d) S^{d-1} (theory)
Direction = choice_of("Direction", DIRECTIONS, __name__)
# What the estimate perturbs: every trainable weight (full: the papers' experiments) or LoRA adapters
# and the head (lora: the reference code's MODE=lora, from MeZO); auto: full for a pretrained model,
# lora for a model trained from scratch (`trains_lora`)
MODES = ("auto", "full", "lora")
Mode = choice_of("Mode", MODES, __name__)


@dataclass
class ZerothOrderOptions(AlgoOptions):
    """DPZero's options (`algo=dpzero`), and the base of MeZO's and DPGD-0th's: two-point
    estimates along random directions."""

    name: str = "dpzero"
    default_lr: float = 1.0e-2  # conf/algo/dpzero.yaml says where these come from
    lr_family: LrFamily = LrFamily.zeroth_order
    default_steps: Optional[int] = 10_000
    default_batch_size: Optional[int] = 64
    smoothing: float = 1.0e-3
    direction: Direction = Direction.gaussian
    weight_decay: float = 0.0
    mode: Mode = Mode.auto  # a run stored before `mode` existed ran full (schema.PREDATING_VALUES)
    lora_rank: int = 8  # lora mode: LoRA r and alpha (the reference code's, from MeZO: 8, 16)
    lora_alpha: float = 16.0
    target_modules: Optional[List[str]] = None  # lora mode: null, the model family's LoRA targets
    train_modules: Optional[List[str]] = None  # lora mode: null, the family's head


def trains_lora(model: nn.Module, cfg) -> bool:
    """Whether a zeroth-order run trains LoRA adapters instead of every weight. auto: only a model
    built from scratch whose family declares LoRA targets. One random direction per step cannot
    train a random-init model's every weight (the estimate's variance grows with the dimension d;
    the papers fine-tune pretrained models, whose loss varies in few directions); LoRA and the head
    leave a few thousand."""
    mode = str(cfg.get("mode", "full"))
    if mode != "auto":
        return mode == "lora"
    family = family_of(model)
    return bool(getattr(model, FROM_SCRATCH_ATTRIBUTE, False) and family is not None and family.lora_targets)

SEED_RANGE = 2**62
SEED_STRIDE = 1_000_003  # per-parameter seeds: seed + index * stride (mod 2^63)


class ZerothOrderAlgorithm(Algorithm):
    """Two-point estimates along one public random direction per step; subclasses privatise them."""

    autocast_forward = False  # losses are evaluated in the model's own dtype
    libraries = ("peft",)  # algo.mode=lora's adapters
    # One-run canaries are examples with their own two-point difference: they join the estimate
    # after the batch's chunks and are clipped as every example is (`estimate`)
    canary_site = DIRECTION
    trained_modules_option = "train_modules"  # lora mode: trained in full beside the adapters
    last_direction: tuple[int, float] | None = None  # the last step's (seed, scale) of z: public, what the update moved along
    checkpoint_attributes = ("seed_generator", "perturbation_bytes")  # the public direction seeds

    @classmethod
    def forward_equivalents_per_example(cls, cfg, chunks: int) -> float:
        """Two forwards per example (at theta + lam z and theta - lam z), no backward."""
        return 2 * FORWARD

    def __init__(self, model, task, cfg, lr, privacy):
        self.mode = "lora" if trains_lora(model, cfg) else "full"
        auto = str(cfg.get("mode")) == "auto"
        if self.mode == "lora":
            weights = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())  # before the adapters
            if sharding.is_sharded(model):
                chose = " (auto's choice for a model built from scratch)" if auto else ""
                raise UserError(f"algo.mode=lora{chose} does not run sharded (train.sharding=fsdp); set algo.mode=full")
            model = inject_lora(model, OmegaConf.create({
                "name": cfg.name, "rank": cfg.lora_rank, "alpha": cfg.lora_alpha,
                "target_modules": cfg.get("target_modules"), "train_modules": cfg.get("train_modules")}))
        super().__init__(model, task, cfg, lr, privacy)
        unique: dict[int, nn.Parameter] = {}
        for p in model.parameters():
            if p.requires_grad:
                unique.setdefault(id(p), p)
        self.params = list(unique.values())
        if not self.params:
            raise UserError(f"algo={cfg.name} found no trainable parameter in the model")
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.dimension = sum(p.numel() for p in self.params)
        if self.mode == "lora" and auto:
            self.run_notes.append(f"algo.mode=auto: the model is built from scratch, so the estimate trains LoRA adapters "
                                  f"and the head ({self.dimension:,} weights; the model has {weights:,}); "
                                  "algo.mode=full perturbs every weight")
        self.smoothing = cfg.smoothing
        if not self.smoothing > 0:
            raise UserError(f"algo.smoothing (lambda) must be positive, got {cfg.smoothing}")
        self.direction = str(cfg.direction)  # a Direction: the schema admits only DIRECTIONS' names
        self.weight_decay = cfg.weight_decay
        # modules that directly own trainable parameters: where the perturbation hooks go
        self.owners: list[tuple[nn.Module, list[nn.Parameter]]] = []
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in self.index]
            if own:
                self.owners.append((module, own))
        # Direction seeds are public: drawn from a generator seeded by the experiment seed (through
        # the global torch RNG), so runs are reproducible; the DP noise never depends on them.
        self.seed_generator = torch.Generator()
        first_seed = int(torch.randint(0, SEED_RANGE, ()).item())
        self.seed_generator.manual_seed(first_seed)
        if self.sharded:  # every rank generates every direction whole: the seeds must be rank 0's
            distributed.check_same_as_rank_zero("direction seed", {"direction_seed": first_seed})
        self.perturbation_bytes = 0  # largest fp32 working set one module's perturbation held
        self.nonfinite_examples: torch.Tensor | None = None  # private runs: examples dropped (a tensor: no sync)

    # --- the direction -----------------------------------------------------------------------
    def next_seed(self) -> int:
        return int(torch.randint(0, SEED_RANGE, (), generator=self.seed_generator).item())

    def direction_part(self, p: nn.Parameter, seed: int) -> torch.Tensor:
        """Parameter p's block of the N(0, I) draw for this seed, fp32 (regenerated, never stored)."""
        generator = torch.Generator(device=p.device)
        generator.manual_seed((seed + self.index[id(p)] * SEED_STRIDE) % 2**63)
        return torch.randn(p.shape, generator=generator, device=p.device, dtype=torch.float32)

    def direction_scale(self, seed: int) -> float:
        """z = scale * N(0, I) draw: 1 for gaussian, sqrt(d)/||draw|| for the sphere (one extra pass)."""
        if self.direction == "gaussian":
            return 1.0
        # one host sync per step, not one per parameter
        squared = float(torch.stack([self.direction_part(p, seed).double().pow(2).sum() for p in self.params]).sum())
        # 0: a draw of probability 0, or a traced step's read (dpbench/tools/benchmarks/memory_trace.py)
        return math.sqrt(self.dimension / squared) if squared > 0 else 1.0

    def shard_direction(self, p: nn.Parameter, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's shard of p, its rows of p's direction block): the block generated whole
        from the seed, as in one process, then sliced (train.sharding=fsdp)."""
        return sharding.local(p), self.direction_part(p, seed)[sharding.local_rows(p)]

    @contextmanager
    def perturbed(self, seed: int, coefficient: float):
        """Within the block, every forward sees theta + coefficient * draw(seed); theta is untouched."""
        if self.sharded:
            with self._perturbed_shards(seed, coefficient) as touched:
                yield touched
            return
        active: dict[int, list] = {}  # id(p) -> [original data, nesting depth]
        touched: set[int] = set()

        def swap_in(module, _inputs, own=None):
            for p in own:
                key = id(p)
                if key in active:  # shared parameter already perturbed by an enclosing module
                    active[key][1] += 1
                    continue
                original = p.data
                perturbed = original.float() + coefficient * self.direction_part(p, seed)
                self.perturbation_bytes = max(self.perturbation_bytes, 2 * perturbed.numel() * 4)
                active[key] = [original, 1]
                p.data = perturbed.to(original.dtype)
                touched.add(key)

        def swap_out(module, _inputs, _output, own=None):
            for p in own:
                entry = active[id(p)]
                entry[1] -= 1
                if entry[1] == 0:
                    p.data = entry[0]
                    del active[id(p)]

        handles = []
        for module, own in self.owners:
            handles.append(module.register_forward_pre_hook(lambda m, i, own=own: swap_in(m, i, own)))
            handles.append(module.register_forward_hook(lambda m, i, o, own=own: swap_out(m, i, o, own)))
        try:
            yield touched
        finally:
            for handle in handles:
                handle.remove()
            for p in self.params:  # an exception mid-forward must not leave weights perturbed
                if id(p) in active:
                    p.data = active.pop(id(p))[0]

    @contextmanager
    def _perturbed_shards(self, seed: int, coefficient: float):
        """`perturbed` for a sharded model: each rank writes theta + coefficient * z into its own
        shards (its rows of z) before the forward, whose all-gathers then carry the perturbed
        weights, and copies the originals back after it (bit for bit: the originals are kept).
        Hooks on the modules would see FSDP2's gathered copies, not the shards. FSDP2 keeps the
        root's gathered parameters after a forward (for a backward): they are dropped on entry
        and on exit, so that no forward reads weights gathered under another perturbation."""
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        sharding.reshard(self.model)
        try:
            with torch.no_grad():
                largest = 0
                for p in self.params:
                    shard, z = self.shard_direction(p, seed)
                    saved.append((shard, shard.clone()))
                    shard.copy_(shard.float() + coefficient * z)  # one process's arithmetic, bit for bit
                    largest = max(largest, self.direction_part_bytes(p))
                self.perturbation_bytes = max(self.perturbation_bytes,
                                              largest + sum(o.numel() * o.element_size() for _, o in saved))
            yield {id(p) for p in self.params}
        finally:
            sharding.reshard(self.model)
            with torch.no_grad():
                for shard, original in saved:
                    shard.copy_(original)

    @staticmethod
    def direction_part_bytes(p: nn.Parameter) -> int:
        return 4 * p.numel()  # one parameter's whole fp32 block of z

    def finite_differences(self, batch: Batch, seed: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-example s_i = (l_i(theta + lam z) - l_i(theta - lam z)) / (2 lam) and mean losses, fp32 [B]."""
        step = self.smoothing * scale
        losses = []
        for coefficient in (step, -step):
            with self.perturbed(seed, coefficient) as touched:
                losses.append(self.per_example_losses(batch).float())  # counted there (algorithms/compute.py)
            if len(touched) != len(self.params):
                missed = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in touched]
                raise UserError(
                    f"zeroth-order perturbation missed parameters {missed[:3]}: they are read outside the "
                    "forward of the module that owns them; move them into a submodule (see models/vit.py)"
                )
        plus, minus = losses
        return (plus - minus) / (2 * self.smoothing), (plus + minus) / 2

    def estimate(self, batches: list[Batch], seed: int, scale: float, clip: float | None):
        """Sum over the logical batch of (clipped) s_i, the mean loss and the realised batch size.

        Clipped (private): an example whose s_i or loss is non-finite (a NaN or inf record)
        contributes nothing, selected away (0 · NaN is NaN); clamping an inf to ±C would add C.
        The mean loss is over the finite losses (nan only when none is), as LossTally's."""
        totals, count = [], 0  # double-precision sums on the device, synced once
        self.last_direction = (seed, scale)
        was_training = self.model.training
        self.model.eval()  # dropout off for both evaluations, as in MeZO/DPZero
        # a sharded model: no_grad (FSDP2's gathered parameters are reused outside inference mode)
        try:
            with torch.no_grad() if self.sharded else torch.inference_mode():
                # a sharded model runs as many chunks as the busiest rank (FSDP2's all-gathers are
                # collectives); a padding chunk's forwards run and contribute nothing
                for batch, padding in self.physical_batches(batches):
                    differences, losses = self.finite_differences(batch, seed, scale)
                    if padding:
                        continue
                    finite = torch.isfinite(losses)
                    if clip is not None:
                        differences = self.clip_differences(differences, finite, clip)
                    losses = torch.where(finite, losses, torch.zeros_like(losses))
                    totals.append(torch.stack([differences.double().sum(), losses.double().sum(), finite.double().sum()]))
                    count += differences.numel()
                # step hook: its examples join the estimate, clipped as the batch's (not tallied:
                # the reported loss and size are the batch's)
                for extra in self.step_hook.extra_examples(self) if self.step_hook is not None else []:
                    if not isinstance(extra, OwnDifferenceExamples):
                        raise TypeError(f"{type(self).__name__}'s step takes examples with their own two-point "
                                        f"differences, not {type(extra).__name__}")
                    differences = extra.per_sample_differences().float()
                    differences = self.clip_differences(differences, torch.ones_like(differences, dtype=torch.bool), clip)
                    totals.append(torch.stack([differences.double().sum(), *differences.new_zeros(2, dtype=torch.float64)]))
        finally:
            self.model.train(was_training)
        total, loss_total, finite_count = torch.stack(totals).sum(dim=0).tolist() if totals else (0.0, 0.0, 0.0)
        return total, (loss_total / finite_count if finite_count else float("nan")), count

    def clip_differences(self, differences: torch.Tensor, finite_losses: torch.Tensor, clip: float) -> torch.Tensor:
        """min(1, C/|s_i|) s_i per example (DPZero's clip); an example whose s_i or loss is
        non-finite is replaced by 0, not scaled, and counted in `nonfinite_examples`."""
        kept = finite_losses & torch.isfinite(differences)
        dropped = (~kept).sum()
        self.nonfinite_examples = dropped if self.nonfinite_examples is None else self.nonfinite_examples + dropped
        return torch.where(kept, differences.clamp(-clip, clip), torch.zeros_like(differences))

    def apply_update(self, seed: int, scale: float, projected_gradient: float) -> None:
        """theta <- theta - lr (g z + wd theta), parameter by parameter, in fp32 then cast."""
        with torch.no_grad():
            for p in self.params:
                # a sharded model: this rank's shard, with its rows of z (generated whole from the seed)
                target, z = self.shard_direction(p, seed) if self.sharded else (p, self.direction_part(p, seed))
                update = z.mul_(projected_gradient * scale)
                if self.weight_decay and p.ndim >= 2:  # MeZO/OPT: no decay on biases and norms
                    update.add_(target.float(), alpha=self.weight_decay)
                lr = self.lr * lr_scale(p)  # train.head_lr_scale (learning_rates.py)
                if target.dtype == torch.float32:
                    target.sub_(update, alpha=lr)
                else:
                    target.copy_(target.float().sub_(update, alpha=lr))

    def optimizer_state_bytes(self) -> int:
        return 0  # plain SGD along z: the only state is the next seed

    def extra_results(self) -> dict:
        return {
            "mode": self.mode,
            "smoothing": self.smoothing,
            "direction": self.direction,
            "dimension": self.dimension,
            "weight_decay": self.weight_decay,
            "perturbation_working_bytes": self.perturbation_bytes,
        }


@ALGORITHMS.register("dpzero", options=ZerothOrderOptions)
class DPZero(ZerothOrderAlgorithm):
    """Per-example scalar clipping to [-C, C], one scalar Gaussian noise per step (sensitivity C)."""

    # train.sharding=fsdp: the scalar is released replicated; each rank perturbs its rows with its rows of z
    shardable = True

    def privatize(self, clipped_sum: float) -> float:
        """The clipped scalar sum (sensitivity C) plus N(0, (sigma C)^2), divided by B."""
        p = self.privacy
        total = torch.tensor(clipped_sum, dtype=torch.float64, device=p.noise.device)
        ((noisy,),) = self.gaussian_release("projected_gradient", ReleasePart([total], p.clip_norm, p.noise_multiplier * p.clip_norm))
        return float(noisy) / p.expected_batch_size

    def step(self, batches: list[Batch], step_index: int) -> StepResult:
        seed = self.next_seed()
        scale = self.direction_scale(seed)
        clipped_sum, loss, count = self.estimate(batches, seed, scale, clip=self.privacy.clip_norm)
        # an empty Poisson batch still releases (pure) noise and moves along z
        self.apply_update(seed, scale, self.privatize(clipped_sum))
        return StepResult(loss, count)
