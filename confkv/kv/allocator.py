"""The KV cache's memory and its byte budget.

One arena, allocated at start-up (`confkv.kv.arena`), lends its pages to one block pool per
storage format (`confkv.kv.block_pool`). The budget counts every block in use, once however many
tables share it, at its full size, plus the bookkeeping of the parked caches alive (it grows with
what the prefix cache holds). An allocation must fit both the budget and the arena's pages, which
one format's partly used pages can hold while another's need them: `fits` checks both before
anything changes, so that whoever allocates can refuse whole.
"""

from __future__ import annotations

import numpy as np
import torch

from confkv.kv.arena import Arena
from confkv.kv.block_pool import BlockPool, Codec


class KVAllocator:
    """The arena, its pools by storage format, and the byte account over them."""

    def __init__(
        self, max_bytes: int, num_kv_heads: int, block_size: int, key_only: Codec, device: torch.device
    ) -> None:
        self.max_bytes = max_bytes
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        # All the KV memory, allocated once: every format's pool borrows its pages.
        self.arena = Arena.for_budget(max_bytes, num_kv_heads * block_size * key_only.head_dim * 4, device)
        self.pools: dict[str, BlockPool] = {}
        self.key_only_pool = self.pool(key_only)  # every sequence's KEY_ONLY values, whatever its format
        self.parked_bookkeeping_bytes = 0  # of the parked caches alive

    def pool(self, codec: Codec) -> BlockPool:
        """The pool of one storage format, made on first use."""
        if codec.name not in self.pools:
            self.pools[codec.name] = BlockPool(codec, self.num_kv_heads, self.block_size, self.arena)
        return self.pools[codec.name]

    def pools_of(self, codec: Codec) -> tuple[BlockPool, BlockPool, BlockPool]:
        """The pools of a sequence stored at `codec`, by table kind (keys, FULL values, KEY_ONLY values)."""
        return self.pool(codec), self.pool(codec.values), self.key_only_pool

    @property
    def used_bytes(self) -> int:
        """Every block in use, running or parked, and the parked caches' bookkeeping."""
        blocks = sum(pool.used_blocks * pool.block_bytes for pool in self.pools.values())
        return blocks + self.parked_bookkeeping_bytes

    @property
    def free_bytes(self) -> int:
        return self.max_bytes - self.used_bytes

    @property
    def allocated_bytes(self) -> int:
        """The memory the cache's blocks live in (the arena): allocated at start, whatever is in use."""
        return self.arena.nbytes

    @property
    def touched_bytes(self) -> int:
        """The arena's pages ever lent: on CPU, the part of it that is resident memory."""
        return self.arena.touched_bytes

    @property
    def pool_bytes(self) -> dict[str, int]:
        """The arena's memory each storage format's pool holds (its pages), in use or free."""
        return {name: pool.capacity_bytes for name, pool in self.pools.items()}

    def fits(self, blocks: list[tuple[BlockPool, int]], extra_bytes: int = 0) -> bool:
        """Do these many more blocks of these pools (pools may repeat), and `extra_bytes` of
        bookkeeping, fit in the budget and in the arena's pages?"""
        needed = sum(pool.block_bytes * n for pool, n in blocks) + extra_bytes
        return needed <= self.free_bytes and self.arena_fits(blocks)

    def arena_fits(self, blocks: list[tuple[BlockPool, int]]) -> bool:
        """Can these pools hand out these many more blocks (pools may repeat) from the arena's pages?"""
        wanted: dict[int, list] = {}
        for pool, n in blocks:
            wanted.setdefault(id(pool), [pool, 0])[1] += n
        pages = sum(pool.pages_needed(n) for pool, n in wanted.values())
        return pages == 0 or pages <= self.arena.spare_pages(*(pool for pool, _ in wanted.values()))

    def unref(self, pools: tuple[BlockPool, ...], tables: list[list[np.ndarray]]) -> None:
        """Give back one reference to every block of these tables (by table kind, then layer)."""
        for pool, layers in zip(pools, tables, strict=True):
            if layers:
                pool.unref(np.concatenate(layers))
