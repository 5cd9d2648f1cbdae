"""Greedy output of the batched engine equals transformers `generate` run one request at a time."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from tests.helpers import greedy, make_engine, reference_greedy, tiny_model, tokens_of

NEAR_TIE = 1e-4


def run_staggered(engine, prompts: list[list[int]], max_tokens: int, arrivals: list[int]):
    """Add request i before step arrivals[i]; capture the logits the engine sampled from."""
    logits_by_seq: dict[int, list[torch.Tensor]] = defaultdict(list)

    def capture(chunks, logits):
        for chunk, row in zip([c for c in chunks if c.needs_logits], logits, strict=False):
            logits_by_seq[chunk.seq_id].append(row.clone())

    engine.runner.after_forward.append(capture)
    seqs, outputs = {}, defaultdict(list)
    step = 0
    while len(seqs) < len(prompts) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if at == step and i not in seqs:
                seqs[i] = engine.add_request(str(i), prompts[i], greedy(max_tokens, ignore_eos=True))
        for out in engine.step():
            outputs[int(out.request_id)].append(out)
        step += 1
    return [(tokens_of(outputs[i]), logits_by_seq[seqs[i].seq_id]) for i in range(len(prompts))]


def assert_same_greedy(got: list[int], got_logits, want: list[int], want_logits: torch.Tensor) -> None:
    """Tokens must be identical; only where the reference's top-two margin is a near-tie may they
    differ, and then the logits at that step must agree within tolerance (the rest diverges)."""
    assert len(got) == len(want)
    for t, (a, b) in enumerate(zip(got, want, strict=False)):
        if a == b:
            continue
        top2 = want_logits[t].topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin < NEAR_TIE, f"token {t}: engine {a} vs generate {b} with a clear margin {margin:.2e}"
        torch.testing.assert_close(got_logits[t], want_logits[t], atol=NEAR_TIE * 10, rtol=0)
        return


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt2"])
def test_tiny_models_match_generate(family, tokenizer):
    model = tiny_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    rng = random.Random(family)
    lengths = [3, 40, 17, 90, 1, 64, 25]
    prompts = [[rng.randrange(3, len(tokenizer)) for _ in range(n)] for n in lengths]
    # A small token budget forces chunked prefill beside running decodes.
    engine = make_engine(model, tokenizer, max_num_batched_tokens=32)
    results = run_staggered(engine, prompts, max_tokens=12, arrivals=[0, 0, 0, 3, 5, 5, 9])
    for prompt, (got, got_logits) in zip(prompts, results, strict=False):
        want, want_logits = reference_greedy(model, prompt, 12)
        assert_same_greedy(got, got_logits, want, want_logits)
    assert engine.store.used_bytes == 0


@pytest.mark.slow
def test_default_model_matches_generate(default_model, tokenizer):
    texts = [
        "The capital of France is",
        "Write a haiku about the sea.",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who",
        "List three primary colors:",
        "Water boils at",
    ]
    prompts = [tokenizer(t).input_ids for t in texts]
    engine = make_engine(default_model, tokenizer, max_num_batched_tokens=16)
    results = run_staggered(engine, prompts, max_tokens=16, arrivals=[0, 0, 2, 2, 6, 11])
    for prompt, (got, got_logits) in zip(prompts, results, strict=False):
        want, want_logits = reference_greedy(default_model, prompt, 16)
        assert_same_greedy(got, got_logits, want, want_logits)
    assert engine.store.used_bytes == 0
