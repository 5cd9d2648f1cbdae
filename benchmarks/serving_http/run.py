"""Serving benchmark over HTTP, in the manner of vLLM's `bench serve`.

Drives a real server (started here, or `--url`) with streaming `/generate` requests at a request
rate (Poisson arrivals) or a fixed maximum concurrency, and measures per request the time to first
token (TTFT), time per output token (TPOT), inter-token latency (ITL) and end-to-end latency (mean,
median, p99), request and token throughput, goodput under an SLO, and errors; meanwhile it polls
`/metrics` for the KV memory and the requests running and waiting.

The headline experiment (`--headline`, `make bench-serving`): a KV budget that holds about 8
uncompressed requests of 1.5k-token prompts, then 32 concurrent such requests with compression off
and with `dynamic` at 0.6, both measured in one run; a few greedy answers are compared across the
two. With `--async-compression`, `dynamic` at 0.6 also runs on a server with `async_compression`
on. Results: benchmarks/serving_http/results/serving_http.{json,md,png}.

    python benchmarks/serving_http/run.py --headline
    python benchmarks/serving_http/run.py --url http://127.0.0.1:8080 --num-prompts 64 --request-rate 2
    python benchmarks/serving_http/run.py --headline --quick      # a few minutes
    python benchmarks/serving_http/run.py --headline --quick --no-generate-batch --device cuda --dtype bfloat16
    python benchmarks/serving_http/run.py --headline --prompt-tokens 512 --max-tokens 256 --no-generate-batch \
        --async-compression --out benchmarks/serving_http/results/serving_decode_heavy_async
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.placement import add_placement_options, model_folder, placement, served_dtype, server_flags, token_bytes  # noqa: E402
from benchmarks.report import commit_of, pyplot, save_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from load_tests.run import served  # noqa: E402

GENERATE_BATCH = "transformers generate_batch"
ON = "dynamic 0.6"
ASYNC = "dynamic 0.6, async compression"


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    started = time.perf_counter()
    last = started
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", f"{url}/generate", json={**body, "stream": True}) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                now = time.perf_counter()
                if event.get("text"):
                    if not result.text:
                        result.ttft = now - started
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.text += event["text"]
                if reason := event.get("finish_reason"):
                    result.ok = reason in ("stop", "length")
                    result.error = "" if result.ok else event.get("error") or f"finished by {reason}"
                    result.output_tokens = event["usage"]["completion_tokens"]
        result.latency = time.perf_counter() - started
    except httpx.HTTPError as exc:
        result.error = repr(exc)
    return result


async def poll_metrics(client: httpx.AsyncClient, url: str, samples: list[dict], stop: asyncio.Event) -> None:
    started = time.perf_counter()
    wanted = {
        "kv_cache_memory_bytes": "kv_bytes",
        'kv_cache_bytes{pool="running"}': "kv_running_bytes",
        "requests_running": "running",
        "requests_waiting": "waiting",
    }
    while not stop.is_set():
        try:
            text = (await client.get(f"{url}/metrics")).text
            sample = {"t": time.perf_counter() - started}
            for line in text.splitlines():
                name, _, value = line.rpartition(" ")
                if name in wanted:
                    sample[wanted[name]] = float(value)
            samples.append(sample)
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)


async def run_load(url: str, bodies: list[dict], rate: float, concurrency: int | None, seed: int) -> dict:
    """Send `bodies` (Poisson arrivals at `rate`/s, inf: all at once) with at most `concurrency` in flight."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(concurrency or len(bodies))
    samples: list[dict] = []
    stop = asyncio.Event()
    async with httpx.AsyncClient(timeout=httpx.Timeout(1800.0)) as client:
        poller = asyncio.create_task(poll_metrics(client, url, samples, stop))
        bar = tqdm(total=len(bodies), desc="requests", unit="request")

        async def limited(body: dict) -> RequestResult:
            async with limit:
                result = await one_request(client, url, body)
            bar.update(1)
            return result

        started = time.perf_counter()
        tasks = []
        for body in bodies:
            tasks.append(asyncio.create_task(limited(body)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
        bar.close()
        stop.set()
        await poller
    return {"results": results, "wall": wall, "samples": samples}


def summarise(run: dict, slo_ttft: float, slo_tpot: float) -> dict:
    results: list[RequestResult] = run["results"]
    good = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean": 0.0, "median": 0.0, "p99": 0.0}
        ordered = sorted(values)
        return {
            "mean": statistics.mean(ordered),
            "median": statistics.median(ordered),
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        }

    meets = [r for r in good if r.ttft <= slo_ttft and r.tpot <= slo_tpot]
    samples = run["samples"]
    return {
        "requests": len(results),
        "errors": len(results) - len(good),
        "wall_s": run["wall"],
        "request_throughput": len(good) / run["wall"],
        "output_token_throughput": sum(r.output_tokens for r in good) / run["wall"],
        "goodput": len(meets) / run["wall"],
        "ttft_s": stats([r.ttft for r in good]),
        "tpot_s": stats([r.tpot for r in good]),
        "itl_s": stats([x for r in good for x in r.itl]),
        "latency_s": stats([r.latency for r in good]),
        "peak_running": max((s.get("running", 0) for s in samples), default=0),
        "mean_running": statistics.mean([s.get("running", 0) for s in samples]) if samples else 0.0,
        "peak_kv_bytes": max((s.get("kv_bytes", 0) for s in samples), default=0),
        "first_error": next((r.error for r in results if not r.ok), ""),
    }


def prompt_bodies(
    num: int, prompt_tokens: int, max_tokens: int, compression: dict | None, model_path: Path | None = None
) -> list[dict]:
    from transformers import AutoTokenizer

    from confkv.models.corpus import text_of_tokens

    tokenizer = AutoTokenizer.from_pretrained(model_folder(model_path))
    bodies = []
    for i in range(num):
        body = {
            "prompt_token_ids": text_of_tokens(tokenizer, prompt_tokens, offset=37 * i),
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if compression is not None:
            body["compression"] = compression
        bodies.append(body)
    return bodies


def run_generate_batch(bodies: list[dict], kv_bytes: float, args: argparse.Namespace) -> dict:
    """transformers' continuous batching (`generate_batch`) in this process, on the same prompts and
    model, where the server ran it, its paged KV cache sized to `kv_bytes`: the same budget, without
    compression."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from confkv.models.loader import load_model

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_path, torch.device(args.device), args.dtype and getattr(torch, args.dtype))
    page_size = 64
    page_bytes = page_size * token_bytes(model.config, model.dtype)
    batching = ContinuousBatchingConfig(page_size=page_size, num_blocks=int(kv_bytes // page_bytes))
    generation = GenerationConfig(
        max_new_tokens=bodies[0]["max_tokens"], do_sample=False, eos_token_id=-1, pad_token_id=tokenizer.pad_token_id
    )
    prompts = [body["prompt_token_ids"] for body in bodies]
    started = time.perf_counter()
    with torch.inference_mode():
        outputs = model.generate_batch(
            prompts,
            generation_config=generation,
            continuous_batching_config=batching,
            record_timestamps=True,
            progress_bar=True,
        )
    wall = time.perf_counter() - started
    results = []
    for out in outputs.values():
        stamps = out.timestamps or []
        ok = out.error is None and len(stamps) > 0
        results.append(
            RequestResult(
                ok=ok,
                ttft=stamps[0] - started if ok else 0.0,
                latency=stamps[-1] - started if ok else 0.0,
                itl=[b - a for a, b in zip(stamps, stamps[1:], strict=False)],
                output_tokens=len(out.generated_tokens),
                text=tokenizer.decode(out.generated_tokens),
                error=out.error or "",
            )
        )
    # Requests running at each moment: admitted (no longer pending) and not finished.
    spans = [(out.lifespan[0] - started, out.lifespan[1] - started) for out in outputs.values()]
    samples = [{"t": t / 2, "running": sum(a <= t / 2 < b for a, b in spans)} for t in range(int(2 * wall) + 1)]
    return {"results": results, "wall": wall, "samples": samples}


def headline(args) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_folder(args.model_path))
    budget_mb = args.fit * (args.prompt_tokens + args.max_tokens + 32) * token_bytes(config, served_dtype(args)) / 1e6
    on = {"policy": "dynamic", "compression_rate": 0.6}
    modes = {"compression off": ({"enabled": False}, []), ON: (on, [])}  # name -> request, server flags
    if args.async_compression:
        modes[ASYNC] = (on, ["--async-compression=true"])
    summaries, runs = {}, {}
    for name, (compression, extra) in modes.items():
        flags = [
            f"--max-cache-size={budget_mb:.0f}MB",
            f"--max-num-seqs={args.num_prompts}",
            "--enable-prefix-cache=false",
            *server_flags(args),
            *extra,
        ]
        bodies = prompt_bodies(args.num_prompts, args.prompt_tokens, args.max_tokens, compression, args.model_path)
        with served(None, flags) as (url, _):
            runs[name] = asyncio.run(run_load(url, bodies, float("inf"), args.num_prompts, args.seed))
        summaries[name] = summarise(runs[name], args.slo_ttft, args.slo_tpot)
    if args.generate_batch:
        bodies = prompt_bodies(args.num_prompts, args.prompt_tokens, args.max_tokens, None, args.model_path)
        runs[GENERATE_BATCH] = run_generate_batch(bodies, budget_mb * 1e6, args)
        summaries[GENERATE_BATCH] = summarise(runs[GENERATE_BATCH], args.slo_ttft, args.slo_tpot)
    setup = (
        f"{args.num_prompts} concurrent requests of {args.prompt_tokens}-token prompts, {args.max_tokens} greedy "
        f"tokens each (EOS ignored), streamed over HTTP; max_cache_size {budget_mb:.0f} MB (about {args.fit} "
        f"uncompressed requests)"
        + ("; transformers' generate_batch in-process with a paged cache of the same bytes" * args.generate_batch)
        + "; all in one run"
    )
    report(summaries, runs, args, setup, answer_agreement(runs, args.check_answers))


def answer_agreement(runs: dict, count: int) -> dict | None:
    """The first `count` greedy answers with compression on against off: identical, and ROUGE-L; None
    for none (a model with random weights, whose answers say nothing)."""
    if not count:
        return None
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    pairs = list(zip(runs["compression off"]["results"][:count], runs[ON]["results"][:count], strict=True))
    rouge = [scorer.score(off.text, on.text)["rougeL"].fmeasure for off, on in pairs]
    return {
        "compared": len(pairs),
        "identical": sum(off.text == on.text for off, on in pairs),
        "rouge_l": statistics.mean(rouge) if rouge else 0.0,
    }


def report(summaries: dict, runs: dict, args, setup: str, agreement: dict | None) -> None:
    lines = [
        f"{setup}; {placement(args)}. SLO for goodput: TTFT <= {args.slo_ttft:.0f} s "
        f"and TPOT <= {args.slo_tpot:.2f} s. Commit {commit_of()}.",
        "",
        "| mode | errors | peak running | mean running | req/s | output tok/s | goodput req/s | "
        "TTFT median / p99 s | TPOT median / p99 s | ITL median / p99 s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, s in summaries.items():
        lines.append(
            f"| {name} | {s['errors']} | {s['peak_running']:.0f} | {s['mean_running']:.1f} | "
            f"{s['request_throughput']:.3f} | {s['output_token_throughput']:.1f} | {s['goodput']:.3f} | "
            f"{s['ttft_s']['median']:.1f} / {s['ttft_s']['p99']:.1f} | "
            f"{s['tpot_s']['median']:.3f} / {s['tpot_s']['p99']:.3f} | "
            f"{s['itl_s']['median']:.3f} / {s['itl_s']['p99']:.3f} |"
        )
    if ON in summaries:
        a, b = summaries["compression off"], summaries[ON]
        answers = (
            f" Answers of the first {agreement['compared']} requests: {agreement['identical']} identical, ROUGE-L "
            f"{agreement['rouge_l']:.3f} against the uncompressed ones."
            if agreement
            else ""
        )
        lines += [
            "",
            f"dynamic 0.6 against compression off: {b['peak_running'] / max(a['peak_running'], 1):.2f}x the peak "
            f"running requests, {b['mean_running'] / max(a['mean_running'], 1e-9):.2f}x the mean, "
            f"{b['output_token_throughput'] / max(a['output_token_throughput'], 1e-9):.2f}x the token throughput, "
            f"p99 TTFT {b['ttft_s']['p99']:.1f} s against {a['ttft_s']['p99']:.1f} s.{answers}",
        ]
        beside = summaries.get(ASYNC)
        if beside:
            ratio = beside["output_token_throughput"] / max(b["output_token_throughput"], 1e-9)
            lines.append(
                f"With async_compression: {ratio:.2f}x the token throughput of compressing between steps, "
                f"{beside['peak_running']:.0f} peak running against {b['peak_running']:.0f}."
            )
        peer = summaries.get(GENERATE_BATCH)
        if peer:
            lines.append(
                f"Against transformers' generate_batch at the same KV memory: "
                f"{b['output_token_throughput'] / max(peer['output_token_throughput'], 1e-9):.2f}x the token "
                f"throughput (its peak running requests are read from its own request lifespans; it reports no "
                "KV memory)."
            )
    data = {"commit": commit_of(), "setup": setup, "summaries": summaries, "agreement": agreement}
    data["timelines"] = {name: run["samples"] for name, run in runs.items()}
    save_report(args.out, "Serving benchmark over HTTP", "\n".join(lines), data, args)
    plot(runs, args.out.with_suffix(".png"))


def plot(runs: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, run in runs.items():
        t = [s["t"] for s in run["samples"]]
        if any("kv_bytes" in s for s in run["samples"]):  # generate_batch does not report its KV memory
            axes[0].plot(t, [s.get("kv_bytes", 0) / 2**20 for s in run["samples"]], label=name)
        axes[1].plot(t, [s.get("running", 0) for s in run["samples"]], label=name)
        ttft = sorted(r.ttft for r in run["results"] if r.ok)
        axes[2].plot(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], label=name)
    for ax, title, xlabel in (
        (axes[0], "KV memory held (MiB)", "seconds"),
        (axes[1], "requests running", "seconds"),
        (axes[2], "TTFT CDF", "time to first token (s)"),
    ):
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server; default: start one")
    parser.add_argument("--headline", action="store_true", help="the fixed-budget experiment, off against on")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1536)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson; inf: at once")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--compression", type=json.loads, default=None, help="e.g. '{\"compression_rate\": 0.75}'")
    parser.add_argument("--fit", type=int, default=8, help="headline: uncompressed requests the budget holds")
    parser.add_argument("--slo-ttft", type=float, default=60.0)
    parser.add_argument("--slo-tpot", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    add_placement_options(parser)
    parser.add_argument("--check-answers", type=int, default=4, help="headline: answers compared off against on")
    parser.add_argument(
        "--no-generate-batch",
        dest="generate_batch",
        action="store_false",
        help="headline: leave out transformers' generate_batch (the longest run)",
    )
    parser.add_argument(
        "--async-compression", action="store_true", help="headline: also dynamic 0.6 with async_compression on"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="8 requests of 512 tokens, 32 new, room for 2")
    parser.add_argument("--out", type=Path, default=RESULTS / "serving_http")
    args = parser.parse_args()
    if args.quick:
        args.num_prompts, args.prompt_tokens, args.max_tokens, args.fit = 8, 512, 32, 2
    if args.headline:
        headline(args)
        return
    bodies = prompt_bodies(args.num_prompts, args.prompt_tokens, args.max_tokens, args.compression, args.model_path)
    with served(args.url, server_flags(args)) as (url, _):
        run = asyncio.run(run_load(url, bodies, args.request_rate, args.max_concurrency, args.seed))
    rate = "all at once" if args.request_rate == float("inf") else f"Poisson at {args.request_rate}/s"
    setup = (
        f"{args.num_prompts} requests of {args.prompt_tokens}-token prompts, {args.max_tokens} greedy tokens each "
        f"(EOS ignored), {rate}, at most {args.max_concurrency or args.num_prompts} in flight, streamed over HTTP"
    )
    report({"server": summarise(run, args.slo_ttft, args.slo_tpot)}, {"server": run}, args, setup, None)


if __name__ == "__main__":
    main()
