"""The prefix cache: finished requests' KV, kept (compressed as it is) for the requests that follow.

When a request ends, its cache is parked here with its token ids and a fingerprint of the
compression settings it was built under. A new request whose tokens start with a parked
sequence's tokens (the longest common prefix, under the same fingerprint) starts from those entries,
sharing their blocks, and prefills only the rest: turn 2 of a chat reuses turn 1. Parked bytes count
against `max_cache_size`; under memory pressure they are the first to go, by LRU-K.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from compression.kv_store import KVStore, ParkedKV
from compression.lru import LRUK


@dataclass
class CachedPrefix:
    token_ids: torch.Tensor  # [n] the tokens whose entries `kv` holds (positions 0..n-1, some maybe dropped)
    fingerprint: Hashable
    kv: ParkedKV


@dataclass
class PrefixHit:
    entry_id: int
    num_tokens: int  # tokens of the request served from the cache


class PrefixCache:
    def __init__(self, store: KVStore, k: int = 2, min_tokens: int = 16) -> None:
        self.store = store
        self.min_tokens = min_tokens  # shorter matches are not worth a copy
        self.entries: dict[int, CachedPrefix] = {}
        self.lru = LRUK(k)
        self._ids = itertools.count()
        self.queries = 0
        self.hits = 0
        self.evictions: Counter[str] = Counter()  # entries evicted, by reason
        self.warmup_tokens = 0  # prompt tokens prefilled at start-up

    def __len__(self) -> int:
        return len(self.entries)

    def insert(self, seq_id: int, token_ids: list[int], fingerprint: Hashable) -> None:
        """Park a finished sequence's cache; it supersedes cached prefixes of its own tokens."""
        kv = self.store.park(seq_id)
        if kv is None or len(token_ids) < self.min_tokens:
            if kv is not None:
                self.store.discard(kv)
            return
        tokens = torch.tensor(token_ids)
        for entry_id, entry in list(self.entries.items()):
            if entry.fingerprint == fingerprint and _common_prefix(entry.token_ids, tokens) == len(entry.token_ids):
                self._evict(entry_id, "superseded")
        entry_id = next(self._ids)
        self.entries[entry_id] = CachedPrefix(tokens, fingerprint, kv)
        self.lru.touch(entry_id)

    def lookup(self, token_ids: list[int], fingerprint: Hashable) -> PrefixHit | None:
        """The longest cached prefix of `token_ids` under `fingerprint`, leaving one token to compute."""
        self.queries += 1
        tokens = torch.tensor(token_ids)
        best: PrefixHit | None = None
        for entry_id, entry in self.entries.items():
            if entry.fingerprint != fingerprint:
                continue
            n = min(_common_prefix(entry.token_ids, tokens), len(token_ids) - 1)
            if n >= self.min_tokens and (best is None or n > best.num_tokens):
                best = PrefixHit(entry_id, n)
        return best

    def adopt(self, seq_id: int, hit: PrefixHit) -> None:
        """Start sequence `seq_id` from the hit's entries (KVBudgetExceeded if its copies do not fit)."""
        self.store.adopt(seq_id, self.entries[hit.entry_id].kv, hit.num_tokens)
        self.lru.touch(hit.entry_id)
        self.hits += 1

    def evict_one(self, keep: int | None = None) -> bool:
        """Free the LRU-K victim (never `keep`); False when there is nothing to free."""
        victim = self.lru.victim(exclude=keep)
        if victim is None:
            return False
        self._evict(victim, "memory")
        return True

    def clear(self) -> None:
        for entry_id in list(self.entries):
            self._evict(entry_id, "cleared")

    def _evict(self, entry_id: int, reason: str) -> None:
        self.store.discard(self.entries.pop(entry_id).kv)
        self.lru.remove(entry_id)
        self.evictions[reason] += 1


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n
