"""The value predictor's training and weights files, on a tiny synthetic trace set."""

from __future__ import annotations

import pytest
import torch

from confkv.compress.predictor import PredictorConfig, ValuePredictor, load_predictor, model_fingerprint, save_predictor
from confkv.compress.predictor.train import train
from tests.helpers import tiny_model

SMALL = {"hidden_size": 16, "num_layers": 1, "learning_rate": 1e-2, "max_epochs": 12, "batch_size": 64}


def synthetic(n: int = 600, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, PredictorConfig]:
    """Future attention follows recent attention, fading with age: learnable, not trivial."""
    config = PredictorConfig.load(**SMALL)
    g = torch.Generator().manual_seed(seed)
    windows = torch.rand(n, config.observation_steps, config.num_features, generator=g)
    trend = windows[:, -1, 0] * 2 + windows[:, :, 1].mean(1) - windows[:, -1, 2]
    return windows, torch.log1p(torch.relu(trend)) + 0.01 * torch.randn(n, generator=g), config


def test_the_shipped_config_keeps_the_seed_keys():
    config = PredictorConfig.load()
    assert (config.model_arch, config.hidden_size, config.num_layers) == ("lstm", 256, 2)
    assert (config.dropout_rate, config.learning_rate) == (0.1, 1e-4)
    assert config.prediction_window == 128 and "attention_last" in config.features
    with pytest.raises(ValueError, match="not supported"):
        PredictorConfig.load(model_arch="transformer")


def test_training_reduces_the_loss_and_keeps_the_best_epoch():
    windows, targets, config = synthetic()
    untrained = ValuePredictor(config)
    with torch.no_grad():
        before = float(torch.nn.functional.mse_loss(untrained(windows), targets))
    predictor, history = train(windows, targets, config, progress=False)
    with torch.no_grad():
        after = float(torch.nn.functional.mse_loss(predictor(windows), targets))
    assert after < 0.3 * before
    assert history.validation_loss[history.best_epoch] == min(history.validation_loss)


def test_saved_weights_load_with_identical_predictions_and_refuse_another_model(tmp_path, tokenizer):
    windows, targets, config = synthetic(200)
    predictor, _ = train(windows, targets, config.__class__(**{**config.__dict__, "max_epochs": 2}), progress=False)
    llama = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    gpt2 = tiny_model("gpt2", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    path = tmp_path / "predictor.safetensors"
    save_predictor(predictor, path, model_fingerprint(llama.config))
    loaded = load_predictor(path, model_fingerprint(llama.config))
    with torch.no_grad():
        assert torch.equal(loaded(windows), predictor(windows))
    assert loaded.config == predictor.config
    with pytest.raises(ValueError, match="trained on another model"):
        load_predictor(path, model_fingerprint(gpt2.config))
    assert load_predictor(tmp_path / "missing.safetensors", model_fingerprint(llama.config)) is None


def test_traces_follow_the_serving_timeline_and_targets_sum_the_future(tokenizer):
    import random

    from confkv.compress.config import CompressionConfig
    from confkv.compress.predictor.collect import record, samples
    from confkv.compress.predictor.features import scaled_attention, target
    from confkv.engine.llm_engine import EngineConfig, LLMEngine

    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(max_cache_bytes=2**28),
        CompressionConfig(score_interval=1, compression_interval=10**6, observation_window=8),
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(30 + 10 * i)] for i in range(2)]
    recordings = record(engine, prompts, max_tokens=12)
    for rec, prompt in zip(recordings, prompts, strict=True):
        assert len(rec.confidences) == 12 and rec.prompt_len == len(prompt)
        for prefill, layer_masses in zip(rec.prefill, rec.masses, strict=True):
            assert prefill.shape == (8, len(prompt))  # the last 8 prompt queries, one row each
            assert torch.allclose(prefill.sum(dim=1), torch.ones(8), atol=1e-4)
            assert len(layer_masses) == 11  # one per decode step (the first token comes from prefill)
            for j, mass in enumerate(layer_masses):
                assert len(mass) == len(prompt) + j + 1  # every held entry and the query itself
                assert float(mass.sum()) == pytest.approx(1.0, abs=1e-4)  # one query's attention
    config = PredictorConfig.load(observation_steps=2, prediction_window=4)
    rec = recordings[0]
    got = samples(rec, config, every=2, decay=0.5, stride=1, per_step=5, rng=random.Random(1))
    windows, targets, groups = got["windows"], got["targets"], got["groups"]
    assert windows.shape[1:] == (2, config.num_features) and len(windows) == len(targets) == len(groups) > 0
    # The first group: layer 0 at the end of prefill; the window holds prompt queries 2 apart
    # (the last and the third last), the target sums decode steps 0..3.
    picks = random.Random(1)
    first = torch.tensor(sorted(picks.sample(range(len(prompts[0])), 5)))
    prefill, decode = rec.prefill[0], rec.masses[0]
    assert torch.allclose(windows[groups == 0][:, :, 0], scaled_attention(prefill[[-3, -1]][:, first].T))
    assert torch.allclose(targets[groups == 0], target(sum(decode[j][first] for j in range(4))))
    assert torch.allclose(got["accumulated"][groups == 0], prefill.sum(0)[first])
    # The next group: the first decode observation (step 0, which also sees its own entry): the
    # target sums steps 1..4 and the decayed score has taken the observation in (decay 0.5).
    second = torch.tensor(sorted(picks.sample(range(len(prompts[0]) + 1), 5)))
    padded = torch.cat((prefill.sum(0), torch.zeros(1)))
    assert torch.allclose(targets[groups == 1], target(sum(decode[j][second] for j in range(1, 5))))
    decayed = 0.5 * padded + decode[0]
    assert torch.allclose(windows[groups == 1][:, -1, 1], scaled_attention(decayed[second]))
    assert torch.allclose(got["accumulated"][groups == 1], (padded + decode[0])[second])
    assert engine.store.used_bytes == 0


class NewestFirst(torch.nn.Module):
    """Stands in for trained weights: predicts that the newest entries will matter most."""

    def __init__(self) -> None:
        super().__init__()
        self.config = PredictorConfig.load(observation_steps=2)
        self.batches: list[int] = []

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        self.batches.append(len(window))
        return 5.0 * window[:, -1, self.config.features.index("position")]


def test_the_dynamic_policy_tiers_by_the_prediction_batched_over_layers_and_sequences(tokenizer):
    from confkv.compress.config import CompressionConfig, resolve
    from confkv.compress.predictor.online import FutureValue
    from confkv.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
    from tests.helpers import greedy

    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    predictor = NewestFirst()
    settings = CompressionConfig(sink_tokens=4, recent_window=16, compression_interval=8, score_interval=2)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_cache_bytes=2**30), settings, FutureValue(predictor, 2))
    compressed: list[tuple[bool, torch.Tensor, int]] = []
    jobs: dict[int, int] = {}  # seq_id -> compressions the predictor has run for

    def check_after_compress(seq_id, num_tokens, state):
        kv = engine.store.layer(seq_id, 0)
        assert kv.observed is not None and kv.observed.shape[0] == 2
        compressed.append((state.params.value_predictor, kv.positions[: kv.length].sort().values, num_tokens))
        jobs[seq_id] = state.predictions

    engine.compression.hooks.compressed.append(check_after_compress)
    rng = torch.Generator().manual_seed(0)
    ids = torch.randint(3, len(tokenizer), (150,), generator=rng).tolist()  # all three prefill in one step
    for name, use in (("a", True), ("b", True), ("c", False)):
        request = {"policy": "dynamic", "compression_rate": 0.8, "value_predictor": use, "retention_unit": "token"}
        params = resolve(settings, request, True, False)  # entry by entry: exactly the newest
        engine.add_request(name, ids, greedy(48, ignore_eos=True), params)
    run_to_completion(engine)
    assert engine.store.used_bytes == 0
    assert sum(jobs.values()) == 2 * len(predictor.batches)  # both due together: one batch for the two
    layers = engine.store.num_layers
    # Every other prediction every entry of every layer of both sequences; in between only the entries
    # written since (a few compression intervals of 8 decode steps at most), the others keeping their forecast.
    assert len(predictor.batches) >= 3
    assert all(rows >= 2 * layers * 50 for rows in predictor.batches[0::2])
    assert all(rows <= 2 * layers * 24 for rows in predictor.batches[1::2])
    for use, held, num_tokens in compressed:
        middle = held[(held >= 4) & (held <= num_tokens - 1 - 16)]  # neither sinks nor the recent window
        newest_kept = torch.equal(middle, torch.arange(num_tokens - 16 - len(middle), num_tokens - 16))
        assert newest_kept == use  # with the prediction: exactly the newest; without: attention's choice


def test_without_weights_the_server_says_it_scores_by_attention_only(tmp_path, caplog, tokenizer):
    from confkv.compress.predictor.online import load_future_value

    llama = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    with caplog.at_level("WARNING"):
        assert load_future_value(tmp_path / "none.safetensors", llama.config, torch.device("cpu"), 4) is None
    assert "observed attention only" in caplog.text and "conf-kv calibrate" in caplog.text


@pytest.mark.parametrize(
    ("min_attention", "logged", "silent"),
    [(0.0, "every drop", False), (2.0, "none", False), (0.0, "none", True)],  # silent: a tensor-parallel follower's
)
def test_dropped_entries_that_draw_attention_are_logged_for_training(
    tokenizer, tmp_path, min_attention, logged, silent
):
    from confkv.compress.config import CompressionConfig, resolve
    from confkv.compress.predictor.misses import MissLog
    from confkv.compress.predictor.online import FutureValue
    from confkv.compress.predictor.train import load_error_samples
    from confkv.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
    from tests.helpers import greedy

    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    settings = CompressionConfig(sink_tokens=4, recent_window=16, compression_interval=8, score_interval=2)
    misses = MissLog(tmp_path / "errors", prediction_window=16, min_attention=min_attention)
    misses = misses.silent() if silent else misses
    engine = LLMEngine(
        model, tokenizer, EngineConfig(max_cache_bytes=2**30), settings, FutureValue(NewestFirst(), 2, misses)
    )
    ids = torch.randint(3, len(tokenizer), (200,), generator=torch.Generator().manual_seed(1)).tolist()
    # No compression_stats asked: logging mistakes audits the request anyway.
    params = resolve(settings, {"policy": "dynamic", "compression_rate": 0.8, "kv_cache_dtype": "auto"}, True, False)
    engine.add_request("r", ids, greedy(40, ignore_eos=True), params)
    dropped = {}

    def count_drops(seq_id, num_tokens, state):
        dropped.update({layer: len(d.future) for layer, d in state.misses.items()})

    engine.compression.hooks.compressed.append(count_drops)
    run_to_completion(engine)
    assert sum(dropped.values()) > 0 and engine.compression.audit_bytes == 0 and engine.store.used_bytes == 0
    files = list((tmp_path / "errors").glob("*.safetensors"))
    if logged == "none":
        assert files == [] and misses.written == 0
        return
    samples = load_error_samples(tmp_path / "errors")
    assert len(files) == 1 and len(samples["targets"]) == sum(dropped.values()) == misses.written
    assert samples["windows"].shape[1:] == (2, len(NewestFirst().config.features))
    assert (samples["targets"] >= 0).all() and (samples["targets"] > 0).any()  # the audit saw attention
    config = PredictorConfig.load(**{**SMALL, "observation_steps": 2, "max_epochs": 2})
    predictor, _ = train(samples["windows"], samples["targets"], config, progress=False)
    assert predictor(samples["windows"]).shape == samples["targets"].shape


def test_the_library_compressor_ranks_by_the_predictor_it_is_given(tokenizer):
    from confkv import DynamicKVCompressor
    from confkv.compress.config import CompressionConfig
    from confkv.compress.predictor.online import FutureValue

    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    ids = torch.randint(3, len(tokenizer), (1, 200), generator=torch.Generator().manual_seed(1))
    predictor = NewestFirst()
    compressor = DynamicKVCompressor(
        max_cache_size="64MiB",
        future_value=FutureValue(predictor, 2),
        compression_rate=0.8,
        compression_interval=8,
        kv_cache_dtype="auto",
        config=CompressionConfig(recent_window=16),  # a server setting: a request cannot choose it
    )
    compressor.generate(model, ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert predictor.batches  # consulted
    kv = compressor.store.layer(0, 0)
    held = kv.positions[: kv.length].sort().values
    num_tokens = compressor.sequence.num_computed
    middle = held[(held >= 4) & (held < num_tokens - 16)]
    assert torch.equal(middle, torch.arange(num_tokens - 16 - len(middle), num_tokens - 16))  # the newest
