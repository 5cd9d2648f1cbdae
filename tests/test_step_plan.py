"""A step's plan over the block tables (`confkv/kv/step_plan.py`): where a mixed step's new entries go, by
key pool; which rows decode, and the observed ones' numbering; keys stored in a rotated basis."""

from __future__ import annotations

import torch

from confkv.kv.attention import Segment
from confkv.kv.kv_store import KVStore
from confkv.kv.quant import random_rotation
from confkv.kv.step_plan import KeyBasis
from tests.helpers import fill_store

HEAD_DIM = 16


def mixed_store() -> KVStore:
    """Sequence 0 at int8, 1 and 2 at fp32, each holding a few entries already."""
    store = KVStore(2, 2, HEAD_DIM, max_bytes=10**7)
    store.set_storage(0, "int8")
    for seq_id, held in ((0, 20), (1, 7), (2, 3)):
        fill_store(store, seq_id, held)
    return store


def test_a_mixed_step_writes_by_key_pool_and_decodes_its_one_token_rows():
    store = mixed_store()
    # A prefill chunk of sequence 1 between two decode rows; sequence 2's decode row is observed.
    segments = [Segment(0, 0, 1), Segment(1, 1, 6), Segment(2, 6, 7, observe=1)]
    for seg in segments:
        store.reserve(seg.seq_id, seg.num_tokens)
    plan = store.begin_step(segments, torch.arange(7))
    assert plan.decode_tokens.tolist() == [0, 6] and not plan.only_decode
    slots = store.tables.slot_of
    assert plan.row_slot.tolist() == [slots[0], slots[2]]
    assert plan.observe_index.tolist() == [-1, 0] and plan.num_observed == 1
    # Each new entry goes after what its sequence held, in every layer.
    assert plan.key_index[:, 0].tolist() == [20, 20] and plan.key_index[:, 1:6].tolist() == [list(range(7, 12))] * 2
    by_format = {group.keys.codec.bits: group.tokens.tolist() for group in plan.groups}
    assert by_format == {8: [0], 0: [1, 2, 3, 4, 5, 6]}  # int8 keys, then float ones
    # The int8 row's keys are stored in the rotated basis, the fp32 row's as they are.
    assert plan.turned_rows.tolist() == [0]
    keys = torch.randn(2, 7, HEAD_DIM)
    for layer in range(2):
        store.write(layer, plan, keys * (layer + 1), -keys)
    view = store.view(1, 1)
    torch.testing.assert_close(view.keys[:, 7:12], keys[:, 1:6] * 2)  # read back in the model's basis
    assert store.view(0, 0).keys.shape[1] == 21


def test_a_decode_only_step_reads_decode_row_i_as_token_i():
    store = mixed_store()
    segments = [Segment(seq, i, i + 1) for i, seq in enumerate((2, 0, 1))]
    for seg in segments:
        store.reserve(seg.seq_id, 1)
    plan = store.begin_step(segments, torch.arange(3))
    assert plan.only_decode and plan.decode_tokens.tolist() == [0, 1, 2] and plan.num_observed == 0
    assert plan.lengths[0, store.tables.slot_of[0]] == 21 and plan.tables.dtype == torch.int32


def test_turned_keys_keep_every_dot_product():
    basis = KeyBasis(random_rotation(HEAD_DIM))
    q, k = torch.randn(5, HEAD_DIM), torch.randn(7, HEAD_DIM)
    torch.testing.assert_close(basis.turn(q) @ basis.turn(k).T, q @ k.T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(basis.unturn(basis.turn(k)), k, atol=1e-6, rtol=1e-6)
