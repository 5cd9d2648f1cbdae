"""Serving benchmark: this engine against transformers' continuous batching and plain `generate`.

Side by side in one run on the same model, prompts and settings (greedy, fixed lengths, EOS ignored):
output tokens/s and median time per output token (TPOT) and to first token (TTFT) at each concurrency.

    python benchmarks/serving/run.py                 # 512-token prompts, 128 new tokens, concurrency 1 4 16
    python benchmarks/serving/run.py --quick         # a few minutes
Results: benchmarks/serving/results/serving.json and serving.md.
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine import CPU, advance, decoding_engine, is_pure_decode, load_with_predictor  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from confkv.models.corpus import text_of_tokens  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from confkv.compress.predictor.online import FutureValue  # noqa: E402
from confkv.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from confkv.engine.sequence import SamplingParams  # noqa: E402
from confkv.models.loader import load_model  # noqa: E402


@dataclass
class Run:
    system: str
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    median_tpot_ms: float
    median_ttft_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def run_engine(model, tokenizer, prompts, max_new, max_batched_tokens) -> tuple[float, list[float], list[float]]:
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(max_cache_bytes=2**33, max_num_seqs=len(prompts), max_num_batched_tokens=max_batched_tokens),
    )
    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first, last = {}, {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    with torch.inference_mode():
        while engine.has_unfinished():
            for out in engine.step():
                now = time.perf_counter()
                first.setdefault(out.request_id, now)
                last[out.request_id] = now
    wall = time.perf_counter() - start
    ttft = [first[k] - start for k in first]
    tpot = [(last[k] - first[k]) / (max_new - 1) for k in first]
    return wall, ttft, tpot


def run_generate_batch(model, tokenizer, prompts, max_new, _) -> tuple[float, list[float], list[float]]:
    config = GenerationConfig(
        max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id or 0
    )
    start = time.perf_counter()
    outputs = model.generate_batch(prompts, generation_config=config, record_timestamps=True, progress_bar=False)
    wall = time.perf_counter() - start
    ttft = [o.timestamps[0] - o.created_time for o in outputs.values()]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in outputs.values()]
    return wall, ttft, tpot


def run_sequential(model, tokenizer, prompts, max_new, _) -> tuple[float, list[float], list[float]]:
    ttft, tpot = [], []
    start = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            t0 = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
            t1 = time.perf_counter()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
            )
            t2 = time.perf_counter()
            ttft.append(t1 - t0)
            tpot.append((t2 - t1 - (t1 - t0)) / (max_new - 1))
    # Each prompt ran twice above (once for TTFT); count the full generation only.
    wall = time.perf_counter() - start - sum(ttft)
    return wall, ttft, tpot


def measure_overhead(
    model,
    tokenizer,
    num_seqs: int,
    prompt_tokens: int,
    max_new: int,
    future_value: FutureValue | None = None,
    rate: float = 0.6,
) -> dict:
    """Decode steps of `num_seqs` sequences of `prompt_tokens`: compression off, dynamic at `rate` by
    observed attention and, given a value predictor, dynamic at `rate` with it.

    Reports the median step time of each and, with compression on, the share of each step spent in
    the compressor (scoring, prediction, tiering, compaction), i.e. not counting the
    attention's own work on the int8/KEY_ONLY tiers, which shows in the step-time ratio.
    """
    modes = {"compression off": ("none", None), f"dynamic {rate}": ("dynamic", None)}
    if future_value is not None:
        modes[f"dynamic {rate} + value predictor"] = ("dynamic", future_value)
    result = {}
    for label, (policy, predictor) in modes.items():
        request = {"policy": policy, "compression_rate": rate}
        engine = decoding_engine(model, tokenizer, predictor, request, num_seqs, prompt_tokens, max_new)
        steps, shares = [], []
        with torch.inference_mode(), tqdm(total=num_seqs * max_new, desc=f"overhead: {label}", leave=False) as bar:
            while engine.has_unfinished():
                advance(engine, bar)
                stats = engine.last_step
                if is_pure_decode(stats, num_seqs):
                    steps.append(stats.duration_s)
                    shares.append(stats.compression_s / stats.duration_s)
        result[label] = {
            "median_step_s": statistics.median(steps),
            "mean_compression_share": statistics.mean(shares),
            "max_compression_share": max(shares),
            "decode_steps": len(steps),
        }
    for label in modes:
        result[label]["step_time_ratio"] = result[label]["median_step_s"] / result["compression off"]["median_step_s"]
    return result


SYSTEMS = {
    "conf-kv engine": run_engine,
    "transformers generate_batch": run_generate_batch,
    "transformers generate (sequential)": run_sequential,
}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    run_overhead(args)
    if args.overhead_only:
        return
    runs: list[Run] = []
    plan = [(name, c) for c in args.concurrency for name in SYSTEMS if not (name.endswith("(sequential)") and c > 1)]
    for name, concurrency in tqdm(plan, desc="serving benchmark", unit="run"):
        runs.append(run_system(name, concurrency, args))
        gc.collect()  # the run's model, before the next one loads
    report(runs, args)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument(
        "--sequential-requests",
        type=int,
        default=2,
        help="plain generate runs one request at a time, so its figures do not depend on "
        "concurrency: it is measured on this many requests once",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="128-token prompts, 32 new tokens, concurrency 1 4")
    parser.add_argument("--overhead-seqs", type=int, default=16)
    parser.add_argument("--overhead-prompt-tokens", type=int, default=2000)
    parser.add_argument("--overhead-only", action="store_true", help="only the compression overhead experiment")
    parser.add_argument("--out", type=Path, default=RESULTS / "serving")
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens, args.max_new_tokens, args.concurrency = 128, 32, [1, 4]
        args.overhead_seqs, args.overhead_prompt_tokens = 4, 512
    return args


def run_overhead(args: argparse.Namespace) -> None:
    """The compression overhead experiment, saved beside the serving figures (OUT_overhead)."""
    model, tokenizer, future_value = load_with_predictor(args.model_path)
    overhead = measure_overhead(model, tokenizer, args.overhead_seqs, args.overhead_prompt_tokens, 48, future_value)
    overhead_md = overhead_table(overhead, args.overhead_seqs, args.overhead_prompt_tokens, args.threads)
    save_report(args.out.with_name(args.out.name + "_overhead"), "Compression overhead", overhead_md, overhead)


def run_system(name: str, concurrency: int, args: argparse.Namespace) -> Run:
    """One system serving `concurrency` requests at once, after a one-request warm-up; plain generate
    serves its `--sequential-requests` one at a time."""
    # A fresh model per run: generate_batch switches the model to its own paged attention.
    model, tokenizer = load_model(args.model_path, CPU)
    n = args.sequential_requests if name.endswith("(sequential)") else concurrency
    prompts = [text_of_tokens(tokenizer, args.prompt_tokens, offset=7 * i) for i in range(n)]
    SYSTEMS[name](model, tokenizer, prompts[:1], 2, args.max_num_batched_tokens)  # warm-up
    wall, ttft, tpot = SYSTEMS[name](model, tokenizer, prompts, args.max_new_tokens, args.max_num_batched_tokens)
    tpot_ms, ttft_s = 1000 * statistics.median(tpot), statistics.median(ttft)
    run = Run(name, concurrency, n, n * args.max_new_tokens, wall, tpot_ms, ttft_s)
    tqdm.write(
        f"{name:38s} c={concurrency:<3d} {run.tokens_per_s:7.1f} tok/s  "
        f"TPOT {run.median_tpot_ms:6.1f} ms  TTFT {run.median_ttft_s:6.2f} s"
    )
    return run


def overhead_table(overhead: dict, seqs: int, prompt_tokens: int, threads: int) -> str:
    lines = [
        f"Compression overhead: {seqs} sequences of {prompt_tokens} prompt tokens decoding together, {threads} "
        "CPU threads; dynamic with int8 storage.",
        "",
        "| mode | median decode step | step time vs off | compressor share of the step (mean / max) |",
        "| --- | ---: | ---: | ---: |",
    ]
    for label, row in overhead.items():
        share = (
            "-"
            if label == "compression off"
            else (f"{row['mean_compression_share']:.1%} / {row['max_compression_share']:.1%}")
        )
        lines.append(f"| {label} | {row['median_step_s'] * 1000:.0f} ms | {row['step_time_ratio']:.2f}x | {share} |")
    return "\n".join(lines)


def report(runs: list[Run], args) -> None:
    by = {(r.system, r.concurrency): r for r in runs}
    seq = next(r for r in runs if r.system.endswith("(sequential)"))
    lines = [
        f"Prompts of {args.prompt_tokens} tokens, {args.max_new_tokens} new tokens (greedy, EOS ignored), "
        f"{args.threads} CPU threads, fp32. Plain generate runs requests one at a time; its row is measured "
        f"on {seq.requests} requests and holds for every concurrency.",
        "",
        "| concurrency | system | output tok/s | median TPOT ms | median TTFT s | tok/s vs generate_batch |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for c in args.concurrency:
        peer = by.get(("transformers generate_batch", c))
        for name in SYSTEMS:
            r = by.get((name, c)) or (seq if name.endswith("(sequential)") else None)
            if r is None:
                continue
            ratio = f"{r.tokens_per_s / peer.tokens_per_s:.2f}x" if peer else ""
            lines.append(
                f"| {c} | {name} | {r.tokens_per_s:.1f} | {r.median_tpot_ms:.1f} | {r.median_ttft_s:.2f} | {ratio} |"
            )
    meta = {
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
    }
    payload = {"meta": meta, "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in runs]}
    save_report(args.out, "Serving benchmark", "\n".join(lines), payload)


if __name__ == "__main__":
    main()
