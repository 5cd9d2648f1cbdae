from __future__ import annotations

import torch

from confkv.engine.sampler import History, sample
from confkv.engine.sequence import SamplingParams


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_greedy_takes_argmax_and_reports_confidence():
    logits = torch.tensor([[0.0, 5.0, 1.0], [2.0, 0.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0.0)] * 2, [gen(0), gen(0)])
    assert [o.token_id for o in out] == [1, 0]
    probs = logits.softmax(-1)
    assert abs(out[0].top_prob - float(probs[0].max())) < 1e-6
    assert abs(out[1].top_prob - float(probs[1].max())) < 1e-6


def test_same_seed_same_tokens_regardless_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    p = SamplingParams(temperature=1.0)
    alone = [sample(logits[2:3], [p], [gen(7)])[0].token_id for _ in range(3)]
    batched = sample(logits, [p] * 4, [gen(1), gen(2), gen(7), gen(3)])[2].token_id
    assert alone == [batched] * 3


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    g = gen(0)
    top_k = {sample(logits, [SamplingParams(temperature=5.0, top_k=2)], [g])[0].token_id for _ in range(200)}
    assert top_k == {0, 1}
    # probabilities at T=1: .64 .24 .09 ...; top_p 0.7 keeps the first two
    top_p = {sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)], [g])[0].token_id for _ in range(200)}
    assert top_p == {0, 1}


def test_non_finite_logits_fail_only_their_row():
    logits = torch.tensor([[0.0, float("nan")], [1.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0.0)] * 2, [gen(0), gen(0)])
    assert out[0].token_id is None and "non-finite" in out[0].error
    assert out[1].token_id == 0


def test_a_temperature_too_small_for_fp32_samples_greedily():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    out = sample(logits, [SamplingParams(temperature=1e-300)], [gen(0)])  # 0 in fp32: logits / 0 would be inf
    assert out[0].token_id == 1 and out[0].error is None


def test_a_top_p_too_small_for_fp32_keeps_the_most_likely_token():
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    out = sample(logits, [SamplingParams(temperature=1.0, top_p=1e-184)], [gen(0)])  # 0 in fp32
    assert out[0].token_id == 1 and out[0].error is None


def test_a_row_whose_draw_fails_fails_alone():
    # Finite logits that overflow once divided by the temperature: no distribution to draw from, found
    # before the draw.
    logits = torch.tensor([[3e38, -3e38, 0.0], [1.0, 0.0, 0.0]])
    out = sample(logits, [SamplingParams(temperature=0.5), SamplingParams(temperature=0.0)], [gen(0), gen(0)])
    assert out[0].token_id is None and "non-finite logits" in out[0].error
    assert out[1].token_id == 0 and out[1].error is None


def test_logprobs_are_the_models_own_before_temperature():
    torch.manual_seed(0)
    logits = torch.randn(2, 50)
    params = [SamplingParams(temperature=0.7, logprobs=3), SamplingParams(temperature=0.0)]
    out = sample(logits, params, [gen(0), gen(0)])
    raw = logits[0].log_softmax(-1)
    report = out[0].logprob
    assert report.token_id == out[0].token_id
    assert abs(report.logprob - float(raw[report.token_id])) < 1e-6
    assert [t for t, _ in report.top] == raw.topk(3).indices.tolist()
    assert out[1].logprob is None  # only requests that ask pay for it


def history(token_ids: list[int], generated: int = 0, end_ids: frozenset[int] = frozenset()) -> History:
    return History(token_ids, generated, end_ids)


def test_repetition_penalty_makes_seen_tokens_less_likely_whatever_their_sign():
    logits = torch.tensor([[2.0, 1.5, -1.0, -1.2]])
    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    assert sample(logits, [greedy], [gen(0)], [history([0])])[0].token_id == 1  # 2.0 / 2 < 1.5
    plain = sample(logits, [SamplingParams(temperature=0.0)], [gen(0)], [history([0])])[0].token_id
    assert plain == 0  # no penalty asked: the history changes nothing
    negative = torch.tensor([[-1.0, -1.2]])
    assert sample(negative, [greedy], [gen(0)], [history([0])])[0].token_id == 1  # -1.0 * 2 < -1.2


def test_below_min_tokens_nothing_that_would_end_the_request_is_sampled():
    logits = torch.tensor([[5.0, 1.0, 0.0]])  # token 0 (EOS here) is by far the likeliest
    p = SamplingParams(temperature=0.0, min_tokens=2)
    ends = frozenset({0})
    assert sample(logits, [p], [gen(0)], [history([7], generated=1, end_ids=ends)])[0].token_id == 1
    assert sample(logits, [p], [gen(0)], [history([7, 1], generated=2, end_ids=ends)])[0].token_id == 0


def test_min_p_keeps_only_tokens_near_the_likeliest():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])  # at T=1: 0.58, 0.35, 0.03, 0.01
    p, g = SamplingParams(temperature=1.0, min_p=0.5), gen(0)
    assert {sample(logits, [p], [g])[0].token_id for _ in range(200)} == {0, 1}
