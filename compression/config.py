"""Compression settings: the server-wide file (`config/compression.json`, seed 002's shape plus
ours) and the per-request parameters resolved from it and the request's `compression` object."""

from __future__ import annotations

import json
import re
from dataclasses import astuple, dataclass, replace
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_FILE = Path(__file__).resolve().parent.parent / "config" / "compression.json"

Policy = Literal["dynamic", "none", "streaming_llm", "h2o", "snapkv", "tova", "knorm", "random"]
StorageDtype = Literal["auto", "float32", "float16", "bfloat16", "int8", "int4"]
POLICIES: tuple[str, ...] = Policy.__args__


class Thresholds(BaseModel):
    """Retention confidence thresholds: >= high stays FULL, >= medium KEY_ONLY, below is dropped."""

    model_config = ConfigDict(extra="forbid")
    high: float = Field(0.9, ge=0.0, le=1.0)
    medium: float = Field(0.7, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _ordered(self) -> Thresholds:
        if self.medium > self.high:
            raise ValueError("thresholds.medium must not exceed thresholds.high")
        return self


class CompressionConfig(BaseModel):
    """The server-wide defaults. Field names follow seed 002 where it names them."""

    model_config = ConfigDict(extra="forbid")
    confidence_thresholds: Thresholds = Thresholds()
    cache_eviction_policy: Literal["LRU-2", "LRU-3"] = "LRU-2"
    max_cache_size: str = "80%"
    policy: Policy = "dynamic"
    compression_rate: float = Field(0.6, ge=0.0, lt=1.0)
    compression_interval: int = Field(16, ge=1, description="decode steps between compressions")
    score_interval: int = Field(4, ge=1, description="decode steps between attention observations")
    prediction_window: int = Field(128, ge=1, description="future tokens the value predictor looks ahead")
    prediction_refresh: int = Field(
        2,
        ge=1,
        description="compressions between runs of the value predictor over every entry; in between it "
        "predicts only entries it has not seen and the others keep their forecast",
    )
    observation_window: int = Field(32, ge=1, description="last prompt queries observed at the end of prefill")
    sink_tokens: int = Field(4, ge=0, description="first tokens never dropped (attention sinks)")
    recent_window: int = Field(32, ge=0, description="most recent tokens never dropped")
    kv_cache_dtype: StorageDtype = Field(
        "int8",
        description="storage precision of FULL entries of compressed requests; auto is the model's dtype "
        "(uncompressed requests always keep the model's dtype)",
    )
    key_only_value_bits: Literal[4, 8] = 4
    attention_decay: float = Field(0.95, gt=0.0, le=1.0, description="per-observation decay of dynamic scores")
    confident_extra_rate: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="share of the remaining bytes the dynamic budget also removes while the model is confident",
    )
    pressure_rate_ceiling: float = Field(
        0.9, ge=0.0, lt=1.0, description="under memory pressure running requests compress up to this rate"
    )
    pressure_rate_step: float = Field(0.05, gt=0.0, le=1.0, description="how much harder at each squeeze")
    seed: int = 0

    @property
    def lru_k(self) -> int:
        return int(self.cache_eviction_policy.removeprefix("LRU-"))

    @classmethod
    def load(cls, path: Path | None = None) -> CompressionConfig:
        path = path or DEFAULT_FILE
        return cls.model_validate(json.loads(Path(path).read_text()))


@dataclass(frozen=True)
class CompressionParams:
    """What the engine applies to one request."""

    enabled: bool
    policy: str
    compression_rate: float
    high: float
    medium: float
    compression_interval: int
    score_interval: int
    prediction_window: int
    observation_window: int
    sink_tokens: int
    recent_window: int
    attention_decay: float
    confident_extra_rate: float
    kv_cache_dtype: str = "auto"  # storage precision of FULL entries
    prediction_refresh: int = 2  # compressions between full runs of the value predictor
    value_predictor: bool = True  # dynamic: score by the predictor's future attention, when one is loaded
    stats: bool = False  # the client asked for compression_metrics: keep an audit of dropped keys
    seed: int = 0

    @property
    def active(self) -> bool:
        return self.enabled and self.policy != "none"

    @property
    def fingerprint(self) -> tuple:
        """What a cached KV state depends on: reuse it only under the same settings."""
        if not self.active:
            return ("none", self.kv_cache_dtype)
        return astuple(replace(self, stats=False))


def resolve(config: CompressionConfig, request: dict | None, server_enabled: bool, stats: bool) -> CompressionParams:
    """Request values over config values; `--compression-enabled false` turns everything off."""
    request = request or {}
    thresholds = request.get("thresholds") or {}
    enabled = server_enabled and request.get("enabled", True) is not False
    policy = request.get("policy") or config.policy
    # Storage precision: the request's own choice, else the config's for requests that compress;
    # a request that does not compress keeps the model's dtype.
    storage = request.get("kv_cache_dtype") or (config.kv_cache_dtype if policy != "none" else "auto")
    return CompressionParams(
        enabled=enabled,
        policy=policy,
        compression_rate=_first(request.get("compression_rate"), config.compression_rate),
        high=_first(thresholds.get("high"), config.confidence_thresholds.high),
        medium=_first(thresholds.get("medium"), config.confidence_thresholds.medium),
        compression_interval=request.get("compression_interval") or config.compression_interval,
        score_interval=config.score_interval,
        prediction_window=request.get("prediction_window") or config.prediction_window,
        observation_window=config.observation_window,
        sink_tokens=config.sink_tokens,
        recent_window=config.recent_window,
        attention_decay=config.attention_decay,
        confident_extra_rate=config.confident_extra_rate,
        prediction_refresh=config.prediction_refresh,
        kv_cache_dtype=storage if enabled else "auto",
        value_predictor=request.get("value_predictor") is not False,
        stats=stats,
        seed=config.seed,
    )


def _first(value, default):
    return default if value is None else value


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
