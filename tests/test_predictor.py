"""The value predictor's training and weights files, on a tiny synthetic trace set."""

from __future__ import annotations

import pytest
import torch

from compression.predictor import PredictorConfig, ValuePredictor, load_predictor, model_fingerprint, save_predictor
from compression.predictor.train import train
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


def test_traces_record_every_decode_step_and_targets_sum_the_future(tokenizer):
    import random

    from app.engine import EngineConfig, LLMEngine
    from compression.config import CompressionConfig
    from compression.predictor.collect import record, samples
    from compression.predictor.features import target

    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(max_cache_bytes=2**28),
        CompressionConfig(score_interval=1, compression_interval=10**6),
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(30 + 10 * i)] for i in range(2)]
    recordings = record(engine, prompts, max_tokens=12)
    for rec, prompt in zip(recordings, prompts, strict=True):
        assert len(rec.confidences) == 12 and rec.prompt_len == len(prompt)
        for layer_masses in rec.masses:
            assert len(layer_masses) == 11  # one per decode step (the first token comes from prefill)
            for j, mass in enumerate(layer_masses):
                assert len(mass) == len(prompt) + j + 1  # every held entry and the query itself
                assert float(mass.sum()) == pytest.approx(1.0, abs=1e-4)  # one query's attention
    config = PredictorConfig.load(observation_steps=2, prediction_window=4)
    windows, targets = samples(recordings[0], config, stride=2, per_step=5, rng=random.Random(1))
    assert windows.shape[1:] == (2, config.num_features) and len(windows) == len(targets) > 0
    # The first sample: layer 0, observation 1, its entries; the target sums observations 2..5.
    first = recordings[0].masses[0]
    entries = torch.tensor(sorted(random.Random(1).sample(range(len(first[0])), 5)))
    future = sum(first[j][entries] for j in range(2, 6))
    assert torch.allclose(targets[:5], target(future))
    assert engine.store.used_bytes == 0
