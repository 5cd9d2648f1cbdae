"""`conf-kv calibrate`: a model's retention confidence fitted from scratch, kept by the model's
fingerprint and window, and found by a server pointed at that model."""

from __future__ import annotations

import json
import time

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoConfig

from confkv.compress.config import CompressionConfig
from confkv.compress.predictor.calibration import calibration_path
from confkv.compress.predictor.model import load_predictor, model_fingerprint
from confkv.compress.predictor.online import PREDICTOR_FILE, fitted_dir, predictor_path
from confkv.server.api import build_engine, create_app
from confkv.server.calibration import server_confidence
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


def _serve(model_dir, tmp_path, **calibration) -> Settings:
    compression = tmp_path / "compression.json"
    compression.write_text(CompressionConfig(prediction_window=WINDOW).model_dump_json())
    fitting = {"background": True, "sequences": 4, "prompt_tokens": 96, **calibration}
    return Settings(
        model_path=model_dir, max_cache_size="64", torch_threads=1, compression_config=compression, calibration=fitting
    )


def _calibration_metric(client: TestClient) -> str:
    lines = client.get("/metrics").text.splitlines()
    return next(line.split('"')[1] for line in lines if line.startswith("kv_calibration{") and line.endswith(" 1.0"))


def _wait_for(client: TestClient, states: set[str], timeout: float = 240.0) -> str:
    deadline = time.monotonic() + timeout
    while (state := client.get("/health").json()["calibration"]) not in states and time.monotonic() < deadline:
        time.sleep(0.5)
    return state


def test_a_model_with_no_confidence_is_served_by_the_rate_while_one_is_fitted_then_by_the_thresholds(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("CONFKV_CONFIDENCE_CACHE", str(tmp_path / "cache"))
    body = {"prompt": "The river runs " * 40, "max_tokens": 24, "compression_stats": True}  # dynamic, the default
    with TestClient(create_app(_serve(tiny_model_dir, tmp_path))) as client:
        compressor = client.app.state.engine.llm_engine.compression
        assert client.get("/health").json()["calibration"] == "fitting"
        assert _calibration_metric(client) == "fitting"
        assert compressor.future_value is None and compressor.calibrations == {}
        served = client.post("/generate", json=body)  # not kept waiting for the fitting
        assert served.status_code == 200, served.text
        assert _wait_for(client, {"fitted", "rate only"}) == "fitted"
        assert _calibration_metric(client) == "fitted"
        assert compressor.future_value.predictor.config.prediction_window == WINDOW
        assert set(compressor.calibrations) == {"forecast", "attention"}
        after = client.post("/generate", json=body)
        assert after.status_code == 200, after.text
        kept = after.json()["compression_metrics"]
        assert kept["compressed_size"] < kept["original_size"]
    with TestClient(create_app(_serve(tiny_model_dir, tmp_path))) as client:  # kept: found at the next start
        assert client.get("/health").json()["calibration"] == "fitted"


def test_a_corrupt_fitted_confidence_is_fitted_again_not_a_crash(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CONFKV_CONFIDENCE_CACHE", str(tmp_path / "cache"))
    fitted = fitted_dir(AutoConfig.from_pretrained(tiny_model_dir), WINDOW)
    fitted.mkdir(parents=True)
    (fitted / PREDICTOR_FILE).write_bytes(b"not safetensors")
    calibration_path(fitted / PREDICTOR_FILE).write_text("{")
    with TestClient(create_app(_serve(tiny_model_dir, tmp_path, background=False))) as client:
        assert client.get("/health").json()["calibration"] == "rate only"
    with TestClient(create_app(_serve(tiny_model_dir, tmp_path))) as client:
        assert _wait_for(client, {"fitted", "rate only"}) == "fitted"


def test_a_fitting_that_fails_leaves_the_rate_deciding_and_the_server_serving(tiny_model_dir, tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("CONFKV_CONFIDENCE_CACHE", str(blocked / "cache"))  # the fitting cannot save there
    with TestClient(create_app(_serve(tiny_model_dir, tmp_path))) as client:
        assert _wait_for(client, {"fitted", "rate only"}) == "rate only"
        answer = client.post("/generate", json={"prompt": "The river runs", "max_tokens": 4})
        assert answer.status_code == 200, answer.text


def test_a_predictor_is_refused_by_an_engine_that_keeps_too_few_observations(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CONFKV_CONFIDENCE_CACHE", str(tmp_path / "cache"))
    main(
        [
            "calibrate",
            "--model-path",
            str(tiny_model_dir),
            "--prediction-window",
            str(WINDOW),
            "--sequences",
            "2",
            "--prompt-tokens",
            "96",
        ]
    )
    settings = _serve(tiny_model_dir, tmp_path, background=False)
    engine, calibration = build_engine(settings.model_copy(update={"value_predictor": "off"}))
    assert calibration.state == "fitted" and engine.compression.future_value is None
    found = server_confidence(settings, engine.model.config, settings.compression(), torch.device("cpu"))
    with pytest.raises(ValueError, match="observations per entry"):
        engine.compression.use_confidence(found.future_value, found.calibrations)


def test_the_shipped_predictor_is_found_by_the_models_fingerprint_whatever_its_folder_is_called(default_path, tmp_path):
    config = AutoConfig.from_pretrained(default_path)
    found = predictor_path(tmp_path / "renamed-copy", config, 128)
    assert found.parent.name == "weights" and load_predictor(found, model_fingerprint(config)) is not None
