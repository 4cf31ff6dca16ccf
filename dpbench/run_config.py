"""The composed config of one run: its values checked before anything expensive happens, and the
plain-data form of it that results.json, checkpoints and W&B store."""

from __future__ import annotations

import torch
from omegaconf import DictConfig, OmegaConf

from dpbench.data.validation import validation_fraction
from dpbench.errors import UserError
from dpbench.logging.console import console
from dpbench.schema import check_keys


def validate(cfg: DictConfig) -> None:
    """Reject bad input before anything expensive happens, with the fix in the message. Types and
    choices were checked by Hydra against dpbench/schema.py while it composed; here: values."""
    for note in check_keys(cfg):
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    p, t = cfg.privacy, cfg.train
    if p.noise_multiplier is None:
        if p.epsilon is None or not p.epsilon > 0:
            raise UserError(f"privacy.epsilon must be positive, got {p.epsilon}; or set privacy.noise_multiplier")
    elif not p.noise_multiplier > 0:
        raise UserError(f"privacy.noise_multiplier must be positive, got {p.noise_multiplier}")
    if p.delta is None or not 0 < p.delta < 1:
        raise UserError(f"privacy.delta must lie strictly between 0 and 1, got {p.delta}")
    if p.clip_norm is None or not p.clip_norm > 0:
        raise UserError(f"privacy.clip_norm must be positive, got {p.clip_norm}")
    if not t.batch_size or t.batch_size <= 0:
        raise UserError(f"train.batch_size must be a positive integer, got {t.batch_size}")
    if t.physical_batch_size is not None and not 0 < t.physical_batch_size <= t.batch_size:
        raise UserError(
            f"train.physical_batch_size={t.physical_batch_size} must lie in 1..train.batch_size={t.batch_size}"
        )
    if t.steps is None and (t.epochs is None or t.epochs <= 0):
        raise UserError("set train.steps or a positive train.epochs")
    if t.steps is not None and t.steps < 0:
        raise UserError(f"train.steps must be >= 0, got {t.steps}")
    if not t.lr > 0:
        raise UserError(f"train.lr must be positive, got {t.lr}")
    if t.get("checkpoint_every") is not None and t.checkpoint_every < 1:
        raise UserError(f"train.checkpoint_every must be >= 1 or null (no periodic checkpoints), got {t.checkpoint_every}")
    fraction = validation_fraction(cfg.dataset)  # in [0, 1), or a one-line error
    sigma_v = p.get("validation_noise_multiplier", 10.0)
    if fraction > 0 and (sigma_v is None or not sigma_v > 0):
        raise UserError(f"privacy.validation_noise_multiplier must be positive, got {sigma_v}")
    if str(p.get("validation_composition", "sequential")) == "parallel" and str(p.neighboring) != "add_remove":
        raise UserError("privacy.validation_composition=parallel needs privacy.neighboring=add_remove: under replace-one "
                        "a replaced record can leave the training part for the validation part, so both releases read "
                        "it; use validation_composition=sequential")
    # optimize left at its default means the validation score when there is a split (dpbench.cli.objective)
    selects_validation = fraction > 0 and str(cfg.get("optimize") or DEFAULT_OPTIMIZE) == DEFAULT_OPTIMIZE
    if not t.get("evaluate_test", True) and names_test_metric(cfg) and not selects_validation:
        raise UserError(f"optimize={cfg.get('optimize')} is a test metric but train.evaluate_test=false evaluates no test "
                        "set; set dataset.validation_fraction > 0 (optimize=validation_score), or train.evaluate_test=true")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise UserError("device=cuda but no CUDA GPU is visible; use device=cpu or device=auto")


DEFAULT_OPTIMIZE = "test_accuracy"  # dpbench.options.Config.optimize


def names_test_metric(cfg: DictConfig) -> bool:
    """Whether `optimize` names a test-set metric (test_accuracy, -test_loss, best_test_accuracy, ...)."""
    key = str(cfg.get("optimize") or DEFAULT_OPTIMIZE).lstrip("-")
    return key.startswith(("test_", "best_test_"))


def resolved_config(cfg: DictConfig) -> dict:
    """The config as plain data (choices as their strings): what results.json, checkpoints and
    W&B store and what resume compares."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
