"""Engine behaviour on a tiny model: budgets, preemption, aborts, failures, seeds."""

from __future__ import annotations

import random
import re

import pytest

from confkv.engine.llm_engine import run_to_completion
from confkv.engine.sequence import SamplingParams
from tests.helpers import greedy, make_engine, text_of, tiny_model, tokens_of


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)


def prompts(tokenizer, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, len(tokenizer)) for _ in range(n)] for n in lengths]


def run_all(engine, batch, params):
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, params)
    return run_to_completion(engine)


def test_preemption_under_a_small_budget_keeps_greedy_output(model, tokenizer):
    batch = prompts(tokenizer, [30, 50, 20, 60, 40, 35])
    free = make_engine(model, tokenizer)
    want = run_all(free, batch, greedy(40, ignore_eos=True))
    # Room for about three of the six sequences at their full length.
    tight = make_engine(model, tokenizer, max_cache_bytes=300 * free.store.model_token_bytes)
    steps_preempted = 0
    for i, p in enumerate(batch):
        tight.add_request(str(i), p, greedy(40, ignore_eos=True))
    got: dict[str, list] = {}
    peak = 0
    while tight.has_unfinished():
        for out in tight.step():
            got.setdefault(out.request_id, []).append(out)
        steps_preempted += tight.last_step.num_preempted
        peak = max(peak, tight.store.used_bytes)
        assert tight.store.used_bytes <= tight.store.max_bytes
    assert steps_preempted > 0, "the budget was meant to force preemption"
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in want.items()}
    assert tight.store.used_bytes == 0


def test_admission_waits_for_memory_and_respects_max_num_seqs(model, tokenizer):
    engine = make_engine(model, tokenizer, max_num_seqs=2)
    for i, p in enumerate(prompts(tokenizer, [10, 10, 10, 10])):
        engine.add_request(str(i), p, greedy(5, ignore_eos=True))
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 2
    run_to_completion(engine)
    assert engine.store.used_bytes == 0


def test_a_request_that_cannot_fit_lets_those_that_fit_pass_a_bounded_number_of_times(model, tokenizer):
    """Behind a request waiting for running ones to finish, short requests that fit now run at once,
    but no more than max_num_seqs of them: then the waiting one has the next free memory."""
    budget = make_engine(model, tokenizer).store.bytes_for(340)
    engine = make_engine(model, tokenizer, max_cache_bytes=budget, max_num_seqs=4)
    long, big, *smalls = prompts(tokenizer, [200, 200] + [10] * 7)
    engine.add_request("long", long, greedy(100, ignore_eos=True))
    engine.step()
    engine.add_request("big", big, greedy(2, ignore_eos=True))  # cannot fit beside "long" until it ends
    for i, prompt in enumerate(smalls):
        engine.add_request(f"small {i}", prompt, greedy(2, ignore_eos=True))
    order = []
    while engine.has_unfinished():
        for seq in [*engine.scheduler.running]:
            if seq.request_id not in order:
                order.append(seq.request_id)
        engine.step()
    assert order[:5] == ["long"] + [f"small {i}" for i in range(4)]  # four passed "big" while it waited...
    assert order[5] == "big" and order[6:] == [f"small {i}" for i in range(4, 7)]  # ...then it went first
    assert engine.store.used_bytes == 0


def test_request_too_big_for_the_budget_fails_alone(model, tokenizer):
    engine = make_engine(model, tokenizer, max_cache_bytes=64 * make_engine(model, tokenizer).store.model_token_bytes)
    small, huge = prompts(tokenizer, [8, 200])
    engine.add_request("small", small, greedy(5, ignore_eos=True))
    engine.add_request("huge", huge, greedy(5, ignore_eos=True))
    results = run_to_completion(engine)
    assert results["huge"][-1].finish_reason == "error" and "max_cache_size" in results["huge"][-1].error
    assert results["small"][-1].finish_reason == "length" and len(tokens_of(results["small"])) == 5
    assert engine.store.used_bytes == 0


def test_abort_returns_memory_at_once(model, tokenizer):
    engine = make_engine(model, tokenizer)
    a, b = prompts(tokenizer, [20, 20])
    engine.add_request("a", a, greedy(50, ignore_eos=True))
    engine.add_request("b", b, greedy(50, ignore_eos=True))
    first_step = [o for o in engine.step() if o.request_id == "b"]
    held = engine.store.used_bytes
    out = engine.abort("a")
    assert out.finished and out.finish_reason == "abort"
    assert 0 < engine.store.used_bytes < held
    results = run_to_completion(engine)
    assert len(tokens_of(first_step + results["b"])) == 50
    assert engine.store.used_bytes == 0


class Recorder:
    """A scheduler listener that logs what it is told, and whether the sequence still held its KV."""

    def __init__(self, name, store, log):
        self.name, self.store, self.log = name, store, log

    def finished(self, seq):
        self.log.append((self.name, "finished", seq.request_id, seq.finish_reason, self.store.seq_bytes(seq.seq_id)))

    def preempted(self, seq):
        self.log.append((self.name, "preempted", seq.request_id, None, self.store.seq_bytes(seq.seq_id)))


def test_listeners_are_told_once_per_finish_preemption_and_abort_in_order(model, tokenizer):
    free = make_engine(model, tokenizer)
    engine = make_engine(model, tokenizer, max_cache_bytes=300 * free.store.model_token_bytes)  # forces preemption
    log = []
    engine.scheduler.listeners += [Recorder("first", engine.store, log), Recorder("second", engine.store, log)]
    for i, p in enumerate(prompts(tokenizer, [30, 50, 20, 60, 40, 35])):
        engine.add_request(str(i), p, greedy(40, ignore_eos=True))
    engine.step()
    aborted = engine.abort("0")
    preempted = engine.last_step.num_preempted
    while engine.has_unfinished():
        engine.step()
        preempted += engine.last_step.num_preempted
    assert aborted.finished and aborted.finish_reason == "abort"
    assert preempted > 0
    # Each event reaches both, the first registered first, while the sequence still holds its KV.
    assert [entry[0] for entry in log] == ["first", "second"] * (len(log) // 2)
    events = [entry[1:] for entry in log[::2]]
    assert events == [entry[1:] for entry in log[1::2]]
    assert all(held > 0 for *_, held in events)
    finished = [(request, reason) for kind, request, reason, _ in events if kind == "finished"]
    assert sorted(finished) == [("0", "abort")] + [(str(i), "length") for i in range(1, 6)]
    assert sum(kind == "preempted" for kind, *_ in events) == preempted
    assert engine.store.used_bytes == 0


def test_failed_forward_fails_its_batch_and_the_engine_goes_on(model, tokenizer):
    engine = make_engine(model, tokenizer)
    calls = {"n": 0}

    def flaky(chunks, logits):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")

    engine.runner.after_forward.append(flaky)
    first, later = prompts(tokenizer, [10, 10])
    engine.add_request("first", first, greedy(5))
    results = run_to_completion(engine)
    assert results["first"][-1].finish_reason == "error" and "injected fault" in results["first"][-1].error
    engine.add_request("later", later, greedy(5, ignore_eos=True))
    assert len(tokens_of(run_to_completion(engine)["later"])) == 5
    assert engine.store.used_bytes == 0


def test_seeded_sampling_is_reproducible_whatever_runs_beside(model, tokenizer):
    p = prompts(tokenizer, [12])[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = make_engine(model, tokenizer)
    alone.add_request("x", p, params)
    want = tokens_of(run_to_completion(alone)["x"])
    crowded = make_engine(model, tokenizer)
    for i, other in enumerate(prompts(tokenizer, [5, 30, 9], seed=1)):
        crowded.add_request(f"o{i}", other, SamplingParams(max_tokens=25, temperature=1.0, ignore_eos=True))
    crowded.add_request("x", p, params)
    assert tokens_of(run_to_completion(crowded)["x"]) == want


def test_max_tokens_and_eos_end_a_request(model, tokenizer):
    engine = make_engine(model, tokenizer)
    p = prompts(tokenizer, [6])[0]
    engine.add_request("n", p, greedy(7, ignore_eos=True))
    out = run_to_completion(engine)["n"]
    assert out[-1].finish_reason == "length" and out[-1].completion_tokens == 7
    first = tokens_of(out)[0]
    engine.eos_token_ids = {first}  # the first greedy token now counts as EOS
    engine.add_request("e", p, greedy(7))
    out = run_to_completion(engine)["e"]
    assert out[-1].finish_reason == "stop" and out[-1].completion_tokens == 1
    assert isinstance(text_of(out), str)


def test_a_request_past_its_deadline_ends_with_timeout_and_frees_its_memory(model, tokenizer):
    import time

    engine = make_engine(model, tokenizer)
    late, fine = prompts(tokenizer, [40, 40])
    engine.add_request("late", late, greedy(500, ignore_eos=True, deadline=time.monotonic() + 0.2))
    engine.add_request("fine", fine, greedy(6, ignore_eos=True))
    results = run_to_completion(engine)
    assert results["late"][-1].finish_reason == "timeout"
    assert results["late"][-1].completion_tokens < 500
    assert results["fine"][-1].finish_reason == "length" and results["fine"][-1].completion_tokens == 6
    assert engine.store.used_bytes == 0


def test_nan_logits_or_a_detokenizer_fault_fail_one_request_only(model, tokenizer):
    import torch

    engine = make_engine(model, tokenizer)
    batch = prompts(tokenizer, [12, 14, 16])
    for i, p in enumerate(batch):
        engine.add_request(str(i), p, greedy(6, ignore_eos=True))
    victim = engine.outputs.requests["0"].seq_id

    def poison(chunks, logits):  # the row of request "0" turns to NaN
        sampled = [c.seq_id for c in chunks if c.needs_logits]
        if victim in sampled:
            logits[sampled.index(victim)] = torch.nan

    engine.runner.after_forward.append(poison)
    detok = engine.outputs.detokenizers[engine.outputs.requests["1"].seq_id]
    detok.add = lambda token: (_ for _ in ()).throw(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected"))
    results = run_to_completion(engine)
    assert results["0"][-1].finish_reason == "error" and "non-finite" in results["0"][-1].error
    assert results["1"][-1].finish_reason == "error" and "detokenization failed" in results["1"][-1].error
    assert results["2"][-1].finish_reason == "length" and len(tokens_of(results["2"])) == 6
    assert engine.store.used_bytes == 0


def test_stop_token_ids_end_a_request_and_min_tokens_hold_them_off(model, tokenizer):
    prompt = prompts(tokenizer, [12])[0]
    free = tokens_of(run_all(make_engine(model, tokenizer), [prompt], greedy(8))["0"])
    stop = free[2]
    stopped = run_all(make_engine(model, tokenizer), [prompt], greedy(8, stop_token_ids=(stop,)))["0"]
    assert tokens_of(stopped) == free[: free.index(stop) + 1] and stopped[-1].finish_reason == "stop"
    held = run_all(make_engine(model, tokenizer), [prompt], greedy(8, min_tokens=4, stop_token_ids=(free[0],)))["0"]
    assert free[0] not in tokens_of(held)[:4] and len(tokens_of(held)) >= 4


def test_a_request_too_big_on_its_own_is_told_all_it_needs(model, tokenizer):
    """Admitted for its prompt, it outgrows the whole budget alone: the error names the bytes of all
    its tokens, over the budget, not the one token it was refused."""
    budget = make_engine(model, tokenizer).store.bytes_for(64)
    engine = make_engine(model, tokenizer, max_cache_bytes=budget)
    last = run_all(engine, prompts(tokenizer, [60]), greedy(40, ignore_eos=True))["0"][-1]
    assert last.finish_reason == "error" and engine.store.used_bytes == 0
    need = int(re.search(r"needs (\d+) bytes", last.error).group(1))
    assert need > budget and "max_cache_size is" in last.error
