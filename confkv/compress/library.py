"""`DynamicKVCompressor`: the compressor for a plain transformers model, without the server.

    from confkv import DynamicKVCompressor

    compressor = DynamicKVCompressor(max_cache_size=4096, prediction_window=128)   # MB, as in seed 000
    output = compressor.generate(model, input_ids, max_new_tokens=64)              # batch 1
    print(compressor.metrics())                                                     # compression_metrics

`generate(model, ...)` is `model.generate(..., cache=compressor)` inside `attached(model)`:
the compressor is the `Cache` that `generate` keeps, and while attached, a forward pre-hook hands
each forward pass its packed-batch description so that the KV store's attention function (the
server's) writes, reads, observes and compresses this one sequence. It also watches the logits to
learn the model's confidence. Batch size 1, greedy or sampled, any `generate` options that keep
the batch at one row.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import Cache, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from confkv.compress.compressor import Compressor
from confkv.compress.config import CompressionConfig, parse_size, resolve
from confkv.compress.predictor.calibration import Calibration, Source
from confkv.compress.predictor.online import FutureValue, calibrations_for
from confkv.compress.spans import word_starts
from confkv.compress.state import CompressionMetrics
from confkv.kv.attention import ATTENTION_NAME, PackedBatch, Segment, register_attention
from confkv.kv.kv_store import KVStore, memory_for_cache

SEQ_ID = 0


@dataclass
class _Sequence:
    """The one sequence, as the compressor tracks it."""

    seq_id: int = SEQ_ID
    num_computed: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _Step:
    """One forward pass, as the engine's prepare() sees it."""

    seq_id: int
    token_ids: list[int]
    needs_logits: bool = True
    observe: int = 0
    audit: bool = False


class DynamicKVCompressor(Cache):
    """A transformers `Cache` that keeps one sequence's KV compressed while `generate` runs."""

    def __init__(
        self,
        max_cache_size: int | float | str = 4096,
        prediction_window: int | None = None,
        policy: str | None = None,
        compression_rate: float | None = None,
        config: CompressionConfig | None = None,
        stats: bool = True,
        future_value: FutureValue | None = None,
        calibrations: dict[Source, Calibration] | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        **options,
    ) -> None:
        """`max_cache_size`: MB (as in the seeds), or '2GiB', or '80%' of device memory.
        `prediction_window`: the config's (the window the predictor was trained for); another is refused.
        `future_value`: the value predictor for the `dynamic` policy (`load_future_value`); without it,
        dynamic scores by observed attention only. `calibrations`: the retention confidence's tables
        (`load_retention`; None: those that go with `future_value`, `calibrations_for`). `tokenizer`: the model's, which
        `retention_unit="word"` (the default) needs to tell where words begin; without it, entries are kept
        token by token unless `retention_unit` is given. Other options (`compression_interval`,
        `thresholds={...}`, `kv_cache_dtype`, `policy_options={...}`) are those of a request's
        `compression` object, and anything else is refused (`InvalidCompression` names it); the rest
        comes from `config` (default: confkv/config/compression.json)."""
        super().__init__(layers=[])
        self.config = config or CompressionConfig.load()
        request = {
            "prediction_window": prediction_window,
            "policy": policy,
            "compression_rate": compression_rate,
            **options,
        }
        if tokenizer is None and "retention_unit" not in options:  # words cannot be told without it
            request["retention_unit"] = "token"
        self.params = resolve(self.config, {k: v for k, v in request.items() if v is not None}, True, stats)
        if self.params.retention_unit == "word" and tokenizer is None:
            raise ValueError("retention_unit='word' needs the model's tokenizer: give tokenizer=")
        if future_value is not None:
            future_value.require_window(self.config.prediction_window)
        self.max_cache_size = max_cache_size
        self.future_value = future_value
        self.calibrations = calibrations
        self.word_starts = word_starts(tokenizer) if tokenizer is not None else None
        self.store: KVStore | None = None
        self.compressor: Compressor | None = None
        self.sequence = _Sequence()
        self._pending_confidence: float | None = None

    # ----- the Cache interface generate relies on ------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.sequence.num_computed

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        return self.sequence.num_computed + query_length, 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # The attention function stores and reads the entries itself; it needs only the new ones.
        return key_states, value_states

    def __len__(self) -> int:
        return self.store.num_layers if self.store else 0

    @property
    def is_compileable(self) -> bool:
        return False

    # ----- use ------------------------------------------------------------------------------
    def generate(self, model: PreTrainedModel, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """`model.generate(input_ids, cache=self, ...)` while attached (batch 1)."""
        if input_ids.shape[0] != 1:
            raise ValueError("DynamicKVCompressor handles one sequence (batch size 1)")
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(self)
        with self.attached(model):
            return model.generate(input_ids, **{cache_keyword(model): self}, logits_processor=processors, **kwargs)

    @contextmanager
    def attached(self, model: PreTrainedModel) -> Iterator[DynamicKVCompressor]:
        """Route the model's attention through the compressed store while inside the block."""
        self._reset(model)
        previous = model.config._attn_implementation
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
        handle = model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        try:
            yield self
        finally:
            handle.remove()
            model.set_attn_implementation(previous)

    def metrics(self) -> CompressionMetrics:
        """compression_metrics of the sequence so far, as the server reports them."""
        return self.compressor.metrics(SEQ_ID, self.sequence.num_computed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """As a logits processor: note the model's confidence in its next token; scores unchanged."""
        self._pending_confidence = float(scores[0].float().softmax(-1).max())
        return scores

    # ----- internals ------------------------------------------------------------------------
    def _reset(self, model: PreTrainedModel) -> None:
        self.store = KVStore.for_model(
            model,
            parse_size(self.max_cache_size, memory_for_cache(next(model.parameters()).device)),
            self.config.key_only_value_bits,
            self.future_value.history_steps if self.future_value else 0,
            self.config.key_rotation,
        )
        if self.calibrations is None:
            self.calibrations = calibrations_for(self.future_value, model.config, self.config.prediction_window)
        self.compressor = Compressor(
            self.store, future_value=self.future_value, calibrations=self.calibrations, word_starts=self.word_starts
        )
        self.sequence = _Sequence()
        self.store.set_storage(SEQ_ID, self.params.kv_cache_dtype)
        self._pending_confidence = None

    def _before_forward(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if kwargs.get("past_key_values", kwargs.get("cache")) is not self:
            return args, kwargs
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None or input_ids.shape[0] != 1:
            raise ValueError("DynamicKVCompressor handles one sequence given as input_ids (batch size 1)")
        seq = self.sequence
        new = input_ids[0].tolist()
        if not seq.token_ids:
            self.compressor.register(SEQ_ID, self.params, len(new))
            seq.token_ids = list(new)
        else:
            # The previous pass is complete: its step ends here, and compression may be due.
            confidence = {} if self._pending_confidence is None else {SEQ_ID: self._pending_confidence}
            seq.token_ids.extend(new)
            self.compressor.after_step([seq], confidence)
            failed = self.compressor.take_failures()
            if failed:  # in a library one sequence is the whole run: stop it, with why
                raise RuntimeError(failed[SEQ_ID])
        start = seq.num_computed
        positions = torch.arange(start, start + len(new), device=input_ids.device)
        self.store.reserve(SEQ_ID, len(new))
        step = _Step(SEQ_ID, new)
        self.compressor.prepare([step])
        segment = Segment(SEQ_ID, 0, len(new), step.observe, step.audit)
        kwargs["packed_batch"] = PackedBatch(self.store, [segment], positions, self.compressor)
        kwargs["position_ids"] = positions.unsqueeze(0)
        seq.num_computed += len(new)
        return args, kwargs


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword the model's forward and generate take a cache by: `cache` in transformers 5.24
    (where `past_key_values` is deprecated), `past_key_values` in 5.17, which has no `cache`."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
