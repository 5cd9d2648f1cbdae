"""Spans: a number, a UUID or a name is kept or dropped whole (`retention_unit`)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from confkv.compress.config import resolve
from confkv.compress.library import DynamicKVCompressor
from confkv.compress.spans import LONGEST_SPAN, pool_over_spans, span_ids, word_starts
from confkv.engine.llm_engine import run_to_completion
from tests.helpers import COMPRESS_OFTEN, greedy, make_engine, tiny_model


@pytest.fixture(scope="module")
def starts(tokenizer):
    return word_starts(tokenizer)


def words_of(tokenizer, starts, text: str) -> list[str]:
    ids = tokenizer(text)["input_ids"]
    spans = span_ids("word", ids, starts, 8).tolist()
    return [tokenizer.decode([t for t, s in zip(ids, spans, strict=True) if s == span]) for span in sorted(set(spans))]


def test_a_number_a_uuid_and_a_name_are_one_span_each(tokenizer, starts):
    text = "The pass key is 9746862. Its id: 3f2a9c1e-7b4d-4e8a-9c0f-1d2e3f4a5b6c, owner Bartholomew Okonkwo-Vasquez."
    words = words_of(tokenizer, starts, text)
    assert " 9746862." in words
    assert " 3f2a9c1e-7b4d-4e8a-9c0f-1d2e3f4a5b6c," in words
    assert " Okonkwo-Vasquez." in words and " Bartholomew" in words
    assert words[:3] == ["The", " pass", " key"]


def test_an_unbroken_run_is_cut_into_spans_of_at_most_the_longest(tokenizer, starts):
    ids = tokenizer(" " + "7" * 130)["input_ids"]
    spans = span_ids("word", ids, starts, 8)
    assert torch.bincount(spans).max() == LONGEST_SPAN and spans.max() == 2


def test_chunks_are_fixed_runs_of_positions_and_tokens_have_no_spans():
    assert span_ids("chunk", list(range(10)), None, 4).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]
    assert span_ids("token", list(range(10)), None, 4).tolist() == list(range(10))


@given(st.lists(st.tuples(st.integers(0, 6), st.floats(-10, 10)), min_size=1, max_size=40))
def test_an_entry_is_scored_as_the_best_entry_of_its_span(entries):
    spans = torch.tensor([s for s, _ in entries])
    scores = torch.tensor([v for _, v in entries])
    pooled = pool_over_spans(scores, spans)
    for i, span in enumerate(spans.tolist()):
        assert pooled[i] == scores[spans == span].max()


def numbered_prompt(tokenizer, n: int) -> list[int]:
    rng = random.Random(0)
    text = " ".join(f"Entry {i} holds code {rng.randrange(10**6, 10**9)}." for i in range(n))
    return tokenizer(text)["input_ids"]


def partial_spans(engine, seq_id, ids, starts, protected: int) -> int:
    """Words some of whose entries a layer holds and others not (the protected ends left out), over all layers."""
    spans = span_ids("word", ids, starts, 8)
    partial = 0
    for layer in range(engine.store.num_layers):
        held = torch.zeros(len(ids), dtype=torch.bool)
        positions = engine.store.positions(seq_id, layer).long()
        held[positions[positions < len(ids)]] = True
        for span in spans[protected : len(ids) - 2 * COMPRESS_OFTEN["recent_window"]].unique():
            members = held[spans == span]
            partial += bool(members.any() and not members.all())
    return partial


@pytest.mark.parametrize("unit", ["token", "word"])
def test_word_retention_keeps_or_drops_each_number_whole(tokenizer, starts, unit):
    """With random scores keeping 30% of the bytes, each entry on its own splits most numbers (and
    words); ranked by word, a layer splits at most the one word at its budget's margin at each
    compression."""
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    ids = numbered_prompt(tokenizer, 24)
    request = {"policy": "random", "compression_rate": 0.7, "kv_cache_dtype": "auto", "retention_unit": unit}
    params = resolve(engine.compression_config, request, True, False)
    engine.add_request("r", ids, greedy(10, ignore_eos=True), params)
    seen = {}
    engine.compression.hooks.compressed.append(
        lambda seq_id, n, state: seen.update(
            partial=partial_spans(engine, seq_id, ids, starts, 8), times=state.compressions
        )
    )
    run_to_completion(engine)
    margins = engine.store.num_layers * seen["times"]  # one word at each layer's margin, at each compression
    assert seen["partial"] <= margins if unit == "word" else seen["partial"] > 5 * margins


def test_the_library_asks_for_the_tokenizer_that_word_retention_needs():
    with pytest.raises(ValueError, match="tokenizer"):
        DynamicKVCompressor(retention_unit="word")


def test_the_library_keeps_words_whole_by_default_when_given_the_tokenizer_and_tokens_without_it(tokenizer):
    assert DynamicKVCompressor(tokenizer=tokenizer).params.retention_unit == "word"
    assert DynamicKVCompressor().params.retention_unit == "token"  # the seed's call, no tokenizer: still works
    assert DynamicKVCompressor(retention_unit="chunk").params.retention_unit == "chunk"
