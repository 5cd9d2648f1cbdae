"""NVIDIA kvpress presses on the quality benchmark's own cases, in kvpress's own environment.

kvpress 0.5.5 needs transformers < 5.3, so it cannot share the server's environment: `make bench-peers`
builds `.venv-peers` and `benchmarks/quality.py --peers` runs this script there. It reads the cases that
quality.py wrote (chat messages, token budgets, the perplexity text), runs every press at every rate and
writes the raw outputs; quality.py scores them exactly as it scores our own policies.

- Needles and summaries, query-aware, as kvpress's pipeline does it: the whole user message (document and
  question) is prefilled and compressed with `compression_ratio` = our `compression_rate`, then the chat
  template's assistant header and greedy decoding follow.
- Perplexity: the text is teacher-forced one token at a time after an uncompressed prefill, the press
  wrapped in `CompressionRatioDecodingPress` so that it keeps the same fraction of every token seen so far,
  compressing every `compression_interval` tokens as our engine does.

    .venv-peers/bin/python benchmarks/peers/kvpress_runner.py --cases cases.json --out peers.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kvpress import (
    AdaKVPress,
    CompressionRatioDecodingPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVPressTextGenerationPipeline,
    ObservedAttentionPress,
    ScorerPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache

PRESSES: dict[str, Callable[[float], ScorerPress | AdaKVPress]] = {
    "SnapKV": lambda r: SnapKVPress(compression_ratio=r),
    "ExpectedAttention": lambda r: ExpectedAttentionPress(compression_ratio=r),
    "AdaKV(ExpectedAttention)": lambda r: AdaKVPress(ExpectedAttentionPress(compression_ratio=r)),
    "TOVA": lambda r: TOVAPress(compression_ratio=r),
    "KeyDiff": lambda r: KeyDiffPress(compression_ratio=r),
    "StreamingLLM": lambda r: StreamingLLMPress(compression_ratio=r),
    "Knorm": lambda r: KnormPress(compression_ratio=r),
    "ObservedAttention": lambda r: ObservedAttentionPress(compression_ratio=r),
}
UNCOMPRESSED = "none"
NEEDS_EAGER = {"ObservedAttention"}  # scores from the attention weights, which only eager attention returns


def make_press(name: str, rate: float) -> ScorerPress | AdaKVPress | None:
    return None if name == UNCOMPRESSED else PRESSES[name](rate)


def load(model_path: str, eager: bool):
    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "quantization_config", "absent") is None:
        del config.quantization_config  # newer transformers write `null`; this one reads it as quantised
    model = AutoModelForCausalLM.from_pretrained(
        model_path, config=config, dtype=torch.float32, attn_implementation="eager" if eager else "sdpa"
    ).eval()
    return model, AutoTokenizer.from_pretrained(model_path)


def answer(pipe: KVPressTextGenerationPipeline, case: dict, press) -> str:
    content = case["messages"][-1]["content"]
    return pipe(content, press=press, max_new_tokens=case["max_tokens"])["answer"]


@torch.inference_mode()
def perplexity(model, ids: list[int], prefill: int, press, interval: int) -> float:
    """exp(mean NLL) of ids[prefill:], teacher-forced one token at a time, compressed as it goes (press)."""
    tokens = torch.tensor([ids])
    cache = DynamicCache()
    logits = model(input_ids=tokens[:, :prefill], past_key_values=cache).logits[0, -1]
    nll = 0.0
    decoding = (
        CompressionRatioDecodingPress(
            press, compression_interval=interval, target_compression_ratio=press.compression_ratio
        )
        if press is not None
        else None
    )
    with decoding(model) if decoding else contextlib.nullcontext():
        for pos in range(prefill, len(ids)):
            nll -= torch.log_softmax(logits.float(), -1)[ids[pos]].item()
            if pos + 1 < len(ids):
                step = tokens[:, pos : pos + 1]
                logits = model(input_ids=step, past_key_values=cache, position_ids=torch.tensor([[pos]])).logits[0, -1]
    return math.exp(nll / (len(ids) - prefill))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=Path, required=True, help="written by benchmarks/quality.py")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--presses", nargs="+", default=list(PRESSES), choices=list(PRESSES))
    parser.add_argument("--rates", type=float, nargs="+", required=True)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    spec = json.loads(args.cases.read_text())
    cases, ppl = spec["cases"], spec["perplexity"]

    runs = []
    # kvpress's own uncompressed run first: presses are scored against it, so that a difference between
    # the two transformers versions is not counted against them.
    plan = [(UNCOMPRESSED, 0.0)] + [(press, rate) for press in args.presses for rate in args.rates]
    models: dict[bool, tuple] = {}
    for name, rate in tqdm(plan, desc="kvpress", unit="setup"):
        eager = name in NEEDS_EAGER
        if eager not in models:
            models[eager] = load(spec["model_path"], eager)
        model, tokenizer = models[eager]
        pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer)
        started = time.perf_counter()
        outputs = {
            case["name"]: answer(pipe, case, make_press(name, rate))
            for case in tqdm(cases, desc=f"{name} @ {rate}", unit="case", leave=False)
        }
        seconds = time.perf_counter() - started
        ppl_value = perplexity(model, ppl["token_ids"], ppl["prefill"], make_press(name, rate), ppl["interval"])
        runs.append({"press": name, "rate": rate, "outputs": outputs, "perplexity": ppl_value, "seconds": seconds})
        tqdm.write(f"{name:26s} rate {rate:.2f}  perplexity {ppl_value:.2f}  ({seconds:.0f}s)")
        args.out.write_text(json.dumps({"runs": runs}, indent=1))  # partial results survive an interrupt


if __name__ == "__main__":
    main()
