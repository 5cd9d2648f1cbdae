"""Turns logits into tokens: greedy, temperature, top-k, top-p, min-p, repetition penalty, a
floor under the length (min_tokens), per-request seeds.

Besides the token it reports how sure the model was (the probability of the top token in the
distribution the token was drawn from), which the compressor uses as a signal, and,
for requests that ask, log-probabilities of the model's own distribution (before temperature and
cuts, as OpenAI's API reports them): of the tokens it samples, and of the prompt's own tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from confkv.engine.sequence import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their log-probabilities, best first
    rank: int | None = None  # 1 for the likeliest token (reported for prompt tokens)


@dataclass(frozen=True)
class History:
    """What the options that look back need of a row's request."""

    token_ids: list[int]  # prompt and output so far
    num_generated: int
    end_ids: frozenset[int]  # the tokens that would end it: EOS (unless ignored) and its stop_token_ids


@dataclass
class SampleOutput:
    token_id: int | None  # None when sampling failed for this row
    top_prob: float
    error: str | None = None
    logprob: TokenLogprob | None = None  # only when the request asked for logprobs


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    histories: list[History] | None = None,
) -> list[SampleOutput]:
    """Sample one token per row of `logits` [n, vocab] (fp32); `histories` (one per row) where a
    request's repetition penalty or min_tokens need them."""
    temperatures = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
    finite = torch.isfinite(logits).all(dim=-1)
    shaped = _shaped(logits, params, histories) if histories is not None else logits
    logprobs = torch.log_softmax(shaped / temperatures.unsqueeze(1), dim=-1)
    finite &= ~torch.isnan(logprobs).any(dim=-1)  # a penalty or temperature that overflowed the logits
    probs = logprobs.exp()
    top_prob, greedy_ids = probs.max(dim=-1)
    # One transfer for the whole batch; the per-row work below stays on the host.
    finite, top_prob, greedy_ids = (t.cpu() for t in (finite, top_prob, greedy_ids))

    outputs = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=False)):
        if not finite[row]:
            outputs.append(SampleOutput(None, 0.0, "non-finite logits (the model's, or after the penalties)"))
            continue
        try:
            token = int(greedy_ids[row]) if p.greedy else _draw(logprobs[row], p, gen)
        except RuntimeError as exc:  # this request fails alone; the others in the batch go on
            outputs.append(SampleOutput(None, 0.0, f"sampling failed: {exc}"))
            continue
        report = _logprob(logits[row], token, p.logprobs) if p.logprobs is not None else None
        outputs.append(SampleOutput(token, float(top_prob[row]), logprob=report))
    return outputs


def _shaped(logits: torch.Tensor, params: list[SamplingParams], histories: list[History]) -> torch.Tensor:
    """The logits the rows' penalties and length floors leave (a copy, where any applies): tokens seen
    so far divided (or, when negative, multiplied) by the repetition penalty, as CTRL and vLLM do; the
    tokens that would end a request below its min_tokens removed."""
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0 or histories[i].num_generated < p.min_tokens]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        p, history = params[i], histories[i]
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(history.token_ids)), device=logits.device)
            values = logits[i, seen]
            logits[i, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if history.num_generated < p.min_tokens and history.end_ids:
            logits[i, sorted(history.end_ids)] = float("-inf")
    return logits


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    raw = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(raw, top) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist(), strict=True)) if best is not None else []
    return TokenLogprob(token, float(raw[token]), alternatives)


def prompt_logprobs(logits: torch.Tensor, targets: list[int], top: int) -> list[TokenLogprob]:
    """The log-probability each row of `logits` [n, vocab] gives its target, the next prompt token, with
    its rank and the `top` likeliest tokens: the model's own distribution, as for sampled tokens."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    index = torch.tensor(targets, device=raw.device).unsqueeze(1)
    values = raw.gather(1, index)
    ranks = (raw > values).sum(dim=-1) + 1
    best = torch.topk(raw, top, dim=-1) if top else None
    values, ranks = values[:, 0].tolist(), ranks.tolist()
    alternatives = (
        [list(zip(i, v, strict=True)) for i, v in zip(best.indices.tolist(), best.values.tolist(), strict=True)]
        if best is not None
        else [[] for _ in targets]
    )
    return [
        TokenLogprob(token, value, others, rank)
        for token, value, others, rank in zip(targets, values, alternatives, ranks, strict=True)
    ]


def _draw(logprobs: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> int:
    """Draw from the temperature-scaled distribution after top-k, top-p and min-p cuts."""
    logprobs = logprobs.cpu()
    if p.min_p > 0.0:
        logprobs = logprobs.masked_fill(logprobs < logprobs.max() + math.log(p.min_p), float("-inf"))
    if p.top_k > 0 and p.top_k < logprobs.numel():
        kth = torch.topk(logprobs, p.top_k).values[-1]
        logprobs = logprobs.masked_fill(logprobs < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_lp, order = torch.sort(logprobs, descending=True)
        cumulative = sorted_lp.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - sorted_lp.softmax(-1) >= p.top_p
        drop[0] = False  # also when top_p rounds to 0 in fp32
        logprobs = logprobs.scatter(0, order[drop], float("-inf"))
    probs = logprobs.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
