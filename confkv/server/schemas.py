"""The HTTP contract: request and response models of POST /generate."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from confkv.compress.predictor.online import CalibrationState
from confkv.server.sampling_options import SamplingOptions, StopTokenIds


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str


class GenerateRequest(_Strict, SamplingOptions):
    prompt: str | None = Field(None, min_length=1, description="plain text prompt (or give messages or token ids)")
    messages: list[ChatMessage] | None = Field(None, min_length=1, description="chat, formatted by the chat template")
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="the prompt as token ids (or give prompt or messages)"
    )
    stop_token_ids: StopTokenIds = Field(
        default_factory=list, description="token ids that end the request, as EOS does"
    )
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=16)
    stream: bool = False
    inspect: bool = Field(
        False,
        description="keep what compression does to this request, layer by layer, for the cache inspector: "
        "GET /inspect/requests/{id} (kept for the newest requests only)",
    )

    @model_validator(mode="after")
    def _one_prompt(self) -> GenerateRequest:
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_token_ids)) != 1:
            raise ValueError("give exactly one of prompt, messages or prompt_token_ids")
        return self


class CompressionMetricsModel(BaseModel):
    """Returned when `compression_stats` is true; sizes are bytes."""

    original_size: int = Field(description="bytes this request's KV would hold uncompressed, at the end")
    compressed_size: int = Field(description="bytes it actually holds at the end")
    ceiling_size: int = Field(
        description="bytes compression_rate allowed it at the end, (1 - rate) x original_size (the rate as raised "
        "under memory pressure); where thresholds decide, compressed_size may stay well below it"
    )
    compression_ratio: float = Field(description="compressed_size / original_size")
    mean_compression_ratio: float = Field(
        description="compression_ratio after every decode step, averaged over the request: where thresholds "
        "decide, what it held over its life, not only at the end"
    )
    hit_rate: float = Field(description="share of prompt tokens whose KV came from the prefix cache")
    prefix_parked: Literal["prompt", "request"] | None = Field(
        None,
        description="how the reused prefix was parked, both query-agnostic: `prompt`, an earlier prompt's KV "
        "before any compression; `request`, a finished request that dropped and quantised nothing; "
        "absent without reuse",
    )
    recall_rate: float = Field(
        description="share of attention mass, over decode steps, layers and heads, on held entries"
    )
    entries: dict[str, int] = Field(description="(layer, token) entries held FULL, KEY_ONLY, and dropped")
    policy: str
    compression_time_ms: float


class PromptLogprob(BaseModel):
    """vLLM's shape: a token's log-probability at a prompt position, its rank and its text."""

    logprob: float = Field(description="-9999.0 where the model gives the token no chance (JSON has no -inf)")
    rank: int = Field(description="1 for the likeliest token")
    decoded_token: str


# Per prompt token: None for the first, then the prompt token's and the likeliest tokens' by token id.
PromptLogprobs = list[dict[int, PromptLogprob] | None]
PROMPT_LOGPROBS = (
    "with prompt_logprobs: each prompt token's log-probability (none for the first), its rank and the likeliest "
    "tokens', by token id; from this request's own prefill: before any eviction, over its KV at its storage precision "
    "(the model's own where kv_cache_dtype is the model's dtype)"
)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0


class GenerateResponse(BaseModel):
    id: str
    text: str
    finish_reason: str | None
    usage: Usage
    compression_metrics: CompressionMetricsModel | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS)


class StreamChunk(BaseModel):
    """One server-sent event: a piece of text, and on the last one the finish reason and usage."""

    id: str
    text: str
    finish_reason: str | None = None
    usage: Usage | None = None
    compression_metrics: CompressionMetricsModel | None = None
    error: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description=f"on the first chunk: {PROMPT_LOGPROBS}")


class HealthStatus(BaseModel):
    status: str = Field(
        description="ok or ready; otherwise (503) engine_failed, not_ready, restarting (the engine is being reset "
        "after a crash: ready again within seconds) or shutting_down"
    )
    error: str | None = Field(None, description="why the engine loop stopped (engine_failed)")
    calibration: CalibrationState | None = Field(
        None,
        description="what dynamic's retention confidence stands on (/health): a predictor and calibration shipped "
        "with the package or the model, fitted for this model and window, being fitted in the background (the rate "
        "decides until then), or none (the rate alone decides)",
    )


class ErrorBody(BaseModel):
    type: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class LayerTiers(BaseModel):
    tiers: list[int] = Field(
        description="run-length over positions 0..num_tokens-1, flat: tier, count, tier, count...; "
        "tier 0 dropped, 1 KEY_ONLY (key kept, value quantised), 2 FULL"
    )
    scores: str | None = Field(
        description="the policy's score of each position (the forecast under dynamic with a predictor): "
        "base64 of little-endian float16, NaN where not scored; null when this layer was not scored then"
    )
    retention: str | None = Field(description="each position's retention confidence, encoded as `scores`")


class CompressionSnapshot(BaseModel):
    step: int = Field(description="decode steps done")
    num_tokens: int = Field(description="tokens in the request's cache then")
    final: bool = Field(description="the state as the request finished, not a compression")
    layers: list[LayerTiers]


class InspectionResponse(BaseModel):
    """What compression did to one request that asked for it (`inspect`), compression by compression."""

    id: str
    created: float = Field(description="Unix time the request finished")
    prompt: str | None = Field(description="the prompt's text (the chat as the template rendered it); null for ids")
    text: str
    tokens: list[str] = Field(description="every token, prompt then generated, decoded one by one")
    num_prompt_tokens: int
    num_layers: int
    tiers: dict[int, str] = Field(description="tier codes and their names")
    entry_bytes: dict[str, int] = Field(description="bytes of one (layer, token) entry: full, key_only")
    compressions: list[CompressionSnapshot] = Field(
        description="after the end-of-prefill compression, after each later one, then the final state"
    )
    compression_metrics: CompressionMetricsModel | None
    params: dict = Field(description="the compression settings the request ran under")
