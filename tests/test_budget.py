"""The budget step of a compression (`confkv/compress/budget.py`): the rate's ceiling in bytes per layer,
when the thresholds judge, how the bytes are shared among layers, and which layers are over their share."""

from __future__ import annotations

import pytest

from confkv.compress.budget import layer_bytes, layers_over, plan_budget
from confkv.compress.config import CompressionConfig, resolve
from confkv.compress.state import SequenceState
from confkv.kv.kv_store import KVStore
from tests.helpers import fill_store

TOKENS = 96


def state_of(config: dict | None = None, **request) -> SequenceState:
    """A sequence's compression state under the server's `config` and the `request`'s own values."""
    params = resolve(CompressionConfig(**(config or {})), request, server_enabled=True, stats=False)
    return SequenceState(params, params.scorer(), TOKENS)


@pytest.fixture
def store() -> KVStore:
    store = KVStore(4, 2, 8, max_bytes=10**7, storage="int8")
    fill_store(store, 0, TOKENS)
    return store


def test_no_rate_keeps_everything_and_judges_nothing(store):
    budget = plan_budget(store, 0, TOKENS, state_of(compression_rate=0.0), 0.0)
    assert budget.ceiling == budget.per_layer == float("inf") and not budget.judge and not budget.rescore


def test_the_rate_sets_a_ceiling_of_bytes_per_layer_less_a_partial_block_of_each_table(store):
    rate = 0.6
    budget = plan_budget(store, 0, TOKENS, state_of(compression_rate=rate), rate)
    per_token = store.model_token_bytes / store.num_layers
    assert budget.rounding == store.table_blocks_bytes(store.codec_of(0)) > 0
    assert budget.ceiling == pytest.approx((1 - rate) * TOKENS * per_token - budget.rounding)
    assert (budget.full_bytes, budget.key_only_bytes) == store.entry_bytes(store.codec_of(0))


def test_the_thresholds_judge_every_prediction_refresh_and_their_judgment_holds_between(store):
    state = state_of({"prediction_refresh": 2}, policy="dynamic", compression_rate=0.6)
    first = plan_budget(store, 0, TOKENS, state, 0.6)
    assert first.judge and first.rescore and first.per_layer == first.ceiling
    state.compressions, state.content_bytes_per_token = 1, 2.0  # what the judgment kept, per token
    between = plan_budget(store, 0, TOKENS, state, 0.6)
    assert not between.judge and between.per_layer == 2.0 * TOKENS < between.ceiling
    state.content_bytes_per_token = 10**6  # more than the rate allows: the ceiling still binds
    assert plan_budget(store, 0, TOKENS, state, 0.6).per_layer == between.ceiling
    state.compressions = 2
    assert plan_budget(store, 0, TOKENS, state, 0.6).judge


@pytest.mark.parametrize("kind", ["uniform", "pyramid"])
def test_layer_shares_keep_the_mean(kind):
    shares = layer_bytes(4, state_of(layer_budget=kind), 1000.0)
    assert sum(shares) == pytest.approx(4000.0)
    if kind == "pyramid":  # lower layers attend broadly and get more (PyramidKV)
        assert shares == sorted(shares, reverse=True) and shares[0] > shares[-1]
    else:
        assert shares == [1000.0] * 4


def test_only_layers_holding_more_than_their_share_and_a_partial_block_are_over(store):
    held = store.layer_bytes(0)
    rounding = 1.0
    shares = [held[0] - 2 * rounding, held[1], held[2] + 10.0, held[3] - rounding]
    assert layers_over(store, 0, shares, rounding).tolist() == [True, False, False, False]
