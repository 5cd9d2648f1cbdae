"""Prompt log-probabilities (`prompt_logprobs`): the model's own, from the request's prefill, in
chunks, each prompt token once; a request that asks for no token only prefills."""

from __future__ import annotations

import pytest
import torch

from confkv.engine.llm_engine import run_to_completion
from confkv.engine.sequence import FinishReason
from tests.helpers import greedy, make_engine, tokens_of

# fp32 on the CPU: our packed prefill against transformers' own attention, summed in another order.
TOLERANCE = 1e-4
TEXT = (
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He lit the lamp, wound the "
    "clockwork that turned the lens, and wrote the weather into a book whose pages had gone yellow with salt. "
    "Ships he would never meet passed in the dark, guided by a light he tended alone."
)


@torch.inference_mode()
def reference(model, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities [len(ids), vocab] of the next token at each position."""
    logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer(TEXT).input_ids


def scored(model, tokenizer, prompt: list[int], chunk: int, compression: dict | None = None, top: int = 3):
    """One request's outputs, asking for its prompt's log-probabilities, prefilled `chunk` tokens a step."""
    engine = make_engine(model, tokenizer, compression=compression, max_num_batched_tokens=chunk)
    engine.add_request("r", prompt, greedy(4, prompt_logprobs=top))
    outputs = run_to_completion(engine)["r"]
    assert len(tokens_of(outputs)) == 4 and engine.store.used_bytes == 0
    assert all(out.prompt_logprobs is None for out in outputs[1:]), "reported once, on the first output"
    return outputs


def test_prompt_logprobs_equal_transformers_over_chunked_prefill(default_model, tokenizer, prompt):
    """Every prompt token after the first gets the log-probability transformers gives it, its rank and the
    likeliest tokens, whether the prompt is prefilled in one chunk or in many."""
    want = reference(default_model, prompt)
    targets = torch.tensor(prompt[1:])
    expected = want[:-1].gather(1, targets[:, None])[:, 0]
    for chunk in (512, 24):
        reports = scored(default_model, tokenizer, prompt, chunk)[0].prompt_logprobs
        assert [r.token_id for r in reports] == prompt[1:]
        got = torch.tensor([r.logprob for r in reports])
        torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)
        # The rank is the reference's, up to tokens within the tolerance of the prompt token's.
        lowest = (want[:-1] > expected[:, None] + TOLERANCE).sum(dim=-1) + 1
        highest = (want[:-1] > expected[:, None] - TOLERANCE).sum(dim=-1) + 1
        assert all(lo <= r.rank <= hi for r, lo, hi in zip(reports, lowest.tolist(), highest.tolist(), strict=True))
        for report, row in zip(reports, want[:-1], strict=True):
            best = row.topk(3)
            assert len(report.top) == 3
            torch.testing.assert_close(torch.tensor([v for _, v in report.top]), best.values, atol=TOLERANCE, rtol=0)


def test_prompt_logprobs_are_of_the_requests_storage_precision(default_model, tokenizer, prompt):
    """No entry is dropped before the prompt is prefilled, but its keys and values lie at the request's
    storage format from the first chunk on: at int8 the log-probabilities are the model's over an int8
    cache, near transformers' own (in one chunk or many), not equal to them."""
    int8 = {"policy": "dynamic", "compression_rate": 0.6, "kv_cache_dtype": "int8"}
    exact = reference(default_model, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    for chunk in (512, 24):
        reports = scored(default_model, tokenizer, prompt, chunk, int8)[0].prompt_logprobs
        difference = (torch.tensor([r.logprob for r in reports]) - exact).abs()
        assert TOLERANCE < difference.max() < 0.25 and difference.mean() < 0.05, difference


def test_only_the_requests_that_ask_pay_for_prompt_logits(default_model, tokenizer, prompt):
    """Beside a request that asks, another's output is the same as alone and carries none."""
    alone = make_engine(default_model, tokenizer)
    alone.add_request("b", prompt[:40], greedy(6))
    want = tokens_of(run_to_completion(alone)["b"])
    engine = make_engine(default_model, tokenizer, max_num_batched_tokens=32)
    engine.add_request("a", prompt, greedy(6, prompt_logprobs=0))
    engine.add_request("b", prompt[:40], greedy(6))
    outputs = run_to_completion(engine)
    assert tokens_of(outputs["b"]) == want
    assert all(out.prompt_logprobs is None for out in outputs["b"])
    assert len(outputs["a"][0].prompt_logprobs) == len(prompt) - 1
    assert all(r.top == [] for r in outputs["a"][0].prompt_logprobs)


def test_max_tokens_zero_only_prefills(default_model, tokenizer, prompt):
    engine = make_engine(default_model, tokenizer)
    engine.add_request("r", prompt, greedy(0, prompt_logprobs=1))
    (out,) = run_to_completion(engine)["r"]
    assert out.finished and out.finish_reason == FinishReason.LENGTH and out.error is None
    assert out.new_token_ids == [] and out.completion_tokens == 0 and len(out.prompt_logprobs) == len(prompt) - 1
    assert engine.store.used_bytes == 0


def test_a_request_asking_for_prompt_logprobs_reuses_no_prefix(default_model, tokenizer, prompt):
    """The prefix cache would skip computing the reused tokens, and with them their log-probabilities."""
    engine = make_engine(default_model, tokenizer, prefix_cache=True)
    engine.add_request("first", prompt, greedy(2))
    run_to_completion(engine)
    engine.add_request("scored", prompt, greedy(2, prompt_logprobs=0))
    scored = run_to_completion(engine)["scored"]
    assert scored[-1].cached_prompt_tokens == 0 and len(scored[0].prompt_logprobs) == len(prompt) - 1
    engine.add_request("again", prompt, greedy(2))
    assert run_to_completion(engine)["again"][-1].cached_prompt_tokens > 0, "others still reuse it"
    assert engine.prefix_cache.queries == 2  # the scored request did not look


def test_a_preempted_prefill_reports_each_prompt_token_once(default_model, tokenizer, prompt):
    """Preempted halfway through its prefill, a request computes its prompt again; the tokens it had
    reported are not reported twice, and the rest are the same."""
    engine = make_engine(default_model, tokenizer, max_num_batched_tokens=16)
    seq = engine.add_request("r", prompt, greedy(2, prompt_logprobs=0))
    engine.step()
    engine.step()
    reported = len(seq.prompt_logprobs)
    assert 0 < reported < len(prompt) - 1
    engine.scheduler._preempt(seq)
    outputs = run_to_completion(engine)["r"]
    assert seq.num_computed >= len(prompt) and engine.store.used_bytes == 0
    want = reference(default_model, prompt)[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    got = torch.tensor([r.logprob for r in outputs[0].prompt_logprobs])
    torch.testing.assert_close(got, want, atol=TOLERANCE, rtol=0)
