"""Prometheus metrics of the server, each registered on the app's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from app.engine import LLMEngine, StepStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "requests",
            "Finished requests by status (finish reason, or the HTTP code of a refusal)",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter("prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("generation_tokens", "Tokens generated", registry=r)
        self.request_latency = Histogram(
            "request_latency_seconds", "End-to-end request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.time_to_first_token = Histogram(
            "time_to_first_token_seconds",
            "Time from arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "time_per_output_token_seconds",
            "Mean time between generated tokens after the first, per request",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("requests_running", "Requests running in the engine", registry=r)
        self.waiting = Gauge("requests_waiting", "Requests waiting to be admitted", registry=r)
        self.kv_memory = Gauge("kv_cache_memory_bytes", "All KV cache bytes held", registry=r)
        self.kv_pool = Gauge("kv_cache_bytes", "KV cache bytes held, by pool", ["pool"], registry=r)
        self.kv_capacity = Gauge("kv_cache_capacity_bytes", "KV cache budget (max_cache_size)", registry=r)
        self.kv_usage = Gauge("kv_cache_usage_ratio", "KV cache bytes held / budget", registry=r)
        self.preemptions = Counter("kv_preemptions", "Sequences preempted to free KV memory", registry=r)
        self.batch_size = Histogram(
            "batch_size", "Sequences in one engine step", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.step_time = Histogram(
            "engine_step_seconds", "Duration of one engine step", buckets=_TOKEN_LATENCY_BUCKETS, registry=r
        )

    def bind_engine(self, engine: LLMEngine) -> None:
        """Gauges read the engine's own accounting when scraped, so they are never stale."""
        store, compression = engine.store, engine.compression
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.kv_memory.set_function(lambda: store.used_bytes + compression.audit_bytes)
        self.kv_pool.labels("running").set_function(lambda: store.used_bytes)
        self.kv_pool.labels("audit").set_function(lambda: compression.audit_bytes)
        self.kv_capacity.set_function(lambda: store.max_bytes)
        self.kv_usage.set_function(lambda: store.used_bytes / store.max_bytes)

    def observe_step(self, stats: StepStats, engine: LLMEngine) -> None:
        self.step_time.observe(stats.duration_s)
        self.batch_size.observe(stats.num_seqs)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)

    def observe_request(
        self, status: str, prompt_tokens: int, completion_tokens: int, latency: float, ttft: float | None
    ) -> None:
        self.requests.labels(status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.request_latency.observe(latency)
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
            if completion_tokens > 1:
                self.time_per_output_token.observe((latency - ttft) / (completion_tokens - 1))
