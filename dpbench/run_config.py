"""The composed config of one run: its values checked before anything expensive happens, and the
plain-data form of it that results.json, checkpoints and W&B store."""

from __future__ import annotations

import contextvars
import math

from omegaconf import DictConfig, OmegaConf

from dpbench.data.validation import validation_fraction
from dpbench.errors import UserError
from dpbench.options import DEFAULT_EPSILON, target_epsilon  # noqa: F401  (the rule lives in the leaf)
from dpbench.logging.console import console
from dpbench.models.user import check_builders
from dpbench.models.zero_shot_head import check_head_init
from dpbench.preflight import check_device, check_threads
from dpbench.schema import check_keys, preset_fallbacks


def validate(cfg: DictConfig, grid: bool | None = None) -> None:
    """Reject bad input before anything expensive happens, with the fix in the message. Types and
    choices were checked by Hydra against dpbench/schema.py while it composed; here: values.
    `grid`: whether the job is a point of a grid (None: whether Hydra runs a multirun)."""
    for note in [*check_keys(cfg), *preset_fallbacks(cfg)]:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    p, t = cfg.privacy, cfg.train
    check_privacy_choice(cfg, in_grid() if grid is None else grid)
    if p.epsilon is not None and not p.epsilon > 0:
        raise UserError(f"privacy.epsilon must be positive, got {p.epsilon}; or set privacy.noise_multiplier")
    if p.noise_multiplier is not None and not p.noise_multiplier > 0:
        raise UserError(f"privacy.noise_multiplier must be positive, got {p.noise_multiplier}")
    if p.delta is None or not 0 < p.delta < 1:
        raise UserError(f"privacy.delta must lie strictly between 0 and 1, got {p.delta}")
    if p.clip_norm is None or not p.clip_norm > 0:
        raise UserError(f"privacy.clip_norm must be positive, got {p.clip_norm}")
    if not p.get("clipping_gamma", 0.01) > 0:  # automatic / psac divide by norm + gamma: <= 0 breaks the bound C
        raise UserError(f"privacy.clipping_gamma must be positive (the stability constant of automatic and psac "
                        f"clipping), got {p.clipping_gamma}")
    if str(p.get("per_layer_thresholds", "equal")) != "equal" and str(p.clipping) != "per_layer":
        console.print(f"[yellow]note:[/] privacy.per_layer_thresholds={p.per_layer_thresholds} is read only by "
                      f"privacy.clipping=per_layer, not by privacy.clipping={p.clipping}", soft_wrap=True)
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
    if t.eval_every < 0:
        raise UserError(f"train.eval_every must be >= 0 (0: evaluate the final model only), got {t.eval_every}")
    check_threads(cfg)
    if not t.lr > 0:
        raise UserError(f"train.lr must be positive, got {t.lr}")
    if not t.get("head_lr_scale", 1.0) > 0:
        raise UserError(f"train.head_lr_scale must be positive (1: the head learns at train.lr), got {t.head_lr_scale}")
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
    check_device(cfg)
    check_builders(cfg)  # model.builder / dataset.builder: importable, before any work
    check_head_init(cfg)  # model.head_init=zero_shot: a text encoder and the data set's label descriptions


# The target when neither privacy.epsilon nor privacy.noise_multiplier is given (conf/config.yaml):
# a default in code, not in the YAML, so that a given epsilon and a given sigma can be told apart.
def _names(private: bool) -> str:
    from dpbench.algorithms import ALGORITHMS, algorithm_class

    return ", ".join(f"algo={n}" for n in ALGORITHMS.names() if algorithm_class(n).private is private)


API_GRID = contextvars.ContextVar("dpbench_api_grid", default=False)  # set by dpbench.api.grid


def in_grid() -> bool:
    """Whether this job is one of a Hydra multirun (a grid or a search) or of `dpbench.api.grid`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return API_GRID.get() or (HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN)


def check_privacy_choice(cfg: DictConfig, grid: bool) -> None:
    """One rule each, so that no privacy setting is silently ignored: sigma and epsilon both given
    (by the command, the Python call or a preset: the YAML default of both is null) is refused; a
    budget with a non-private algorithm is refused (in a grid over algorithms it is the private
    jobs' budget: noted); epsilon = inf is refused (a non-private algorithm is the honest name)."""
    from dpbench.algorithms import algorithm_class

    p = cfg.privacy
    if p.epsilon is not None and p.noise_multiplier is not None:
        raise UserError(f"privacy.epsilon={p.epsilon:g} and privacy.noise_multiplier={p.noise_multiplier:g} both set the "
                        "noise: give one (privacy.epsilon calibrates sigma; privacy.noise_multiplier fixes sigma and "
                        "epsilon is computed), and set the other to null if a preset gave it")
    if not algorithm_class(cfg.algo.name).private:
        given = [f"privacy.{k}={p[k]:g}" for k in ("epsilon", "noise_multiplier") if p[k] is not None]
        if not given:
            return
        if grid:  # a grid over algorithms shares its privacy keys: they are the private jobs'
            console.print(f"[yellow]note:[/] algo={cfg.algo.name} is not private: {given[0]} does not apply to it",
                          soft_wrap=True)
            return
        raise UserError(f"algo={cfg.algo.name} is not private, so {given[0]} would be ignored: drop it for a "
                        f"non-private run, or pick a private algorithm ({_names(private=True)})")
    if p.epsilon is not None and math.isinf(p.epsilon):
        raise UserError(f"privacy.epsilon={p.epsilon:g} is no privacy guarantee: for non-private training use a "
                        f"non-private algorithm ({_names(private=False)}), e.g. algo=adam")


DEFAULT_OPTIMIZE = "test_accuracy"  # dpbench.options.Config.optimize


def names_test_metric(cfg: DictConfig) -> bool:
    """Whether `optimize` names a test-set metric (test_accuracy, -test_loss, best_test_accuracy, ...)."""
    key = str(cfg.get("optimize") or DEFAULT_OPTIMIZE).lstrip("-")
    return key.startswith(("test_", "best_test_"))


def resolved_config(cfg: DictConfig) -> dict:
    """The config as plain data (choices as their strings): what results.json, checkpoints and
    W&B store and what resume compares. A private run's privacy.epsilon is the target its sigma
    was calibrated to (DEFAULT_EPSILON when neither it nor sigma was given), as runs stored it before
    the default moved out of the YAML; a non-private run records neither (a grid's epsilon is its
    private jobs'), so that its stored config passes `validate` when the model is rebuilt."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    _privacy_as_run(plain, cfg)
    return plain


def _privacy_as_run(plain: dict, cfg: DictConfig) -> None:
    from dpbench.algorithms import algorithm_class

    privacy, algo = plain.get("privacy"), (plain.get("algo") or {}).get("name")
    if not (isinstance(privacy, dict) and "epsilon" in privacy and algo):
        return  # a hand-made config (tests)
    if algorithm_class(algo).private:
        privacy["epsilon"] = target_epsilon(cfg)
    else:
        privacy.update(epsilon=None, noise_multiplier=None)


def stored_config(config: dict) -> DictConfig:
    """A config as results.json stored it, readable by today's checks: runs stored before sigma and
    epsilon were exclusive hold the old default epsilon beside a fixed sigma (which they ignored),
    and non-private runs the old default epsilon."""
    cfg = OmegaConf.create(config)
    privacy = cfg.get("privacy")
    if privacy is not None and privacy.get("noise_multiplier") is not None:
        privacy.epsilon = None
    if privacy is not None and cfg.get("algo") is not None:
        plain = OmegaConf.to_container(cfg, resolve=True)
        _privacy_as_run(plain, cfg)
        cfg = OmegaConf.create(plain)
    return cfg
