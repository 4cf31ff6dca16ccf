"""The trained model a run keeps: model.safetensors, written once epsilon is final, rebuilt by
load_model / dpbench-evaluate to the run's own final test figures; tied weights stored once; frozen
parts of a base checkpoint named by SHA-256 instead of stored."""

from __future__ import annotations

import json

import pytest
import torch
from omegaconf import OmegaConf
from helpers.config import FIXED_SIGMA, TINY, compose
from safetensors import safe_open

from dpbench.runtime.checkpoint import CHECKPOINT_FILE
from dpbench.errors import UserError
from dpbench.run import run_job
from dpbench.saved_model import MODEL_FILE, load_weights, read_header, save_model

STEPS = ["train.steps=4", "train.eval_every=2"]


def test_a_run_keeps_its_model_and_evaluating_it_again_gives_the_final_test_figures(tmp_path, capsys):
    from dpbench.api import load_model
    from dpbench.api import rebuild
    from dpbench.tools import evaluate

    results = run_job(compose(TINY + STEPS + FIXED_SIGMA + ["algo=dpsgd"]), tmp_path, show_progress=False)
    assert (tmp_path / MODEL_FILE).is_file() and not (tmp_path / CHECKPOINT_FILE).exists()
    assert read_header(tmp_path / MODEL_FILE)["config"] == results.config
    job = rebuild(tmp_path)
    again = job.task.evaluate(job.model)
    assert again["accuracy"] == results.metrics.test_accuracy and again["loss"] == results.metrics.test_loss
    model = load_model(tmp_path)
    for name, value in model.state_dict().items():
        assert torch.equal(value, job.model.state_dict()[name]), name
    capsys.readouterr()
    assert evaluate.main([str(tmp_path)]) == 0
    assert f"test acc {results.metrics.test_accuracy:.4f}" in capsys.readouterr().out
    assert evaluate.main([str(tmp_path), "train.lr=1"]) == 2  # the weights depend on it: refused in one line
    assert "only dataset.*, device, threads and model.path" in capsys.readouterr().err
    assert evaluate.main([str(tmp_path / "nope")]) == 2


class Tied(torch.nn.Module):
    """An embedding whose transpose is the output layer (a language model's tied head), one frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(5, 3)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(3, 5, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("count", torch.tensor([7.0]))


def _saved(model, tmp_path, model_cfg: dict):
    cfg = OmegaConf.create({"model": {**model_cfg, "name": "tied"}})  # what save_model reads of a run's config
    save_model(model, cfg, {"model": {"name": "tied"}}, tmp_path)
    return tmp_path / MODEL_FILE


def test_tied_weights_are_stored_once_and_come_back_tied(tmp_path):
    torch.manual_seed(0)
    trained, fresh = Tied(), Tied()
    path = _saved(trained, tmp_path, {})
    with safe_open(str(path), framework="pt") as handle:
        assert sorted(handle.keys()) == ["count", "embed.weight", "frozen.bias", "frozen.weight"]
    assert read_header(path)["aliases"] == {"head.weight": "embed.weight"}
    load_weights(fresh, tmp_path)
    assert fresh.head.weight is fresh.embed.weight
    for name, value in trained.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[name]), name


def test_frozen_parts_of_a_base_checkpoint_are_named_by_hash_not_stored(tmp_path):
    base = tmp_path / "base.bin"
    base.write_bytes(b"pretrained weights")
    trained, fresh = Tied(), Tied()
    fresh.frozen.load_state_dict(trained.frozen.state_dict())  # the base checkpoint rebuilds them
    path = _saved(trained, tmp_path, {"path": str(base)})
    with safe_open(str(path), framework="pt") as handle:
        assert "frozen.weight" not in handle.keys()
    assert read_header(path)["base"]["path"] == str(base)
    load_weights(fresh, tmp_path)
    assert torch.equal(fresh.embed.weight, trained.embed.weight)
    other = Tied()  # frozen parts that differ from the trained model's: refused
    with pytest.raises(UserError, match="frozen"):
        load_weights(other, tmp_path)
    base.write_bytes(b"another checkpoint")
    with pytest.raises(UserError, match="SHA-256"):
        load_weights(fresh, tmp_path)


def test_the_model_is_written_after_epsilon_is_final_and_never_by_a_run_that_stops(tmp_path, monkeypatch):
    import dpbench.run as run_module
    from dpbench import saved_model
    from dpbench.algorithms import Algorithm

    cfg = compose(TINY + STEPS + FIXED_SIGMA + ["algo=dpsgd", "dataset.validation_fraction=0.2"])
    original = Algorithm.train_step

    def dies(self, batches, step_index):
        if step_index == 3:
            raise RuntimeError("killed")
        return original(self, batches, step_index)

    with monkeypatch.context() as patch:
        patch.setattr(Algorithm, "train_step", dies)
        with pytest.raises(RuntimeError, match="killed"):
            run_job(cfg, tmp_path, show_progress=False)
    assert (tmp_path / CHECKPOINT_FILE).is_file() and not (tmp_path / MODEL_FILE).exists()

    order, save = [], saved_model.save_model
    record = run_module.record

    def recorded(job, trainer, *args, **kwargs):
        results = record(job, trainer, *args, **kwargs)
        order.append(("record", len(trainer.state.ledger.as_records()), results.privacy.epsilon))
        return results

    def saving(model, cfg, config, run_dir):
        order.append(("save", (run_dir / "results.json").exists()))
        return save(model, cfg, config, run_dir)

    monkeypatch.setattr(run_module, "record", recorded)
    monkeypatch.setattr(saved_model, "save_model", saving)
    results = run_job(cfg, tmp_path, show_progress=False)  # resumed from step 2
    # the ledger holds the validation score's release, epsilon is computed, then the model is written
    assert [o[0] for o in order] == ["record", "save"] and order[0][1] == 2 and order[0][2] == results.privacy.epsilon
    assert results.resumed_from_step == 2 and (tmp_path / MODEL_FILE).is_file()
    assert json.loads((tmp_path / "results.json").read_text())["privacy"]["epsilon"] == results.privacy.epsilon


def test_save_model_false_keeps_none(tmp_path):
    run_job(compose(TINY + ["algo=adam", "train.steps=1", "train.save_model=false"]), tmp_path, show_progress=False)
    assert (tmp_path / "results.json").is_file() and not (tmp_path / MODEL_FILE).exists()
