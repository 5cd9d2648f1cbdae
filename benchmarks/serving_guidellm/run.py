"""The fixed-budget serving experiment through a peer's client: guidellm, the vLLM project's benchmark
tool, run as its users run it (`guidellm run`, synthetic prompts, a concurrent profile) against the
server started here with compression off and with `dynamic` at 0.6, at the same `--max-cache-size`.

The figures are guidellm's own (requests, tokens and latencies from its JSON report), beside those of
our client (`serving_client.py --headline`) on the same shape: what a reader who trusts neither of
our instruments can reproduce with a tool of the field.

    python benchmarks/serving_guidellm/run.py                            # 512-token prompts, 256 new, 8 and 32 streams
    python benchmarks/serving_guidellm/run.py --streams 4 --requests 8   # a short run
Results: benchmarks/serving_guidellm/results/serving_guidellm.{json,md,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.report import pyplot, save_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from benchmarks.placement import add_placement_options, model_folder, placement, served_dtype, server_flags, token_bytes  # noqa: E402
from load_tests.run import served  # noqa: E402

# guidellm sends no extension field: each mode is the server's default (confkv/config/compression.json: dynamic, 0.6).
MODES = {"compression off": ["--compression-enabled=false"], "dynamic 0.6": []}
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--fit", type=int, default=8, help="uncompressed requests the KV budget holds")
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32], help="guidellm's concurrencies")
    parser.add_argument("--requests", type=int, default=32, help="requests at each concurrency")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    add_placement_options(parser)
    parser.add_argument("--out", type=Path, default=RESULTS / "serving_guidellm")
    args = parser.parse_args()
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_folder(args.model_path))
    per_request = (args.prompt_tokens + args.max_tokens + 32) * token_bytes(config, served_dtype(args))
    budget_mb = args.fit * per_request / 1e6
    results = {}
    for mode, mode_flags in tqdm(MODES.items(), unit="mode"):
        flags = [f"--max-cache-size={budget_mb:.0f}MB", f"--max-num-seqs={max(args.streams)}"]
        flags += ["--enable-prefix-cache=false", *mode_flags, *server_flags(args)]
        with served(None, flags) as (url, _):
            results[mode] = run_guidellm(url, args)
    setup = (
        f"guidellm {guidellm_version()} (`guidellm run`, synthetic text of {args.prompt_tokens} prompt tokens and "
        f"{args.max_tokens} output tokens, EOS ignored, streamed over /v1/completions; a concurrent profile at "
        f"{', '.join(map(str, args.streams))} streams, {args.requests} requests each); max_cache_size "
        f"{budget_mb:.0f} MB (about {args.fit} uncompressed requests); {placement(args)}"
    )
    save_report(args.out, "Serving at a fixed KV budget, through guidellm", table(results, setup), {"setup": setup,
                "results": results}, args)  # fmt: skip
    plot(results, args.out.with_suffix(".png"))


def run_guidellm(url: str, args: argparse.Namespace) -> dict[str, dict]:
    """guidellm against the server at `url`: its figures at each concurrency."""
    served_name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "guidellm.json"
        subprocess.run(
            [str(Path(sys.executable).with_name("guidellm")), "run", "--disable-console-interactive"]
            + ["--backend", f"kind=openai_http,target={url},model={served_name},request_format=/v1/completions"]
            + ["--profile", f"kind=concurrent,streams={args.streams[0]}"]
            + ["--override", "profile.streams", ",".join(map(str, args.streams))]
            + ["--constraint", f"kind=max_requests,count={args.requests}"]
            + ["--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.max_tokens}"]
            + ["--tokenizer", f"kind=huggingface_auto,model={model_folder(args.model_path)}"]
            + ["--output", f"kind=json,path={report}"],
            cwd=tmp,
            env={**os.environ, **OFFLINE},
            check=True,
        )
        benchmarks = json.loads(report.read_text())["benchmarks"]
    done = {str(b["config"]["strategy"]["streams"]): figures(b) for b in benchmarks}
    failed = {streams: r["errored"] for streams, r in done.items() if r["errored"]}
    if failed:  # a figure of failed requests says nothing: stop, saying what failed and where to look
        sys.exit(
            f"guidellm's requests failed (errored requests by streams: {failed}); guidellm's errors: "
            f"{errors(benchmarks)}; the server's log above says what it saw"
        )
    return done


def errors(benchmarks: list[dict]) -> list[str]:
    """The distinct errors of guidellm's errored requests (as it sampled them), at most three."""
    seen = {
        str((request.get("info") or {}).get("error"))
        for benchmark in benchmarks
        for request in (benchmark.get("requests") or {}).get("errored") or []
    }
    return sorted(seen)[:3]


def figures(benchmark: dict) -> dict:
    """One concurrency's figures as guidellm reports them."""
    m = benchmark["metrics"]

    def stat(name: str, key: str) -> float:
        return m[name]["successful"][key] if key in m[name]["successful"] else m[name]["successful"]["percentiles"][key]

    output_tokens = m["output_token_count"]["successful"]["total_sum"]
    return {
        "successful": m["request_totals"]["successful"],
        "errored": m["request_totals"]["errored"],
        "duration_s": benchmark["duration"],
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / benchmark["duration"],
        "ttft_median_s": stat("time_to_first_token_ms", "median") / 1000,
        "ttft_p99_s": stat("time_to_first_token_ms", "p99") / 1000,
        "itl_median_s": stat("inter_token_latency_ms", "median") / 1000,
        "concurrency_mean": m["request_concurrency"]["successful"]["mean"],
    }


def guidellm_version() -> str:
    from importlib.metadata import version

    return version("guidellm")


def table(results: dict, setup: str) -> str:
    lines = [
        f"{setup}.",
        "",
        "| streams | mode | requests ok / errored | output tok/s | vs off | mean concurrency | TTFT median / p99 s "
        "| ITL median s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    off = results["compression off"]
    for streams in off:
        for mode, rows in results.items():
            r = rows[streams]
            ratio = r["output_tokens_per_s"] / max(off[streams]["output_tokens_per_s"], 1e-9)
            lines.append(
                f"| {streams} | {mode} | {r['successful']} / {r['errored']} | {r['output_tokens_per_s']:.1f} | "
                f"{ratio:.2f}x | {r['concurrency_mean']:.1f} | {r['ttft_median_s']:.1f} / {r['ttft_p99_s']:.1f} | "
                f"{r['itl_median_s']:.3f} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, rows in results.items():
        streams = [int(s) for s in rows]
        ax.plot(streams, [rows[str(s)]["output_tokens_per_s"] for s in streams], marker="o", label=mode)
    ax.set_xlabel("guidellm streams (requests in flight)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Fixed KV budget, through guidellm")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
