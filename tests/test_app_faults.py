"""The app around a tiny model saved to disk: an engine-loop crash is reported, not hidden."""

from __future__ import annotations

import statistics
import threading
import time

import httpx
import uvicorn
from fastapi.testclient import TestClient

from confkv.engine.async_engine import EngineStalledError
from confkv.server.api import create_app
from confkv.server.main import GracefulServer
from confkv.server.settings import Settings
from tests.helpers import LiveServer


def metric(client: TestClient, sample: str) -> float:
    line = next(line for line in client.get("/metrics").text.splitlines() if line.startswith(sample + " "))
    return float(line.rsplit(" ", 1)[1])


def test_an_engine_loop_crash_past_its_restarts_is_reported_by_health_ready_requests_and_metrics(
    tiny_model_dir, caplog
):
    settings = Settings(
        model_path=tiny_model_dir, max_cache_size="64", torch_threads=1, slo_tpot_seconds=0.25, engine_max_restarts=0
    )
    app = create_app(settings)
    dead: list[BaseException] = []
    app.state.on_engine_dead = dead.append  # the server's own exits the process (`GracefulServer.engine_died`)
    with TestClient(app) as client:
        body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0}
        assert client.post("/generate", json=body).status_code == 200
        assert client.get("/v1/models").json()["data"][0]["id"] == tiny_model_dir.name
        assert metric(client, 'slo_target_seconds{kind="tpot"}') == 0.25
        assert metric(client, 'slo_target_seconds{kind="ttft"}') == 5.0
        beat = metric(client, "engine_loop_heartbeat_timestamp_seconds")
        time.sleep(0.7)  # the idle loop passes every 0.5 s
        assert time.time() - 2 < beat < metric(client, "engine_loop_heartbeat_timestamp_seconds")

        def crash():
            raise RuntimeError("injected loop fault")

        client.app.state.engine.llm_engine.step = crash
        lost = client.post("/generate", json=body)  # in flight as the loop dies: it failed, once
        assert lost.status_code == 500 and lost.json()["error"]["type"] == "engine_error"
        assert "injected loop fault" in lost.json()["error"]["message"] and "restart" in lost.json()["error"]["message"]
        refused = client.post("/generate", json=body)  # after: refused, the engine is down
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "engine_unavailable"
        assert "restart" in refused.json()["error"]["message"]
        health = client.get("/health")
        assert health.status_code == 503 and "injected loop fault" in health.json()["error"]
        assert client.get("/ready").status_code == 503
        assert client.post("/generate", json=body).status_code == 503  # and it stays down, clearly
        # A stream is refused before its first byte too, not opened with a 200 and cut.
        stream = client.post("/generate", json={**body, "stream": True})
        assert stream.status_code == 503 and stream.headers["retry-after"] == "5"
        completion = {"model": tiny_model_dir.name, "prompt": "Hello", "max_tokens": 3, "stream": True}
        assert client.post("/v1/completions", json=completion).status_code == 503
        # Each counted once, as what it was: the lost one an engine error, the refused ones 503s.
        assert metric(client, 'requests_total{status="error"}') == 1
        assert metric(client, 'requests_total{status="503"}') == 4
        assert 'requests_total{status="abort"}' not in client.get("/metrics").text
        stopped = metric(client, "engine_loop_heartbeat_timestamp_seconds")
        time.sleep(0.7)
        assert metric(client, "engine_loop_heartbeat_timestamp_seconds") == stopped  # EngineLoopStalled will fire
        assert len(dead) == 1 and "injected loop fault" in repr(dead[0])
        assert metric(client, "engine_loop_restarts_total") == 0
    assert "engine loop crashed" in caplog.text


def test_the_server_process_exits_non_zero_when_its_engine_loop_is_dead(tiny_model_dir):
    """So that Docker, Kubernetes or systemd restart it, rather than a process that lingers half-alive."""
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1)
    app = create_app(settings)
    server = GracefulServer(uvicorn.Config(app), app, grace_s=1.0)
    app.state.on_engine_dead(RuntimeError("dead"))  # what the engine loop calls once it gives up
    assert server.should_exit and server.exit_code == 1


def test_metrics_read_the_engine_between_steps_and_do_not_wait_on_a_hung_step(tiny_model_dir):
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1)
    with TestClient(create_app(settings)) as client:
        engine = client.app.state.engine.llm_engine
        take, takers = engine.snapshot, []

        def recorded():
            takers.append(threading.current_thread().name)
            return take()

        engine.snapshot = recorded
        assert metric(client, "requests_running") == 0
        assert takers == ["engine-loop"]  # the store is read by the thread that changes it, never beside it

        step, entered, release = engine.step, threading.Event(), threading.Event()

        def hung_step():
            entered.set()
            release.wait(30)
            return step()

        engine.step = hung_step
        body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0}
        worker = threading.Thread(target=lambda: client.post("/generate", json=body))
        worker.start()
        try:
            assert entered.wait(10)
            started = time.monotonic()
            assert metric(client, "requests_running") == 0  # the last snapshot, from before the step
            assert time.monotonic() - started < 5
        finally:
            release.set()
            worker.join()
        assert metric(client, 'requests_total{status="length"}') == 1
        assert metric(client, 'kv_cache_bytes{pool="running"}') == 0


def test_a_step_that_hangs_past_the_iteration_timeout_is_declared_dead_not_waited_on(tiny_model_dir, caplog):
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1, engine_iteration_timeout=2.0)
    app = create_app(settings)
    dead: list[BaseException] = []
    app.state.on_engine_dead = dead.append
    with TestClient(app) as client:
        body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0}
        time.sleep(2.5)  # an idle loop is not a hung one
        assert client.post("/generate", json=body).status_code == 200 and not dead
        engine, release = client.app.state.engine.llm_engine, threading.Event()
        step = engine.step
        engine.step = lambda: release.wait(30) and step()
        try:
            started = time.monotonic()
            lost = client.post("/generate", json=body)
            assert time.monotonic() - started < 10  # answered once the watchdog saw the step hang
            assert lost.status_code == 500 and "engine_iteration_timeout" in lost.json()["error"]["message"]
            health = client.get("/health")
            assert health.status_code == 503 and "hung" in health.json()["error"]
            assert client.post("/generate", json=body).status_code == 503
            assert len(dead) == 1 and isinstance(dead[0], EngineStalledError)
        finally:
            release.set()
    assert "the engine loop is hung" in caplog.text


def test_malformed_and_non_utf8_bodies_get_4xx_in_our_error_shape(tiny_model_dir):
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1)
    with TestClient(create_app(settings)) as client:
        json_type = {"Content-Type": "application/json"}
        for body in (b'{"prompt": "\xff\xfe"}', b'{"prompt": "unterminated', b"\x00\x01\x02"):
            r = client.post("/generate", content=body, headers=json_type)
            assert r.status_code in (400, 422), (body, r.text)
            assert r.json()["error"]["type"] == "invalid_request" and r.json()["error"]["message"]
        assert client.get("/nowhere").json()["error"]["type"] == "not_found"
        r = client.post("/v1/completions", content=b'{"model": "x", "prompt": "\xff"}', headers=json_type)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_other_streams_keep_flowing_while_a_long_prompt_is_tokenized(tiny_model_dir):
    """Tokenizing ~1M characters takes seconds; meanwhile the event loop goes on streaming another
    request's tokens (the tiny model decodes one every few milliseconds)."""
    words = [f"{word}{i}" for i in range(1000) for word in ("alpha", "beta", "gamma", "delta")]
    huge = " ".join(words[(7 * i) % len(words)] for i in range(150_000))[:1_000_000]  # under the 1 MiB body limit
    # One torch thread: on a busy machine two threads wait on each other at every op, slowing the
    # stream's pace twentyfold while tokenizing barely slows, so the window would look too short.
    server = LiveServer("--model-path", str(tiny_model_dir), "--max-cache-size", "64", torch_threads=1)
    arrivals: list[float] = []
    body = {"prompt": "Hello there", "max_tokens": 400, "ignore_eos": True, "stream": True}

    def stream() -> None:  # one streamed request after another, until told to stop
        while not stop.is_set():
            with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=300) as r:
                arrivals.extend(time.monotonic() for line in r.iter_lines() if line.startswith("data:"))

    stop = threading.Event()
    streaming = threading.Thread(target=stream)
    try:
        streaming.start()
        while len(arrivals) < 10:
            time.sleep(0.01)
        started = time.monotonic()
        refused = httpx.post(f"{server.url}/generate", json={"prompt": huge, "max_tokens": 1}, timeout=300)
        finished = time.monotonic()
        stop.set()
        streaming.join(60)
    finally:
        server.stop()
    # ~450k tokens: refused once tokenized (over the context, or over the queue's token budget).
    assert refused.status_code in (413, 503), refused.text
    # A blocked event loop shows only if tokenizing outlasts many of the stream's steps; how long it
    # takes in seconds depends on the machine, so the window is judged against the stream's own pace.
    before = [t for t in arrivals if t < started]
    pace = statistics.median(b - a for a, b in zip(before, before[1:], strict=False))
    assert finished - started > 20 * pace, f"tokenizing ({finished - started:.2f} s) too short to show anything"
    during = [started, *(t for t in arrivals if started < t < finished), finished]
    assert len(during) > 10, "the stream delivered (almost) nothing while the long prompt was tokenized"
    assert max(b - a for a, b in zip(during, during[1:], strict=False)) < (finished - started) / 2


def test_unknown_openai_fields_are_refused_when_the_server_says_so(tiny_model_dir):
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1, openai_unknown_fields="reject")
    with TestClient(create_app(settings)) as client:
        body = {"model": tiny_model_dir.name, "prompt": "Hello", "max_tokens": 2, "stream_options": None}
        assert client.post("/v1/completions", json=body).status_code == 200
        refused = client.post("/v1/completions", json={**body, "guided_json": {}})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "guided_json" and "reject" in refused.json()["error"]["message"]
        assert metric(client, 'requests_total{status="400"}') == 1
        # Every refusal is counted by its status, whichever check made it.
        assert client.post("/v1/completions", json={**body, "max_tokens": 2, "min_tokens": 3}).status_code == 400
        assert metric(client, 'requests_total{status="400"}') == 2
        assert client.post("/v1/completions", json={**body, "model": "other"}).status_code == 404
        assert metric(client, 'requests_total{status="404"}') == 1
