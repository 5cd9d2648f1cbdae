"""One packed forward pass of every scheduled sequence through a transformers model.

All sequences of a step are concatenated along the token axis of a single batch row. A custom
attention function, registered with transformers' `AttentionInterface`, receives the packed batch
description as a keyword argument, writes each segment's new keys and values into our `KVStore`
and attends each segment's queries to that sequence's cached entries only. Positions are passed
explicitly, so a token keeps its true RoPE position even after entries before it were evicted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from compression.kv_store import KVStore

ATTENTION_NAME = "conf_kv_packed"


@dataclass
class Segment:
    """The slice [start, end) of the packed batch that belongs to one sequence."""

    seq_id: int
    start: int
    end: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass
class PackedBatch:
    store: KVStore
    segments: list[Segment]
    positions: torch.Tensor  # [num_tokens]


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
    outputs = []
    for seg in packed_batch.segments:
        s, e = seg.start, seg.end
        store.append(seg.seq_id, layer, key[0, :, s:e], value[0, :, s:e], packed_batch.positions[s:e])
        keys, values = store.view(seg.seq_id, layer)
        mask = None
        if seg.num_tokens > 1:
            # New entries sit at the end of the cache: query i sees everything older than
            # the new block plus new entries up to itself.
            held, new = keys.shape[1], seg.num_tokens
            cols = torch.arange(held, device=keys.device)
            rows = torch.arange(new, device=keys.device).unsqueeze(1)
            mask = cols <= rows + (held - new)
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, s:e],
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=mask,
                scale=scaling,
                enable_gqa=True,
            )
        )
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=2)
    return out.transpose(1, 2), None


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


class ModelRunner:
    def __init__(self, model: PreTrainedModel, store: KVStore) -> None:
        self.model = model
        self.store = store
        self.device = next(model.parameters()).device
        model.set_attn_implementation(ATTENTION_NAME)

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Run one packed forward; return fp32 logits [n, vocab] of the chunks that need them."""
        segments, token_ids, positions, keep = [], [], [], []
        offset = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            segments.append(Segment(chunk.seq_id, offset, offset + n))
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + n))
            offset += n
            if chunk.needs_logits:
                keep.append(offset - 1)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        batch = PackedBatch(self.store, segments, position_ids[0])
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
