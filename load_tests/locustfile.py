"""A realistic load mix for CONF-KV; every task checks the answer, not only the status code.

    locust -f load_tests/locustfile.py --host http://127.0.0.1:8080            # web UI
    make load-test                                                              # headless, CSV + HTML

Short questions and long documents (text from the Python standard library's docstrings), streaming
and not, compression off and on at several rates and storage formats, multi-turn chats through the
OpenAI route, and a share of invalid requests that must be refused with 422 naming the field.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from locust import HttpUser, between, task

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from confkv.models.corpus import paragraphs  # noqa: E402

RATES = (0.5, 0.6, 0.75, 0.875)
POLICIES = ("dynamic", "h2o", "snapkv", "tova")
# Every storage format at once: their pages come and go in one arena, which a soak must see stay bounded.
STORAGES = ("int8", "int4", "kivi4", "float16", "auto")
QUESTIONS = (
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is two plus two?",
)


def document(rng: random.Random, words: int) -> str:
    """Consecutive paragraphs of real prose, about `words` words long."""
    texts = paragraphs()
    start = rng.randrange(len(texts))
    parts: list[str] = []
    while sum(len(p.split()) for p in parts) < words:
        parts.append(texts[(start + len(parts)) % len(texts)])
    return "\n\n".join(parts)


class ServerUser(HttpUser):
    wait_time = between(0.5, 2.0)
    network_timeout = 300.0
    connection_timeout = 30.0

    def on_start(self) -> None:
        self.rng = random.Random()
        self.model = self.client.get("/v1/models", name="openai models").json()["data"][0]["id"]

    # ----- checks ------------------------------------------------------------------------
    @staticmethod
    def _check_generate(body: dict, max_tokens: int) -> str | None:
        """What is wrong with a /generate answer, or None."""
        usage = body.get("usage", {})
        if body.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {body.get('finish_reason')!r}"
        if not 1 <= usage.get("completion_tokens", 0) <= max_tokens:
            return f"completion_tokens {usage.get('completion_tokens')} outside 1..{max_tokens}"
        if body["finish_reason"] == "length" and not body.get("text"):
            return "no text although max_tokens was reached"
        return None

    def _post(self, name: str, payload: dict, check) -> None:
        with self.client.post(payload.pop("_path", "/generate"), json=payload, name=name, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            problem = check(r.json())
            if problem:
                r.failure(problem)

    # ----- the mix -----------------------------------------------------------------------
    @task(4)
    def short_question(self) -> None:
        max_tokens = self.rng.randint(8, 24)
        payload = {
            "messages": [{"role": "user", "content": self.rng.choice(QUESTIONS)}],
            "max_tokens": max_tokens,
            "temperature": self.rng.choice((0.0, 0.7)),
        }
        self._post("generate short", payload, lambda b: self._check_generate(b, max_tokens))

    @task(3)
    def long_document_compressed(self) -> None:
        rate = self.rng.choice(RATES)
        max_tokens = 16
        payload = {
            "messages": [{"role": "user", "content": document(self.rng, 500) + "\n\nSummarise the text above."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "compression": {
                "policy": self.rng.choice(POLICIES),
                "compression_rate": rate,
                "kv_cache_dtype": self.rng.choice(STORAGES),
            },
            "compression_stats": True,
        }

        def check(body: dict) -> str | None:
            problem = self._check_generate(body, max_tokens)
            metrics = body.get("compression_metrics")
            if problem or metrics is None:
                return problem or "no compression_metrics"
            if not 0 < metrics["compression_ratio"] <= 1 - rate + 0.1:  # one interval of slack, and rounding
                return f"compression_ratio {metrics['compression_ratio']:.3f} above {1 - rate:.2f}"
            return None

        self._post(f"generate long compressed {rate}", payload, check)

    @task(2)
    def long_document_uncompressed(self) -> None:
        payload = {
            "prompt": document(self.rng, 400) + "\n\nIn one sentence, the text above is about",
            "max_tokens": 12,
            "temperature": 0,
            "compression": {"enabled": False},
        }
        self._post("generate long uncompressed", payload, lambda b: self._check_generate(b, 12))

    @task(3)
    def streamed(self) -> None:
        payload = {"prompt": "Once upon a time", "max_tokens": 20, "temperature": 0.8, "stream": True}
        with self.client.post("/generate", json=payload, name="generate stream", stream=True, catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return
            events = [json.loads(line[5:]) for line in r.iter_lines(decode_unicode=True) if line.startswith("data:")]
            if not events or events[-1].get("finish_reason") not in ("stop", "length"):
                r.failure(f"stream did not finish cleanly: {events[-1:]}")
            elif events[-1]["usage"]["completion_tokens"] > 20:
                r.failure("more tokens than max_tokens")

    @task(2)
    def chat_two_turns(self) -> None:
        """Turn 2 carries turn 1 and its answer, as chat clients do."""
        messages = [{"role": "user", "content": self.rng.choice(QUESTIONS)}]
        for turn in (1, 2):
            payload = {"model": self.model, "messages": messages, "max_tokens": 16, "temperature": 0}
            with self.client.post(
                "/v1/chat/completions", json=payload, name=f"openai chat turn {turn}", catch_response=True
            ) as r:
                if r.status_code != 200:
                    r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                    return
                choice = r.json()["choices"][0]
                if choice["message"]["role"] != "assistant" or choice["finish_reason"] not in ("stop", "length"):
                    r.failure(f"bad choice {choice}")
                    return
            messages += [choice["message"], {"role": "user", "content": "Tell me more."}]

    @task(1)
    def invalid_request_is_refused(self) -> None:
        field, payload = self.rng.choice(
            [
                ("max_tokens", {"prompt": "Hi", "max_tokens": -1}),
                ("compression.compression_rate", {"prompt": "Hi", "compression": {"compression_rate": 1.5}}),
                ("temperature", {"prompt": "Hi", "temperature": -1}),
            ]
        )
        name = "generate invalid (422 expected)"
        with self.client.post("/generate", json=payload, name=name, catch_response=True) as r:
            if r.status_code == 422 and field in r.json()["error"]["fields"]:
                r.success()
            else:
                r.failure(f"expected 422 naming {field}, got {r.status_code}: {r.text[:200]}")
