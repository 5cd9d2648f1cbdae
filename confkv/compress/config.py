"""Compression settings, each declared once.

`CompressionSettings` is what a request may choose (its `compression` object). The server-wide
file (`confkv/config/compression.json`, seed 002's shape plus ours) is a `CompressionConfig`: those
settings' defaults plus the server's own. The request schema (`CompressionOptions`) is derived
from `CompressionSettings` with every field optional, and `resolve` lays a request over the
config and validates the result again, so the config file, requests and the library all get the
same bounds and the same refusal of unknown options.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import InitErrorDetails, PydanticCustomError, core_schema

from confkv import CONFIG_DIR
from confkv.compress.scoring import NO_COMPRESSION, POLICIES, ScorePolicy, make_policy, options_model, policy_names
from confkv.compress.spans import RetentionUnit

DEFAULT_FILE = CONFIG_DIR / "compression.json"


class _PolicyOptions:
    """`policy_options`: {policy name: {option: value}}, each policy's options validated as its
    fields declare them (`confkv.compress.scoring`), an error located at the option. Its JSON schema
    lists the policies registered when the schema is made (policies may be registered after import)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(self._validate, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler) -> dict:
        properties = {
            name: handler(options_model(policy).__pydantic_core_schema__) for name, policy in POLICIES.items()
        }
        return {"type": "object", "properties": properties, "additionalProperties": False}

    @staticmethod
    def _validate(options: dict[str, dict] | None) -> dict[str, dict] | None:
        if options is None:  # a request's `"policy_options": null`: the config's options stand
            return None
        errors = []
        for name, values in options.items():
            if name not in POLICIES:
                message = f"unknown policy {name!r}: policies with options are {', '.join(POLICIES)}"
                errors.append(
                    InitErrorDetails(type=PydanticCustomError("unknown_policy", message), loc=(name,), input=values)
                )
                continue
            try:
                options_model(POLICIES[name]).model_validate(values)
            except ValidationError as error:
                errors.extend(
                    InitErrorDetails(
                        type=PydanticCustomError(e["type"], e["msg"]), loc=(name, *e["loc"]), input=e["input"]
                    )
                    for e in error.errors(include_url=False)
                )
        if errors:
            raise ValidationError.from_exception_data("policy_options", errors)
        return options


PolicyOptions = Annotated[dict[str, dict[str, Any]], _PolicyOptions()]

StorageDtype = Literal["auto", "float32", "float16", "bfloat16", "int8", "int4", "kivi4"]


class Thresholds(BaseModel):
    """Retention confidence thresholds (seed 002): >= high stays FULL, >= medium KEY_ONLY, below is dropped."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
    high: float = Field(0.9, ge=0.0, le=1.0, description="an entry at or above this retention confidence stays FULL")
    medium: float = Field(
        0.7, ge=0.0, le=1.0, description="at or above this (below high) an entry is kept KEY_ONLY; below, dropped"
    )
    low: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="seed 002's drop line for entries an earlier compression kept: they are dropped only below "
        "it, and between low and medium they stay as KEY_ONLY (default: medium)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Thresholds:
        if self.medium > self.high:
            raise ValueError("thresholds.medium must not exceed thresholds.high")
        if self.low is not None and self.low > self.medium:
            raise ValueError("thresholds.low must not exceed thresholds.medium")
        return self

    @property
    def drop_line(self) -> float:
        """Below this an entry that was kept before is dropped."""
        return self.medium if self.low is None else self.low


class CompressionSettings(BaseModel):
    """What a request may choose; the config file gives the defaults."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)
    policy: str = Field("dynamic", description=f"one of {', '.join(policy_names())}; `none` does not compress")
    policy_options: PolicyOptions = Field(
        default_factory=dict,
        description='parameters of policies by policy name (a policy\'s fields), e.g. {"snapkv": {"kernel_size": 7}}: '
        "see the policy options table",
    )
    compression_rate: float = Field(0.6, ge=0.0, lt=1.0, description="share of KV bytes to remove")
    thresholds: Thresholds = Field(
        Thresholds(),
        validation_alias=AliasChoices("thresholds", "confidence_thresholds"),
        description="retention confidence thresholds {high, medium, low} for policies that give a confidence "
        "(dynamic): see the thresholds table",
    )
    prediction_window: int = Field(
        128,
        ge=1,
        le=8192,
        description="future tokens the value predictor looks ahead: the window it was trained for (a request "
        "may only repeat it; another value is refused)",
    )
    compression_interval: int = Field(32, ge=1, description="decode steps between compressions")
    kv_cache_dtype: StorageDtype = Field(
        "int8",
        description="storage precision of FULL entries of compressed requests; auto is the model's dtype "
        "(uncompressed requests always keep the model's dtype); int8 keeps ~26% of fp32; kivi4 stores keys as "
        "int4 per channel over each 16-token block (KIVI) and values as int4 per token, ~16%",
    )
    value_predictor: bool = Field(
        True, description="rank entries by the value predictor's forecast when one is loaded (policies that use it)"
    )
    lookahead_tokens: int = Field(
        0,
        ge=0,
        le=64,
        description="tokens decoded greedily on the uncompressed cache at the end of prefill, only so that their "
        "attention (what the answer reads) joins the prompt's in the first compression, then forgotten (LAQ's "
        "lookahead queries): costs that many decode steps before the first token, no bytes",
    )
    retention_unit: RetentionUnit = Field(
        "word",
        description="what is kept or dropped together: word (a word with its pieces, a number's digits, a UUID: "
        "ranked as its best entry, so a value is kept whole or not at all), token (each entry on its own), or "
        "chunk (fixed runs of chunk_tokens positions, ChunkKV)",
    )
    chunk_tokens: int = Field(8, ge=2, le=64, description="positions a span holds with retention_unit chunk")
    layer_budget: Literal["uniform", "pyramid", "adaptive"] = Field(
        "uniform",
        description="how a request's bytes are shared among layers: uniform (each layer holds as much), pyramid "
        "(PyramidKV: more in lower layers, falling linearly), or adaptive (in proportion to how widely each "
        "layer's expected attention spreads over its entries, with a floor)",
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        if name not in policy_names():
            raise ValueError(f"unknown policy {name!r}: use one of {', '.join(policy_names())}")
        return name


class CompressionConfig(CompressionSettings):
    """The server-wide defaults and the server's own settings. Names follow seed 002 where it names them."""

    cache_eviction_policy: Literal["LRU-2", "LRU-3"] = Field(
        "LRU-2", description="which parked prefix-cache entry goes first under pressure (LRU-K)"
    )
    max_cache_size: str = Field(
        "80%",
        description="KV cache budget: MB (4096), with a unit (2GiB) or a share (80%) of the device's memory "
        "(on CUDA, of what is free once the model is loaded and warmed up)",
    )
    score_interval: int = Field(4, ge=1, description="decode steps between attention observations")
    prediction_refresh: int = Field(
        2,
        ge=1,
        description="compressions between runs of the value predictor over every entry; in between it "
        "predicts only entries it has not seen and the others keep their forecast",
    )
    observation_window: int = Field(32, ge=1, description="last prompt queries observed at the end of prefill")
    sink_tokens: int = Field(4, ge=0, description="first tokens never dropped (attention sinks)")
    recent_window: int = Field(32, ge=0, description="most recent tokens never dropped")
    key_only_value_bits: Literal[2, 4, 8] = Field(
        4, description="bits of a KEY_ONLY entry's value (per token and head, asymmetric below 8, as KIVI's values)"
    )
    key_rotation: bool = Field(
        True,
        description="store quantised keys (int8, int4) turned by a fixed random Hadamard rotation (decode queries "
        "are turned alike, so q.k is unchanged): it spreads keys' outlier channels, on which per-token "
        "quantisation otherwise spends its levels",
    )
    pressure_rate_ceiling: float = Field(
        0.9, ge=0.0, lt=1.0, description="under memory pressure running requests compress up to this rate"
    )
    pressure_rate_step: float = Field(0.05, gt=0.0, le=1.0, description="how much harder at each squeeze")
    seed: int = Field(0, description="seed of the policies that draw at random (random)")

    @property
    def lru_k(self) -> int:
        return int(self.cache_eviction_policy.removeprefix("LRU-"))

    @classmethod
    def load(cls, path: Path | None = None) -> CompressionConfig:
        path = path or DEFAULT_FILE
        return cls.model_validate(json.loads(Path(path).read_text()))


class CompressionParams(CompressionConfig):
    """What the engine applies to one request: the config with the request's choices over it."""

    enabled: bool = True
    stats: bool = False  # the client asked for compression_metrics: keep an audit of dropped keys
    inspect: bool = False  # the client asked for the cache inspector: keep the tier history

    @property
    def active(self) -> bool:
        return self.enabled and self.policy != NO_COMPRESSION

    @property
    def fingerprint(self) -> str:
        """What a parked KV state depends on: the precision it is stored at, nothing else. Only
        exact entries are parked (a prompt before its compression, a request that dropped and
        demoted nothing), so a request reuses them whatever its own policy, rate or thresholds."""
        return self.kv_cache_dtype

    def scorer(self) -> ScorePolicy | None:
        """This request's policy with its options; None for a request that does not compress."""
        return make_policy(self.policy, self.policy_options.get(self.policy)) if self.active else None


def _optional(field: FieldInfo) -> tuple[Any, FieldInfo]:
    optional = FieldInfo.merge_field_infos(field, default=None)
    optional.default_factory = None
    return field.annotation | None, optional


CompressionOptions = create_model(
    "CompressionOptions",
    __config__=ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False),
    __doc__="Per-request compression settings; anything left out comes from the server's config.",
    enabled=(bool | None, Field(None, description="false serves this request uncompressed")),
    **{name: _optional(field) for name, field in CompressionSettings.model_fields.items()},
)


class InvalidCompression(ValueError):
    """A request's compression settings, laid over the config, are not valid; `fields` names them."""

    def __init__(self, errors: list[dict]) -> None:
        self.errors = errors  # pydantic's shape: each with `loc` (within `compression`) and `msg`
        super().__init__("; ".join(f"{field}: {e['msg']}" for field, e in zip(self.fields, errors, strict=True)))

    @classmethod
    def of(cls, error: ValidationError) -> InvalidCompression:
        return cls(error.errors(include_url=False))

    @property
    def fields(self) -> list[str]:
        return [".".join(("compression", *map(str, e["loc"]))) for e in self.errors]


def resolve(
    config: CompressionConfig, request: dict | None, server_enabled: bool, stats: bool, inspect: bool = False
) -> CompressionParams:
    """Request values over config values (`policy_options` and `thresholds` merged key by key);
    `--compression-enabled false` turns everything off. Raises `InvalidCompression`."""
    try:
        request = CompressionOptions.model_validate(request or {}).model_dump(exclude_unset=True, exclude_none=True)
    except ValidationError as error:
        raise InvalidCompression.of(error) from None
    window = request.get("prediction_window", config.prediction_window)
    if window != config.prediction_window:  # the value predictor forecasts one window, fixed by its training
        message = (
            f"this server forecasts {config.prediction_window} tokens ahead, the window its value predictor was "
            f"trained for; omit prediction_window or give {config.prediction_window}"
        )
        raise InvalidCompression([{"loc": ("prediction_window",), "msg": message}])
    enabled = server_enabled and request.pop("enabled", True)
    merged = config.model_dump()
    for key, value in request.items():
        if key == "policy_options":
            value = {name: {**merged[key].get(name, {}), **options} for name, options in value.items()}
        merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
    # Storage precision: the request's own choice, else the config's for requests that compress; a
    # request that does not compress (or is turned off) keeps the model's dtype.
    if not enabled or ("kv_cache_dtype" not in request and merged["policy"] == NO_COMPRESSION):
        merged["kv_cache_dtype"] = "auto"
    try:
        return CompressionParams.model_validate({**merged, "enabled": enabled, "stats": stats, "inspect": inspect})
    except ValidationError as error:
        raise InvalidCompression.of(error) from None


_UNITS = {"": 2**20, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(value: str | int | float, total_bytes: int) -> int:
    """'4096' (MB, as in the seeds), '2GiB', '512mb' or '80%' of `total_bytes` -> bytes."""
    text = str(value).strip().lower()
    if text.endswith("%"):
        share = float(text[:-1])
        if not 0 < share <= 100:
            raise ValueError(f"a percentage must be in (0, 100], got {value!r}")
        return int(total_bytes * share / 100)
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    if not match or match.group(2) not in _UNITS:
        raise ValueError(f"max_cache_size {value!r} is not a size: use MB (4096), 2GiB, 512MB or 80%")
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size <= 0:
        raise ValueError(f"max_cache_size must be positive, got {value!r}")
    return size
