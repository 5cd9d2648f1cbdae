"""Attention over the tiered KV store, registered with transformers' `AttentionInterface`.

A forward pass carries a `PackedBatch` keyword argument: the store, the segments of the packed
token axis that belong to each sequence, and their true positions. For every segment the function
appends the new keys and values to that sequence's cache and attends the segment's queries to that
sequence's entries only. A plain SDPA call serves sequences with only FULL entries and nothing to
observe; otherwise probabilities are computed explicitly, so that KEY_ONLY values can be
dequantised, attention can be reported for scoring, and recall can be audited against dropped keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from compression.kv_store import KVStore, LayerView
from compression.quant import dequantize

ATTENTION_NAME = "conf_kv_packed"


class AttentionObserver(Protocol):
    """Receives what attention saw, for the sequences that asked (see PackedBatch.observe/audit)."""

    def on_attention(self, seq_id: int, layer: int, rows: torch.Tensor) -> None:
        """rows [observed queries, held]: attention each held entry received from each query, mean over heads."""

    def audit_keys(self, seq_id: int, layer: int) -> torch.Tensor | None:
        """Keys [kv_heads, n, head_dim] this sequence dropped in this layer, or None."""

    def on_audit(self, seq_id: int, layer: int, recall: torch.Tensor, dropped_mass: torch.Tensor | None) -> None:
        """recall [heads, queries]: share of attention mass that fell on held entries; dropped_mass
        [dropped]: the attention each dropped entry would have received (mean over heads and queries)."""


@dataclass
class Segment:
    """The slice [start, end) of the packed batch that belongs to one sequence."""

    seq_id: int
    start: int
    end: int
    observe: int = 0  # report attention of the last `observe` queries to the observer
    audit: bool = False  # measure recall against the keys this sequence dropped

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class PackedBatch:
    store: KVStore
    segments: list[Segment]
    positions: torch.Tensor  # [num_tokens]
    observer: AttentionObserver | None = None


def packed_kv_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    packed_batch: PackedBatch | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, D], key/value [1, kv_heads, T, D] -> output [1, T, heads, D].

    Without a packed batch (the model called directly, e.g. by `generate`) it is plain SDPA.
    """
    if packed_batch is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    store, layer = packed_batch.store, module.layer_idx
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    outputs = []
    for seg in packed_batch.segments:
        s, e = seg.start, seg.end
        store.append(seg.seq_id, layer, key[0, :, s:e], value[0, :, s:e], packed_batch.positions[s:e])
        kv = store.view(seg.seq_id, layer)
        mask = _causal_mask(kv.keys.shape[1], seg.num_tokens, kv.keys.device)
        q = query[:, :, s:e]
        if kv.ko_values is None and not seg.observe and not seg.audit:
            out = F.scaled_dot_product_attention(
                q, kv.keys.unsqueeze(0), kv.values.unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=True
            )
        else:
            out = _tiered_attention(q, kv, mask, scaling, seg, layer, packed_batch.observer)
        outputs.append(out)
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2), None


def _causal_mask(held: int, new: int, device: torch.device) -> torch.Tensor | None:
    """New entries sit at the end of the cache: query i sees everything older plus new entries up to i."""
    if new == 1:
        return None
    cols = torch.arange(held, device=device)
    rows = torch.arange(new, device=device).unsqueeze(1)
    return cols <= rows + (held - new)


def _tiered_attention(
    q: torch.Tensor,
    kv: LayerView,
    mask: torch.Tensor | None,
    scaling: float,
    seg: Segment,
    layer: int,
    observer: AttentionObserver | None,
) -> torch.Tensor:
    """Attention with explicit probabilities: KEY_ONLY values dequantised, observation and audit."""
    _, heads, t, d = q.shape
    kv_heads = kv.keys.shape[0]
    group = heads // kv_heads
    qg = q[0].reshape(kv_heads, group * t, d)
    scores = torch.matmul(qg, kv.keys.transpose(1, 2)).float() * scaling  # [kv_heads, group*t, held]
    if mask is not None:
        scores = scores.view(kv_heads, group, t, -1).masked_fill(~mask, float("-inf")).view(kv_heads, group * t, -1)
    probs = scores.softmax(dim=-1)
    n_ko = kv.num_key_only
    out = torch.matmul(probs[..., n_ko:].to(kv.values.dtype), kv.values)
    if n_ko:
        ko_values = dequantize(kv.ko_values, kv.values.dtype)
        out = out + torch.matmul(probs[..., :n_ko].to(kv.values.dtype), ko_values)
    if observer is not None:
        if seg.observe:
            rows = probs.view(kv_heads, group, t, -1)[:, :, -seg.observe :]
            observer.on_attention(seg.seq_id, layer, rows.mean(dim=(0, 1)))
        if seg.audit:
            dropped = observer.audit_keys(seg.seq_id, layer)
            if dropped is not None and dropped.shape[1]:
                dropped_scores = torch.matmul(qg, dropped.transpose(1, 2).to(qg.dtype)).float() * scaling
                lost = dropped_scores.logsumexp(-1)
                kept = scores.logsumexp(-1)
                # As if the dropped keys were still there: their share of the full softmax.
                dropped_mass = (dropped_scores - torch.logaddexp(kept, lost).unsqueeze(-1)).exp().mean(dim=(0, 1))
                observer.on_audit(seg.seq_id, layer, torch.sigmoid(kept - lost).view(heads, t), dropped_mass)
            else:
                observer.on_audit(seg.seq_id, layer, torch.ones(heads, t), None)
    return out.view(kv_heads, group, t, d).reshape(1, heads, t, d).to(q.dtype)


AttentionInterface.register(ATTENTION_NAME, packed_kv_attention)
# The SDPA mask serves direct calls; packed calls ignore it and mask per segment.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
