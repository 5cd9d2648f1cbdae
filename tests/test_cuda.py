"""The CUDA paths, against the CPU: decode attention at the embedded model's sizes; the block writes,
byte for byte; generation with compression off and on, step by step on one model with random weights
(the embedded model's architecture: real weights need not travel to a GPU machine), its logits
compared with the CPU's; asynchronous compression (the worker's stream) against compressing between
steps; and generation under torch's CUDA sanitizer.

They run only where `torch.cuda.is_available()` (`make gpu-check` runs them, `pytest -m cuda` selects
them) and are skipped elsewhere. On CUDA the decode step reads the block pools through the same
interface as on the CPU, the KV budget is taken from the memory the weights and a forward pass at
the largest batch leave free, and every kernel must stay on one stream but the worker's plans with
`async_compression`, ordered against it by waits (the sanitizer would see any unordered use across
streams); these are what a CPU-only test suite cannot see.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from benchmarks.engine import decoding_engine, load_with_predictor
from confkv.compress.predictor.online import predictor_path
from confkv.engine.llm_engine import run_to_completion
from confkv.kv.attention import Segment
from confkv.kv.kv_layout import BLOCK_SIZE
from confkv.kv.kv_store import KVStore
from confkv.kv.paged_attention import (
    FORMAT_CODES,
    KEY_FORMATS,
    DecodeBatch,
    decode_attention,
    decode_attention_reference,
)
from confkv.models.default_model import MODEL_NAME
from confkv.models.loader import KVShape
from confkv.models.random_weights import random_model_path
from confkv.server.api import build_engine
from confkv.server.settings import Settings
from tests.helpers import ROOT, appends, make_pool, same_bytes, tokens_of, written_both_ways

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run make gpu-check on a GPU machine"),
]

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
ROWS, KEYS = 16, 2000  # decode rows and keys per row, as the decode-step benchmark runs them
# Greedy runs: a few corpus prompts decoding together, long enough for a compression during decoding.
SEQS, PROMPT_TOKENS, MAX_TOKENS = 4, 600, 24
OFF = {"policy": "none", "compression_rate": 0.0}
INT8 = {"policy": "dynamic", "compression_rate": 0.875, "kv_cache_dtype": "int8"}
# Both in fp32, summed in other orders over 600 keys and 30 layers: logits agree to about 1e-4 (a
# cache read wrongly moves them by tenths at least, this random model's logits spanning about 5).
FP32_LOGITS = 1e-2
# bf16 keeps 8 bits of mantissa: CUDA's bf16 run may differ from fp32 by its own rounding, which the
# CPU's bf16 run shows, times this (the two round in other orders).
BF16_MARGIN = 3.0


@dataclass
class Generated:
    tokens: list[int]
    logits: list[torch.Tensor]  # on the CPU, the logits each token was chosen from
    metrics: dict | None


# ----- decode attention at the model's sizes ------------------------------------------------


def real_batch(config, key_only_format: str, gen: torch.Generator) -> DecodeBatch:
    """ROWS rows of up to KEYS keys at the model's head counts and size, spread over every storage
    format, some rows with KEY_ONLY entries, every other row observed; tables share blocks at random."""
    shape = KVShape.of(config)
    formats = list(FORMAT_CODES)
    blocks = 2 * -(-KEYS // BLOCK_SIZE)
    pools = [make_pool(fmt, blocks, shape.num_kv_heads, BLOCK_SIZE, shape.head_dim, gen) for fmt in formats]
    pools.append(make_pool(key_only_format, blocks, shape.num_kv_heads, BLOCK_SIZE, shape.head_dim, gen))
    rows = torch.arange(ROWS)
    num_keys = KEYS - 7 * rows  # the first row holds KEYS exactly
    num_key_only = (rows % 3) * num_keys // 4  # none, a quarter, a half
    width = -(-KEYS // BLOCK_SIZE)

    def table(entries: torch.Tensor) -> torch.Tensor:
        t = torch.randint(0, blocks, (ROWS, width), generator=gen, dtype=torch.int32)
        for slot, n in enumerate(entries.tolist()):
            t[slot, -(-n // BLOCK_SIZE) :] = -1
        return t

    def value_pool(key_format: str) -> int:
        return formats.index("int4" if key_format in KEY_FORMATS else key_format)

    observed = rows[::2]
    observe_index = torch.full((ROWS,), -1, dtype=torch.int32)
    observe_index[observed] = torch.arange(len(observed) - 1, -1, -1, dtype=torch.int32)
    return DecodeBatch(
        query=torch.randn(ROWS, config.num_attention_heads, shape.head_dim, generator=gen) * 2,
        pools=pools,
        row_slot=torch.randperm(ROWS, generator=gen).int(),
        row_pool=(rows % len(formats)).int(),
        # int4c holds keys only: those rows' values are per-token int4.
        row_value_pool=torch.tensor([value_pool(formats[r % len(formats)]) for r in rows.tolist()]).int(),
        key_only_pool=len(pools) - 1,
        key_tables=table(num_keys),
        value_tables=table(num_keys - num_key_only),
        key_only_tables=table(num_key_only),
        num_keys=num_keys.int(),
        num_key_only=num_key_only.int(),
        block_size=BLOCK_SIZE,
        scale=shape.head_dim**-0.5,
        observe_index=observe_index,
        num_observed=len(observed),
    )


def to_device(batch: DecodeBatch, device: torch.device) -> DecodeBatch:
    """The same batch with every tensor on `device`."""
    pools = [dataclasses.replace(p, data=p.data.to(device)) for p in batch.pools]
    tensors = {
        f.name: value.to(device)
        for f in dataclasses.fields(batch)
        if isinstance(value := getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, pools=pools, **tensors)


@pytest.mark.parametrize("key_only_format", ["int4", "int8"])
def test_decode_attention_on_cuda_matches_the_cpu_reference(model_path, key_only_format):
    batch = real_batch(AutoConfig.from_pretrained(model_path), key_only_format, torch.Generator().manual_seed(0))
    got = decode_attention(to_device(batch, CUDA))
    want = decode_attention_reference(batch)
    assert got.out.device.type == "cuda"
    # Both in fp32, summed in another order over 2000 keys: agreement to about 1e-5 relative. A wrong
    # block, offset, scale or head would be off by whole units.
    torch.testing.assert_close(got.out.cpu(), want.out, rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(got.lse.cpu(), want.lse, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(got.observed.cpu(), want.observed, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_keys_stored_rotated_on_cuda_attend_as_on_the_cpu(storage):
    """Quantised keys are turned on the way into the pool (by the Triton block kernel on CUDA) and
    decode queries alike: the CUDA store must attend as the CPU one does, and turn keys back in its view."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 41, 64, generator=generator)
    keys[..., [3, 17, 40]] *= 25.0  # outlier channels, as trained keys have
    query = torch.randn(1, 4, 64, generator=generator)
    outs, views = {}, {}
    for device in (CPU, CUDA):
        store = KVStore(1, 2, 64, 10**8, storage=storage, device=device)
        for start, n in ((0, 40), (40, 1)):  # a prefill chunk, then a decode step
            store.reserve(1, n)
            plan = store.begin_step([Segment(1, 0, n)], torch.arange(start, start + n, device=device))
            store.write(0, plan, keys[:, start : start + n].to(device), -keys[:, start : start + n].to(device))
        outs[device.type] = decode_attention(store.decode_batch(0, plan, query.to(device), 0.125)).out.cpu()
        views[device.type] = store.view(1, 0).keys.cpu()
    # The same codes but where a turned key lands within rounding of a level boundary.
    torch.testing.assert_close(views["cuda"], views["cpu"], rtol=0.0, atol=0.2 if storage == "int4" else 0.05)
    torch.testing.assert_close(outs["cuda"], outs["cpu"], rtol=0.0, atol=0.05)


# A constant vector's int4 scale rounds to 0 in float16: its codes divide by zero, as torch's do.
@pytest.mark.filterwarnings("ignore:.* encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("writer", ["triton", "torch"])
# Few cases: each new shape, format and dtype compiles the kernel anew, within the tests' time limit.
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=appends(), seed=st.integers(0, 2**31))
def test_block_writes_on_cuda_store_the_bytes_the_cpu_stores(writer, case, seed):
    """The compiled Triton row writer (and torch's path on CUDA) against the CPU's torch path, byte for
    byte: the interpreter runs the Triton kernel's logic on CPU, but only a GPU runs its division,
    rounding and casts as compiled."""
    fmt, x = case
    reference, written = written_both_ways(writer, x, fmt, seed, device=CUDA)
    assert written.data.device.type == "cuda" and (written._triton is not None) == (writer == "triton")
    assert same_bytes(written.data.cpu(), reference.data)


# ----- generation on CUDA against the CPU, on one model with random weights ----------------------


@pytest.fixture(scope="module")
def model_path() -> Path:
    """The embedded model's architecture with random weights: the same model on every machine, with
    nothing to download (on a GPU machine offline, the bundle's model cache holds it)."""
    return random_model_path(MODEL_NAME)


@pytest.fixture(scope="module")
def cpu_fp32(model_path) -> tuple:
    """The model (built on the CPU from its seed), its tokenizer and the embedded model's value
    predictor, which fits its shape (how it was trained does not matter to the comparison)."""
    return load_with_predictor(model_path, predictor_path(None))


def placed(loaded: tuple, device: torch.device, dtype: torch.dtype) -> tuple:
    """A copy of the loaded model and predictor on `device`, the model in `dtype`."""
    model, tokenizer, future_value = loaded
    predictor = copy.deepcopy(future_value)
    predictor.predictor.to(device)
    return copy.deepcopy(model).to(device, dtype), tokenizer, predictor


def generate(
    loaded: tuple,
    request: dict,
    forced: list[list[int]] | None = None,
    seqs: int = SEQS,
    async_compression: bool = False,
) -> list[Generated]:
    """`seqs` corpus prompts decoded together by the engine as the benchmarks build it (greedy, EOS
    ignored), compressed as `request` asks: their tokens, compression_metrics and the logits each
    token was chosen from. With `forced`, each sequence decodes those tokens instead of its own
    choices (teacher forcing), so that two runs' logits can be compared step by step."""
    engine = decoding_engine(
        *loaded, request, seqs, PROMPT_TOKENS, MAX_TOKENS, stats=True, async_compression=async_compression
    )
    index = {seq.seq_id: int(request_id) for request_id, seq in engine.outputs.requests.items()}
    logits: dict[int, list[torch.Tensor]] = defaultdict(list)

    def keep(chunks, rows: torch.Tensor) -> None:
        for chunk, row in zip([c for c in chunks if c.needs_logits], rows, strict=True):
            i = index[chunk.seq_id]
            logits[i].append(row.to(CPU, torch.float32, copy=True))
            if forced is not None:  # the sampler's choice is the forced token
                row[forced[i][len(logits[i]) - 1]] = row.max() + 100.0

    engine.runner.after_forward.append(keep)
    with torch.inference_mode():
        outputs = run_to_completion(engine)
    assert [(outs[-1].finish_reason, outs[-1].error) for outs in outputs.values()] == [("length", None)] * seqs
    assert engine.store.used_bytes == 0
    return [
        Generated(tokens_of(outputs[str(i)]), logits[i], outputs[str(i)][-1].compression_metrics) for i in range(seqs)
    ]


def logit_error(got: list[Generated], want: list[Generated], steps: int = MAX_TOKENS) -> float:
    """The largest difference between two runs' logits over their first `steps` tokens."""
    return max(
        float((a - b).abs().max())
        for g, w in zip(got, want, strict=True)
        for a, b in zip(g.logits[:steps], w.logits[:steps], strict=True)
    )


@pytest.fixture(scope="module", autouse=True)
def every_core() -> Iterator[None]:
    """The CPU runs are the references of the CUDA ones: on a GPU machine they take every core (the
    suite's two would spend most of `make gpu-check`'s time on them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or before)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_logits_on_cuda_follow_the_cpu_step_by_step(cpu_fp32):
    """Compression off, every step teacher-forced to the CPU run's tokens: in fp32 CUDA computes the
    CPU's logits (a cache read wrongly, a block, position or scale, moves them by whole units); in
    bf16 it is no further from them than the CPU's own bf16 run."""
    want = generate(cpu_fp32, OFF)
    forced = [w.tokens for w in want]
    fp32 = generate(placed(cpu_fp32, CUDA, torch.float32), OFF, forced)
    assert [g.tokens for g in fp32] == forced
    assert logit_error(fp32, want) < FP32_LOGITS
    bf16_error = logit_error(generate(placed(cpu_fp32, CUDA, torch.bfloat16), OFF, forced), want)
    cpu_bf16_error = logit_error(generate(placed(cpu_fp32, CPU, torch.bfloat16), OFF, forced), want)
    assert bf16_error <= BF16_MARGIN * cpu_bf16_error + FP32_LOGITS, (bf16_error, cpu_bf16_error)


@pytest.mark.slow
def test_compression_on_cuda_holds_what_it_holds_on_the_cpu(cpu_fp32):
    """int8 at rate 0.875, both in fp32 so that both budgets are the same bytes. Which entries each
    keeps may differ where a score is a near-tie, so logits are compared up to the first compression
    (the prefill's token), and how much each holds, which the budget sets. Not teacher-forced: the
    model's confidence in its own tokens takes part in the budget."""
    want = generate(cpu_fp32, INT8)
    got = generate(placed(cpu_fp32, CUDA, torch.float32), INT8)
    assert logit_error(got, want, steps=1) < FP32_LOGITS
    for g, w in zip(got, want, strict=True):
        assert len(g.tokens) == MAX_TOKENS
        on, off = g.metrics, w.metrics
        assert on["policy"] == off["policy"] == "dynamic"
        assert on["original_size"] == off["original_size"] and on["ceiling_size"] == off["ceiling_size"]
        assert sum(on["entries"].values()) == sum(off["entries"].values())
        assert on["entries"]["dropped"] > 0  # int8 alone holds about a quarter of the fp32 bytes
        # Held bytes follow the budget, which both share: ratio and tiers agree to a few percent, however
        # near-ties ranked the entries (between prompts they differ by about as much).
        assert abs(on["compression_ratio"] - off["compression_ratio"]) < 0.05
        total = sum(off["entries"].values())
        for tier in ("full", "key_only", "dropped"):
            assert abs(on["entries"][tier] - off["entries"][tier]) <= 0.05 * total, tier


def test_asynchronous_compression_on_cuda_holds_what_compressing_between_steps_holds(cpu_fp32):
    """With `async_compression` the worker plans on a stream of its own beside the forward pass. The
    two runs batch differently (a compressing sequence sits a step out), so on CUDA their sums may
    round apart: logits agree up to the first compression, then tokens and held bytes must agree
    as the budget sets them."""
    loaded = placed(cpu_fp32, CUDA, torch.float32)
    want = generate(loaded, INT8)
    got = generate(loaded, INT8, async_compression=True)
    assert logit_error(got, want, steps=1) < FP32_LOGITS
    for g, w in zip(got, want, strict=True):
        assert len(g.tokens) == MAX_TOKENS
        assert g.metrics["original_size"] == w.metrics["original_size"]
        assert abs(g.metrics["compression_ratio"] - w.metrics["compression_ratio"]) < 0.05
        assert g.metrics["entries"]["dropped"] > 0


def generate_both_on_cuda() -> None:
    """Generation on CUDA in bf16, compression off, on, and on planned beside the forward pass on
    the worker's stream, with fewer sequences (what the sanitizer test runs: it checks every kernel
    launch from Python, which is slow)."""
    model = load_with_predictor(random_model_path(MODEL_NAME), predictor_path(None), CUDA, torch.bfloat16)
    for request, asynchronous in ((OFF, False), (INT8, False), (INT8, True)):
        generate(model, request, seqs=2, async_compression=asynchronous)
    torch.cuda.synchronize()


@pytest.mark.slow
def test_generation_on_cuda_passes_the_cuda_sanitizer():
    """torch's CUDA sanitizer (CSAN) checks every kernel's reads and writes across streams: nothing
    in a step (forward pass, sampling, compression, the worker's plans on their own stream) may
    touch a tensor from an unordered stream."""
    run = subprocess.run(
        [sys.executable, "-c", "from tests.test_cuda import generate_both_on_cuda; generate_both_on_cuda()"],
        cwd=ROOT,
        env={**os.environ, "TORCH_CUDA_SANITIZER": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "CSAN" not in run.stderr, run.stderr[-4000:]


def test_a_share_of_cuda_memory_is_a_share_of_what_the_weights_and_activations_leave(model_path):
    """`max_cache_size: 50%` on CUDA: half of the memory free once the model is loaded and a forward
    pass of the largest step has run (its activation peak stays available), and the server starts."""
    settings = Settings(model_path=model_path, device="cuda", max_cache_size="50%", max_num_batched_tokens=2048)
    torch.cuda.reset_peak_memory_stats(CUDA)
    engine, _ = build_engine(settings)
    free, _ = torch.cuda.mem_get_info(CUDA)
    unused = free + torch.cuda.memory_reserved(CUDA) - torch.cuda.memory_allocated(CUDA)
    peak_activations = torch.cuda.max_memory_allocated(CUDA) - torch.cuda.memory_allocated(CUDA)
    assert peak_activations > 0, "the forward pass at the largest batch did not run before the budget"
    assert engine.max_cache_bytes == pytest.approx((unused - peak_activations) / 2, rel=0.02)
