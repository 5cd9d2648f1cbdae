"""The Ray Serve application: an ingress, the engine replicas behind our router, and the metrics hub.

python serve.py --ray --cluster.replicas 2             # a local Ray cluster, the same flags and config file
serve run confkv.cluster.app:app_builder replicas=...          # or Serve's own CLI / a KubeRay RayService:
                                                        # args are Settings fields (deploy/rayservice.yaml)
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import ray
from ray import serve
from ray.serve import Application

from confkv.cluster.autoscaling import POLICY_CLASS
from confkv.cluster.ingress import Ingress
from confkv.cluster.metrics import MetricsHub
from confkv.cluster.replica import EngineReplica
from confkv.cluster.router import ROUTER_CLASS
from confkv.server.settings import Settings, load_settings

log = logging.getLogger("conf_kv")

APP_NAME = "conf-kv"
ROUTING_STATS_PERIOD_S = 1.0  # how stale the router's view of free KV memory may be


def build(settings: Settings) -> Application:
    quiet = {"enable_access_log": False}  # replicas report every second
    hub = serve.deployment(MetricsHub, num_replicas=1, ray_actor_options={"num_cpus": 0}, logging_config=quiet).bind()
    engine = serve.deployment(
        EngineReplica,
        max_ongoing_requests=settings.max_num_seqs,  # more would wait in the engine, invisible to the router
        graceful_shutdown_timeout_s=settings.shutdown_grace_period,
        health_check_period_s=5,
        ray_actor_options=replica_resources(settings),
        request_router_config=_router_config(settings),
        **_scaling(settings),
    ).bind(settings, hub)
    ingress = serve.deployment(Ingress, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine, hub, settings.max_request_bytes)


def replica_resources(settings: Settings) -> dict:
    """What Ray reserves for one replica: the per-rank CPUs and GPUs times its tensor-parallel
    ranks, all on one node (the ranks are the replica's child processes, on the devices Ray gives it)."""
    ranks = settings.tensor_parallel_size
    return {"num_cpus": settings.cluster.replica_cpus * ranks, "num_gpus": settings.cluster.replica_gpus * ranks}


def app_builder(args: dict) -> Application:
    """For `serve run` and a RayService's serveConfigV2: `args` are Settings fields; CONFKV_* env applies too."""
    return build(load_settings(None, **args))


def _router_config(settings: Settings) -> dict:
    config: dict = {"request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}
    if settings.cluster.router == "prefix_kv":
        config["request_router_class"] = ROUTER_CLASS
        config["request_router_kwargs"] = {"imbalance_threshold": settings.cluster.imbalance_threshold}
    return config


def _scaling(settings: Settings) -> dict:
    cluster = settings.cluster
    if cluster.max_replicas is None:
        return {"num_replicas": cluster.replicas}
    return {
        "autoscaling_config": {
            "min_replicas": cluster.replicas,
            "max_replicas": cluster.max_replicas,
            "target_ongoing_requests": cluster.target_ongoing_requests,
            "upscale_delay_s": cluster.upscale_delay_s,
            "downscale_delay_s": cluster.downscale_delay_s,
            "policy": {"policy_function": POLICY_CLASS, "policy_kwargs": {"target_kv_usage": cluster.target_kv_usage}},
        }
    }


def serve_env(settings: Settings) -> dict[str, str]:
    """Ray Serve's proxy checks, loosened. On a starved CPU (a loaded machine, a small container) the
    proxy misses its 5 s readiness check three times, and Serve kills it with every stream it relays
    and starts another; on shutdown it gives the streams still in the proxy 5 s. A value the user set
    in the environment wins."""
    loosened = {
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60",
        "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "60",
        "RAY_SERVE_PROXY_GRACEFUL_SHUTDOWN_TIMEOUT_S": str(max(5.0, settings.shutdown_grace_period)),
    }
    return {name: os.environ.get(name, value) for name, value in loosened.items()}


def _drain(grace_s: float) -> None:
    """New requests get 503; wait up to `grace_s` for running ones (streams included) to finish."""
    log.info("shutting down: new requests get 503; waiting up to %.0f s for running ones", grace_s)
    ingress = serve.get_app_handle(APP_NAME)
    deadline = time.monotonic() + grace_s
    while (running := ingress.drain.remote().result()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if running:
        log.warning("grace period over with %d requests unfinished; they are cut off", running)


def main(settings: Settings) -> None:
    """Start (or join) a Ray cluster, run the application on --host/--port, and drain on SIGTERM or Ctrl-C."""
    env = serve_env(settings)
    os.environ.update(env)  # a local cluster's processes inherit it; a joined cluster's Serve gets it below
    ray.init(address=settings.cluster.address, logging_level=settings.log_level.upper(), runtime_env={"env_vars": env})
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs handlers that exit at once
        signal.signal(sig, lambda *_: stop.set())
    serve.start(http_options={"host": settings.host, "port": settings.port})
    serve.run(build(settings), name=APP_NAME, route_prefix="/")
    log.info("ready on %s:%d with %d engine replicas", settings.host, settings.port, settings.cluster.replicas)
    stop.wait()
    _drain(settings.shutdown_grace_period)
    serve.shutdown()
    ray.shutdown()
