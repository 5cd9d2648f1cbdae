"""The KV cache's memory and its byte budget: one pool per storage format, blocks counted against the
budget and against the arena's pages, references given back whole."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from confkv.kv.allocator import KVAllocator
from confkv.kv.arena import ArenaFull
from confkv.kv.block_pool import Codec

KV_HEADS, BLOCK_SIZE, HEAD_DIM = 2, 16, 16


def allocator(max_bytes: int) -> KVAllocator:
    return KVAllocator(max_bytes, KV_HEADS, BLOCK_SIZE, Codec("int2", HEAD_DIM, BLOCK_SIZE), torch.device("cpu"))


def test_one_pool_per_storage_format_made_on_first_use() -> None:
    kv = allocator(1 << 20)
    int8 = kv.pool(Codec("int8", HEAD_DIM, BLOCK_SIZE))
    assert kv.pool(Codec("int8", HEAD_DIM, BLOCK_SIZE)) is int8
    keys, values, key_only = kv.pools_of(Codec("int4c", HEAD_DIM, BLOCK_SIZE))
    assert (keys.codec.name, values.codec.name, key_only) == ("int4c", "int4", kv.key_only_pool)


def test_blocks_count_against_the_budget_at_their_format_size_and_come_back() -> None:
    kv = allocator(1 << 20)
    fp32 = kv.pool(Codec(torch.float32, HEAD_DIM, BLOCK_SIZE))
    int8 = kv.pool(Codec("int8", HEAD_DIM, BLOCK_SIZE))
    assert fp32.block_bytes == KV_HEADS * BLOCK_SIZE * HEAD_DIM * 4
    assert int8.block_bytes == KV_HEADS * BLOCK_SIZE * (HEAD_DIM + 2)  # the codes, then an fp16 scale
    a, b = fp32.allocate(3), int8.allocate(5)
    kv.parked_bookkeeping_bytes = 100
    assert kv.used_bytes == 3 * fp32.block_bytes + 5 * int8.block_bytes + 100
    fp32.ref(a[:1])  # shared by a second table: counted once
    kv.unref((fp32, int8, kv.key_only_pool), [[np.array(a)], [np.array(b)], []])
    assert fp32.held() == {a[0]: 1} and int8.used_blocks == 0
    assert kv.used_bytes == fp32.block_bytes + 100


def test_fits_checks_the_budget_and_the_arena_pages_before_anything_changes() -> None:
    kv = allocator(64 * 1024)
    fp32 = kv.pool(Codec(torch.float32, HEAD_DIM, BLOCK_SIZE))
    fitting = kv.free_bytes // fp32.block_bytes
    assert kv.fits([(fp32, fitting)]) and not kv.fits([(fp32, fitting + 1)])
    assert not kv.fits([(fp32, fitting)], extra_bytes=1)  # bookkeeping counts too
    # The same pool twice in one question counts both.
    assert not kv.fits([(fp32, fitting // 2 + 1), (fp32, fitting // 2 + 1)])
    before = kv.used_bytes
    with pytest.raises(ArenaFull):
        fp32.allocate(kv.arena.num_pages * kv.arena.page_bytes // fp32.block_bytes + 1)
    assert kv.used_bytes == before and fp32.used_blocks == 0  # refused whole


def test_pages_held_empty_by_one_format_are_lent_to_another() -> None:
    kv = allocator(64 * 1024)
    fp32 = kv.pool(Codec(torch.float32, HEAD_DIM, BLOCK_SIZE))
    int8 = kv.pool(Codec("int8", HEAD_DIM, BLOCK_SIZE))
    every = fp32.allocate(kv.arena.num_pages * kv.arena.page_bytes // fp32.block_bytes)
    assert kv.arena.free_pages == 0 and not kv.arena_fits([(int8, 1)])
    fp32.unref(every)  # the pages stay with fp32, empty, until another format needs them
    assert fp32.empty_pages == len(fp32.pages) and kv.arena_fits([(int8, 1)])
    int8.allocate(1)
    assert len(int8.pages) == 1 and len(fp32.pages) == 0
