"""A trial's planned ledger and privacy event, as the trial's own run will plan them."""

from __future__ import annotations

from omegaconf import DictConfig, open_dict

from dpbench.errors import UserError
from dpbench.study import accounting


class TrialPlanner:
    """Plans a trial's privacy the way dpbench.run.setup does (train size, steps, plan_privacy),
    without building its model: the ledger its run will record, at a given noise multiplier."""

    def __init__(self, base: DictConfig) -> None:
        import torch

        from dpbench.algorithms import algorithm_class
        from dpbench.run_config import validate
        from dpbench.tasks import build_task

        validate(base)  # the job's own input checks, one line each
        if not algorithm_class(base.algo.name).private:
            raise UserError(f"private_search studies private training; algo={base.algo.name} is not private")
        if not float(base.dataset.get("validation_fraction", 0) or 0) > 0:
            raise UserError("private_search selects trials by their noisy validation score: set "
                            "dataset.validation_fraction (e.g. 0.2); the test set is never a search's objective")
        # the public planning size n(1 - f) sets the sample rate (q = B / n(1 - f)); dataset keys
        # are never swept, so it is one for all trials
        self.train_size = build_task(base, torch.device("cpu")).planning_size

    def _plan(self, cfg: DictConfig, noise_multiplier: float, score_noise_multiplier: float | None = None):
        import torch

        from dpbench.algorithms import algorithm_class
        from dpbench.privacy.plan import plan_privacy
        from dpbench.run import planned_steps

        cfg = cfg.copy()
        with open_dict(cfg):
            cfg.privacy.noise_multiplier = float(noise_multiplier)
            if score_noise_multiplier is not None:
                cfg.privacy.validation_noise_multiplier = float(score_noise_multiplier)
        steps = planned_steps(cfg, self.train_size)
        return plan_privacy(cfg, algorithm_class(cfg.algo.name), self.train_size, steps, torch.device("cpu")), steps

    def ledger(self, cfg: DictConfig, noise_multiplier: float, score_noise_multiplier: float | None = None):
        plan, steps = self._plan(cfg, noise_multiplier, score_noise_multiplier)
        return plan.planned_ledger(steps, final=True)  # training, then the noisy validation score

    def event(self, cfg: DictConfig, noise_multiplier: float, score_noise_multiplier: float | None = None):
        """The trial's privacy event: training and its noisy validation score, composed as the run
        composes them (privacy.validation_composition: sequential, or parallel: accounting.ParallelEvent)."""
        plan, steps = self._plan(cfg, noise_multiplier, score_noise_multiplier)
        if plan.parallel_final:
            return accounting.parallel_trial_event(plan.planned_ledger(steps), plan.validation_noise_multiplier)
        return accounting.trial_event(plan.planned_ledger(steps, final=True))
