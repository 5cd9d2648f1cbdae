"""Autoscaling on ongoing requests and on KV use: the engine replicas' custom Serve policy.

Serve wraps the policy with the deployment's own bounds and delays (min/max replicas,
upscale/downscale delays); the policy only says how many replicas the load wants. It wants the
larger of two counts: Serve's own (ongoing requests over `target_ongoing_requests` per replica)
and the KV count (the replicas' summed KV use over `target_kv_usage` per replica). A replica full of
long requests is saturated well before its request count says so.
"""

from __future__ import annotations

import logging
import math

from ray.serve.config import AutoscalingContext

log = logging.getLogger("ray.serve")  # the controller's log, where Serve logs its own scaling decisions

POLICY_CLASS = "confkv.cluster.autoscaling:KVPressurePolicy"
KV_USAGE = "kv_cache_usage"  # the custom metric each replica records (EngineReplica.record_autoscaling_stats)


class KVPressurePolicy:
    def __init__(self, target_kv_usage: float = 0.7) -> None:
        if not 0.0 < target_kv_usage <= 1.0:
            raise ValueError(f"target_kv_usage must be in (0, 1], not {target_kv_usage}")
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict]:
        by_requests = ctx.total_num_requests / ctx.config.get_target_ongoing_requests()
        usage = (ctx.aggregated_metrics or {}).get(KV_USAGE, {})
        by_kv = sum(usage.values()) / self.target_kv_usage
        desired = max(by_requests, by_kv)
        wanted = math.ceil(desired)
        if wanted != ctx.policy_state.get("wanted", ctx.target_num_replicas):  # logged once per change
            log.info(
                "kv-pressure policy: %s wants %.2f replicas (requests %.2f, KV %.2f over %d reporting), has %d",
                ctx.deployment_name,
                desired,
                by_requests,
                by_kv,
                len(usage),
                ctx.target_num_replicas,
            )
        return desired, {"wanted": wanted, "by_requests": by_requests, "by_kv": by_kv}
