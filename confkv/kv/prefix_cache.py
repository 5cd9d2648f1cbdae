"""The prefix cache: KV of earlier prompts and requests, kept for the requests that follow.

What is parked must serve any later question, so only query-agnostic KV is parked:
- a request's prompt KV as its prefill ends, before the end-of-prefill compression (which keeps
  what the prompt's last tokens, the question, attended to). Its whole blocks are shared with the
  running request, so this costs no copy until the request's compaction rewrites them;
- a finished request's whole cache, but only when it dropped and demoted nothing (compression off,
  or a rate its storage precision alone meets): then it supersedes its prompt's entry.
A finished request that compressed is not parked: its cache was pruned for its own question, and a
second question about the same document would start from it (see docs/design.md).

A new request whose tokens start with a parked entry's tokens (the longest common prefix, at the
same storage precision, whatever its compression settings) starts from those entries, sharing
their blocks, and prefills only the rest. Parked bytes count against `max_cache_size`; under
memory pressure they are the first to go, by LRU-K.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from confkv.kv.block_tables import ParkedKV
from confkv.kv.kv_store import KVStore
from confkv.kv.lru import LRUK

PARKED = ("prompt", "request")  # how an entry was parked: a prompt as its prefill ended, a whole finished request


@dataclass
class CachedPrefix:
    token_ids: torch.Tensor  # [n] the tokens whose entries `kv` holds, every one as stored
    fingerprint: Hashable
    kv: ParkedKV
    parked: str  # one of PARKED
    referenced_by: int  # the request that made it or last started from it


@dataclass
class PrefixHit:
    entry_id: int
    num_tokens: int  # tokens of the request served from the cache
    parked: str  # how the entry was parked


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
        self.reused_tokens: Counter[str] = Counter()  # tokens served from the cache, by how they were parked

    def __len__(self) -> int:
        return len(self.entries)

    def park_prompt(self, seq_id: int, token_ids: list[int], fingerprint: Hashable) -> None:
        """Park a running request's prompt KV (call as its prefill ends, before it is compressed)."""
        if len(token_ids) >= self.min_tokens:
            kv = self.store.share(seq_id)
            if kv is not None:  # else the partial blocks' copies do not fit: not worth evicting for
                self._add(seq_id, token_ids, fingerprint, kv, "prompt")

    def insert(self, seq_id: int, token_ids: list[int], fingerprint: Hashable) -> None:
        """Take a finished request's cache: parked if it holds every entry as stored, else freed."""
        kv = self.store.park(seq_id)
        if kv is None:
            return
        if len(token_ids) < self.min_tokens or not kv.holds_every_entry(len(token_ids)):
            self.store.discard(kv)
            return
        self._add(seq_id, token_ids, fingerprint, kv, "request")

    def _add(self, seq_id: int, token_ids: list[int], fingerprint: Hashable, kv: ParkedKV, parked: str) -> None:
        """A new entry; it supersedes cached prefixes of its own tokens and takes their references
        (LRU-K): a conversation whose every turn extends the last is one entry referenced at each
        turn, not a new entry each time, referenced once. The request that started from a superseded
        entry, or parked it, already referenced it: its new entry is that reference again."""
        tokens = torch.tensor(token_ids)
        superseded = [
            entry_id
            for entry_id, entry in self.entries.items()
            if entry.fingerprint == fingerprint and _common_prefix(entry.token_ids, tokens) == len(entry.token_ids)
        ]
        again = any(self.entries[entry_id].referenced_by == seq_id for entry_id in superseded)
        entry_id = next(self._ids)
        self.lru.inherit(entry_id, superseded)
        for old in superseded:
            self._evict(old, "superseded")
        self.entries[entry_id] = CachedPrefix(tokens, fingerprint, kv, parked, referenced_by=seq_id)
        self.lru.touch(entry_id, again=again)

    def lookup(self, token_ids: list[int], fingerprint: Hashable, tail: int = 1) -> PrefixHit | None:
        """The longest cached prefix of `token_ids` under `fingerprint`, leaving `tail` tokens (at
        least one) to compute: the queries the request's end-of-prefill compression observes. Not
        counted: a waiting request looks up at every step; `admitted` counts it once."""
        tokens = torch.tensor(token_ids)
        best: PrefixHit | None = None
        for entry_id, entry in self.entries.items():
            if entry.fingerprint != fingerprint:
                continue
            n = min(_common_prefix(entry.token_ids, tokens), len(token_ids) - max(1, tail))
            if n >= self.min_tokens and (best is None or n > best.num_tokens):
                best = PrefixHit(entry_id, n, entry.parked)
        return best

    def adopt(self, seq_id: int, hit: PrefixHit) -> None:
        """Start sequence `seq_id` from the hit's entries (KVBudgetExceeded if its copies do not fit)."""
        entry = self.entries[hit.entry_id]
        self.store.adopt(seq_id, entry.kv, hit.num_tokens)
        entry.referenced_by = seq_id
        self.lru.touch(hit.entry_id)

    def admitted(self, hit: PrefixHit | None) -> None:
        """Count a prompt admitted for the first time: one query, and the hit it started from, if any."""
        self.queries += 1
        if hit is not None:
            self.hits += 1
            self.reused_tokens[hit.parked] += hit.num_tokens

    def reclaimable_bytes(self, keep: int | None = None) -> int:
        """Bytes that evicting every entry but `keep` would free."""
        return self.store.reclaimable_bytes([entry.kv for entry_id, entry in self.entries.items() if entry_id != keep])

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
        if entry_id in self.lru:  # else a new entry inherited its place
            self.lru.remove(entry_id)
        self.evictions[reason] += 1


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n
