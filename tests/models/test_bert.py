"""BERT-family sentence classification (model=minilm's family) on a tiny random BERT written in the
real on-disk format and a tiny corpus in the Rotten Tomatoes layout: the per-example engines
against one-example-at-a-time autograd (float64), the family record, freezing, and one step of
each algorithm family end to end."""

from __future__ import annotations

import pytest
import torch
from helpers.config import FIXED_SIGMA, OFFLINE, compose
from helpers.tiny_bert import tiny_bert_cfg, write_corpus, write_tiny_bert

from dpbench.errors import UserError
from dpbench.models import family_of
from dpbench.privacy.engines import PER_SAMPLE_ENGINES, build_engine
from dpbench.tasks import build_task
from dpbench.tasks.sentence_classification import SentenceClassificationTask

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_bert")
    return write_tiny_bert(folder / "model"), write_corpus(folder / "corpus.csv.bz2")


@pytest.mark.parametrize("pooling", ["mean", pytest.param("pooler", marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", PER_SAMPLE_ENGINES.names())
def test_engines_match_per_example_autograd_in_float64(files, mode, pooling):
    """Every layer trains (embeddings too): each engine's per-example norms and its clipped sum
    Σ f_i g_i equal autograd's on each example alone. Padded batch: the pads must not count."""
    cfg = tiny_bert_cfg(files, "model.freeze_embeddings=false", "model.trained_blocks=null", f"model.pooling={pooling}")
    task = build_task(cfg, CPU)
    torch.manual_seed(0)
    model = task.build_model(cfg.model).double().train()
    params = [p for p in model.parameters() if p.requires_grad]
    assert len(params) == sum(1 for _ in model.parameters())
    lengths = [len(task.train_ids[i]) for i in range(len(task.train_ids))]
    indices = [lengths.index(min(lengths)), lengths.index(max(lengths)), 1]  # the shortest one is padded
    assert min(lengths) < max(lengths)
    reference = [torch.autograd.grad(task.per_sample_loss(model, task.batch([i])).sum(), params) for i in indices]
    expected_norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in grads)) for grads in reference])
    factors = torch.tensor([0.25, 1.0, 0.5], dtype=torch.float64)
    seen = []

    def factors_fn(norms):
        seen.append(norms.detach().clone())
        return factors.to(norms)

    engine = build_engine(mode, model, unprobed=True)
    try:
        sums = engine.clipped_sum(task.per_sample_loss(model, task.batch(indices)), factors_fn)
    finally:
        engine.detach()
    torch.testing.assert_close(seen[0].double(), expected_norms, rtol=1e-5, atol=1e-9)
    expected = [sum(f * grads[position] for f, grads in zip(factors, reference)) for position in range(len(params))]
    # the engines sum in fp32: rounding is relative to the call's largest entry (some tensors, like
    # the attention keys' biases, have a gradient that is zero up to float64 rounding)
    scale = max(float(e.abs().max()) for e in expected)
    for actual, wanted in zip(sums, expected):
        torch.testing.assert_close(actual.double(), wanted, rtol=1e-5, atol=1e-6 * scale)


def test_family_record_freezing_and_split(files):
    cfg = tiny_bert_cfg(files, "model.trained_blocks=1")
    task = build_task(cfg, CPU)
    assert isinstance(task, SentenceClassificationTask)
    model = task.build_model(cfg.model)
    family = family_of(model)
    assert family.language_task == "sentence_classification" and family.model_type == "bert"
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(("bert.encoder.layer.1.", "classifier.")) for n in trained)
    assert {"classifier.weight", "classifier.bias"} <= trained
    from dpbench.algorithms.projected_adam import select_projected_modules

    # DP-GRAPE projects the trained block's Linears only (frozen ones have no gradient to project)
    assert sorted(select_projected_modules(model, None)) == sorted(
        f"bert.encoder.layer.1.{n}" for n in ("attention.self.query", "attention.self.key", "attention.self.value",
                                             "attention.output.dense", "intermediate.dense", "output.dense"))
    # No functorch path: transformers' BERT mask code is not vmap-compatible, and no layer needs it
    # (every module the engines hook has a rule or an Opacus grad sampler), embeddings trained too.
    from dpbench.privacy.layers import by_functorch, hooked_modules

    everything = task.build_model(tiny_bert_cfg(files, "model.freeze_embeddings=false", "model.trained_blocks=null").model)
    hooked = hooked_modules(everything, {})
    assert {type(m).__name__ for m in hooked} == {"Linear", "Embedding", "LayerNorm"}
    assert not [m for m in hooked if by_functorch(m)]
    embeddings_only = task.build_model(tiny_bert_cfg(files).model)  # the default: embeddings frozen, every layer trained
    frozen = {n for n, p in embeddings_only.named_parameters() if not p.requires_grad}
    assert frozen == {n for n, _ in embeddings_only.named_parameters() if n.startswith("bert.embeddings.")}
    with pytest.raises(UserError, match=r"model.trained_blocks=3 must lie in 0..2"):
        task.build_model(tiny_bert_cfg(files, "model.trained_blocks=3").model)
    with pytest.raises(UserError, match="model.pooling=cls is not known"):
        task.build_model(tiny_bert_cfg(files, "model.pooling=cls").model)


@pytest.mark.parametrize("pooling", ["mean", pytest.param("pooler", marks=pytest.mark.slow)])
def test_cached_frozen_part_gives_the_uncached_logits_and_gradients(files, pooling):
    """model.cache_frozen: the top k layers and the head on the cached lower part compute what the
    whole encoder computes (eval mode: the cache is taken without dropout), gradients included, for
    k = 0 (the probe) .. L; a padded batch; the float64 copy (the layout probe's) shares the cache."""
    import copy

    task = build_task(tiny_bert_cfg(files), CPU)
    indices = [0, 1, 2, 3]
    batch = task.batch(indices)
    assert int(batch.attention_mask.sum(dim=1).min()) < batch.attention_mask.shape[1]  # padded
    for k in (0, 1, 2):
        cfg = tiny_bert_cfg(files, f"model.trained_blocks={k}", f"model.pooling={pooling}")
        torch.manual_seed(0)
        cached = task.build_model(cfg.model).eval()
        assert cached.prefix_cache is not None and cached.prefix_cache.depth == 2 - k
        torch.manual_seed(0)
        plain = task.build_model(tiny_bert_cfg(files, f"model.trained_blocks={k}", f"model.pooling={pooling}",
                                          "model.cache_frozen=false").model).eval()
        assert plain.prefix_cache is None
        got, want = cached(batch.input_ids, batch.attention_mask), plain(batch.input_ids, batch.attention_mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        trained = [p for p in cached.parameters() if p.requires_grad]
        assert len(trained) == len([p for p in plain.parameters() if p.requires_grad])
        for a, b in zip(torch.autograd.grad(got.square().sum(), trained),
                        torch.autograd.grad(want.square().sum(), [p for p in plain.parameters() if p.requires_grad])):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
        double = copy.deepcopy(cached).double()
        assert double.prefix_cache is cached.prefix_cache
        torch.testing.assert_close(double(batch.input_ids, batch.attention_mask).float(), want, rtol=1e-4, atol=1e-5)
    # the whole task's sentences were computed once, on the first lookup
    assert len(cached.prefix_cache.store) == len({tuple(s) for s in task.train_ids + task.eval_ids})


def test_cached_model_under_each_engine_matches_autograd(files):
    """The top block and head trained on the cached lower part: each engine's per-example norms
    equal autograd's one example at a time (the cache hands each example its own rows)."""
    cfg = tiny_bert_cfg(files, "model.trained_blocks=1")
    task = build_task(cfg, CPU)
    torch.manual_seed(0)
    model = task.build_model(cfg.model).double().train()
    model.bert.encoder.layer[1].attention.self.dropout.p = 0.0  # the tiny BERT's dropout is 0; stay exact
    params = [p for p in model.parameters() if p.requires_grad]
    indices = [0, 1, 2]
    reference = [torch.autograd.grad(task.per_sample_loss(model, task.batch([i])).sum(), params) for i in indices]
    expected = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in grads)) for grads in reference])
    for mode in PER_SAMPLE_ENGINES.names():
        seen = []
        engine = build_engine(mode, model, unprobed=True)
        try:
            engine.clipped_sum(task.per_sample_loss(model, task.batch(indices)),
                               lambda norms: seen.append(norms.detach().clone()) or torch.ones_like(norms))
        finally:
            engine.detach()
        torch.testing.assert_close(seen[0].double(), expected, rtol=1e-5, atol=1e-9)


def test_dplora_adapts_the_trained_layers_only(files):
    from dpbench.models.lora import inject_lora

    cfg = tiny_bert_cfg(files, "model.trained_blocks=1", "algo=dplora")
    task = build_task(cfg, CPU)
    model = inject_lora(task.build_model(cfg.model), cfg.algo)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(n.startswith(("bert.encoder.layer.1.attention.self.", "classifier.")) for n in trained)
    assert any("lora_" in n for n in trained)


def test_validation_fraction_holds_out_whole_movies(files):
    task = build_task(tiny_bert_cfg(files, "dataset.validation_fraction=0.3"), CPU)
    assert task.split is not None and task.split.validation_indices and task.validation_labels
    assert task.train_size == len(task.split.train_indices) == len(task.train_labels)
    assert len(task.validation_scores(task.build_model(tiny_bert_cfg(files).model))) == len(task.validation_labels)


def test_a_sentence_model_with_another_dataset_is_a_user_error(files, tmp_path):
    from helpers.text_data import write_dataset

    sst2 = write_dataset(tmp_path, "sst2", n_train=4, n_test=2)
    with pytest.raises(UserError, match="dataset=sst2 is not a sentence classification data set for model=minilm"):
        build_task(compose([*OFFLINE, "model=minilm", f"model.path={files[0]}", "dataset=sst2", f"dataset.path={sst2}"]), CPU)


def test_an_asset_folder_holding_an_unpinned_adapter_is_refused_before_any_load(files, tmp_path, monkeypatch):
    """`from_pretrained` applies an adapter_config.json and its weights found in the folder unasked:
    an asset (the tiny BERT pinned as one) holding any file it does not pin is refused in one line
    that names the file and the fix; the same folder without them loads."""
    import hashlib
    import shutil

    from dpbench import assets
    from dpbench.models.bert import load_classifier, load_tokenizer

    monkeypatch.setenv(assets.CACHE_VARIABLE, str(tmp_path / "cache"))
    folder = tmp_path / "cache" / "assets" / "tiny-bert"
    shutil.copytree(files[0], folder)
    pinned = {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")}
    monkeypatch.setitem(assets.ASSETS, "tiny-bert", assets.Asset("tiny-bert", "tiny-bert", "0", "model", pinned, "test"))
    model_cfg = tiny_bert_cfg(files).model
    model_cfg.path, model_cfg.asset = None, "tiny-bert"
    vocab = len(load_tokenizer(model_cfg))
    assert isinstance(load_classifier(model_cfg, 2, vocab), torch.nn.Module)  # the pinned files alone: loaded
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "."}')
    (folder / "extra").mkdir()
    (folder / "extra" / "adapter_model.safetensors").write_bytes(b"\0" * 8)
    for load in (load_tokenizer, lambda cfg: load_classifier(cfg, 2, vocab)):
        with pytest.raises(UserError) as error:
            load(model_cfg)
        message = str(error.value)
        assert "\n" not in message and "does not pin: adapter_config.json, extra (" in message
        assert "dpbench-fetch tiny-bert --force" in message

# One step per algorithm family: non-private, DP first-order (each engine above), projected,
# LoRA, zeroth-order. B = 2, T = 8.
FAMILIES = {"adam": [], "dpadam": ["algo.per_sample=bk"], "grape": [], "dplora": [], "dpzero": []}


@pytest.mark.parametrize("algo", sorted(FAMILIES))
def test_one_step_of_each_algorithm_family(files, algo, tmp_path):
    from dpbench.run import run_job

    sigma = FIXED_SIGMA if algo != "adam" else []  # a non-private run refuses a privacy setting
    cfg = tiny_bert_cfg(files, f"algo={algo}", *FAMILIES[algo], *sigma, "train.batch_size=2", "train.physical_batch_size=2",
                   "train.steps=1",
                   "train.eval_every=1", "train.lr=1e-3")
    results = run_job(cfg, tmp_path, show_progress=False)
    assert results.status == "completed" and results.model == "minilm"
    assert 0 <= results.metrics.test_accuracy <= 1
    assert results.metrics.train_loss == results.metrics.train_loss  # not NaN
    assert results.privacy.private == (algo != "adam")


def test_a_dataset_config_sets_the_train_defaults_it_needs():
    """dataset=rt_snippets's train_defaults replace config.yaml's train values; the command line
    still wins; a data set without train_defaults keeps config.yaml's own (digits: 30 epochs)."""
    from omegaconf import OmegaConf

    real = compose([*OFFLINE, "model=minilm", "dataset=rt_snippets"])
    wanted = OmegaConf.to_container(real.dataset.train_defaults)
    rates = wanted.pop("lr")  # one per lr family
    heads = wanted.pop("head_init")  # model.head_init, one per lr family (test_zero_shot_head.py)
    assert {key: real.train[key] for key in wanted} == wanted
    assert real.model.head_init == heads.get(real.algo.lr_family, "random")
    for algo in ("dpadam", "dpsgd", "dpzero"):
        chosen = compose([*OFFLINE, "model=minilm", "dataset=rt_snippets", f"algo={algo}"])
        assert chosen.train.lr == rates[chosen.algo.lr_family] and rates[chosen.algo.lr_family] > 0
    assert compose([*OFFLINE, "model=minilm", "dataset=rt_snippets", "train.lr=5e-4"]).train.lr == 5e-4
    digits = compose(OFFLINE)
    assert "train_defaults" not in digits.dataset
    assert digits.train.epochs == 30 and digits.train.lr == digits.algo.default_lr
    assert digits.train.physical_batch_size is None


def test_the_audits_dropout_off_silences_attention_dropout(files):
    """dpbench-audit's sensitivity check needs two runs that differ in the neighbour only.
    transformers 5's BERT attention applies dropout functionally, with the Dropout module's p and
    the attention module's training flag: putting the Dropout modules in eval mode alone left it on
    (the audit of MiniLM, attention dropout 0.1, saw 1.05-1.15x the stated sensitivity)."""
    from dpbench.tools.audit.harness import dropout_off

    cfg = tiny_bert_cfg(files, "model.trained_blocks=null", "model.cache_frozen=false")
    task = build_task(cfg, CPU)
    model = task.build_model(cfg.model).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.5
    batch = task.batch([0, 1, 2, 3])
    assert not torch.equal(model(batch.input_ids, batch.attention_mask), model(batch.input_ids, batch.attention_mask))
    dropout_off(model)
    assert model.training
    torch.testing.assert_close(model(batch.input_ids, batch.attention_mask), model(batch.input_ids, batch.attention_mask),
                               rtol=0, atol=0)


def test_a_saved_model_finds_its_base_checkpoint_by_hash_after_the_folder_moves(files, tmp_path):
    import shutil

    from dpbench.api import rebuild
    from dpbench.run import run_job

    model, corpus = files
    trained_on = tmp_path / "cache" / "model"
    shutil.copytree(model, trained_on)
    run = tmp_path / "run"
    results = run_job(compose([*OFFLINE, "model=minilm", f"model.path={trained_on}", "dataset=rt_snippets",
                               f"dataset.path={corpus}", "dataset.test_fraction=0.5", "dataset.max_length=8",
                               "algo=adam", "train.steps=1", "train.batch_size=4", "train.physical_batch_size=4"]), run, show_progress=False)
    moved = tmp_path / "elsewhere" / "model"
    shutil.move(str(trained_on), moved)
    with pytest.raises(UserError, match="model.path=DIR"):  # one line, before the task is rebuilt
        rebuild(run)
    job = rebuild(run, [f"model.path={moved}"])
    assert job.task.evaluate(job.model)["accuracy"] == results.metrics.test_accuracy
    other = write_tiny_bert(tmp_path / "other", seed=1)  # another checkpoint: its hash differs
    with pytest.raises(UserError, match="SHA-256"):
        rebuild(run, [f"model.path={other}"])
