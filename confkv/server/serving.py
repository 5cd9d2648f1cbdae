"""What POST /generate does between the route and the engine: tokenize, check, run, report."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from sse_starlette import EventSourceResponse
from starlette.background import BackgroundTask
from transformers import PreTrainedTokenizerBase

from confkv.compress.config import CompressionParams, InvalidCompression, resolve
from confkv.engine.async_engine import AsyncEngine, EngineDeadError
from confkv.engine.inspection import InspectionRecord, InspectionStore
from confkv.engine.outputs import RequestOutput
from confkv.engine.sequence import FinishReason, SamplingParams
from confkv.server import logprobs
from confkv.server.metrics import Metrics
from confkv.server.schemas import (
    CompressionMetricsModel,
    GenerateRequest,
    GenerateResponse,
    PromptLogprobs,
    StreamChunk,
    Usage,
)
from confkv.server.settings import Settings


class APIError(Exception):
    """An error the client should see, with its HTTP status and a message saying what to do."""

    def __init__(
        self,
        status: int,
        type_: str,
        message: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.type, self.message, self.headers, self.param = status, type_, message, headers, param


@dataclass
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    compression: CompressionParams
    arrival: float
    prompt_text: str | None = None  # as given, or as the chat template rendered it; None for token ids
    ignored_fields: tuple[str, ...] = ()  # what the request gave that this server does not know

    def metrics_of(self, out: RequestOutput) -> CompressionMetricsModel | None:
        if not self.compression.stats or out.compression_metrics is None:
            return None
        return CompressionMetricsModel(**out.compression_metrics)


class GenerateService:
    def __init__(
        self, engine: AsyncEngine, tokenizer: PreTrainedTokenizerBase, settings: Settings, metrics: Metrics
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self.metrics = metrics
        # What prepare() checks a request against: fixed facts of the engine, read once.
        core = engine.llm_engine
        self.max_model_len = core.max_model_len
        self.compression_config = core.compression_config
        self.max_cache_bytes = core.max_cache_bytes
        self.kv_bytes_for = core.kv_bytes_for
        self.entry_bytes = core.entry_bytes
        self.num_layers = core.store.num_layers
        self.inspections = InspectionStore(settings.inspect_max_requests, settings.inspect_max_bytes)
        self.draining = False  # set on shutdown: refuse new requests
        # Requests accepted and not finished -> prompt tokens. Reserved when `prepare` accepts, not when the
        # engine first sees the request: a burst is admitted before any of its requests has started.
        self.admitted: dict[str, int] = {}

    async def prepare(
        self, req: GenerateRequest, logprobs: int | None = None, id_prefix: str = "gen"
    ) -> PreparedRequest:
        """Tokenize and check a request; raise APIError if it cannot be served.

        Tokenizing a long prompt takes a while (about a second per 300k characters): it runs in a
        worker thread (the tokenizer releases the GIL), so that the event loop goes on streaming
        other requests' tokens meanwhile. The request holds its place in the queue while it waits."""
        arrival = time.monotonic()
        self.engine.check_running()  # a dead loop is a 503 (counted by its handler), streams included
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        try:
            self._admit(request_id)
            ids, text = await asyncio.to_thread(self._tokenize, req)
            prepared = self._check(req, ids, logprobs, request_id, arrival)
            prepared.prompt_text = text
        except BaseException as error:
            if isinstance(error, APIError):
                self.count_refusal(error.status)  # every refusal counted once, by its status
            self.admitted.pop(request_id, None)
            raise
        self.admitted[request_id] = len(ids)
        return prepared

    def _admit(self, request_id: str) -> None:
        """Hold a place in the queue, or refuse while shutting down or with the queue full."""
        if self.draining:
            message = "the server is shutting down; retry on another instance"
            raise APIError(503, "shutting_down", message, {"Retry-After": "5"})
        if len(self.admitted) >= self.settings.max_queue_size + self.settings.max_num_seqs:
            raise APIError(503, "overloaded", "the request queue is full; retry later", {"Retry-After": "1"})
        self.admitted[request_id] = 0

    def _check(
        self, req: GenerateRequest, ids: list[int], logprobs: int | None, request_id: str, arrival: float
    ) -> PreparedRequest:
        """The checks that need the prompt's tokens; the request to run if it passes them."""
        vocab = len(self.tokenizer)
        if req.stop_token_ids and max(req.stop_token_ids) >= vocab:
            message = f"stop_token_ids: {max(req.stop_token_ids)} is outside the vocabulary (0-{vocab - 1})"
            raise APIError(422, "invalid_request", message, param="stop_token_ids")
        pending_tokens = sum(self.admitted.values())
        if pending_tokens and pending_tokens + len(ids) > self.settings.max_queue_tokens:
            message = f"{pending_tokens} prompt tokens are already queued or running; retry later"
            raise APIError(503, "overloaded", message, {"Retry-After": "1"})
        max_tokens = req.max_tokens
        if max_tokens is None:
            max_tokens = min(self.settings.default_max_tokens, max(1, self.max_model_len - len(ids)))
        if len(ids) + max_tokens > self.max_model_len:
            raise APIError(
                413,
                "context_length_exceeded",
                f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the model's context of "
                f"{self.max_model_len} tokens; shorten the prompt or lower max_tokens",
            )
        try:
            compression = resolve(
                self.compression_config,
                req.compression.model_dump(exclude_unset=True) if req.compression else None,
                server_enabled=self.settings.compression_enabled,
                stats=req.compression_stats,
                inspect=req.inspect,
            )
        except InvalidCompression as error:  # valid alone, not over the server's config
            raise APIError(422, "invalid_request", str(error), param=error.fields[0]) from None
        # Without compression the whole request must fit the budget; with it, the prompt must.
        need = len(ids) if compression.active else len(ids) + max_tokens
        budget = self.max_cache_bytes
        if self.kv_bytes_for(need, compression.kv_cache_dtype) > budget:
            self.metrics.oom_errors.inc()
            raise APIError(
                413,
                "kv_cache_exceeded",
                f"{need} tokens of this request need more KV cache than max_cache_size "
                f"({budget} bytes) allows; shorten the prompt, lower max_tokens or raise --max-cache-size",
            )
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=max(req.top_k, 0),
            seed=req.seed,
            stop=tuple(req.stop),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=req.prompt_logprobs,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            min_tokens=req.min_tokens,
            stop_token_ids=tuple(req.stop_token_ids),
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
            deadline=_deadline(arrival, req.timeout or self.settings.request_timeout),
        )
        return PreparedRequest(request_id, ids, params, compression, arrival)

    def release(self, prepared: PreparedRequest) -> None:
        """Give back an accepted request's place in the queue; safe to call more than once."""
        self.admitted.pop(prepared.request_id, None)

    def event_stream(self, prepared: PreparedRequest, chunks: AsyncIterator[str]) -> EventSourceResponse:
        """The SSE response; its place in the queue comes back even if the stream never starts."""
        return EventSourceResponse(chunks, ping=15, background=BackgroundTask(self.release, prepared))

    async def generate(self, prepared: PreparedRequest, http_request: Request) -> GenerateResponse:
        outputs = await self.run(prepared, http_request)
        last = outputs[-1]
        return GenerateResponse(
            id=prepared.request_id,
            text="".join(out.delta_text for out in outputs),
            finish_reason=last.finish_reason,
            usage=_usage(last),
            compression_metrics=prepared.metrics_of(last),
            prompt_logprobs=self.prompt_logprobs_of(outputs[0], prepared.params.prompt_logprobs),
        )

    def prompt_logprobs_of(self, out: RequestOutput, top: int | None) -> PromptLogprobs | None:
        """The prompt log-probabilities `out` carries (a request's first output, if it asked), as vLLM's,
        with `top` alternatives each."""
        if out.prompt_logprobs is None or top is None:
            return None
        return logprobs.prompt_logprobs(out.prompt_logprobs, top, self.decode_token)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def run(self, prepared: PreparedRequest, http_request: Request) -> list[RequestOutput]:
        """Every output of the request, to the end; abort if the client goes away first."""
        collect = asyncio.ensure_future(self._collect(prepared))
        watch = asyncio.ensure_future(_wait_disconnect(http_request))
        try:
            done, _ = await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if collect not in done:
            collect.cancel()  # cancelling the stream aborts the request in the engine
            self.release(prepared)  # `collect` may be cancelled before it ever starts
            raise APIError(499, "client_closed_request", "the client went away")
        return collect.result()

    async def stream(self, prepared: PreparedRequest) -> AsyncIterator[str]:
        """Server-sent events, one JSON chunk per token piece; the last has finish reason and usage."""
        async for out in self.outputs(prepared):
            prompt = self.prompt_logprobs_of(out, prepared.params.prompt_logprobs)
            if out.finished:
                chunk = StreamChunk(
                    id=prepared.request_id,
                    text=out.delta_text,
                    finish_reason=out.finish_reason,
                    usage=_usage(out),
                    compression_metrics=prepared.metrics_of(out),
                    error=out.error,
                    prompt_logprobs=prompt,
                )
            elif out.delta_text or prompt is not None:
                chunk = StreamChunk(id=prepared.request_id, text=out.delta_text, prompt_logprobs=prompt)
            else:
                continue  # text held back (possible stop string or partial character)
            yield chunk.model_dump_json(exclude_none=True)

    async def outputs(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them; closing the iterator aborts the request."""
        first: float | None = None
        last: RequestOutput | None = None
        counted = False  # a refusal, already counted (here, or by the error handler that answers it)
        generated: list[RequestOutput] = []  # kept for the inspector only
        try:
            async for out in self.engine.generate(
                prepared.prompt_token_ids, prepared.params, prepared.request_id, prepared.compression
            ):
                if first is None and out.completion_tokens:
                    first = time.monotonic()
                last = out
                if prepared.compression.inspect:
                    generated.append(out)
                    if out.tier_history is not None:
                        self._keep_inspection(prepared, generated)
                yield out
        except ValueError as exc:
            self.count_refusal(400)
            counted = True
            raise APIError(400, "invalid_request", str(exc)) from exc
        except EngineDeadError:
            counted = True
            raise
        finally:
            self.release(prepared)
            status = (last.finish_reason if last and last.finished else "abort") or "abort"
            if not counted:
                self.metrics.observe_request(
                    status,
                    len(prepared.prompt_token_ids),
                    last.completion_tokens if last else 0,
                    time.monotonic() - prepared.arrival,
                    None if first is None else first - prepared.arrival,
                    compression=last.compression_metrics if last and last.finished else None,
                    audited=prepared.compression.stats,
                )

    # ----- internals ---------------------------------------------------------------------
    def _keep_inspection(self, prepared: PreparedRequest, outputs: list[RequestOutput]) -> None:
        last = outputs[-1]
        full, key_only = self.entry_bytes(prepared.compression.kv_cache_dtype)
        params = prepared.compression.model_dump(include={"policy", "compression_rate", "thresholds", "kv_cache_dtype"})
        params["enabled"] = prepared.compression.active
        self.inspections.add(
            InspectionRecord(
                request_id=prepared.request_id,
                prompt=prepared.prompt_text,
                token_ids=prepared.prompt_token_ids + [t for out in outputs for t in out.new_token_ids],
                num_prompt_tokens=len(prepared.prompt_token_ids),
                text="".join(out.delta_text for out in outputs),
                history=last.tier_history,
                num_layers=self.num_layers,
                entry_bytes={"full": full, "key_only": key_only},
                params=params,
                compression_metrics=last.compression_metrics,
            )
        )

    async def _collect(self, prepared: PreparedRequest) -> list[RequestOutput]:
        outputs = [out async for out in self.outputs(prepared)]
        last = outputs[-1]
        if last.error is not None and last.finish_reason == FinishReason.ABORT:  # cut off: the server is stopping
            raise APIError(503, "shutting_down", last.error, {"Retry-After": "5"})
        if last.error is not None:
            raise APIError(500, "engine_error", f"the request failed inside the engine: {last.error}")
        return outputs

    def _tokenize(self, req: GenerateRequest) -> tuple[list[int], str | None]:
        """The prompt's token ids, and its text (None for token ids)."""
        text = req.prompt
        if req.messages is not None:
            if not getattr(self.tokenizer, "chat_template", None):
                raise APIError(400, "invalid_request", "this model has no chat template; send a prompt instead")
            text = self.tokenizer.apply_chat_template(
                [m.model_dump() for m in req.messages], tokenize=False, add_generation_prompt=True
            )
            ids = self.tokenizer(text, add_special_tokens=False).input_ids
        elif req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
            vocab = len(self.tokenizer)
            if max(ids) >= vocab:
                message = f"token id {max(ids)} of the prompt is outside the vocabulary (0-{vocab - 1})"
                raise APIError(422, "invalid_request", message, param="prompt_token_ids")
        else:
            ids = self.tokenizer(req.prompt).input_ids
        if not ids:
            raise APIError(422, "invalid_request", "the prompt has no tokens")
        return ids, text

    def count_refusal(self, status: int) -> None:
        self.metrics.requests.labels(str(status)).inc()


def _usage(out: RequestOutput) -> Usage:
    return Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        cached_prompt_tokens=out.cached_prompt_tokens,
    )


def _deadline(arrival: float, timeout: float | None) -> float | None:
    return arrival + timeout if timeout is not None else None


async def _wait_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)
