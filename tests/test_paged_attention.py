"""The C++ decode-attention kernel against its PyTorch reference, on random block pools."""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compression import kernels
from compression.paged_attention import (
    FORMAT_CODES,
    DecodeBatch,
    DecodeResult,
    decode_attention,
    decode_attention_reference,
    kernel_arguments,
)
from tests.helpers import make_pool

FORMATS = list(FORMAT_CODES)

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module")
def kernel():
    module = kernels.load_kernel()
    assert module is not None, "the kernel did not build (see the warning logged above)"
    return module


@st.composite
def batches(draw: st.DrawFn, max_keys: int = 300) -> DecodeBatch:
    block_size = draw(st.sampled_from([4, 16]))
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([4, 16, 64]))
    rows = draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    formats = draw(st.lists(st.sampled_from(FORMATS), min_size=1, max_size=3))
    key_only_format = draw(st.sampled_from(FORMATS))
    pool_formats = [*formats, key_only_format]
    blocks = [draw(st.integers(1, 40)) for _ in pool_formats]
    pools = [make_pool(f, n, kv_heads, block_size, head_dim, gen) for f, n in zip(pool_formats, blocks, strict=True)]
    key_only_pool = len(pools) - 1

    # Some slots are held by no row; rows take slots in any order.
    slots = rows + draw(st.integers(0, 2))
    row_slot = torch.randperm(slots, generator=gen)[:rows].int()
    row_pool = torch.tensor([draw(st.integers(0, len(formats) - 1)) for _ in range(rows)], dtype=torch.int32)
    slot_pool = torch.zeros(slots, dtype=torch.long)
    slot_pool[row_slot.long()] = row_pool.long()
    num_keys = torch.tensor([draw(st.integers(1, max_keys)) for _ in range(slots)], dtype=torch.int32)
    num_key_only = torch.tensor([draw(st.integers(0, int(n))) for n in num_keys], dtype=torch.int32)
    max_blocks = -(-max_keys // block_size) + draw(st.integers(0, 2))

    def tables(pool_of_slot: list[int]) -> torch.Tensor:
        # Random block ids: out of order, repeated within a table and shared between slots; -1 past the end.
        t = torch.full((slots, max_blocks), -1, dtype=torch.int32)
        for s, p in enumerate(pool_of_slot):
            t[s] = torch.randint(0, blocks[p], (max_blocks,), generator=gen, dtype=torch.int32)
        return t

    def trim(t: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        for s, n in enumerate(entries.tolist()):
            t[s, -(-n // block_size) :] = -1
        return t

    key_tables = trim(tables(slot_pool.tolist()), num_keys)
    value_tables = trim(tables(slot_pool.tolist()), num_keys - num_key_only)
    key_only_tables = trim(tables([key_only_pool] * slots), num_key_only)

    observe = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    num_observed = sum(observe) + draw(st.integers(0, 1))
    order = torch.randperm(num_observed, generator=gen).tolist()
    observe_index = torch.tensor([order.pop() if o else -1 for o in observe], dtype=torch.int32)
    query = torch.randn(rows, heads, head_dim, generator=gen) * draw(st.sampled_from([0.5, 2.0, 8.0]))
    return DecodeBatch(
        query=query,
        pools=pools,
        row_slot=row_slot,
        row_pool=row_pool,
        key_only_pool=key_only_pool,
        key_tables=key_tables,
        value_tables=value_tables,
        key_only_tables=key_only_tables,
        num_keys=num_keys,
        num_key_only=num_key_only,
        block_size=block_size,
        scale=head_dim**-0.5,
        observe_index=observe_index,
        num_observed=num_observed,
    )


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    # Building pools and the reference is many small ops, which on a busy machine each wait for a second
    # thread; the kernel runs with two (run_kernel).
    with threads(1):
        yield


def run_kernel(kernel, batch: DecodeBatch, num_threads: int = 2) -> DecodeResult:
    with threads(num_threads):
        return DecodeResult(*kernel.decode_attention(*kernel_arguments(batch)))


def assert_matches(result: DecodeResult, expected: DecodeResult) -> None:
    # float32 accumulated in another order (and exp by a polynomial): agreement to a few 1e-6 relative.
    torch.testing.assert_close(result.out, expected.out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(result.lse, expected.lse, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(result.observed, expected.observed, rtol=1e-4, atol=1e-6)


@needs_compiler
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches())
def test_kernel_matches_reference(kernel, batch: DecodeBatch) -> None:
    assert_matches(run_kernel(kernel, batch), decode_attention_reference(batch))


@needs_compiler
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_keys=1500))
def test_kernel_matches_reference_on_long_sequences(kernel, batch: DecodeBatch) -> None:
    # Long enough for a (row, KV head) pair to be split into several work items, then merged.
    assert_matches(run_kernel(kernel, batch), decode_attention_reference(batch))


def only_row(batch: DecodeBatch, row: int) -> DecodeBatch:
    """The batch reduced to one of its rows (observed, if it was)."""
    observed = int(batch.observe_index[row]) >= 0
    return dataclasses.replace(
        batch,
        query=batch.query[row : row + 1],
        row_slot=batch.row_slot[row : row + 1],
        row_pool=batch.row_pool[row : row + 1],
        observe_index=torch.tensor([0 if observed else -1], dtype=torch.int32),
        num_observed=int(observed),
    )


@needs_compiler
@settings(max_examples=20, deadline=None)
@given(batch=batches(max_keys=600))
def test_rows_do_not_depend_on_the_batch_or_the_thread_count(kernel, batch: DecodeBatch) -> None:
    single = run_kernel(kernel, batch, num_threads=1)
    many = run_kernel(kernel, batch, num_threads=2)
    for a, b in zip(vars(single).values(), vars(many).values(), strict=True):
        assert torch.equal(a, b)
    for row in range(batch.query.shape[0]):
        alone = run_kernel(kernel, only_row(batch, row))
        assert torch.equal(alone.out[0], many.out[row]) and torch.equal(alone.lse[0], many.lse[row])
        if (o := int(batch.observe_index[row])) >= 0:
            n = alone.observed.shape[1]
            assert torch.equal(alone.observed[0], many.observed[o, :n])


def small_batch(num_keys: list[int], num_key_only: list[int], fmt: str = "int8") -> DecodeBatch:
    """Rows 0..len-1 on slots 0..len-1, every row observed, contiguous tables."""
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, heads, head_dim, block_size, max_blocks = len(num_keys), 2, 4, 16, 4, 8
    pools = [make_pool(fmt, rows * max_blocks, kv_heads, block_size, head_dim, gen)]
    table = torch.arange(rows * max_blocks, dtype=torch.int32).view(rows, max_blocks)
    return DecodeBatch(
        query=torch.randn(rows, heads, head_dim, generator=gen),
        pools=pools,
        row_slot=torch.arange(rows, dtype=torch.int32),
        row_pool=torch.zeros(rows, dtype=torch.int32),
        key_only_pool=0,
        key_tables=table,
        value_tables=table.flip(1).contiguous(),
        key_only_tables=table.roll(1, 0).contiguous(),
        num_keys=torch.tensor(num_keys, dtype=torch.int32),
        num_key_only=torch.tensor(num_key_only, dtype=torch.int32),
        block_size=block_size,
        scale=head_dim**-0.5,
        observe_index=torch.arange(rows, dtype=torch.int32),
        num_observed=rows,
    )


@needs_compiler
def test_empty_sequence_gives_zeros_and_minus_infinity(kernel) -> None:
    batch = small_batch([0, 5], [0, 2])
    result = run_kernel(kernel, batch)
    assert torch.equal(result.out[0], torch.zeros_like(result.out[0]))
    assert torch.isneginf(result.lse[0]).all()
    assert torch.equal(result.observed[0], torch.zeros(5))
    assert_matches(result, decode_attention_reference(batch))


@needs_compiler
@pytest.mark.parametrize(
    "change",
    [
        {"key_tables": torch.full((2, 8), 99, dtype=torch.int32)},  # a block outside the pool
        {"row_slot": torch.tensor([0, 2], dtype=torch.int32)},
        {"observe_index": torch.tensor([1, 1], dtype=torch.int32)},
        {"num_key_only": torch.tensor([6, 0], dtype=torch.int32)},  # more KEY_ONLY entries than entries
        {"num_keys": torch.tensor([40, 5], dtype=torch.int32)},  # more entries than the table holds
    ],
)
def test_kernel_rejects_inconsistent_batches(kernel, change: dict) -> None:
    batch = dataclasses.replace(small_batch([5, 5], [2, 0]), **change)
    with pytest.raises(RuntimeError):
        run_kernel(kernel, batch)


@needs_compiler
def test_decode_attention_uses_the_kernel_and_falls_back_when_disabled(kernel, monkeypatch) -> None:
    batch = small_batch([7, 13, 30], [0, 13, 11], fmt="int4")
    with_kernel = decode_attention(batch)
    # Bit for bit: a row's kernel result depends neither on the thread count nor on the rest of the batch.
    for a, b in zip(vars(with_kernel).values(), vars(run_kernel(kernel, batch)).values(), strict=True):
        assert torch.equal(a, b)
    monkeypatch.setenv("CONFKV_DISABLE_KERNEL", "1")
    assert kernels.load_kernel() is None
    fallback = decode_attention(batch)
    expected = decode_attention_reference(batch)
    for a, b in zip(vars(fallback).values(), vars(expected).values(), strict=True):
        assert torch.equal(a, b)
    assert_matches(with_kernel, fallback)
