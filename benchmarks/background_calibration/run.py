"""What a background fitting costs the requests served meanwhile.

Two servers on the embedded model take turns on the same streams: one fitting its retention
confidence in the background (its compression config asks for a prediction_window no shipped
predictor forecasts, 64, so it fits one as it starts, in a child process at the lowest CPU
priority), one not (`--calibration.background false`, the same window, the rate alone deciding).
Each turn sends the same requests, a few at a time, while the fitting runs; reported per arm:
median time per output token, output tokens/s, the ratios fitting / not fitting, and the CPU time
the fitting took meanwhile (a share of the turn's wall time). A turn of the fitting arm counts only
if the fitting was still running when it ended.

    python benchmarks/background_calibration/run.py --turns 2 --requests 8 --concurrency 2
Results: benchmarks/background_calibration/results/background_calibration.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.report import Provenance, save_report  # noqa: E402
from benchmarks.serving_http.run import prompt_bodies, run_load, summarise  # noqa: E402
from confkv.compress.config import CompressionConfig  # noqa: E402
from load_tests.run import start_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ARMS = ("not fitting", "fitting")
WINDOW = 64  # no shipped predictor forecasts it: a server on it fits one


def fitting_cpu_s(server: psutil.Process) -> float:
    """CPU seconds the server's child processes (the fitting) have used."""
    total = 0.0
    for child in server.children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def turn(arm: str, bodies: list[dict], args: argparse.Namespace, tmp: Path, index: int) -> dict:
    """One server of `arm`, started afresh (an empty confidence cache), serving `bodies`."""
    config = tmp / "compression.json"
    config.write_text(CompressionConfig(prediction_window=WINDOW).model_dump_json())
    flags = ["--compression-config", str(config), "--torch-threads", str(args.threads)]
    flags += ["--max-cache-size", "1GiB", "--calibration.background", "true" if arm == "fitting" else "false"]
    env = {**os.environ, "CONFKV_CONFIDENCE_CACHE": str(tmp / f"cache-{index}")}
    proc, url = start_server(flags, env=env)
    try:
        server = psutil.Process(proc.pid)
        before = httpx.get(f"{url}/health").json()["calibration"]
        cpu_before = fitting_cpu_s(server)
        run = asyncio.run(run_load(url, bodies, float("inf"), args.concurrency, seed=index))
        cpu = fitting_cpu_s(server) - cpu_before
        after = httpx.get(f"{url}/health").json()["calibration"]
    finally:
        proc.terminate()
        proc.wait(60)
    summary = summarise(run, float("inf"), float("inf"))
    return {
        "arm": arm,
        "calibration_before": before,
        "calibration_after": after,
        "counts": arm == "not fitting" or after == "fitting",
        "fitting_cpu_s": cpu,
        "wall_s": summary["wall_s"],
        "median_tpot_s": summary["tpot_s"]["median"],
        "output_tokens_per_s": summary["output_token_throughput"],
        "errors": summary["errors"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=2, help="turns of each arm, taking turns")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "background_calibration")
    args = parser.parse_args()
    provenance = Provenance.capture()
    bodies = prompt_bodies(args.requests, args.prompt_tokens, args.max_tokens, None)
    turns = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.turns):
            for arm in ARMS:
                turns.append(turn(arm, bodies, args, Path(tmp), len(turns)))
                print(json.dumps(turns[-1]))
    arms = {}
    for arm in ARMS:
        counted = [t for t in turns if t["arm"] == arm and t["counts"]]
        arms[arm] = {
            "turns": len(counted),
            "median_tpot_ms": 1000 * statistics.median(t["median_tpot_s"] for t in counted) if counted else None,
            "output_tokens_per_s": statistics.median(t["output_tokens_per_s"] for t in counted) if counted else None,
            "fitting_cpu_share": statistics.median(t["fitting_cpu_s"] / t["wall_s"] for t in counted) if counted else 0,
        }
    off, on = arms["not fitting"], arms["fitting"]
    ratios = None
    if off["turns"] and on["turns"]:
        ratios = {
            "tpot": on["median_tpot_ms"] / off["median_tpot_ms"],
            "tokens_per_s": on["output_tokens_per_s"] / off["output_tokens_per_s"],
        }
    lines = [
        f"The embedded model on {args.threads} torch threads, {args.requests} requests of {args.prompt_tokens} "
        f"tokens, {args.max_tokens} new each, {args.concurrency} at a time, per turn; {args.turns} turns of each "
        "arm, taking turns. The fitting runs with 1 thread at the lowest priority; a fitting turn counts only if "
        "it was still fitting when the turn ended. Medians over the turns.",
        "",
        "| arm | turns counted | median time per output token | output tokens/s | CPU the fitting took |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for arm, row in arms.items():
        if row["turns"]:
            lines.append(
                f"| {arm} | {row['turns']} | {row['median_tpot_ms']:.1f} ms | {row['output_tokens_per_s']:.2f} | "
                f"{100 * row['fitting_cpu_share']:.0f}% of a core |"
            )
    if ratios:
        lines += ["", f"Fitting / not fitting: time per output token {ratios['tpot']:.2f}x, output tokens/s "
                  f"{ratios['tokens_per_s']:.2f}x."]  # fmt: skip
    save_report(
        args.out,
        "A background fitting beside serving",
        "\n".join(lines),
        {"arms": arms, "ratios": ratios, "turns": turns},
        args,
        provenance,
    )


if __name__ == "__main__":
    main()
