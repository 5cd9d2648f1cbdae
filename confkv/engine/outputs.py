"""What the clients get: each request's outputs, its text detokenised as its tokens arrive.

It listens to the scheduler: a sequence that finishes, for whatever reason (an abort too), gets
its final output there, with the text held back so far and its compression metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tokenizers import Tokenizer

from confkv.compress.history import TierHistory
from confkv.engine.detokenizer import IncrementalDetokenizer
from confkv.engine.sampler import TokenLogprob
from confkv.engine.sequence import Sequence


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    delta_text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0
    error: str | None = None
    compression_metrics: dict | None = None
    tier_history: TierHistory | None = None  # on the final output of a request that asked (`inspect`)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of new_token_ids, when asked for
    # Of prompt tokens 1.. (the first has none), on a request's first output when it asked for them.
    prompt_logprobs: list[TokenLogprob] | None = None


class Outputs:
    """The requests in flight, and the outputs made for them since the last `drain()`, in order."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, Sequence] = {}
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self._last_token: dict[int, tuple[list[int], list[TokenLogprob]]] = {}  # sent with the final output
        self._prompt_reported: set[int] = set()  # sequences whose prompt log-probabilities went out
        self._outputs: list[RequestOutput] = []

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        p = seq.params
        self.detokenizers[seq.seq_id] = IncrementalDetokenizer(
            self.tokenizer, p.stop, p.include_stop_str_in_output, p.skip_special_tokens
        )

    def detokenize(self, seq: Sequence, token: int) -> bool:
        """Add a generated token to the text; True when a stop string ended it (once min_tokens are out)."""
        return self.detokenizers[seq.seq_id].add(token, len(seq.output_token_ids) >= seq.params.min_tokens)

    def emit(self, seq: Sequence, token: int, logprobs: list[TokenLogprob]) -> None:
        """A new token of a sequence that goes on."""
        self._outputs.append(self._output(seq, [token], logprobs, final=False))

    def hold_last(self, seq: Sequence, token: int, logprobs: list[TokenLogprob]) -> None:
        """The token that ends a sequence: it goes out with the final output as the sequence finishes."""
        self._last_token[seq.seq_id] = ([token], logprobs)

    def drain(self) -> list[RequestOutput]:
        """The outputs made since the last call."""
        drained, self._outputs = self._outputs, []
        return drained

    # ----- as a scheduler listener -------------------------------------------------------
    def finished(self, seq: Sequence) -> None:
        tokens, logprobs = self._last_token.pop(seq.seq_id, ([], []))
        self._outputs.append(self._output(seq, tokens, logprobs, final=True))
        del self.detokenizers[seq.seq_id]
        del self.requests[seq.request_id]
        self._prompt_reported.discard(seq.seq_id)

    def preempted(self, seq: Sequence) -> None:
        """Nothing to do: its tokens and text so far stand, only its KV is recomputed."""

    # ----- internals ---------------------------------------------------------------------
    def _output(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprob], final: bool) -> RequestOutput:
        metrics = seq.compression_metrics if final else None
        prompt_logprobs = None
        if seq.params.prompt_logprobs is not None and seq.seq_id not in self._prompt_reported:
            self._prompt_reported.add(seq.seq_id)
            prompt_logprobs = seq.prompt_logprobs
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=tokens,
            delta_text=self.detokenizers[seq.seq_id].delta(final),
            finished=final,
            finish_reason=seq.finish_reason.value if final and seq.finish_reason else None,
            prompt_tokens=seq.num_prompt_tokens,
            completion_tokens=len(seq.output_token_ids),
            cached_prompt_tokens=seq.num_cached_tokens,
            error=seq.error,
            compression_metrics=asdict(metrics) if metrics is not None else None,
            tier_history=seq.tier_history if final else None,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
