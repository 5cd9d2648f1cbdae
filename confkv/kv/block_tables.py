"""The block tables of every running sequence, and of parked ones.

Every (sequence, layer) has three tables of block ids (`confkv.kv.kv_layout`): keys, FULL values
and KEY_ONLY values, with the entries each holds. A running sequence owns a slot, a row of
`ids` [3, layers, slots, max_blocks]; a parked cache (`ParkedKV`) holds copies of its rows outside
the slots. A rebuild (`plan_rebuild`) says how a slot comes to hold chosen entries of a cache: which
of its blocks stay shared in place, and which rows are copied or quantised into fresh blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from confkv.kv.block_pool import BlockPool, Codec
from confkv.kv.kv_layout import KEY_ONLY, KEYS, VALUES, blocks_for, entry_rows, pad

Pools = tuple[BlockPool, BlockPool, BlockPool]  # a slot's pools, by table kind


class Keep(NamedTuple):
    """The entries (indices in key order) one layer keeps: FULL, and KEY_ONLY."""

    full: torch.Tensor
    key_only: torch.Tensor


@dataclass
class ParkedKV:
    """A finished sequence's cache outside the running slots; it holds one reference to its blocks."""

    codec: Codec
    tables: list[list[np.ndarray]]  # [table kind][layer] block ids
    lengths: np.ndarray  # [layers] entries held
    key_only: np.ndarray  # [layers] KEY_ONLY entries
    meta: dict[str, torch.Tensor]  # bookkeeping rows [layers, ...]

    @property
    def bookkeeping_bytes(self) -> int:
        """Host memory beside the blocks: tables, lengths and bookkeeping rows."""
        arrays = [t for layers in self.tables for t in layers] + [self.lengths, self.key_only]
        return sum(a.nbytes for a in arrays) + sum(t.nbytes for t in self.meta.values())

    def holds_every_entry(self, num_tokens: int) -> bool:
        """Every entry of its `num_tokens` tokens, as stored: nothing dropped, no value quantised
        to KEY_ONLY. Only such a cache is query-agnostic: it serves any later question."""
        return bool((self.lengths == num_tokens).all() and (self.key_only == 0).all())


class BlockTables:
    """The running slots' tables (`ids`, `num_blocks` per table) and the entries each layer holds
    (`lengths`, of which `key_only` are KEY_ONLY), with each slot's pools."""

    def __init__(self, num_layers: int, block_size: int) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.slot_of: dict[int, int] = {}  # running sequence -> slot
        self.pools: dict[int, Pools] = {}  # slot -> its pools, by table kind
        self._free: list[int] = []
        self.ids = np.zeros((3, num_layers, 0, 4), dtype=np.int32)
        self.num_blocks = np.zeros((3, num_layers, 0), dtype=np.int32)
        self.lengths = np.zeros((num_layers, 0), dtype=np.int32)
        self.key_only = np.zeros((num_layers, 0), dtype=np.int32)

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[1]

    def open(self, seq_id: int, pools: Pools) -> int:
        """A slot for `seq_id`, holding nothing (more slots when none is free)."""
        if not self._free:
            old, new = self.num_slots, max(8, 2 * self.num_slots)
            self.ids = pad(self.ids, 2, new)
            self.num_blocks = pad(self.num_blocks, 2, new)
            self.lengths = pad(self.lengths, 1, new)
            self.key_only = pad(self.key_only, 1, new)
            self._free.extend(range(new - 1, old - 1, -1))
        slot = self._free.pop()
        self.slot_of[seq_id] = slot
        self.pools[slot] = pools
        self.lengths[:, slot] = 0
        self.key_only[:, slot] = 0
        self.num_blocks[:, :, slot] = 0
        return slot

    def close(self, seq_id: int) -> None:
        """Give back the slot of `seq_id` (its blocks' references already moved or given back)."""
        slot = self.slot_of.pop(seq_id)
        del self.pools[slot]
        self.lengths[:, slot] = 0
        self.key_only[:, slot] = 0
        self._free.append(slot)

    def fit(self, entries: int) -> None:
        """Room for `entries` in every table row."""
        blocks = blocks_for(entries, self.block_size)
        if blocks > self.ids.shape[-1]:
            self.ids = pad(self.ids, 3, max(blocks, 2 * self.ids.shape[-1]))

    def held(self, kind: int, layer: int, slot: int) -> np.ndarray:
        """The blocks one table of a slot holds (a view)."""
        return self.ids[kind, layer, slot, : self.num_blocks[kind, layer, slot]]

    def extend(self, kind: int, layer: int, slot: int, blocks: list[int]) -> None:
        start = self.num_blocks[kind, layer, slot]
        self.ids[kind, layer, slot, start : start + len(blocks)] = blocks
        self.num_blocks[kind, layer, slot] += len(blocks)

    def leading_rows(self, kind: int, layer: int, slot: int, n: int) -> np.ndarray:
        """Pool rows of the first n entries of one table of a slot."""
        return entry_rows(self.ids[kind, layer, slot], np.arange(n), self.block_size)

    def copies(self, slot: int) -> list[list[np.ndarray]]:
        """Copies of a slot's tables, [table kind][layer] (what a parked cache holds)."""
        return [[self.held(kind, layer, slot).copy() for layer in range(self.num_layers)] for kind in range(3)]

    def running_blocks(self) -> dict[int, tuple[BlockPool, list[np.ndarray]]]:
        """Every block the running slots hold, by pool (`id` of the pool): (the pool, its tables)."""
        held: dict[int, tuple[BlockPool, list[np.ndarray]]] = {}
        for slot in self.slot_of.values():
            for kind, pool in enumerate(self.pools[slot]):
                held.setdefault(id(pool), (pool, []))[1].extend(
                    self.held(kind, layer, slot) for layer in range(self.num_layers)
                )
        return held


class RebuildPlan(NamedTuple):
    """What `KVStore._rebuild` copies from a parked cache, per layer it rebuilds."""

    layers: list[int]
    orders: list[tuple[np.ndarray, int]]  # kept entries in their new order (KEY_ONLY first), and the KEY_ONLY count
    layouts: list[list[tuple[np.ndarray, int]]]  # per table kind: (source blocks shared in place, entries written)
    reads: list[list[np.ndarray]]  # per table kind, per layer: source rows copied as stored
    demoted: list[np.ndarray]  # per layer: source rows of FULL values that become KEY_ONLY (quantised now)


def held_before(source: ParkedKV, num_tokens: int) -> dict[int, Keep]:
    """Every layer's entries of `source` at positions < num_tokens, in their tiers."""
    keep = {}
    for layer, (n, n_ko) in enumerate(zip(source.lengths.tolist(), source.key_only.tolist(), strict=True)):
        held = (source.meta["positions"][layer, :n] < num_tokens).nonzero().flatten()
        keep[layer] = Keep(full=held[held >= n_ko], key_only=held[held < n_ko])
    return keep


def plan_rebuild(source: ParkedKV, keep: dict[int, Keep], bs: int) -> RebuildPlan:
    """Per layer of `keep`: which source blocks stay shared, and which rows are read, or demoted."""
    plan = RebuildPlan(list(keep), [], [], [[], [], []], [])
    for layer in plan.layers:
        full, key_only = (np.sort(t.cpu().numpy()) for t in keep[layer])
        n_ko = int(source.key_only[layer])
        if full.size and full[0] < n_ko:
            raise ValueError("a KEY_ONLY entry cannot become FULL again")
        order = np.concatenate((key_only, full))
        layout = []
        for kind, entries in ((KEYS, order), (VALUES, full - n_ko), (KEY_ONLY, key_only[key_only < n_ko])):
            table = source.tables[kind][layer]
            shared = in_place_run(entries) // bs
            plan.reads[kind].append(entry_rows(table, entries[shared * bs :], bs))
            layout.append((table[:shared], len(entries) - shared * bs))
        moved = key_only[key_only >= n_ko] - n_ko
        plan.demoted.append(entry_rows(source.tables[VALUES][layer], moved, bs))
        layout[KEY_ONLY] = (layout[KEY_ONLY][0], layout[KEY_ONLY][1] + len(moved))
        plan.orders.append((order, len(key_only)))
        plan.layouts.append(layout)
    return plan


def in_place_run(entries: np.ndarray) -> int:
    """How many leading entries sit where they already are (entries[i] == i)."""
    moved = np.flatnonzero(entries != np.arange(len(entries)))
    return int(moved[0]) if moved.size else len(entries)


def interleave(first: list[int], second: list[int]) -> np.ndarray:
    """Indices into concat(A, B), where A and B are runs of first[i] and second[i] items, that
    give A's run 0, B's run 0, A's run 1, B's run 1, ..."""
    a_starts = np.cumsum(first) - first
    b_starts = sum(first) + np.cumsum(second) - second
    runs = []
    for a, n, b, m in zip(a_starts, first, b_starts, second, strict=True):
        runs += [np.arange(a, a + n), np.arange(b, b + m)]
    return np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)
