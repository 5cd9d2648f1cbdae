"""How much each key format moves attention, on the default model's own keys and queries.

Every layer's post-RoPE queries and keys are captured while the model reads texts (the benchmark
corpus, far from the needle haystacks' start); each format's keys are quantised and dequantised as
it stores them, and the last `--queries` queries of each text attend to them. What is compared is
attention itself: KL(exact || quantised) per (query, head), and how often the most attended key
stays the same, averaged over layers, heads and queries, the median over texts. Values are left
exact, so the figure is the keys' share of the error.

Formats, at the bits per element they cost (parameters included):
- per-token int8 and int4, as the KV store kept them before rotation (one scale, and a minimum below
  8 bits, per head vector);
- the same turned by the store's key rotation first (`confkv.kv.quant.random_rotation`), as int4 keys
  are stored now;
- KIVI's keys, per channel over groups of 32 tokens (`benchmarks/kivi.py`), 4 and 2 bits.

    python benchmarks/key_quantization/run.py          # about a minute on 2 cores
Results: benchmarks/key_quantization/results/key_quantization.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import kivi  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from confkv.models.corpus import text_of_tokens  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from confkv.kv.block_pool import Codec  # noqa: E402
from confkv.kv.kv_layout import BLOCK_SIZE  # noqa: E402
from confkv.kv.quant import (  # noqa: E402
    bytes_per_vector,
    dequantize,
    dequantize_channels,
    quantize,
    quantize_channels,
    random_rotation,
)
from confkv.models.default_model import default_model_path  # noqa: E402

CAPTURE = "capture_queries_and_keys"
Format = Callable[[torch.Tensor], torch.Tensor]  # keys [kv_heads, n, D] -> as stored, dequantised


def per_token(bits: int, rotation: torch.Tensor | None = None) -> Format:
    def stored(keys: torch.Tensor) -> torch.Tensor:
        turned = keys if rotation is None else keys @ rotation
        back = dequantize(quantize(turned, bits))
        return back if rotation is None else back @ rotation.T

    return stored


def per_channel_blocks(keys: torch.Tensor) -> torch.Tensor:
    """Keys as the kivi4 storage holds them: int4 per channel over each block of BLOCK_SIZE tokens."""
    heads, n, dim = keys.shape
    padded = torch.cat((keys, keys.new_zeros(heads, -n % BLOCK_SIZE, dim)), dim=1)
    blocks = padded.view(heads, -1, BLOCK_SIZE, dim).permute(1, 2, 0, 3)  # [blocks, BLOCK_SIZE, heads, D]
    counts = (n - BLOCK_SIZE * torch.arange(blocks.shape[0])).clamp(max=BLOCK_SIZE)
    codes, params = quantize_channels(blocks, counts)
    back = dequantize_channels(codes, params.unsqueeze(1))  # [blocks, BLOCK_SIZE, heads, D]
    return back.permute(2, 0, 1, 3).reshape(heads, -1, dim)[:, :n]


def formats(head_dim: int) -> dict[str, tuple[Format, float]]:
    """Name -> (format, bits per element)."""
    rotation = random_rotation(head_dim)

    def token_bits(bits: int) -> float:
        return 8 * bytes_per_vector(head_dim, bits) / head_dim

    def kivi_keys(bits: int) -> Format:
        return lambda keys: kivi.fake_quantize(keys, bits, dim=1)

    kivi_bits = {bits: bits + kivi.PARAM_BITS / kivi.GROUP for bits in (4, 2)}
    return {
        "int8, per token (before rotation)": (per_token(8), token_bits(8)),
        "int8, per token, rotated (stored now)": (per_token(8, rotation), token_bits(8)),
        "int4, per token (before rotation)": (per_token(4), token_bits(4)),
        "int4, per token, rotated (stored now)": (per_token(4, rotation), token_bits(4)),
        "int4c, per channel over 16-token blocks (kivi4 storage)": (
            per_channel_blocks,
            8 * Codec("int4c", head_dim, BLOCK_SIZE).vector_bytes / head_dim,
        ),
        "KIVI-4 keys, per channel": (kivi_keys(4), kivi_bits[4]),
        "KIVI-2 keys, per channel": (kivi_keys(2), kivi_bits[2]),
    }


def capture(model, ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's queries [heads, n, D] and keys [kv_heads, n, D] as attention sees them."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def attention(module, query, key, value, mask, **kwargs):
        seen[module.layer_idx] = (query[0].float(), key[0].float())
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register(CAPTURE, attention)
    model.set_attn_implementation(CAPTURE)
    with torch.inference_mode():
        model(torch.tensor([ids]))
    return seen


def compare(query: torch.Tensor, keys: torch.Tensor, stored: torch.Tensor, last: int) -> tuple[float, float]:
    """Mean KL(exact || stored) and top-1 agreement of the last `last` queries' causal attention."""
    kv_heads, n, d = keys.shape
    q = query[:, n - last :].reshape(kv_heads, -1, last, d)  # [kv_heads, group, last, D]
    visible = torch.arange(n) <= torch.arange(n - last, n).unsqueeze(1)  # [last, n]

    def logits(k: torch.Tensor) -> torch.Tensor:
        scores = q @ k.unsqueeze(1).transpose(-1, -2) * d**-0.5
        return scores.masked_fill(~visible, float("-inf")).log_softmax(-1)

    exact, moved = logits(keys), logits(stored)
    kl = (exact.exp() * (exact - moved).nan_to_num(0.0, 0.0, 0.0)).sum(-1)
    top1 = (exact.argmax(-1) == moved.argmax(-1)).float()
    return float(kl.mean()), float(top1.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per text")
    parser.add_argument("--queries", type=int, default=64, help="last queries of each text that attend")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "key_quantization")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    kinds = formats(head_dim)
    results: dict[str, dict[str, list[float]]] = {name: {"kl": [], "top1": []} for name in kinds}
    for i in tqdm(range(args.texts), desc="texts", unit="text"):
        # Texts from the corpus's far half, each its own stretch (offsets in paragraphs).
        seen = capture(model, text_of_tokens(tokenizer, args.tokens, offset=200 + 150 * i))
        for name, (stored, _) in kinds.items():
            per_layer = [compare(q, k, stored(k), args.queries) for q, k in seen.values()]
            results[name]["kl"].append(statistics.mean(kl for kl, _ in per_layer))
            results[name]["top1"].append(statistics.mean(top for _, top in per_layer))
    rows = {
        name: {
            "bits_per_element": bits,
            "kl": statistics.median(results[name]["kl"]),
            "top1": statistics.median(results[name]["top1"]),
            "kl_by_text": results[name]["kl"],
        }
        for name, (_, bits) in kinds.items()
    }
    lines = [
        f"Attention of the last {args.queries} queries over {args.tokens}-token texts, keys as each format stores "
        f"them, values exact; the median over {args.texts} texts of the mean over layers, heads and queries.",
        "",
        "| key format | bits per element | KL(exact ‖ stored) | top-1 key kept |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {n} | {r['bits_per_element']:.2f} | {r['kl']:.5f} | {r['top1']:.3f} |" for n, r in rows.items()]
    save_report(args.out, "Key quantisation: how far each format moves attention", "\n".join(lines), rows, args)


if __name__ == "__main__":
    main()
