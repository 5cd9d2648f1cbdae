"""OpenAI-compatible routes, thin over `OpenAIService`; errors take OpenAI's shape (see api.py)."""

from __future__ import annotations

from typing import Annotated, TypeVar

from fastapi import APIRouter, Depends, Request, Response

from confkv.server.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from confkv.server.openai_serving import OpenAIService
from confkv.server.request_body import CheckedRoute
from confkv.server.serving import PreparedRequest

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
_R = TypeVar("_R", bound=Response)

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"], route_class=CheckedRoute)


def _openai(request: Request) -> OpenAIService:
    return request.app.state.openai


Service = Annotated[OpenAIService, Depends(_openai)]


@router.get("/models", response_model=ModelList)
async def models(service: Service) -> ModelList:
    return service.models()


@router.post("/completions", response_model=CompletionResponse, response_model_exclude_none=True)
async def completions(body: CompletionRequest, request: Request, response: Response, service: Service):
    prepared = await service.prepare_completion(body)
    if body.stream:
        return _reporting_ignored(service.completion_stream(body, prepared), prepared)
    _reporting_ignored(response, prepared)
    return await service.completion(body, prepared, request)


@router.post("/chat/completions", response_model=ChatCompletionResponse, response_model_exclude_none=True)
async def chat_completions(body: ChatCompletionRequest, request: Request, response: Response, service: Service):
    prepared = await service.prepare_chat(body)
    if body.stream:
        return _reporting_ignored(service.chat_stream(body, prepared), prepared)
    _reporting_ignored(response, prepared)
    return await service.chat(body, prepared, request)


def _reporting_ignored(response: _R, prepared: PreparedRequest) -> _R:
    """`response` naming the request's fields this server ignored, if any, in IGNORED_FIELDS_HEADER."""
    if prepared.ignored_fields:  # each name printable ASCII; at most a kilobyte in all
        response.headers[IGNORED_FIELDS_HEADER] = ", ".join(prepared.ignored_fields)[:1024]
    return response
