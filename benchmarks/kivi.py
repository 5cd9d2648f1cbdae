"""KIVI as published (Liu et al., 2024), the quality benchmark's quantisation anchor.

Keys are quantised per channel over groups of `GROUP` tokens, values per token over groups of
`GROUP` channels, both asymmetric with a float16 scale and minimum per group; the newest tokens
stay at full precision (the residual). It runs on the plain transformers model: the prompt is
prefilled, its cache quantised and dequantised in place (what the model then reads is exactly what
KIVI stores), and the answer is decoded greedily. Its tokens stay in the residual, as KIVI's
residual of `RESIDUAL` to `RESIDUAL + GROUP` tokens holds a short answer whole.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

GROUP = 32
RESIDUAL = 32
PARAM_BITS = 32  # a float16 scale and minimum per group


def fake_quantize(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """`x` quantised asymmetrically to `bits` over groups of `GROUP` along `dim`, and dequantised."""
    moved = x.movedim(dim, -1)
    groups = moved.reshape(*moved.shape[:-1], moved.shape[-1] // GROUP, GROUP)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp_min(1e-8).half().float()
    lo = lo.half().float()
    codes = torch.round((groups - lo) / scale).clamp_(0, 2**bits - 1)
    return (codes * scale + lo).reshape(moved.shape).movedim(-1, dim)


def quantized_tokens(n: int) -> int:
    """Of a prompt of `n` tokens, how many KIVI holds quantised: whole groups, the residual left out."""
    return max(0, (n - RESIDUAL) // GROUP * GROUP)


def memory_kept(n: int, bits: int, model_bits: int) -> float:
    """KIVI's bytes over the uncompressed cache's, for a cache of `n` tokens (keys and values alike:
    `bits` per element and a scale and minimum per group of `GROUP` elements)."""
    quantized = quantized_tokens(n)
    return (quantized * (bits + PARAM_BITS / GROUP) + (n - quantized) * model_bits) / (n * model_bits)


@torch.inference_mode()
def generate(model: PreTrainedModel, prompt: list[int], bits: list[int], max_tokens: int) -> dict[int, list[int]]:
    """Greedy answers of up to `max_tokens` to `prompt` with the prompt's cache held by KIVI at each of
    `bits` (one prefill serves them all); EOS ends an answer."""
    ids = torch.tensor([prompt], device=model.device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :-1], past_key_values=cache, use_cache=True)
    stored = [(layer.keys, layer.values) for layer in cache.layers]
    quantized = quantized_tokens(len(prompt) - 1)
    eos = model.generation_config.eos_token_id
    stops = set(eos) if isinstance(eos, list) else {eos}
    answers = {}
    for width in bits:
        for layer, (keys, values) in zip(cache.layers, stored, strict=True):  # [batch, kv heads, tokens, dim]
            old_keys, old_values = keys[:, :, :quantized], values[:, :, :quantized]
            layer.keys = torch.cat((fake_quantize(old_keys, width, dim=2), keys[:, :, quantized:]), 2)
            layer.values = torch.cat((fake_quantize(old_values, width, dim=3), values[:, :, quantized:]), 2)
        answer, token = [], ids[:, -1:]
        for _ in range(max_tokens):
            logits = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
            token = logits.argmax(-1, keepdim=True)
            answer.append(int(token))
            if int(token) in stops:
                break
        answers[width] = answer
    return answers
