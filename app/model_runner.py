"""One packed forward pass of every scheduled sequence through a transformers model.

All sequences of a step are concatenated along the token axis of a single batch row. A custom
attention function, registered with transformers' `AttentionInterface`, receives the packed batch
description as a keyword argument, writes each segment's new keys and values into our `KVStore`
and attends each segment's queries to that sequence's cached entries only. Positions are passed
explicitly, so a token keeps its true RoPE position even after entries before it were evicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from compression.kv_store import KVStore, LayerView
from compression.quant import dequantize

ATTENTION_NAME = "conf_kv_packed"


class AttentionObserver(Protocol):
    """Receives what attention saw, for the sequences that asked (see PackedBatch.observe/audit)."""

    def on_attention(self, seq_id: int, layer: int, mass: torch.Tensor) -> None:
        """mass [held]: attention each held entry received, summed over observed queries, mean over heads."""

    def audit_keys(self, seq_id: int, layer: int) -> torch.Tensor | None:
        """Keys [kv_heads, n, head_dim] this sequence dropped in this layer, or None."""

    def on_recall(self, seq_id: int, recall: torch.Tensor) -> None:
        """recall [heads, queries]: share of attention mass that fell on held entries."""


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
            observer.on_attention(seg.seq_id, layer, rows.sum(dim=2).mean(dim=(0, 1)))
        if seg.audit:
            dropped = observer.audit_keys(seg.seq_id, layer)
            if dropped is not None and dropped.shape[1]:
                lost = (torch.matmul(qg, dropped.transpose(1, 2).to(qg.dtype)).float() * scaling).logsumexp(-1)
                kept = scores.logsumexp(-1)
                observer.on_recall(seg.seq_id, torch.sigmoid(kept - lost).view(heads, t))
            else:
                observer.on_recall(seg.seq_id, torch.ones(heads, t))
    return out.view(kv_heads, group, t, d).reshape(1, heads, t, d).to(q.dtype)


AttentionInterface.register(ATTENTION_NAME, packed_kv_attention)
# The SDPA mask serves direct calls; packed calls ignore it and mask per segment.
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of a sequence, starting at position `start`, to run this step."""

    seq_id: int
    token_ids: list[int]
    start: int
    needs_logits: bool
    observe: int = 0  # see Segment
    audit: bool = False


class ModelRunner:
    def __init__(self, model: PreTrainedModel, store: KVStore) -> None:
        self.model = model
        self.store = store
        self.device = next(model.parameters()).device
        model.set_attn_implementation(ATTENTION_NAME)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], observer: AttentionObserver | None = None) -> torch.Tensor:
        """Run one packed forward; return fp32 logits [n, vocab] of the chunks that need them."""
        segments, token_ids, positions, keep = [], [], [], []
        offset = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            segments.append(Segment(chunk.seq_id, offset, offset + n, chunk.observe, chunk.audit))
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + n))
            offset += n
            if chunk.needs_logits:
                keep.append(offset - 1)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        batch = PackedBatch(self.store, segments, position_ids[0], observer)
        if not keep:
            # Nothing to sample (only middle chunks of long prompts): skip the LM head entirely.
            self.model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False, packed_batch=batch)
            return torch.empty(0, self.model.config.vocab_size, device=self.device)
        out = self.model(
            input_ids=input_ids,
            position_ids=position_ids,
            use_cache=False,
            logits_to_keep=torch.tensor(keep, device=self.device),
            packed_batch=batch,
        )
        return out.logits[0].float()
