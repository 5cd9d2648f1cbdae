"""Server settings: defaults < config file (`--config`, YAML) < CONFKV_* environment < flags."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    CliImplicitFlag,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from confkv.compress.config import DEFAULT_FILE as DEFAULT_COMPRESSION_FILE
from confkv.compress.config import CompressionConfig, parse_size
from confkv.kv.kv_store import memory_for_cache
from confkv.models.default_model import MODEL_NAME
from confkv.server.schemas import ChatMessage


class ClusterSettings(BaseModel):
    """Serving through Ray Serve replicas (`serve.py --ray`; flags `--cluster.NAME`, env `CONFKV_CLUSTER__NAME`)."""

    model_config = {"extra": "forbid"}

    address: str | None = Field(
        None, description="Ray cluster to join (auto: the one this machine belongs to); default: start a local one"
    )
    replicas: int = Field(2, ge=1, description="engine replicas (each holds the model and its own KV cache)")
    max_replicas: int | None = Field(
        None, ge=1, description="autoscale between --cluster.replicas and this many replicas; default: no autoscaling"
    )
    target_ongoing_requests: float = Field(
        8.0, gt=0.0, description="autoscaling: ongoing requests per replica it aims for"
    )
    target_kv_usage: float = Field(
        0.7, gt=0.0, le=1.0, description="autoscaling: share of each replica's KV budget held that it aims for"
    )
    upscale_delay_s: float = Field(10.0, ge=0.0, description="autoscaling: how long more replicas must be wanted")
    downscale_delay_s: float = Field(300.0, ge=0.0, description="autoscaling: how long fewer replicas must be wanted")
    router: Literal["prefix_kv", "power_of_two"] = Field(
        "prefix_kv",
        description="prefix_kv: longest cached prefix, then most free KV memory; power_of_two: Ray Serve's default",
    )
    imbalance_threshold: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="when replicas' free KV shares differ by more, the freest replica takes a request "
        "even if another has its prefix cached",
    )
    replica_cpus: float = Field(
        1.0, ge=0.0, description="CPUs Ray reserves for each engine replica, per tensor-parallel rank"
    )
    replica_gpus: float = Field(
        0.0,
        ge=0.0,
        description="GPUs Ray reserves for each engine replica, per tensor-parallel rank (1 with CUDA): a replica "
        "of --tensor-parallel-size N takes N on one node",
    )

    @model_validator(mode="after")
    def _check_bounds(self) -> ClusterSettings:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas})")
        return self


class CalibrationSettings(BaseModel):
    """Fitting the retention confidence of a model that has none for its fingerprint and
    prediction_window (flags `--calibration.NAME`, env `CONFKV_CALIBRATION__NAME`)."""

    model_config = {"extra": "forbid"}

    background: bool = Field(
        True,
        description="fit it in a child process while the server serves by the rate alone, then switch dynamic to the "
        "thresholds without a restart (on the CPU, whatever the server's device); false: the rate alone until "
        "`conf-kv calibrate` is run",
    )
    threads: int = Field(
        1, ge=1, description="CPU threads of the background fitting, which runs at the lowest scheduling priority"
    )
    sequences: int = Field(24, ge=2, description="built-in corpus sequences recorded (fewer: faster and noisier)")
    prompt_tokens: int = Field(800, ge=32, description="tokens of each recorded prompt")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="CONFKV_",
        env_nested_delimiter="__",
        cli_kebab_case=True,
        cli_prog_name="conf-kv",
        cli_implicit_flags=False,
        extra="forbid",
    )
    # Set by `load_settings` before parsing, so the YAML file takes its place among the sources.
    _config_file: ClassVar[Path | None] = None

    config: Path | None = Field(None, description="YAML file with any of these settings (flags and env win)")
    model_path: Path | None = Field(None, description="local Hugging Face model folder; default: the embedded model")
    served_model_name: str | None = Field(
        None, description="model name clients give (OpenAI routes); default: the model folder's name"
    )
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 for all interfaces)")
    port: int = Field(8080, ge=1, le=65535, description="port to listen on")
    compression_enabled: bool = Field(True, description="compress the KV cache while generating")
    compression_config: Path | None = Field(
        None, description="compression config file (JSON); default: the shipped confkv/config/compression.json"
    )
    value_predictor: str = Field(
        "auto",
        description="future-value predictor weights (safetensors) for the dynamic policy, its calibration beside them; "
        "auto: the model folder's own, else one fitted for the model and prediction_window (`conf-kv calibrate`, or "
        "the background fitting), else the one shipped; off: observed attention only",
    )
    predictor_error_samples: Path | None = Field(
        None,
        description="folder where entries the dynamic policy dropped but that then drew attention are logged "
        "as training samples for the predictor (audits every request the predictor ranks); off when unset",
    )
    max_cache_size: str | None = Field(
        None,
        description="KV cache budget: MB (4096), with a unit (2GiB) or a share of device memory (80%); "
        "default: max_cache_size of the compression config file",
    )
    enable_prefix_cache: bool = Field(
        True, description="keep finished requests' KV for reuse by requests that start with the same tokens"
    )
    prefix_cache_warmup: list[str | list[ChatMessage]] = Field(
        default_factory=list,
        description="prompts (text, or chat messages in the chat template) prefilled into the prefix cache "
        "at start-up, e.g. shared system prompts",
    )
    max_num_seqs: int = Field(32, ge=1, description="most sequences running at once")
    max_num_batched_tokens: int = Field(512, ge=1, description="most tokens in one forward pass (chunked prefill)")
    async_compression: bool = Field(
        False,
        description="plan due compressions on a worker thread beside the next step's forward pass (the sequences "
        "compressed sit that step out); off: compress between steps",
    )
    max_queue_size: int = Field(256, ge=0, description="most requests waiting; beyond it 503 with Retry-After")
    max_queue_tokens: int = Field(
        262144, ge=1, description="most prompt tokens queued or running; beyond it 503 with Retry-After"
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none")
    slo_ttft_seconds: float = Field(
        5.0, gt=0.0, description="p99 time to first token the alerts hold the server to (exported as a gauge)"
    )
    slo_tpot_seconds: float = Field(
        0.5, gt=0.0, description="p99 time per output token the alerts hold the server to (exported as a gauge)"
    )
    slo_min_requests: int = Field(
        20, ge=0, description="requests in 5 minutes below which the SLO alerts stay quiet (exported as a gauge)"
    )
    inspect_max_requests: int = Field(
        16, ge=0, description="requests whose tier history the cache inspector keeps (newest first; 0: none)"
    )
    inspect_max_bytes: int = Field(
        64 * 2**20, ge=0, description="bytes of tier history the cache inspector keeps at most (oldest dropped first)"
    )
    engine_max_restarts: int = Field(
        3,
        ge=0,
        description="times the engine loop is reset and goes on after a step raised (requests in flight get an "
        "error); past that, or if memory is not all back, the server exits with status 1 for its orchestrator "
        "to restart it",
    )
    engine_iteration_timeout: float = Field(
        300.0,
        ge=0.0,
        description="seconds one engine step may take (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S); past it the loop "
        "is declared hung, requests in flight get an error and the server exits with status 1 (0: no watchdog)",
    )
    shutdown_grace_period: float = Field(
        30.0, ge=0.0, description="on SIGTERM, seconds running requests may take to finish (new ones get 503)"
    )
    request_timeout: float | None = Field(
        600.0, gt=0.0, description="seconds a request may take when it gives no timeout; null: no limit"
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="model dtype; auto: fp32 on CPU, the model's own dtype on CUDA"
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="ranks each layer's heads are split over, one process each (vLLM's name): with CUDA one "
        "device each, cuda:0..N-1, joined by NCCL; on the CPU processes joined by gloo. Must divide the model's "
        "attention and KV heads. max_cache_size is per rank",
    )
    torch_threads: int | None = Field(None, ge=1, description="CPU threads for torch; default: all cores")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="least severe log lines shown")
    api_key: str | None = Field(None, description="require 'Authorization: Bearer <key>' on every route but /health")
    api_key_file: Path | None = Field(None, description="file with one accepted API key per line")
    public_metrics: bool = Field(False, description="with API keys, leave /metrics open (for Prometheus)")
    max_request_bytes: int = Field(2**20, ge=1024, description="larger request bodies get 413")
    openai_unknown_fields: Literal["ignore", "reject"] = Field(
        "ignore",
        description="fields of an OpenAI-route request this server does not know: ignore (reported in the "
        "X-Ignored-Fields header, the log and openai_ignored_fields_total, as vLLM ignores them) or reject (400)",
    )
    cors_allow_origins: list[str] = Field(default_factory=list, description="origins allowed by CORS; none: CORS off")
    ray: CliImplicitFlag[bool] = Field(
        False, description="serve through Ray Serve replicas behind one ingress (pip install .[distributed])"
    )
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)
    calibration: CalibrationSettings = Field(default_factory=CalibrationSettings)

    def api_keys(self) -> list[str]:
        keys = [self.api_key] if self.api_key else []
        if self.api_key_file is not None:
            lines = self.api_key_file.read_text().splitlines()
            keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        return keys

    @field_validator("max_cache_size")
    @classmethod
    def _check_cache_size(cls, value: str | None) -> str | None:
        if value is not None:
            parse_size(value, total_bytes=1)  # raises on a malformed size
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if cls._config_file is not None:
            sources += (YamlConfigSettingsSource(settings_cls, yaml_file=cls._config_file),)
        return sources

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def model_name(self) -> str:
        return self.served_model_name or (self.model_path.name if self.model_path else MODEL_NAME)

    def compression(self) -> CompressionConfig:
        return CompressionConfig.load(self.compression_config or DEFAULT_COMPRESSION_FILE)

    def max_cache_bytes(self, device: torch.device | None = None) -> int:
        """The KV budget in bytes on `device` (default: the resolved one); on CUDA call it once the
        model is loaded and warmed up."""
        size = self.max_cache_size or self.compression().max_cache_size
        return parse_size(size, memory_for_cache(device or self.resolved_device()))


def load_settings(argv: list[str] | None = None, **overrides) -> Settings:
    """Settings from flags (`argv`), environment and an optional YAML file named by --config."""
    config = overrides.get("config")
    args = list(argv or [])
    for i, arg in enumerate(args):
        if arg == "--config" and i + 1 < len(args):
            config = args[i + 1]
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
    if config is not None and not Path(config).is_file():
        raise FileNotFoundError(f"config file {config} does not exist")
    Settings._config_file = Path(config) if config is not None else None
    try:
        return Settings(_cli_parse_args=args, **overrides) if argv is not None else Settings(**overrides)
    finally:
        Settings._config_file = None
