"""The cluster's HTTP front: every route of the single-process server, forwarded to an engine replica.

Only `/metrics` is answered here (all replicas' metrics, labelled). A request whose replica dies
before answering goes to another replica; nothing of it had reached the client. A stream cut by its
replica's death ends with an error event in the route's own error shape.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from prometheus_client import CONTENT_TYPE_LATEST
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from confkv.cluster.metrics import INGRESS, REPLICAS, RETRIES, STREAM_ERRORS, exposition, labelled
from confkv.cluster.replica import ForwardedRequest, ResponseStart
from confkv.server.middleware import OPENAI_PREFIX, error_body

log = logging.getLogger(__name__)

# What a dead or unreachable replica raises; a request that got one never reached the model's output.
REPLICA_GONE = (RayActorError, ActorUnavailableError)


def routing_text(body: bytes) -> str:
    """The prompt as text, for prefix affinity: the prompt, the chat messages' roles and contents in
    order (so a conversation's next turn extends its last one), or the token ids. Empty when the body
    is not such a request."""
    try:
        payload = json.loads(body) if body else None
    except ValueError:
        return ""
    if not isinstance(payload, dict):
        return ""
    prompt, messages, ids = payload.get("prompt"), payload.get("messages"), payload.get("prompt_token_ids")
    if isinstance(prompt, str):
        return prompt
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages if isinstance(m, dict))
    if isinstance(ids, list):
        return "".join(f"{i}," for i in ids)
    return ""


def _message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return f"<{message.get('role', '')}>{content if isinstance(content, str) else ''}"


class Ingress:
    """Serve deployment class (see `confkv.cluster.app`): Serve's proxy hands it every HTTP request."""

    def __init__(
        self, replicas: DeploymentHandle, hub: DeploymentHandle, max_request_bytes: int, attempts: int = 3
    ) -> None:
        self.replicas = replicas.options(stream=True)
        self.hub = hub
        self.max_request_bytes = max_request_bytes
        self.attempts = attempts
        self.draining = False  # set on shutdown: new requests get 503, running ones finish
        self.in_flight = 0

    async def __call__(self, request: Request) -> Response:
        if request.url.path == "/metrics" and request.method == "GET":
            return await self.metrics()
        if self.draining:
            message = "the server is shutting down; retry on another instance"
            body = error_body(request.url.path, 503, "shutting_down", message)
            return JSONResponse(body, 503, {"Retry-After": "5"})
        self.in_flight += 1
        response = None
        try:
            response = await self.forward(request)
            return response
        finally:
            if isinstance(response, StreamingResponse):
                response.background = BackgroundTask(self._finished)  # once the stream has ended
            else:
                self._finished()

    def drain(self) -> int:
        """Refuse new requests from now on; the number still running (`serve.py --ray` waits for 0)."""
        self.draining = True
        return self.in_flight

    def _finished(self) -> None:
        self.in_flight -= 1

    async def metrics(self) -> Response:
        reports = await self.hub.fresh.remote(5.0)
        REPLICAS.set(len(reports))
        return Response(exposition(labelled(reports), INGRESS), media_type=CONTENT_TYPE_LATEST)

    async def forward(self, request: Request) -> Response:
        path = request.url.path
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_request_bytes:
                message = f"the request body is larger than {self.max_request_bytes} bytes (--max-request-bytes)"
                return JSONResponse(error_body(path, 413, "request_too_large", message), status_code=413)
        client = (request.client.host, request.client.port) if request.client else None
        forwarded = ForwardedRequest(
            request.method, path, request.scope["query_string"], request.scope["headers"], body, client
        )
        text = routing_text(body)
        for _ in range(self.attempts):
            stream: DeploymentResponseGenerator = self.replicas.handle.remote(forwarded, routing_text=text)
            try:
                start: ResponseStart = await stream.__anext__()
                if not _is_event_stream(start):  # whole answers are read before any byte goes out: retryable
                    content = b"".join([chunk async for chunk in stream])
                    response = Response(content, status_code=start.status)
                    response.raw_headers = start.headers
                    return response
            except REPLICA_GONE as error:
                RETRIES.inc()
                log.warning("%s %s: replica gone before answering (%r); trying another", request.method, path, error)
                continue
            response = StreamingResponse(self._relay(stream, path), status_code=start.status)
            response.raw_headers = [(k, v) for k, v in start.headers if k.lower() != b"content-length"]
            return response
        message = f"no replica could answer after {self.attempts} attempts; retry shortly"
        return JSONResponse(error_body(path, 503, "replica_unavailable", message), 503, {"Retry-After": "5"})

    @staticmethod
    async def _relay(stream: DeploymentResponseGenerator, path: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in stream:
                yield chunk
        except REPLICA_GONE as error:
            STREAM_ERRORS.inc()
            log.warning("stream on %s cut by its replica's death: %r", path, error)
            yield _stream_error(path)
        finally:
            stream.cancel()  # the client went away: the replica aborts the request


def _is_event_stream(start: ResponseStart) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)


def _stream_error(path: str) -> bytes:
    message = "the replica serving this stream died; send the request again"
    if path.startswith(OPENAI_PREFIX):  # OpenAI's error shape, then [DONE], as the replica ends a failed stream
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_died"}}
        return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
    chunk = {"id": "", "text": "", "finish_reason": "error", "error": message}
    return f"data: {json.dumps(chunk)}\n\n".encode()
