"""Thresholds decide where a policy gives a retention confidence, and compression_rate is a ceiling."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.compress.config import Thresholds, resolve
from confkv.compress.scoring import POLICIES, LayerEntries, ScorePolicy
from confkv.compress.tiers import plan_tiers, threshold_bytes
from confkv.engine.llm_engine import run_to_completion
from confkv.kv.kv_layout import BLOCK_SIZE
from tests.helpers import greedy, make_engine, tiers, tiny_model

FULL, KEY_ONLY = 10, 6  # bytes of an entry at each tier in these plans
UNLIMITED = float("inf")


def f32(x: float) -> float:
    """As the plan compares: confidences and thresholds in float32."""
    return torch.tensor(x, dtype=torch.float32).item()


def cost(plan) -> int:
    return FULL * plan.keep_full.numel() + KEY_ONLY * plan.keep_key_only.numel()


threshold_pairs = st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)).map(
    lambda t: Thresholds(high=max(t[:2]), medium=min(t[:2]), low=min(t[2], min(t[:2])))
)


@settings(max_examples=200, deadline=None)
@given(confidence=st.lists(st.floats(0, 1), min_size=1, max_size=40), thresholds=threshold_pairs, data=st.data())
def test_under_a_generous_ceiling_the_thresholds_alone_decide(confidence, thresholds, data):
    n = len(confidence)
    num_key_only = data.draw(st.integers(0, n))
    judged = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    c = torch.tensor(confidence)
    protected = torch.zeros(n, dtype=torch.bool)
    plan = plan_tiers(c, protected, num_key_only, UNLIMITED, FULL, KEY_ONLY, True, c, thresholds, judged)
    full, key_only, dropped = tiers(plan)
    for i, value in enumerate(c.tolist()):
        line = f32(thresholds.drop_line if judged[i] else thresholds.medium)
        if value < line:
            assert i in dropped
        elif value >= f32(thresholds.high) and i >= num_key_only:
            assert i in full
        else:  # KEY_ONLY: between the lines, or KEY_ONLY already (it never goes back to FULL)
            assert i in key_only


@settings(max_examples=200, deadline=None)
@given(
    confidence=st.lists(st.floats(0, 1), min_size=1, max_size=40),
    pair=st.tuples(threshold_pairs, threshold_pairs),
    budget=st.integers(0, 500),
    data=st.data(),
)
def test_higher_thresholds_never_keep_more_and_the_ceiling_is_never_exceeded(confidence, pair, budget, data):
    n = len(confidence)
    c = torch.tensor(confidence)
    confidence = c.tolist()  # as the plan sees them: float32 (2e-258 is 0.0 there, a tie with 0.0)
    protected = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    lower, higher = sorted(pair, key=lambda t: (t.high, t.medium))
    if higher.medium < lower.medium:  # both lines must rise for the comparison
        higher = Thresholds(high=higher.high, medium=lower.medium)
    plans = [plan_tiers(c, protected, 0, budget, FULL, KEY_ONLY, True, c, t) for t in (lower, higher)]
    protected_cost = FULL * int(protected.sum())
    for plan in plans:
        assert cost(plan) <= max(budget, protected_cost)  # the ceiling
        full, key_only, dropped = tiers(plan)
        kept = [confidence[i] for i in full | key_only if not protected[i]]
        assert all(confidence[i] <= min(kept, default=1.0) for i in dropped)  # lowest confidence first
    generous = [plan_tiers(c, protected, 0, UNLIMITED, FULL, KEY_ONLY, True, c, t) for t in (lower, higher)]
    assert cost(generous[1]) <= cost(generous[0])


@settings(max_examples=200, deadline=None)
@given(confidence=st.lists(st.floats(0, 1), min_size=1, max_size=40), thresholds=threshold_pairs, data=st.data())
def test_the_thresholds_bytes_are_those_of_their_plan(confidence, thresholds, data):
    """What the engine asks to size a request (counted without ranking) is what the plan would keep."""
    n = len(confidence)
    num_key_only = data.draw(st.integers(0, n))
    use_tiers = data.draw(st.booleans())
    judged = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    protected = torch.tensor(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)))
    c = torch.tensor(confidence)
    plan = plan_tiers(c, protected, num_key_only, UNLIMITED, FULL, KEY_ONLY, use_tiers, c, thresholds, judged)
    counted = threshold_bytes(protected, num_key_only, FULL, KEY_ONLY, use_tiers, c, thresholds, judged)
    assert counted == cost(plan)


def test_where_key_only_costs_what_full_does_the_kept_entries_are_raised_to_full():
    """int4 storage with 4-bit KEY_ONLY values: raising an entry to FULL is free."""
    scores = torch.arange(10, dtype=torch.float32)
    protected = torch.zeros(10, dtype=torch.bool)
    plan = plan_tiers(scores, protected, 0, 5 * FULL, FULL, FULL, True)
    assert tiers(plan) == (set(range(5, 10)), set(), set(range(5)))


def test_an_entry_kept_before_stays_down_to_the_drop_line():
    c = torch.tensor([0.95, 0.8, 0.6, 0.4])
    protected = torch.zeros(4, dtype=torch.bool)
    seed = Thresholds(high=0.9, medium=0.7, low=0.5)
    fresh = plan_tiers(c, protected, 0, UNLIMITED, FULL, KEY_ONLY, True, c, seed, torch.zeros(4, dtype=torch.bool))
    kept = plan_tiers(c, protected, 0, UNLIMITED, FULL, KEY_ONLY, True, c, seed, torch.ones(4, dtype=torch.bool))
    assert tiers(fresh) == ({0}, {1}, {2, 3})
    assert tiers(kept) == ({0}, {1, 2}, {3})  # 0.6 is above low: it stays, as KEY_ONLY


def confidence_policy(name: str, confidence: Callable[[LayerEntries], torch.Tensor]) -> Iterator[type[ScorePolicy]]:
    """A registered policy that ranks by position and gives `confidence(entries)` as its retention
    confidence, so that the thresholds decide; unregistered afterwards."""

    @dataclass
    class Confident(ScorePolicy):
        uses_attention = False
        uses_tiers = True
        thresholds_decide = True

        def score(self, entries: LayerEntries) -> torch.Tensor:
            return entries.positions.float()

        def retention(self, entries: LayerEntries) -> torch.Tensor:
            return confidence(entries)

    Confident.name = name
    POLICIES[name] = Confident
    yield Confident
    del POLICIES[name]


@pytest.fixture
def by_position() -> Iterator[type[ScorePolicy]]:
    """Every third entry 0.95, the next 0.8, the next 0.3: the thresholds then decide how many bytes
    the request holds."""
    yield from confidence_policy(
        "test_by_position", lambda entries: torch.tensor([0.95, 0.8, 0.3])[entries.positions % 3]
    )


def test_a_requests_thresholds_decide_its_memory_under_the_rate_ceiling(tokenizer, by_position):
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    settings = {"sink_tokens": 4, "recent_window": 16, "compression_interval": 8, "score_interval": 2}
    ids = [int(t) for t in torch.randint(3, len(tokenizer), (300,), generator=torch.Generator().manual_seed(0))]

    def run(rate: float, thresholds: dict) -> dict:
        engine = make_engine(model, tokenizer, compression=settings)
        request = {"policy": "test_by_position", "compression_rate": rate, "thresholds": thresholds}
        engine.add_request(
            "r", ids, greedy(16, ignore_eos=True), resolve(engine.compression_config, request, True, True)
        )
        return run_to_completion(engine)["r"][-1].compression_metrics

    seed = run(0.1, {"high": 0.9, "medium": 0.7})
    strict = run(0.1, {"high": 0.99, "medium": 0.9})
    lenient = run(0.1, {"high": 0.5, "medium": 0.2})
    # Generous ceiling: the thresholds decide the bytes (those of one entry in three FULL, one
    # KEY_ONLY), which the layers then spend as a rate does...
    held = seed["entries"]
    assert held["key_only"] > 0 and held["full"] > 0
    assert seed["compressed_size"] < 0.7 * seed["ceiling_size"]  # ...far below what the rate allows
    assert strict["compressed_size"] < seed["compressed_size"] < lenient["compressed_size"]
    assert lenient["entries"]["dropped"] == 0
    # A tight ceiling: the rate wins over lenient thresholds.
    tight = run(0.8, {"high": 0.5, "medium": 0.2})
    slack = (8 + 2 * BLOCK_SIZE) * make_engine(model, tokenizer).store.model_token_bytes  # an interval, partial blocks
    assert tight["compressed_size"] <= tight["ceiling_size"] + slack
    assert tight["compressed_size"] < lenient["compressed_size"]


@pytest.fixture
def by_layer() -> Iterator[type[ScorePolicy]]:
    """Sure of every entry of layer 0 (0.95) and of none of layer 1's (0.1)."""
    yield from confidence_policy(
        "test_by_layer", lambda entries: torch.full(entries.positions.shape, 0.95 if entries.layer == 0 else 0.1)
    )


def test_the_thresholds_judge_the_request_and_every_layer_holds_as_much(tokenizer, by_layer):
    """The thresholds set the request's bytes (all of layer 0's entries FULL, none of layer 1's:
    half of the cache); the layers share them, as a rate would, instead of one keeping all and the
    other nothing. At equal bytes that kept more fidelity on the quality benchmark."""
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    settings = {"sink_tokens": 4, "recent_window": 16, "compression_interval": 8, "score_interval": 2}
    engine = make_engine(model, tokenizer, compression=settings)
    ids = [int(t) for t in torch.randint(3, len(tokenizer), (300,), generator=torch.Generator().manual_seed(1))]
    request = {"policy": "test_by_layer", "compression_rate": 0.1}
    params = resolve(engine.compression_config, request, True, True)
    seq = engine.add_request("r", ids, greedy(2, ignore_eos=True), params)
    engine.step()  # the prompt, and its end-of-prefill compression
    held = [engine.store.layer(seq.seq_id, layer) for layer in range(2)]
    full, key_only = engine.store.entry_bytes()
    layer_bytes = [kv.num_full * full + kv.num_key_only * key_only for kv in held]
    assert abs(layer_bytes[0] - layer_bytes[1]) <= full  # as much in each layer...
    assert sum(layer_bytes) <= 300 * full + 2 * full  # ...half of the cache in all, the first layer's worth
    assert all(kv.length < 300 for kv in held)
    run_to_completion(engine)


def test_dynamic_at_int4_storage_runs_to_the_end(tokenizer):
    """Its KEY_ONLY entries cost what FULL ones do: once a division by zero in the plan."""
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer, compression={"recent_window": 16, "compression_interval": 8})
    ids = [int(t) for t in torch.randint(3, len(tokenizer), (300,), generator=torch.Generator().manual_seed(3))]
    request = {"policy": "dynamic", "compression_rate": 0.9, "kv_cache_dtype": "int4"}
    engine.add_request("r", ids, greedy(20, ignore_eos=True), resolve(engine.compression_config, request, True, True))
    metrics = run_to_completion(engine)["r"][-1].compression_metrics
    assert metrics["entries"]["dropped"] > 0 and metrics["entries"]["key_only"] == 0  # raised: FULL costs no more
