"""Replica choice for the engine deployment: the longest cached prefix, then the most free KV memory.

KV memory, not queue length, is what limits one replica: a replica with few requests but long ones
has no room left. Each replica reports its free KV bytes through Serve's routing stats; the router
remembers which prompts went where (Ray's prefix tree, the one its `PrefixCacheAffinityRouter`
uses) and sends a prompt where the longest prefix of it went before, unless the replicas' free
shares differ by more than `imbalance_threshold`: then the freest one takes it, cached prefix or not.

Serve ships this module to the routers by value (cloudpickle), so it holds no state of its own at
module level: the decision counter lives in `confkv.cluster.metrics`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_tree import PrefixTree
from ray.serve.request_router import (
    FIFOMixin,
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    ReplicaResult,
    RequestRouter,
    RunningReplica,
)

from confkv.cluster import metrics

ROUTER_CLASS = "confkv.cluster.router:PrefixKVRouter"
ROUTING_TEXT = "routing_text"  # the keyword argument that carries a request's prompt text to the router
# Replicas whose free share is this close to the freest one's count as tied; Serve's queue-length probe
# picks among them, so that a burst of new prompts spreads before the next routing stats arrive.
TIE = 0.05


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of one replica: its id and the share of its KV budget that is free."""

    replica_id: str
    free_share: float


def free_share(stats: dict) -> float:
    """A replica's free KV share from its routing stats; a replica that has not reported yet counts as empty."""
    capacity = stats.get("kv_capacity_bytes") or 0
    if capacity <= 0:
        return 1.0
    return min(1.0, max(0.0, stats.get("kv_free_bytes", capacity) / capacity))


def rank(loads: Sequence[ReplicaLoad], cached: set[str], imbalance_threshold: float) -> tuple[list[list[str]], str]:
    """Replica ids in ranks, most preferred first (Serve tries a rank's members by queue length), and
    the reason. `cached` holds the replicas with the longest cached prefix of the prompt (may be empty)."""
    by_free = sorted(loads, key=lambda load: -load.free_share)
    spread = by_free[0].free_share - by_free[-1].free_share
    if cached and spread <= imbalance_threshold:
        first = [load.replica_id for load in by_free if load.replica_id in cached]
        reason = "prefix"
    else:
        first = [load.replica_id for load in by_free if load.free_share >= by_free[0].free_share - TIE]
        reason = "imbalance" if cached else "free_kv"
    rest = [[load.replica_id] for load in by_free if load.replica_id not in first]
    return [first, *rest], reason


def prompt_text(request: PendingRequest | None) -> str:
    return "" if request is None else request.kwargs.get(ROUTING_TEXT) or ""


class PrefixKVRouter(FIFOMixin, LocalityMixin, MultiplexMixin, RequestRouter):
    def initialize_state(
        self,
        imbalance_threshold: float = 0.5,
        match_threshold: float = 0.1,
        min_match_chars: int = 256,
        max_chars_per_replica: int = 2_000_000,
    ) -> None:
        """A cached prefix counts when it covers `match_threshold` of the prompt and at least
        `min_match_chars` characters (about 64 tokens: shorter ones save little prefill, and every
        prompt shares its first words with some other); `max_chars_per_replica`: prompt characters
        remembered per replica (least recently used go first)."""
        self.imbalance_threshold = imbalance_threshold
        self.match_threshold = match_threshold
        self.min_match_chars = min_match_chars
        self.max_chars_per_replica = max_chars_per_replica
        self.tree = PrefixTree()

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        replicas = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        loads = [ReplicaLoad(rid, free_share(r.routing_stats or {})) for rid, r in replicas.items()]
        text = prompt_text(pending_request)
        cached: set[str] = set()
        if text:
            matched, tenants = self.tree.prefix_match(text, list(replicas))
            if len(matched) >= max(self.min_match_chars, self.match_threshold * len(text)):
                cached = set(tenants or ())
        ranks, reason = rank(loads, cached, self.imbalance_threshold)
        if pending_request is not None:
            metrics.ROUTE_DECISIONS.labels(reason).inc()
        return [[replicas[rid] for rid in group] for group in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        text = prompt_text(pending_request)
        if not text:
            return
        tenant = replica_id.to_full_id_str()
        if tenant not in self.tree.tenant_to_char_count:
            self.tree.add_tenants([tenant], time.time())
        self.tree.insert(text, tenant, time.time())
        excess = self.tree.tenant_to_char_count[tenant] - self.max_chars_per_replica
        if excess > 0:
            self.tree.evict_tenant_by_lru(tenant, excess)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.to_full_id_str() for r in replicas}
        gone = [tenant for tenant in self.tree.tenant_to_char_count if tenant not in live]
        if gone:
            self.tree.remove_tenants(gone)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        tenant = replica_id.to_full_id_str()
        if tenant in self.tree.tenant_to_char_count:
            self.tree.remove_tenants([tenant])
