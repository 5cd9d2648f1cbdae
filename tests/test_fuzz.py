"""Fuzzing a live server on the real default model, bounded here (`make fuzz` runs it for longer):
schemathesis over every route of its own OpenAPI schema (no 5xx, no response off the schema), and
hypothesis requests drawn from the options' declared ranges (`tests/strategies.py`), each of which
must be served, leave the engine running and give its memory back.

CONFKV_FUZZ_EXAMPLES sets how many requests each draws (12 and 20 here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import LiveServer
from tests.strategies import compression_options, sampling_options

pytestmark = pytest.mark.slow
EXAMPLES = os.environ.get("CONFKV_FUZZ_EXAMPLES")
# A prompt long enough that every compression has entries to drop, short enough for ~1 s a request.
PROMPT = " ".join(f"The value of item {i} is {i * 37 % 1000}." for i in range(40))
MAX_TOKENS = 12


def test_fuzzed_requests_get_no_server_error_and_match_the_schema(default_path, tmp_path):
    srv = LiveServer(
        "--model-path",
        str(default_path),
        "--max-cache-size",
        "64",
        "--default-max-tokens",
        "2",
        "--request-timeout",  # fuzzed max_tokens may be large: bound every request's time
        "5",
    )
    try:
        cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
        result = subprocess.run(
            [
                cli,
                "run",
                f"{srv.url}/openapi.json",
                "--checks",
                "not_a_server_error,response_schema_conformance",
                "--max-examples",
                EXAMPLES or "12",
                "--seed",
                "1",
                "--generation-database",
                "none",
                "--request-timeout",
                "60",
                "--exclude-path-regex",
                "^/metrics$",  # Prometheus text, not JSON
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
        assert "passed" in result.stdout.lower()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def fuzzed(default_path):
    srv = LiveServer(
        "--model-path", str(default_path), "--max-cache-size", "64", "--request-timeout", "60",
        "--enable-prefix-cache", "true",
    )  # fmt: skip
    yield srv
    srv.stop()


@settings(
    max_examples=int(EXAMPLES or 20),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    route=st.sampled_from(["/generate", "/v1/completions"]),
    sampling=sampling_options(),
    compression=compression_options(),
    stream=st.booleans(),
)
def test_every_request_within_the_declared_ranges_is_served_and_the_engine_survives(
    fuzzed, route, sampling, compression, stream
):
    """The defect this guards: an option the schema took that the compressor could not use stopped the
    engine for good. Every compression setting and policy option is drawn from its own declaration."""
    sampling["max_tokens"] = min(sampling.get("max_tokens") or MAX_TOKENS, MAX_TOKENS)
    sampling["min_tokens"] = min(sampling.get("min_tokens", 0), sampling["max_tokens"])
    body = {"prompt": PROMPT, **sampling, "compression": compression, "compression_stats": True, "stream": stream}
    if route.startswith("/v1"):
        body["model"] = httpx.get(f"{fuzzed.url}/v1/models", timeout=10).json()["data"][0]["id"]
    with httpx.stream("POST", f"{fuzzed.url}{route}", json=body, timeout=120) as answer:
        text = answer.read().decode()
    assert answer.status_code == 200, (body, text[-2000:])
    if stream:
        events = [line.removeprefix("data:").strip() for line in text.splitlines() if line.startswith("data:")]
        answers = [json.loads(event) for event in events if event != "[DONE]"]
    else:
        answers = [json.loads(text)]
    assert answers and not [a for a in answers if a.get("error")], (body, text[-2000:])
    assert httpx.get(f"{fuzzed.url}/health", timeout=10).json()["status"] == "ok"
    assert fuzzed.metric("kv_cache_bytes", '{pool="running"}') == 0  # its memory came back
    failures = [line for line in httpx.get(f"{fuzzed.url}/metrics", timeout=10).text.splitlines()
                if line.startswith("engine_request_failures_total")]  # fmt: skip
    assert not failures, failures
