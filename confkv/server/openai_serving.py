"""What the OpenAI-compatible routes do: translate to a `GenerateRequest`, run it, format the answer."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from sse_starlette import EventSourceResponse
from transformers import PreTrainedTokenizerBase

from confkv.engine.outputs import RequestOutput
from confkv.engine.sampler import TokenLogprob
from confkv.engine.sequence import FinishReason
from confkv.server.logprobs import finite
from confkv.server.openai_protocol import (
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
from confkv.server.schemas import ChatMessage, GenerateRequest
from confkv.server.serving import APIError, GenerateService, PreparedRequest

log = logging.getLogger(__name__)

_Built = TypeVar("_Built", CompletionResponse, ChatCompletionResponse, CompletionChunk, ChatCompletionChunk)

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
    async def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        prompt = {"prompt": req.prompt} if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
        try:
            return await self._prepare(req, req.max_tokens, req.logprobs, "cmpl", req.prompt_top, **prompt)
        except APIError as exc:
            exc.param = "prompt" if exc.param == "prompt_token_ids" else exc.param  # the field's name here
            raise

    async def completion(self, req: CompletionRequest, prepared: PreparedRequest, http: Request) -> CompletionResponse:
        outputs = await self.service.run(prepared, http)
        choice = self._completion_choice(req, prepared, outputs, 0, echo=req.echo)
        return self._build(CompletionResponse, prepared, [choice], **self._final(prepared, outputs[-1]))

    def completion_stream(self, req: CompletionRequest, prepared: PreparedRequest) -> EventSourceResponse:
        # The echoed prompt opens the stream at once, unless its log-probabilities go with it: then it
        # rides on the request's first output, which carries them.
        scored = req.prompt_top is not None
        opening = CompletionChoice(text=self._echoed(req, prepared)) if req.echo and not scored else None
        offset = len(opening.text) if opening else 0  # of the next piece in the whole text (legacy logprobs)

        def choice(out: RequestOutput) -> CompletionChoice:
            nonlocal offset
            piece = self._completion_choice(req, prepared, [out], offset, echo=req.echo and scored)
            offset += len(piece.text)
            return piece

        return self.service.event_stream(prepared, self._stream(CompletionChunk, req, prepared, choice, opening))

    def _completion_choice(
        self, req: CompletionRequest, prepared: PreparedRequest, outputs: list[RequestOutput], offset: int, echo: bool
    ) -> CompletionChoice:
        """The choice for `outputs` (all of a request's, or a streamed one) whose text starts at `offset` of the
        whole; with `echo`, the prompt's text first, and its tokens' log-probabilities where they came (on the
        request's first output)."""
        prompt = outputs[0].prompt_logprobs
        echo = echo and (prompt is not None or req.prompt_top is None)
        text = self._echoed(req, prepared) if echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo and prompt is not None:  # the first prompt token has none: nothing comes before it
                first = prepared.prompt_token_ids[0]
                logprobs = self._completion_logprobs(
                    [(first, None), *((r.token_id, r) for r in prompt)], 0, req.logprobs
                )
            generated = [(r.token_id, r) for out in outputs for r in out.logprobs]
            logprobs.merge(self._completion_logprobs(generated, offset + len(text)))
        return CompletionChoice(
            text=text + "".join(o.delta_text for o in outputs),
            logprobs=logprobs,
            finish_reason=outputs[-1].finish_reason,
            prompt_logprobs=(
                self.service.prompt_logprobs_of(outputs[0], req.prompt_logprobs)
                if req.prompt_logprobs is not None
                else None
            ),
        )

    def _echoed(self, req: CompletionRequest, prepared: PreparedRequest) -> str:
        """The prompt's text where `echo` asks for it (token ids decoded), else nothing."""
        if not req.echo:
            return ""
        return (
            prepared.prompt_text
            if prepared.prompt_text is not None
            else self.tokenizer.decode(prepared.prompt_token_ids)
        )

    # ----- chat completions --------------------------------------------------------------
    async def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        messages = [ChatMessage(role=_ROLES.get(m.role, m.role), content=m.text) for m in req.messages]
        top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        return await self._prepare(req, max_tokens, top, "chatcmpl", req.prompt_logprobs, messages=messages)

    async def chat(
        self, req: ChatCompletionRequest, prepared: PreparedRequest, http: Request
    ) -> ChatCompletionResponse:
        outputs = await self.service.run(prepared, http)
        choice = ChatChoice(
            message=ChatMessageOut(content="".join(o.delta_text for o in outputs)),
            logprobs=self._chat_logprobs(outputs) if req.logprobs else None,
            finish_reason=outputs[-1].finish_reason,
        )
        prompt = self.service.prompt_logprobs_of(outputs[0], req.prompt_logprobs)
        return self._build(
            ChatCompletionResponse, prepared, [choice], prompt_logprobs=prompt, **self._final(prepared, outputs[-1])
        )

    def chat_stream(self, req: ChatCompletionRequest, prepared: PreparedRequest) -> EventSourceResponse:
        def choice(out: RequestOutput) -> ChatChunkChoice:
            return ChatChunkChoice(
                delta=ChatDelta(content=out.delta_text or None),
                logprobs=self._chat_logprobs([out]) if req.logprobs else None,
                finish_reason=out.finish_reason,
            )

        opening = ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))
        return self.service.event_stream(prepared, self._stream(ChatCompletionChunk, req, prepared, choice, opening))

    # ----- internals ---------------------------------------------------------------------
    async def _prepare(
        self,
        req: _SamplingRequest,
        max_tokens: int | None,
        logprobs: int | None,
        prefix: str,
        prompt_logprobs: int | None,
        **prompt,
    ) -> PreparedRequest:
        if req.model != self.model_name:
            self.service.count_refusal(404)
            raise APIError(
                404,
                "model_not_found",
                f"model: {req.model!r} is not served here; this server serves {self.model_name!r} (GET /v1/models)",
            )
        ignored = req.ignored_fields()
        if ignored and self.service.settings.openai_unknown_fields == "reject":
            self.service.count_refusal(400)
            raise APIError(
                400,
                "invalid_request",
                f"{ignored[0]}: unknown field; leave it out (this server runs with --openai-unknown-fields reject)",
                param=ignored[0],
            )
        if ignored:
            log.warning("request fields ignored (not known to this server): %s", ", ".join(ignored))
            self.service.metrics.count_ignored_fields(ignored)
        try:
            generate = self._generate_request(req, max_tokens, prompt_logprobs, prompt)
        except ValidationError as exc:  # fields valid alone, not together (min_tokens > max_tokens): the 400 as any
            raise RequestValidationError(exc.errors()) from exc
        prepared = await self.service.prepare(generate, logprobs=logprobs, id_prefix=prefix)
        prepared.ignored_fields = tuple(ignored)
        return prepared

    @staticmethod
    def _generate_request(
        req: _SamplingRequest, max_tokens: int | None, prompt_logprobs: int | None, prompt: dict
    ) -> GenerateRequest:
        return GenerateRequest(
            **prompt,
            max_tokens=max_tokens,
            prompt_logprobs=prompt_logprobs,
            temperature=req.temperature,
            top_p=req.top_p,
            seed=req.seed,
            stop=req.stop_list,
            compression=req.compression,
            compression_stats=req.compression_stats,
            ignore_eos=req.ignore_eos,
            timeout=req.timeout,
            top_k=req.top_k,
            min_p=req.min_p,
            repetition_penalty=req.repetition_penalty,
            min_tokens=req.min_tokens,
            stop_token_ids=req.stop_token_ids or [],
            include_stop_str_in_output=req.include_stop_str_in_output,
            skip_special_tokens=req.skip_special_tokens,
        )

    def _build(self, cls: type[_Built], prepared: PreparedRequest, choices: list, **extra) -> _Built:
        return cls(id=prepared.request_id, created=int(time.time()), model=self.model_name, choices=choices, **extra)

    @staticmethod
    def _final(prepared: PreparedRequest, last: RequestOutput) -> dict:
        return {"usage": _usage(last), "compression_metrics": prepared.metrics_of(last)}

    async def _stream(
        self,
        cls: type[CompletionChunk | ChatCompletionChunk],
        req: _SamplingRequest,
        prepared: PreparedRequest,
        choice_of: Callable[[RequestOutput], CompletionChoice | ChatChunkChoice],
        opening: CompletionChoice | ChatChunkChoice | None = None,
    ) -> AsyncIterator[str]:
        """SSE data: a chunk per piece of text, then (with include_usage) a usage chunk, then [DONE].

        Usage and compression_metrics ride on the last chunk before [DONE]; with continuous usage,
        usage so far rides on every chunk too.
        """
        if opening is not None:
            yield _dump(self._build(cls, prepared, [opening]))
        async for out in self.service.outputs(prepared):
            if not out.delta_text and not out.finished and out.prompt_logprobs is None:
                continue  # text held back (possible stop string or partial character)
            if out.error is not None:
                yield _stream_error(out)
                break
            usage = {"usage": _usage(out)} if req.continuous_usage else {}
            if not out.finished:
                yield _dump(self._build(cls, prepared, [choice_of(out)], **usage))
            elif req.include_usage:
                yield _dump(self._build(cls, prepared, [choice_of(out)], **usage))
                yield _dump(self._build(cls, prepared, [], **self._final(prepared, out)))
            else:
                yield _dump(self._build(cls, prepared, [choice_of(out)], **self._final(prepared, out)))
        yield "[DONE]"

    def _token_text(self, token_id: int) -> str:
        return self.service.decode_token(token_id)

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

    def _completion_logprobs(
        self, tokens: list[tuple[int, TokenLogprob | None]], offset: int, top: int | None = None
    ) -> CompletionLogprobs:
        """Tokens in the legacy format from `offset` of the whole text: each with its report (None: null
        log-probabilities), its alternatives cut at `top` if given."""
        result = CompletionLogprobs()
        for token_id, report in tokens:
            text = self._token_text(token_id)
            result.tokens.append(text)
            result.token_logprobs.append(None if report is None else finite(report.logprob))
            result.top_logprobs.append(
                None if report is None else {self._token_text(t): finite(v) for t, v in report.top[:top]}
            )
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
    if out.finish_reason == FinishReason.ABORT:  # cut off by the server's shutdown
        code, message = "shutting_down", out.error
    else:
        code, message = "engine_error", f"the request failed inside the engine: {out.error}"
    return json.dumps({"error": {"message": message, "type": "server_error", "param": None, "code": code}})
