"""The app around a tiny model saved to disk: an engine-loop crash is reported, not hidden."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from app.api import create_app
from app.settings import Settings
from tests.helpers import tiny_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_an_engine_loop_crash_is_reported_by_health_ready_and_requests(tiny_model_dir, caplog):
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1)
    with TestClient(create_app(settings)) as client:
        body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0}
        assert client.post("/generate", json=body).status_code == 200
        assert client.get("/v1/models").json()["data"][0]["id"] == tiny_model_dir.name

        def crash():
            raise RuntimeError("injected loop fault")

        client.app.state.engine.engine.step = crash
        failed = client.post("/generate", json=body)
        assert failed.status_code == 503 and failed.json()["error"]["type"] == "engine_unavailable"
        assert "restart" in failed.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and "injected loop fault" in health.json()["error"]
        assert client.get("/ready").status_code == 503
        assert client.post("/generate", json=body).status_code == 503  # and it stays down, clearly
    assert "engine loop crashed" in caplog.text
