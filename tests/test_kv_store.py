"""The block KV store: exact accounting, all-or-nothing reservations, shared blocks, never over budget."""

from __future__ import annotations

import contextlib
import re
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.kv.arena import HUGE_PAGE, SPARE_PAGES, Arena
from confkv.kv.attention import PackedBatch, Segment, packed_kv_attention
from confkv.kv.block_pool import BlockPool, Codec
from confkv.kv.block_tables import Keep, ParkedKV
from confkv.kv.kv_layout import BLOCK_SIZE
from confkv.kv.kv_store import KVBudgetExceeded, KVStore
from confkv.kv.paged_attention import decode_attention, decode_attention_reference
from confkv.kv.quant import random_rotation
from tests.helpers import check_references
from tests.helpers import fill_store as fill


def make_store(max_bytes: int = 10**7, storage=None, history_steps: int = 0) -> KVStore:
    head_dim = 8 if storage == "kivi4" else 4  # int4c spreads 2 x head_dim parameters over a block's 16 rows
    return KVStore(3, 2, head_dim, max_bytes=max_bytes, storage=storage, history_steps=history_steps)


def test_write_view_roundtrip():
    store = make_store()
    fill(store, 1, 5)
    fill(store, 1, 30, start=5)  # crosses block boundaries
    view = store.view(1, 2)
    keys, values = view.keys, view.values
    assert keys.shape == (2, 35, 4)
    assert torch.equal(keys[0, :, 0], torch.arange(35, dtype=torch.float32))
    assert torch.equal(values, -keys)
    assert store.positions(1, 0).tolist() == list(range(35))
    check_references(store)


def test_waste_is_at_most_one_partial_block_per_table():
    store = make_store()
    fill(store, 1, 13)
    assert store.seq_bytes(1) == store.num_layers * 2 * store.block_bytes()  # one block of keys, one of values
    full_entry = store.entry_bytes()[0]
    assert store.seq_bytes(1) <= store.num_layers * (13 * full_entry + 2 * store.block_bytes())
    fill(store, 1, 4, start=13)  # 17 entries: a second block per table
    assert store.seq_bytes(1) == store.num_layers * 4 * store.block_bytes()


def test_reserve_is_all_or_nothing():
    store = make_store(max_bytes=3 * 2 * make_store().block_bytes())
    fill(store, 1, BLOCK_SIZE)  # one block of keys and one of values in each of 3 layers: budget used up
    before = store.used_bytes
    with pytest.raises(KVBudgetExceeded):
        store.reserve(2, 1)
    with pytest.raises(KVBudgetExceeded):
        store.reserve(1, 1)
    assert store.used_bytes == before and 2 not in store
    assert store.seq_length(1) == BLOCK_SIZE
    check_references(store)


class RecordingObserver:
    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], torch.Tensor] = {}

    def on_attention(self, seq_id: int, layer: int, rows: torch.Tensor) -> None:
        self.rows[seq_id, layer] = rows


@pytest.mark.parametrize("storage", [None, "int8"])
def test_a_prefill_chunk_attends_to_key_only_entries_and_observes_its_last_queries(storage):
    """A chunk after a compaction that kept some entries KEY_ONLY (as a new turn's prompt after an
    adopted compressed prefix): its output is the softmax over both tiers (the KEY_ONLY entries
    first, in the keys' order), causal within the chunk, and the observed rows are its last
    queries' probabilities, mean over heads."""
    kv_heads, group, head_dim, t, observe = 2, 3, 8, 5, 3
    store = KVStore(1, kv_heads, head_dim, max_bytes=10**7, storage=storage, key_only_bits=8)
    gen = torch.Generator().manual_seed(0)
    fill(store, 1, 40, keys=lambda layer: torch.randn(kv_heads, 40, head_dim, generator=gen))
    store.compact(1, {0: Keep(full=torch.tensor([1, 5, 20, 39]), key_only=torch.tensor([0, 7, 8, 30]))})
    store.reserve(1, t)
    observer = RecordingObserver()
    batch = PackedBatch(store, [Segment(1, 0, t, observe=observe)], torch.arange(40, 40 + t), observer)
    q = torch.randn(1, kv_heads * group, t, head_dim, generator=gen)
    k, v = (torch.randn(1, kv_heads, t, head_dim, generator=gen) for _ in range(2))
    layer = type("Layer", (), {"layer_idx": 0})()
    out, _ = packed_kv_attention(layer, q, k, v, None, 0.5, packed_batch=batch)

    view = store.view(1, 0)
    assert view.num_key_only == 4 and view.keys.shape[1] == 4 + 4 + t
    scores = torch.matmul(q[0].view(kv_heads, group * t, head_dim), view.keys.transpose(1, 2)) * 0.5
    held = view.keys.shape[1]
    causal = torch.arange(held) <= torch.arange(t).unsqueeze(1) + held - t
    probs = scores.view(kv_heads, group, t, held).masked_fill(~causal, float("-inf")).softmax(-1)
    values = torch.cat((view.key_only_values, view.values), dim=1)  # [kv_heads, held, D]
    expected = torch.einsum("hgtk,hkd->thgd", probs, values).reshape(1, t, kv_heads * group, head_dim)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(observer.rows[1, 0], probs[:, :, -observe:].mean(dim=(0, 1)), rtol=1e-5, atol=1e-6)


def test_compaction_keeps_chosen_entries_rewrites_only_what_moved_and_frees_bytes():
    store = make_store()
    fill(store, 1, 40)
    before = store.used_bytes
    first_block = store.tables.ids[0, 1, store.tables.slot_of[1], 0]
    keep = torch.tensor([*range(BLOCK_SIZE), 39])  # the first block stays in place
    freed = store.compact(1, {1: Keep(full=keep, key_only=torch.tensor([], dtype=torch.long))})
    assert freed > 0 and store.used_bytes == before - freed
    keys = store.view(1, 1).keys
    assert keys[0, :, 0].tolist() == [*map(float, range(BLOCK_SIZE)), 39.0]
    assert store.positions(1, 1).tolist() == [*range(BLOCK_SIZE), 39]
    assert store.tables.ids[0, 1, store.tables.slot_of[1], 0] == first_block  # not copied
    assert store.seq_length(1, 0) == 40  # other layers untouched
    check_references(store)


def test_a_prefix_is_shared_by_reference_and_only_its_partial_block_copied():
    store = make_store(storage="int8")
    fill(store, 1, 40)
    parked = store.park(1)
    held = store.used_bytes
    assert store.parked_bytes == held and 1 not in store
    store.adopt(2, parked, 36)  # 2 whole blocks shared per table, the 4 entries after them copied
    block = store.block_bytes(store.make_codec("int8"))
    assert store.used_bytes == held + store.num_layers * 2 * block
    assert store.positions(2, 0).tolist() == list(range(36))
    assert torch.allclose(store.view(2, 1).keys[0, :, 0], torch.arange(36.0), rtol=0.01)
    check_references(store, [parked])
    fill(store, 2, 10, start=36)  # the adopter writes after its own copy, never into the cache
    assert torch.allclose(store.view(2, 0).keys[0, :, 0], torch.arange(46.0), rtol=0.01)
    store.free(2)
    assert store.used_bytes == store.parked_bytes == held
    assert store.discard(parked) == held and store.used_bytes == 0


def test_sharing_a_running_cache_copies_only_partial_blocks_and_survives_its_compaction():
    store = make_store(storage="int8")
    fill(store, 1, 40)
    before = store.used_bytes
    parked = store.share(1)  # 2 whole blocks shared per table, the partial third one copied
    copies = store.num_layers * 2 * store.block_bytes(store.make_codec("int8"))
    assert store.used_bytes == before + copies + parked.bookkeeping_bytes
    assert parked.holds_every_entry(40)
    check_references(store, [parked])
    store.compact(1, {layer: mixed_keep(store, 1, layer, 0) for layer in range(3)})
    fill(store, 1, 10, start=40)  # the sequence writes on, into its own blocks
    check_references(store, [parked])
    store.free(1)
    store.adopt(2, parked, 40)
    assert torch.allclose(store.view(2, 1).keys[0, :, 0], torch.arange(40.0), rtol=0.01)
    store.free(2)
    assert store.discard(parked) > 0 and store.used_bytes == 0


def test_adopting_what_does_not_fit_holds_nothing():
    store = make_store()
    fill(store, 1, 40)
    parked = store.park(1)
    store.allocator.max_bytes = store.used_bytes  # no room for a copied partial block
    with pytest.raises(KVBudgetExceeded):
        store.adopt(2, parked, 36)
    assert 2 not in store
    check_references(store, [parked])


ops = st.lists(
    st.tuples(
        st.sampled_from(["grow", "free", "compact", "park", "share", "adopt"]), st.integers(0, 4), st.integers(1, 70)
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(ops=ops, budget_tokens=st.integers(16, 600), storage=st.sampled_from(["int8", "kivi4"]))
def test_accounting_matches_references_and_budget(ops, budget_tokens, storage):
    store = make_store(max_bytes=budget_tokens * make_store().entry_bytes()[0], storage=storage)
    parked: list[ParkedKV] = []
    for op, seq_id, n in ops:
        if op == "grow":
            with contextlib.suppress(KVBudgetExceeded):
                fill(store, seq_id, n, start=store.seq_length(seq_id))
        elif op == "free":
            store.free(seq_id)
        elif op == "park" and seq_id in store:
            parked.append(store.park(seq_id))
        elif op == "share" and seq_id in store:
            shared = store.share(seq_id)
            parked += [shared] if shared is not None else []
        elif op == "adopt" and parked and seq_id not in store:
            with contextlib.suppress(KVBudgetExceeded):
                store.adopt(seq_id, parked[n % len(parked)], n)
        elif op == "compact" and seq_id in store:
            store.compact(seq_id, {layer: mixed_keep(store, seq_id, layer, n) for layer in range(n % 4)})
        check_references(store, parked)
        # Running sequences stay within the budget; a compaction may rewrite blocks that a parked copy
        # still holds, and those bytes are the prefix cache's to give back (the scheduler evicts them).
        assert store.running_bytes <= store.max_bytes + 3 * store.num_layers * store.block_bytes()
    for seq_id in range(5):
        store.free(seq_id)
    for cache in parked:
        store.discard(cache)
    assert store.used_bytes == 0


@settings(max_examples=60, deadline=None)
@given(
    ops=ops,
    formats=st.lists(st.sampled_from(["auto", "float16", "int8", "int4", "kivi4"]), min_size=5, max_size=5),
    budget_tokens=st.integers(16, 400),
)
def test_the_arena_bounds_memory_whatever_the_mix_of_formats(ops, formats, budget_tokens):
    """Sequences at every storage format, growing, compacted, parked, shared, adopted and freed in any
    order: the memory every block lives in is allocated once, the budget and its spare pages, and
    what one format held serves another once it is let go."""
    store = make_store(storage="kivi4")  # head_dim 8: every format can be stored
    budget = budget_tokens * store.num_layers * store.entry_bytes(store.make_codec("auto"))[0]
    store = make_store(max_bytes=budget, storage="kivi4")
    memory, allocated = store.allocator.arena.memory.data_ptr(), store.allocator.allocated_bytes
    assert budget <= allocated <= budget + SPARE_PAGES * store.allocator.arena.page_bytes
    parked: list[ParkedKV] = []
    for op, seq_id, n in ops:
        with contextlib.suppress(KVBudgetExceeded):  # refused, nothing changed: the budget or the pages
            if op == "grow":
                if seq_id not in store:
                    store.set_storage(seq_id, formats[seq_id])
                fill(store, seq_id, n, start=store.seq_length(seq_id))
            elif op == "free":
                store.free(seq_id, preempted=n % 2 == 0)
            elif op == "park" and seq_id in store:
                parked.append(store.park(seq_id))
            elif op == "share" and seq_id in store:
                parked += [shared] if (shared := store.share(seq_id)) is not None else []
            elif op == "adopt" and parked and seq_id not in store:
                store.adopt(seq_id, parked[n % len(parked)], n)
            elif op == "compact" and seq_id in store:
                store.compact(seq_id, {layer: mixed_keep(store, seq_id, layer, n) for layer in range(n % 4)})
        check_references(store, parked)
        assert store.allocator.arena.memory.data_ptr() == memory and store.allocator.allocated_bytes == allocated
        assert sum(store.allocator.pool_bytes.values()) <= store.allocator.touched_bytes <= allocated
    for seq_id in range(5):
        store.free(seq_id)
    for cache in parked:
        store.discard(cache)
    assert store.used_bytes == 0
    # All of it serves one format now: a sequence at the model's dtype takes nearly the whole budget.
    whole = budget // (store.num_layers * 2 * store.block_bytes(store.make_codec("auto")))
    store.set_storage(9, "auto")
    fill(store, 9, whole * store.block_size)
    assert store.used_bytes > budget - store.num_layers * 2 * store.block_bytes(store.make_codec("auto"))
    check_references(store)


def mixed_keep(store: KVStore, seq_id: int, layer: int, pattern: int) -> Keep:
    """Some FULL entries kept, some demoted, some dropped, and every other KEY_ONLY one kept."""
    kv = store.layer(seq_id, layer)
    full = torch.arange(kv.num_key_only, kv.length)
    return Keep(
        full=full[(full + pattern + layer) % 3 == 0],
        key_only=torch.cat((torch.arange(0, kv.num_key_only, 2), full[(full + pattern + layer) % 3 == 1])),
    )


def test_compacting_several_layers_at_once_keeps_each_layers_own_entries():
    store = make_store(storage="int8")
    fill(store, 1, 50, keys=lambda layer: torch.randn(2, 50, 4) + 10 * layer)
    before = [store.view(1, layer) for layer in range(3)]
    for pattern in (0, 1):  # the second time, some entries are KEY_ONLY already
        keep = {layer: mixed_keep(store, 1, layer, pattern) for layer in (0, 2)}
        expected = {
            layer: (
                store.positions(1, layer)[keep[layer].key_only.sort().values],
                store.positions(1, layer)[keep[layer].full.sort().values],
            )
            for layer in keep
        }
        store.compact(1, keep)
        for layer, (key_only, full) in expected.items():
            view, positions = store.view(1, layer), store.positions(1, layer)
            assert positions.tolist() == key_only.tolist() + full.tolist()
            assert view.num_key_only == len(key_only)
            original = before[layer]
            assert torch.allclose(view.keys, original.keys[:, positions], atol=0.05)
            assert torch.allclose(view.values, original.values[:, full], atol=0.05)
            assert torch.allclose(view.key_only_values, original.values[:, key_only], atol=0.5)  # int4
        assert store.seq_length(1, 1) == 50  # a layer not named is untouched
        check_references(store)


def test_the_predictors_bookkeeping_follows_its_entries_through_compaction_and_growth():
    store = make_store(history_steps=2)
    fill(store, 1, 10)
    kv = store.layer(1, 0)
    assert kv.forecast[:10].isnan().all()  # nothing predicted yet
    kv.forecast[:10] = torch.arange(10, dtype=torch.float32)
    kv.observed[:, :10] = torch.arange(10, dtype=torch.float16)
    store.compact(1, {0: Keep(full=torch.tensor([1, 4, 7]), key_only=torch.tensor([8, 2]))})
    kv = store.layer(1, 0)
    order = kv.positions[: kv.length].tolist()  # KEY_ONLY entries first, then FULL ones
    assert kv.forecast[: kv.length].tolist() == order
    assert kv.observed[1, : kv.length].tolist() == order
    assert kv.key_norm[: kv.length].tolist() == pytest.approx([store_key_norm(p) for p in order], rel=1e-2)
    fill(store, 1, 10 * BLOCK_SIZE, start=10)  # grows every table and the bookkeeping
    kv = store.layer(1, 0)
    assert kv.forecast[:5].tolist() == order and kv.forecast[5 : kv.length].isnan().all()
    assert kv.positions[: kv.length].tolist() == order + list(range(10, 10 + 10 * BLOCK_SIZE))


def store_key_norm(position: int) -> float:
    return float(torch.full((4,), float(position)).norm())  # fill(): every component of key p is p


def test_a_parked_cache_keeps_only_what_adoption_reads_and_counts_it_in_the_budget():
    store = make_store(history_steps=2)
    fill(store, 1, 40)
    store.layer(1, 0).forecast[:40] = 1.0
    store.layer(1, 0).attention[:40] = 1.0
    blocks = store.used_bytes
    parked = store.park(1)
    # Its observations answered its own questions; positions and key norms are what an adopter needs.
    assert set(parked.meta) == {"positions", "key_norm"} and parked.meta["positions"].dtype == torch.int32
    assert parked.bookkeeping_bytes >= 3 * 40 * (4 + 2)
    assert store.used_bytes == store.parked_bytes == blocks + parked.bookkeeping_bytes
    check_references(store, [parked])
    store.adopt(2, parked, 36)
    kv = store.layer(2, 0)
    assert kv.positions[: kv.length].tolist() == list(range(36))
    assert kv.key_norm[: kv.length].tolist() == pytest.approx([store_key_norm(p) for p in range(36)], rel=1e-2)
    assert not kv.attention[: kv.length].any() and kv.forecast[: kv.length].isnan().all()
    store.free(2)
    assert store.discard(parked) == blocks + parked.bookkeeping_bytes and store.used_bytes == 0


@pytest.mark.parametrize("head_dim", [64, 48])
def test_the_key_rotation_is_orthogonal_and_fixed(head_dim):
    rotation = random_rotation(head_dim)
    assert torch.allclose(rotation @ rotation.T, torch.eye(head_dim), atol=1e-5)
    assert torch.equal(rotation, random_rotation(head_dim))  # every process stores keys alike


def outlier_keys(layer: int, n: int = 40, heads: int = 2, dim: int = 64) -> torch.Tensor:
    """Keys as a trained model's look: a few channels far larger than the rest (KIVI's finding)."""
    generator = torch.Generator().manual_seed(layer)
    keys = torch.randn(heads, n, dim, generator=generator)
    keys[..., [3, 17, 40]] *= 25.0
    return keys


def assert_decode_agrees_with_views(store: KVStore, attend, query: torch.Tensor, new: torch.Tensor, positions) -> None:
    """Sequences 1 and 2 (2 KV heads of 64, 4 query heads) decode one token each in one step, keys
    `new` and values negated: `attend` over the store's decode batch gives each row the attention
    over its sequence's dequantised view."""
    store.reserve(1, 1)
    store.reserve(2, 1)
    plan = store.begin_step([Segment(1, 0, 1), Segment(2, 1, 2)], torch.tensor(positions))
    store.write(0, plan, new, -new)
    result = attend(store.decode_batch(0, plan, query, 0.125))
    for row, seq_id in enumerate((1, 2)):
        view = store.view(seq_id, 0)
        probs = (query[row].view(2, 2, 64) @ view.keys.transpose(1, 2) * 0.125).softmax(-1)
        assert torch.allclose(result.out[row], (probs @ view.values).view(4, 64), atol=1e-4)


def test_quantised_keys_stored_rotated_come_back_closer_and_decode_agrees_with_the_view():
    """The rotation spreads the outlier channels: int4 and int8 keys come back closer to what was
    written; the decode kernel (turned queries on turned keys) and the view (keys turned back) compute
    the same attention, for a batch that mixes an int4 sequence with an int8 one."""
    errors = {}
    for rotated in (False, True):
        store = KVStore(2, 2, 64, 10**8, storage="int4", key_rotation=rotated)
        store.set_storage(2, "int8")
        for seq_id in (1, 2):
            fill(store, seq_id, 40, keys=outlier_keys)
            written = outlier_keys(0)
            errors[rotated, seq_id] = float((store.view(seq_id, 0).keys - written).norm() / written.norm())

        query = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(7))
        new = torch.randn(2, 2, 64, generator=torch.Generator().manual_seed(8))
        assert_decode_agrees_with_views(store, decode_attention_reference, query, new, [40, 40])
    for seq_id in (1, 2):  # int4, int8
        assert errors[True, seq_id] < 0.5 * errors[False, seq_id]


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), storage=st.sampled_from(["int8", "int4"]), outlier=st.floats(1.0, 100.0))
def test_a_rotated_key_comes_back_within_half_a_level_per_channel_of_its_turned_range(seed, storage, outlier):
    """Turning preserves lengths, so a key's error is its turned vector's: at most half a level in every
    channel (plus the float16 rounding of the stored scale and minimum), whatever its outliers."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 20, 64, generator=generator)
    keys[..., 5] *= outlier
    store = KVStore(1, 2, 64, 10**8, storage=storage)
    fill(store, 1, 20, keys=lambda layer: keys)
    turned = keys @ random_rotation(64)
    levels = 255 if storage == "int8" else 15  # int8: symmetric over [-absmax, absmax]
    span = 2 * turned.abs().amax(-1) if storage == "int8" else turned.amax(-1) - turned.amin(-1)
    half_level = span / levels / 2
    error = (store.view(1, 0).keys - keys).norm(dim=-1)
    assert (error <= 64**0.5 * half_level * 1.01 + 1e-3 * turned.abs().amax(-1)).all()


# ----- int4c keys (storage kivi4) ---------------------------------------------------------------


def block_half_levels(keys: torch.Tensor, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Half an int4 level of each key's block and channel range: keys [heads, n, D] -> [heads, n, D]."""
    heads, n, dim = keys.shape
    padded = torch.cat((keys, keys[:, -1:].expand(heads, -n % block_size, dim)), dim=1)
    blocks = padded.view(heads, -1, block_size, dim)
    span = (blocks.amax(2) - blocks.amin(2)) / 15 / 2
    return span.repeat_interleave(block_size, dim=1)[:, :n]


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    chunks=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    outlier=st.floats(1.0, 100.0),
)
def test_kivi4_keys_come_back_within_half_a_level_of_their_blocks_channel_range(seed, chunks, outlier):
    """Written in chunks (a prefill, then appends into a partial block, beside an int8 sequence in the
    same steps), every key comes back within half a level of its own block's range in each channel:
    a block is encoded from exact keys, never from keys already rounded."""
    generator = torch.Generator().manual_seed(seed)
    n = sum(chunks)
    keys = torch.randn(2, 2, n, 64, generator=generator) + torch.randn(64, generator=generator) * 3
    keys[..., 5] *= outlier
    values = torch.randn(2, 2, n, 64, generator=generator)
    store = KVStore(2, 2, 64, 10**8, storage="kivi4")
    store.set_storage(2, "int8")
    start = 0
    for size in chunks:
        store.reserve(1, size)
        store.reserve(2, 1)
        plan = store.begin_step(
            [Segment(1, 0, size), Segment(2, size, size + 1)], torch.arange(start, start + size + 1)
        )
        for layer in range(2):
            new = slice(start, start + size)
            other = torch.zeros(2, 1, 64)
            store.write(
                layer, plan, torch.cat((keys[layer, :, new], other), 1), torch.cat((values[layer, :, new], other), 1)
            )
        start += size
    for layer in range(2):
        view = store.view(1, layer)
        bound = block_half_levels(keys[layer]) * 1.01 + 2e-3 * keys[layer].abs().amax()
        assert ((view.keys - keys[layer]).abs() <= bound).all()
        span = values[layer].amax(-1, keepdim=True) - values[layer].amin(-1, keepdim=True)
        assert ((view.values - values[layer]).abs() <= span / 15 / 2 * 1.01 + 1e-3).all()
    assert store.allocator.pools["int4c"].codec.per_channel and store.seq_length(2) == len(chunks)
    check_references(store)


def test_kivi4_compaction_and_adoption_keep_their_keys_within_two_roundings():
    """Compaction re-encodes the keys it moves from their stored values: one more rounding at most. An
    adopter of a parked kivi4 cache reads the same keys and writes on after them."""
    generator = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 50, 64, generator=generator) * torch.linspace(0.1, 5.0, 64)
    store = KVStore(1, 2, 64, 10**8, storage="kivi4")
    fill(store, 1, 50, keys=lambda layer: keys)
    before = store.used_bytes
    kept = torch.tensor([i for i in range(50) if i % 3])
    freed = store.compact(1, {0: Keep(full=kept, key_only=torch.tensor([0, 3]))})
    assert freed > 0 and store.used_bytes == before - freed
    order = torch.cat((torch.tensor([0, 3]), kept))
    first = block_half_levels(keys)[:, order]
    second = block_half_levels(store.view(1, 0).keys)
    error = (store.view(1, 0).keys - keys[:, order]).abs()
    assert (error <= (first + second) * 1.01 + 1e-3).all()
    check_references(store)

    parked = store.park(1)
    store.adopt(2, parked, 50)
    adopted = store.view(2, 0).keys
    assert torch.allclose(adopted, keys[:, order], atol=float((first + block_half_levels(adopted)).max()) * 1.1)
    more = torch.randn(2, 5, 64, generator=generator)
    fill(store, 2, 5, start=50, keys=lambda layer: more)
    assert torch.allclose(store.view(2, 0).keys[:, : len(order)], adopted, atol=float(first.max()) * 2.5)
    check_references(store, [parked])
    store.free(2)
    store.discard(parked)
    assert store.used_bytes == 0


def test_a_kivi4_prompt_of_whole_blocks_is_adopted_whole():
    """An adopter of whole int4c blocks shares them and reads no key row: the empty read must not fail."""
    store = make_store(storage="kivi4")
    fill(store, 0, 32)
    keys = store.view(0, 1).keys
    parked = store.park(0)
    store.adopt(1, parked, 32)
    assert torch.equal(store.view(1, 1).keys, keys)
    check_references(store, [parked])


def test_kivi4_decode_attention_agrees_with_the_view_beside_an_int8_sequence():
    """The decode kernel reads int4c keys and their int4 values in place: the same attention as over
    the dequantised view, in a batch that mixes a kivi4 sequence with an int8 one."""
    store = KVStore(2, 2, 64, 10**8, storage="kivi4")
    store.set_storage(2, "int8")
    generator = torch.Generator().manual_seed(5)
    for seq_id, n in ((1, 37), (2, 21)):
        keys = torch.randn(2, n, 64, generator=generator) * torch.linspace(0.1, 5.0, 64)
        fill(store, seq_id, n, keys=lambda layer, keys=keys: keys)
    query, new = torch.randn(2, 4, 64, generator=generator), torch.randn(2, 2, 64, generator=generator)
    assert_decode_agrees_with_views(store, decode_attention, query, new, [37, 21])


def test_reclaimable_bytes_are_what_discarding_would_free_not_what_others_still_hold():
    store = make_store(storage="int8")
    fill(store, 1, 40)
    parked = store.share(1)  # its whole blocks are the running sequence's too
    copies = store.num_layers * 2 * store.block_bytes(store.make_codec("int8"))
    assert store.reclaimable_bytes([parked]) == copies + parked.bookkeeping_bytes
    store.free(1)  # now it alone holds them
    alone = store.reclaimable_bytes([parked])
    assert alone > copies + parked.bookkeeping_bytes and store.reclaimable_bytes([]) == 0
    assert store.discard(parked) == alone and store.used_bytes == 0


def test_a_pool_short_of_pages_takes_the_empty_pages_of_others_and_keeps_its_own():
    """When no page is free, the others give back their empty pages; the taker's own would only come
    back to it zeroed again."""
    codec = Codec(torch.float32, 8)
    block_bytes = codec.vector_bytes * 16
    arena = Arena(3 * 4 * block_bytes, 4 * block_bytes)  # 3 pages of 4 blocks
    taker, other, full = (BlockPool(codec, 1, 16, arena) for _ in range(3))
    taker.unref(taker.allocate(4))  # page 0, empty
    other.unref(other.allocate(4))  # page 1, empty
    full.allocate(4)  # page 2
    taker.data[0].fill_(7.0)  # a free block of the taker's empty page
    blocks = taker.allocate(8)
    assert sorted(blocks) == list(range(8)) and other.pages == [] and taker.data[0].eq(7.0).all()


def test_the_cpu_arena_lies_in_huge_pages():
    """Decode attention reads blocks scattered over the arena: on 4 KiB pages it would wait on page walks
    (see confkv.kv.arena.huge_page_memory). The arena is aligned to a huge page and, where the kernel
    grants transparent huge pages on request, backed by them once touched."""
    arena = Arena(8 * HUGE_PAGE, HUGE_PAGE)
    start = arena.memory.data_ptr()
    assert start % HUGE_PAGE == 0 and arena.nbytes == 8 * HUGE_PAGE
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform != "linux" or not thp.exists() or "[never]" in thp.read_text():
        return  # the alignment is all this host can show
    arena.memory.fill_(1)
    huge_kib = 0
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            mapping = low <= start < high
        elif mapping and line.startswith("AnonHugePages:"):
            huge_kib = int(line.split()[1])
    assert huge_kib >= HUGE_PAGE // 1024
