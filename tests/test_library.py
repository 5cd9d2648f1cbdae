"""DynamicKVCompressor with a plain transformers model and its own generate (no server)."""

from __future__ import annotations

import torch

from confkv import DynamicKVCompressor
from tests.helpers import tiny_model


def prompt_ids(n: int, vocab: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(n)
    return torch.randint(3, vocab, (1, n), generator=generator)


def test_policy_none_is_token_identical_to_generate(tokenizer):
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    ids = prompt_ids(120, len(tokenizer))
    want = model.generate(ids, max_new_tokens=20, do_sample=False)
    compressor = DynamicKVCompressor(max_cache_size=64, policy="none")
    got = compressor.generate(model, ids, max_new_tokens=20, do_sample=False)
    assert torch.equal(got, want)
    metrics = compressor.metrics()
    assert metrics.entries["dropped"] == 0 and metrics.policy == "none"
    assert model.config._attn_implementation == "sdpa"  # detached afterwards
    assert torch.equal(model.generate(ids, max_new_tokens=20, do_sample=False), want)


def test_dynamic_compresses_within_the_rate_and_reports_metrics(tokenizer):
    model = tiny_model("qwen2", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    ids = prompt_ids(300, len(tokenizer))
    compressor = DynamicKVCompressor(
        max_cache_size="64MiB", prediction_window=128, compression_rate=0.8, compression_interval=8
    )
    out = compressor.generate(model, ids, max_new_tokens=24, do_sample=False, eos_token_id=None)
    assert out.shape[1] == 300 + 24
    metrics = compressor.metrics()
    slack = (8 + 32) * compressor.store.model_token_bytes  # one interval plus chunk rounding
    assert metrics.compressed_size <= 0.2 * metrics.original_size + slack
    assert metrics.entries["dropped"] > 0
    assert 0.0 < metrics.recall_rate <= 1.0
    assert metrics.policy == "dynamic"
