"""The frozen lower part of a BERT encoder, computed once per token sequence (`model.cache_frozen`).

With the embeddings and the lower L − k encoder layers frozen (`model.trained_blocks=k`), their
output for a sentence depends only on its tokens and the public checkpoint: a public function of
the record, like its tokenisation. Computing it once and training the top k layers and the head on
it changes neither the gradients of what trains nor the privacy analysis (the per-example
gradient is taken through the same function of the record), and saves the lower layers' forward
at every step. Two differences from running them each step, both stated in docs/real-tier.md: the
lower layers run without dropout (eval mode), and always in fp32 (train.precision=bf16 applies to
the trained top part).

One cache per (folder, depth) per process, shared by every model built from that folder (a
dpbench-audit builds dozens) and by their copies (the layout probe's float64 copy): it holds its
own fp32 copy of the frozen modules, so a copy's dtype or mode never changes what it computes.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

WARM_BATCH = 128  # sequences per forward when the task's splits are computed up front (length-sorted)

_CACHES: dict[tuple[str, int], "FrozenPrefixCache"] = {}


def encoder_mask(config, hidden: torch.Tensor, mask: torch.Tensor):
    """The attention mask BertModel hands its layers, for this attention implementation."""
    try:  # transformers 5: per-implementation masks (sdpa, eager, ...), as BertModel builds them
        from transformers.masking_utils import create_bidirectional_mask
    except ImportError:  # transformers 4: the additive [B, 1, 1, T] mask every attention took
        return (1.0 - mask[:, None, None, :].to(hidden.dtype)) * torch.finfo(hidden.dtype).min
    return create_bidirectional_mask(config=config, inputs_embeds=hidden, attention_mask=mask)


def run_layers(layers, config, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    attention = encoder_mask(config, hidden, mask)
    for layer in layers:
        out = layer(hidden, attention)
        hidden = out[0] if isinstance(out, tuple) else out  # transformers 4 returned a tuple
    return hidden


class FrozenPrefixCache:
    """Output of the embeddings and the first `depth` encoder layers, per token sequence (the
    tokens of its attention mask), in fp32; `lookup` pads them into a batch."""

    def __init__(self, bert: nn.Module, depth: int):
        self.depth = depth
        self.config = bert.config
        prefix = nn.ModuleDict({"embeddings": bert.embeddings, "layers": nn.ModuleList(bert.encoder.layer[:depth])})
        self.prefix = copy.deepcopy(prefix).float().eval().requires_grad_(False)
        self.store: dict[tuple[int, ...], torch.Tensor] = {}
        self.pending: list[list[int]] = []  # the task's splits, computed at the first lookup

    def __deepcopy__(self, memo):
        return self  # a model's copy shares its cache: the frozen part's outputs are the same

    def expect(self, sequences: list[list[int]]) -> None:
        """Sequences to compute in length-sorted batches at the first lookup (less padding than
        computing each training batch's misses as they come)."""
        self.pending.extend(sequences)

    @torch.no_grad()
    def _compute(self, sequences: list[tuple[int, ...]], device: torch.device) -> None:
        self.prefix.to(device)
        width = max(len(s) for s in sequences)
        ids = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            mask[row, : len(seq)] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = torch.arange(width, device=device).expand_as(ids)
        with torch.autocast(device.type, enabled=False):  # fp32 whatever train.precision says
            hidden = self.prefix["embeddings"](input_ids=ids, position_ids=positions,
                                               token_type_ids=torch.zeros_like(ids))
            hidden = run_layers(self.prefix["layers"], self.config, hidden, mask)
        for row, seq in enumerate(sequences):
            self.store[seq] = hidden[row, : len(seq)].clone()

    def warm(self, sequences, device: torch.device) -> None:
        missing = sorted({tuple(s) for s in sequences} - self.store.keys(), key=len)
        for start in range(0, len(missing), WARM_BATCH):
            self._compute(missing[start:start + WARM_BATCH], device)

    def lookup(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor | None:
        """[B, T, hidden] fp32 for a right-padded batch; None for any other mask (not cached)."""
        lengths = attention_mask.sum(dim=1)
        width = input_ids.shape[1]
        if not torch.equal(attention_mask.bool(), torch.arange(width, device=lengths.device) < lengths[:, None]):
            return None
        if self.pending:
            pending, self.pending = self.pending, []
            self.warm(pending, input_ids.device)
        keys = [tuple(row[:n]) for row, n in zip(input_ids.tolist(), lengths.tolist())]
        self.warm(keys, input_ids.device)
        out = torch.zeros((len(keys), width, self.config.hidden_size), device=input_ids.device)
        for row, key in enumerate(keys):
            out[row, : len(key)] = self.store[key]
        return out


def prefix_cache(folder, bert: nn.Module, depth: int) -> FrozenPrefixCache:
    """The process's cache of this folder's frozen prefix of this depth (built on first use)."""
    key = (str(folder), depth)
    if key not in _CACHES:
        _CACHES[key] = FrozenPrefixCache(bert, depth)
    return _CACHES[key]
