"""Byte accounting of the KV store: exact, all-or-nothing, never over budget."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compression.kv_store import GROWTH_CHUNK, KVBudgetExceeded, KVStore


def make_store(max_bytes: int = 10**7, storage=None) -> KVStore:
    return KVStore(num_layers=3, num_kv_heads=2, head_dim=4, max_bytes=max_bytes, storage=storage)


def held_tensor_bytes(store: KVStore) -> int:
    total = 0
    for seq in store._seqs.values():
        for layer in seq.layers:
            tensors = [layer.keys, layer.values, layer.key_params, layer.value_params]
            if layer.ko_values is not None:
                tensors += [layer.ko_values.codes, layer.ko_values.scale, layer.ko_values.minimum]
            total += sum(t.nbytes for t in tensors if t is not None)
    return total


def fill(store: KVStore, seq_id: int, n: int, start: int = 0) -> None:
    store.reserve(seq_id, n)
    for layer in range(store.num_layers):
        k = torch.arange(n, dtype=torch.float32).repeat(2, 4, 1).transpose(1, 2) + start
        store.append(seq_id, layer, k, -k, torch.arange(start, start + n))


def test_append_view_roundtrip():
    store = make_store()
    fill(store, 1, 5)
    fill(store, 1, 3, start=5)
    view = store.view(1, 2)
    keys, values = view.keys, view.values
    assert keys.shape == (2, 8, 4)
    assert torch.equal(keys[0, :, 0], torch.arange(8, dtype=torch.float32))
    assert torch.equal(values, -keys)
    assert store.positions(1, 0).tolist() == list(range(8))


def test_reserve_is_all_or_nothing():
    store = make_store(max_bytes=3 * GROWTH_CHUNK * store_token_bytes())
    fill(store, 1, GROWTH_CHUNK)  # one chunk in each of 3 layers: budget used up
    before = store.used_bytes
    with pytest.raises(KVBudgetExceeded):
        store.reserve(2, 1)
    assert store.used_bytes == before and 2 not in store


def store_token_bytes() -> int:
    return make_store().token_bytes_per_layer


def test_compact_keeps_chosen_entries_and_frees_bytes():
    store = make_store()
    fill(store, 1, 40)
    before = store.used_bytes
    keep = torch.tensor([0, 1, 2, 39])
    freed = store.retier(1, 1, keep_full=keep, keep_key_only=torch.tensor([], dtype=torch.long))
    assert freed > 0 and store.used_bytes == before - freed
    keys = store.view(1, 1).keys
    assert keys[0, :, 0].tolist() == [0.0, 1.0, 2.0, 39.0]
    assert store.positions(1, 1).tolist() == [0, 1, 2, 39]
    assert store.seq_length(1, 0) == 40  # other layers untouched
    assert store.used_bytes == held_tensor_bytes(store)


ops = st.lists(
    st.tuples(st.sampled_from(["grow", "free", "compact"]), st.integers(0, 4), st.integers(1, 70)),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, budget_tokens=st.integers(16, 600))
def test_accounting_matches_tensors_and_budget(ops, budget_tokens):
    store = make_store(max_bytes=budget_tokens * store_token_bytes())
    for op, seq_id, n in ops:
        if op == "grow":
            with contextlib.suppress(KVBudgetExceeded):
                fill(store, seq_id, n, start=store.seq_length(seq_id))
        elif op == "free":
            store.free(seq_id)
        elif seq_id in store and store.seq_length(seq_id, 0):
            length = store.seq_length(seq_id, 0)
            layer = store.layer(seq_id, 0)
            entries = torch.arange(layer.num_key_only, length)
            store.retier(seq_id, 0, keep_full=entries[entries % 3 == 0], keep_key_only=entries[entries % 3 == 1])
        assert store.used_bytes == held_tensor_bytes(store)
        assert store.used_bytes <= store.max_bytes
    for seq_id in range(5):
        store.free(seq_id)
    assert store.used_bytes == 0


def test_the_predictors_bookkeeping_follows_its_entries_through_compaction_and_growth():
    store = KVStore(num_layers=3, num_kv_heads=2, head_dim=4, max_bytes=10**7, history_steps=2)
    fill(store, 1, 10)
    kv = store.layer(1, 0)
    assert kv.forecast[:10].isnan().all()  # nothing predicted yet
    kv.forecast[:10] = torch.arange(10, dtype=torch.float32)
    kv.observed[:, :10] = torch.arange(10, dtype=torch.float16)
    store.retier(1, 0, keep_full=torch.tensor([1, 4, 7]), keep_key_only=torch.tensor([8, 2]))
    kv = store.layer(1, 0)
    order = kv.positions[: kv.length].tolist()  # KEY_ONLY entries first, then FULL ones
    assert kv.forecast[: kv.length].tolist() == order
    assert kv.observed[1, : kv.length].tolist() == order
    assert kv.key_norm[: kv.length].tolist() == pytest.approx([store_key_norm(p) for p in order], rel=1e-2)
    fill(store, 1, 2 * GROWTH_CHUNK, start=10)  # grows the layer
    kv = store.layer(1, 0)
    assert kv.forecast[:5].tolist() == order and kv.forecast[5 : kv.length].isnan().all()


def store_key_norm(position: int) -> float:
    return float(torch.full((4,), float(position)).norm())  # fill(): every component of key p is p
