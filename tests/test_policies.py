"""Policies plug in like kvpress presses, and every compression setting is declared once: the
config file, requests and the library accept the same names and refuse the same mistakes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv import DynamicKVCompressor
from confkv.compress.config import CompressionConfig, CompressionOptions, InvalidCompression, resolve
from confkv.compress.scoring import POLICIES, LayerEntries, ScorePolicy, make_policy
from confkv.engine.llm_engine import run_to_completion
from tests.helpers import COMPRESS_OFTEN, greedy, make_engine, tiny_model


@pytest.fixture
def oldest_first() -> Iterator[type[ScorePolicy]]:
    """A policy of one class, written the way a user would add one."""

    @dataclass
    class OldestFirst(ScorePolicy):
        name = "test_oldest_first"
        uses_attention = False
        skip: int = 0  # an option: entries at positions below it score lowest

        def score(self, entries: LayerEntries) -> torch.Tensor:
            score = -entries.positions.float()
            return torch.where(entries.positions < self.skip, score.min() - 1, score)

    yield OldestFirst
    del POLICIES[OldestFirst.name]


def test_a_policy_of_one_class_is_accepted_by_name_and_decides_what_is_kept(tokenizer, oldest_first):
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    # entry by entry: kept by word, the oldest entry's word would come along whole
    request = {
        "policy": "test_oldest_first",
        "compression_rate": 0.8,
        "kv_cache_dtype": "auto",
        "retention_unit": "token",
    }
    request["policy_options"] = {"test_oldest_first": {"skip": 10}}
    assert CompressionOptions.model_validate(request).policy == "test_oldest_first"  # the request schema knows it
    params = resolve(engine.compression_config, request, True, False)
    assert params.scorer() == oldest_first(skip=10)
    ids = [int(t) for t in torch.randint(3, len(tokenizer), (300,), generator=torch.Generator().manual_seed(0))]
    engine.add_request("r", ids, greedy(16, ignore_eos=True), params)
    seen = []

    def held_after_compress(seq_id, num_tokens, state):
        kv = engine.store.layer(seq_id, 0)
        seen.append((num_tokens, kv.positions[: kv.length].sort().values.tolist()))

    engine.compression.hooks.compressed.append(held_after_compress)
    out = run_to_completion(engine)["r"]
    assert out[-1].finished and seen
    num_tokens, held = seen[0]
    middle = [p for p in held if 4 <= p < num_tokens - 16]
    assert middle and middle == list(range(10, 10 + len(middle)))  # the oldest past `skip`, as the policy says


def test_policy_options_are_the_policy_fields_and_unknown_ones_are_refused():
    assert make_policy("snapkv", {"kernel_size": 7}).kernel_size == 7
    assert make_policy("dynamic", {"decay": 0.5}).decay == 0.5
    with pytest.raises(ValueError, match="'kernel'.*kernel_size"):
        make_policy("snapkv", {"kernel": 7})
    with pytest.raises(ValueError, match="unknown policy 'magic'"):
        make_policy("magic")
    with pytest.raises(ValueError, match="kernel_size"):
        make_policy("snapkv", {"kernel_size": "wide"})


def test_dynamic_ranks_a_run_of_attended_tokens_above_a_lone_peaks_neighbours():
    # A fact spans several tokens: averaged over neighbours, the run (positions 20-26) outranks
    # the tokens beside a single spike (positions 9 and 11), which max-pooling raises to the spike.
    value = torch.full((40,), 0.01)
    value[10] = 1.0
    value[20:27] = 0.5
    entries = LayerEntries(
        keys=None, positions=torch.arange(40), attention=value, token_confidence=torch.ones(40), position=39, layer=0
    )
    averaged = make_policy("dynamic").score(entries)  # the default: averaged over 7
    assert averaged[[9, 11]].max() < averaged[21:26].min()
    maxed = make_policy("dynamic", {"pooling": "max", "kernel_size": 3}).score(entries)  # the earlier default
    assert maxed[[9, 11]].min() > maxed[21:26].max()
    with pytest.raises(ValueError, match="pooling"):
        make_policy("dynamic", {"pooling": "median"})


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    seed=st.integers(0, 2**16),
    options=st.sampled_from([("snapkv", {}), ("dynamic", {}), ("dynamic", {"pooling": "max", "kernel_size": 3})]),
)
def test_pooling_runs_over_neighbours_in_the_text_whatever_the_storage_order(n, seed, options):
    # After a compression KEY_ONLY entries move to the front of the table: an entry's score must
    # not depend on where it is stored, only on its neighbours in the text.
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randperm(3 * n, generator=generator)[:n].sort().values
    value = torch.rand(n, generator=generator)
    confidence = torch.rand(n, generator=generator)
    stored = torch.randperm(n, generator=generator)
    policy = make_policy(*options)

    def scores(order: torch.Tensor) -> torch.Tensor:
        entries = LayerEntries(None, positions[order], value[order], confidence[order], position=3 * n, layer=0)
        return policy.score(entries)

    assert torch.allclose(scores(stored), scores(torch.arange(n))[stored])


@pytest.mark.parametrize(
    ("request_body", "field"),
    [
        ({"recent_window": 16}, "compression.recent_window"),  # a server setting, not a request's
        ({"policy_options": {"snapkv": {"kernel": 7}}}, "compression.policy_options.snapkv.kernel"),
        ({"policy_options": {"magic": {}}}, "compression.policy_options.magic"),
        ({"policy_options": {"dynamic": {"pooling": "median"}}}, "compression.policy_options.dynamic.pooling"),
        # values the schema once took and a compression could not use: each option's declared range
        (
            {"policy_options": {"dynamic": {"retention_kernel": 0}}},
            "compression.policy_options.dynamic.retention_kernel",
        ),
        ({"policy_options": {"dynamic": {"kernel_size": 0}}}, "compression.policy_options.dynamic.kernel_size"),
        ({"policy_options": {"snapkv": {"kernel_size": -5}}}, "compression.policy_options.snapkv.kernel_size"),
        ({"policy_options": {"dynamic": {"decay": float("nan")}}}, "compression.policy_options.dynamic.decay"),
        ({"policy_options": {"dynamic": {"decay": None}}}, "compression.policy_options.dynamic.decay"),
        ({"compression_rate": float("inf")}, "compression.compression_rate"),
        ({"policy": "magic"}, "compression.policy"),
        ({"thresholds": {"high": 0.5}}, "compression.thresholds"),
        ({"prediction_window": 64}, "compression.prediction_window"),  # not the window the predictor learned
    ],
)
def test_resolve_names_the_field_it_refuses(request_body, field):
    with pytest.raises(InvalidCompression) as refused:
        resolve(CompressionConfig(), request_body, True, False)
    assert refused.value.fields == [field]


def test_a_request_is_laid_over_the_config_key_by_key_and_checked_again():
    config = CompressionConfig(
        thresholds={"high": 0.8, "medium": 0.5}, policy_options={"dynamic": {"decay": 0.9, "kernel_size": 5}}
    )
    params = resolve(config, {"thresholds": {"high": 0.95}, "policy_options": {"dynamic": {"decay": 0.5}}}, True, False)
    assert (params.thresholds.high, params.thresholds.medium) == (0.95, 0.5)
    assert params.scorer() == make_policy("dynamic", {"decay": 0.5, "kernel_size": 5})
    # A null is a field left out: the config's value stands.
    nulls = resolve(config, {"policy_options": None, "thresholds": None}, True, False)
    assert nulls.scorer() == make_policy("dynamic", {"decay": 0.9, "kernel_size": 5})
    assert nulls.thresholds.high == 0.8
    # Valid alone (the default medium is 0.7), not over this config's medium of 0.5.
    with pytest.raises(InvalidCompression) as refused:
        resolve(config, {"thresholds": {"low": 0.6}}, True, False)
    assert refused.value.fields == ["compression.thresholds"]


def test_the_seed_config_with_its_low_threshold_is_accepted():
    seed = {"confidence_thresholds": {"high": 0.9, "medium": 0.7, "low": 0.5}, "policy": "dynamic"}
    config = CompressionConfig.model_validate(seed)
    assert (config.thresholds.high, config.thresholds.medium, config.thresholds.drop_line) == (0.9, 0.7, 0.5)
    assert CompressionConfig().thresholds.drop_line == 0.7  # without low, medium is the drop line
    with pytest.raises(ValueError, match="bogus"):
        CompressionConfig.model_validate({"bogus": 1})


def test_the_library_refuses_options_it_does_not_know():
    with pytest.raises(InvalidCompression) as refused:
        DynamicKVCompressor(max_cache_size=64, recent_window=16)
    assert refused.value.fields == ["compression.recent_window"]
    with pytest.raises(InvalidCompression):
        DynamicKVCompressor(max_cache_size=64, policy_options={"dynamic": {"decy": 0.5}})
    compressor = DynamicKVCompressor(max_cache_size=64, policy_options={"dynamic": {"decay": 0.5}})
    assert compressor.params.scorer().decay == 0.5


def test_prediction_window_is_the_predictors_or_refused():
    from confkv.compress.predictor import PredictorConfig, ValuePredictor
    from confkv.compress.predictor.online import FutureValue

    assert resolve(CompressionConfig(), {"prediction_window": 128}, True, False).prediction_window == 128
    future_value = FutureValue(ValuePredictor(PredictorConfig.load(prediction_window=32)), 4)
    with pytest.raises(ValueError, match="trained to forecast 32 tokens ahead"):
        future_value.require_window(CompressionConfig().prediction_window)
    with pytest.raises(ValueError, match="trained to forecast 32"):
        DynamicKVCompressor(max_cache_size=64, future_value=future_value)
    config = CompressionConfig(prediction_window=32)
    compressor = DynamicKVCompressor(max_cache_size=64, future_value=future_value, config=config)
    assert compressor.params.prediction_window == 32
    with pytest.raises(InvalidCompression, match="forecasts 32 tokens ahead"):
        DynamicKVCompressor(max_cache_size=64, future_value=future_value, config=config, prediction_window=128)


def test_a_request_that_does_not_compress_builds_no_policy():
    config = CompressionConfig()
    assert resolve(config, {"policy": "none"}, True, False).scorer() is None
    assert resolve(config, {"policy": "h2o"}, False, False).scorer() is None  # compression off server-wide
    assert resolve(config, {"enabled": False}, True, False).scorer() is None
    assert resolve(config, {"policy": "h2o"}, True, False).scorer() == make_policy("h2o")


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_keeps_the_contract_the_engine_relies_on(name, tokenizer):
    """Scores: one finite float per entry, the same for the same input, whatever order the entries
    are stored in; a retention confidence in [0, 1] or none; a rate in [0, 1). And a request with
    the policy runs to its end within its rate and gives every byte back."""
    policy, n = make_policy(name), 40
    gen = torch.Generator().manual_seed(0)
    positions = torch.randperm(n, generator=gen)  # storage order is not text order after compaction
    entries = LayerEntries(
        keys=torch.randn(2, n, 16, generator=gen),
        positions=positions,
        attention=torch.rand(n, generator=gen),
        token_confidence=torch.rand(n, generator=gen).clamp(min=0.05),
        position=n,
        layer=0,
        predicted=torch.rand(n, generator=gen),
    )
    score = policy.score(entries)
    assert score.shape == (n,) and score.dtype.is_floating_point and torch.isfinite(score).all()
    assert torch.equal(policy.score(entries), score)
    order = torch.randperm(n, generator=gen)  # the same entries stored in another order: the same scores
    moved = LayerEntries(**{**vars(entries), **{k: getattr(entries, k)[..., order] for k in ("positions",
                         "attention", "token_confidence", "predicted")}, "keys": entries.keys[:, order]})  # fmt: skip
    if name != "random":  # its scores are a seeded draw per stored slot
        assert torch.allclose(policy.score(moved), score[order])
    accumulated = policy.accumulate(entries.attention, torch.rand(n, generator=gen))
    assert accumulated.shape == (n,) and torch.isfinite(accumulated).all()
    retention = policy.retention(entries)
    assert retention is None or (retention.shape == (n,) and ((retention >= 0) & (retention <= 1)).all())
    assert 0.0 <= policy.target_rate(0.6, [0.9, 0.2, 0.7]) < 1.0

    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    request = {"policy": name, "compression_rate": 0.6, "kv_cache_dtype": "auto"}  # the policy alone meets the rate
    params = resolve(engine.compression_config, request, True, True)
    prompt = [int(t) for t in torch.randint(3, len(tokenizer), (200,), generator=gen)]
    engine.add_request("r", prompt, greedy(24, ignore_eos=True), params)
    out = run_to_completion(engine)["r"]
    assert sum(len(o.new_token_ids) for o in out) == 24
    assert out[-1].compression_metrics["compression_ratio"] <= 0.4 + 0.1  # the rate, up to its protected windows
    assert engine.store.used_bytes == 0
