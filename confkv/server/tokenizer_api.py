"""vLLM's tokenizer routes: /tokenize, /detokenize and /tokenizer_info, in vLLM's request and response
shapes, so that a client needs no tokenizer of its own (lm-eval's `tokenizer_backend=remote` finds them
and uses them; its local-completions picks them by itself when they answer)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import Field, model_validator
from transformers import PreTrainedTokenizerBase

from confkv.server.request_body import CheckedRoute
from confkv.server.schemas import ChatMessage, _Strict
from confkv.server.serving import APIError, GenerateService

router = APIRouter(tags=["Tokenizer (vLLM's)"], route_class=CheckedRoute)


class TokenizeRequest(_Strict):
    """Text (`prompt`) or a chat (`messages`, rendered by the model's chat template), as vLLM takes them."""

    model: str | None = Field(None, description="the served model's name, if given")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None, description="add the tokenizer's special tokens (BOS); default true for a prompt, false for messages"
    )
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant turn's opening")
    continue_final_message: bool = Field(False, description="messages: leave the last message open, to continue it")
    return_token_strs: bool = Field(False, description="also return each token's string (the vocabulary's)")

    @model_validator(mode="after")
    def _text_or_chat(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false")
        return self


class TokenizeResponse(_Strict):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = Field(None, description="the served model's name, if given")
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(_Strict):
    prompt: str


class TokenizerInfo(_Strict):
    """What a client needs to tokenize as the server does (what lm-eval's remote tokenizer reads)."""

    tokenizer_class: str
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | None
    model_max_length: int = Field(description="the server's context: prompt and generated tokens together")
    vocab_size: int


def _service(request: Request, model: str | None) -> GenerateService:
    served = request.app.state.openai.model_name
    if model is not None and model != served:
        raise APIError(404, "model_not_found", f"model: {model!r} is not served here; this server serves {served!r}")
    return request.app.state.service


@router.post("/tokenize", response_model=TokenizeResponse, response_model_exclude_none=True)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    service = _service(request, body.model)
    ids = await asyncio.to_thread(_token_ids, service.tokenizer, body)  # long texts: off the event loop
    strs = service.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=service.max_model_len, tokens=ids, token_strs=strs)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    service = _service(request, body.model)
    vocab = len(service.tokenizer)
    if body.tokens and max(body.tokens) >= vocab:
        message = f"tokens: {max(body.tokens)} is outside the vocabulary (0-{vocab - 1})"
        raise APIError(422, "invalid_request", message, param="tokens")
    return DetokenizeResponse(prompt=await asyncio.to_thread(service.tokenizer.decode, body.tokens))


@router.get("/tokenizer_info", response_model=TokenizerInfo)
async def tokenizer_info(request: Request) -> TokenizerInfo:
    service: GenerateService = request.app.state.service
    tokenizer = service.tokenizer
    return TokenizerInfo(
        tokenizer_class=type(tokenizer).__name__,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        pad_token=tokenizer.pad_token,
        unk_token=tokenizer.unk_token,
        chat_template=getattr(tokenizer, "chat_template", None),
        model_max_length=service.max_model_len,
        vocab_size=len(tokenizer),
    )


def _token_ids(tokenizer: PreTrainedTokenizerBase, body: TokenizeRequest) -> list[int]:
    if body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer(body.prompt, add_special_tokens=add).input_ids
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(422, "invalid_request", "messages: this model has no chat template; send a prompt instead")
    try:
        text = tokenizer.apply_chat_template(
            [m.model_dump() for m in body.messages],
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
    except Exception as exc:  # the template's own refusal (a final message it cannot continue, a role it lacks)
        message = f"messages: the chat template refused them: {exc}"
        raise APIError(422, "invalid_request", message, param="messages") from None
    return tokenizer(text, add_special_tokens=bool(body.add_special_tokens)).input_ids
