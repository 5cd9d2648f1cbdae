"""Tensor parallelism on the CPU (gloo between processes): two ranks give the tokens and the
compression of one process, the server's followers keep up with rank 0, and a rank that dies
stops the server instead of hanging it."""

from __future__ import annotations

import multiprocessing
import socket
import time

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoConfig

from confkv.compress.config import CompressionConfig, resolve
from confkv.compress.predictor.online import PREDICTOR_FILE
from confkv.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
from confkv.models.loader import load_model
from confkv.models.parallel import SINGLE, check_tensor_parallel, join
from confkv.server.api import create_app
from confkv.server.main import main
from confkv.server.settings import CalibrationSettings, Settings
from tests.helpers import COMPRESS_OFTEN, greedy, tokens_of

PROMPTS = [
    "The river runs " * 30,
    "Once upon a time, in a city by the sea, " * 8,
    "Numbers: " + " ".join(map(str, range(60))),
]
REQUESTS = [  # dropping and demoting entries often, observed attention deciding what
    {"policy": "dynamic", "compression_rate": 0.6, "kv_cache_dtype": "auto"},
    {"policy": "h2o", "compression_rate": 0.5, "kv_cache_dtype": "auto"},
    {"policy": "dynamic", "compression_rate": 0.8, "kv_cache_dtype": "int4"},
]


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _generate(rank: int, size: int, port: int, model_dir, answers) -> None:
    """Every request through an engine of `size` ranks (this process rank `rank`); rank 0 reports."""
    torch.set_num_threads(1)
    ranks = join(rank, size, "127.0.0.1", port, torch.device("cpu")) if size > 1 else SINGLE
    model, tokenizer = load_model(model_dir, torch.device("cpu"), None, size)
    config = CompressionConfig(**COMPRESS_OFTEN)
    engine_config = EngineConfig(max_cache_bytes=2**26, prefix_cache=True, async_compression=True)
    engine = LLMEngine(model, tokenizer, engine_config, config, None, {}, ranks)
    outputs = {}
    for round in range(2):  # the second from the prefix cache
        for i, (prompt, request) in enumerate(zip(PROMPTS, REQUESTS, strict=True)):
            params = resolve(config, request, True, True)
            engine.add_request(f"{round}-{i}", tokenizer(prompt).input_ids, greedy(40, ignore_eos=True), params)
        with torch.inference_mode():
            outputs |= run_to_completion(engine)
    if ranks.is_leader:
        metrics = {rid: outs[-1].compression_metrics for rid, outs in outputs.items()}
        answers.put(
            {rid: (tokens_of(outs), metrics[rid]["entries"], metrics[rid]["hit_rate"]) for rid, outs in outputs.items()}
        )


def test_two_ranks_generate_compress_and_reuse_prefixes_as_one_process(tiny_model_dir):
    context = multiprocessing.get_context("spawn")
    answers = context.Queue()
    port = _port()
    ranks = [context.Process(target=_generate, args=(r, 2, port, tiny_model_dir, answers)) for r in range(2)]
    for process in ranks:
        process.start()
    _generate(0, 1, 0, tiny_model_dir, answers)
    alone = answers.get(timeout=120)
    split = answers.get(timeout=240)
    for process in ranks:
        process.join(30)
        assert process.exitcode == 0
    assert split == alone
    assert all(entries["dropped"] > 0 for _, entries, _ in alone.values()), alone  # compression really decided
    assert all(hit_rate > 0 for rid, (_, _, hit_rate) in alone.items() if rid.startswith("1-"))


def _settings(model_dir, tmp_path, size: int) -> Settings:
    compression = tmp_path / "compression.json"
    compression.write_text(CompressionConfig(**COMPRESS_OFTEN).model_dump_json())
    return Settings(
        model_path=model_dir,
        tensor_parallel_size=size,
        torch_threads=1,
        max_cache_size="64",
        compression_config=compression,
        engine_iteration_timeout=60,
    )


def test_the_servers_followers_keep_up_and_a_rank_that_dies_stops_the_server(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CONFKV_CONFIDENCE_CACHE", str(tmp_path / "cache"))
    config = _settings(tiny_model_dir, tmp_path, 1).compression_config  # the timeline it will be served with
    fit = ["--out", str(tmp_path / "fitted"), "--sequences", "2", "--prompt-tokens", "96", "--compression-config"]
    main(["calibrate", "--model-path", str(tiny_model_dir), *fit, str(config)])
    fitted = tmp_path / "fitted" / PREDICTOR_FILE
    bodies = [
        {"prompt": prompt, "max_tokens": 32, "temperature": 0.0, "ignore_eos": True, "compression_stats": True}
        for prompt in PROMPTS
    ]
    answers = {}
    for size in (1, 2):
        settings = _settings(tiny_model_dir, tmp_path, size).model_copy(
            update={"calibration": CalibrationSettings(background=True)}
        )
        with TestClient(create_app(settings)) as client:  # reserves what a fitted predictor reads
            client.app.state.calibration.stop()
            replies = [client.post("/generate", json=body) for body in bodies]
            switched = client.app.state.engine.call(lambda e: e.use_confidence(fitted, None)).result(60)
            assert switched.state == "shipped" and switched.future_value is not None  # an order to the followers
            replies += [client.post("/generate", json=body) for body in bodies]
            assert all(reply.status_code == 200 for reply in replies), replies[0].text
            answers[size] = [(r.json()["text"], r.json()["compression_metrics"]) for r in replies]
            if size == 2:
                follower = client.app.state.engine.llm_engine.followers.processes[0]
                follower.kill()
                deadline = time.monotonic() + 20
                while client.get("/health").status_code == 200 and time.monotonic() < deadline:
                    time.sleep(0.2)
                health = client.get("/health")
                assert health.status_code == 503 and "rank 1" in health.json()["error"]
                refused = client.post("/generate", json=bodies[0])
                assert refused.status_code == 503
    for (text_one, metrics_one), (text_two, metrics_two) in zip(answers[1], answers[2], strict=True):
        assert text_two == text_one
        # every rank holds its share of the heads; a request's sizes are the whole model's
        assert metrics_two["original_size"] == metrics_one["original_size"]
        assert metrics_two["entries"] == metrics_one["entries"]


def test_a_size_the_model_cannot_split_is_refused_with_the_sizes_that_can(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)  # 4 attention heads, 2 KV heads
    check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="does not divide.*Sizes that do: 1, 2"):
        check_tensor_parallel(config, 4)
    with pytest.raises(ValueError, match="gpt2 models have no tensor-parallel plan"):
        check_tensor_parallel(AutoConfig.for_model("gpt2"), 2)
