"""Three published memory figures, measured with dpbench and predicted by the traced oracle.

All three are RoBERTa-large on SST-2 (so one random-init stand-in serves them, and each fits one
80 GB card in a minute): the DP-GRAPE paper's Fig. 3 text (B = 40, reserved, GB = 1e9 B) for
DP-GRAPE and DP-Adam, and DPZero's Table 3 (MeZO = DPZero, MiB, the measure unstated). The node is
offline, so the run reads a random-init model folder at the published configuration (with the
tiny public-text tokenizer: the embedding keeps RoBERTa's 50,265 rows) and synthetic SST-2 records
long enough that every prompt fills the template's 128 tokens. Each point is one `dpbench`
process (`max_batch.probe`: a few steps at one batch size, memory from its results.json).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dpbench.tools.benchmarks.published_memory import POINTS as PUBLISHED
from dpbench.tools.benchmarks.published_memory import Point as PublishedPoint

MIB = 2**20
SEQ_LEN = 128  # the LM-BFF SST-2 template's max_length (the papers do not state theirs)


@dataclass(frozen=True)
class Point:
    key: str
    published: PublishedPoint  # the catalogue's entry: source, method, overrides, batch, figure
    text: str  # the figure as printed, with its measure
    assumptions: list[str] = field(default_factory=list)

    @property
    def source(self) -> str:
        return self.published.source

    @property
    def algo(self) -> list[str]:
        return [o for o in self.published.overrides if o.startswith("algo")]

    @property
    def batch(self) -> int:
        return self.published.batch

    @property
    def published_bytes(self) -> int:
        return int(self.published.published)


def published(source: str, method: str) -> PublishedPoint:
    """One entry of the published-memory catalogue (tools/benchmarks/published_memory.py), so a figure
    is typed in one place."""
    return next(p for p in PUBLISHED if p.source == source and p.method == method)


POINTS = (
    Point("dpgrape_fig3_grape", published("DP-GRAPE, Fig. 3", "DP-GRAPE"), "DP-GRAPE 24.4 GB reserved",
          ["GB = 1e9 B", "sequence length 128 (LM-BFF template)", "dpbench's default DP-GRAPE engine"]),
    Point("dpgrape_fig3_dpadam", published("DP-GRAPE, Fig. 3", "DP-Adam"), "DP-Adam 78.1 GB reserved",
          ["GB = 1e9 B", "sequence length 128 (LM-BFF template)", "dpbench's default DP-Adam engine"]),
    Point("dpzero_t3_dpzero", published("DPZero, Table 3", "MeZO = DPZero"), "MeZO = DPZero 2,668 MiB (measure unstated)",
          ["batch 64 (MeZO's RoBERTa setting; the table does not state it)", "sequence length 128 (LM-BFF template)"]),
)


def point_overrides(point: Point, batch: int, model: Path | None, data: Path, device: str) -> list[str]:
    """The run's overrides: the published model (`model`: the stand-in folder; None: the tiny
    random-init RoBERTa of the CPU fallback), the synthetic SST-2 folder, a fixed noise multiplier
    (a memory probe, not a calibrated run)."""
    size = ["model.size=large", f"model.path={model}"] if model else ["model.size=tiny"]
    k_shot = max(8, batch)  # the k-shot sampler draws k per class from the synthetic records
    return ["model=roberta", *size, "dataset=sst2", f"dataset.path={data}", f"dataset.k_shot={k_shot}",
            "dataset.num_test=8", "dataset.eval_batch_size=8", *point.algo, "privacy.noise_multiplier=1.0",
            f"train.physical_batch_size={batch}", f"device={device}"]


def write_sst2(folder: Path, records: int) -> Path:
    """Synthetic SST-2 records (the hub's fields): each sentence is longer than the template's 128
    tokens, so every prompt is cut to exactly that length."""
    from dpbench.data.public_text import COMMON_ENGLISH_WORDS

    words = list(dict.fromkeys(COMMON_ENGLISH_WORDS))
    folder.mkdir(parents=True, exist_ok=True)
    for split, count in (("train", records), ("validation", 16)):
        lines = []
        for i in range(count):
            sentence = " ".join(words[(i * 7 + j) % len(words)] for j in range(2 * SEQ_LEN))
            lines.append(json.dumps({"sentence": sentence, "label": i % 2, "idx": i}))
        (folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def write_roberta_large(folder: Path) -> Path:
    """A random-init RoBERTa-large (its published configuration) with the tiny public-text tokenizer."""
    import torch
    import transformers

    from dpbench.models.language import public_tokenizer_corpus, train_tiny_tokenizer
    from dpbench.tools.benchmarks.model_shapes import KNOWN_CONFIGS

    if (folder / "config.json").exists():
        return folder
    tokenizer = train_tiny_tokenizer("roberta", public_tokenizer_corpus())
    device = "cuda" if torch.cuda.is_available() else "cpu"  # random init of 355M weights: seconds on a GPU
    with torch.device(device):
        model = transformers.RobertaForMaskedLM(transformers.RobertaConfig(**KNOWN_CONFIGS["FacebookAI/roberta-large"]))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def predict(overrides: list[str], batch: int, seq_len: int) -> dict:
    """The traced oracle's prediction, or why there is none (its error)."""
    from dpbench.tools.benchmarks import memory_trace

    try:
        prediction = memory_trace.predict_step_peak(list(overrides), batch=batch, seq_len=seq_len)
    except Exception as error:  # noqa: BLE001 - the measurement stands without it; the row says why
        return {"status": f"no prediction ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"[:200]}
    return {"status": "ok", **prediction}


def ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def measure(point: Point, batch: int, overrides: list[str], workdir: Path, on_cuda: bool, timeout_s: float,
            steps: int) -> dict:
    """One dpbench process at the point's batch: reserved and allocated peaks (CPU: the own peak)."""
    from dpbench.tools.benchmarks import max_batch

    budget_mib = 10**7  # no cap below the card (GPU) and no kill (CPU): a measurement, not a search
    if on_cuda:
        import torch

        budget_mib = torch.cuda.get_device_properties(0).total_memory / MIB
    outcome = max_batch.probe(batch, overrides, budget_mib, 1024, workdir / point.key, timeout_s, steps, on_cuda)
    # CPU: the run's own peak resident size stands in for reserved; there is no allocator's figure
    reserved = outcome.get("reserved_mib") if on_cuda else outcome.get("own_mib")
    allocated = outcome.get("allocated_mib")
    return {"ok": "reason" not in outcome, "reason": outcome.get("reason"),
            "reserved_bytes": None if reserved is None else int(reserved * MIB),
            "allocated_bytes": None if allocated is None else int(allocated * MIB),
            "samples_per_s": outcome.get("samples_per_s")}


def records_needed(batch: int) -> int:
    """Synthetic training records for the k-shot sampler: k per class for train and again for dev."""
    return 4 * max(8, batch)


def run_point(point: Point, model: Path | None, data: Path, device: str, workdir: Path, timeout_s: float,
              steps: int, batch: int | None = None) -> dict:
    """Measure and predict one point; `batch` replaces the published one (the CPU fallback's tiny runs)."""
    batch = batch or point.batch
    overrides = point_overrides(point, batch, model, data, device)
    measured = measure(point, batch, overrides, workdir, device == "cuda", timeout_s, steps)
    prediction = predict(overrides, batch, SEQ_LEN)
    return {"key": point.key, "source": point.source, "overrides": overrides, "batch": batch, "seq_len": SEQ_LEN,
            "published": {"bytes": point.published_bytes, "text": point.text},
            "assumptions": point.assumptions, "measured": measured, "prediction": prediction,
            "measured_vs_published": ratio(measured["reserved_bytes"], point.published_bytes),
            "predicted_vs_measured": ratio(prediction.get("reserved_bytes"), measured["reserved_bytes"]),
            "predicted_vs_published": ratio(prediction.get("reserved_bytes"), point.published_bytes)}
