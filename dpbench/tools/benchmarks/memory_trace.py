"""Traced peak memory of one training step: dpbench's own step on fake tensors (docs/memory-prediction.md).

The analytic model (memory_model.py) adds up what it knows; this runs the step itself. The config
is composed as `dpbench` composes it, the model built at its real size under torch's
FakeTensorMode (shapes and dtypes, no storage: a 6.7B model costs no memory), the algorithm built
by its own class with its own engine, and `Algorithm.train_step` run on a fake physical batch
under torch's MemTracker, which records every tensor the step allocates and frees (activations,
per-example work, clipping, noise, optimizer step). The peak is the largest sum of live tensors:
what `torch.cuda.max_memory_allocated` reports on a GPU for the same step; reserved memory is
predicted as allocated x (1 + RESERVED_SLACK).

Seams (the step's code is not re-implemented; a fake tensor cannot hold a value):
* host reads (`.item()`, `bool(tensor)`, `.tolist()`) read True for a truth test and 0 for a
  number: every example finite, the coverage check passes, a loss of 0 (`TracingMode`);
* the book-keeping engine tells tensors apart by storage address, which fake tensors do not have:
  during the trace it reads the storage's identity instead (`fake_safe_engines`);
* the task is dpbench's own class (its `per_sample_loss`), built without reading its dataset
  (`task_without_data`); the layout probe, a one-off check before training, does not run.
Two steps are traced (the optimizer's state appears in the first), the peak is over both.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

MEMTRACKER_TORCH = "2.13"  # MemTracker (torch.distributed._tools) is private: the version it was checked with
RESERVED_SLACK = 0.10  # reserved = allocated x (1 + this): the caching allocator's rounding and fragmentation
TRACED_STEPS = 2


class TracingMode(FakeTensorMode):
    """FakeTensorMode whose host reads return a fixed value instead of raising: a truth test reads
    True (every example finite, every check passes), a number 0. A shape that depends on values
    (`nonzero`, under boolean indexing: DC-DPSGD drops a draw's negligible directions) is the
    largest, as if every element were true, as every truth test reads; a `bincount` with a
    minlength (DC-DPSGD's score histogram) has that length."""

    def dispatch(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            tensor = args[0]
            return True if tensor.dtype is torch.bool else (0.0 if tensor.is_floating_point() else 0)
        if func is torch.ops.aten.nonzero.default:
            mask = args[0]
            return super().dispatch(torch.ops.aten.empty.memory_format, types, ((mask.numel(), mask.dim()),),
                                    {"dtype": torch.long, "device": mask.device})
        if func is torch.ops.aten.bincount.default:
            named = dict(zip(("self", "weights", "minlength"), args), **(kwargs or {}))
            values, weights, minlength = named["self"], named.get("weights"), named.get("minlength", 0)
            if minlength:
                dtype = torch.long if weights is None else weights.dtype
                return super().dispatch(torch.ops.aten.zeros.default, types, ((int(minlength),),),
                                        {"dtype": dtype, "device": values.device})
        return super().dispatch(func, types, args, kwargs)

    def __deepcopy__(self, memo):  # a module copied during the trace (Opacus's functorch layers) keeps this mode
        return self


_MODE: TracingMode | None = None


def tracing_mode() -> TracingMode:
    """One mode per process: a fake tensor left in a cache by one trace (Opacus copies modules)
    must not meet another mode's in the next."""
    global _MODE
    if _MODE is None:  # a module's constant tensor made before the trace (DC-DPSGD's bin edges) joins it as fake
        _MODE = TracingMode(allow_non_fake_inputs=True)
    return _MODE


@contextlib.contextmanager
def fake_safe_engines():
    """The book-keeping engine keys tensors by storage address (`_storage`); a fake tensor's is 0,
    so during the trace it reads the storage's identity (also unique while the storage lives).
    Opacus's functorch layers (a ViT's class token) deep-copy the module and move the copy to
    `meta`, which a fake parameter refuses (swapping a tensor the fake mode holds a weak reference
    to): the copy is made with meta parameters at once, which is what it ends as. peft moves a new
    LoRA adapter to its base layer's device the same way, a `.to` that changes nothing: such a
    `.to` returns the module as it is (torch swaps each parameter with itself, which fails too)."""
    import types

    from opacus.grad_sample import functorch

    from dpbench.privacy import bookkeeping

    def meta_deepcopy(module, memo=None):
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():
            memo = {id(p): torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
                    for p in module.parameters()}
        return copy.deepcopy(module, memo)

    def unchanged_or_to(module, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*module.parameters(), *module.buffers()]
        if memory_format is None and all((device is None or t.device == device) and
                                         (dtype is None or not t.is_floating_point() or t.dtype == dtype)
                                         for t in tensors):
            return module
        return original_to(module, *args, **kwargs)

    original, original_copy = bookkeeping._storage, functorch.copy
    original_to = torch.nn.Module.to
    bookkeeping._storage = lambda tensor: tensor.untyped_storage()._cdata
    functorch.copy = types.SimpleNamespace(deepcopy=meta_deepcopy)
    torch.nn.Module.to = unchanged_or_to
    try:
        yield
    finally:
        bookkeeping._storage, functorch.copy = original, original_copy
        torch.nn.Module.to = original_to


@contextlib.contextmanager
def fused_attention_dropout():
    """SDPA with attention dropout runs, on CUDA, a fused kernel that draws the dropout inside it
    from a seed and keeps only the output and the log-sum-exp; CPU torch has no fused kernel with
    dropout and falls back to the math path, which keeps the T x T probabilities and the dropout
    mask (BERT's and RoBERTa's attention dropout is 0.1). During the trace SDPA runs with dropout 0,
    which takes the CPU's fused kernel: the memory of the CUDA one, not its values."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def without_dropout(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return original(query, key, value, attn_mask, 0.0, *args, **kwargs)

    F.scaled_dot_product_attention = without_dropout
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@dataclass
class Traced:
    """A built step: the algorithm, its physical batch and what it was built under."""

    algorithm: object
    batch: object
    model: torch.nn.Module
    batch_size: int
    tokens: int
    assumptions: list[str]


def task_without_data(cfg, device: torch.device):
    """dpbench's task class for `cfg` with the fields its `per_sample_loss` reads, no dataset read."""
    from dpbench.tasks import TASKS

    kind = cfg.dataset.get("task", "image_classification")
    if kind == "language":
        from dpbench.tasks.language import language_task_kind

        kind = language_task_kind(cfg)
    task = object.__new__(TASKS.get(kind))
    task.cfg, task.device, task.train_size = cfg, device, 0  # train_size 0: no layout probe (a one-off check)
    if kind == "prompt_mlm":
        task.prompt = task.prompts[str(cfg.dataset.name)]
        task.label_ids = list(range(5, 5 + len(task.prompt.label_words)))
    elif kind == "causal_lm":
        task.prompt = task.prompts[str(cfg.dataset.name)]
    elif kind == "sentence_classification":
        pass  # per_sample_loss reads only cfg and device
    elif kind == "image_classification":
        task.user_loss, task.margins, task.drw = None, None, None
    else:
        from dpbench.errors import UserError

        raise UserError(f"the traced memory model covers image, prompt_mlm, causal_lm and sentence_classification "
                        f"tasks, not {kind}")
    return task, kind


# Scored tokens per row of a traced causal-LM batch: a candidate's label word (MeZO's SST-2 words are one
# token each, BoolQ's " Yes"/" No" too); a generation task's gold answer, whose length is data: every
# position (the upper bound).
CANDIDATE_TOKENS = 1


def scored_span(prompt, tokens: int, every_position: bool = False) -> int:
    """`every_position`: as the papers' code scores (every position's logits), not dpbench's batches."""
    return tokens - 1 if prompt.generation or every_position else min(tokens - 1, CANDIDATE_TOKENS)


def fake_batch(task, kind: str, info: dict, batch: int, tokens: int, device, every_position: bool = False):
    """One physical batch of `batch` examples in the task's own batch type (token ids and images
    drawn at random: a real run's checks need gradients that do not cancel; labels 0)."""
    zeros = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=device)  # noqa: E731
    ids = lambda *shape: torch.randint(5, info.get("vocab", 6), shape, device=device)  # noqa: E731
    if kind == "prompt_mlm":
        from dpbench.tasks.prompt_mlm import MLMBatch

        return MLMBatch(ids(batch, tokens), torch.ones(batch, tokens, dtype=torch.long, device=device),
                        zeros(batch), zeros(batch))
    if kind == "sentence_classification":
        from dpbench.tasks.sentence_classification import SentenceBatch

        mask = torch.ones(batch, tokens, dtype=torch.long, device=device)
        return SentenceBatch(ids(batch, tokens), mask, zeros(batch))
    if kind == "causal_lm":
        from dpbench.tasks.causal_lm import CausalBatch, _PlaceholderRow

        prompt = task.prompt
        rows = 1 if prompt.generation else len(prompt.candidates(_PlaceholderRow()))
        ones = torch.ones(batch * rows, tokens, dtype=torch.long, device=device)
        span = scored_span(prompt, tokens, every_position)
        target = torch.zeros_like(ones)
        target[:, tokens - span:] = 1  # a real row ends in its scored tokens (causal_lm._batch)
        return CausalBatch(ids(batch * rows, tokens), ones, target, zeros(batch), rows, span)
    return torch.randn(batch, *info["shape"], device=device), zeros(batch)


def sentence_classifier(cfg, config):
    """BERT and dpbench's head as `load_classifier` builds them (dpbench/models/bert.py), from the
    config instead of a folder: the pooler only with `model.pooling=pooler`, the same parts frozen."""
    import transformers

    from dpbench.models.bert import SentenceClassifier, freeze
    from dpbench.tasks.sentence_classification import SENTENCE_SETS

    pooling = str(cfg.model.get("pooling", "mean"))
    encoder = transformers.BertModel(config, add_pooling_layer=pooling == "pooler")
    model = SentenceClassifier(encoder, SENTENCE_SETS[str(cfg.dataset.name)][1], pooling)
    freeze(model, bool(cfg.model.get("freeze_embeddings", False)), cfg.model.get("trained_blocks"))
    return model  # no model.cache_frozen cache (it needs the data): the frozen blocks run in each forward


def build_model(cfg, info_only: bool = False):
    """`cfg.model` as dpbench builds it (language: from its transformers config, real size, the
    attention implementation transformers picks by default, SDPA; model.dtype applied)."""
    from dpbench.models import MODELS, apply_opacus_fixes
    from dpbench.models.language import AUTO_CLASSES, DTYPES, LanguageFamily, family
    from dpbench.tools.benchmarks.model_shapes import image_spec, language_config

    name = str(cfg.model.name)
    if isinstance(MODELS.get(name).family, LanguageFamily):
        import transformers

        config = language_config(cfg)
        if family(cfg.model).language_task == "sentence_classification":
            model = sentence_classifier(cfg, config)
        else:
            auto = getattr(transformers, AUTO_CLASSES[family(cfg.model).objective])
            model = auto.from_config(config, dtype=DTYPES[str(cfg.model.get("dtype", "float32"))])
        return apply_opacus_fixes(model, name), {"kind": "language", "vocab": config.vocab_size,
                                                 "attention": model.config._attn_implementation}
    spec = image_spec(cfg)  # the task's input: digits is 1 x 8 x 8, not the config's absent size
    model = apply_opacus_fixes(MODELS.get(name).build(cfg.model, spec), name)
    return model, {"kind": "image", "shape": spec.input_shape or (spec.channels, spec.image_size, spec.image_size)}


def build_step(overrides: list[str], batch: int | None = None, seq_len: int | None = None,
               every_position: bool = False) -> Traced:
    """Model, algorithm and batch of `dpbench <overrides>` (under the caller's tensor mode)."""
    from dpbench.algorithms import algorithm_class
    from dpbench.algorithms.learning_rates import mark_head
    from dpbench.api import compose
    from dpbench.models import ModelFamily, family_of
    from dpbench.precision import Precision
    from dpbench.privacy.noise import GaussianNoise
    from dpbench.privacy.plan import PrivacySetup

    cfg = compose(list(overrides))
    device = torch.device("cpu")
    batch = int(batch or cfg.train.get("physical_batch_size") or cfg.train.batch_size)
    torch.manual_seed(int(cfg.seed))
    model, info = build_model(cfg)
    model.train()
    mark_head(model, (family_of(model) or ModelFamily()).trained_modules, float(cfg.train.get("head_lr_scale", 1.0)),
              str(cfg.model.name))
    task, kind = task_without_data(cfg, device)
    tokens = 1 if info["kind"] == "image" else int(seq_len or cfg.dataset.get("max_length") or 128)
    cls = algorithm_class(str(cfg.algo.name))
    privacy = PrivacySetup(1.0, float(cfg.privacy.get("clip_norm") or 1.0), float(batch), 0.01,
                           GaussianNoise(device)) if cls.private else None
    algorithm = cls(model, task, cfg.algo, float(cfg.train.lr), privacy)
    algorithm.use_precision(Precision(str(cfg.train.precision), "cpu"))  # CPU autocast: the trace runs CPU kernels
    assumptions = [f"B={batch} examples" + (f" of T={tokens} tokens" if tokens > 1 else f" of {info['shape']}"),
                   f"algo={cfg.algo.name}" + (f" algo.per_sample={algorithm.engine_spec.name}"
                                              if hasattr(algorithm, "engine_spec") else ""),
                   f"precision={cfg.train.precision}, model.dtype={cfg.model.get('dtype', 'float32')}"]
    if info["kind"] == "language":
        assumptions.append(f"attention: transformers' {info['attention']} (dpbench's default); the trace runs "
                           "its CPU kernel, which like CUDA's fused kernels keeps no T x T probabilities, except "
                           "with attention dropout (CPU torch's math path then keeps them; see fused_dropout)")
    physical = fake_batch(task, kind, info, batch, tokens, device, every_position)
    if kind == "causal_lm":
        why = ("every position's logits, as the paper's code computes them" if every_position else
               "a generation answer's length is data: every position" if task.prompt.generation else
               "one label-word token per candidate")
        assumptions.append(f"scored tokens per row: the last {physical.scored_span} ({why})")
    return Traced(algorithm, physical, model, batch, tokens, assumptions)


def batch_tensors(batch) -> list[torch.Tensor]:
    values = batch if isinstance(batch, (tuple, list)) else vars(batch).values()
    return [v for v in values if torch.is_tensor(v)]


class _NoHook:
    def remove(self):
        pass


_NO_HOOK = _NoHook()


def step_tracker():
    """MemTracker that allows the root module's forward more than once (the next step, DPZero's
    two evaluations): it then starts its per-module breakdown afresh; the device peak is kept."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from torch.utils._pytree import tree_leaves

    def vmapped(values) -> bool:  # a per-example vmap's wrapped tensors have no storage to attribute
        return any(torch.is_tensor(v) and torch._C._functorch.is_functorch_wrapped_tensor(v)
                   for v in tree_leaves(values))

    class StepTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            if vmapped(inputs):  # the module breakdown skips it; the device's peak still counts it
                return
            try:
                super()._pre_fw_hook(module, inputs)
            except NotImplementedError:  # "multiple iterative calls" of the root module
                self.reset_mod_stats()
                super()._pre_fw_hook(module, inputs)

        def _post_fw_hook(self, module, inputs, outputs):
            if not (vmapped(inputs) or vmapped(outputs)):
                super()._post_fw_hook(module, inputs, outputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # a frozen parameter (LoRA's base, a frozen embedding) gets no gradient, so no grad
            # hook: MemTracker would try to register one and fail
            for param in module.parameters():
                if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                    self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

    return StepTracker()


def measure(step: Traced, steps: int = TRACED_STEPS) -> dict:
    """MemTracker's peak over `steps` training steps of `step` (real or fake tensors)."""
    tracker = step_tracker()
    tracker.track_external(step.model, *batch_tensors(step.batch))
    with tracker:
        for index in range(steps):
            step.algorithm.train_step([step.batch], index)
    device_peak = tracked_peak(tracker)
    by_category = {getattr(k, "value", str(k)): int(v) for k, v in device_peak.items() if k != "Total"}
    return {"allocated_bytes": int(device_peak["Total"]), "by_category": by_category}


def tracked_peak(tracker) -> dict:
    """MemTracker's peak snapshot of the device the step ran on (the CPU: the trace's device), by category."""
    peaks = tracker.get_tracker_snapshot("peak")
    (device_peak,) = [v for k, v in peaks.items() if k.type == "cpu"] or list(peaks.values())
    return device_peak


def measure_inference_floor(step: Traced) -> int:
    """The floor a zeroth-order step is held to (MeZO's and DPZero's claim: inference memory): the
    peak of live tensors of one forward with no gradient, to the model's last hidden state plus the
    logits of the positions the loss reads (a causal LM's scored span, through its output
    embedding, built here apart from the task's loss); any other task: its loss, with no gradient."""
    model, batch = step.model, step.batch
    tracker = step_tracker()
    tracker.track_external(model, *batch_tensors(batch))
    was_training = model.training
    model.eval()
    try:
        with tracker, torch.no_grad():
            if getattr(batch, "scored_span", None) is not None:
                span = int(batch.scored_span)
                hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                             use_cache=False).last_hidden_state
                logits = model.get_output_embeddings()(hidden[:, -span - 1:-1])
                torch.log_softmax(logits.float(), dim=-1).gather(-1, batch.input_ids[:, -span:, None])
            else:
                step.algorithm.task.per_sample_loss(model, batch)
    finally:
        model.train(was_training)
    return int(tracked_peak(tracker)["Total"])


def trace(overrides: list[str], *, batch: int | None = None, seq_len: int | None = None, fake: bool = True,
          fused_dropout: bool = False, inference_floor: bool = False, every_position: bool = False) -> dict:
    """`measure` of the step built from `overrides`, on fake tensors (or real ones: the self-check);
    `fused_dropout`: attention with dropout as CUDA's fused SDPA kernel holds it (`fused_attention_dropout`)."""
    started = time.perf_counter()
    mode = tracing_mode() if fake else contextlib.nullcontext()
    attention = fused_attention_dropout() if fused_dropout else contextlib.nullcontext()
    with mode, fake_safe_engines(), attention:
        step = build_step(overrides, batch, seq_len, every_position)
        floor = measure_inference_floor(step) if inference_floor else None
        result = measure(step)
    if floor is not None:
        result["inference_floor_bytes"] = floor
    result["assumptions"] = step.assumptions
    result["seconds"] = time.perf_counter() - started
    return result


def predict_step_peak(overrides: list[str], *, batch: int | None = None, seq_len: int | None = None,
                      fused_dropout: bool = True, inference_floor: bool = False, every_position: bool = False) -> dict:
    """Trace one training step of the run `dpbench <overrides>` would make (model at its real size,
    built under FakeTensorMode; the algorithm's real step: forward, per-example work of its engine,
    clipping, noise, optimizer step) and return
    {"allocated_bytes": int (peak), "reserved_bytes": int (allocated x (1 + RESERVED_SLACK)),
     "reserved_slack": float, "by_category": {...MemTracker's categories...}, "assumptions": [str, ...]}"""
    result = trace(overrides, batch=batch, seq_len=seq_len, fake=True, fused_dropout=fused_dropout,
                   inference_floor=inference_floor, every_position=every_position)
    allocated = result["allocated_bytes"]
    attention = (["attention dropout as CUDA's fused SDPA kernel holds it (no T x T probabilities or mask)"]
                 if fused_dropout else [])
    assumptions = result["assumptions"] + attention + [
        f"peak over {TRACED_STEPS} steps of live tensors (MemTracker, checked with torch {MEMTRACKER_TORCH}); "
        "host reads see every example finite; no CUDA context",
        f"reserved = allocated x (1 + {RESERVED_SLACK})"]
    return {"allocated_bytes": allocated, "reserved_bytes": int(allocated * (1 + RESERVED_SLACK)),
            "reserved_slack": RESERVED_SLACK, "by_category": result["by_category"], "assumptions": assumptions,
            "seconds": result["seconds"], **({"inference_floor_bytes": result["inference_floor_bytes"]}
                                            if "inference_floor_bytes" in result else {})}


def predicted_search(overrides: list[str], budget_mib: float, start: int = 8, limit: int = 4096,
                     predict=None) -> tuple[int, int]:
    """(largest batch whose traced reserved memory fits `budget_mib`, traces run): doubling, then
    bisection, on `memory_trace.predict_step_peak` instead of probe runs."""
    predict = predict or predict_step_peak
    traces = 0

    def fits(batch: int) -> bool:
        nonlocal traces
        traces += 1
        return predict(list(overrides), batch=batch)["reserved_bytes"] <= budget_mib * 2**20

    good, bad = 0, None
    candidate = max(1, min(start, limit))
    while bad is None and good < limit:
        if fits(candidate):
            good, candidate = candidate, min(2 * candidate, limit)
        else:
            bad = candidate
    while bad is not None and bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good, traces
