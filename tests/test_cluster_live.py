"""The Ray Serve application on a local Ray cluster started here: an ingress on loopback and two
engine replicas of the real default model. Serving, labelled metrics, routing under KV pressure, a
replica killed under locust load, and conversations kept where their prefixes are cached."""

from __future__ import annotations

import asyncio
import csv
import itertools
import json
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.ray_serving.run import (
    conversations,
    deploy,
    local_cluster,
    replica_settings,
    run_conversations,
    summary,
)
from confkv.cluster.replica import REPLICA_HEADER
from load_tests import run
from load_tests.monitoring import free_port

pytestmark = [pytest.mark.slow, pytest.mark.ray]

# Small enough that one long uncompressed request fills most of one replica's cache.
SETTINGS = {"max_cache_size": "96MB", "max_num_batched_tokens": 256}
DOCUMENT = " ".join(f"Line {i} of the long report says the value is {i * 7 % 13}." for i in range(90))
LONG_REQUEST = {
    "prompt": DOCUMENT,
    "max_tokens": 400,
    "ignore_eos": True,
    "stream": True,
    "compression": {"enabled": False},
}


@pytest.fixture(scope="module")
def cluster():
    with local_cluster(free_port()) as url:
        deploy(url, replica_settings(**SETTINGS, cluster={"replicas": 2, "imbalance_threshold": 0.4}))
        yield url


def samples(url: str) -> list:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def by_replica(url: str, name: str, **labels: str) -> dict[str, float]:
    return {
        s.labels["replica"]: s.value
        for s in samples(url)
        if s.name == name and "replica" in s.labels and all(s.labels.get(k) == v for k, v in labels.items())
    }


def replicas_reporting(url: str) -> float:
    return next(s.value for s in samples(url) if s.name == "cluster_replicas_reporting")


def wait_for(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def test_both_replicas_serve_and_every_engine_metric_names_its_replica(cluster):
    async def ask_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster, timeout=300) as client:
            prompts = [f"Question {i}: name a colour that starts with the letter {chr(65 + i)}." for i in range(8)]
            return await asyncio.gather(
                *(client.post("/generate", json={"prompt": p, "max_tokens": 4, "temperature": 0}) for p in prompts)
            )

    responses = asyncio.run(ask_all())
    assert all(r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1 for r in responses)
    assert len({r.headers[REPLICA_HEADER] for r in responses}) == 2
    invalid = httpx.post(f"{cluster}/generate", json={"prompt": "Hi", "max_tokens": -1}, timeout=60)
    assert invalid.status_code == 422 and "max_tokens" in invalid.json()["error"]["fields"]  # the replica's own check

    assert replicas_reporting(cluster) == 2

    def served() -> dict[str, float]:  # finished requests per replica, over every status
        counts: dict[str, float] = {}
        for sample in samples(cluster):
            if sample.name == "requests_total":
                counts[sample.labels["replica"]] = counts.get(sample.labels["replica"], 0.0) + sample.value
        return counts if sum(counts.values()) >= 9 else {}

    assert len(wait_for(served, 10, "the replicas reporting the 9 requests")) == 2
    engine = [s for s in samples(cluster) if s.name.startswith(("kv_cache", "requests", "time_to_first"))]
    assert engine and all("replica" in s.labels for s in engine)
    assert httpx.get(f"{cluster}/ready", timeout=30).status_code == 200


def test_a_replica_full_of_a_long_request_gets_no_new_ones_and_its_memory_comes_back(cluster):
    with (
        httpx.Client(base_url=cluster, timeout=300) as client,
        client.stream("POST", "/generate", json=LONG_REQUEST) as held,
    ):
        full_id = held.headers[REPLICA_HEADER]

        def pressed() -> bool:
            running = by_replica(cluster, "kv_cache_bytes", pool="running").get(full_id, 0.0)
            capacity = by_replica(cluster, "kv_cache_capacity_bytes")[full_id]
            return running > 0.6 * capacity

        wait_for(pressed, 120, "the long request holding 60% of its replica's KV cache")
        time.sleep(2.5)  # the routers' view of free KV memory is refreshed every second
        same_prefix = {"prompt": DOCUMENT + " In short,", "max_tokens": 2}
        shorts = [{"prompt": f"Say {word}.", "max_tokens": 2} for word in ("yes", "no", "maybe")]
        for body in (same_prefix, *shorts):
            response = httpx.post(f"{cluster}/generate", json=body, timeout=300)
            assert response.status_code == 200
            assert response.headers[REPLICA_HEADER] != full_id, body
    # Its memory comes back once the stream is gone.
    wait_for(
        lambda: by_replica(cluster, "kv_cache_bytes", pool="running").get(full_id, 1.0) == 0.0,
        60,
        "the cut stream's KV memory returned",
    )
    decisions = {s.labels["reason"]: s.value for s in samples(cluster) if s.name == "cluster_route_decisions_total"}
    assert decisions.get("imbalance", 0) >= 1


def test_a_replica_killed_under_locust_load_loses_no_request_and_comes_back(cluster, tmp_path):
    import ray

    before = set(by_replica(cluster, "kv_cache_capacity_bytes"))
    out = tmp_path / "load"
    users = 6
    load = threading.Thread(target=run.run_locust, args=(cluster, users, 3, "30s", out))
    load.start()
    time.sleep(10)
    # Besides locust's short requests, whole answers that may be in flight on the victim (retried).
    longs = [{"prompt": f"Tell a long story about the number {i}.", "max_tokens": 96} for i in range(4)]
    answers: list[httpx.Response] = []
    askers = [
        threading.Thread(target=lambda b=body: answers.append(httpx.post(f"{cluster}/generate", json=b, timeout=300)))
        for body in longs
    ]
    for asker in askers:
        asker.start()

    # The victim is the replica serving a long stream, named by its answer's header: whatever the
    # machine's speed, that stream is still decoding when the replica dies, and must end with the
    # documented error event. (Choosing by the metrics, up to a second old, could pick a replica
    # whose requests had all finished by then.)
    stream_body = {"prompt": "Tell a long story.", "max_tokens": 320, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{cluster}/generate", json=stream_body, timeout=300) as held:
        lines = held.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # decoding has begun
        victim_id = held.headers[REPLICA_HEADER]
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
        victim = next(name for name in names if name.endswith(victim_id))
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        events = [line for line in lines if line.startswith("data:")]
    assert "replica serving this stream died" in events[-1], events[-2:]
    for asker in askers:
        asker.join(timeout=300)
    assert [a.status_code for a in answers] == [200] * len(longs)  # whole answers are retried elsewhere
    load.join(timeout=400)
    assert not load.is_alive()

    rows = list(csv.DictReader((tmp_path / "load_stats.csv").read_text().splitlines()))
    total = next(row for row in rows if row["Name"] == "Aggregated")
    # The load really ran: a request per user at least (how many more is the machine's speed).
    assert int(total["Request Count"]) >= users
    failures = list(csv.DictReader((tmp_path / "load_failures.csv").read_text().splitlines()))
    lost = [(f["Name"], f["Error"]) for f in failures if "replica serving this stream died" not in f["Error"]]
    assert not lost, lost  # only streams already under way may end, with the documented error event
    stream_errors = next(s.value for s in samples(cluster) if s.name == "cluster_stream_errors_total")
    assert stream_errors >= 1

    def replaced() -> bool:
        now = set(by_replica(cluster, "kv_cache_capacity_bytes"))
        return len(now) == 2 and now != before

    wait_for(replaced, 180, "Serve replacing the killed replica")
    assert httpx.post(f"{cluster}/generate", json={"prompt": "Hello", "max_tokens": 2}, timeout=300).status_code == 200


def test_our_router_keeps_each_conversation_where_its_prefix_is_cached(cluster):
    """Every later turn goes to the replica that served the conversation, and finds its earlier turns
    cached there. Against Ray's default router this is a figure, not a test: power-of-two choices
    often sends a turn back to the replica it just left (the least loaded one), so how far it falls
    behind varies from run to run; `benchmarks/ray_serving/run.py` measures it."""
    convs = conversations(6, 3, words=300, seed=1)
    roomy = {**SETTINGS, "max_cache_size": "512MB"}  # every conversation's prefix fits
    deploy(cluster, replica_settings(**roomy, cluster={"replicas": 2}))
    turns = asyncio.run(run_conversations(cluster, convs, max_tokens=8, progress=False))
    figures = summary(turns, 1.0)
    print(json.dumps(figures, indent=1))
    assert figures["errors"] == 0 and figures["requests"] == 18
    assert figures["prefix_hit_rate"] > 0.9
    by_conversation: dict[int, list] = {}
    for turn in sorted(turns, key=lambda t: (t.conversation, t.turn)):
        by_conversation.setdefault(turn.conversation, []).append(turn)
    for conversation in by_conversation.values():
        assert {t.replica for t in conversation} == {conversation[0].replica}
        for before, after in itertools.pairwise(conversation):
            assert after.cached_tokens >= 0.9 * before.prompt_tokens
