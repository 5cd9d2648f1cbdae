"""Capacity under a small KV budget: 32 concurrent 1k-token requests, compression off against on.

The budget holds about `--fit` uncompressed requests. Everything must complete without an error;
reported side by side from one run: requests running at once, preemptions, squeezes (compression
raised under pressure), the compression ratio reached, throughput and wall time.

    python benchmarks/capacity/run.py             # 32 requests, 1k-token prompts, 64 new tokens
    python benchmarks/capacity/run.py --quick     # 8 requests, 256-token prompts, room for 2
Results: benchmarks/capacity/results/capacity.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.report import save_report  # noqa: E402
from confkv.models.corpus import text_of_tokens  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from confkv.compress.config import CompressionConfig, resolve  # noqa: E402
from confkv.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from confkv.engine.sequence import SamplingParams  # noqa: E402
from confkv.models.loader import load_model  # noqa: E402

MODES = {"compression off": {"enabled": False}, "dynamic 0.6": {"policy": "dynamic", "compression_rate": 0.6}}


def run_mode(model, tokenizer, prompts: list[list[int]], budget: int, max_tokens: int, request: dict) -> dict:
    config = CompressionConfig.load()
    engine = LLMEngine(model, tokenizer, EngineConfig(max_cache_bytes=budget, max_num_seqs=len(prompts)), config)
    params = resolve(config, request, server_enabled=True, stats=True)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, sampling, params)
    running, preempted, errors, ratios, generated = [], 0, 0, [], 0
    started = time.perf_counter()
    with torch.inference_mode(), tqdm(total=len(prompts), desc=str(request), unit="request") as bar:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    errors += out.error is not None
                    ratios.append(out.compression_metrics["compression_ratio"])
                    generated += out.completion_tokens
                    bar.update(1)
            running.append(engine.num_running)
            preempted += engine.last_step.num_preempted
            assert engine.store.used_bytes <= budget
    wall = time.perf_counter() - started
    return {
        "completed": len(ratios) - errors,
        "errors": errors,
        "peak_running": max(running),
        "mean_running": statistics.mean(running),
        "preemptions": preempted,
        "squeezes": engine.compression.squeezes,
        "mean_compression_ratio": statistics.mean(ratios),
        "output_tokens_per_s": generated / wall,
        "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--fit", type=int, default=8, help="uncompressed requests the budget holds")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "capacity")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.prompt_tokens, args.max_tokens, args.fit = 8, 256, 16, 2
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_path, torch.device("cpu"))
    prompts = [text_of_tokens(tokenizer, args.prompt_tokens, offset=101 * i) for i in range(args.requests)]
    probe = LLMEngine(model, tokenizer, EngineConfig(max_cache_bytes=1), CompressionConfig.load())
    budget = args.fit * probe.store.bytes_for(args.prompt_tokens + args.max_tokens)
    results = {name: run_mode(model, tokenizer, prompts, budget, args.max_tokens, req) for name, req in MODES.items()}
    lines = [
        f"{args.requests} concurrent requests of {args.prompt_tokens}-token prompts, {args.max_tokens} greedy tokens "
        f"each; KV budget {budget / 2**20:.0f} MiB (about {args.fit} uncompressed requests); default model, fp32, "
        f"{args.threads} CPU threads; both modes in one run.",
        "",
        "| mode | completed | errors | peak running | mean running | preemptions | squeezes | "
        "compression ratio | output tok/s | wall s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['completed']} | {r['errors']} | {r['peak_running']} | {r['mean_running']:.1f} | "
            f"{r['preemptions']} | {r['squeezes']} | {r['mean_compression_ratio']:.3f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['wall_s']:.0f} |"
        )
    save_report(args.out, "Capacity benchmark", "\n".join(lines), {"budget": budget, "results": results}, args)


if __name__ == "__main__":
    main()
