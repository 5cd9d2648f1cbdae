"""FastAPI application: thin routes over `GenerateService`, wired in the lifespan."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Annotated

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from confkv.compress.config import resolve
from confkv.engine.async_engine import AsyncEngine, EngineDeadError
from confkv.engine.llm_engine import EngineConfig, LLMEngine
from confkv.kv.kv_store import memory_for_cache
from confkv.models.loader import load_model, profile_forward
from confkv.models.parallel import SINGLE, RankGroup
from confkv.server.calibration import BackgroundCalibration, server_confidence
from confkv.server.inspect_api import assets as inspect_assets
from confkv.server.inspect_api import router as inspect_router
from confkv.server.metrics import Metrics
from confkv.server.middleware import (
    OPENAI_PREFIX,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    JSONBodyMiddleware,
    error_body,
)
from confkv.server.openai_api import router as openai_router
from confkv.server.openai_serving import OpenAIService
from confkv.server.ranks import check_ranks, rank_device, start_ranks
from confkv.server.request_body import CheckedRoute
from confkv.server.schemas import ErrorResponse, GenerateRequest, GenerateResponse, HealthStatus
from confkv.server.serving import APIError, GenerateService
from confkv.server.settings import Settings
from confkv.server.tokenizer_api import router as tokenizer_router

log = logging.getLogger(__name__)


def build_engine(settings: Settings, ranks: RankGroup | None = None) -> tuple[LLMEngine, BackgroundCalibration]:
    """The engine, and the state of its retention confidence (with the fitting to start where it has
    none). With a `tensor_parallel_size` above 1 the server's engine is rank 0: it starts the other
    ranks first, and they call this with their `ranks`."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    followers = None
    if ranks is None and settings.tensor_parallel_size > 1:
        check_ranks(settings)
        ranks, followers = start_ranks(settings)
    ranks = ranks or SINGLE
    device = rank_device(settings, ranks.rank)
    dtype = None if settings.dtype == "auto" else getattr(torch, settings.dtype)
    model, tokenizer = load_model(settings.model_path, device, dtype, ranks.size)
    if device.type == "cuda":  # a share of device memory is a share of what the activations leave
        profile_forward(model, settings.max_num_batched_tokens)
    compression = settings.compression()
    confidence = server_confidence(settings, model.config, compression, device, ranks.is_leader)
    calibration = BackgroundCalibration(settings, model.config, confidence)
    config = EngineConfig(
        max_cache_bytes=ranks.least(settings.max_cache_bytes(device)),
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        prefix_cache=settings.enable_prefix_cache,
        async_compression=settings.async_compression,
        lru_k=compression.lru_k,
        history_steps=calibration.history_steps() if calibration.wanted else 0,
    )
    log.info(
        "KV cache budget %.1f MiB (max_cache_size %s; memory for the cache %.1f MiB, %s); prefix cache %s; "
        "compression %s (policy %s, rate %.2f, storage %s)",
        config.max_cache_bytes / 2**20,
        settings.max_cache_size or compression.max_cache_size,
        memory_for_cache(device) / 2**20,
        "free after the weights and a forward pass at the largest batch" if device.type == "cuda" else "the system's",
        f"on ({compression.cache_eviction_policy})" if config.prefix_cache else "off",
        "on" if settings.compression_enabled else "off",
        compression.policy,
        compression.compression_rate,
        compression.kv_cache_dtype,
    )
    engine = LLMEngine(model, tokenizer, config, compression, confidence.future_value, confidence.calibrations, ranks)
    arena = engine.store.allocator.arena
    log.info(
        "KV arena allocated: %.1f MiB on %s, %d pages of %.0f KiB (the budget and the spare pages every storage "
        "format may hold partly used); nothing more is allocated for the KV cache",
        arena.nbytes / 2**20,
        device,
        arena.num_pages,
        arena.page_bytes / 2**10,
    )
    if settings.prefix_cache_warmup:
        warm_up(engine, settings)
    engine.followers = followers  # from here on rank 0 orders, the others follow
    return engine, calibration


def warm_up(engine: LLMEngine, settings: Settings) -> None:
    """Prefill the configured prompts into the prefix cache under the server's default compression."""
    tokenizer = engine.tokenizer
    prompts = []
    for item in settings.prefix_cache_warmup:
        if isinstance(item, str):
            prompts.append(tokenizer(item).input_ids)
        else:
            text = tokenizer.apply_chat_template([m.model_dump() for m in item], tokenize=False)
            prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    started = time.perf_counter()
    default = resolve(engine.compression_config, None, server_enabled=settings.compression_enabled, stats=False)
    with torch.inference_mode():
        tokens = engine.warm_up(prompts, default)
    log.info(
        "prefix cache warm-up: %d prompts, %d tokens prefilled in %.1f s",
        len(prompts),
        tokens,
        time.perf_counter() - started,
    )


def create_app(settings: Settings) -> FastAPI:
    app = FastAPI(
        title="CONF-KV",
        version="0.1.0",
        lifespan=_lifespan(settings),
        responses={413: {"model": ErrorResponse}, 503: {"model": ErrorResponse}},
        exception_handlers={
            APIError: _api_error,
            StarletteHTTPException: _http_error,
            EngineDeadError: _engine_dead,
            RequestValidationError: _invalid,
        },
    )
    app.include_router(openai_router)
    app.include_router(inspect_router)
    app.include_router(tokenizer_router)
    app.mount("/inspect/assets", inspect_assets, name="inspect-assets")
    app.include_router(router)
    _add_middleware(app, settings)
    _document_served_model(app, settings.model_name())
    return app


def _lifespan(settings: Settings) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Load the model and run the engine while the app serves; stop the engine on shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = Metrics()
        engine, calibration = build_engine(settings)
        metrics.set_slo(settings.slo_ttft_seconds, settings.slo_tpot_seconds, settings.slo_min_requests)
        loop = AsyncEngine(
            engine,
            on_step=metrics.observe_step,
            max_restarts=settings.engine_max_restarts,
            on_dead=lambda error: app.state.on_engine_dead(error),
            iteration_timeout=settings.engine_iteration_timeout,
        )
        if not hasattr(app.state, "on_engine_dead"):  # set by the process that serves the app (`main`)
            app.state.on_engine_dead = lambda error: log.critical("the engine loop is dead: %r", error)
        metrics.bind_engine(loop.snapshot, engine.store.device)
        metrics.bind_loop(loop)
        if engine.followers is not None:
            engine.followers.on_lost = loop.lost
        metrics.calibration.state(calibration.state)
        calibration.listeners.append(metrics.calibration.state)
        loop.start()
        calibration.start(loop)
        app.state.calibration = calibration
        app.state.metrics = metrics
        app.state.engine = loop
        app.state.service = GenerateService(loop, engine.tokenizer, settings, metrics)
        app.state.openai = OpenAIService(app.state.service, settings.model_name())
        log.info("ready on %s:%d", settings.host, settings.port)
        try:
            yield
        finally:
            calibration.stop()
            loop.stop()
            if engine.followers is not None:
                engine.followers.stop()

    return lifespan


def _add_middleware(app: FastAPI, settings: Settings) -> None:
    # Outermost last: the size limit and the key check answer before any body is parsed; CORS outside
    # them all, since a browser's preflight carries no key, and a refusal needs CORS headers to be read.
    keys = settings.api_keys()
    if keys:
        open_paths = {"/health"} | ({"/metrics"} if settings.public_metrics else set())
        app.add_middleware(APIKeyMiddleware, keys=keys, open_paths=open_paths, browser_paths={"/inspect"})
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_request_bytes)
    app.add_middleware(JSONBodyMiddleware)
    if settings.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_allow_origins, allow_methods=["*"], allow_headers=["*"]
        )


# ----- errors ---------------------------------------------------------------------------------
async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error(request, exc.status, exc.type, exc.message, exc.headers, exc.param)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # FastAPI's own refusals (unreadable body, unknown route, wrong method) in our error shape.
    kinds = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
    return _error(request, exc.status_code, kinds.get(exc.status_code, "http_error"), str(exc.detail), exc.headers)


async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
    request.app.state.metrics.requests.labels("503").inc()  # counted, so the 5xx alert sees a dead engine
    message = f"{exc}; the server exits to be restarted (restart it if nothing does), then retry"
    return _error(request, 503, "engine_unavailable", message, {"Retry-After": "5"})


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    fields = ", ".join(".".join(str(p) for p in e["loc"] if p != "body") or "body" for e in errors)
    message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in errors)
    openai = _is_openai(request)
    if hasattr(request.app.state, "metrics"):
        request.app.state.metrics.requests.labels("400" if openai else "422").inc()
    if openai:  # OpenAI answers invalid parameters with 400 and names the first in `param`
        return _error(request, 400, "invalid_request", message, param=fields.split(", ")[0])
    body = {"error": {"type": "invalid_request", "message": message, "fields": fields}, "detail": _jsonable(errors)}
    return JSONResponse(status_code=422, content=body)


# ----- routes ---------------------------------------------------------------------------------
def _service(request: Request) -> GenerateService:
    return request.app.state.service


router = APIRouter(route_class=CheckedRoute)
_HEALTH_503 = {503: {"model": HealthStatus, "description": "the engine is not serving"}}


@router.post("/generate", response_model=GenerateResponse, response_model_exclude_none=True)
async def generate(body: GenerateRequest, request: Request, service: Annotated[GenerateService, Depends(_service)]):
    prepared = await service.prepare(body)
    if body.stream:
        return service.event_stream(prepared, service.stream(prepared))
    return await service.generate(prepared, request)


@router.get("/health", response_model=HealthStatus, response_model_exclude_none=True, responses=_HEALTH_503)
async def health(request: Request):
    engine: AsyncEngine | None = getattr(request.app.state, "engine", None)
    if engine is not None and engine.error is not None:
        return JSONResponse(status_code=503, content={"status": "engine_failed", "error": repr(engine.error)})
    calibration: BackgroundCalibration | None = getattr(request.app.state, "calibration", None)
    return {"status": "ok", "calibration": calibration.state if calibration else None}


@router.get("/ready", response_model=HealthStatus, response_model_exclude_none=True, responses=_HEALTH_503)
async def ready(request: Request):
    engine: AsyncEngine | None = getattr(request.app.state, "engine", None)
    if engine is not None and engine.restarting:
        return JSONResponse(status_code=503, content={"status": "restarting"})
    if engine is None or not engine.is_running:
        return JSONResponse(status_code=503, content={"status": "not_ready"})
    if request.app.state.service.draining:
        return JSONResponse(status_code=503, content={"status": "shutting_down"})
    return {"status": "ready"}


@router.get("/metrics")
def metrics(request: Request) -> Response:  # sync: FastAPI runs it on a worker thread, as it waits for the engine
    registry = request.app.state.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _document_served_model(app: FastAPI, name: str) -> None:
    """The OpenAPI schema names the one model the OpenAI routes accept."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()  # FastAPI keeps it as app.openapi_schema
            for request in ("CompletionRequest", "ChatCompletionRequest"):
                schema["components"]["schemas"][request]["properties"]["model"]["enum"] = [name]
        return app.openapi_schema

    app.openapi = openapi


def _is_openai(request: Request) -> bool:
    return request.url.path.startswith(OPENAI_PREFIX)


def _error(
    request: Request,
    status: int,
    type_: str,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
) -> JSONResponse:
    if _is_openai(request):
        status = 400 if status == 422 else status  # OpenAI has no 422
    body = error_body(request.url.path, status, type_, message, param)
    return JSONResponse(status_code=status, content=body, headers=headers)


def _jsonable(errors: list[dict]) -> list:
    # pydantic puts the raised exception object into ctx and raw bytes into input; make both text, and
    # the numbers JSON cannot write (NaN, Infinity: a refused input echoed) text too.
    encoders = {BaseException: str, bytes: lambda b: b.decode(errors="replace"), float: _finite_or_text}
    return jsonable_encoder(errors, custom_encoder=encoders)


def _finite_or_text(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
