"""What an attacker (or a careless client) sends a real server: each gets a JSON 4xx naming the
field, never a 500 or a stuck engine, and the next normal request is served. Then the shutdown: a
request still running past the grace period ends with an error, not a cut connection."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from tests.helpers import LiveServer

KEY = "k3y"
ORIGIN = "http://page.example"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
PROMPT = " ".join(f"word{i % 97}" for i in range(800))  # the 800-word prompt the defect was found with


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = LiveServer(
        "--model-path",
        str(tiny_model_dir),
        "--max-cache-size",
        "64",
        "--cors-allow-origins",
        ORIGIN,
        "--shutdown-grace-period",
        "0",  # the shutdown test's requests are cut off at once
        "--api-key",
        KEY,
        api_key=KEY,
        torch_threads=1,
    )
    yield srv
    srv.stop()


def post(server: LiveServer, path: str, body: bytes | dict, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers=headers or AUTH, timeout=120)


def served_normally(server: LiveServer) -> None:
    ok = post(server, "/generate", {"prompt": "Hello", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    assert server.metric("kv_cache_bytes", '{pool="running"}') == 0


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"dynamic": {"retention_kernel": 0}}, "compression.policy_options.dynamic.retention_kernel"),
        ({"dynamic": {"kernel_size": 0}}, "compression.policy_options.dynamic.kernel_size"),
        ({"snapkv": {"kernel_size": 0}}, "compression.policy_options.snapkv.kernel_size"),
        ({"snapkv": {"kernel_size": -5}}, "compression.policy_options.snapkv.kernel_size"),
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_policy_options_the_compressor_cannot_use_are_refused_before_the_engine(server, options, field, path):
    compression = {"policy": "dynamic", "compression_rate": 0.9, "policy_options": options}
    body = {"prompt": PROMPT, "max_tokens": 4, "compression": compression}
    if path.startswith("/v1"):
        body["model"] = server_model(server)
    refused = post(server, path, body)
    assert refused.status_code == (400 if path.startswith("/v1") else 422), refused.text
    error = refused.json()["error"]
    assert field in (error.get("param") or error.get("fields")), error
    served_normally(server)


def server_model(server: LiveServer) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=AUTH, timeout=10).json()["data"][0]["id"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "timeout", "repetition_penalty"])
def test_numbers_json_cannot_hold_get_a_json_4xx_naming_the_field(server, literal, field):
    refused = post(server, "/generate", f'{{"prompt": "Hello", "{field}": {literal}}}'.encode())
    assert refused.status_code == 422, refused.text
    assert refused.json()["error"]["fields"] == field
    body = f'{{"model": "{server_model(server)}", "prompt": "Hello", "{field}": {literal}}}'.encode()
    refused = post(server, "/v1/completions", body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == field, refused.text


def test_a_repetition_penalty_that_would_overflow_the_logits_is_refused(server):
    refused = post(server, "/generate", {"prompt": "Hello", "repetition_penalty": 1e-300})
    assert refused.status_code == 422 and refused.json()["error"]["fields"] == "repetition_penalty"
    served_normally(server)


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/generate", b'{"prompt": "a\\ud800b"}', "prompt"),
        ("/generate", b'{"prompt": "a", "stop": ["x", "\\udfff"]}', "stop.1"),
        ("/generate", b'{"prompt": "a", "\\ud800": 1}', "\\ud800"),
        ("/generate", b'{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content"),
        ("/v1/chat/completions", b'{"model": "m", "messages": [{"role": "user", "content": "\\udc00"}]}', None),
    ],
)
def test_text_with_a_lone_surrogate_is_refused_naming_where_it_is(server, path, body, field):
    refused = post(server, path, body)
    assert refused.status_code in (400, 422), refused.text
    error = refused.json()["error"]
    named = error.get("fields") or error.get("param")
    assert named == (field or "messages.0.content") and "surrogate" in error["message"]
    # a valid pair (an emoji, escaped) is text like any other
    assert post(server, "/generate", b'{"prompt": "\\ud83d\\ude00", "max_tokens": 1}').status_code == 200
    served_normally(server)


def test_a_browser_preflight_needs_no_key_and_refusals_carry_cors_headers(server):
    preflight = httpx.options(
        f"{server.url}/v1/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
        timeout=10,
    )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    unauthorised = httpx.post(f"{server.url}/generate", json={"prompt": "a"}, headers={"Origin": ORIGIN}, timeout=10)
    assert unauthorised.status_code == 401
    assert unauthorised.headers["access-control-allow-origin"] == ORIGIN  # so the page can read why


def test_requests_past_the_grace_period_end_with_an_error_not_a_cut_connection(server):
    """Last in this module: it stops the server."""
    long = {"prompt": "Hello", "max_tokens": 400, "ignore_eos": True}  # a second or two on the tiny model
    events: list[str] = []
    answers: dict[str, httpx.Response] = {}
    started = threading.Event()

    def stream() -> None:
        model = server_model(server)
        body = json.dumps({**long, "model": model, "stream": True}).encode()
        with httpx.stream("POST", f"{server.url}/v1/completions", content=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line.removeprefix("data:").strip())
                    started.set()

    def whole(path: str) -> None:
        answers[path] = post(server, path, long)

    workers = [threading.Thread(target=stream), threading.Thread(target=whole, args=("/generate",))]
    for worker in workers:
        worker.start()
    assert started.wait(60)
    deadline = time.monotonic() + 60
    while server.metric("requests_running") < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.proc.send_signal(signal.SIGTERM)
    for worker in workers:
        worker.join(60)
    assert server.proc.wait(60) == 0
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["code"] == "shutting_down" and "grace period (0 s)" in error["message"]
    answer = answers["/generate"]
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "shutting_down", answer.text
