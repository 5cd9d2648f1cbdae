"""One packed forward pass of every scheduled sequence through a transformers model.

All sequences of a step are concatenated along the token axis of a single batch row. A custom
attention function, registered with transformers' `AttentionInterface` when the runner is made,
receives the packed batch description as a keyword argument, writes each segment's new keys and
values into our `KVStore` and attends each segment's queries to that sequence's cached entries
only. Positions are passed explicitly, so a token keeps its true RoPE position even after entries
before it were evicted.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from confkv.engine.sequence import ScheduledChunk
from confkv.kv.attention import ATTENTION_NAME, AttentionObserver, PackedBatch, Segment, register_attention
from confkv.kv.kv_store import KVStore


class ModelRunner:
    def __init__(self, model: PreTrainedModel, store: KVStore) -> None:
        self.model = model
        self.store = store
        self.device = next(model.parameters()).device
        # For tests, called in the order added after each forward with its chunks and the logits it
        # returns (a row per chunk that needs one): a hook may change them in place, or raise to fail it.
        self.after_forward: list[Callable[[list[ScheduledChunk], torch.Tensor], None]] = []
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)

    @torch.inference_mode()
    def run(
        self, chunks: list[ScheduledChunk], observer: AttentionObserver | None = None
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run one packed forward; return fp32 logits [n, vocab] of the chunks that need them, and by
        seq_id the logits [k, vocab] of the chunks' `prompt_positions` (their prompt log-probabilities)."""
        segments, token_ids, positions, keep = [], [], [], []
        prompt_rows: dict[int, range] = {}  # seq_id -> its prompt positions' rows among those kept
        sample_rows = []  # the rows kept for sampling, where prompt rows lie among them
        offset = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            segments.append(Segment(chunk.seq_id, offset, offset + n, chunk.observe, chunk.audit))
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + n))
            if chunk.prompt_positions:
                prompt_rows[chunk.seq_id] = range(len(keep), len(keep) + len(chunk.prompt_positions))
                keep.extend(offset + p - chunk.start for p in chunk.prompt_positions)
            offset += n
            if chunk.needs_logits:
                sample_rows.append(len(keep))
                keep.append(offset - 1)
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        position_ids = torch.tensor([positions], dtype=torch.long, device=self.device)
        batch = PackedBatch(self.store, segments, position_ids[0], observer)
        if keep:
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=torch.tensor(keep, device=self.device),
                packed_batch=batch,
            )
            logits = out.logits[0].float()
        else:
            # Nothing to sample (only middle chunks of long prompts): skip the LM head entirely.
            self.model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False, packed_batch=batch)
            logits = torch.empty(0, self.model.config.vocab_size, device=self.device)
        prompt_logits = {seq_id: logits[rows.start : rows.stop] for seq_id, rows in prompt_rows.items()}
        if prompt_rows:
            logits = logits[torch.tensor(sample_rows, dtype=torch.long, device=logits.device)]
        for hook in self.after_forward:
            hook(chunks, logits)
        return logits, prompt_logits
