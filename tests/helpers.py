"""Shared test helpers: tiny random models, a live server on loopback, reference generation."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from app.engine import EngineConfig, LLMEngine
from app.outputs import RequestOutput
from app.sequence import SamplingParams
from compression.attention import Segment
from compression.config import CompressionConfig
from compression.kv_store import KVStore
from compression.paged_attention import PoolTensors
from compression.quant import quantize
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
TINY_CONFIGS = {
    "llama": dict(model_type="llama", **_DECODER),
    "qwen2": dict(model_type="qwen2", **_DECODER),
    "mistral": dict(model_type="mistral", **_DECODER),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512),
}


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


def make_pool(
    fmt: str, num_blocks: int, kv_heads: int, block_size: int, head_dim: int, gen: torch.Generator
) -> PoolTensors:
    """A pool whose codes and parameters come from quantising random vectors, as the KV store writes them."""
    x = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    # Per-vector offsets and magnitudes, so int4 minima and scales vary.
    x = x * torch.rand(num_blocks, block_size, kv_heads, 1, generator=gen).mul(2).add(0.1)
    x = x + torch.randn(num_blocks, block_size, kv_heads, 1, generator=gen) * 0.5
    if fmt in ("float32", "float16", "bfloat16"):
        return PoolTensors(x.to(getattr(torch, fmt)), None, fmt)
    q = quantize(x, 8 if fmt == "int8" else 4)
    params = q.scale.unsqueeze(-1) if fmt == "int8" else torch.stack((q.scale, q.minimum), dim=-1)
    return PoolTensors(q.codes, params, fmt)


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

    def __init__(self, *args: str, env: dict[str, str] | None = None, api_key: str | None = None) -> None:
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            str(ROOT / "serve.py"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--torch-threads",
            "2",
            *args,
        ]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"conf-kv-test-{self.port}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
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
