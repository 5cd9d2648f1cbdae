"""Asynchronous compression: planned on a worker thread beside the next forward pass, it keeps the
same entries and gives the same tokens as the same steps planned on the engine's own thread, and
as compressing between steps; never is a block both free and held, nor the budget passed."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from confkv.compress.config import CompressionConfig, resolve
from confkv.compress.predictor.model import PredictorConfig, ValuePredictor
from confkv.compress.predictor.online import FutureValue
from confkv.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from confkv.server.api import build_engine
from confkv.server.settings import Settings
from tests.helpers import COMPRESS_OFTEN, check_references, greedy, tiny_model, tokens_of

WORKER = "confkv-compress"


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)


def future_value() -> FutureValue:
    """A value predictor with random weights (the same ones each call): its forecasts are written
    by the worker."""
    torch.manual_seed(0)
    return FutureValue(ValuePredictor(PredictorConfig.load(hidden_size=16, num_layers=1)).eval(), 2)


def make(model, tokenizer, asynchronous: bool, budget: int = 2**30, prefix_cache: bool = False) -> LLMEngine:
    config = EngineConfig(budget, prefix_cache=prefix_cache, async_compression=asynchronous)
    return LLMEngine(model, tokenizer, config, CompressionConfig(**COMPRESS_OFTEN), future_value())


class Inline:
    """Runs the worker's jobs on the caller's thread when started: the same steps, no overlap."""

    def submit(self, fn, *args):
        job: Future = Future()
        job.set_result(fn(*args))
        return job


def slowed(engine: LLMEngine, seed: int) -> LLMEngine:
    """Sleep at random points of the worker's plans (as it reads the cache, and before it returns),
    so that the forward pass beside it reaches every point of its own meanwhile."""
    rng = random.Random(seed)
    store = engine.store

    def pausing(read):
        def wrapper(*args, **kwargs):
            if threading.current_thread().name.startswith(WORKER) and rng.random() < 0.3:
                time.sleep(rng.random() * 0.004)
            return read(*args, **kwargs)

        return wrapper

    store.layer, store.view = pausing(store.layer), pausing(store.view)
    plan = engine.worker._plan
    engine.worker._plan = lambda due: pausing(plan)(due)
    return engine


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: int  # the number of tokens the run has emitted when it is added
    compression: dict


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    # per request: (tokens computed, each layer's held positions and KEY_ONLY count) after each compression
    compressions: dict[str, list[tuple]] = field(default_factory=dict)
    preempted: int = 0
    checks: int = 0


def drive(engine: LLMEngine, requests: list[Request]) -> Run:
    """Add each request once the run has emitted `arrival` tokens (steps differ between the ways of
    running, tokens do not); check the references and the budget after every forward pass and step."""
    run, names = Run(), {}
    store, cache = engine.store, engine.prefix_cache

    def check(*_) -> None:
        check_references(store, [entry.kv for entry in cache.entries.values()] if cache else [])
        assert store.used_bytes <= store.max_bytes
        run.checks += 1

    def compressed(seq_id: int, num_tokens: int, state) -> None:
        layers = []
        for layer in range(store.num_layers):
            kv = store.layer(seq_id, layer)
            layers.append((tuple(sorted(kv.positions[: kv.length].tolist())), kv.num_key_only))
        run.compressions.setdefault(names[seq_id], []).append((num_tokens, tuple(layers)))

    engine.runner.after_forward.append(check)
    engine.compression.hooks.compressed.append(compressed)
    emitted, added = 0, set()
    with torch.inference_mode():
        while len(added) < len(requests) or engine.has_unfinished():
            for i, request in enumerate(requests):
                if i not in added and request.arrival <= emitted:
                    params = resolve(engine.compression_config, request.compression, True, True)
                    sampling = greedy(request.max_tokens, ignore_eos=True)
                    seq = engine.add_request(str(i), request.prompt, sampling, params)
                    names[seq.seq_id] = str(i)
                    added.add(i)
            outputs = engine.step()
            run.preempted += engine.last_step.num_preempted
            for out in outputs:
                run.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                emitted += len(out.new_token_ids)
            check()
            if not engine.has_unfinished() and len(added) < len(requests):
                emitted = max(emitted, min(r.arrival for i, r in enumerate(requests) if i not in added))
    held = sum(entry.kv.bookkeeping_bytes for entry in cache.entries.values()) if cache else 0
    assert store.running_bytes == 0 and (cache is not None or store.used_bytes == held == 0)
    return run


def prompt(tokenizer, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, len(tokenizer)) for _ in range(n)]


def mixed_requests(tokenizer) -> list[Request]:
    """Prompts long and short, arriving while others decode, at several rates and policies."""
    policies = [
        {"policy": "dynamic", "compression_rate": 0.75},
        {"policy": "dynamic", "compression_rate": 0.9, "kv_cache_dtype": "int8", "retention_unit": "word"},
        {"policy": "h2o", "compression_rate": 0.6},
        {"policy": "dynamic", "compression_rate": 0.8, "value_predictor": False, "kv_cache_dtype": "kivi4"},
        {"policy": "none"},
    ]
    lengths, arrivals = [300, 120, 40, 220, 90], [0, 0, 10, 25, 40]
    return [
        Request(prompt(tokenizer, n, seed=i), 40, at, policy)
        for i, (n, at, policy) in enumerate(zip(lengths, arrivals, policies, strict=True))
    ]


def test_the_worker_keeps_the_entries_and_tokens_of_compressing_between_steps(model, tokenizer):
    requests = mixed_requests(tokenizer)
    between = drive(make(model, tokenizer, asynchronous=False), requests)
    engine = make(model, tokenizer, asynchronous=True)
    beside = drive(engine, requests)
    assert engine.last_step.compression_background_s >= 0.0
    assert beside.tokens == between.tokens
    assert beside.compressions == between.compressions
    # Those that compress: at the end of prefill, then every 8 of their 39 decode steps.
    assert {request: len(c) for request, c in beside.compressions.items()} == {"0": 5, "1": 5, "2": 5, "3": 5}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.data(),
    tight=st.booleans(),
    prefix_cache=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_arrivals_lengths_rates_and_preemptions_race_nothing(model, tokenizer, data, tight, prefix_cache, seed):
    """With the worker slowed at random points, every sequence holds after each compression the
    entries it holds when the same steps plan on the engine's thread, and gives the same tokens."""
    rates = st.sampled_from([0.0, 0.5, 0.75, 0.9])
    units = st.sampled_from(["token", "word"])
    requests = data.draw(
        st.lists(
            st.builds(
                Request,
                prompt=st.integers(20, 260).map(lambda n: prompt(tokenizer, n, seed + n)),
                max_tokens=st.integers(4, 40),
                arrival=st.integers(0, 60),
                compression=st.fixed_dictionaries(
                    {"policy": st.sampled_from(["dynamic", "h2o", "snapkv"]), "compression_rate": rates},
                    optional={"retention_unit": units, "kv_cache_dtype": st.sampled_from(["int8", "kivi4"])},
                ),
            ),
            min_size=1,
            max_size=5,
        )
    )
    # Tight: about two long prompts' worth at full size, so that sequences are squeezed and preempted.
    budget = 2 * 300 * make(model, tokenizer, False).store.model_token_bytes if tight else 2**30
    inline = make(model, tokenizer, asynchronous=True, budget=budget, prefix_cache=prefix_cache)
    inline.worker._pool = Inline()
    reference = drive(inline, requests)
    threaded = slowed(make(model, tokenizer, asynchronous=True, budget=budget, prefix_cache=prefix_cache), seed)
    run = drive(threaded, requests)
    assert run.tokens == reference.tokens
    assert run.compressions == reference.compressions
    assert run.preempted == reference.preempted


def test_a_due_sequence_aborted_or_finished_before_its_compression_gives_its_memory_back(model, tokenizer):
    engine = make(model, tokenizer, asynchronous=True)
    params = resolve(engine.compression_config, {"policy": "dynamic", "compression_rate": 0.8}, True, False)
    with torch.inference_mode():
        engine.add_request("a", prompt(tokenizer, 200, 1), greedy(30, ignore_eos=True), params)
        engine.add_request("b", prompt(tokenizer, 150, 2), greedy(30, ignore_eos=True), params)
        emitted = []
        while not engine._due:
            emitted += [out for out in engine.step() if out.request_id == "b"]
        assert {seq.seq_id for seq in engine._due} == {seq.seq_id for seq in engine.scheduler.running}
        engine.abort("a")
        emitted += run_to_completion(engine)["b"]
    assert len(tokens_of(emitted)) == 30
    assert engine.store.used_bytes == 0 and not engine.compression.states


def test_a_step_that_only_compresses_runs_no_forward_and_emits_nothing(model, tokenizer):
    engine = make(model, tokenizer, asynchronous=True)
    params = resolve(engine.compression_config, {"policy": "dynamic", "compression_rate": 0.8}, True, False)
    with torch.inference_mode():
        engine.add_request("a", prompt(tokenizer, 200, 3), greedy(20, ignore_eos=True), params)
        while not engine._due:
            engine.step()
        before = engine.store.seq_bytes(engine._due[0].seq_id)
        assert engine.step() == []
        stats = engine.last_step
        assert stats.num_seqs == 0 and stats.compression_s > 0 and stats.compression_background_s == 0
        assert engine.store.seq_bytes(engine.scheduler.running[0].seq_id) < before


@pytest.mark.parametrize("on", [False, True])
def test_the_server_setting_reaches_the_engine(tiny_model_dir, on):
    settings = Settings(model_path=tiny_model_dir, async_compression=on, max_cache_size="64MB", value_predictor="off")
    engine, _ = build_engine(settings)
    assert engine.config.async_compression is on and (engine.worker is not None) is on
