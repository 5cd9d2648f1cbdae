"""The model and the engine as the benchmarks run them: on the CPU unless told otherwise, with the value
predictor the server loads."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from confkv.compress.config import CompressionConfig, resolve
from confkv.compress.predictor.online import load_future_value, predictor_path
from confkv.engine.llm_engine import EngineConfig, LLMEngine
from confkv.engine.sequence import SamplingParams
from confkv.kv.kv_layout import BLOCK_SIZE
from confkv.models.corpus import text_of_tokens
from confkv.models.loader import KVShape, load_model

if TYPE_CHECKING:  # names for the annotations only: decode_step.py runs this on older revisions' code too
    from tqdm import tqdm
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from confkv.compress.predictor.online import FutureValue
    from confkv.engine.llm_engine import StepStats

CPU = torch.device("cpu")
KV_BUDGET = 2**34  # bytes of KV an engine here may hold at least: more than a setup needs, so nothing waits


def load_with_predictor(
    model_path: Path | None,
    predictor: Path | None = None,
    device: torch.device = CPU,
    dtype: torch.dtype | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, FutureValue | None]:
    """The model at `model_path` (default: the embedded one) on `device` in `dtype` (None: what
    `load_model` picks), its tokenizer, and the value predictor at `predictor` (default: the one a
    server would find for the model, `predictor_path`), None where there is none. Engines given it
    take the calibration beside it."""
    model, tokenizer = load_model(model_path, device, dtype)
    config = CompressionConfig()
    path = predictor or predictor_path(model_path, model.config, config.prediction_window)
    return model, tokenizer, load_future_value(path, model.config, device, config.score_interval)


def decoding_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    future_value: FutureValue | None,
    request: dict,
    seqs: int,
    prompt_tokens: int,
    max_tokens: int,
    stats: bool = False,
    **engine: object,
) -> LLMEngine:
    """An engine holding `seqs` requests of `prompt_tokens` corpus tokens each, compressed as `request`
    asks, to decode `max_tokens` greedy tokens each together (EOS ignored); with `stats`, each
    request's last output carries its compression_metrics. `engine`: more `EngineConfig` fields."""
    config = CompressionConfig()
    shape = KVShape.of(model.config)
    # Every sequence uncompressed at the model's dtype, with a partial block per table and layer.
    tokens = prompt_tokens + max_tokens + 3 * BLOCK_SIZE
    need = seqs * tokens * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * model.dtype.itemsize
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(max_cache_bytes=max(KV_BUDGET, need), max_num_seqs=seqs, max_num_batched_tokens=2048, **engine),
        config,
        future_value,
    )
    params = resolve(config, request, True, stats)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(str(i), text_of_tokens(tokenizer, prompt_tokens, offset=11 * i), sampling, params)
    return engine


def advance(engine: LLMEngine, bar: tqdm, device: torch.device = CPU) -> float:
    """One engine step, its new tokens counted on `bar`; returns its duration in host time.

    On the CPU every operation has finished when the step returns, and the engine's own figure is
    the step. On CUDA it is not: the sampler's copy to the host waits for the forward pass, but the
    compressor's last kernels (the compaction's copies) may still be queued when the engine's clock
    stops, and would be charged to whichever step comes next (in decode_step.py another setup's). There the device is
    synchronised before the step returns, and the step is timed here up to that point.
    """
    started = time.perf_counter()
    outputs = engine.step()
    duration = engine.last_step.duration_s
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        duration = time.perf_counter() - started
    bar.update(sum(len(out.new_token_ids) for out in outputs))
    return duration


def is_pure_decode(stats: StepStats, seqs: int) -> bool:
    """Whether a step decoded one token of each of `seqs` sequences and nothing else: the steps timed."""
    return stats.num_seqs == seqs and stats.num_tokens == seqs
