"""Greedy output of the batched engine equals transformers `generate` run one request at a time."""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
import torch

from confkv.compress.config import resolve
from confkv.engine.llm_engine import run_to_completion
from confkv.engine.sequence import FinishReason
from confkv.models.loader import FAMILIES
from tests.helpers import COMPRESS_OFTEN, greedy, make_engine, reference_greedy, tiny_model, tokens_of

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


def family_prompts(family: str, tokenizer) -> list[list[int]]:
    rng = random.Random(family)
    return [[rng.randrange(3, len(tokenizer)) for _ in range(n)] for n in (3, 40, 17, 90, 1, 64, 25)]


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_of_every_family_served_match_generate(family, tokenizer):
    """Every family the loader serves, through chunked prefill beside running decodes (a small token
    budget) and then from the prefix cache (the same prompts, longer)."""
    model = tiny_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer, max_num_batched_tokens=32, prefix_cache=True)
    prompts = family_prompts(family, tokenizer)
    again = [prompt + prompt[:7] for prompt in prompts[1:]]
    for batch in (prompts, again):
        results = run_staggered(engine, batch, max_tokens=12, arrivals=[0, 0, 0, 3, 5, 5, 9][: len(batch)])
        for prompt, (got, got_logits) in zip(batch, results, strict=True):
            want, want_logits = reference_greedy(model, prompt, 12)
            assert_same_greedy(got, got_logits, want, want_logits)
    assert engine.prefix_cache.hits >= len(again) - 1  # the 1-token prompt parks nothing worth a hit
    assert engine.store.used_bytes == engine.snapshot().kv_bytes["prefix"]  # only what is parked


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_served_compresses_and_gives_its_memory_back(family, tokenizer):
    """The default policy at a high rate on int8 storage: every request served whole, none failed."""
    model = tiny_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN, max_num_batched_tokens=32)
    params = resolve(engine.compression_config, {"compression_rate": 0.75, "kv_cache_dtype": "int8"}, True, True)
    for i, prompt in enumerate(family_prompts(family, tokenizer)):
        engine.add_request(str(i), prompt, greedy(24, ignore_eos=True), params)
    outputs = run_to_completion(engine)
    for request in outputs.values():
        assert len(tokens_of(request)) == 24 and request[-1].finish_reason == FinishReason.LENGTH
    dropped = [request[-1].compression_metrics["entries"]["dropped"] for request in outputs.values()]
    assert max(dropped) > 0
    assert engine.store.used_bytes == 0


@pytest.mark.parametrize("family", ["gemma3_text", "mistral"])
def test_sliding_window_layers_hold_their_window_and_decode_as_generate(family, tokenizer):
    """Past its window a sliding layer lets go of what it can no longer attend to, a block at a time,
    and decoding stays generate's; compression leaves it whole (its entries stay consecutive) and
    drops only in the layers that attend to everything."""
    model = tiny_model(family, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    window, prompt = model.config.sliding_window, family_prompts(family, tokenizer)[3]  # 90 tokens
    for compression in ({"policy": "none"}, {"compression_rate": 0.75, "kv_cache_dtype": "auto"}):
        engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN, max_num_batched_tokens=32)
        store = engine.store
        sliding = [layer for layer, w in enumerate(store.windows) if w]
        assert sliding and engine.max_model_len == model.config.max_position_embeddings
        params = resolve(engine.compression_config, compression, True, True)
        seq = engine.add_request("r", prompt, greedy(60, ignore_eos=True), params)
        outputs = []
        while engine.has_unfinished():
            outputs += engine.step()
            if seq.seq_id in store and seq.num_computed >= len(prompt):
                for layer in sliding:
                    positions = store.positions(seq.seq_id, layer)
                    assert window <= len(positions) < window + store.block_size
                    assert torch.equal(positions, torch.arange(seq.num_computed - len(positions), seq.num_computed))
        assert store.evicted_entries["window"] > 0 and store.used_bytes == engine.snapshot().kv_bytes["prefix"]
        if compression.get("policy") == "none":
            want, want_logits = reference_greedy(model, prompt, 60)
            assert tokens_of(outputs) == want, "decoding past the window left generate's tokens"
        else:
            assert store.evicted_entries["compression"] > 0 or family == "mistral"  # mistral: every layer slides


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
