"""Soak test: the locust mix for a long time against a server started here, memory watched throughout.

    python load_tests/soak.py                    # 10 minutes, 16 users (make soak)
    python load_tests/soak.py --duration 3m      # shorter
Every 10 s it samples the server's resident memory and its KV bytes by pool. It fails (exit 1) if
any request failed, if resident memory other than the KV arena's pages keeps growing after the
warm-up (the prefix pool fills up to max_cache_size by design), or if the running and audit pools do
not come back to zero at the end. Compressed requests come at every storage format, so the arena's
pages move between formats all the time. Results: load_tests/results/soak.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import save_report  # noqa: E402
from load_tests.run import ROOT, run_locust, served  # noqa: E402

RESULTS = ROOT / "load_tests" / "results"


def kv_pools(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """KV bytes held by pool (running, prefix, audit), and the KV cache's memory: its budget, the arena
    allocated at start, its pages the formats hold now and those ever lent (resident once touched,
    whichever format holds them now), and the parked caches' bookkeeping."""
    pools, memory = {}, {"held": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith('kv_cache_bytes{pool="'):
            pools[name.split('"')[1]] = float(value)
        elif name.startswith("kv_cache_pool_bytes{"):
            memory["held"] += float(value)  # the pages the formats' pools hold
        elif name in MEMORY_GAUGES:
            memory[MEMORY_GAUGES[name]] = float(value)
    return pools, memory


MEMORY_GAUGES = {
    "kv_cache_capacity_bytes": "budget",
    "kv_cache_allocated_bytes": "allocated",
    "kv_cache_touched_bytes": "touched",
    "kv_prefix_cache_bookkeeping_bytes": "bookkeeping",
}


def sample(url: str, pid: int, samples: list[dict], stop: threading.Event, every: float) -> None:
    process = psutil.Process(pid)
    started = time.monotonic()
    while not stop.is_set():
        pools, memory = kv_pools(url)
        rss = process.memory_info().rss
        # The arena's resident part may grow by design (the prefix cache fills up to max_cache_size):
        # judge the rest.
        kv_memory = memory["touched"] + memory["bookkeeping"] + pools.get("audit", 0.0)
        samples.append(
            {"t": time.monotonic() - started, "rss": rss, "rss_without_kv": rss - kv_memory, **pools, **memory}
        )
        stop.wait(every)


def seconds(duration: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600}
    return float(duration[:-1]) * units[duration[-1]] if duration[-1] in units else float(duration)


def soak(args: argparse.Namespace) -> tuple[list[dict], int, dict]:
    """Serve, run locust for the duration while sampling memory; the samples, locust's exit code and
    the KV pools at the end."""
    samples: list[dict] = []
    stop = threading.Event()
    with served(None, args.server_arg) as (url, pid):
        watcher = threading.Thread(target=sample, args=(url, pid, samples, stop, 10.0), daemon=True)
        watcher.start()
        try:
            code = run_locust(url, args.users, 2.0, args.duration, args.out.with_name("soak_locust"))
            time.sleep(5)  # the last requests finish
            end = kv_pools(url)[0]
        finally:
            stop.set()
            watcher.join(15)
    return samples, code, end


def summarise(args: argparse.Namespace, samples: list[dict], code: int, end: dict) -> tuple[dict, bool]:
    """The report, and whether the soak passed: no failure, flat memory after warm-up, no KV left."""
    warm = [s for s in samples if s["t"] >= args.warmup_share * seconds(args.duration)] or samples
    # A single sample catches whatever activations the requests of the moment hold: compare medians
    # of the first and the last third after the warm-up.
    unfilled = [(s["held"] - s.get("running", 0) - s.get("prefix", 0)) / s["budget"] for s in samples]
    third = max(1, len(warm) // 3)
    early = statistics.median(s["rss_without_kv"] for s in warm[:third])
    late = statistics.median(s["rss_without_kv"] for s in warm[-third:])
    growth = (late - early) / early
    report = {
        "duration": args.duration,
        "users": args.users,
        "locust_exit_code": code,
        "rss_after_warmup_mib": [round(warm[0]["rss"] / 2**20, 1), round(warm[-1]["rss"] / 2**20, 1)],
        "rss_without_kv_mib": [round(early / 2**20, 1), round(late / 2**20, 1)],
        "rss_growth_after_warmup": growth,
        "peak_kv_running_bytes": max(s.get("running", 0) for s in samples),
        "kv_budget_bytes": samples[-1]["budget"],
        "kv_allocated_bytes": [min(s["allocated"] for s in samples), max(s["allocated"] for s in samples)],
        "peak_kv_touched_bytes": max(s["touched"] for s in samples),
        # Pages a format holds but does not fill (fragmentation), as a share of the budget.
        "unfilled_pages_share": [statistics.median(unfilled), max(unfilled)],
        "kv_pools_at_end": end,
        "samples": samples,
    }
    arena_held = report["kv_allocated_bytes"][0] == report["kv_allocated_bytes"][1] >= report["peak_kv_touched_bytes"]
    ok = (
        code == 0
        and growth <= args.max_rss_growth
        and arena_held
        and end.get("running", 0) == 0
        and end.get("audit", 0) == 0
    )
    return report, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", default="10m")
    parser.add_argument("--users", type=int, default=16)
    parser.add_argument("--warmup-share", type=float, default=0.25, help="share of the run before memory must be flat")
    parser.add_argument("--max-rss-growth", type=float, default=0.05, help="allowed growth after warm-up (share)")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak")
    parser.add_argument("--server-arg", action="append", default=[])
    args = parser.parse_args()

    samples, code, end = soak(args)
    report, ok = summarise(args, samples, code, end)
    table = "\n".join(
        [
            f"Soak: {args.duration}, {args.users} locust users; {'PASS' if ok else 'FAIL'}.",
            "",
            "| figure | value |",
            "| --- | ---: |",
            f"| failed requests (locust exit code) | {code} |",
            f"| resident memory after warm-up, first and last sample (MiB) | "
            f"{report['rss_after_warmup_mib'][0]} -> {report['rss_after_warmup_mib'][1]} |",
            f"| resident memory without KV bytes, median of the first and last third after warm-up (MiB) | "
            f"{report['rss_without_kv_mib'][0]} -> {report['rss_without_kv_mib'][1]} "
            f"({report['rss_growth_after_warmup']:+.1%}) |",
            f"| peak KV bytes of running requests | {report['peak_kv_running_bytes']:.0f} |",
            f"| KV budget; arena allocated, least and most seen; its pages ever lent, at the most (MiB) | "
            f"{report['kv_budget_bytes'] / 2**20:.1f}; {report['kv_allocated_bytes'][0] / 2**20:.1f}, "
            f"{report['kv_allocated_bytes'][1] / 2**20:.1f}; {report['peak_kv_touched_bytes'] / 2**20:.1f} |",
            f"| pages held by a format but not filled, share of the budget: median, most | "
            f"{report['unfilled_pages_share'][0]:.1%}, {report['unfilled_pages_share'][1]:.1%} |",
            f"| KV bytes at the end (running, prefix, audit) | {end.get('running', 0):.0f}, "
            f"{end.get('prefix', 0):.0f}, {end.get('audit', 0):.0f} |",
        ]
    )
    save_report(args.out, "Soak test", table, report)
    plot(samples, args.out.with_suffix(".png"))
    return 0 if ok else 1


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t = [s["t"] / 60 for s in samples]
    top.plot(t, [s["rss"] / 2**20 for s in samples])
    top.set_ylabel("server RSS (MiB)")
    for pool in ("running", "prefix", "audit"):
        bottom.plot(t, [s.get(pool, 0) / 2**20 for s in samples], label=pool)
    bottom.set_ylabel("KV bytes (MiB)")
    bottom.set_xlabel("minutes")
    bottom.legend()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
