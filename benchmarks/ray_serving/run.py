"""Engine replicas on Ray Serve: our router against Ray's default, on multi-turn conversations.

A local Ray cluster runs the application of `confkv.cluster.app`; conversations (a document, then
questions about it, each turn carrying the whole chat so far) go through the ingress as streaming
OpenAI chat requests. Side by side in one run: 1 replica, 2 replicas with Ray Serve's default
power-of-two router, 2 replicas with ours (longest cached prefix, then most free KV memory).
Measured per setup: the prefix hit rate of turns 2+ (prompt tokens the replica's prefix cache
served, from each answer's `usage.prompt_tokens_details.cached_tokens`), their median time to
first token, output tokens per second over the run, and errors.

    python benchmarks/ray_serving/run.py             # make bench-ray
    python benchmarks/ray_serving/run.py --quick     # fewer conversations
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.report import Provenance, save_report  # noqa: E402
from confkv.models.corpus import paragraphs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from confkv.server.settings import Settings  # noqa: E402
from load_tests.monitoring import free_port  # noqa: E402

QUESTIONS = (
    "Summarise the document in one sentence.",
    "What is the main subject?",
    "Name one detail the document gives.",
    "What would a reader do with this?",
    "Which word best describes its tone?",
)


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft: float  # seconds from sending to the first piece of text
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    replica: str
    error: str = ""


@dataclass
class Conversation:
    document: str
    questions: list[str]


def conversations(count: int, turns: int, words: int, seed: int = 0) -> list[Conversation]:
    """`count` conversations about different documents of about `words` words, `turns` questions each."""
    rng, texts = random.Random(seed), paragraphs()
    out = []
    for i in range(count):
        start, parts = (i * 37) % len(texts), []
        while sum(len(p.split()) for p in parts) < words:
            parts.append(texts[(start + len(parts)) % len(texts)])
        out.append(Conversation("\n\n".join(parts), [rng.choice(QUESTIONS) for _ in range(turns)]))
    return out


async def chat_turn(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int) -> tuple[str, Turn]:
    """One streaming chat request; the answer's text and its figures (conversation and turn left 0)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, first, text, usage = time.perf_counter(), None, "", {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        replica = response.headers.get("x-confkv-replica", "")
        if response.status_code != 200:
            await response.aread()
            return "", Turn(0, 0, 0.0, 0, 0, 0, replica, f"{response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return text, Turn(0, 0, 0.0, 0, 0, 0, replica, chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    first = first or time.perf_counter()
                    text += choice["delta"]["content"]
            usage = chunk.get("usage") or usage
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    ttft = (first or time.perf_counter()) - sent
    return text, Turn(0, 0, ttft, usage.get("prompt_tokens", 0), cached, usage.get("completion_tokens", 0), replica)


async def run_conversations(url: str, convs: list[Conversation], max_tokens: int, progress: bool = True) -> list[Turn]:
    """All conversations at once, each one turn after another, as chat users do."""
    bar = tqdm(total=sum(len(c.questions) for c in convs), desc="turns", disable=not progress)

    async def talk(client: httpx.AsyncClient, index: int, conv: Conversation) -> list[Turn]:
        messages, turns = [], []
        for number, question in enumerate(conv.questions, 1):
            content = f"{conv.document}\n\n{question}" if number == 1 else question
            messages.append({"role": "user", "content": content})
            answer, turn = await chat_turn(client, model, messages, max_tokens)
            turn.conversation, turn.turn = index, number
            turns.append(turn)
            bar.update()
            if turn.error:
                break
            messages.append({"role": "assistant", "content": answer})
        return turns

    async with httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        results = await asyncio.gather(*(talk(client, i, c) for i, c in enumerate(convs)))
    bar.close()
    return [turn for turns in results for turn in turns]


def summary(turns: list[Turn], wall_s: float) -> dict:
    later = [t for t in turns if t.turn > 1 and not t.error]
    return {
        "requests": len(turns),
        "errors": sum(bool(t.error) for t in turns),
        "prefix_hit_rate": sum(t.cached_tokens for t in later) / max(1, sum(t.prompt_tokens for t in later)),
        "ttft_later_median_s": statistics.median(t.ttft for t in later) if later else float("nan"),
        "ttft_first_median_s": statistics.median(t.ttft for t in turns if t.turn == 1 and not t.error),
        "output_tokens_per_s": sum(t.completion_tokens for t in turns) / wall_s,
        "replicas_used": len({t.replica for t in turns if t.replica}),
        "wall_s": wall_s,
    }


# ----- a local cluster --------------------------------------------------------------------------
@contextlib.contextmanager
def local_cluster(port: int, num_cpus: int = 4) -> Iterator[str]:
    """A Ray head on this machine with Serve's HTTP proxy on `port`; yields the base URL."""
    import ray
    from ray import serve

    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level="WARNING")
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def deploy(url: str, settings: Settings, timeout_s: float = 300.0) -> None:
    """Run the application (replacing any running one) and wait until every replica reports metrics."""
    from ray import serve

    from confkv.cluster.app import APP_NAME, build

    serve.run(build(settings), name=APP_NAME, route_prefix="/")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            text = httpx.get(f"{url}/metrics", timeout=10).text
            if f"cluster_replicas_reporting {float(settings.cluster.replicas)}" in text:
                return
        time.sleep(1.0)
    raise TimeoutError(f"{settings.cluster.replicas} replicas did not report within {timeout_s:.0f} s")


def replica_settings(**overrides) -> Settings:
    """Replicas for this machine's benchmarks and tests: one torch thread each, greedy short answers."""
    base = {"torch_threads": 1, "max_num_seqs": 8, "max_cache_size": "512MB"}
    return Settings(**{**base, **overrides})


SETUPS = {
    "1 replica": {"replicas": 1, "router": "power_of_two"},
    "2 replicas, Ray's default router": {"replicas": 2, "router": "power_of_two"},
    "2 replicas, our router": {"replicas": 2, "router": "prefix_kv"},
}


def table(results: dict[str, dict]) -> str:
    rows = [
        "| setup | prefix hit rate, turns 2+ | TTFT turns 2+ (median) | TTFT turn 1 (median) | output tokens/s "
        "| errors | replicas used |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {r['prefix_hit_rate']:.1%} | {r['ttft_later_median_s'] * 1000:.0f} ms "
            f"| {r['ttft_first_median_s'] * 1000:.0f} ms | {r['output_tokens_per_s']:.1f} | {r['errors']} "
            f"| {r['replicas_used']} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--words", type=int, default=400, help="document length")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="8 conversations")
    parser.add_argument("--out", type=Path, default=RESULTS / "ray_serving")
    args = parser.parse_args()
    if args.quick:
        args.conversations = 8
    provenance = Provenance.capture()
    convs = conversations(args.conversations, args.turns, args.words)
    results = {}
    with local_cluster(free_port()) as url:
        for name, cluster in SETUPS.items():
            print(f"== {name}")
            deploy(url, replica_settings(cluster=cluster))
            started = time.perf_counter()
            turns = asyncio.run(run_conversations(url, convs, args.max_tokens))
            results[name] = summary(turns, time.perf_counter() - started) | {"turns": [asdict(t) for t in turns]}
    figures = {name: {k: v for k, v in r.items() if k != "turns"} for name, r in results.items()}
    save_report(
        args.out, "Replicas on Ray Serve: conversations", table(figures), {"results": results}, args, provenance
    )


if __name__ == "__main__":
    main()
