"""The sampling parameters both request routes take, each declared once with its range and meaning.

`/generate` (`GenerateRequest`) and the OpenAI routes (`_SamplingRequest`) inherit them, so the two
schemas, their validation, the OpenAPI document and the fuzzer's requests (which read it) agree, and
a value the schema accepts is one the sampler can use. Numbers are finite (NaN, Infinity and 1e400
are refused here, naming the field). Ranges follow OpenAI where it sets one and vLLM's meaning
otherwise, narrowed where a wider value only breaks sampling: a repetition penalty near 0 divides
the seen tokens' logits into infinities.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from confkv.compress.config import CompressionOptions

MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's bound, vLLM's default max_logprobs)
MAX_TIMEOUT_S = 86400.0


class SamplingOptions(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    max_tokens: int | None = Field(
        None,
        ge=0,
        description="most tokens to generate; default from the server. 0: the prompt is only prefilled (for "
        "prompt_logprobs or echo, or to warm the prefix cache)",
    )
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 means greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="sample from the smallest set of tokens with this mass")
    top_k: int = Field(0, ge=-1, description="vLLM's: 0 or -1 mean no top-k cut")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="drop tokens less likely than min_p times the likeliest")
    repetition_penalty: float = Field(
        1.0,
        ge=0.01,
        le=10.0,
        description="vLLM's: above 1, tokens already in the prompt or output become less likely (below 1, more)",
    )
    min_tokens: int = Field(0, ge=0, description="tokens generated before EOS, stop_token_ids or stop can end it")
    seed: int | None = Field(None, ge=0, lt=2**63, description="the same seed and request give the same tokens")
    ignore_eos: bool = Field(False, description="keep generating past EOS up to max_tokens (benchmarks)")
    include_stop_str_in_output: bool = Field(False, description="keep the stop string that ended the text")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")
    timeout: float | None = Field(
        None, gt=0.0, le=MAX_TIMEOUT_S, description="seconds; past it the request ends with finish_reason timeout"
    )
    prompt_logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="vLLM's: each prompt token's log-probability (the first has none) and this many of the "
        "likeliest tokens'; computed in the request's own prefill, before any eviction, over its KV at its storage "
        "precision; such a request reuses no prefix-cache entry",
    )
    compression: CompressionOptions | None = None
    compression_stats: bool = Field(False, description="return compression_metrics with the response")

    @field_validator("min_tokens")
    @classmethod
    def _within_max_tokens(cls, value: int, info: ValidationInfo) -> int:
        # A field's own check, so that the error names it (max_tokens is validated before it).
        max_tokens = info.data.get("max_tokens")
        if max_tokens is not None and value > max_tokens:
            raise ValueError(f"must not exceed max_tokens ({max_tokens})")
        return value


StopTokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)]
