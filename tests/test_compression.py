"""The compressor on real runs: budgets, tiers, protection, recall, mixed batches."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.compress.config import CompressionConfig, resolve
from confkv.compress.history import FULL, KEY_ONLY, tiers_by_position
from confkv.compress.scoring import POLICIES, LayerEntries, ScorePolicy
from confkv.compress.tiers import plan_tiers
from confkv.engine.llm_engine import run_to_completion
from confkv.kv.block_pool import Codec
from confkv.kv.block_tables import Keep
from confkv.kv.kv_layout import BLOCK_SIZE
from confkv.kv.kv_store import KVStore
from confkv.kv.quant import dequantize, quantize
from tests.helpers import COMPRESS_OFTEN, fill_store, greedy, make_engine, tiers, tiny_model, tokens_of

EVICTING = list(POLICIES)


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)


def prompt(tokenizer, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, len(tokenizer)) for _ in range(n)]


def run_one(engine, ids, policy, rate, max_tokens=24, stats=True, **overrides):
    params = resolve(engine.compression_config, {"policy": policy, "compression_rate": rate, **overrides}, True, stats)
    engine.add_request("r", ids, greedy(max_tokens, ignore_eos=True), params)
    return run_to_completion(engine)["r"]


def slack_bytes(engine, interval: int) -> int:
    """One compression interval of FULL tokens, plus a partial block per table of every layer."""
    return (interval + 2 * BLOCK_SIZE) * engine.store.model_token_bytes


@pytest.mark.parametrize("policy", EVICTING)
@pytest.mark.parametrize(
    ("rate", "storage"), [(0.6, "auto"), (0.75, "auto"), (0.75, "int8"), (0.9, "int8"), (0.9, "kivi4")]
)
def test_every_policy_respects_the_compression_rate(model, tokenizer, policy, rate, storage):
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    sizes = []  # held and uncompressed bytes right after each compression

    def check_after_compress(seq_id, num_tokens, state):
        sizes.append((engine.store.seq_bytes(seq_id), num_tokens * engine.store.model_token_bytes))

    engine.compression.hooks.compressed.append(check_after_compress)
    out = run_one(engine, prompt(tokenizer, 400), policy, rate, max_tokens=40, kv_cache_dtype=storage)
    metrics = out[-1].compression_metrics
    assert sizes, "the engine never compressed"
    for held, uncompressed in sizes:
        assert held <= (1 - rate) * uncompressed + 2 * BLOCK_SIZE * engine.store.model_token_bytes
    assert metrics["compressed_size"] <= (1 - rate) * metrics["original_size"] + slack_bytes(engine, 8)
    entries = metrics["entries"]
    assert entries["dropped"] + entries["key_only"] > 0  # int8 storage alone keeps ~28%: every case must demote
    assert metrics["policy"] == policy
    assert engine.store.used_bytes == 0


def test_protected_entries_are_never_dropped(model, tokenizer):
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    ids = prompt(tokenizer, 300)
    params = resolve(engine.compression_config, {"policy": "random", "compression_rate": 0.9}, True, False)
    engine.add_request("r", ids, greedy(30, ignore_eos=True), params)
    checked = 0
    while engine.has_unfinished():
        engine.step()
        seq = engine.scheduler.running[0] if engine.scheduler.running else None
        if seq is None or seq.num_computed < len(ids):
            continue
        for layer in range(engine.store.num_layers):
            held = set(engine.store.positions(seq.seq_id, layer).tolist())
            assert set(range(4)) <= held
            assert set(range(seq.num_computed - 16, seq.num_computed)) <= held
        checked += 1
    assert checked > 10


def test_policy_none_is_token_identical_to_uncompressed(model, tokenizer):
    ids = prompt(tokenizer, 300, seed=3)
    plain = make_engine(model, tokenizer)  # compression off entirely
    want = tokens_of(run_one(plain, ids, "none", 0.6, stats=False))
    engine = make_engine(model, tokenizer, compression={**COMPRESS_OFTEN, "policy": "dynamic"})
    out = run_one(engine, ids, "none", 0.6)
    assert tokens_of(out) == want
    metrics = out[-1].compression_metrics
    assert metrics["recall_rate"] == 1.0 and metrics["entries"]["dropped"] == 0


def test_recall_is_one_without_drops_and_lower_when_attended_entries_go(model, tokenizer):
    ids = prompt(tokenizer, 400, seed=5)
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    kept_all = run_one(engine, ids, "dynamic", 0.0)[-1].compression_metrics
    assert kept_all["entries"]["dropped"] == 0 and kept_all["recall_rate"] == 1.0
    squeezed = run_one(engine, ids, "streaming_llm", 0.9)[-1].compression_metrics
    assert squeezed["entries"]["dropped"] > 0
    assert 0.0 < squeezed["recall_rate"] < 1.0
    assert engine.compression.audit_bytes == 0  # audit buffers go with their request


def test_dynamic_demotes_only_as_far_as_the_rate_needs(model, tokenizer):
    ids = prompt(tokenizer, 400, seed=7)
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    # int8 storage holds ~28% of the fp32 bytes: at rate 0.6 everything stays FULL ...
    entries = run_one(engine, ids, "dynamic", 0.6)[-1].compression_metrics["entries"]
    assert entries["key_only"] == entries["dropped"] == 0
    # ... at 0.73 most of it becomes KEY_ONLY, which really costs less (all KEY_ONLY would hold ~24%
    # here, with this tiny model's 16-dim heads); the most attended stay FULL, for which a few of
    # the faintest may go.
    entries = run_one(engine, ids, "dynamic", 0.73)[-1].compression_metrics["entries"]
    assert entries["key_only"] > 0 and entries["full"] > 0
    assert entries["dropped"] < entries["key_only"] / 10
    full, key_only = engine.store.entry_bytes(engine.store.make_codec("int8"))
    assert key_only < full


def test_mixed_policies_in_one_batch_match_each_alone(model, tokenizer):
    requests = [("dynamic", 0.6), ("h2o", 0.75), ("none", 0.0), ("streaming_llm", 0.5), ("snapkv", 0.6)]
    prompts = [prompt(tokenizer, 150 + 60 * i, seed=i) for i in range(len(requests))]
    alone = []
    for (policy, rate), ids in zip(requests, prompts, strict=True):
        alone.append(tokens_of(run_one(make_engine(model, tokenizer, compression=COMPRESS_OFTEN), ids, policy, rate)))
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    for i, ((policy, rate), ids) in enumerate(zip(requests, prompts, strict=True)):
        params = resolve(engine.compression_config, {"policy": policy, "compression_rate": rate}, True, True)
        engine.add_request(str(i), ids, greedy(24, ignore_eos=True), params)
    together = run_to_completion(engine)
    for i, want in enumerate(alone):
        assert tokens_of(together[str(i)]) == want, requests[i]
    assert engine.store.used_bytes == 0


@pytest.mark.parametrize("storage", ["float16", "int8", "int4", "kivi4"])
def test_storage_precision_counts_as_compression(model, tokenizer, storage):
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    metrics = run_one(engine, prompt(tokenizer, 200), "none", 0.0, kv_cache_dtype=storage)[-1].compression_metrics
    d = engine.store.head_dim
    # Codes plus fp16 parameters per head vector (scale; scale and minimum at 4 bits), against fp32.
    # kivi4: int4 keys with a scale and minimum per channel per block, int4 values per token.
    kivi4 = (d / 2 + 4 * d / BLOCK_SIZE + d / 2 + 4) / (8 * d)
    share = {"float16": 0.5, "int8": (d + 2) / (4 * d), "int4": (d / 2 + 4) / (4 * d), "kivi4": kivi4}[storage]
    # Held bytes include the buffers' growth slack (at most an eighth).
    assert share <= metrics["compression_ratio"] <= share * 1.15


@pytest.mark.parametrize("bits", [4, 2])
def test_key_only_attention_error_is_bounded(bits):
    """Values quantised to int4 (int2) per token and head move each attention output by at most
    max over entries of (value range / 30 (6)): half a step, since the output is a convex mix of the values."""
    torch.manual_seed(0)
    values = torch.randn(3, 200, 64)
    probs = torch.rand(3, 5, 200).softmax(-1)
    approx = dequantize(quantize(values, bits))
    error = (probs @ approx - probs @ values).abs().max()
    value_range = (values.amax(-1) - values.amin(-1)).max()
    assert error <= value_range / (2 * (2**bits - 1)) * 1.01
    assert quantize(values, bits).nbytes < values.nbytes / (6 if bits == 4 else 10)
    assert len(torch.unique(quantize(values, bits).codes)) > 2 ** (8 - bits)  # every bit of a byte used


def test_budget_demotes_lowest_confidence_first():
    scores = torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0, 0.5])
    protected = torch.tensor([True, False, False, False, False, True])
    plan = plan_tiers(
        scores,
        protected,
        num_key_only=0,
        budget_bytes=2 * 10 + 10 + 2 * 6,
        full_bytes=10,
        key_only_bytes=6,
        use_tiers=True,
    )
    kept = set(plan.keep_full.tolist()) | set(plan.keep_key_only.tolist())
    assert {0, 5} <= set(plan.keep_full.tolist())  # protected stay FULL
    assert 1 in plan.dropped.tolist()  # the lowest score goes first
    assert 2 in kept and 3 in kept
    cost = 10 * plan.keep_full.numel() + 6 * plan.keep_key_only.numel()
    assert cost <= 42


@settings(max_examples=200, deadline=None)
@given(
    scores=st.lists(st.floats(0, 1, allow_nan=False), min_size=1, max_size=40),
    data=st.data(),
)
def test_plan_demotes_only_as_far_as_the_budget_needs(scores, data):
    n = len(scores)
    protected_list = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    protected = torch.tensor(protected_list, dtype=torch.bool)
    num_key_only = data.draw(st.integers(0, n))
    budget = data.draw(st.integers(0, 12 * n))
    use_tiers = data.draw(st.booleans())
    plan = plan_tiers(torch.tensor(scores), protected, num_key_only, budget, 10, 6, use_tiers)
    full, key_only, dropped = (set(t.tolist()) for t in (plan.keep_full, plan.keep_key_only, plan.dropped))
    assert full | key_only | dropped == set(range(n)) and not (full & key_only or full & dropped or key_only & dropped)
    assert not {i for i in range(n) if protected_list[i]} & dropped
    assert not full & set(range(num_key_only))  # KEY_ONLY never goes back to FULL
    if not use_tiers:
        assert key_only == set(range(num_key_only)) - dropped  # eviction only makes no new KEY_ONLY
    cost = 10 * len(full) + 6 * len(key_only)
    protected_cost = sum(6 if i < num_key_only else 10 for i in range(n) if protected_list[i])
    assert cost <= max(budget, protected_cost)
    if 10 * (n - num_key_only) + 6 * num_key_only <= budget:
        assert not dropped and key_only == set(range(num_key_only))  # it all fits: nothing changes
    # The lowest scores are demoted first (compared as the plan ranks them, in float32).
    ranked = torch.tensor(scores).tolist()
    kept_scores = [ranked[i] for i in range(n) if not protected_list[i] and i not in dropped]
    assert all(ranked[i] <= min(kept_scores, default=1.0) for i in dropped)


def test_an_entry_the_output_leans_on_is_raised_before_faint_ones_are_kept():
    """int8 FULL values against 4-bit KEY_ONLY ones: an entry drawing 100x the attention of 199 others
    is worth a precise value more than one more faint entry (3x is not); without errors given, count
    comes first."""
    scores = torch.tensor([100.0] + [1.0] * 199)
    protected = torch.zeros(200, dtype=torch.bool)
    budget = 200 * 6 + 2  # all as KEY_ONLY (6 bytes), not one more raised (4 more)
    errors = (Codec("int8", 64).relative_error, Codec("int4", 64).relative_error)
    spent = plan_tiers(scores, protected, 0, budget, 10, 6, True, value_errors=errors)
    assert tiers(spent) == ({0}, set(range(1, 199)), {199})
    counted = plan_tiers(scores, protected, 0, budget, 10, 6, True)
    assert tiers(counted) == (set(), set(range(200)), set())
    scores[0] = 3.0
    even = plan_tiers(scores, protected, 0, budget, 10, 6, True, value_errors=errors)
    assert tiers(even) == (set(), set(range(200)), set())


@settings(max_examples=300, deadline=None)
@given(
    scores=st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=40),
    errors=st.tuples(st.floats(0, 0.1), st.floats(0, 0.6)),
    data=st.data(),
)
def test_the_budget_buys_the_most_value_per_byte(scores, errors, data):
    """Every step bought (keeping an entry at 6 bytes, raising a kept one to FULL for 4 more) is worth
    at least as much per byte as every step left: a^2 x (1 - KEY_ONLY error^2) to keep, a^2 x
    (KEY_ONLY error^2 - FULL error^2) to raise (a^2: the score's square plus the mean square), a
    raise never worth more than its own keep."""
    n = len(scores)
    protected = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    num_key_only = data.draw(st.integers(0, n))
    budget = data.draw(st.integers(0, 12 * n))
    s = torch.tensor(scores)
    plan = plan_tiers(s, protected, num_key_only, budget, 10, 6, True, value_errors=errors)
    full, key_only, dropped = tiers(plan)
    ranked = torch.sort(s, descending=True, stable=True).indices  # as the plan ranks them, in float32
    may_keep = ~protected[ranked]
    floor = s[ranked][may_keep].square().mean() if bool(may_keep.any()) else 0.0
    variance = s.square() + floor  # the plan's floor: the mean square over the entries it may keep
    keep_gain = variance * (1 - errors[1] ** 2) / 6
    lift_gain = torch.minimum(variance * max(errors[1] ** 2 - errors[0] ** 2, 0) / 4, keep_gain)
    keep, lift = keep_gain.tolist(), lift_gain.tolist()
    free = [i for i in range(n) if not protected[i]]
    bought = [keep[i] for i in free if i not in dropped] + [lift[i] for i in free if i in full]
    left = [keep[i] for i in dropped] + [lift[i] for i in free if i in key_only and i >= num_key_only]
    assert min(bought, default=float("inf")) >= max(left, default=0.0) * (1 - 1e-5)
    protected_cost = sum(6 if i < num_key_only else 10 for i in range(n) if protected[i])
    assert 10 * len(full) + 6 * len(key_only) <= max(budget, protected_cost)


@dataclass
class Peaked(ScorePolicy):
    """Expected attention of 1, and 100 at every 100th position (a fact the output leans on)."""

    uses_tiers = True

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return torch.where(entries.positions % 100 == 7, 100.0, 1.0)


@pytest.mark.parametrize("attention", [True, False])
def test_the_compressor_raises_the_entries_attention_leans_on(model, tokenizer, monkeypatch, attention):
    """Through the engine, at int8 under a budget that keeps most entries as KEY_ONLY: the peaks of
    a policy whose scores are attention are FULL; a policy whose scores are not keeps the count first.
    Entry by entry: kept by word, a peak's word would share its score and its FULL budget."""
    monkeypatch.setitem(POLICIES, "test_peaked", Peaked)
    monkeypatch.setattr(Peaked, "uses_attention", attention)
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    request = {"policy": "test_peaked", "compression_rate": 0.8, "kv_cache_dtype": "int8", "retention_unit": "token"}
    params = resolve(engine.compression_config, request, True, True, inspect=True)
    engine.add_request("r", prompt(tokenizer, 400), greedy(2), params)
    prefill = run_to_completion(engine)["r"][-1].tier_history.records[0]
    peaks = np.arange(7, prefill.num_tokens - COMPRESS_OFTEN["recent_window"], 100)
    for layer in prefill.layers:
        held = tiers_by_position(layer.tiers)
        assert (held == KEY_ONLY).any()  # the budget binds
        assert bool((held[peaks] == FULL).all()) == attention


def test_kv_store_tiers_account_exactly():
    store = KVStore(num_layers=2, num_kv_heads=2, head_dim=8, max_bytes=10**7, storage="int8", key_only_bits=4)
    x = torch.randn(2, 40, 8)
    fill_store(store, 1, 40, keys=lambda layer: x)
    store.compact(1, {0: Keep(full=torch.arange(20, 40), key_only=torch.arange(0, 10))})
    store.compact(1, {0: Keep(full=torch.arange(25, 30), key_only=torch.arange(0, 20))})
    layer = store.layer(1, 0)
    assert (layer.num_key_only, layer.num_full) == (20, 5)
    # Layer 0: 25 keys (2 int8 blocks), 5 values (1), 20 int4 key-only values (2); layer 1: 40 + 40 (3 + 3).
    int8, int4 = store.allocator.pools["int8"].block_bytes, store.allocator.pools["int4"].block_bytes
    assert store.used_bytes == store.seq_bytes(1) == (2 + 1 + 3 + 3) * int8 + 2 * int4
    view = store.view(1, 0)  # KEY_ONLY 10..19 were entries 20..29, quantised to 4 bits
    assert torch.allclose(view.key_only_values[:, 10:], -x[:, 20:30], atol=0.5)
    with pytest.raises(ValueError, match="cannot become FULL"):
        store.compact(1, {0: Keep(full=torch.tensor([0]), key_only=torch.tensor([], dtype=torch.long))})


def test_key_only_values_at_two_bits_take_a_quarter_of_a_byte_per_dimension():
    store = KVStore(num_layers=1, num_kv_heads=2, head_dim=16, max_bytes=10**7, storage="int8", key_only_bits=2)
    x = torch.randn(2, 40, 16)  # [kv_heads, tokens, head_dim]
    fill_store(store, 1, 40, keys=lambda layer: x)
    store.compact(1, {0: Keep(full=torch.arange(30, 40), key_only=torch.arange(0, 30))})
    assert store.allocator.pools["int2"].codec.width == 4 and store.entry_bytes()[1] == 2 * (16 + 2) + 2 * (4 + 4)
    view = store.view(1, 0)
    step = (x.amax(-1) - x.amin(-1))[:, :30] / 3  # values are -keys in fill_store
    assert bool(((view.key_only_values + x[:, :30]).abs() <= step.unsqueeze(-1) / 2 + 1e-2).all())


def test_config_file_matches_model_defaults():
    assert CompressionConfig.load() == CompressionConfig()


def test_dynamic_budget_compresses_harder_only_while_confident():
    from confkv.compress.compressor import Compressor

    engine = Compressor(KVStore(num_layers=1, num_kv_heads=1, head_dim=4, max_bytes=10**6))
    config = CompressionConfig()
    for seq_id, policy in ((1, "dynamic"), (2, "h2o")):
        request = {"policy": policy, "compression_rate": 0.6, "retention_unit": "token"}  # no tokenizer: no words
        engine.register(seq_id, resolve(config, request, True, False), 10)
    dynamic, baseline = engine.states[1], engine.states[2]
    dynamic.confidences = [0.3] * 16  # unsure: keep all the rate allows
    assert engine.target_rate(dynamic) == 0.6
    dynamic.confidences = [0.99] * 16  # sure: remove part of what is left too, never less than the rate
    assert 0.6 < engine.target_rate(dynamic) <= 0.6 + dynamic.policy.confident_extra_rate * 0.4
    baseline.confidences = [0.99] * 16
    assert engine.target_rate(baseline) == 0.6


@pytest.mark.parametrize("policy", ["dynamic", "snapkv", "h2o"])
def test_a_layer_is_compacted_only_when_that_frees_blocks(model, tokenizer, policy):
    """Memory is held in whole blocks: a due compression leaves alone a layer whose blocks still fit
    its budget (compacting it would rewrite its tables and free nothing), and every layer it does
    compact gives blocks back."""
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    store, compactions, compressions = engine.store, [], []
    compact = store.compact

    def watched(seq_id, keep):
        before = store.layer_bytes(seq_id).copy()
        freed = compact(seq_id, keep)
        after = store.layer_bytes(seq_id)
        compactions.append([(before[layer], after[layer]) for layer in keep])
        return freed

    store.compact = watched
    engine.compression.hooks.compressed.append(lambda *_: compressions.append(1))
    run_one(engine, prompt(tokenizer, 400, seed=3), policy, 0.75, max_tokens=64, kv_cache_dtype="int8")
    assert compactions, "nothing was ever compacted"
    assert len(compactions) < len(compressions)  # some due compressions found every layer fitting
    assert all(after < before for layers in compactions for before, after in layers)
    assert store.used_bytes == 0
