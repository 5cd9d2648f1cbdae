"""A request as the engine sees it: its tokens, sampling parameters and progress."""

from __future__ import annotations

import itertools
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import TYPE_CHECKING

import torch

from confkv.compress.history import TierHistory
from confkv.compress.state import CompressionMetrics

if TYPE_CHECKING:
    from confkv.engine.sampler import TokenLogprob

# Below this temperature sampling is greedy: dividing fp32 logits by a smaller one overflows to inf
# (vLLM's _SAMPLING_EPS), and the distribution is a point mass anyway.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128  # 0: the prompt is only prefilled (for its prompt_logprobs)
    temperature: float = 1.0  # 0 (below GREEDY_BELOW) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # report the sampled token's log-probability and this many alternatives
    # Report each prompt token's log-probability (all but the first) and this many alternatives, from the
    # request's own prefill: such a request reuses no prefix-cache entry, so every prompt token is computed.
    prompt_logprobs: int | None = None
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    repetition_penalty: float = 1.0  # above 1, tokens of the prompt or output so far become less likely
    min_tokens: int = 0  # before this many tokens, nothing that would end the request is sampled or matched
    stop_token_ids: tuple[int, ...] = ()  # tokens that end the request, like EOS
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    deadline: float | None = None  # time.monotonic() after which the request ends with TIMEOUT

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled, e.g. the client went away
    TIMEOUT = "timeout"  # its deadline passed
    ERROR = "error"  # failed inside the engine


_ids = itertools.count()


@dataclass
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(init=False)
    num_computed: int = 0  # tokens whose KV is in the store (or were, before eviction)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefix_parked: str | None = None  # how the reused prefix-cache entry was parked (prefix_cache.PARKED)
    prefill_tail: int = 1  # tokens its last prefill chunk computes: the queries its compression observes
    prefix_fingerprint: Hashable = None  # the compression settings its KV is built under
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    compression_metrics: CompressionMetrics | None = None  # its figures as it finished, for its final output
    tier_history: TierHistory | None = None  # what compression did, when the request asked (`inspect`)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.., when asked for
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    overtaken: int = 0  # sequences admitted ahead of it while it waited for memory
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        # A private generator per request: the same seed gives the same text whatever runs beside it.
        self.generator = torch.Generator()
        if self.params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.params.seed)

    def restart(self) -> None:
        """Its KV is gone (preempted, or a prefix copy it could not keep): compute it again from the start."""
        self.num_computed = 0
        self.num_cached_tokens = 0
        self.prefix_parked = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class ScheduledChunk:
    """The tokens of a sequence, from position `start`, that run in this step."""

    seq_id: int
    token_ids: list[int]
    start: int
    needs_logits: bool  # the chunk reaches the sequence's last known token: sample from it
    # Positions whose logits score the next prompt token (the request asked for prompt_logprobs): each once,
    # also when a preempted sequence computes its prompt again.
    prompt_positions: range = range(0)
    observe: int = 0  # last queries whose attention the compressor observes (confkv.kv.attention.Segment)
    audit: bool = False  # measure the attention its sequence's dropped keys would get
