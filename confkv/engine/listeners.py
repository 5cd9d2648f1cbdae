"""The compressor and the prefix cache as scheduler listeners: what each does as a
sequence finishes or is preempted (their own APIs speak of sequence ids)."""

from __future__ import annotations

from confkv.compress.compressor import Compressor
from confkv.engine.sequence import FinishReason, Sequence
from confkv.kv.prefix_cache import PrefixCache


class CompressionListener:
    def __init__(self, compression: Compressor) -> None:
        self.compression = compression

    def finished(self, seq: Sequence) -> None:
        """Forget it; its metrics and tier history, read while its KV is still held, stay on it for
        its final output."""
        seq.tier_history = self.compression.history(seq.seq_id, seq.num_computed)
        seq.compression_metrics = self.compression.release(
            seq.seq_id, seq.num_computed, seq.num_cached_tokens, seq.prefix_parked
        )

    def preempted(self, seq: Sequence) -> None:
        self.compression.preempted(seq.seq_id)


class PrefixCacheListener:
    def __init__(self, prefix_cache: PrefixCache) -> None:
        self.prefix_cache = prefix_cache

    def finished(self, seq: Sequence) -> None:
        """Take the KV of a request that ended normally; one that failed or was cut short is not reused."""
        if seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.prefix_cache.insert(seq.seq_id, seq.token_ids[: seq.num_computed], seq.prefix_fingerprint)

    def preempted(self, seq: Sequence) -> None:
        """Nothing to keep: its KV is recomputed."""
