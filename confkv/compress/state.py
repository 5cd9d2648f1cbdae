"""What the compressor keeps of each sequence, what it reads of the engine's, and what it reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch

from confkv.compress.config import CompressionParams
from confkv.compress.history import TierHistory
from confkv.compress.predictor.misses import Dropped
from confkv.compress.predictor.online import Forecast
from confkv.compress.scoring import ScorePolicy
from confkv.kv.block_tables import Keep


class TrackedSequence(Protocol):
    """What the compressor reads of a sequence."""

    seq_id: int
    num_computed: int  # tokens whose KV has been computed
    token_ids: list[int]  # prompt and generated tokens


class MarkedChunk(Protocol):
    """What the compressor reads and marks of a chunk scheduled for the forward pass."""

    seq_id: int
    token_ids: list[int]  # the chunk's tokens (one for a decode step)
    needs_logits: bool  # the chunk ends its sequence's known tokens (the end of prefill, or a decode step)
    observe: int  # set here: how many of its last queries' attention to observe
    audit: bool  # set here: measure the attention its dropped keys would get


@dataclass
class CompressionMetrics:
    """Per-request figures: a response's `compression_metrics` (docs/compression.md defines each field)."""

    original_size: int
    compressed_size: int
    ceiling_size: int
    compression_ratio: float
    mean_compression_ratio: float
    hit_rate: float
    prefix_parked: str | None
    recall_rate: float
    entries: dict[str, int]
    policy: str
    compression_time_ms: float


@dataclass
class SequenceState:
    params: CompressionParams
    policy: ScorePolicy | None  # None: the request does not compress (nothing is observed or scored)
    prompt_len: int
    prefilled: bool = False
    steps_since_compression: int = 0
    decode_steps: int = 0
    seconds: float = 0.0
    pressure_rate: float = 0.0  # raised under memory pressure, never lowered (dropped entries do not return)
    recall_sum: float = 0.0
    recall_count: int = 0
    ratio_sum: float = 0.0  # compression_ratio after each decode step, summed (with `stats` only)
    ratio_steps: int = 0
    audit: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> dropped keys
    misses: dict[int, Dropped] = field(default_factory=dict)  # layer -> dropped entries the predictor ranked
    confidences: list[float] = field(default_factory=list)  # top-token probability of each generated token
    predictions: int = 0  # compressions the value predictor ran for
    judged_until: int = 0  # entries below this position were kept by an earlier compression
    compressions: int = 0  # compressions run (due or forced), whether or not they changed anything
    content_bytes_per_token: float | None = None  # per layer: what the thresholds kept at their last judgment
    layer_weights: torch.Tensor | None = None  # adaptive layer budgets: each layer's share (mean 1), when scored
    history: TierHistory | None = None  # each compression's tiers, for requests that ask (`inspect`)
    spans: torch.Tensor | None = None  # the span of each position (`retention_unit`), as of the last compression
    error: str | None = None  # why its compression failed: it is no longer compressed, and its request ends

    @cached_property
    def observation_group(self) -> str:
        """Sequences whose policies are alike fold their observations the same way: one update per
        group and layer (computed once: a repr per sequence, layer and step cost about 1% of a decode step)."""
        return repr(self.policy)

    @property
    def rate(self) -> float:
        """The share of bytes to remove: the request's rate, or the pressure's if higher."""
        return max(self.params.compression_rate, self.pressure_rate)

    @property
    def observed_prompt_queries(self) -> int:
        """Prompt queries whose attention the end-of-prefill compression observes (0: none)."""
        if not self.params.active or not self.policy.uses_attention:
            return 0
        return self.policy.observation_window or self.params.observation_window

    def reset_cache_state(self) -> None:
        """After preemption the cache is rebuilt from scratch."""
        self.prefilled = False
        self.steps_since_compression = 0
        self.audit.clear()
        self.misses.clear()
        self.predictions = 0
        self.judged_until = 0
        self.compressions = 0
        self.content_bytes_per_token = None
        self.layer_weights = None
        if self.history is not None:
            self.history.clear()


@dataclass
class CompressionPlan:
    """One sequence's compression as decided (`Compressor.plan`), before it is applied (`Compressor.apply`)."""

    seq_id: int
    num_tokens: int  # tokens computed when it was decided
    state: SequenceState
    keep: dict[int, Keep] = field(default_factory=dict)  # the layers that change -> what each keeps
    # Audited layers -> (the entries it drops, their keys), read before compaction lets them go.
    dropped: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    predicted: dict[int, Forecast] | None = None  # the forecasts it was decided on, by layer
    seconds: float = 0.0  # spent deciding it (its share of a batched prediction included)


@dataclass
class CompressionHooks:
    """Callbacks, called in the order added, for tests and trace collection (serving adds none, and
    then they cost nothing)."""

    # After each compression of a sequence, due or forced by memory pressure, whether or not it
    # changed anything: (seq_id, tokens computed, its state).
    compressed: list[Callable[[int, int, SequenceState], None]] = field(default_factory=list)
    # After each observation of a sequence's attention is folded in: (seq_id, layer, rows [observed
    # queries, held entries]), the attention each held entry received from each query.
    observed: list[Callable[[int, int, torch.Tensor], None]] = field(default_factory=list)
    # After each step's sampling: the top-token probability of each sequence that sampled, by seq_id.
    sampled: list[Callable[[dict[int, float]], None]] = field(default_factory=list)
