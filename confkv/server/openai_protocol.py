"""The OpenAI-compatible contract: /v1/completions, /v1/chat/completions and /v1/models.

Fields follow OpenAI's API reference, with vLLM's extensions where clients of that ecosystem send
them. Fields that OpenAI defines but this server does not implement are accepted only at their
neutral value (a clear 400 names them otherwise), so a client never gets silently different
behaviour. A field nobody defines (a newer client's, another server's extension) is ignored, as
vLLM does, and reported: the `X-Ignored-Fields` response header, a warning in the log and
`openai_ignored_fields_total{field}`; `--openai-unknown-fields reject` makes it a 400 instead. Our
extensions (`compression`, `compression_stats`) are extra body fields, checked strictly;
`compression_metrics` comes back as an extra field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from confkv.server.sampling_options import MAX_LOGPROBS, SamplingOptions, StopTokenIds
from confkv.server.schemas import PROMPT_LOGPROBS, CompressionMetricsModel, PromptLogprobs

MAX_FIELD_NAME = 64  # characters of an ignored field's name that are reported


class _Lenient(BaseModel):
    """A request object as clients send it: fields it does not define are kept aside, unused, so
    that the route can report them (`ignored_fields`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    def ignored_fields(self, prefix: str = "") -> list[str]:
        """The fields given that this object and the objects in it do not define, dotted, sorted; in
        printable ASCII, escaped as Python escapes strings, and cut at MAX_FIELD_NAME characters, since
        they go into a header, the log and a metric label."""
        names = {f"{prefix}{_printable(name)}" for name in self.model_extra or {}}
        for name in type(self).model_fields:
            value = getattr(self, name)
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, _Lenient):
                    names.update(item.ignored_fields(f"{prefix}{name}."))
        return sorted(names)


def _printable(name: str) -> str:
    return name.encode("unicode_escape", "backslashreplace").decode("ascii")[:MAX_FIELD_NAME]


class StreamOptions(_Lenient):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: with include_usage, usage in every chunk")


class _SamplingRequest(_Lenient, SamplingOptions):
    """What completions and chat completions share (the sampling parameters and vLLM's extensions
    among them, with vLLM's meaning, in `SamplingOptions`)."""

    model: str = Field(description="the served model's name (GET /v1/models)")
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(None, description="up to 16 stop strings")
    n: int = Field(1, ge=1, description="only 1: send several requests for several completions")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    presence_penalty: float = Field(0.0, description="not supported: only 0")
    frequency_penalty: float = Field(0.0, description="not supported: only 0")
    logit_bias: dict[str, float] | None = Field(None, description="not supported")
    stop_token_ids: StopTokenIds | None = Field(None, description="vLLM's: token ids that end the request, as EOS does")

    @field_validator("stop")
    @classmethod
    def _at_most_16(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop strings")
        if value == "":
            raise ValueError("a stop string must not be empty")
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported; send n requests (with different seeds) instead")
        return value

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; leave it at 0")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError("logit_bias is not supported; leave it out")
        return value

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's `continuous_usage_stats`, which needs `include_usage`)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream: true")
        return self


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text or token ids; a list holds one prompt (send one request per prompt)"
    )
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="log-probabilities of the sampled and top tokens (with echo, of the prompt's tokens first)",
    )
    echo: bool = Field(
        False,
        description="the prompt's text before the completion; with logprobs, the prompt tokens' log-probabilities "
        "(the first has none) before the completion's, as lm-eval's loglikelihood requests read them",
    )
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1")

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("one prompt per request is supported; send one request per prompt")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        if isinstance(value, list) and min(value) < 0:
            raise ValueError("token ids must not be negative")
        return value

    @property
    def prompt_top(self) -> int | None:
        """Alternatives per prompt token the engine must report: for echo with logprobs and for
        prompt_logprobs, the more of the two; None where neither asks."""
        asked = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(asked) if asked else None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("suffix is not supported; leave it out")
        return value


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatCompletionMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(description="text, or text parts (other part types are not supported)")
    name: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ResponseFormat(_Lenient):
    type: Literal["text"] = Field(description="only text; JSON modes are not supported")


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatCompletionMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="wins over max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = Field(None, description="not supported")
    tool_choice: Literal["none"] | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("tool calls are not supported; leave tools out")
        return value

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> ChatCompletionRequest:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError(
                "prompt_logprobs: not supported on a chat stream; ask without stream (or on /v1/completions)"
            )
        return self


# ----- responses -------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    """The legacy completions format; with echo, the prompt's tokens come first, the first of them
    with null log-probabilities (nothing comes before it)."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def merge(self, other: CompletionLogprobs) -> None:
        """Append `other`'s tokens (their offsets already in the whole text)."""
        self.tokens += other.tokens
        self.token_logprobs += other.token_logprobs
        self.top_logprobs += other.top_logprobs
        self.text_offset += other.text_offset


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS)


class _Response(BaseModel):
    id: str
    created: int
    model: str
    usage: UsageInfo | None = None
    compression_metrics: CompressionMetricsModel | None = None


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = Field(None, description=PROMPT_LOGPROBS)


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _only_what_changed(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}  # the last delta is {}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "conf-kv"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
