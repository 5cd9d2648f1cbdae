"""One request's failure stays its own: a compression or a sampling that raises for one sequence ends
that request with an error, gives its memory back and leaves the others and the engine running; a
step that raises anyway is survived by a supervised loop, up to its restarts."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from confkv.compress.config import resolve
from confkv.compress.scoring import POLICIES, LayerEntries, ScorePolicy
from confkv.engine import llm_engine
from confkv.engine.async_engine import AsyncEngine, EngineDeadError
from tests.helpers import COMPRESS_OFTEN, check_references, greedy, make_engine, tiny_model


@pytest.fixture
def failing_policy() -> Iterator[type[ScorePolicy]]:
    """A policy whose score raises at its `fail_at`-th compression of a sequence (a defect in a policy)."""

    @dataclass
    class FailsLater(ScorePolicy):
        name = "test_fails_later"
        uses_attention = False
        fail_at: int = 2

        def score(self, entries: LayerEntries) -> torch.Tensor:
            self.scored = getattr(self, "scored", 0) + (entries.layer == 0)
            if self.scored >= self.fail_at:
                raise RuntimeError("injected policy fault")
            return entries.positions.float()

    yield FailsLater
    del POLICIES[FailsLater.name]


def prompt(seed: int, n: int = 120) -> list[int]:
    return [int(t) for t in torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed))]


def run_all(engine) -> tuple[dict[str, list], dict[str, int]]:
    """Step to the end; every request's outputs, and the failures the steps counted by stage."""
    results, failures = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            results.setdefault(out.request_id, []).append(out)
        for stage, count in engine.last_step.failures.items():
            failures[stage] = failures.get(stage, 0) + count
    return results, failures


@pytest.mark.parametrize("async_compression", [False, True])
def test_a_compression_that_raises_ends_its_own_request_and_the_others_finish(
    tokenizer, failing_policy, async_compression
):
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer, compression=COMPRESS_OFTEN, async_compression=async_compression)
    config = engine.compression_config
    # Stored at the model's dtype, so that the rate's bytes are found by dropping entries, not by int8.
    rate = {"compression_rate": 0.5, "kv_cache_dtype": "auto", "retention_unit": "token"}
    fails_first = {"policy_options": {"test_fails_later": {"fail_at": 1}}}
    failing = resolve(config, {"policy": "test_fails_later", **rate, **fails_first}, True, False)
    compressing = resolve(config, {"policy": "h2o", **rate}, True, True)
    engine.add_request("fails", prompt(0), greedy(40, ignore_eos=True), failing)
    engine.add_request("compresses", prompt(1), greedy(40, ignore_eos=True), compressing)
    engine.add_request("plain", prompt(2), greedy(40, ignore_eos=True))
    results, failures = run_all(engine)

    last = results["fails"][-1]
    assert last.finish_reason == "error" and "compression failed (planning)" in last.error
    assert "injected policy fault" in last.error
    assert last.completion_tokens < 40  # it failed at its first compression, at the end of prefill
    for request_id in ("compresses", "plain"):
        assert results[request_id][-1].finish_reason == "length" and results[request_id][-1].completion_tokens == 40
    assert results["compresses"][-1].compression_metrics["entries"]["dropped"] > 0  # still compressed after
    assert failures == {"compression": 1}
    check_references(engine.store)
    assert engine.store.used_bytes == 0 and not engine.compression.states
    # and the engine serves the next request as if nothing happened
    engine.add_request("after", prompt(3), greedy(8, ignore_eos=True), compressing)
    assert run_all(engine)[0]["after"][-1].finish_reason == "length"


def test_a_squeeze_that_raises_fails_its_request_and_frees_its_memory(tokenizer, failing_policy):
    """Under memory pressure the compressor squeezes running requests inside scheduling; a policy that
    raises there must not take the schedule (and every other request) down."""
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    probe = make_engine(model, tokenizer)
    budget = probe.kv_bytes_for(2 * 120 + 60, "auto")
    engine = make_engine(model, tokenizer, max_cache_bytes=budget, compression=COMPRESS_OFTEN)
    config = engine.compression_config
    # Compressed once at the end of prefill, then only when squeezed (the newest request first).
    once = {"compression_rate": 0.1, "kv_cache_dtype": "auto", "compression_interval": 10_000}
    steady = resolve(config, {"policy": "h2o", **once}, True, False)
    squeezed = resolve(config, {"policy": "test_fails_later", **once}, True, False)
    engine.add_request("steady", prompt(1), greedy(100, ignore_eos=True), steady)
    engine.add_request("squeezed", prompt(0), greedy(100, ignore_eos=True), squeezed)
    results, failures = run_all(engine)
    last = results["squeezed"][-1]
    assert last.finish_reason == "error" and "compression failed (squeezing)" in last.error
    assert results["steady"][-1].finish_reason in ("length", "error")
    assert failures.get("compression") == 1
    check_references(engine.store)
    assert engine.store.used_bytes == 0


def test_a_batch_whose_sampling_raises_is_sampled_row_by_row_and_only_the_row_at_fault_fails(tokenizer, monkeypatch):
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer)
    sample = llm_engine.sample

    def faulty(logits, params, generators, histories=None):
        if any(p.seed == 666 for p in params):  # a row the sampler cannot handle
            raise RuntimeError("injected sampler fault")
        return sample(logits, params, generators, histories)

    monkeypatch.setattr(llm_engine, "sample", faulty)
    engine.add_request("bad", prompt(0, 20), greedy(6, seed=666))
    engine.add_request("good", prompt(1, 20), greedy(6, ignore_eos=True))
    results, failures = run_all(engine)
    assert results["bad"][-1].finish_reason == "error" and "injected sampler fault" in results["bad"][-1].error
    assert results["good"][-1].finish_reason == "length" and results["good"][-1].completion_tokens == 6
    assert failures == {"sampling": 1}
    assert engine.store.used_bytes == 0


def test_the_supervised_loop_resets_the_engine_after_a_crash_then_dies_past_its_restarts(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer, prefix_cache=True)
    dead: list[BaseException] = []
    loop = AsyncEngine(engine, max_restarts=1, on_dead=dead.append)
    step, crashes = engine.step, []

    def crashing_step():
        if crashes:
            crashes.pop()
            raise RuntimeError("injected loop fault")
        return step()

    engine.step = crashing_step

    async def generate(request_id: str, max_tokens: int = 4):
        return [out async for out in loop.generate(prompt(5, 40), greedy(max_tokens, ignore_eos=True), request_id)]

    async def scenario():
        assert (await generate("warm"))[-1].finish_reason == "length"  # parked in the prefix cache
        crashes.append(1)
        lost = await generate("lost")
        assert lost[-1].finish_reason == "error" and "the engine restarted, retry" in lost[-1].error
        for _ in range(100):  # the client hears of the crash first, then the engine is reset
            if loop.restarts:
                break
            await asyncio.sleep(0.05)
        assert loop.restarts == 1 and loop.is_running and loop.error is None
        assert engine.store.used_bytes == 0 and len(engine.prefix_cache) == 0  # reset: nothing kept, all back
        assert (await generate("after"))[-1].finish_reason == "length"
        crashes.append(1)
        lost = await generate("lost again")
        assert lost[-1].finish_reason == "error" and "exiting" in lost[-1].error
        for _ in range(100):
            if loop.error is not None:
                break
            await asyncio.sleep(0.05)
        assert not loop.is_alive and "injected loop fault" in repr(loop.error) and len(dead) == 1
        with pytest.raises(EngineDeadError):
            await generate("refused")

    loop.start()
    try:
        asyncio.run(scenario())
    finally:
        loop.stop()
