"""Per-layer budgets: how a request's bytes are shared among its layers (`layer_budget`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.compress.config import resolve
from confkv.compress.scoring import POLICIES, LayerEntries, ScorePolicy
from confkv.compress.tiers import ADAPTIVE_FLOOR, adaptive_weights, pyramid_weights
from confkv.engine.llm_engine import run_to_completion
from tests.helpers import greedy, make_engine, tiny_model, tokens_of


@pytest.mark.parametrize("layers", [1, 2, 30])
def test_pyramid_shares_fall_from_the_bottom_layer_and_average_one(layers):
    weights = pyramid_weights(layers)
    assert weights.mean().item() == pytest.approx(1.0)
    assert bool((weights[1:] < weights[:-1]).all())
    if layers > 1:
        assert weights[-1].item() == pytest.approx(1 / 20)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.floats(0, 10), min_size=0, max_size=40), min_size=1, max_size=8))
def test_adaptive_shares_average_one_and_never_starve_a_layer(values):
    weights = adaptive_weights([torch.tensor(v) for v in values])
    assert weights.shape == (len(values),)
    assert weights.mean().item() == pytest.approx(1.0, abs=1e-5)
    assert bool((weights >= ADAPTIVE_FLOOR - 1e-6).all())


def test_a_layer_whose_attention_spreads_wide_gets_more_than_one_that_looks_at_one_entry():
    spread, focused, unseen = torch.ones(100), torch.zeros(100), torch.zeros(100)
    focused[7] = 1.0
    weights = adaptive_weights([spread, focused, unseen])
    assert weights[0] > weights[2] > weights[1]  # the unobserved layer counts as average
    assert weights[1].item() == pytest.approx(ADAPTIVE_FLOOR + (1 - ADAPTIVE_FLOOR) * 1 / 50.5, rel=1e-4)


@pytest.fixture
def focused_first_layer() -> Iterator[str]:
    """A registered policy whose layer 0 puts all its value on one entry and layer 1 spreads it evenly."""

    @dataclass
    class FocusedFirstLayer(ScorePolicy):
        uses_attention = False

        def score(self, entries: LayerEntries) -> torch.Tensor:
            if entries.layer == 0:
                return (entries.positions == 100).float()
            return torch.ones(entries.positions.shape)

    name = "test_focused_first_layer"
    FocusedFirstLayer.name = name
    POLICIES[name] = FocusedFirstLayer
    yield name
    del POLICIES[name]


@pytest.mark.parametrize("layer_budget", ["uniform", "pyramid", "adaptive"])
def test_layers_share_the_requests_bytes_as_layer_budget_says(tokenizer, focused_first_layer, layer_budget):
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    settings = {"sink_tokens": 4, "recent_window": 16, "compression_interval": 8}
    engine = make_engine(model, tokenizer, compression=settings)
    ids = [int(t) for t in torch.randint(3, len(tokenizer), (400,), generator=torch.Generator().manual_seed(2))]
    request = {
        "policy": focused_first_layer,
        "compression_rate": 0.5,
        "layer_budget": layer_budget,
        "kv_cache_dtype": "auto",
    }
    params = resolve(engine.compression_config, request, True, True)
    seq = engine.add_request("r", ids, greedy(12, ignore_eos=True), params)
    engine.step()  # the prompt, and its end-of-prefill compression
    full, key_only = engine.store.entry_bytes(engine.store.codec_of(seq.seq_id))
    held = [engine.store.layer(seq.seq_id, layer) for layer in range(2)]
    first, second = (kv.num_full * full + kv.num_key_only * key_only for kv in held)
    uncompressed = 400 * full
    assert first + second <= 2 * 0.5 * uncompressed  # the request's bytes hold whatever their sharing
    if layer_budget == "uniform":
        assert abs(first - second) <= full
    elif layer_budget == "pyramid":  # two layers: 1.95 and 0.05 of the mean
        assert first > 4 * second
    else:  # the spread layer holds more than the focused one
        assert second > 4 * first
        assert first >= ADAPTIVE_FLOOR * 0.5 * uncompressed - 2 * 16 * full  # the floor, less partial blocks
    assert len(tokens_of(run_to_completion(engine)["r"])) == 11  # the rest of its tokens, compressing every 8 steps
