"""One engine replica: the whole single-process server (`confkv.server.api.create_app`) inside a Serve replica.

The ingress forwards each HTTP request as it came (`ForwardedRequest`); the replica runs it through
its own app in process and streams the response back: first a `ResponseStart`, then body chunks.
Every route, error and limit of the single-process server therefore holds per replica unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import generate_latest
from ray import serve
from ray.serve.handle import DeploymentHandle

from confkv.server.api import create_app
from confkv.server.settings import Settings

log = logging.getLogger(__name__)

REPLICA_HEADER = "x-confkv-replica"  # names the replica that answered (debugging, the routing tests)


@dataclass
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass
class ResponseStart:
    status: int
    headers: list[tuple[bytes, bytes]]


def replica_threads(settings: Settings) -> int:
    """Torch threads of one replica: the CPUs it reserves from Ray (at least one), never more. Beyond
    them the replicas and Ray's own workers oversubscribe the cores, and OpenMP threads spin waiting
    for descheduled ones: on a loaded 2-core machine a replica decoded a token in 4.7 s at 2 threads
    and in 0.6 s at 1, and a 48-token stream outlived a 120 s drain."""
    reserved = max(1, int(settings.cluster.replica_cpus))
    return min(settings.torch_threads or reserved, reserved)


class EngineReplica:
    """Serve deployment class (bound in `confkv.cluster.app`); `hub` receives this replica's metrics."""

    async def __init__(self, settings: Settings, hub: DeploymentHandle, metrics_interval_s: float = 1.0) -> None:
        threads = replica_threads(settings)
        if settings.torch_threads and threads < settings.torch_threads:
            log.warning("torch threads %d, not %d: the CPUs this replica reserves (--cluster.replica-cpus)",
                        threads, settings.torch_threads)  # fmt: skip
        self.app = create_app(settings.model_copy(update={"torch_threads": threads}))
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # loads the model and starts the engine loop
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.hub = hub
        self._reporter = asyncio.create_task(self._report_metrics(metrics_interval_s))

    # ----- requests ----------------------------------------------------------------------------
    async def handle(self, request: ForwardedRequest, routing_text: str = "") -> AsyncIterator[ResponseStart | bytes]:
        """Run one HTTP request through the app. `routing_text` is for the router; unused here.
        Cancelling the stream (the client went away) tells the app the client disconnected, so the
        request is aborted and its KV memory returned."""
        messages: asyncio.Queue = asyncio.Queue()
        disconnected = asyncio.Event()
        body = [{"type": "http.request", "body": request.body, "more_body": False}]

        async def receive() -> dict:
            if body:
                return body.pop()
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def run() -> None:
            try:
                await self.app(_scope(request), receive, messages.put)
            except Exception:  # Starlette has answered 500 already; the replica goes on serving
                log.exception("request %s %s failed", request.method, request.path)
            finally:
                messages.put_nowait(None)

        task = asyncio.create_task(run())
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    headers = [*message.get("headers", []), (REPLICA_HEADER.encode(), self.replica_id.encode())]
                    yield ResponseStart(message["status"], headers)
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield message["body"]
                    if not message.get("more_body", False):
                        break
        finally:
            disconnected.set()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ----- what Serve asks of a replica ----------------------------------------------------------
    async def record_routing_stats(self) -> dict[str, float]:
        """Free KV bytes for the router. Prefix-cache bytes count as free: they are given up on demand."""
        snapshot = await asyncio.to_thread(self.app.state.engine.snapshot)
        held = snapshot.kv_bytes["running"] + snapshot.kv_bytes["audit"]
        return {
            "kv_capacity_bytes": snapshot.capacity_bytes,
            "kv_free_bytes": max(0, snapshot.capacity_bytes - held),
            "num_running": snapshot.num_running,
            "num_waiting": snapshot.num_waiting,
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The KV usage the autoscaling policy (`confkv.cluster.autoscaling`) scales on."""
        stats = await self.record_routing_stats()
        return {"kv_cache_usage": 1.0 - stats["kv_free_bytes"] / max(1, stats["kv_capacity_bytes"])}

    def check_health(self) -> None:
        """Serve replaces a replica whose engine loop has stopped."""
        engine = self.app.state.engine
        if not engine.is_alive:  # restarting after a crash is alive: it serves again within a step
            raise RuntimeError(f"the engine loop is not running: {engine.error!r}")

    async def __del__(self) -> None:
        # Serve calls this after the replica's ongoing requests finished (or the grace period ran out).
        self._reporter.cancel()
        with contextlib.suppress(Exception):
            await self.hub.forget.remote(self.replica_id)
        await self._lifespan.__aexit__(None, None, None)

    async def _report_metrics(self, interval_s: float) -> None:
        registry = self.app.state.metrics.registry
        while True:
            try:
                text = await asyncio.to_thread(generate_latest, registry)
                await self.hub.report.remote(self.replica_id, text.decode())
            except Exception as error:  # the hub restarting: report again next time
                log.debug("metrics report failed: %r", error)
            await asyncio.sleep(interval_s)


def _scope(request: ForwardedRequest) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "scheme": "http",
        "method": request.method,
        "path": request.path,
        "raw_path": request.path.encode(),
        "root_path": "",
        "query_string": request.query_string,
        "headers": request.headers,
        "client": request.client,
        "server": None,
        "state": {},
    }
