"""The Triton kernels against the PyTorch paths, on CPU tensors under Triton's interpreter.

Decode attention is held to its reference like the C++ kernel; the block writes and row copies to the
torch path bit for bit. The interpreter runs the kernels' own code with numpy, so what these tests
cannot see is the GPU compiler's side: speed, and arithmetic it might contract or approximate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton", reason="triton is not installed (it is a Linux-only dev dependency)")
if torch.cuda.is_available():  # conftest interprets Triton only without a GPU
    pytest.skip("with a GPU the kernels are compiled and tested on it (tests/test_cuda.py)", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from confkv.kv import kernels, triton_attention, triton_blocks  # noqa: E402
from confkv.kv.block_pool import BlockPool  # noqa: E402
from confkv.kv.block_tables import Keep  # noqa: E402
from confkv.kv.kv_store import KVStore  # noqa: E402
from confkv.kv.paged_attention import DecodeBatch, decode_attention, decode_attention_reference  # noqa: E402
from tests.helpers import (  # noqa: E402
    FORMATS,
    INCONSISTENT,
    KEY_ONLY_VALUE_FORMATS,
    appends,
    assert_matches,
    batches,
    block_pool,
    fill_store,
    same_bytes,
    small_batch,
    written_both_ways,
)

KERNELS = [
    triton_attention._attend,
    triton_attention._observe,
    triton_blocks._encode,
    triton_blocks._copy_rows,
]


@pytest.fixture(autouse=True, scope="module")
def interpreted() -> Iterator[None]:
    # Compiled, they would need a GPU: conftest sets TRITON_INTERPRET=1 before anything imports triton.
    assert all(isinstance(k, InterpretedFunction) for k in KERNELS), "the Triton kernels are not interpreted"
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # many small operators: a second thread only waits
    yield
    torch.set_num_threads(before)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_keys=48))
def test_attention_matches_reference(batch: DecodeBatch) -> None:
    assert_matches(triton_attention.decode_attention_triton(batch), decode_attention_reference(batch))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=batches(max_keys=400))
def test_attention_matches_reference_over_many_tiles(batch: DecodeBatch) -> None:
    assert_matches(triton_attention.decode_attention_triton(batch), decode_attention_reference(batch))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("key_only_fmt", KEY_ONLY_VALUE_FORMATS)
def test_every_pair_of_formats(fmt: str, key_only_fmt: str) -> None:
    batch = small_batch([7, 13, 30], [0, 13, 11], fmt=fmt, key_only_fmt=key_only_fmt)
    assert_matches(triton_attention.decode_attention_triton(batch), decode_attention_reference(batch))


def test_int2_holds_key_only_values_and_never_keys() -> None:
    with pytest.raises(ValueError, match="KEY_ONLY values only"):
        triton_attention.decode_attention_triton(small_batch([5, 5], [2, 0], fmt="int2"))


def int4c_keys(value_fmt: str, key_only_fmt: str = "int2") -> DecodeBatch:
    """small_batch's rows with int4c keys (pool 0), their FULL values in a `value_fmt` pool (1) and
    KEY_ONLY values in a `key_only_fmt` pool (2)."""
    keys = small_batch([7, 13, 30], [0, 13, 11], fmt="int4c", key_only_fmt=key_only_fmt)
    values = small_batch([7, 13, 30], [0, 13, 11], fmt=value_fmt).pools[0]
    return dataclasses.replace(
        keys,
        pools=[keys.pools[0], values, keys.pools[1]],
        row_value_pool=torch.ones(3, dtype=torch.int32),
        key_only_pool=2,
    )


@pytest.mark.parametrize("value_fmt", FORMATS)
def test_int4c_keys_with_values_in_another_pool(value_fmt: str) -> None:
    batch = int4c_keys(value_fmt)
    assert_matches(triton_attention.decode_attention_triton(batch), decode_attention_reference(batch))


def test_rows_of_one_key_pool_with_different_value_pools() -> None:
    # Rows 0 and 1 read their values from pool 1, row 2 (19 FULL entries) from pool 3: two launches
    # share the key pool.
    batch = int4c_keys("int8")
    batch = dataclasses.replace(
        batch,
        pools=[*batch.pools, small_batch([1, 1, 1], [0, 0, 0], fmt="float16").pools[0]],
        row_value_pool=torch.tensor([1, 1, 3], dtype=torch.int32),
    )
    assert_matches(triton_attention.decode_attention_triton(batch), decode_attention_reference(batch))


def test_int4c_holds_keys_and_never_values() -> None:
    # As FULL values: small_batch's rows read their values from their key pool.
    with pytest.raises(ValueError, match="keys only, not a row's values"):
        triton_attention.decode_attention_triton(small_batch([5, 5], [2, 0], fmt="int4c", key_only_fmt="int8"))
    with pytest.raises(ValueError, match="keys only, not a row's values"):
        triton_attention.decode_attention_triton(
            dataclasses.replace(int4c_keys("int8"), row_value_pool=torch.zeros(3, dtype=torch.int32))
        )
    # As KEY_ONLY values, even of rows whose keys and values are elsewhere.
    with pytest.raises(ValueError, match="keys only, not KEY_ONLY values"):
        triton_attention.decode_attention_triton(small_batch([5, 5], [2, 0], fmt="int8", key_only_fmt="int4c"))
    with pytest.raises(ValueError, match="keys only, not KEY_ONLY values"):
        triton_attention.decode_attention_triton(dataclasses.replace(int4c_keys("int8"), key_only_pool=0))


def test_value_tables_are_checked_against_the_value_pool() -> None:
    batch = int4c_keys("int8")
    with pytest.raises(IndexError, match="value pool is out of range"):
        triton_attention.decode_attention_triton(
            dataclasses.replace(batch, row_value_pool=torch.tensor([1, 3, 1], dtype=torch.int32))
        )
    # Row 0's value table names blocks 7 and 6: inside the key pool, outside a value pool of 4 blocks.
    values = batch.pools[1]
    small = dataclasses.replace(values, data=values.data[:4])
    with pytest.raises(IndexError, match="block tables"):
        triton_attention.decode_attention_triton(
            dataclasses.replace(batch, pools=[batch.pools[0], small, batch.pools[2]])
        )


def test_empty_sequence_gives_zeros_and_minus_infinity() -> None:
    batch = small_batch([0, 5], [0, 2])
    result = triton_attention.decode_attention_triton(batch)
    assert torch.equal(result.out[0], torch.zeros_like(result.out[0]))
    assert torch.isneginf(result.lse[0]).all()
    assert torch.equal(result.observed[0], torch.zeros(5))
    assert_matches(result, decode_attention_reference(batch))


@pytest.mark.parametrize("change", INCONSISTENT)
def test_attention_rejects_inconsistent_batches(change: dict) -> None:
    batch = dataclasses.replace(small_batch([5, 5], [2, 0]), **change)
    with pytest.raises((IndexError, ValueError)):
        triton_attention.decode_attention_triton(batch)


def test_decode_attention_dispatches_to_triton_unless_disabled(monkeypatch) -> None:
    # CPU tensors stand in for CUDA ones: everything but the device decides as it would there.
    monkeypatch.setattr(kernels, "triton_enabled", lambda device: not kernels.disabled())
    batch = small_batch([7, 13, 30], [0, 13, 11], fmt="int4")
    direct = triton_attention.decode_attention_triton(batch)
    for a, b in zip(vars(decode_attention(batch)).values(), vars(direct).values(), strict=True):
        assert torch.equal(a, b)
    monkeypatch.setenv("CONFKV_DISABLE_KERNEL", "1")
    expected = decode_attention_reference(batch)
    for a, b in zip(vars(decode_attention(batch)).values(), vars(expected).values(), strict=True):
        assert torch.equal(a, b)


def pools(fmt: str, kv_heads: int, head_dim: int, blocks: int) -> tuple[BlockPool, BlockPool]:
    """Two empty pools of `blocks` blocks: one on the torch path, one on the Triton kernels."""
    made = block_pool(fmt, kv_heads, head_dim, blocks, "torch"), block_pool(fmt, kv_heads, head_dim, blocks, "triton")
    assert made[0]._triton is None and made[1]._triton is triton_blocks
    return made


# A constant vector's int4 scale rounds to 0 in float16: its codes divide by zero (0 / 0 included), as
# torch's do.
@pytest.mark.filterwarnings("ignore:.* encountered in divide:RuntimeWarning")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=appends(), seed=st.integers(0, 2**31))
def test_appends_are_bit_exact(case: tuple[str, torch.Tensor], seed: int) -> None:
    fmt, x = case
    reference, kernel = written_both_ways("triton", x, fmt, seed)
    assert kernel._triton is triton_blocks and same_bytes(kernel.data, reference.data)


def test_int8_and_int4_round_half_to_even() -> None:
    int8 = pools("int8", 1, 8, blocks=1)[1]
    int8.write(torch.tensor([0]), torch.tensor([[[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]]]))
    assert int8.data[0, 0, 0, :8].view(torch.int8).tolist() == [127, 0, 2, 2, 0, -2, -2, 126]
    int4 = pools("int4", 1, 8, blocks=1)[1]
    int4.write(torch.tensor([0]), torch.tensor([[[0.0, 15.0, 0.5, 1.5, 2.5, 13.5, 14.5, 7.5]]]))
    low, high = int4.data[0, 0, 0, :4] & 0x0F, int4.data[0, 0, 0, :4] >> 4
    assert torch.cat((low, high)).tolist() == [0, 15, 0, 2, 2, 14, 14, 8]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fmt=st.sampled_from(FORMATS), seed=st.integers(0, 2**31))
def test_row_copies_are_bit_exact(fmt: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    reference, kernel = pools(fmt, 2, 16, blocks=4)
    x = torch.randn(16, 2, 16, generator=gen)
    reference.write(torch.arange(16), x)
    kernel.write(torch.arange(16), x)
    source = torch.randint(0, 16, (10,), generator=gen)  # repeats allowed: a gather
    target = torch.randperm(16, generator=gen)[:10]
    for pool in (reference, kernel):
        pool.write_rows(target, pool.read_rows(source))
    assert same_bytes(kernel.data, reference.data)
    assert same_bytes(kernel.read_rows(source), reference.read_rows(source))


def test_compaction_and_sharing_through_the_kernels_match_the_torch_path() -> None:
    def run(use_triton: bool) -> KVStore:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(kernels, "triton_enabled", lambda device: use_triton)
            if not use_triton:
                patch.setenv("CONFKV_DISABLE_KERNEL", "1")  # nor the C++ writes: the torch path
            store = KVStore(num_layers=2, num_kv_heads=2, head_dim=8, max_bytes=10**7, storage="int8")
            gen = torch.Generator().manual_seed(0)
            fill_store(store, 1, 40, keys=lambda layer: torch.randn(2, 40, 8, generator=gen))
            store.share(1)  # copies each table's partial last block
            keep = Keep(full=torch.tensor([*range(16), 20, 25, 39]), key_only=torch.tensor([17, 30, 33]))
            store.compact(1, {0: keep, 1: keep})
            fill_store(store, 1, 5, start=40, keys=lambda layer: torch.randn(2, 5, 8, generator=gen))
        return store

    reference, kernel = run(False), run(True)
    assert all(pool._triton is triton_blocks for pool in kernel.allocator.pools.values())
    for name, pool in reference.allocator.pools.items():
        held = sorted(pool.held())  # the arena's other bytes are whatever was there
        assert kernel.allocator.pools[name].held() == pool.held() and same_bytes(
            kernel.allocator.pools[name].data[held], pool.data[held]
        )
