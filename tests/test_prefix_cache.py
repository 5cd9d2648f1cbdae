"""The prefix cache in the engine: reuse that changes nothing, safe sharing, LRU-K under pressure."""

from __future__ import annotations

import random

import pytest

from confkv.compress.config import resolve
from confkv.engine.llm_engine import run_to_completion
from tests.helpers import COMPRESS_OFTEN, greedy, make_engine, tiny_model, tokens_of


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)


def ids(tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, len(tokenizer)) for _ in range(n)]


def run(engine, request_id: str, prompt: list[int], max_tokens: int = 12, **compression):
    params = resolve(engine.compression_config, compression or None, True, True)
    engine.add_request(request_id, prompt, greedy(max_tokens, ignore_eos=True), params)
    return run_to_completion(engine)[request_id]


def test_chat_turn_two_reuses_turn_one_and_gives_the_same_tokens(model, tokenizer):
    cached = make_engine(model, tokenizer, prefix_cache=True)
    turn1 = ids(tokenizer, 120, seed=1)
    answer = tokens_of(run(cached, "t1", turn1))
    turn2 = turn1 + answer + ids(tokenizer, 40, seed=2)
    out = run(cached, "t2", turn2)
    fresh = run(make_engine(model, tokenizer), "t2", turn2)
    assert tokens_of(out) == tokens_of(fresh)
    # Turn 1's KV covers its prompt and all but the last answer token (never fed back).
    assert out[-1].cached_prompt_tokens == len(turn1) + len(answer) - 1
    assert out[-1].compression_metrics["hit_rate"] == pytest.approx((len(turn1) + len(answer) - 1) / len(turn2))
    assert fresh[-1].cached_prompt_tokens == 0
    assert cached.prefix_cache.hits == 1 and len(cached.prefix_cache) == 1  # turn 2 superseded turn 1
    assert cached.store.used_bytes == cached.store.parked_bytes  # nothing running holds memory


def test_a_second_question_about_a_document_answers_as_a_fresh_request(model, tokenizer):
    """The first question's query-aware compression must not carry over: its prompt is parked before it."""
    compression = {"policy": "h2o", "compression_rate": 0.75}
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN, prefix_cache=True)
    document, decoy, question = ids(tokenizer, 300, seed=20), ids(tokenizer, 12, seed=21), ids(tokenizer, 12, seed=22)
    first = run(engine, "decoy", document + decoy, **compression)
    assert first[-1].compression_metrics["entries"]["dropped"] > 0  # the decoy's own cache was pruned
    (entry,) = engine.prefix_cache.entries.values()  # and not parked: only its prompt, as it was stored
    assert entry.parked == "prompt" and entry.kv.holds_every_entry(len(document + decoy))
    second = run(engine, "real", document + question, **compression)
    fresh = run(make_engine(model, tokenizer, compression=COMPRESS_OFTEN), "real", document + question, **compression)
    # The document is reused, except for what the compression must observe: the last 32 queries.
    reused = len(document + question) - engine.compression_config.observation_window
    assert second[-1].cached_prompt_tokens == reused
    assert second[-1].compression_metrics["prefix_parked"] == "prompt"
    assert engine.prefix_cache.reused_tokens == {"prompt": reused}
    assert tokens_of(second) == tokens_of(fresh)
    assert engine.store.used_bytes == engine.store.parked_bytes  # nothing running holds memory


def test_a_prompt_equal_to_a_cached_one_still_computes_its_last_token(model, tokenizer):
    engine = make_engine(model, tokenizer, prefix_cache=True)
    prompt = ids(tokenizer, 64, seed=3)
    first = tokens_of(run(engine, "a", prompt, max_tokens=1))
    again = run(engine, "b", prompt, max_tokens=6)
    assert again[-1].cached_prompt_tokens == len(prompt) - 1
    assert tokens_of(again)[:1] == first
    assert tokens_of(again) == tokens_of(run(make_engine(model, tokenizer), "c", prompt, max_tokens=6))


def test_reuse_needs_the_same_storage_precision_and_no_more(model, tokenizer):
    """What is parked is exact at its storage precision, so another policy or rate reuses it and
    answers as a fresh request; another precision does not."""
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN, prefix_cache=True)
    prompt = ids(tokenizer, 200, seed=4)
    run(engine, "a", prompt, policy="h2o", compression_rate=0.5)
    longer = prompt + ids(tokenizer, 30, seed=5)
    assert (
        run(engine, "b", longer, policy="h2o", compression_rate=0.5, kv_cache_dtype="int4")[-1].cached_prompt_tokens
        == 0
    )
    hit = run(engine, "c", longer, policy="snapkv", compression_rate=0.6)
    # What "a" and "c" share, but the last 32 queries, which "c"'s compression observes.
    assert hit[-1].cached_prompt_tokens == min(len(prompt), len(longer) - engine.compression_config.observation_window)
    metrics = hit[-1].compression_metrics
    assert metrics["hit_rate"] > 0.8
    assert metrics["compressed_size"] <= 0.4 * metrics["original_size"] + 24 * engine.store.model_token_bytes
    fresh = make_engine(model, tokenizer, compression=COMPRESS_OFTEN)
    alone = run(fresh, "c", longer, policy="snapkv", compression_rate=0.6)
    assert tokens_of(hit) == tokens_of(alone)
    assert metrics["entries"] == alone[-1].compression_metrics["entries"]


def test_concurrent_reusers_never_see_each_others_writes(model, tokenizer):
    engine = make_engine(model, tokenizer, prefix_cache=True)
    shared = ids(tokenizer, 100, seed=6)
    run(engine, "system", shared, max_tokens=1)
    parked = engine.store.parked_bytes
    tails = [ids(tokenizer, 20 + 7 * i, seed=10 + i) for i in range(3)]
    for i, tail in enumerate(tails):
        engine.add_request(str(i), shared + tail, greedy(10, ignore_eos=True))
    together = run_to_completion(engine)
    for i, tail in enumerate(tails):
        alone = run(make_engine(model, tokenizer), "x", shared + tail, max_tokens=10)
        assert tokens_of(together[str(i)]) == tokens_of(alone)
        assert together[str(i)][-1].cached_prompt_tokens == len(shared)
    assert engine.prefix_cache.hits == 3
    # The shorter shared entry was superseded by the longer ones, which still hold its prefix.
    hit = engine.prefix_cache.lookup(shared + [1, 2], engine.default_compression().fingerprint)
    assert hit.num_tokens == len(shared)
    assert engine.store.parked_bytes > parked


def test_memory_pressure_evicts_parked_entries_by_lru_2_before_preempting(model, tokenizer):
    probe = make_engine(model, tokenizer)
    budget = probe.store.bytes_for(300) * 2  # room for two parked prompts, not three
    engine = make_engine(model, tokenizer, max_cache_bytes=budget, prefix_cache=True)
    prompts = [ids(tokenizer, 280, seed=20 + i) for i in range(3)]
    run(engine, "hot", prompts[0], max_tokens=2)
    run(engine, "hot-again", prompts[0] + [5], max_tokens=2)  # the hot prefix is used twice
    run(engine, "cold", prompts[1], max_tokens=2)
    run(engine, "new", prompts[2], max_tokens=2)  # needs room: the cold entry (one use) goes
    assert engine.prefix_cache.evictions["memory"] >= 1
    assert engine.store.used_bytes <= budget
    assert run(engine, "hot-3", prompts[0] + [7, 8], max_tokens=2)[-1].cached_prompt_tokens > 0
    assert run(engine, "cold-2", prompts[1] + [7, 8], max_tokens=2)[-1].cached_prompt_tokens == 0
    engine.prefix_cache.clear()
    assert engine.store.used_bytes == engine.store.parked_bytes == 0


def test_memory_pressure_compresses_harder_before_preempting(model, tokenizer):
    """Order under pressure: prefix-cache entries, then squeezing compressing requests, then preemption."""
    prompts_ = [ids(tokenizer, 64, seed=30 + i) for i in range(6)]
    budget = make_engine(model, tokenizer).store.bytes_for(400)  # six growing requests: fit at 0.9, not at 0.3

    def storm(ceiling: float) -> tuple:
        engine = make_engine(
            model, tokenizer, max_cache_bytes=budget, compression={**COMPRESS_OFTEN, "pressure_rate_ceiling": ceiling}
        )
        for i, prompt in enumerate(prompts_):
            request = {"policy": "h2o", "compression_rate": 0.3, "kv_cache_dtype": "auto"}
            params = resolve(engine.compression_config, request, True, False)
            engine.add_request(str(i), prompt, greedy(120, ignore_eos=True), params)
        preempted = 0
        while engine.has_unfinished():
            outs = engine.step()
            preempted += engine.last_step.num_preempted
            assert engine.store.used_bytes <= budget
            assert not [o for o in outs if o.error]
        return preempted, engine.compression.squeezes, engine.store.used_bytes

    no_relief = storm(ceiling=0.3)
    relieved = storm(ceiling=0.9)
    assert no_relief[1] == 0 and no_relief[0] > 0  # without room to squeeze, preemption
    assert relieved[1] > 0 and relieved[0] < no_relief[0]
    assert relieved[2] == 0


def test_warm_up_prefills_shared_prompts_for_later_requests(model, tokenizer):
    engine = make_engine(model, tokenizer, prefix_cache=True)
    system = ids(tokenizer, 80, seed=40)
    assert engine.warm_up([system], engine.default_compression()) == 80
    assert len(engine.prefix_cache) == 1 and engine.store.used_bytes == engine.store.parked_bytes > 0
    out = run(engine, "user", system + ids(tokenizer, 20, seed=41), max_tokens=4)
    assert out[-1].cached_prompt_tokens == 80
    with pytest.raises(ValueError, match="prefix cache"):
        make_engine(model, tokenizer).warm_up([system], engine.default_compression())


def test_a_hit_too_big_to_copy_beside_its_source_is_prefilled_instead(model, tokenizer):
    """Room for one request only: the cached prefix cannot be copied, so it makes way (no deadlock)."""
    prompt = ids(tokenizer, 200, seed=50)
    budget = make_engine(model, tokenizer).store.bytes_for(230)
    engine = make_engine(model, tokenizer, max_cache_bytes=budget, prefix_cache=True)
    run(engine, "first", prompt, max_tokens=4)
    assert len(engine.prefix_cache) == 1
    again = run(engine, "again", prompt, max_tokens=4)
    assert again[-1].finish_reason == "length" and again[-1].cached_prompt_tokens == 0
    assert engine.store.used_bytes <= budget


def test_a_compaction_beside_a_parked_prompt_takes_its_pages_from_the_parked_prompt(model, tokenizer):
    """The compaction writes the kept entries into fresh blocks while the parked prompt holds the old
    ones: where the arena has no page left for them, the prefix cache gives the parked prompt back,
    and the compaction goes ahead, never past the arena, and no forward pass past the budget."""
    prompt = ids(tokenizer, 300, seed=30)
    budget = int(1.15 * make_engine(model, tokenizer).store.bytes_for(len(prompt) + 16))
    engine = make_engine(model, tokenizer, max_cache_bytes=budget, compression=COMPRESS_OFTEN, prefix_cache=True)
    request = {"policy": "h2o", "compression_rate": 0.5, "kv_cache_dtype": "auto"}
    engine.add_request(
        "r", prompt, greedy(12, ignore_eos=True), resolve(engine.compression_config, request, True, True)
    )
    at_forward, after_step = [], []
    schedule = engine.scheduler.schedule
    evict_one = engine.store.reclaim
    reclaimed = []

    def recording_schedule(compressing=()):
        out = schedule(compressing)
        at_forward.append(engine.store.used_bytes)
        return out

    def recording_reclaim():
        reclaimed.append(engine.store.used_bytes)
        return evict_one()

    engine.scheduler.schedule = recording_schedule
    engine.store.reclaim = recording_reclaim
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
        after_step.append(engine.store.used_bytes)
    assert reclaimed  # the compaction found no page...
    assert len(engine.prefix_cache) == 0  # ...and the parked prompt paid for it
    assert max(at_forward) <= budget and max(after_step) <= engine.store.allocator.allocated_bytes
    assert outputs[-1].compression_metrics["compression_ratio"] < 0.6  # compressed as asked


def test_a_request_that_cannot_fit_waits_without_emptying_the_cache_and_counts_one_query(model, tokenizer):
    """Running requests hold the memory; a waiting request that would not fit even with every parked
    entry gone must leave them be (today's chat prefix is tomorrow's hit), and a prompt that waits
    many steps is one query of the prefix cache, counted as it is admitted."""
    # Room for "long" as it grows and "chat" parked, or for "big" and "chat", never for "long" and "big".
    budget = make_engine(model, tokenizer).store.bytes_for(640)
    engine = make_engine(model, tokenizer, max_cache_bytes=budget, prefix_cache=True)
    run(engine, "chat", ids(tokenizer, 120, seed=40), max_tokens=8)  # parked: about 128 tokens
    assert len(engine.prefix_cache) == 1 and engine.prefix_cache.queries == 1
    params = resolve(engine.compression_config, None, True, True)
    engine.add_request("long", ids(tokenizer, 300, seed=41), greedy(120, ignore_eos=True), params)
    engine.add_request("big", ids(tokenizer, 400, seed=42), greedy(4, ignore_eos=True), params)
    waited = 0
    while engine.has_unfinished() and "long" in engine.outputs.requests:
        engine.step()
        big = engine.outputs.requests.get("big")
        waited += big is not None and big.first_scheduled_time is None
    assert waited > 10  # "big" waited behind "long" for many steps...
    assert engine.prefix_cache.evictions["memory"] == 0  # ...and evicted nothing while it could not fit
    assert engine.prefix_cache.queries == 2  # "long" admitted; "big" not yet, however often it looked
    run_to_completion(engine)
    assert engine.prefix_cache.queries == 3  # "big" admitted once memory came back
    assert engine.store.used_bytes <= budget


def test_a_conversation_outlives_a_newer_one_off_request_under_pressure(model, tokenizer):
    """Each turn of a chat parks a new entry that supersedes the last; it inherits the last one's
    references (LRU-K), so a conversation used at two turns is kept over a request parked once
    since, however recent (before, every turn's entry was new, seen once, and went first)."""
    engine = make_engine(model, tokenizer, max_cache_bytes=make_engine(model, tokenizer).store.bytes_for(420),
                         prefix_cache=True)  # fmt: skip
    turn = ids(tokenizer, 40, seed=50)
    turn += tokens_of(run(engine, "turn 1", turn, max_tokens=8)) + ids(tokenizer, 16, seed=51)
    turn += tokens_of(run(engine, "turn 2", turn, max_tokens=8)) + ids(tokenizer, 16, seed=52)
    assert len(engine.prefix_cache) == 1  # turn 2's entry superseded turn 1's
    run(engine, "document", ids(tokenizer, 100, seed=53), max_tokens=8)  # parked once, after the turns
    run(engine, "pressure", ids(tokenizer, 280, seed=54), max_tokens=2)  # one entry must go to admit it
    assert engine.prefix_cache.evictions["memory"] == 1
    hits = engine.prefix_cache.hits
    run(engine, "turn 3", turn, max_tokens=8)
    assert engine.prefix_cache.hits == hits + 1  # the conversation was kept; the document went


@pytest.mark.server
def test_a_live_chat_keeps_reusing_its_turns_while_long_requests_queue_beside_it(tiny_model_dir, tokenizer):
    """Seed 002's chat workload on the real server: each turn resends the conversation. Long requests
    take turns holding most of the budget, one running and one waiting that could not fit even with
    every parked turn evicted; the parked turns must survive that wait, so every turn after the first
    starts from its conversation's cache (before the fix, a waiting request evicted them each step)."""
    import threading

    import httpx

    from tests.helpers import LiveServer

    token_bytes = 2 * 2 * 2 * 16 * 4  # the tiny model: layers x (K, V) x kv_heads x head_dim x fp32
    budget = 800 * token_bytes  # a long request (420 + 80 tokens) leaves too little for a second
    server = LiveServer(
        "--model-path", str(tiny_model_dir), f"--max-cache-size={budget / 1e6}MB", "--compression-enabled=false"
    )  # fmt: skip
    client = httpx.Client(base_url=f"{server.url}/v1", timeout=120)
    model = tiny_model_dir.name

    def complete(prompt: list[int], max_tokens: int) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        response = client.post("/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]

    def longs(seed: int, done: threading.Event) -> None:
        while not done.is_set():
            complete(ids(tokenizer, 420, seed=seed), 80)
            seed += 2

    try:
        done = threading.Event()
        runners = [threading.Thread(target=longs, args=(100 + i, done)) for i in range(2)]
        for runner in runners:
            runner.start()
        while server.metric("requests_waiting") < 1:  # one long request runs, the other waits
            pass
        reused, resent, turns_that_hit, later_turns = 0, 0, 0, 0
        for conversation in range(2):
            prompt = ids(tokenizer, 24, seed=conversation)
            for turn in range(4):
                usage = complete(prompt, 8)
                if turn:
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    reused, resent = reused + cached, resent + len(prompt) - 16
                    turns_that_hit, later_turns = turns_that_hit + (cached > 0), later_turns + 1
                prompt = prompt + ids(tokenizer, 16, seed=1000 * conversation + turn)
        waiting_at_the_end = server.metric("requests_waiting")
        done.set()
        for runner in runners:
            runner.join()
    finally:
        server.stop()
    assert waiting_at_the_end >= 1  # the chat ran while a long request was waiting throughout
    assert turns_that_hit / later_turns > 0.9
    assert reused / resent > 0.9  # of the tokens each later turn shares with the one before it


def test_a_request_whose_bytes_fit_but_whose_pages_are_held_by_parked_caches_of_another_format_is_admitted(
    model, tokenizer
):
    """Parked int8 prompts, every other one evicted, leave the arena's pages half used by int8 blocks:
    an uncompressed request then fits in the free bytes but finds no free page. With nothing running,
    nothing else would free one: parked entries must go until its pages fit, or it waits forever."""
    budget = make_engine(model, tokenizer).store.bytes_for(600)
    engine = make_engine(model, tokenizer, max_cache_bytes=budget, compression=COMPRESS_OFTEN, prefix_cache=True)
    prompts = [ids(tokenizer, 150, seed=60 + i) for i in range(14)]
    for i, prompt in enumerate(prompts):  # parked at int8, before their compression
        run(engine, f"p{i}", prompt, max_tokens=2, kv_cache_dtype="int8")
    for i, prompt in enumerate(prompts[::2]):  # reused: LRU-2 keeps these, the others go first
        run(engine, f"again{i}", prompt, max_tokens=2, kv_cache_dtype="int8")
    while engine.prefix_cache.entries and len(engine.prefix_cache) > len(prompts) // 2:
        engine.prefix_cache.evict_one()
    store = engine.store
    need = store.bytes_for(250)
    assert (
        need <= store.free_bytes and store.allocator.arena.free_pages * store.allocator.arena.page_bytes < need
    )  # fragmented
    params = resolve(engine.compression_config, {"enabled": False}, True, True)
    engine.add_request("big", ids(tokenizer, 250, seed=99), greedy(4, ignore_eos=True), params)
    for _ in range(200):
        engine.step()
        if not engine.has_unfinished():
            break
    assert not engine.has_unfinished() and engine.outputs.requests.get("big") is None  # finished, not stuck
    assert store.used_bytes <= budget
