"""The Triton kernels against the PyTorch paths, on CPU tensors under Triton's interpreter.

Decode attention is held to its reference like the C++ kernel. The interpreter runs the kernels' own
code with numpy, so what these tests cannot see is the GPU compiler's side: speed, and arithmetic it
might contract or approximate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings

triton = pytest.importorskip("triton", reason="triton is not installed (it is a Linux-only dev dependency)")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from compression import kernels, triton_attention  # noqa: E402
from compression.paged_attention import DecodeBatch, decode_attention, decode_attention_reference  # noqa: E402
from tests.helpers import FORMATS, INCONSISTENT, assert_matches, batches, small_batch  # noqa: E402

KERNELS = [triton_attention._attend, triton_attention._observe]


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
@pytest.mark.parametrize("key_only_fmt", FORMATS)
def test_every_pair_of_formats(fmt: str, key_only_fmt: str) -> None:
    batch = small_batch([7, 13, 30], [0, 13, 11], fmt=fmt, key_only_fmt=key_only_fmt)
    assert_matches(triton_attention.decode_attention_triton(batch), decode_attention_reference(batch))


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
