"""Prometheus metrics of the server, each registered on the app's own registry.

What the engine holds (requests, KV bytes by pool and tier, its own counters) is read from one
snapshot of its accounting per scrape, taken by the engine's thread, so it is never stale and never
read while a step changes it; per-request and per-step figures are observed as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import get_args

import psutil
import torch
from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from confkv.compress.predictor.online import CalibrationState
from confkv.engine.async_engine import AsyncEngine
from confkv.engine.llm_engine import EngineSnapshot, StepStats
from confkv.kv.prefix_cache import PARKED

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
_RATIO_BUCKETS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0, 1.5)
_EVICTION_REASONS = ("compression", "preemption", "prefix_cache")
_MAX_FIELD_LABELS = 64  # clients choose the names: a bound on the label's values


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._field_labels: set[str] = set()  # names ignored_fields counts under
        # Registered in this order, which is the order a scrape lists them in.
        self._add_request_metrics(self.registry)
        self._add_occupancy_metrics(self.registry)
        self._add_compression_metrics(self.registry)
        self._add_engine_metrics(self.registry)

    def _add_request_metrics(self, r: CollectorRegistry) -> None:
        """Per finished request: counts, tokens and latencies."""
        self.requests = Counter(
            "requests",
            "Finished requests by status (finish reason, or the HTTP code of a refusal)",
            ["status"],
            registry=r,
        )
        self.ignored_fields = Counter(
            "openai_ignored_fields",
            f"Request fields the OpenAI routes did not know and ignored, by field (the first {_MAX_FIELD_LABELS} "
            "names seen; later ones as 'other')",
            ["field"],
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
        self.queue_time = Histogram(
            "request_queue_seconds",
            "Time from arrival until the engine first schedules the request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )

    def _add_occupancy_metrics(self, r: CollectorRegistry) -> None:
        """Device memory; what the engine holds is read from its snapshot (`_EngineCollector`)."""
        self.device_memory = Gauge(
            "device_memory_usage_ratio",
            "Share of the device's memory in use (GPU memory on CUDA, system memory on CPU)",
            registry=r,
        )

    def _add_compression_metrics(self, r: CollectorRegistry) -> None:
        """KV memory pressure and what compression does about it."""
        self.preemptions = Counter("kv_preemptions", "Sequences preempted to free KV memory", registry=r)
        self.oom_errors = Counter(
            "kv_oom_errors",
            "Requests failed for want of KV memory: larger than max_cache_size, or out of memory in the forward",
            registry=r,
        )
        self.request_failures = Counter(
            "engine_request_failures",
            "Requests the engine failed alone, by the stage of their own work that raised (forward, prompt_logprobs, "
            "sampling, detokenization, compression); the engine and the other requests went on",
            ["stage"],
            registry=r,
        )
        self.compression_ratio = Histogram(
            "kv_compression_ratio",
            "Per finished compressed request: compressed_size / original_size",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.attention_recall = Histogram(
            "kv_attention_recall",
            "Per finished request with compression_stats: share of attention mass on held entries",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        buckets = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
        self.compression_time = Histogram(
            "kv_compression_seconds",
            "Compression on the critical path of one engine step: the time the step waited for it (steps "
            "that compressed)",
            buckets=buckets,
            registry=r,
        )
        self.calibration = Enum(
            "kv_calibration",
            "What dynamic's retention confidence stands on: shipped or fitted (its thresholds decide), fitting (in "
            "the background; its rate decides until then) or rate only",
            states=list(get_args(CalibrationState)),
            registry=r,
        )
        self.compression_background_time = Histogram(
            "kv_compression_background_seconds",
            "Compression planned beside one engine step's forward pass, off its critical path "
            "(async_compression; steps that planned one)",
            buckets=buckets,
            registry=r,
        )

    def _add_engine_metrics(self, r: CollectorRegistry) -> None:
        """The engine loop: steps, liveness, and the SLO targets the alerts compare against."""
        self.batch_size = Histogram(
            "batch_size", "Sequences in one engine step", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.step_time = Histogram(
            "engine_step_seconds", "Duration of one engine step", buckets=_TOKEN_LATENCY_BUCKETS, registry=r
        )
        self.heartbeat = Gauge(
            "engine_loop_heartbeat_timestamp_seconds",
            "Unix time of the engine loop's last pass (at least every 0.5 s while it lives, busy or idle)",
            registry=r,
        )
        self.slo_target = Gauge(
            "slo_target_seconds",
            "p99 latency targets the alert rules compare against (settings slo_*)",
            ["kind"],
            registry=r,
        )
        self.slo_min_requests = Gauge(
            "slo_min_requests",
            "requests in 5 minutes below which the latency SLO alerts stay quiet (setting slo_min_requests)",
            registry=r,
        )

    def bind_engine(self, snapshot: Callable[[], EngineSnapshot], device: torch.device) -> None:
        """What the engine holds is read from `snapshot` when scraped, so it is never stale."""
        self.device_memory.set_function(lambda: _device_memory_ratio(device))
        self.registry.register(_EngineCollector(snapshot))

    def bind_loop(self, loop: AsyncEngine) -> None:
        self.heartbeat.set_function(lambda: loop.heartbeat)
        self.registry.register(_LoopCollector(loop))

    def count_ignored_fields(self, fields: list[str]) -> None:
        """Count each ignored field under its name, or 'other' once _MAX_FIELD_LABELS names are in use."""
        for name in fields:
            if len(self._field_labels) < _MAX_FIELD_LABELS:
                self._field_labels.add(name)
            self.ignored_fields.labels(name if name in self._field_labels else "other").inc()

    def set_slo(self, ttft_seconds: float, tpot_seconds: float, min_requests: int) -> None:
        self.slo_target.labels("ttft").set(ttft_seconds)
        self.slo_target.labels("tpot").set(tpot_seconds)
        self.slo_min_requests.set(min_requests)

    def observe_step(self, stats: StepStats) -> None:
        self.step_time.observe(stats.duration_s)
        self.batch_size.observe(stats.num_seqs)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)
        if stats.num_out_of_memory:
            self.oom_errors.inc(stats.num_out_of_memory)
        for stage, count in stats.failures.items():
            self.request_failures.labels(stage).inc(count)
        if stats.compression_s:
            self.compression_time.observe(stats.compression_s)
        if stats.compression_background_s:
            self.compression_background_time.observe(stats.compression_background_s)
        for wait in stats.queue_s:
            self.queue_time.observe(wait)

    def observe_request(
        self,
        status: str,
        prompt_tokens: int,
        completion_tokens: int,
        latency: float,
        ttft: float | None,
        compression: dict | None = None,
        audited: bool = False,
    ) -> None:
        self.requests.labels(status).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.request_latency.observe(latency)
        if ttft is not None:
            self.time_to_first_token.observe(ttft)
            if completion_tokens > 1:
                self.time_per_output_token.observe((latency - ttft) / (completion_tokens - 1))
        if compression is not None and compression["policy"] != "none":
            self.compression_ratio.observe(compression["compression_ratio"])
            if audited:  # recall is measured only against the dropped keys of requests that keep them
                self.attention_recall.observe(compression["recall_rate"])


class _LoopCollector(Collector):
    """The engine loop's supervision: its restarts, a counter the loop keeps."""

    def __init__(self, loop: AsyncEngine) -> None:
        self.loop = loop

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "engine_loop_restarts",
            "Times the engine loop was reset and went on after a step raised (requests in flight then got an "
            "error; past --engine-max-restarts the process exits instead)",
            self.loop.restarts,
        )


class _EngineCollector(Collector):
    """What the engine holds, from one snapshot per scrape."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        now = self.snapshot()
        yield GaugeMetricFamily("requests_running", "Requests running in the engine", now.num_running)
        yield GaugeMetricFamily("requests_waiting", "Requests waiting to be admitted", now.num_waiting)
        yield GaugeMetricFamily(
            "kv_cache_memory_bytes", "All KV cache bytes held (every pool)", sum(now.kv_bytes.values())
        )
        yield _labelled(
            GaugeMetricFamily,
            "kv_cache_bytes",
            "KV cache bytes held, by pool: running requests, prefix cache, audit of dropped keys",
            "pool",
            now.kv_bytes,
        )
        yield GaugeMetricFamily("kv_cache_capacity_bytes", "KV cache budget (max_cache_size)", now.capacity_bytes)
        yield GaugeMetricFamily(
            "kv_cache_allocated_bytes",
            "Memory the KV cache's blocks live in, allocated once at start (the budget and a few spare pages)",
            now.allocated_bytes,
        )
        yield GaugeMetricFamily(
            "kv_cache_touched_bytes",
            "Pages of the KV arena ever lent to a storage format: on the CPU, the part of the arena that is "
            "resident memory (it stays resident once touched); at most kv_cache_allocated_bytes",
            now.touched_bytes,
        )
        yield GaugeMetricFamily(
            "kv_cache_usage_ratio",
            "KV cache bytes held within the budget (running and prefix) / budget",
            now.used_bytes / now.capacity_bytes,
        )
        yield _labelled(
            GaugeMetricFamily, "kv_cache_entries", "(layer, token) KV entries held, by tier", "tier", now.entries
        )
        yield _labelled(
            GaugeMetricFamily,
            "kv_cache_pool_bytes",
            "Pages of the KV arena each storage format's pool holds, blocks in use and free",
            "format",
            now.format_bytes,
        )
        yield GaugeMetricFamily(
            "kv_prefix_cache_bookkeeping_bytes",
            "Host memory of the parked caches' block tables, positions and key norms, beside their blocks "
            '(counted in kv_cache_bytes{pool="prefix"})',
            now.bookkeeping_bytes,
        )
        yield _labelled(
            CounterMetricFamily,
            "kv_evictions",
            "(layer, token) KV entries removed from memory, by reason",
            "reason",
            {reason: now.evicted.get(reason, 0) for reason in _EVICTION_REASONS},
        )
        yield CounterMetricFamily(
            "kv_prefix_cache_queries", "Prompts looked up in the prefix cache", now.prefix_queries
        )
        yield CounterMetricFamily("kv_prefix_cache_hits", "Prompts that reused a prefix-cache entry", now.prefix_hits)
        yield _labelled(
            CounterMetricFamily,
            "kv_prefix_cache_reused_tokens",
            "Prompt tokens served from the prefix cache, by how their entry was parked (both query-agnostic)",
            "parked",
            {parked: now.prefix_reused_tokens.get(parked, 0) for parked in PARKED},
        )
        yield _labelled(
            CounterMetricFamily,
            "kv_prefix_cache_evictions",
            "Prefix-cache entries evicted, by reason",
            "reason",
            {reason: now.prefix_evictions.get(reason, 0) for reason in ("memory", "superseded", "cleared")},
        )
        yield GaugeMetricFamily(
            "kv_prefix_cache_warmup_tokens",
            "Prompt tokens prefilled into the prefix cache at start-up",
            now.prefix_warmup_tokens,
        )


def _labelled(
    family: type[GaugeMetricFamily | CounterMetricFamily], name: str, documentation: str, label: str, values: dict
) -> GaugeMetricFamily | CounterMetricFamily:
    """A metric with one label, one sample per entry of `values`."""
    metric = family(name, documentation, labels=[label])
    for key, value in values.items():
        metric.add_metric([key], value)
    return metric


def _device_memory_ratio(device: torch.device) -> float:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return 1.0 - free / total
    return psutil.virtual_memory().percent / 100.0
