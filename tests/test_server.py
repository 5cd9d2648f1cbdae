"""The real server on loopback, on the embedded default model."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from tests.helpers import LiveServer

pytestmark = pytest.mark.slow


def post(server, body, timeout=120):
    return httpx.post(f"{server.url}/generate", json=body, timeout=timeout)


def stream_events(server, body) -> list[dict]:
    events = []
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    return events


def wait_for_kv_bytes(server, expected: float = 0.0, timeout: float = 10.0) -> float:
    deadline = time.monotonic() + timeout
    while True:
        # What requests hold; the prefix pool keeps finished requests on purpose.
        value = server.metric("kv_cache_bytes", '{pool="running"}') + server.metric("kv_cache_bytes", '{pool="audit"}')
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_health_and_ready(server):
    # the embedded model's shipped confidence, found by its fingerprint whatever its folder's name
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok", "calibration": "shipped"}
    assert httpx.get(f"{server.url}/ready").json() == {"status": "ready"}


def test_generate_greedy(server):
    r = post(server, {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["text"].startswith(" Paris")
    assert body["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 8, "cached_prompt_tokens": 0}
    assert body["id"].startswith("gen-")


def test_chat_messages_use_the_chat_template(server):
    r = post(
        server,
        {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 24,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["text"]
    assert body["usage"]["prompt_tokens"] > 20  # system prompt and role markers were added


def test_stream_gives_the_same_text_as_non_stream(server):
    body = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    whole = post(server, body).json()
    events = stream_events(server, body)
    assert len(events) > 3
    assert "".join(e["text"] for e in events) == whole["text"]
    assert all("finish_reason" not in e for e in events[:-1])
    assert events[-1]["finish_reason"] == whole["finish_reason"]
    assert events[-1]["usage"] == whole["usage"]


def test_stop_strings_cut_the_text(server):
    body = {"prompt": "Count: one, two, three, four, five, six,", "max_tokens": 30, "temperature": 0}
    full = post(server, body).json()["text"]
    assert "," in full
    cut = post(server, {**body, "stop": [","]}).json()
    assert cut["finish_reason"] == "stop"
    assert cut["text"] == full[: full.index(",")]
    streamed = stream_events(server, {**body, "stop": [","]})
    assert "".join(e["text"] for e in streamed) == cut["text"]


async def _concurrent(server, bodies):
    async with httpx.AsyncClient(timeout=120) as client:
        responses = await asyncio.gather(*(client.post(f"{server.url}/generate", json=b) for b in bodies))
    return [r.json() for r in responses]


def test_seeds_reproduce_under_concurrency(server):
    seeded = {"prompt": "My favourite animal is", "max_tokens": 20, "temperature": 0.9, "seed": 42}
    alone = post(server, seeded).json()["text"]
    others = [{"prompt": f"Story number {i}:", "max_tokens": 16 + i, "temperature": 1.0} for i in range(4)]
    results = asyncio.run(_concurrent(server, [*others[:2], seeded, *others[2:]]))
    assert results[2]["text"] == alone
    unseeded = asyncio.run(_concurrent(server, [{**seeded, "seed": s} for s in (1, 2, 3)]))
    assert len({r["text"] for r in unseeded}) > 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({}, "body"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "body"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "a", "temperature": -0.5}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "compression": {"policy": "dynamic", "bogus": 1}}, "compression.bogus"),
        ({"prompt": "a", "compression": {"compression_rate": 1.0}}, "compression.compression_rate"),
        ({"prompt": "a", "compression": {"policy": "magic"}}, "compression.policy"),
        ({"prompt": "a", "compression": {"recent_window": 8}}, "compression.recent_window"),
        ({"prompt": "a", "compression": {"prediction_window": 64}}, "compression.prediction_window"),
        ({"prompt": "a", "compression": {"policy_options": {"snapkv": {"kernel": 3}}}}, "compression.policy_options"),
        ({"prompt": "a", "stop": [""]}, "stop.0"),
        ({"prompt": "a", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        ({"prompt": "a", "unknown_field": True}, "unknown_field"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"prompt_token_ids": [1, -2]}, "prompt_token_ids.1"),
        ({"prompt_token_ids": [10**7]}, "prompt_token_ids"),
        ({"prompt": "a", "prompt_token_ids": [1]}, "body"),
        ({"prompt": "a", "timeout": 0}, "timeout"),
    ],
)
def test_bad_input_gets_422_naming_the_field(server, body, field):
    r = post(server, body)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request"
    assert field in error["fields"]


def test_prompt_token_ids_equal_the_text_prompt(server, tokenizer):
    text = post(server, {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).json()
    ids = tokenizer("The capital of France is").input_ids
    by_ids = post(server, {"prompt_token_ids": ids, "max_tokens": 8, "temperature": 0}).json()
    assert by_ids["text"] == text["text"] and by_ids["usage"] == text["usage"]


def test_valid_compression_options_are_accepted(server):
    body = {
        "prompt": "Hi",
        "max_tokens": 2,
        "compression": {
            "enabled": True,
            "policy": "h2o",
            "compression_rate": 0.6,
            "thresholds": {"high": 0.9, "medium": 0.7, "low": 0.5},
            "policy_options": {"h2o": {}, "dynamic": {"decay": 0.9}},
            "prediction_window": 128,
            "compression_interval": 8,
        },
        "compression_stats": True,
    }
    assert post(server, body).status_code == 200


def test_prompt_longer_than_the_context_gets_413(server):
    r = post(server, {"prompt": "word " * 9000, "max_tokens": 10})
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "context_length_exceeded"
    r = post(server, {"prompt": "word " * 100, "max_tokens": 8150})
    assert r.status_code == 413 and "max_tokens" in r.json()["error"]["message"]


def test_malformed_json_gets_422(server):
    r = httpx.post(f"{server.url}/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422


def test_memory_comes_back_after_disconnects(server):
    # Counting keeps the model going well past the client's patience.
    body = {"prompt": "Count from 1 to 1000: 1, 2, 3, 4,", "max_tokens": 400, "temperature": 0}
    # A streaming client that goes away after two events.
    with httpx.stream("POST", f"{server.url}/generate", json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        seen = 0
        for line in lines:
            seen += line.startswith("data:")
            if seen == 2:
                break
    # A non-streaming client that gives up.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/generate", json=body, timeout=1.5)
    assert wait_for_kv_bytes(server, 0.0) == 0.0
    assert server.metric("kv_cache_bytes", '{pool="running"}') == 0.0
    assert server.metric("requests_total", '{status="abort"}') >= 2
    assert server.metric("requests_running") == 0


def test_metrics_count_requests_and_tokens(server):
    before = server.metric("generation_tokens_total")
    post(server, {"prompt": "Hello", "max_tokens": 5, "temperature": 0})
    assert server.metric("generation_tokens_total") == before + 5
    assert server.metric("time_to_first_token_seconds_count") >= 1
    assert server.metric("time_per_output_token_seconds_count") >= 1
    assert server.metric("kv_cache_capacity_bytes") == 256 * 2**20
    assert 256 * 2**20 <= server.metric("kv_cache_allocated_bytes") <= 256 * 2**20 * 17 / 16  # the arena
    assert 0 < server.metric("kv_cache_touched_bytes") <= server.metric("kv_cache_allocated_bytes")
    try:
        refused = server.metric("requests_total", '{status="422"}')
    except KeyError:
        refused = 0.0
    assert post(server, {"prompt": ""}).status_code == 422
    assert post(server, {"prompt_token_ids": [10**7]}).status_code == 422  # refused once its tokens are read
    assert server.metric("requests_total", '{status="422"}') == refused + 2


LONG_PROMPT = " ".join(f"Item {i} is stored in box {i * 7 % 13}." for i in range(120))


def stats_request(policy: str, rate: float, max_tokens: int) -> dict:
    return {
        "prompt": LONG_PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "compression_stats": True,
        "compression": {"policy": policy, "compression_rate": rate},
    }


def test_compression_stats_report_metrics(server):
    body = stats_request("dynamic", 0.85, 20)
    metrics = post(server, body).json()["compression_metrics"]
    assert set(metrics) == {
        "original_size",
        "compressed_size",
        "ceiling_size",
        "compression_ratio",
        "mean_compression_ratio",
        "hit_rate",
        "recall_rate",
        "entries",
        "policy",
        "compression_time_ms",
    }
    assert metrics["policy"] == "dynamic"
    assert metrics["compression_ratio"] == pytest.approx(metrics["compressed_size"] / metrics["original_size"])
    assert metrics["compression_ratio"] <= 0.15 + 0.05  # one compression interval of slack
    # Over the request too: compressed from the end of prefill on, each step at most one interval's slack.
    assert 0.0 < metrics["mean_compression_ratio"] <= 0.15 + 0.05
    assert metrics["ceiling_size"] == pytest.approx(0.15 * metrics["original_size"], abs=1)
    assert 0.0 < metrics["recall_rate"] <= 1.0
    assert metrics["entries"]["dropped"] > 0
    assert "compression_metrics" not in post(server, {**body, "compression_stats": False}).json()
    events = stream_events(server, body)
    assert events[-1]["compression_metrics"]["policy"] == "dynamic"


def test_compression_can_be_turned_off_server_wide(default_path):
    srv = LiveServer("--model-path", str(default_path), "--max-cache-size", "256", "--compression-enabled", "false")
    try:
        metrics = post(srv, stats_request("h2o", 0.8, 8)).json()["compression_metrics"]
        assert metrics["policy"] == "none" and metrics["entries"]["dropped"] == 0
        assert metrics["compression_ratio"] >= 1.0
    finally:
        srv.stop()


def test_operational_metrics_follow_the_engine(server):
    text = httpx.get(f"{server.url}/metrics").text
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            assert f"# HELP {name} " in text, f"{name} has no HELP text"
    before = {
        "evicted": server.metric("kv_evictions_total", '{reason="compression"}'),
        "ratio": server.metric("kv_compression_ratio_count"),
        "recall": server.metric("kv_attention_recall_count"),
        "oom": server.metric("kv_oom_errors_total"),
        "queue": server.metric("request_queue_seconds_count"),
        "compression_s": server.metric("kv_compression_seconds_count"),
    }
    body = {
        "prompt": LONG_PROMPT,
        "max_tokens": 20,
        "temperature": 0,
        "compression": {"policy": "h2o", "compression_rate": 0.75, "compression_interval": 4},
        "compression_stats": True,
    }
    dropped = post(server, body).json()["compression_metrics"]["entries"]["dropped"]
    assert dropped > 0
    assert server.metric("kv_evictions_total", '{reason="compression"}') - before["evicted"] >= dropped
    assert server.metric("kv_compression_ratio_count") == before["ratio"] + 1
    assert server.metric("kv_attention_recall_count") == before["recall"] + 1
    assert server.metric("request_queue_seconds_count") == before["queue"] + 1
    assert server.metric("kv_compression_seconds_count") > before["compression_s"]
    assert server.metric("kv_cache_entries", '{tier="full"}') == 0  # nothing running now
    assert 0 < server.metric("device_memory_usage_ratio") < 1
    # A request that can never fit the KV budget counts as an out-of-memory error.
    too_big = {"prompt": "word " * 5000, "max_tokens": 2000, "compression": {"enabled": False}}
    assert post(server, too_big).json()["error"]["type"] == "kv_cache_exceeded"
    assert server.metric("kv_oom_errors_total") == before["oom"] + 1


def test_chat_turn_two_reuses_turn_one_from_the_prefix_cache(server):
    turn1 = [{"role": "user", "content": "List three fruits, one per line."}]
    first = post(server, {"messages": turn1, "max_tokens": 24, "temperature": 0}).json()
    hits = server.metric("kv_prefix_cache_hits_total")  # turn 1 may reuse the chat template's system prompt
    parked = server.metric("kv_cache_bytes", '{pool="prefix"}')  # turn 1 stays parked, its bookkeeping counted
    assert parked > server.metric("kv_prefix_cache_bookkeeping_bytes") > 0
    turn2 = [*turn1, {"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And vegetables?"}]
    second = post(server, {"messages": turn2, "max_tokens": 8, "temperature": 0, "compression_stats": True}).json()
    # All of turn 1 is reused but the last 32 prompt tokens, which compression observes, and which
    # may reach back into turn 1 when turn 2 adds fewer.
    prompt = second["usage"]["prompt_tokens"]
    assert second["usage"]["cached_prompt_tokens"] >= min(first["usage"]["prompt_tokens"], prompt - 32)
    assert second["compression_metrics"]["hit_rate"] == pytest.approx(
        second["usage"]["cached_prompt_tokens"] / second["usage"]["prompt_tokens"]
    )
    assert server.metric("kv_prefix_cache_hits_total") == hits + 1
    assert server.metric("kv_prefix_cache_evictions_total", '{reason="superseded"}') >= 1  # turn 2 replaced turn 1
    # At the default rate int8 storage alone meets the budget: turn 1 dropped nothing, so it was parked whole.
    assert second["compression_metrics"]["prefix_parked"] == "request"
    reused = server.metric("kv_prefix_cache_reused_tokens_total", '{parked="request"}')
    assert reused >= second["usage"]["cached_prompt_tokens"]
    # The same tokens without the cache give the same greedy answer.
    again = post(server, {"messages": turn2, "max_tokens": 8, "temperature": 0, "compression": {"enabled": False}})
    assert again.json()["text"] == second["text"]


def test_warm_up_serves_the_first_request_from_the_prefix_cache(default_path, tmp_path):
    config = tmp_path / "server.yaml"
    system = (
        "You are a patient assistant who answers questions about the Python standard library in detail. "
        "Name the module, show a short example, say which Python version added it, and point out one common "
        "mistake. Keep answers under two hundred words and never invent functions that do not exist."
    )  # long enough to reuse: a prefix hit leaves the last 32 prompt tokens (what compression observes) to compute
    config.write_text(f"prefix_cache_warmup:\n  - [{{role: system, content: '{system}'}}]\n")
    srv = LiveServer("--model-path", str(default_path), "--max-cache-size", "256", "--config", str(config))
    try:
        assert srv.metric("kv_prefix_cache_warmup_tokens") > 20
        assert srv.metric("kv_cache_bytes", '{pool="prefix"}') > 0
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "What is itertools?"}]
        body = post(srv, {"messages": messages, "max_tokens": 4, "temperature": 0}).json()
        assert body["usage"]["cached_prompt_tokens"] > 20
    finally:
        srv.stop()


def test_request_timeout_ends_the_request_with_its_memory_back(server):
    body = {"prompt": "Count from 1 to 1000: 1, 2, 3,", "max_tokens": 500, "temperature": 0, "timeout": 1.0}
    answer = post(server, body).json()
    assert answer["finish_reason"] == "timeout" and answer["usage"]["completion_tokens"] < 500
    assert wait_for_kv_bytes(server, 0.0) == 0.0


def test_api_keys_guard_every_route_but_health(default_path, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# one key per line\nteam-a\nteam-b\n")
    srv = LiveServer(
        "--model-path", str(default_path), "--max-cache-size", "64", "--api-key-file", str(keys), api_key="team-b"
    )
    try:
        body = {"prompt": "Hi", "max_tokens": 2}
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert httpx.post(f"{srv.url}/generate", json=body).status_code == 401
        assert httpx.get(f"{srv.url}/metrics").status_code == 401
        assert httpx.get(f"{srv.url}/v1/models").json()["error"]["type"] == "authentication_error"
        ok = httpx.post(f"{srv.url}/generate", json=body, headers={"Authorization": "Bearer team-a"}, timeout=60)
        assert ok.status_code == 200
        assert srv.metric("requests_total", '{status="length"}') == 1  # the refused ones never reached the engine
        big = {"prompt": "x" * (2**20 + 10)}
        assert httpx.post(f"{srv.url}/generate", json=big, headers=srv.headers).status_code == 413
    finally:
        srv.stop()


def test_sigterm_refuses_new_requests_and_lets_running_ones_finish(default_path):
    import signal
    import threading

    srv = LiveServer("--model-path", str(default_path), "--max-cache-size", "64", "--shutdown-grace-period", "120")
    try:
        answers = []
        long = {"prompt": "Count from 1 to 100: 1, 2, 3,", "max_tokens": 48, "temperature": 0}
        worker = threading.Thread(target=lambda: answers.append(post(srv, long)))
        worker.start()
        deadline = time.monotonic() + 30
        while srv.metric("requests_running") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = post(srv, {"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["type"] == "shutting_down"
        assert httpx.get(f"{srv.url}/ready").status_code == 503
        worker.join(120)
        assert answers[0].status_code == 200 and answers[0].json()["usage"]["completion_tokens"] == 48
        assert srv.proc.wait(30) == 0
    finally:
        srv.stop()


def test_a_burst_is_bounded_by_the_queue_and_never_exceeds_the_kv_budget(default_path):
    srv = LiveServer(
        "--model-path", str(default_path), "--max-cache-size", "32", "--max-num-seqs", "4", "--max-queue-size", "4"
    )
    try:
        prompt = " ".join(f"Line {i} of a long document about boxes." for i in range(40))
        # Streams, EOS ignored: a request's status comes back as soon as it is admitted or refused, and
        # every admitted one stays open (running or queued) until the whole burst has its answer and the
        # first has started, so no place is given back while the burst is decided, however slowly the
        # machine runs it. The budget holds about one such request at a time.
        body = {
            "prompt": prompt,
            "max_tokens": 200,
            "temperature": 0.7,
            "ignore_eos": True,
            "stream": True,
            "compression": {"enabled": False},
        }
        burst_size = 20

        async def burst() -> list[tuple[int, str | None]]:
            answers: list[tuple[int, str | None]] = []
            release = asyncio.Event()

            async def one(client: httpx.AsyncClient) -> None:
                async with client.stream("POST", f"{srv.url}/generate", json=body) as r:
                    answers.append((r.status_code, r.headers.get("retry-after")))
                    await release.wait()  # leaving closes the stream: the server aborts the request

            async def release_when_decided_and_running() -> None:
                while len(answers) < burst_size or peak == 0.0:
                    await asyncio.sleep(0.05)
                release.set()

            async with httpx.AsyncClient(timeout=300) as client:
                requests = (one(client) for _ in range(burst_size))
                await asyncio.wait_for(asyncio.gather(release_when_decided_and_running(), *requests), 120)
            return answers

        peak = 0.0
        done = threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, srv.metric("kv_cache_usage_ratio"))  # (running + prefix) / budget, one reading
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            answers = asyncio.run(burst())
        finally:
            done.set()
            watcher.join()
        codes = [code for code, _ in answers]
        # Served or refused, nothing else; places are taken as the burst arrives, before any request runs.
        assert set(codes) == {200, 503}, codes
        assert codes.count(200) <= 8, codes  # max_num_seqs + max_queue_size
        assert all(retry for code, retry in answers if code == 503)
        assert 0 < peak <= 1.0
        deadline = time.monotonic() + 60  # the abandoned streams are aborted within a step or two
        while srv.metric("kv_cache_bytes", '{pool="running"}') and time.monotonic() < deadline:
            time.sleep(0.1)
        assert srv.metric("kv_cache_bytes", '{pool="running"}') == 0

        # Streams give their places back, also when the client leaves mid-stream: more of them than the
        # queue holds, one after another, and then a request is still accepted.
        short = {**body, "max_tokens": 4}
        for _ in range(9):
            with httpx.stream("POST", f"{srv.url}/generate", json=short, timeout=60) as r:
                assert r.status_code == 200
                next(r.iter_lines())
        assert (
            httpx.post(f"{srv.url}/generate", json={**body, "max_tokens": 2, "stream": False}, timeout=60).status_code
            == 200
        )
    finally:
        srv.stop()
