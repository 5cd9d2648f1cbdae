"""Attention over the block KV store, registered with transformers' `AttentionInterface` by
`register_attention()` (a model then selects it with `set_attn_implementation(ATTENTION_NAME)`).

A forward pass carries a `PackedBatch` keyword argument: the store, the segments of the packed
token axis that belong to each sequence, and their true positions. The store plans the step once
(where every new entry goes, which rows decode); then in every layer the new keys and values are
written into their blocks, all decode rows (one-token segments) go through one call of the paged
decode kernel, which reads the blocks in place and reports observed attention on the way, and
each prefill chunk attends to its sequence's entries, gathered, through SDPA; the chunk's last queries,
where the compressor observes them, again explicitly for their probabilities. Only decode rows are
audited against dropped keys (`Compressor.prepare`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from confkv.kv import paged_attention
from confkv.kv.kv_store import KVStore
from confkv.kv.step_plan import StepPlan

ATTENTION_NAME = "conf_kv_packed"


class AttentionObserver(Protocol):
    """Receives what attention saw, for the sequences that asked (see PackedBatch.observe/audit)."""

    def on_attention(self, seq_id: int, layer: int, rows: torch.Tensor) -> None:
        """rows [observed queries, held]: attention each held entry received from each query, mean over heads."""

    def on_decode_attention(self, layer: int, seq_ids: list[int], rows: torch.Tensor) -> None:
        """rows [sequences, width]: the attention of each sequence's one decode query, zero past its entries."""

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
    audit: bool = False  # a decode row: measure recall against the keys this sequence dropped

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class PackedBatch:
    store: KVStore
    segments: list[Segment]
    positions: torch.Tensor  # [num_tokens]
    observer: AttentionObserver | None = None
    plan: StepPlan = field(init=False)
    observed: list[int] = field(init=False)  # sequences whose decode row is observed, in the kernel's order
    audited: list[tuple[int, Segment]] = field(init=False)  # decode rows audited, with their segments

    def __post_init__(self) -> None:
        self.plan = self.store.begin_step(self.segments, self.positions)
        decoding = [seg for seg in self.segments if seg.num_tokens == 1]
        self.observed = [seg.seq_id for seg in decoding if seg.observe]
        self.audited = [(row, seg) for row, seg in enumerate(decoding) if seg.audit]


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
    store, layer, plan = packed_batch.store, module.layer_idx, packed_batch.plan
    observer = packed_batch.observer
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    store.write(layer, plan, key[0], value[0])
    decoded = _decode(packed_batch, layer, query, scaling) if plan.decode_tokens.numel() else None
    if plan.only_decode:  # no prefill to place the decode rows among
        return decoded.unsqueeze(0), None
    out = query.new_empty(query.shape[2], query.shape[1], query.shape[3])  # [T, heads, D]
    if decoded is not None:
        out[plan.decode_tokens] = decoded
    for seg in packed_batch.segments:
        if seg.num_tokens > 1:
            out[seg.start : seg.end] = _prefill_attention(
                query[:, :, seg.start : seg.end], store, seg, layer, scaling, observer
            )
    return out.unsqueeze(0), None


def _decode(batch: PackedBatch, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """All decode rows of one layer through the paged kernel -> [rows, heads, D] in query's dtype; their
    attention goes to the observer."""
    plan = batch.plan
    rows = query[0] if plan.only_decode else query[0, :, plan.decode_tokens]
    rows = rows.transpose(0, 1)  # [rows, heads, D]
    result = paged_attention.decode_attention(batch.store.decode_batch(layer, plan, rows.float().contiguous(), scaling))
    if batch.observer is not None:
        _report_decode(batch.observer, batch, layer, rows, result.lse, result.observed, scaling)
    return result.out.to(query.dtype)


def _report_decode(
    observer: AttentionObserver,
    batch: PackedBatch,
    layer: int,
    rows: torch.Tensor,
    lse: torch.Tensor,
    observed: torch.Tensor,
    scaling: float,
) -> None:
    """Hand the observed decode rows' attention (all at once) and the audited ones' to the observer."""
    if batch.observed:
        observer.on_decode_attention(layer, batch.observed, observed)
    kv_heads = batch.store.num_kv_heads
    for row, seg in batch.audited:
        q = rows[row].reshape(kv_heads, -1, rows.shape[-1])
        _audit(observer, seg, layer, q, lse[row].view(kv_heads, -1), scaling)


def _prefill_attention(
    q: torch.Tensor, store: KVStore, seg: Segment, layer: int, scaling: float, observer: AttentionObserver | None
) -> torch.Tensor:
    """One prefill chunk (q [1, heads, t, D]) against its sequence's entries -> [t, heads, D]."""
    kv = store.view(seg.seq_id, layer)
    mask = _causal_mask(kv.keys.shape[1], seg.num_tokens, kv.keys.device, store.windows[layer])
    # KEY_ONLY entries come first among the keys: their values, then the FULL ones, line up with them.
    values = kv.values if kv.key_only_values is None else torch.cat((kv.key_only_values, kv.values), dim=1)
    out = F.scaled_dot_product_attention(
        q, kv.keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=True
    )
    if seg.observe and observer is not None:
        observer.on_attention(seg.seq_id, layer, _observed_rows(q[0, :, -seg.observe :], kv.keys, mask, scaling))
    return out[0].transpose(0, 1)


def _observed_rows(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """The attention of a chunk's last queries (q [heads, w, D]) over keys [kv_heads, held, D], mean
    over heads -> [w, held]. Only these rows are made explicit: SDPA never forms a chunk's
    [heads, t, held] probabilities, which cost several times its attention at a few thousand keys."""
    kv_heads, (heads, w, d) = keys.shape[0], q.shape
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(kv_heads, group * w, d), keys.transpose(1, 2)).float() * scaling
    scores = scores.view(kv_heads, group, w, -1).masked_fill(~mask[-w:], float("-inf"))
    return scores.softmax(dim=-1).mean(dim=(0, 1))


def _causal_mask(held: int, new: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """New entries sit at the end of the cache: query i sees everything older plus new entries up to i;
    in a sliding-window layer (entries in position order, none missing) only the last `window` of them."""
    cols = torch.arange(held, device=device)
    rows = torch.arange(new, device=device).unsqueeze(1) + (held - new)
    mask = cols <= rows
    return mask & (cols > rows - window) if window else mask


def _audit(
    observer: AttentionObserver, seg: Segment, layer: int, qg: torch.Tensor, kept: torch.Tensor, scaling: float
) -> None:
    """Recall against the keys this sequence dropped: qg [kv_heads, queries, D] (a head group's
    queries together), kept [kv_heads, queries] the log-sum-exp of their scores on held entries."""
    dropped = observer.audit_keys(seg.seq_id, layer)
    if dropped is None or not dropped.shape[1]:
        observer.on_audit(seg.seq_id, layer, torch.ones(kept.numel(), 1), None)
        return
    dropped_scores = torch.matmul(qg, dropped.transpose(1, 2).to(qg.dtype)).float() * scaling
    lost = dropped_scores.logsumexp(-1)
    # As if the dropped keys were still there: their share of the full softmax.
    dropped_mass = (dropped_scores - torch.logaddexp(kept, lost).unsqueeze(-1)).exp().mean(dim=(0, 1))
    observer.on_audit(seg.seq_id, layer, torch.sigmoid(kept - lost).view(kept.numel(), 1), dropped_mass)


def register_attention() -> None:
    """Make `ATTENTION_NAME` known to transformers, before a model selects it. Idempotent: the
    registries map the name, so registering again replaces it with the same functions."""
    AttentionInterface.register(ATTENTION_NAME, packed_kv_attention)
    # The SDPA mask serves direct calls; packed calls ignore it and mask per segment.
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
