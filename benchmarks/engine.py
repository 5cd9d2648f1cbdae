"""The model and the engine as the benchmarks run them: on the CPU, with the value predictor the server loads."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from app.engine import EngineConfig, LLMEngine
from app.sequence import SamplingParams
from benchmarks.corpus import text_of_tokens
from compression.config import CompressionConfig, resolve
from compression.predictor.online import load_future_value, predictor_path
from models.loader import load_model

if TYPE_CHECKING:  # names for the annotations only: decode_step.py runs this on older revisions' code too
    from tqdm import tqdm
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from app.engine import StepStats
    from compression.predictor.online import FutureValue

CPU = torch.device("cpu")


def load_with_predictor(
    model_path: Path | None, predictor: Path | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, FutureValue | None]:
    """The model at `model_path` (default: the embedded one) on the CPU, its tokenizer, and the value
    predictor at `predictor` (default: the model's shipped one), None where there is none."""
    model, tokenizer = load_model(model_path, CPU)
    path = predictor or predictor_path(model_path)
    return model, tokenizer, load_future_value(path, model.config, CPU, CompressionConfig().score_interval)


def decoding_engine(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    future_value: FutureValue | None,
    request: dict,
    seqs: int,
    prompt_tokens: int,
    max_tokens: int,
) -> LLMEngine:
    """An engine holding `seqs` requests of `prompt_tokens` corpus tokens each, compressed as `request`
    asks, to decode `max_tokens` greedy tokens each together (EOS ignored)."""
    config = CompressionConfig()
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(max_cache_bytes=2**34, max_num_seqs=seqs, max_num_batched_tokens=2048),
        config,
        future_value,
    )
    params = resolve(config, request, True, False)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request(str(i), text_of_tokens(tokenizer, prompt_tokens, offset=11 * i), sampling, params)
    return engine


def advance(engine: LLMEngine, bar: tqdm) -> None:
    """One engine step, its new tokens counted on `bar`."""
    bar.update(sum(len(out.new_token_ids) for out in engine.step()))


def is_pure_decode(stats: StepStats, seqs: int) -> bool:
    """Whether a step decoded one token of each of `seqs` sequences and nothing else: the steps timed."""
    return stats.num_seqs == seqs and stats.num_tokens == seqs
