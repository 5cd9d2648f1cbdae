"""OpenAI-compatible routes, thin over `OpenAIService`; errors take OpenAI's shape (see api.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from app.openai_protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ModelList,
)
from app.openai_serving import OpenAIService

router = APIRouter(prefix="/v1", tags=["OpenAI-compatible"])


def _openai(request: Request) -> OpenAIService:
    return request.app.state.openai


Service = Annotated[OpenAIService, Depends(_openai)]


@router.get("/models", response_model=ModelList)
async def models(service: Service) -> ModelList:
    return service.models()


@router.post("/completions", response_model=CompletionResponse, response_model_exclude_none=True)
async def completions(body: CompletionRequest, request: Request, service: Service):
    prepared = await service.prepare_completion(body)
    if body.stream:
        return service.completion_stream(body, prepared)
    return await service.completion(body, prepared, request)


@router.post("/chat/completions", response_model=ChatCompletionResponse, response_model_exclude_none=True)
async def chat_completions(body: ChatCompletionRequest, request: Request, service: Service):
    prepared = await service.prepare_chat(body)
    if body.stream:
        return service.chat_stream(body, prepared)
    return await service.chat(body, prepared, request)
