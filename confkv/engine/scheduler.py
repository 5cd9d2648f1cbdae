"""Continuous batching under a KV byte budget.

Each step the scheduler picks what runs: one token for every decoding sequence, then prompt
chunks (chunked prefill) of running and newly admitted sequences, within a per-step token
budget. A sequence is admitted only when its remaining prompt fits in the free KV bytes; one that
cannot fit lets those behind it that fit now go first, a bounded number of them (`_admit`). When a
running sequence cannot grow, memory is found in this order: parked prefix-cache entries go
first (LRU-K), then running sequences that compress are squeezed (their rate raised step by step
up to a ceiling), and only then is the newest running sequence preempted: its cache is freed and it is
requeued at the front to be recomputed later. A waiting sequence whose tokens start with a
parked sequence's tokens starts from a copy of those entries (prefix reuse).

The scheduler is the one place where a sequence finishes or is preempted: it sets the state, tells
its listeners (in the order they were given) while the sequence's KV is still held, then frees it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from confkv.engine.sequence import FinishReason, ScheduledChunk, Sequence, SequenceStatus
from confkv.kv.kv_store import KVBudgetExceeded, KVStore
from confkv.kv.prefix_cache import PrefixCache, PrefixHit


class SequenceListener(Protocol):
    """Told when a sequence finishes or is preempted, before its KV is freed."""

    def finished(self, seq: Sequence) -> None:
        """For good: its status, finish_reason and error are set."""

    def preempted(self, seq: Sequence) -> None:
        """Requeued to be recomputed from scratch."""


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    sequences: list[Sequence] = field(default_factory=list)  # same order as chunks
    rejected: list[Sequence] = field(default_factory=list)  # can never fit the budget
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # scheduled for the first time

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        store: KVStore,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_cache: PrefixCache | None = None,
        squeeze: Callable[[list[Sequence]], bool] | None = None,
        listeners: list[SequenceListener] | None = None,
    ) -> None:
        self.store = store
        self.prefix_cache = prefix_cache
        self.squeeze = squeeze  # compresses running sequences harder; True if it freed bytes
        self.listeners = listeners or []
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, compressing: Collection[int] = ()) -> SchedulerOutput:
        """What runs in this step. The `compressing` sequences (by seq_id) sit it out, their
        compression running beside it, but stay running: they hold their memory, and may be
        squeezed or preempted."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Running sequences first, oldest first: decodes take one token, prefills a chunk.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running or seq.seq_id in compressing:  # preempted making room for an older one
                continue
            n = self._chunk(seq, budget)
            if self._reserve_or_preempt(seq, n, out):
                self._emit(seq, n, out)
                budget -= n
        # Then admit waiting sequences while their prompts fit.
        self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order while they fit. The first that cannot fit (running requests
        hold the memory) waits for them to finish, but does not hold up those behind it that fit in
        the free bytes now, evicting nothing: a chat turn runs beside a long request's wait and
        reuses its conversation's cache while it is still there. At most `max_num_seqs` may pass a
        waiting sequence, then it has the next free memory to itself: it never starves."""
        blocked: Sequence | None = None
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            seq = self.waiting[i]
            need = self.store.bytes_for(seq.num_uncomputed, self.store.codec_of(seq.seq_id))
            if need > self.store.max_bytes:
                del self.waiting[i]
                out.rejected.append(seq)
                continue
            if blocked is not None and need > self.store.free_bytes:
                i += 1
                continue
            hit = None
            # NOTE: a request that asks for its prompt's log-probabilities computes every prompt token (as vLLM's).
            looks_up = self.prefix_cache is not None and seq.params.prompt_logprobs is None
            if looks_up:
                hit = self.prefix_cache.lookup(seq.token_ids, seq.prefix_fingerprint, seq.prefill_tail)
            if blocked is None:
                if hit is not None and not self._make_room(need, keep=hit.entry_id):
                    hit = None  # the copy does not fit beside its source: let the source go too, prefill it all
                if not self._make_room(need):
                    blocked = seq
                    if seq.overtaken >= self.max_num_seqs:
                        return
                    i += 1
                    continue
            if hit is not None and not self._reuse(seq, hit):
                hit = None
            n = self._chunk(seq, budget)
            if not self._reserve_admitted(seq, n):
                self.store.free(seq.seq_id, preempted=True)
                seq.restart()
                return
            del self.waiting[i]
            if blocked is not None:
                blocked.overtaken += 1
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                out.admitted.append(seq)
                if looks_up:
                    self.prefix_cache.admitted(hit)
            self.running.append(seq)
            self._emit(seq, n, out)
            budget -= n
            if blocked is not None and blocked.overtaken >= self.max_num_seqs:
                return

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Take a sequence out of the scheduler for good, tell the listeners and give its memory back."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        try:
            for listener in self.listeners:
                listener.finished(seq)
        finally:  # memory comes back whatever a listener did
            self.store.free(seq.seq_id)

    # ----- internals ---------------------------------------------------------------------
    @staticmethod
    def _chunk(seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute in this step: within the budget, and a prefill split so that
        its last chunk holds the queries its end-of-prefill compression observes."""
        left = seq.num_uncomputed
        n = min(left, budget)
        if n < left and left - seq.prefill_tail > 0:
            n = min(n, left - seq.prefill_tail)
        return n

    def _make_room(self, need: int, keep: int | None = None) -> bool:
        """Free parked prefix-cache entries (never `keep`) until `need` bytes are free; none at all
        where evicting every one could not free enough (running requests hold the memory): a waiting
        request must not empty the cache it may be about to reuse, step after step, and still wait."""
        if need <= self.store.free_bytes:
            return True
        if self.prefix_cache is None or need > self.store.free_bytes + self.prefix_cache.reclaimable_bytes(keep):
            return False
        while need > self.store.free_bytes:
            if not self.prefix_cache.evict_one(keep):
                return False
        return True

    def _reserve_admitted(self, seq: Sequence, n: int) -> bool:
        """Reserve the first chunk of a sequence being admitted. Its bytes fit (`_make_room`), but the
        arena's pages may not, where parked caches of other storage formats hold them partly used.
        With requests running it waits for them, as for bytes, and the cache stays; with none, nothing
        else would ever free a page, so parked entries go one at a time until its pages fit (with all
        of them gone, a request within the budget fits)."""
        while True:
            try:
                self.store.reserve(seq.seq_id, n)
                return True
            except KVBudgetExceeded:
                if self.running or self.prefix_cache is None or not self.prefix_cache.evict_one():
                    return False

    def _reuse(self, seq: Sequence, hit: PrefixHit) -> bool:
        """Start `seq` from the hit's entries; False where their copies do not fit (it prefills all)."""
        try:
            self.prefix_cache.adopt(seq.seq_id, hit)
        except KVBudgetExceeded:
            return False
        seq.num_computed = hit.num_tokens
        seq.num_cached_tokens = min(hit.num_tokens, seq.num_prompt_tokens)
        seq.prefix_parked = hit.parked
        return True

    def _emit(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        start = seq.num_computed
        tokens = seq.token_ids[start : start + n]
        positions = range(0)
        if seq.params.prompt_logprobs is not None:
            positions = range(max(start, len(seq.prompt_logprobs)), min(start + n, seq.num_prompt_tokens - 1))
        out.chunks.append(
            ScheduledChunk(seq.seq_id, tokens, start, start + n == len(seq.token_ids), prompt_positions=positions)
        )
        out.sequences.append(seq)

    def _reserve_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Reserve room for n tokens of `seq`, preempting newer sequences as needed."""
        while True:
            try:
                self.store.reserve(seq.seq_id, n)
                return True
            except KVBudgetExceeded:
                if self.prefix_cache is not None and self.prefix_cache.evict_one():
                    continue  # parked prefix-cache entries go first
                # Then compress harder, but not the sequences whose room this step is already reserved.
                squeezable = [s for s in self.running if s not in out.sequences]
                if self.squeeze is not None and self.squeeze(squeezable):
                    continue
                victim = self.running[-1]  # newest; never one already scheduled this step
                if victim is seq and len(self.running) == 1:
                    out.rejected.append(seq)  # alone and still too big: it can never finish
                    return False
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return False

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        for listener in self.listeners:
            listener.preempted(seq)
        self.store.free(seq.seq_id, preempted=True)
        seq.restart()
        self.waiting.appendleft(seq)
