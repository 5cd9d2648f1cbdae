"""Every replica's engine metrics at the ingress's `/metrics`, each sample labelled with its replica.

Replicas push their exposition text to the hub every second; the ingress merges what is fresh. A
replica that stopped reporting (killed, replaced) drops out after `max_age_s`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

REPLICA_LABEL = "replica"

# The ingress's own metrics (the router runs in the ingress's process, inside its deployment handle).
INGRESS = CollectorRegistry(auto_describe=True)
RETRIES = Counter(
    "cluster_retries", "Requests sent to another replica because theirs died before answering", registry=INGRESS
)
STREAM_ERRORS = Counter(
    "cluster_stream_errors", "Streams cut by their replica's death (ended with an error event)", registry=INGRESS
)
REPLICAS = Gauge("cluster_replicas_reporting", "Engine replicas whose metrics are fresh", registry=INGRESS)
ROUTE_DECISIONS = Counter(
    "cluster_route_decisions",
    "Requests routed, by what chose the replica: a cached prefix (prefix), the most free KV memory with no "
    "prefix cached (free_kv), or free KV memory overruling a cached prefix past the threshold (imbalance)",
    ["reason"],
    registry=INGRESS,
)


class MetricsHub:
    """Serve deployment class (one replica): the latest exposition text of each engine replica."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[float, str]] = {}

    def report(self, replica_id: str, text: str) -> None:
        self.reports[replica_id] = (time.monotonic(), text)

    def forget(self, replica_id: str) -> None:
        self.reports.pop(replica_id, None)

    def fresh(self, max_age_s: float) -> dict[str, str]:
        now = time.monotonic()
        return {rid: text for rid, (at, text) in self.reports.items() if now - at <= max_age_s}


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def labelled(reports: dict[str, str]) -> list[Metric]:
    """The replicas' metric families merged, each sample labelled with its replica's id."""
    families: dict[str, Metric] = {}
    for replica_id, text in sorted(reports.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            merged.samples += [
                Sample(s.name, {**s.labels, REPLICA_LABEL: replica_id}, s.value, s.timestamp, s.exemplar)
                for s in family.samples
            ]
    return list(families.values())


def exposition(families: Iterable[Metric], *registries: CollectorRegistry) -> bytes:
    """One exposition text of the merged families and of the ingress's own registries."""
    merged = CollectorRegistry(auto_describe=False)
    merged.register(_Families(list(families)))
    return generate_latest(merged) + b"".join(generate_latest(registry) for registry in registries)
