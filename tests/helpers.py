"""Shared test helpers: tiny random models, a live server on loopback, reference generation, random
block pools and decode batches."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from confkv.compress.config import CompressionConfig
from confkv.engine.llm_engine import EngineConfig, LLMEngine
from confkv.engine.outputs import RequestOutput
from confkv.engine.sequence import SamplingParams
from confkv.kv import kernels
from confkv.kv.arena import Arena
from confkv.kv.attention import Segment
from confkv.kv.block_pool import BlockPool, Codec
from confkv.kv.block_tables import ParkedKV
from confkv.kv.kv_store import KVStore
from confkv.kv.paged_attention import (
    FORMAT_CODES,
    KEY_FORMATS,
    KEY_ONLY_FORMATS,
    DecodeBatch,
    DecodeResult,
)
from load_tests.monitoring import free_port

ROOT = Path(__file__).resolve().parent.parent

_DECODER = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
# Compression settings under which a short prompt on a small model compresses often, every stage seen.
COMPRESS_OFTEN = {"sink_tokens": 4, "recent_window": 16, "compression_interval": 8, "score_interval": 2}
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
# One small config of every family the loader serves (`confkv.models.loader.FAMILIES`).
TINY_CONFIGS = {
    "llama": dict(model_type="llama", **_DECODER),
    "mistral": dict(model_type="mistral", sliding_window=24, **_DECODER),  # every layer slides
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **_DECODER),
    "qwen2": dict(model_type="qwen2", **_DECODER),
    "qwen2_moe": dict(model_type="qwen2_moe", shared_expert_intermediate_size=32, **_EXPERTS, **_DECODER),
    "qwen3": dict(model_type="qwen3", head_dim=16, **_DECODER),  # q and k normalised per head
    "qwen3_moe": dict(model_type="qwen3_moe", head_dim=16, **_EXPERTS, **_DECODER),
    "phi3": dict(model_type="phi3", **_DECODER),  # one fused qkv projection
    "granite": dict(model_type="granite", attention_multiplier=0.1, embedding_multiplier=2.0, **_DECODER),
    "olmo2": dict(model_type="olmo2", **_DECODER),
    # A sliding layer beside a full one, its window shorter than most prompts.
    "gemma3_text": dict(
        model_type="gemma3_text",
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        **_DECODER,
    ),  # fmt: skip
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512),
}


def tiers(plan) -> tuple[set[int], set[int], set[int]]:
    """A tier plan's (FULL, KEY_ONLY, dropped) entries."""
    return tuple(set(t.tolist()) for t in (plan.keep_full, plan.keep_key_only, plan.dropped))


def tiny_model(family: str, vocab_size: int, eos_token_id: int, seed: int = 0) -> PreTrainedModel:
    """A small random model; a wide initialisation keeps logits well separated (few near-ties)."""
    torch.manual_seed(seed)
    kwargs = dict(TINY_CONFIGS[family])
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
        bos_token_id=eos_token_id,
        initializer_range=0.2,
        **kwargs,
    )
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def check_references(store: KVStore, parked: list[ParkedKV] = ()) -> None:
    """Every block's reference count is the number of tables (running or parked) that hold it, and
    the account is the blocks in use and the parked caches' bookkeeping."""
    expected = {name: Counter() for name in store.allocator.pools}
    for slot, pools in store.tables.pools.items():
        for kind, pool in enumerate(pools):
            for layer in range(store.num_layers):
                held = store.tables.held(kind, layer, slot)
                expected[pool.codec.name].update(held.tolist())
    for cache in parked:
        names = (cache.codec.name, cache.codec.values.name, store.allocator.key_only_pool.codec.name)
        for name, layers in zip(names, cache.tables, strict=True):
            for blocks in layers:
                expected[name].update(blocks.tolist())
    used, lent = 0, []
    for name, pool in store.allocator.pools.items():
        assert pool.held() == dict(expected[name]), name
        # Every block inside the pages a pool holds is free or in use, never both; none lies outside them.
        inside = {b for page in pool.pages for b in store.allocator.arena.blocks_in(page, pool.block_bytes)}
        held = pool.held()
        assert set(pool.free_blocks).isdisjoint(held) and set(pool.free_blocks) | set(held) == inside
        in_use = {
            page for page in pool.pages if set(store.allocator.arena.blocks_in(page, pool.block_bytes)) & held.keys()
        }
        assert pool.empty_pages == len(pool.pages) - len(in_use)
        used += pool.used_blocks * pool.block_bytes
        lent += pool.pages
    assert (
        len(lent) == len(set(lent)) and len(lent) + store.allocator.arena.free_pages == store.allocator.arena.num_pages
    )
    assert store.used_bytes == used + sum(cache.bookkeeping_bytes for cache in parked)
    assert store.allocator.allocated_bytes == store.allocator.arena.nbytes


def fill_store(store: KVStore, seq_id: int, n: int, start: int = 0, keys=None) -> None:
    """Reserve and write n entries (positions start..start+n-1) into every layer of a sequence.

    Keys are `keys(layer)` ([kv_heads, n, head_dim]) or, by default, the position in every
    component; values are the keys negated.
    """
    store.reserve(seq_id, n)
    plan = store.begin_step([Segment(seq_id, 0, n)], torch.arange(start, start + n))
    for layer in range(store.num_layers):
        if keys is None:
            k = torch.arange(start, start + n, dtype=torch.float32).view(1, n, 1)
            k = k.expand(store.num_kv_heads, n, store.head_dim).contiguous()
        else:
            k = keys(layer)
        store.write(layer, plan, k, -k)


def make_engine(model, tokenizer, max_cache_bytes: int = 2**30, compression: dict | None = None, **kwargs) -> LLMEngine:
    """An engine; without `compression` settings it does not compress (policy none)."""
    config = CompressionConfig(**(compression or {"policy": "none"}))
    return LLMEngine(model, tokenizer, EngineConfig(max_cache_bytes=max_cache_bytes, **kwargs), config)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def text_of(outputs: list[RequestOutput]) -> str:
    return "".join(o.delta_text for o in outputs)


@torch.inference_mode()
def reference_greedy(model: PreTrainedModel, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers `generate`, one request alone: tokens and the logits of each step."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.config.eos_token_id,
        eos_token_id=None,
    )
    return out.sequences[0, len(prompt_ids) :].tolist(), torch.cat(out.logits).float()


class LiveServer:
    """`serve.py` started as a real process on loopback."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
        launcher: list[str] | None = None,
        cwd: Path = ROOT,
        torch_threads: int = 2,
    ) -> None:
        """`launcher`: what starts the server (default: this checkout's serve.py), run in `cwd`."""
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            *(launcher or [sys.executable, str(ROOT / "serve.py")]),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--torch-threads",
            str(torch_threads),
            *args,
        ]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"conf-kv-test-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1, headers=self.headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_path.read_text()[-4000:]}")

    def metric(self, name: str, labels: str = "") -> float:
        """Read one sample from /metrics, e.g. metric('kv_cache_bytes', '{pool="running"}')."""
        text = httpx.get(f"{self.url}/metrics", timeout=10, headers=self.headers).text
        for line in text.splitlines():
            if line.startswith(name + labels + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name + labels)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


KEY_STORAGE_FORMATS = [f for f in FORMAT_CODES if f not in KEY_ONLY_FORMATS]  # of keys
FORMATS = [f for f in KEY_STORAGE_FORMATS if f not in KEY_FORMATS]  # of keys and FULL values
KEY_ONLY_VALUE_FORMATS = [f for f in FORMAT_CODES if f not in KEY_FORMATS]


def storage(fmt: str) -> torch.dtype | str:
    """A format's name as `Codec` takes it."""
    return fmt if fmt.startswith("int") else getattr(torch, fmt)


def block_pool(
    fmt: str, kv_heads: int, head_dim: int, blocks: int, writer: str, device: torch.device | str = "cpu"
) -> BlockPool:
    """An empty pool of `blocks` blocks of 4 entries on `device` whose writes take `writer`'s path:
    "torch", "c++" (the CPU extension) or "triton" (compiled on CUDA, interpreted on CPU)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "triton_enabled", lambda device: writer == "triton")
        if writer == "torch":
            patch.setenv("CONFKV_DISABLE_KERNEL", "1")
        codec = Codec(storage(fmt), head_dim)
        block_bytes = kv_heads * 4 * codec.vector_bytes
        arena = Arena(blocks * block_bytes, block_bytes, device=device)
        pool = BlockPool(codec, kv_heads, block_size=4, arena=arena)
    pool.allocate(blocks)
    return pool


def written_both_ways(
    writer: str, x: torch.Tensor, fmt: str, seed: int, device: torch.device | str = "cpu"
) -> tuple[BlockPool, BlockPool]:
    """x [n, kv_heads, head_dim] written at the same random rows of two fresh pools, one on the CPU's
    torch path and one on `device` taking `writer`'s path (see `block_pool`): (torch's, writer's)."""
    n, kv_heads, head_dim = x.shape
    reference = block_pool(fmt, kv_heads, head_dim, 4, "torch")
    pool = block_pool(fmt, kv_heads, head_dim, 4, writer, device)
    rows = torch.randperm(16, generator=torch.Generator().manual_seed(seed))[:n]
    reference.write(rows, x)
    pool.write(rows.to(device), x.to(device))
    return reference, pool


def same_bytes(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a.contiguous().flatten().view(torch.uint8), b.contiguous().flatten().view(torch.uint8))


@st.composite
def appends(draw: st.DrawFn, formats: list[str] = FORMATS) -> tuple[str, torch.Tensor]:
    """A storage format of `formats` and new entries x [n, kv_heads, head_dim] in a model dtype, some of
    them where rounding ties or degenerate ranges are common."""
    fmt = draw(st.sampled_from(formats))
    n, kv_heads = draw(st.integers(1, 12)), draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([8, 16, 64] if fmt == "int2" else [4, 8, 16, 64]))  # int2 rows: 16-bit aligned
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    kind = draw(st.sampled_from(["random", "ties", "constant", "signed zeros"]))
    shape = (n, kv_heads, head_dim)
    if kind == "random":
        x = torch.randn(shape, generator=gen) * torch.rand(n, kv_heads, 1, generator=gen).mul(4)
        x = x + torch.randn(n, kv_heads, 1, generator=gen)
    elif kind == "ties":
        # Halves on a grid whose int8 scale (range 127) or int4 scale (range 0..15) is exactly 1.
        if fmt == "int4":
            x = torch.randint(0, 31, shape, generator=gen) / 2.0
            x[..., 0], x[..., 1] = 0.0, 15.0
        else:
            x = torch.randint(-254, 255, shape, generator=gen) / 2.0
            x[..., 0] = 127.0
    elif kind == "constant":
        x = torch.randn(n, kv_heads, 1, generator=gen).expand(shape) * torch.randint(0, 2, (n, 1, 1), generator=gen)
    else:  # 0.0 and -0.0 mixed: which one a minimum keeps depends on the order it reduces in
        x = torch.zeros(shape) * torch.randn(shape, generator=gen)
    x = x.to(draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])))
    if draw(st.booleans()):
        x = x.transpose(0, 1).contiguous().transpose(0, 1)  # strided, as the KV store's entries are
    return fmt, x


def make_pool(fmt: str, num_blocks: int, kv_heads: int, block_size: int, head_dim: int, gen: torch.Generator):
    """A pool whose codes and parameters come from quantising random vectors, as the KV store writes them."""
    x = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    # Per-vector offsets and magnitudes, so int4 minima and scales vary.
    x = x * torch.rand(num_blocks, block_size, kv_heads, 1, generator=gen).mul(2).add(0.1)
    x = x + torch.randn(num_blocks, block_size, kv_heads, 1, generator=gen) * 0.5
    codec = Codec(storage(fmt), head_dim, block_size)
    block_bytes = kv_heads * block_size * codec.vector_bytes
    pool = BlockPool(codec, kv_heads, block_size, Arena(num_blocks * block_bytes, block_bytes))
    blocks = torch.tensor(pool.allocate(num_blocks))
    if fmt == "int4c":
        pool.write_blocks(blocks, x, torch.full((num_blocks,), block_size))
    else:
        rows = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()
        pool.write_encoded(rows, *pool.codec.encode(x.flatten(0, 1)))
    return pool.tensors()


@st.composite
def batches(draw: st.DrawFn, max_keys: int = 300) -> DecodeBatch:
    block_size = draw(st.sampled_from([4, 16]))
    kv_heads = draw(st.integers(1, 3))
    # Groups of 1-8 query heads take the kernel's vector path (a register each), more its portable loops.
    heads = kv_heads * draw(st.sampled_from([1, 2, 3, 4, 5, 8, 9]))
    # int4c spreads 2 x head_dim params over a block's rows; the vector path reads whole chunks of 32.
    head_dim = draw(st.sampled_from([8, 16, 32, 64, 128]))
    rows = draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    # Key pools, then a pool of per-token values for the rows whose key format holds no values.
    formats = draw(st.lists(st.sampled_from(KEY_STORAGE_FORMATS), min_size=1, max_size=3))
    value_format = draw(st.sampled_from(FORMATS))
    key_only_format = draw(st.sampled_from(KEY_ONLY_VALUE_FORMATS))
    pool_formats = [*formats, value_format, key_only_format]
    blocks = [draw(st.integers(1, 40)) for _ in pool_formats]
    pools = [make_pool(f, n, kv_heads, block_size, head_dim, gen) for f, n in zip(pool_formats, blocks, strict=True)]
    key_only_pool = len(pools) - 1

    # Some slots are held by no row; rows take slots in any order.
    slots = rows + draw(st.integers(0, 2))
    row_slot = torch.randperm(slots, generator=gen)[:rows].int()
    row_pool = torch.tensor([draw(st.integers(0, len(formats) - 1)) for _ in range(rows)], dtype=torch.int32)
    row_value_pool = torch.tensor([len(formats) if formats[p] in KEY_FORMATS else p for p in row_pool.tolist()])
    row_value_pool = row_value_pool.int()
    slot_pool = torch.zeros(slots, dtype=torch.long)
    slot_pool[row_slot.long()] = row_pool.long()
    slot_value_pool = torch.full((slots,), len(formats), dtype=torch.long)
    slot_value_pool[row_slot.long()] = row_value_pool.long()
    num_keys = torch.tensor([draw(st.integers(1, max_keys)) for _ in range(slots)], dtype=torch.int32)
    num_key_only = torch.tensor([draw(st.integers(0, int(n))) for n in num_keys], dtype=torch.int32)
    max_blocks = -(-max_keys // block_size) + draw(st.integers(0, 2))

    def tables(pool_of_slot: list[int]) -> torch.Tensor:
        # Random block ids: out of order, repeated within a table and shared between slots; -1 past the end.
        t = torch.full((slots, max_blocks), -1, dtype=torch.int32)
        for s, p in enumerate(pool_of_slot):
            t[s] = torch.randint(0, blocks[p], (max_blocks,), generator=gen, dtype=torch.int32)
        return t

    def trim(t: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        for s, n in enumerate(entries.tolist()):
            t[s, -(-n // block_size) :] = -1
        return t

    key_tables = trim(tables(slot_pool.tolist()), num_keys)
    value_tables = trim(tables(slot_value_pool.tolist()), num_keys - num_key_only)
    key_only_tables = trim(tables([key_only_pool] * slots), num_key_only)

    observe = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    num_observed = sum(observe) + draw(st.integers(0, 1))
    order = torch.randperm(num_observed, generator=gen).tolist()
    observe_index = torch.tensor([order.pop() if o else -1 for o in observe], dtype=torch.int32)
    query = torch.randn(rows, heads, head_dim, generator=gen) * draw(st.sampled_from([0.5, 2.0, 8.0]))
    return DecodeBatch(
        query=query,
        pools=pools,
        row_slot=row_slot,
        row_pool=row_pool,
        row_value_pool=row_value_pool,
        key_only_pool=key_only_pool,
        key_tables=key_tables,
        value_tables=value_tables,
        key_only_tables=key_only_tables,
        num_keys=num_keys,
        num_key_only=num_key_only,
        block_size=block_size,
        scale=head_dim**-0.5,
        observe_index=observe_index,
        num_observed=num_observed,
        window=draw(st.sampled_from([0, 0, 1, 7, 40])),  # a sliding-window layer's, or none
    )


def assert_matches(result: DecodeResult, expected: DecodeResult) -> None:
    # float32 accumulated in another order (and exp approximated): agreement to a few 1e-6 relative.
    # An output is a weighted sum of values, so its rounding error scales with the largest of them,
    # not with the output itself (a near-zero output of large values carries their error).
    scale = max(1.0, float(expected.out.abs().max())) if expected.out.numel() else 1.0
    torch.testing.assert_close(result.out, expected.out, rtol=1e-4, atol=1e-5 * scale)
    torch.testing.assert_close(result.lse, expected.lse, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(result.observed, expected.observed, rtol=1e-4, atol=1e-6)


def small_batch(
    num_keys: list[int], num_key_only: list[int], fmt: str = "int8", key_only_fmt: str | None = None
) -> DecodeBatch:
    """Rows 0..len-1 on slots 0..len-1, every row observed, contiguous tables; KEY_ONLY values in the
    rows' pool, or with `key_only_fmt` in a pool of their own."""
    gen = torch.Generator().manual_seed(0)
    rows, kv_heads, heads, head_dim, block_size, max_blocks = len(num_keys), 2, 4, 16, 4, 8
    pools = [make_pool(f, rows * max_blocks, kv_heads, block_size, head_dim, gen) for f in (fmt, key_only_fmt) if f]
    table = torch.arange(rows * max_blocks, dtype=torch.int32).view(rows, max_blocks)
    return DecodeBatch(
        query=torch.randn(rows, heads, head_dim, generator=gen),
        pools=pools,
        row_slot=torch.arange(rows, dtype=torch.int32),
        row_pool=torch.zeros(rows, dtype=torch.int32),
        row_value_pool=torch.zeros(rows, dtype=torch.int32),
        key_only_pool=len(pools) - 1,
        key_tables=table,
        value_tables=table.flip(1).contiguous(),
        key_only_tables=table.roll(1, 0).contiguous(),
        num_keys=torch.tensor(num_keys, dtype=torch.int32),
        num_key_only=torch.tensor(num_key_only, dtype=torch.int32),
        block_size=block_size,
        scale=head_dim**-0.5,
        observe_index=torch.arange(rows, dtype=torch.int32),
        num_observed=rows,
    )


# Changes to small_batch([5, 5], [2, 0]) that a kernel must reject rather than read out of bounds.
INCONSISTENT = [
    {"key_tables": torch.full((2, 8), 99, dtype=torch.int32)},  # a block outside the pool
    {"row_slot": torch.tensor([0, 2], dtype=torch.int32)},
    {"observe_index": torch.tensor([1, 1], dtype=torch.int32)},
    {"num_key_only": torch.tensor([6, 0], dtype=torch.int32)},  # more KEY_ONLY entries than entries
    {"num_keys": torch.tensor([40, 5], dtype=torch.int32)},  # more entries than the table holds
]
