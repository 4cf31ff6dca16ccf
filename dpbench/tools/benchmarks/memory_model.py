"""Per-rank memory of a private run, from its config, before launching it (docs/sharding.md, "Will it fit?").

    python -m dpbench.tools.benchmarks.memory_model --world-size 8 --budget-gib 80 -- \
        model=opt model.size=6.7b dataset=squad algo=dpadam algo.per_sample=bk train.physical_batch_size=1
    python -m dpbench.tools.benchmarks.max_batch --sharding --world-size 8 --budget-mib 81920 -- <the same overrides>

The config is composed as `dpbench` composes it (`dpbench.api.compose`); the model is built as a
run builds it (its frozen parts, head and pooler; the traced mode's builder) on fake tensors (no
memory, no weights: a language model from its transformers config, read from a local folder or the
hub cache, else from `KNOWN_CONFIGS`), its parameters counted exactly, and one forward of a physical
batch on fake tensors gives every hooked layer's input and output shapes.
For a world size K (`train.sharding=fsdp`: FSDP2's Shard(0), torch.chunk's rows; rank 0 holds the
most), the table gives rank 0's bytes of:

* parameters / K (their dtype; the frozen ones, a row of their own, hold weights only) and, while
  a block runs, the gathered blocks: FSDP2 all-gathers a
  block's full parameters for its forward and backward and prefetches the next (2 blocks), and the
  root's own parameters (embeddings, tied head, final norm) stay gathered from the forward to the
  end of the backward;
* the released gradient / K (fp32: the noisy shard the optimizer reads) and the optimizer state / K
  (Adam: two fp32 moments; DP-GRAPE: its projected moments, r x n per projected layer, full moments
  elsewhere, not sharded: its release is replicated, and so are they; DP-SGD: a momentum buffer
  when algo.momentum > 0);
* the clipped-sum accumulators: fp32, in the shapes of the privatised sums (DP-GRAPE: projected).
  One process, and DP-GRAPE (its release is replicated: summed before the all-reduce): full size.
  DP-SGD and DP-Adam at K > 1: this rank's shard rows / K, since each physical chunk's sum of each
  parameter is sum-reduce-scattered into them as it is formed (dpbench/algorithms/first_order.py,
  `clip_and_accumulate`), plus the full-size working sum that exists before its reduce-scatter
  (row "clipped-sum working sum"): with bk and ghost ONE PARAMETER's (the largest; bk forms them
  one at a time after the backward, ghost one at a time inside its second backward, each
  reduce-scattered as its hook forms it), with materialize ONE CHUNK's (every parameter's: the
  per-example gradients form them all before the first is reduced), each with the
  reduce-scatter's zero-padded copy where the rows are not a multiple of K and its output rows;
* per-example work, not sharded either: every rank holds its own physical batch's (B examples of T
  tokens) activations of the layer being processed, gathered to full width (FSDP2 gathers the
  weights, not the examples). By engine (dpbench/privacy/bookkeeping.py, per_sample.py):
  - bk keeps, for every hooked layer at once until the norms are known, a Linear's input and output
    gradient (B*T*(d_in + d_out) values in the forward's dtype), an Embedding's ids (int64) and
    output gradient, a LayerNorm's per-example weight and bias gradients (B*2d, fp32), any other
    layer's instantiated per-example gradient (fp32); plus one layer's norm work at a time: two
    T x T Grams (fp32) per example where T*T < d_in*d_out, else the instantiated B*d_in*d_out;
  - ghost keeps every layer's input for its second backward, but one layer's output gradient and
    norm work at a time;
  - materialize keeps every layer's input and B per-example gradients of every parameter (fp32).

`--traced` (on by default; `--no-traced` to skip) adds the traced prediction: dpbench's own step
run on fake tensors under torch's MemTracker (memory_trace.py, docs/memory-prediction.md), which
counts everything below too.

Not counted: autograd's other saved tensors (attention probabilities, nonlinearity inputs), the
loss and logits, the CUDA context and NCCL buffers, and the caching allocator's slack (reserved
memory typically exceeds these figures by 10-20 %). The first chunk of a run also checks coverage
once (autograd's gradient shard beside the unclipped sums), about one more gradient shard.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from dpbench.errors import UserError

GIB = 2**30
FLOAT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ENGINES = ("bk", "ghost", "materialize")
ALGORITHMS = ("dpsgd", "dpadam", "grape")  # the analytic table's; the traced prediction runs every registered algorithm
EXIT_BAD_INPUT = 2


class NotModelled(UserError):
    """The analytic table does not model this algorithm (the traced prediction still runs its step)."""



@dataclass
class LayerCall:
    """One call of a layer the per-example engines hook, from the meta forward."""

    name: str
    kind: str  # linear | embedding | layernorm | other
    in_bytes: int  # its input as the engines keep it (ids: int64)
    out_bytes: int  # its output gradient (the forward's dtype)
    instantiated: int  # bytes of its per-example gradients instantiated (layernorm, other: B x its params, fp32)
    norm_work: int  # bytes of its norm computation at its peak (Grams or the instantiated gradient)


@dataclass
class Estimate:
    """Rank 0's bytes (the largest shard) of one run at world size K."""

    label: str
    world_size: int
    batch: int
    tokens: int
    engine: str
    precision: str
    parameters: int  # number of trained parameters (tied ones once)
    rows: list[tuple[str, int, str]] = field(default_factory=list)  # (what, bytes, note)
    per_example_bytes: int = 0  # the per-example rows' bytes for B = batch (linear in B)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(b for what, b, _ in self.rows if not what.startswith(" "))  # indented rows: a breakdown

    def max_batch(self, budget_bytes: float) -> int:
        """The largest physical batch whose total fits `budget_bytes` (every per-example row is linear in B)."""
        fixed = self.total - self.per_example_bytes
        per_example = self.per_example_bytes / max(self.batch, 1)
        if budget_bytes < fixed or per_example <= 0:
            return 0
        return int((budget_bytes - fixed) // per_example)


# --- sharding arithmetic ----------------------------------------------------------------------------------
def shard_numel(shape, world_size: int) -> int:
    """Elements rank 0 holds of a tensor of `shape` sharded over `world_size` ranks on dim 0
    (torch.chunk's rule, FSDP2's Shard(0): ceil(rows / K) rows; a 0-dim tensor is held whole)."""
    shape = tuple(shape)
    if not shape:
        return 1
    rows = shape[0]
    return min(-(-rows // world_size), rows) * math.prod(shape[1:])


def sharded_bytes(shapes, world_size: int, element_bytes: int) -> int:
    return sum(shard_numel(s, world_size) for s in shapes) * element_bytes


def reduce_scatter_bytes(shape, world_size: int) -> int:
    """fp32 bytes `distributed.reduce_scatter_rows` allocates for one tensor of `shape` beside it:
    a zero-padded copy where the rows are not a multiple of K, and the output's ceil(rows / K) rows."""
    shape = tuple(shape) or (1,)
    rows, rest = shape[0], math.prod(shape[1:])
    per_rank = -(-rows // world_size)
    padded = per_rank * world_size * rest if rows % world_size else 0
    return (padded + per_rank * rest) * 4


# --- the model, shapes only -----------------------------------------------------------------------------------
def shaped_model(cfg) -> tuple[nn.Module, dict]:
    """`cfg.model` as a run builds it (the traced mode's builder: the run's frozen parts, head and
    pooler, so a sentence classifier with `model.trained_blocks=k` trains k blocks and the head),
    with no storage: call it under `memory_trace.tracing_mode()` (fake tensors, whose host reads,
    such as transformers' is-it-padded check, read a fixed value), and the facts `example_inputs`
    needs."""
    from dpbench.models.bert import SentenceClassifier
    from dpbench.tools.benchmarks.memory_trace import build_model

    model, info = build_model(cfg)
    return model, {**info, "sentence_classifier": isinstance(model, SentenceClassifier)}


def example_inputs(info: dict, batch: int, tokens: int) -> dict:
    """One physical batch's keyword inputs (under the caller's tensor mode)."""
    if info["kind"] == "language":
        ids = torch.zeros(batch, tokens, dtype=torch.long)
        # dpbench's sentence classifier pools with the mask, an argument; a causal/MLM model needs none
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)} if info.get("sentence_classifier") else \
            {"input_ids": ids}
    return {"x": torch.zeros(batch, *info["shape"])}


# --- layer calls ------------------------------------------------------------------------------------------
def _kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.LayerNorm) or type(module).__name__ in ("LayerNorm", "RMSNorm"):
        return "layernorm"
    return "other"


def _hooked(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Leaf modules with trainable parameters of their own (what the engines hook)."""
    return [(n, m) for n, m in model.named_modules()
            if any(p.requires_grad for p in m.parameters(recurse=False))
            and (_kind(m) != "other" or not any(True for _ in m.children()))]


def layer_calls(model: nn.Module, inputs: dict, batch: int, act_bytes: int) -> list[LayerCall]:
    """Every hooked layer call of one forward of `inputs` (meta tensors: shapes only)."""
    calls: list[LayerCall] = []

    def record(name):
        def hook(module, args, output):
            x = args[0] if args else None
            out = output[0] if isinstance(output, tuple) else output
            in_numel = x.numel() if isinstance(x, torch.Tensor) else 0
            in_bytes = in_numel * (8 if isinstance(x, torch.Tensor) and not x.is_floating_point() else act_bytes)
            out_bytes = out.numel() * act_bytes
            kind = _kind(module)
            own = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
            instantiated, work = 0, 0
            if kind == "linear":
                d_in, d_out = module.in_features, module.out_features
                tokens = max(in_numel // max(batch * d_in, 1), 1)
                gram = 2 * batch * tokens * tokens * 4 if tokens * tokens < d_in * d_out else batch * d_in * d_out * 4
                work = gram + (batch * d_out * 4 if module.bias is not None else 0)
            elif kind == "embedding":
                tokens = max(in_numel // max(batch, 1), 1)
                work = batch * tokens * tokens * 4
            else:
                instantiated = batch * own * 4
            calls.append(LayerCall(name, kind, in_bytes, out_bytes, instantiated, work))
        return hook

    handles = [m.register_forward_hook(record(n)) for n, m in _hooked(model)]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def per_example_rows(calls: list[LayerCall], engine: str, batch: int, released_numel: int) -> list[tuple[str, int, str]]:
    """The per-example rows of `engine` for the layer calls of one physical batch (`released_numel`:
    the elements of the privatised sums, DP-GRAPE's projected layers as r x n)."""
    if engine == "materialize":
        return [("  layer inputs (all layers)", sum(c.in_bytes for c in calls), "kept for the grad samplers"),
                ("  per-example gradients", batch * released_numel * 4,
                 f"B={batch} x every released value (DP-GRAPE: projected), fp32")]
    work = max((c.norm_work + c.instantiated for c in calls), default=0)
    if engine == "bk":
        pieces = sum(c.in_bytes + c.out_bytes for c in calls if c.kind in ("linear", "embedding"))
        instantiated = sum(c.instantiated for c in calls)
        return [("  layer inputs + output grads", pieces, "every hooked layer, until the norms are known"),
                ("  instantiated (norms, others)", instantiated, "LayerNorm and other layers' per-example grads"),
                ("  norm work (one layer)", work, "Grams (T*T < d_in*d_out) or B*d_in*d_out")]
    if engine == "ghost":
        inputs = sum(c.in_bytes for c in calls)
        one = max((c.out_bytes + c.norm_work + c.instantiated for c in calls), default=0)
        return [("  layer inputs (all layers)", inputs, "kept for the second backward"),
                ("  one layer's output grad + norm", one, "one layer at a time")]
    raise ValueError(f"unknown engine {engine!r}; one of {', '.join(ENGINES)}")


# --- the estimate ---------------------------------------------------------------------------------------------
def trained_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The trainable parameters, tied ones once."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def estimate_model(model: nn.Module, inputs: dict, *, algo: str = "dpadam", engine: str = "bk", batch: int = 1,
                   tokens: int = 1, precision: str = "fp32", world_size: int = 1, block_patterns=(),
                   momentum: float = 0.0, projected: dict | None = None, label: str = "") -> Estimate:
    """Rank 0's bytes of training `model` (built on any device, meta included) at world size K.
    `projected`: {parameter: Projection} of DP-GRAPE's projected layers."""
    from dpbench.runtime.sharding import block_modules

    if algo not in ALGORITHMS:
        raise NotModelled(f"the analytic table models algo={'|'.join(ALGORITHMS)}, not algo={algo}")
    K, act = max(int(world_size), 1), FLOAT_BYTES[precision]
    params = trained_parameters(model)
    numel = sum(p.numel() for _, p in params)
    projected = projected or {}
    est = Estimate(label, K, batch, tokens, engine, precision, numel)
    param_bytes = sum(shard_numel(p.shape, K) * p.element_size() for _, p in params)
    est.rows.append(("parameters / K", param_bytes, f"{numel:,} trained, {params[0][1].dtype}".replace("torch.", "")))
    trained_ids = {id(p) for _, p in params}
    frozen = list({id(p): p for p in model.parameters() if id(p) not in trained_ids}.values())
    if frozen:  # held like the trained weights (FSDP2 shards them too), with no gradient or state
        est.rows.append(("frozen parameters / K", sum(shard_numel(p.shape, K) * p.element_size() for p in frozen),
                         f"{sum(p.numel() for p in frozen):,} not trained (weights only)"))
    if K > 1:
        blocks = block_modules(model, tuple(block_patterns))
        in_blocks = {id(p) for _, b in blocks for p in b.parameters()}
        largest = max((sum(p.numel() * p.element_size() for p in b.parameters()) for _, b in blocks), default=0)
        root = sum(p.numel() * p.element_size() for _, p in params if id(p) not in in_blocks)
        est.rows.append(("gathered (FSDP2 all-gather)", 2 * largest + root,
                         f"{len(blocks)} blocks: 2 gathered at a time, + the root's own parameters"))
    released = [projected[p].projected_shape if p in projected else p.shape for _, p in params]
    # DP-GRAPE's release is replicated under sharding (docs/sharding.md): whole on every rank, as its moments
    held = 1 if algo == "grape" else K
    est.rows.append(("gradients / K", sharded_bytes(released, held, 4),
                     "the released noisy values, fp32, whole on every rank (replicated release)" if algo == "grape"
                     else "the released noisy shard, fp32"))
    if algo in ("dpadam", "grape"):
        state = 2 * sharded_bytes(released, held, 4)
        note = "Adam's two fp32 moments" + (" (projected layers: r x n)" if projected else "") + \
            (", replicated" if algo == "grape" and K > 1 else "")
    else:
        state = sharded_bytes(released, K, 4) if momentum else 0
        note = "momentum buffer" if momentum else "none (algo.momentum=0)"
    est.rows.append(("optimizer state / K", state, note))
    if K > 1 and algo != "grape":  # each chunk's sums reduce-scattered into this rank's rows as formed
        est.rows.append(("clipped-sum accumulators / K", sharded_bytes(released, K, 4),
                         "fp32, this rank's shard rows (each chunk's sums reduce-scattered into them)"))
        scatter = max(reduce_scatter_bytes(shape, K) for shape in released)
        if engine in ("bk", "ghost"):  # bk: after the backward; ghost: inside its second backward, as formed
            working = max(math.prod(shape) * 4 + reduce_scatter_bytes(shape, K) for shape in released)
            note = "fp32, one parameter's full-size sum (the largest) + its reduce-scatter buffers"
        else:
            working = sum(math.prod(shape) for shape in released) * 4 + scatter
            note = f"fp32, one chunk's full-size sums ({engine}: all formed before the first reduce-scatter)"
        est.rows.append(("clipped-sum working sum", working, note))
    else:
        est.rows.append(("clipped-sum accumulators", sum(math.prod(s) for s in released) * 4,
                         "fp32, full size on every rank (summed before the all-reduce)" if algo == "grape" and K > 1
                         else "fp32, full size"))
    rows = per_example_rows(layer_calls(model, inputs, batch, act), engine, batch, sum(math.prod(s) for s in released))
    est.per_example_bytes = sum(b for _, b, _ in rows)
    est.rows.append((f"per-example work ({engine}, B={batch}, T={tokens})", est.per_example_bytes,
                     "not sharded: this rank's examples, full width"))
    est.rows.extend(rows)
    return est


def estimate(overrides: list[str], world_size: int, batch: int | None = None, tokens: int | None = None) -> Estimate:
    """The estimate for `dpbench <overrides>` at `world_size` ranks (physical batch B: `batch`,
    else train.physical_batch_size, else train.batch_size; tokens T: `tokens`, else dataset.max_length, else 512)."""
    from dpbench.algorithms.projected_adam import build_projections
    from dpbench.api import compose
    from dpbench.runtime.sharding import block_patterns

    from dpbench.tools.benchmarks.memory_trace import tracing_mode

    cfg = compose(overrides)
    algo, engine = str(cfg.algo.name), str(cfg.algo.get("per_sample", "materialize"))
    batch = int(batch or cfg.train.get("physical_batch_size") or cfg.train.batch_size)
    label = f"model={cfg.model.name}" + (f" size={cfg.model.size}" if cfg.model.get("size") else "") + f" algo={algo}"
    with tracing_mode():  # shapes only: a 6.7B model costs no memory
        model, info = shaped_model(cfg)
        tokens = 1 if info["kind"] == "image" else int(tokens or cfg.dataset.get("max_length") or 512)
        projected = build_projections(model, cfg.algo)[1] if algo == "grape" else None
        est = estimate_model(model, example_inputs(info, batch, tokens), algo=algo, engine=engine, batch=batch,
                             tokens=tokens, precision=str(cfg.train.get("precision", "fp32")), world_size=world_size,
                             block_patterns=block_patterns(str(cfg.model.name)),
                             momentum=float(cfg.algo.get("momentum") or 0), projected=projected, label=label)
    if info["kind"] == "image":
        est.tokens = 1
    if world_size > 1:
        from dpbench.algorithms import algorithm_class
        from dpbench.privacy.engines import SHARDED_SUMS, engine_spec

        if not algorithm_class(algo).stated("shardable") or not engine_spec(engine).has(SHARDED_SUMS):  # (first-order ones)
            est.notes.append(f"train.sharding=fsdp refuses algo={algo} algo.per_sample={engine} today: "
                             "the figures are what K-way sharding would take")
        if str(cfg.train.get("precision", "fp32")) != "fp32":
            est.notes.append("train.sharding=fsdp runs train.precision=fp32 only today")
    return est


def table(est: Estimate, budget_gib: float | None = None) -> str:
    """The estimate as a readable text table (GiB and bytes)."""
    width = max(len(r[0]) for r in est.rows) + 2
    head = (f"{est.label} engine={est.engine} precision={est.precision} K={est.world_size} "
            f"(rank 0's bytes; B={est.batch} examples of T={est.tokens} tokens per physical chunk)")
    lines = [head, f"{'':{width}}{'GiB':>9} {'bytes':>18}  note", "-" * (width + 60)]
    for what, size, note in est.rows:
        lines.append(f"{what:{width}}{size / GIB:9.2f} {size:18,d}  {note}")
    lines.append("-" * (width + 60))
    lines.append(f"{'total':{width}}{est.total / GIB:9.2f} {est.total:18,d}")
    if budget_gib is not None:
        budget = budget_gib * GIB
        verdict = "fits" if est.total <= budget else "does NOT fit"
        lines.append(f"{verdict} in {budget_gib:g} GiB per GPU (largest physical batch that fits, by this table's "
                     f"linear per-example rows: {est.max_batch(budget)}; one process: the traced line below)")
    lines.extend(f"note: {n}" for n in est.notes)
    lines.append("not counted: autograd's other saved tensors (attention probabilities, nonlinearity inputs), "
                 "logits, CUDA context, NCCL buffers, allocator slack (+10-20 % reserved)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, nargs="+", default=[1], help="K: ranks sharing the model (several: one table each)")
    parser.add_argument("--batch", type=int, default=None, help="physical batch B (default: train.physical_batch_size)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens T per example (default: dataset.max_length or 512)")
    parser.add_argument("--budget-gib", type=float, default=None, help="per-GPU memory: say whether the run fits")
    parser.add_argument("--traced", action=argparse.BooleanOptionalAction, default=True,
                        help="also trace dpbench's own step on fake tensors (memory_trace.py; one process, K=1)")
    parser.add_argument("overrides", nargs="*", help="dpbench overrides (after --)")
    args = parser.parse_args(argv)
    try:
        for k in args.world_size:
            print(table(estimate(args.overrides, k, args.batch, args.seq_len), args.budget_gib))
            print()
    except NotModelled as error:  # any registered algorithm: its own step, traced
        if not args.traced:
            print(f"memory_model: error: {error}; drop --no-traced for the traced prediction of its step",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"note: {error}: the traced prediction below runs its own step\n")
    try:
        if args.traced:
            print(traced_section(args.overrides, args.batch, args.seq_len, args.budget_gib))
    except UserError as error:
        print(f"memory_model: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return 0


def zeroth_order(overrides: list[str]) -> bool:
    """The run's algorithm steps on forward passes alone (its lr family is zeroth_order)."""
    from dpbench.api import compose

    return str(compose(list(overrides)).algo.get("lr_family")) == "zeroth_order"


def traced_section(overrides: list[str], batch: int | None, seq_len: int | None, budget_gib: float | None) -> str:
    """The traced prediction of one process's step (docs/memory-prediction.md), as text."""
    from dpbench.tools.benchmarks.memory_trace import predict_step_peak

    traced = predict_step_peak(overrides, batch=batch, seq_len=seq_len, inference_floor=zeroth_order(overrides))
    lines = [f"traced step (one process, {traced['seconds']:.0f} s): peak allocated "
             f"{traced['allocated_bytes'] / GIB:.2f} GiB, predicted reserved {traced['reserved_bytes'] / GIB:.2f} GiB "
             f"(allocated x {1 + traced['reserved_slack']:g})"]
    lines += [f"  {what:12}{size / GIB:9.2f} GiB" for what, size in traced["by_category"].items() if size]
    if "inference_floor_bytes" in traced:  # a zeroth-order method's claim: the memory of inference
        floor = traced["inference_floor_bytes"]
        lines.append(f"inference floor (one forward, no gradient, logits only where the loss reads): "
                     f"{floor / GIB:.2f} GiB allocated; the step is {traced['allocated_bytes'] / floor:.2f}x it")
    if budget_gib is not None:
        fits = traced["reserved_bytes"] <= budget_gib * GIB
        lines.append(f"traced: {'fits' if fits else 'does NOT fit'} in {budget_gib:g} GiB")
        lines.append(traced_max_batch_line(overrides, budget_gib, seq_len))
    lines += [f"assumed: {a}" for a in traced["assumptions"]]
    return "\n".join(lines)


def traced_max_batch_line(overrides: list[str], budget_gib: float, seq_len: int | None = None) -> str:
    """The largest physical batch whose traced step (predicted reserved memory) fits `budget_gib`, by
    doubling then bisection over traces (memory_trace.py's `predicted_search`): what the run itself
    holds, where the analytic table's largest batch extrapolates its per-example rows linearly."""
    from dpbench.tools.benchmarks.memory_trace import predict_step_peak, predicted_search

    def predict(points, batch):
        return predict_step_peak(points, batch=batch, seq_len=seq_len)

    best, traces = predicted_search(overrides, budget_gib * 1024, predict=predict)
    return (f"traced: largest physical batch that fits in {budget_gib:g} GiB: {best} "
            f"({traces} traces: doubling, then bisection; one process)")


if __name__ == "__main__":
    sys.exit(main())
