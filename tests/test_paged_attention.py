"""The C++ extension against the PyTorch paths, on random block pools: decode attention against its
reference, block writes against the torch path byte for byte."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from confkv.kv import kernels
from confkv.kv.block_pool import BlockPool
from confkv.kv.paged_attention import (
    DecodeBatch,
    DecodeResult,
    decode_attention,
    decode_attention_reference,
    kernel_arguments,
)
from tests.helpers import (
    INCONSISTENT,
    KEY_ONLY_VALUE_FORMATS,
    appends,
    assert_matches,
    batches,
    block_pool,
    same_bytes,
    small_batch,
    written_both_ways,
)

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler to build the kernel")


@pytest.fixture(scope="module")
def kernel():
    module = kernels.load_kernel()
    assert module is not None, "the kernel did not build (see the warning logged above)"
    return module


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


@contextlib.contextmanager
def portable_loops() -> Iterator[None]:
    """The kernel's portable loops instead of its vector path (read at every call)."""
    before = os.environ.get("CONFKV_PORTABLE_KERNEL")
    os.environ["CONFKV_PORTABLE_KERNEL"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["CONFKV_PORTABLE_KERNEL"]
        else:
            os.environ["CONFKV_PORTABLE_KERNEL"] = before


@needs_compiler
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches())
def test_portable_loops_match_reference(kernel, batch: DecodeBatch) -> None:
    # What a CPU without AVX2, FMA and F16C runs (and any head_dim the vector path does not take).
    with portable_loops():
        assert_matches(run_kernel(kernel, batch), decode_attention_reference(batch))


def only_row(batch: DecodeBatch, row: int) -> DecodeBatch:
    """The batch reduced to one of its rows (observed, if it was)."""
    observed = int(batch.observe_index[row]) >= 0
    return dataclasses.replace(
        batch,
        query=batch.query[row : row + 1],
        row_slot=batch.row_slot[row : row + 1],
        row_pool=batch.row_pool[row : row + 1],
        row_value_pool=batch.row_value_pool[row : row + 1],
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


@needs_compiler
def test_empty_sequence_gives_zeros_and_minus_infinity(kernel) -> None:
    batch = small_batch([0, 5], [0, 2])
    result = run_kernel(kernel, batch)
    assert torch.equal(result.out[0], torch.zeros_like(result.out[0]))
    assert torch.isneginf(result.lse[0]).all()
    assert torch.equal(result.observed[0], torch.zeros(5))
    assert_matches(result, decode_attention_reference(batch))


@needs_compiler
@pytest.mark.parametrize("change", INCONSISTENT)
def test_kernel_rejects_inconsistent_batches(kernel, change: dict) -> None:
    batch = dataclasses.replace(small_batch([5, 5], [2, 0]), **change)
    with pytest.raises(RuntimeError):
        run_kernel(kernel, batch)


@needs_compiler
def test_kernel_refuses_int2_keys_and_reads_int2_key_only_values(kernel) -> None:
    with pytest.raises(RuntimeError, match="KEY_ONLY values only"):
        run_kernel(kernel, small_batch([5, 5], [2, 0], fmt="int2"))
    batch = small_batch([7, 13, 30], [0, 13, 11], fmt="int4", key_only_fmt="int2")
    assert_matches(run_kernel(kernel, batch), decode_attention_reference(batch))


@needs_compiler
def test_kernel_refuses_int4c_values_and_reads_int4c_keys_beside_their_values(kernel) -> None:
    # Pools [int4c, int4]: rows' keys in int4c, their FULL values (and the KEY_ONLY ones) in the int4 pool.
    batch = small_batch([7, 13, 30], [0, 13, 11], fmt="int4c", key_only_fmt="int4")
    with pytest.raises(RuntimeError, match="value pool 0 is int4c, which holds keys only"):
        run_kernel(kernel, batch)
    with pytest.raises(RuntimeError, match="key_only_pool 0 is int4c, which holds keys only"):
        run_kernel(kernel, dataclasses.replace(batch, row_value_pool=torch.ones(3, dtype=torch.int32), key_only_pool=0))
    batch = dataclasses.replace(batch, row_value_pool=torch.ones(3, dtype=torch.int32))
    assert_matches(run_kernel(kernel, batch), decode_attention_reference(batch))


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


def writers(fmt: str, kv_heads: int, head_dim: int, blocks: int) -> tuple[BlockPool, BlockPool]:
    """Two empty pools: one writing on the torch path, one through the extension's `encode_rows`."""
    made = block_pool(fmt, kv_heads, head_dim, blocks, "torch"), block_pool(fmt, kv_heads, head_dim, blocks, "c++")
    assert made[0]._kernel is None and made[1]._kernel is kernels.load_kernel() is not None
    return made


# A constant vector's int4 scale rounds to 0 in float16: its codes divide by zero (0 / 0 included), as
# torch's do.
@needs_compiler
@pytest.mark.filterwarnings("ignore:.* encountered in divide:RuntimeWarning")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=appends(KEY_ONLY_VALUE_FORMATS), seed=st.integers(0, 2**31))
def test_kernel_writes_the_bytes_of_the_torch_path(kernel, case: tuple[str, torch.Tensor], seed: int) -> None:
    fmt, x = case
    reference, written = written_both_ways("c++", x, fmt, seed)
    assert written._kernel is kernel and same_bytes(written.data, reference.data)


@needs_compiler
def test_kernel_writes_round_half_to_even_and_spread_over_threads(kernel) -> None:
    int8 = writers("int8", 1, 8, blocks=1)[1]
    int8.write(torch.tensor([0]), torch.tensor([[[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]]]))
    assert int8.data[0, 0, 0, :8].view(torch.int8).tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    # Enough vectors to be split among threads: the bytes do not depend on how.
    x = torch.randn(64, 3, 64)
    reference, written = writers("int4", 3, 64, blocks=16)
    reference.write(torch.arange(64), x)
    with threads(2):
        written.write(torch.arange(64), x)
    assert same_bytes(written.data, reference.data)


@needs_compiler
def test_kernel_writes_refuse_bad_rows_and_block_formats(kernel) -> None:
    pool = writers("int8", 2, 8, blocks=1)[1]
    with pytest.raises(RuntimeError, match="row 4 lies outside the pool's 4 rows"):
        pool.write(torch.tensor([4]), torch.randn(1, 2, 8))
    int4c = block_pool("int4c", 2, 8, 1, "c++")
    with pytest.raises(RuntimeError, match="int4c keys are written by whole blocks"):
        int4c.write(torch.tensor([0]), torch.randn(1, 2, 8))
