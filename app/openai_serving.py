"""What the OpenAI-compatible routes do: translate to a `GenerateRequest`, run it, format the answer."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from transformers import PreTrainedTokenizerBase

from app.engine import RequestOutput
from app.openai_protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
    _SamplingRequest,
)
from app.sampler import TokenLogprob
from app.schemas import ChatMessage, GenerateRequest
from app.serving import APIError, GenerateService, PreparedRequest

# OpenAI's system role was renamed "developer"; chat templates know "system".
_ROLES = {"developer": "system"}


class OpenAIService:
    def __init__(self, service: GenerateService, model_name: str) -> None:
        self.service = service
        self.tokenizer: PreTrainedTokenizerBase = service.tokenizer
        self.model_name = model_name
        self.created = int(time.time())

    def models(self) -> ModelList:
        card = ModelCard(id=self.model_name, created=self.created, max_model_len=self.service.max_model_len)
        return ModelList(data=[card])

    # ----- completions -------------------------------------------------------------------
    def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        prompt = {"prompt": req.prompt} if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
        try:
            return self._prepare(req, req.max_tokens, req.logprobs, "cmpl", **prompt)
        except APIError as exc:
            exc.param = "prompt" if exc.param == "prompt_token_ids" else exc.param  # the field's name here
            raise

    async def completion(self, req: CompletionRequest, prepared: PreparedRequest, http: Request) -> CompletionResponse:
        outputs = await self.service.run(prepared, http)
        last = outputs[-1]
        choice = CompletionChoice(
            text="".join(o.delta_text for o in outputs),
            logprobs=self._completion_logprobs(outputs) if req.logprobs is not None else None,
            finish_reason=last.finish_reason,
        )
        return CompletionResponse(
            id=prepared.request_id,
            created=int(time.time()),
            model=self.model_name,
            choices=[choice],
            usage=_usage(last),
            compression_metrics=prepared.metrics_of(last),
        )

    async def completion_stream(self, req: CompletionRequest, prepared: PreparedRequest) -> AsyncIterator[str]:
        def chunk(choices: list[CompletionChoice], **extra) -> CompletionChunk:
            return CompletionChunk(
                id=prepared.request_id, created=int(time.time()), model=self.model_name, choices=choices, **extra
            )

        offset = 0
        async for out in self.service.outputs(prepared):
            if not out.delta_text and not out.finished:
                continue  # text held back (possible stop string or partial character)
            if out.error is not None:
                yield _stream_error(out)
                break
            logprobs = self._completion_logprobs([out], offset) if req.logprobs is not None else None
            offset += len(out.delta_text)
            choice = CompletionChoice(text=out.delta_text, logprobs=logprobs, finish_reason=out.finish_reason)
            if out.finished:
                yield _dump(chunk([choice], **self._final_fields(req, prepared, out, usage_chunk=False)))
                if req.include_usage:
                    yield _dump(chunk([], **self._final_fields(req, prepared, out, usage_chunk=True)))
            else:
                yield _dump(chunk([choice]))
        yield "[DONE]"

    # ----- chat completions --------------------------------------------------------------
    def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        messages = [ChatMessage(role=_ROLES.get(m.role, m.role), content=m.text) for m in req.messages]
        top = (req.top_logprobs or 0) if req.logprobs else None
        return self._prepare(req, req.max_completion_tokens or req.max_tokens, top, "chatcmpl", messages=messages)

    async def chat(
        self, req: ChatCompletionRequest, prepared: PreparedRequest, http: Request
    ) -> ChatCompletionResponse:
        outputs = await self.service.run(prepared, http)
        last = outputs[-1]
        choice = ChatChoice(
            message=ChatMessageOut(content="".join(o.delta_text for o in outputs)),
            logprobs=self._chat_logprobs(outputs) if req.logprobs else None,
            finish_reason=last.finish_reason,
        )
        return ChatCompletionResponse(
            id=prepared.request_id,
            created=int(time.time()),
            model=self.model_name,
            choices=[choice],
            usage=_usage(last),
            compression_metrics=prepared.metrics_of(last),
        )

    async def chat_stream(self, req: ChatCompletionRequest, prepared: PreparedRequest) -> AsyncIterator[str]:
        def chunk(choices: list[ChatChunkChoice], **extra) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=prepared.request_id, created=int(time.time()), model=self.model_name, choices=choices, **extra
            )

        yield _dump(chunk([ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))]))
        async for out in self.service.outputs(prepared):
            if not out.delta_text and not out.finished:
                continue
            if out.error is not None:
                yield _stream_error(out)
                break
            choice = ChatChunkChoice(
                delta=ChatDelta(content=out.delta_text or None),
                logprobs=self._chat_logprobs([out]) if req.logprobs else None,
                finish_reason=out.finish_reason,
            )
            if out.finished:
                yield _dump(chunk([choice], **self._final_fields(req, prepared, out, usage_chunk=False)))
                if req.include_usage:
                    yield _dump(chunk([], **self._final_fields(req, prepared, out, usage_chunk=True)))
            else:
                yield _dump(chunk([choice]))
        yield "[DONE]"

    # ----- internals ---------------------------------------------------------------------
    def _prepare(
        self, req: _SamplingRequest, max_tokens: int | None, logprobs: int | None, prefix: str, **prompt
    ) -> PreparedRequest:
        if req.model != self.model_name:
            raise APIError(
                404,
                "model_not_found",
                f"model: {req.model!r} is not served here; this server serves {self.model_name!r} (GET /v1/models)",
            )
        generate = GenerateRequest(
            **prompt,
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=req.stop_list,
            compression=req.compression,
            compression_stats=req.compression_stats,
        )
        return self.service.prepare(generate, logprobs=logprobs, id_prefix=prefix)

    def _final_fields(self, req: _SamplingRequest, prepared: PreparedRequest, out: RequestOutput, usage_chunk: bool):
        """Usage and compression_metrics go on the last chunk: the usage chunk when one was asked for."""
        if req.include_usage != usage_chunk:
            return {}
        return {"usage": _usage(out), "compression_metrics": prepared.metrics_of(out)}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _top(self, report: TokenLogprob) -> list[TopLogprob]:
        return [self._logprob_entry(TopLogprob, token, value) for token, value in report.top]

    def _logprob_entry(self, cls, token_id: int, value: float, **extra):
        text = self._token_text(token_id)
        return cls(token=text, logprob=value, bytes=list(text.encode()), **extra)

    def _chat_logprobs(self, outputs: list[RequestOutput]) -> ChatLogprobs:
        content = [
            self._logprob_entry(ChatTokenLogprob, r.token_id, r.logprob, top_logprobs=self._top(r))
            for out in outputs
            for r in out.logprobs
        ]
        return ChatLogprobs(content=content)

    def _completion_logprobs(self, outputs: list[RequestOutput], offset: int = 0) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for report in (r for out in outputs for r in out.logprobs):
            text = self._token_text(report.token_id)
            result.tokens.append(text)
            result.token_logprobs.append(report.logprob)
            result.top_logprobs.append({self._token_text(t): v for t, v in report.top})
            result.text_offset.append(offset)
            offset += len(text)
        return result


def _usage(out: RequestOutput) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        total_tokens=out.prompt_tokens + out.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=out.cached_prompt_tokens),
    )


def _dump(chunk: CompletionChunk | ChatCompletionChunk) -> str:
    # Clients expect `usage: null` on ordinary chunks; our extension appears only where it has a value.
    exclude = {"compression_metrics"} if chunk.compression_metrics is None else None
    return chunk.model_dump_json(exclude=exclude)


def _stream_error(out: RequestOutput) -> str:
    # As vLLM does: an error event in OpenAI's error shape, then [DONE].
    message = f"the request failed inside the engine: {out.error}"
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": "engine_error"}})
