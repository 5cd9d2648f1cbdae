"""`conf-kv calibrate`: a model's retention confidence fitted from scratch, kept by the model's
fingerprint and window, and found by a server pointed at that model."""

from __future__ import annotations

import json

import torch
from fastapi.testclient import TestClient
from transformers import AutoConfig

from confkv.compress.config import CompressionConfig
from confkv.compress.predictor.calibration import calibration_path
from confkv.compress.predictor.model import load_predictor, model_fingerprint
from confkv.compress.predictor.online import PREDICTOR_FILE, fitted_dir, predictor_path
from confkv.server.api import create_app
from confkv.server.main import main
from confkv.server.settings import Settings

WINDOW = 16  # not the shipped predictor's 128: any window is fitted for


def test_calibrate_fits_a_predictor_and_calibration_that_a_server_for_that_model_loads(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("CONFKV_CONFIDENCE_CACHE", str(tmp_path / "cache"))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert not predictor_path(tiny_model_dir, config, WINDOW).is_file()  # nothing shipped for this model
    args = ["--model-path", str(tiny_model_dir), "--prediction-window", str(WINDOW), "--sequences", "4"]
    main(["calibrate", *args, "--prompt-tokens", "96", "--threads", "1"])

    fitted = fitted_dir(config, WINDOW) / PREDICTOR_FILE
    assert fitted.parent.name == f"{model_fingerprint(config)}-w{WINDOW}"
    predictor = load_predictor(fitted, model_fingerprint(config))
    assert predictor.config.prediction_window == WINDOW and predictor.config.hidden_size == 16  # the small profile
    tables = json.loads(calibration_path(fitted).read_text())["tables"]
    assert set(tables) == {"forecast", "attention"}
    assert all(table["prediction_window"] == WINDOW for table in tables.values())

    compression = tmp_path / "compression.json"
    compression.write_text(CompressionConfig(prediction_window=WINDOW).model_dump_json())
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1, compression_config=compression)
    with TestClient(create_app(settings)) as client:
        compressor = client.app.state.engine.llm_engine.compression
        assert compressor.future_value.predictor.config.prediction_window == WINDOW
        assert set(compressor.calibrations) == {"forecast", "attention"}
        body = {"prompt": "The river runs " * 40, "max_tokens": 24, "compression_stats": True}
        answer = client.post("/generate", json=body)
        assert answer.status_code == 200, answer.text


def test_a_models_own_predictor_comes_before_the_fitted_one_and_that_before_the_shipped(tmp_path, monkeypatch):
    monkeypatch.setenv("CONFKV_CONFIDENCE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "SmolLM2-135M-Instruct"  # the shipped predictor's model, by its folder name
    folder.mkdir()
    config = AutoConfig.for_model("llama")
    shipped = predictor_path(folder, config, 128)
    assert shipped.is_file() and shipped.parent.name == "weights"
    fitted = fitted_dir(config, 128) / PREDICTOR_FILE
    fitted.parent.mkdir(parents=True)
    fitted.write_bytes(b"")
    assert predictor_path(folder, config, 128) == fitted
    assert predictor_path(folder, config, 64) == shipped  # fitted for another window: not this one's
    (folder / PREDICTOR_FILE).write_bytes(torch.zeros(1).numpy().tobytes())
    assert predictor_path(folder, config, 128) == folder / PREDICTOR_FILE
