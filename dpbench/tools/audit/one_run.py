"""One-run privacy auditing (Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run",
NeurIPS 2023): an empirical LOWER bound on epsilon from a single training run.

    dpbench-audit algo=dpsgd audit.one_run=true audit.canaries=1000 privacy.epsilon=2

m canaries are each included with probability 1/2 (fresh OS entropy); the run trains once; each
canary is scored, the G/2 highest scores are guessed "in" and the G/2 lowest "out", and v of the G
guesses are right; `one_run_bound.epsilon_lower_bound` is the largest epsilon that v refutes.
A bound above the claimed epsilon is a bug. Where the canaries enter is the algorithm's declaration
(`canary_site`, read from its class; one_run_canaries.py says what each site sees). The verdict
scores each canary from the iterates; the same guesses from the released values are reported beside.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import torch

from dpbench.algorithms.base import DIRECTION, EXAMPLES
from dpbench.errors import UserError
from dpbench.tools.audit.report import AuditReport, Check
from dpbench.tools.audit.one_run_bound import Guesses, ceiling, epsilon_lower_bound, one_run_p_value  # noqa: F401 (the audit's names)
from dpbench.tools.audit.one_run_canaries import (  # noqa: F401
    BlankRecords, Canaries, CanaryHook, Schedule, add_canary_layer,
)


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

KIND_WORDS = {"example": "example (clipped by the run)", "signed": "signed example (clipped by the run, along z)",
              "input": "mislabeled input"}


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
    canary_kind: str = "example"  # example | signed | input
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


def canary_site(cfg) -> str | None:
    """Where the configured algorithm's canaries enter (its class's `canary_site` declaration)."""
    from dpbench.algorithms import algorithm_class

    name = str(cfg.algo.name)
    algo_cls = algorithm_class(name)
    if not algo_cls.private:
        raise UserError(f"audit.one_run=true audits private algorithms; algo={name} is not private")
    if str(cfg.train.get("sharding", "none")) != "none":
        raise UserError("audit.one_run=true runs unsharded: drop train.sharding (the canaries read whole tensors)")
    if str(cfg.audit.get("canary", "gradient")) == "input":
        return None  # mislabeled training records: no site needed
    if algo_cls.canary_site is None:
        raise UserError(f"audit.one_run=true: algo={name} declares no canary_site (dpbench/algorithms/base.py); "
                        "use audit.canary=input or the self-audit (audit.one_run=false)")
    return algo_cls.canary_site


def _canaries(site: str, job, count: int, cfg, neighboring: str) -> Canaries:
    from dpbench.privacy.sampling import batches_per_epoch

    if site == DIRECTION and count > max(2, job.steps // 10):
        raise UserError(f"audit.canaries={count} is too many for algo={cfg.algo.name}'s one-dimensional release "
                        f"over {job.steps} steps: at most about T/10 = {max(2, job.steps // 10)} signed canaries; lower it")
    space = [torch.Size([count, 1])] if site == EXAMPLES else [torch.Size([])]
    return Canaries(space, count, job.privacy.setup.sample_rate, batches_per_epoch(cfg, job.task.planning_size),
                    neighboring, int(cfg.seed), signed=site == DIRECTION, own_space=site == EXAMPLES)


def one_run_audit(cfg) -> OneRunReport:
    """Train the configured run once with canaries and bound its epsilon from below."""
    from omegaconf import OmegaConf

    from dpbench.logging.wandb_logger import build_logger
    from dpbench.run import fit, setup

    count, guesses, confidence = one_run_options(cfg)
    black_box = str(cfg.audit.get("canary", "gradient")) == "input"
    site = canary_site(cfg)
    if cfg.get("threads"):  # as `dpbench` runs the job (run_job)
        torch.set_num_threads(int(cfg.threads))
    cfg = cfg.copy()  # an audit's report is published: it trains without un-noised statistics (docs/results.md)
    OmegaConf.update(cfg, "privacy.log_private_stats", False, force_add=True)
    layers = []
    if site == EXAMPLES:  # the canaries' own layer joins the model before the algorithm is built
        job = setup(cfg, prepare_model=lambda model: layers.append(add_canary_layer(model, count, cfg.algo)))
    elif site == DIRECTION:  # the real records are blanked: they would drown the canaries along z
        job = setup(cfg, prepare_task=BlankRecords)
    else:
        job = setup(cfg)
    setup_ = job.privacy.setup
    neighboring = str(cfg.privacy.get("neighboring", "add_remove"))
    if black_box:
        marks = job.task = InputCanaryTask(job.task, count, neighboring, int(cfg.seed))
        kind = "input"
    else:
        marks = _canaries(site, job, count, cfg, neighboring)
        CanaryHook.attach(marks, job.algorithm, layers[0] if layers else None)
        kind = {EXAMPLES: "example", DIRECTION: "signed"}[site]
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
        "one_run", f"{count} {KIND_WORDS[kind]} canaries",
        bound, claimed, bound <= claimed,
        f"eps lower bound {bound:.3f} {seen} (ceiling {top:.3f} for m={count}, r={guesses}) vs the reported eps "
        f"{claimed:.3f}: {correct}/{guesses} guesses right{beside}; {marks.included.sum()} canaries included, "
        f"{trainer.state.step} steps, q {setup_.sample_rate:.4g}, sigma {setup_.noise_multiplier:.4g}, "
        f"confidence {confidence:g}, delta {delta:g}",
    )
    return OneRunReport(cfg.algo.name, cfg.model.name, cfg.dataset.name, [check], result)
