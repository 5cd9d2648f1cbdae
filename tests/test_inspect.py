"""The cache inspector's history and API: opt-in only, bounded, tiers that add up to the answer's."""

from __future__ import annotations

import base64
import logging

import numpy as np
import torch
from fastapi.testclient import TestClient
from hypothesis import given
from hypothesis import strategies as st

from confkv.compress.config import resolve
from confkv.compress.history import FULL, KEY_ONLY, TierHistory, tier_counts, tier_runs, tiers_by_position
from confkv.engine.inspection import InspectionRecord, InspectionStore
from confkv.engine.llm_engine import run_to_completion
from confkv.server.api import create_app
from confkv.server.settings import Settings
from tests.helpers import greedy, make_engine, tiny_model


@given(st.lists(st.integers(0, 2), max_size=200))
def test_runs_round_trip(tiers):
    runs = tier_runs(np.array(tiers, dtype=np.int8)).tolist()
    assert tiers_by_position(runs).tolist() == tiers
    assert all(a != b for a, b in zip(runs[0:-2:2], runs[2::2], strict=False))  # maximal runs


def test_a_history_records_tiers_scores_and_clears_on_preemption():
    history = TierHistory()
    history.scored(1, torch.tensor([0, 2, 3]), torch.tensor([0.5, 0.25, 1.0]), None)
    history.record([(torch.tensor([0, 1, 2, 3]), 0), (torch.tensor([2, 0, 3]), 1)], num_tokens=4, step=3)
    first, second = (layer.to_json() for layer in history.records[0].layers)
    assert tiers_by_position(first["tiers"]).tolist() == [FULL] * 4 and first["scores"] is None
    assert tiers_by_position(second["tiers"]).tolist() == [FULL, 0, KEY_ONLY, FULL]
    scores = np.frombuffer(base64.b64decode(second["scores"]), dtype="<f2")
    assert scores[[0, 2, 3]].tolist() == [0.5, 0.25, 1.0] and np.isnan(scores[1])
    assert second["retention"] is None and history.records[0].step == 3
    history.record([(torch.tensor([0]), 0)] * 2, num_tokens=1, step=4)
    assert history.records[1].layers[1].scores is None  # scores belong to the compression they were noted in
    history.clear()
    assert history.records == [] and history.nbytes == 0


def record(request_id: str, nbytes: int) -> InspectionRecord:
    """A record of `nbytes`: its token ids count 4 bytes each."""
    tokens = [0] * (nbytes // 4)
    return InspectionRecord(request_id, None, tokens, 0, "", TierHistory(), 1, {"full": 1, "key_only": 1}, {})


def test_the_store_keeps_the_newest_within_both_bounds():
    store = InspectionStore(max_requests=2, max_bytes=100)
    for name in "abc":
        assert store.add(record(name, 8))
    assert store.get("a") is None and store.get("b") and store.get("c") and len(store) == 2
    assert not store.add(record("huge", 800)) and store.get("huge") is None  # alone over the bytes
    assert store.add(record("d", 8)) and store.nbytes == sum(store.get(n).nbytes for n in "cd")
    assert InspectionStore(0, 100).add(record("e", 8)) is False


def test_an_inspected_requests_final_tiers_are_its_answers_entries(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer, compression={"compression_interval": 8, "recent_window": 16})
    ids = [int(t) for t in torch.randint(3, len(tokenizer), (200,), generator=torch.Generator().manual_seed(0))]
    request = {"policy": "dynamic", "compression_rate": 0.85, "kv_cache_dtype": "int8"}
    params = resolve(engine.compression_config, request, True, True, inspect=True)
    engine.add_request("seen", ids, greedy(20, ignore_eos=True), params)
    engine.add_request("unseen", ids, greedy(4), resolve(engine.compression_config, request, True, True))
    outputs = run_to_completion(engine)
    assert all(out.tier_history is None for out in outputs["unseen"])
    history = outputs["seen"][-1].tier_history
    # The end of prefill, then every 8 decode steps, then the state it finished in.
    assert [r.step for r in history.records[:-1]] == [0, 8, 16] and history.records[-1].final
    assert [r.num_tokens for r in history.records] == [200, 208, 216, 219]
    assert not any(r.final for r in history.records[:-1])
    entries = outputs["seen"][-1].compression_metrics["entries"]
    assert tier_counts(history.records[-1].to_json()) == entries
    assert entries["dropped"] > 0 and entries["key_only"] > 0
    assert any(layer.scores is not None for layer in history.records[0].layers)


PROMPT = "The secret word is persimmon. " * 20


def test_the_api_keeps_only_opted_in_requests_the_newest_first_and_never_logs_the_prompt(tiny_model_dir, caplog):
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1, inspect_max_requests=2)
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "compression_stats": True}
    body["compression"] = {"policy": "snapkv", "compression_rate": 0.5, "compression_interval": 4}
    with caplog.at_level(logging.DEBUG), TestClient(create_app(settings)) as client:
        plain = client.post("/generate", json=body).json()
        assert client.get(f"/inspect/requests/{plain['id']}").status_code == 404  # did not opt in
        first, second, third = (client.post("/generate", json={**body, "inspect": True}).json() for _ in range(3))
        gone = client.get(f"/inspect/requests/{first['id']}")
        assert gone.status_code == 404 and '"inspect": true' in gone.json()["error"]["message"]
        seen = client.get(f"/inspect/requests/{third['id']}").json()
        assert client.get(f"/inspect/requests/{second['id']}").status_code == 200
        assert client.get("/inspect/requests/gen-unknown").status_code == 404
        assert "/inspect/requests/{request_id}" in client.get("/openapi.json").json()["paths"]
    assert seen["prompt"] == PROMPT and seen["text"] == third["text"]
    assert len(seen["tokens"]) == third["usage"]["prompt_tokens"] + third["usage"]["completion_tokens"]
    assert "".join(seen["tokens"][seen["num_prompt_tokens"] :]) == third["text"]
    assert seen["compression_metrics"] == third["compression_metrics"]
    assert seen["params"]["policy"] == "snapkv" and seen["entry_bytes"]["full"] > seen["entry_bytes"]["key_only"]
    last = seen["compressions"][-1]
    assert tier_counts(last) == third["compression_metrics"]["entries"]
    assert last["final"] and len(last["layers"]) == seen["num_layers"]
    assert "persimmon" not in caplog.text


def test_the_inspector_sits_behind_the_api_key_and_a_browser_may_give_it_as_basic(tiny_model_dir):
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1, api_key="k3y")
    body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "inspect": True}
    with TestClient(create_app(settings)) as client:
        page = client.get("/inspect")
        assert page.status_code == 401 and page.headers["www-authenticate"].startswith("Basic")
        bearer = {"Authorization": "Bearer k3y"}
        request_id = client.post("/generate", json=body, headers=bearer).json()["id"]
        assert client.get(f"/inspect/requests/{request_id}").status_code == 401
        assert client.get(f"/inspect/requests/{request_id}", headers=bearer).status_code == 200
        assert client.get(f"/inspect/requests/{request_id}", auth=("anyone", "k3y")).status_code == 200
        assert client.get(f"/inspect/requests/{request_id}", auth=("anyone", "wrong")).status_code == 401
        assert client.get("/health").status_code == 200
