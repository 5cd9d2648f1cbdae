"""Log-probabilities as responses carry them: JSON has no infinity, so an impossible token's reads as
LOGPROB_FLOOR (vLLM's -9999.0); prompt log-probabilities in vLLM's `prompt_logprobs` shape."""

from __future__ import annotations

from collections.abc import Callable

from confkv.engine.sampler import TokenLogprob
from confkv.server.schemas import PromptLogprob, PromptLogprobs

LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def prompt_logprobs(reports: list[TokenLogprob], top: int, decode: Callable[[int], str]) -> PromptLogprobs:
    """One entry per prompt token: None for the first (nothing comes before it), then by token id the
    prompt token's and the `top` likeliest tokens' log-probabilities, ranks and texts."""
    entries: PromptLogprobs = [None]
    for report in reports:
        entry = {
            token: PromptLogprob(logprob=finite(value), rank=rank, decoded_token=decode(token))
            for rank, (token, value) in enumerate(report.top[:top], start=1)
        }
        entry[report.token_id] = PromptLogprob(
            logprob=finite(report.logprob), rank=report.rank, decoded_token=decode(report.token_id)
        )
        entries.append(entry)
    return entries
