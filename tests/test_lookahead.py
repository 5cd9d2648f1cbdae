"""Looking ahead (`lookahead_tokens`): greedy tokens decoded on the uncompressed cache at the end of
prefill, observed by the first compression, then forgotten."""

from __future__ import annotations

import random

import pytest

from confkv.compress.config import InvalidCompression, resolve
from confkv.compress.scoring import make_policy
from confkv.engine.llm_engine import run_to_completion
from tests.helpers import greedy, make_engine, tiny_model, tokens_of

SETTINGS = {"sink_tokens": 4, "recent_window": 16, "compression_interval": 8, "observation_window": 16}
PROMPT = 300


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)


def prompt(tokenizer) -> list[int]:
    rng = random.Random(5)
    return [rng.randrange(3, len(tokenizer)) for _ in range(PROMPT)]


def start(engine, ids, lookahead: int, rate: float, storage: str = "auto"):
    request = {"compression_rate": rate, "kv_cache_dtype": storage, "lookahead_tokens": lookahead}
    params = resolve(engine.compression_config, request, True, True)
    return engine.add_request("r", ids, greedy(20, ignore_eos=True), params)


@pytest.mark.parametrize("storage", ["auto", "int8", "kivi4"])
def test_looked_ahead_tokens_are_forgotten_before_the_answer_goes_on(model, tokenizer, storage):
    """At rate 0 nothing is dropped, so the answer must be the one without looking ahead: any entry of a
    looked-ahead token left in the cache (or a position taken twice) would change it."""
    answers = {}
    for lookahead in (0, 6):
        engine = make_engine(model, tokenizer, compression=SETTINGS)
        seq = start(engine, prompt(tokenizer), lookahead, 0.0, storage)
        first = engine.step()  # the prompt, the looking ahead, the first compression
        assert [engine.store.seq_length(seq.seq_id, layer) for layer in range(engine.store.num_layers)] == [PROMPT] * 2
        answers[lookahead] = tokens_of(first) + tokens_of(run_to_completion(engine)["r"])
        assert engine.store.used_bytes == 0
        assert sum(engine.store.evicted_entries.values()) == 0  # forgetting them is not an eviction
    assert len(answers[6]) == 20
    assert answers[6] == answers[0]


def test_the_first_compression_sees_the_looked_ahead_attention(model, tokenizer):
    """The first compression's observed attention is the prompt window's, decayed once per looked-ahead
    query, plus what each of those queries paid the prompt's entries (theirs are forgotten)."""
    engine = make_engine(model, tokenizer, compression=SETTINGS)
    window, decay = SETTINGS["observation_window"], make_policy("dynamic").decay
    masses = []  # layer 0: each observation's attention on the prompt's entries

    def observed(seq_id, layer, rows):
        if layer == 0:
            masses.append(float(rows[:, :PROMPT].sum()))

    at_first = []

    def compressed(seq_id, num_tokens, state):
        kv = engine.store.layer(seq_id, 0)
        at_first.append(float(kv.attention[: kv.length].sum()))

    engine.compression.hooks.observed.append(observed)
    engine.compression.hooks.compressed.append(compressed)
    start(engine, prompt(tokenizer), 6, 0.0)  # nothing dropped: all of the mass stays in view
    engine.step()
    assert len(masses) == 7 and masses[0] == pytest.approx(window, rel=1e-4)  # the window, then 6 queries
    expected = 0.0
    for mass in masses:
        expected = decay * expected + mass
    assert at_first == [pytest.approx(expected, rel=1e-4)]
    assert expected > window * decay**6 + 5.0  # the looked-ahead queries looked mostly at the prompt


def test_a_failed_look_ahead_leaves_the_request_answering(model, tokenizer):
    expected = None
    for fail in (False, True):
        engine = make_engine(model, tokenizer, compression=SETTINGS)
        forwards = []

        def fail_the_look_ahead(chunks, logits, forwards=forwards, fail=fail):
            forwards.append(len(chunks))
            if fail and len(forwards) == 3:  # the prompt, then two of the six looked-ahead tokens
                raise RuntimeError("the look-ahead's forward failed")

        engine.runner.after_forward.append(fail_the_look_ahead)
        start(engine, prompt(tokenizer), 6, 0.0)
        out = run_to_completion(engine)["r"]
        assert out[-1].finish_reason == "length"
        assert engine.store.used_bytes == 0
        expected = expected or tokens_of(out)
        assert tokens_of(out) == expected


def test_a_request_may_not_look_far_ahead(model, tokenizer):
    engine = make_engine(model, tokenizer, compression=SETTINGS)
    with pytest.raises(InvalidCompression) as refused:
        resolve(engine.compression_config, {"lookahead_tokens": 65}, True, False)
    assert refused.value.fields == ["compression.lookahead_tokens"]
