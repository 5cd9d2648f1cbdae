"""Run the locust mix headless against a server, started here unless --host names one.

    python load_tests/run.py                          # 20 users, 5 minutes, own server
    python load_tests/run.py --host http://127.0.0.1:8080 --users 10 --duration 40s
    python load_tests/run.py --users 4 --duration 3m --watch-alerts    # and what it pages
Writes locust's CSV files and HTML report under --out; exits non-zero if any request failed.

--watch-alerts runs a real Prometheus and Alertmanager beside the load, with the repo's rules and
routes, scraping and evaluating every second and every rule's `for` cut to 2 s, so a few minutes
of load show what hours would page. It writes what fired, by receiver, to --alerts-out and exits
non-zero if anything reached the pager.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import save_report  # noqa: E402
from load_tests.monitoring import ROOT, Alertmanager, Prometheus, WebhookLog, fast_rules, free_port  # noqa: E402


@contextmanager
def served(url: str | None, extra: list[str]) -> Iterator[tuple[str, int | None]]:
    """`url` as it is, or a server started here with `extra` flags (stopped afterwards): (url, its pid)."""
    if url is not None:
        yield url, None
        return
    proc, url = start_server(extra)
    try:
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(60)


def start_server(
    extra: list[str], root: Path = ROOT, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """`serve.py` of the checkout at `root` on a free port, once it answers /ready: (process, url)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(root / "serve.py"), "--port", str(port), *extra], cwd=root, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url)
    except BaseException:  # not ready, or the caller stopped meanwhile: never leave the server running
        proc.terminate()
        proc.wait(60)
        raise
    return proc, url


def _wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited before it was ready; see its log above")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server was not ready after {timeout_s:.0f} s")


def run_locust(host: str, users: int, spawn_rate: float, duration: str, out: Path) -> int:
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(ROOT / "load_tests" / "locustfile.py"),
        "--headless",
        "--host",
        host,
        "--users",
        str(users),
        "--spawn-rate",
        str(spawn_rate),
        "--run-time",
        duration,
        "--stop-timeout",
        "300",  # let requests in flight finish: a cut-off request is not a server failure
        "--csv",
        str(out),
        "--html",
        str(out.with_suffix(".html")),
        "--only-summary",
    ]
    return subprocess.run(cmd, cwd=ROOT).returncode


@contextmanager
def watched(host: str, workdir: Path) -> Iterator[Callable[[], dict]]:
    """Prometheus and Alertmanager (notifying a webhook log) watching `host`; yields a function
    that reports what fired so far, what reached each receiver, and the worst p99 latencies."""
    webhook = WebhookLog(workdir)
    alertmanager = Alertmanager(workdir, webhook.url)
    instance = host.removeprefix("http://")
    prometheus = Prometheus([instance], workdir, fast_rules(workdir), alertmanager.url.removeprefix("http://"))

    def report() -> dict:
        time.sleep(5)  # the last evaluations and notifications
        fired = prometheus.query('ALERTS{alertstate="firing"}[1d]')
        notified = [line.split(" ", 2)[2] for line in webhook.log_text().splitlines() if " firing " in line]
        p99 = {
            kind: prometheus.query(f"max_over_time(instance:{kind}_seconds:p99_5m[1d])")
            for kind in ("time_to_first_token", "time_per_output_token")
        }
        slo = {kind: prometheus.query(f'max(slo_target_seconds{{kind="{kind}"}})') for kind in ("ttft", "tpot")}
        return {
            "slo_seconds": {k: float(v[0]["value"][1]) for k, v in slo.items()},
            "fired": sorted({a["metric"]["alertname"] for a in fired}),
            "paged": sorted({line.split()[2] for line in notified if line.startswith("pager ")}),
            "logged": sorted({line.split()[2] for line in notified if line.startswith("log ")}),
            "worst_p99_seconds": {k: float(v[0]["value"][1]) if v else None for k, v in p99.items()},
            "notifications": notified,
        }

    try:
        prometheus.wait_for(lambda: prometheus.query('up{job="conf-kv"} == 1'), "the server up")
        yield report
    finally:
        for process in (prometheus, alertmanager, webhook):
            process.stop()


def alerts_table(users: int, duration: str, seen: dict) -> str:
    def names(key: str) -> str:
        return ", ".join(seen[key]) or "none"

    p99, slo = seen["worst_p99_seconds"], seen["slo_seconds"]
    return "\n".join(
        [
            "| users | duration | SLO TTFT / TPOT | worst p99 TTFT | worst p99 TPOT | paged | logged only |",
            "| ---: | --- | --- | ---: | ---: | --- | --- |",
            f"| {users} | {duration} | {slo['ttft']:g} s / {slo['tpot']:g} s | {p99['time_to_first_token'] or 0:.2f} s "
            f"| {p99['time_per_output_token'] or 0:.3f} s | {names('paged')} | {names('logged')} |",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", help="a running server; default: start one on the embedded model")
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--spawn-rate", type=float, default=2.0)
    parser.add_argument("--duration", default="5m", help="locust --run-time, e.g. 40s or 10m")
    parser.add_argument("--out", type=Path, default=ROOT / "load_tests" / "results" / "load")
    parser.add_argument("--server-arg", action="append", default=[], help="extra serve.py flag (repeatable)")
    parser.add_argument("--watch-alerts", action="store_true", help="run Prometheus and Alertmanager beside it")
    parser.add_argument(
        "--alerts-out", type=Path, default=ROOT / "benchmarks" / "load_alerts" / "results" / "load_alerts"
    )
    args = parser.parse_args(argv)
    with served(args.host, args.server_arg) as (host, _), tempfile.TemporaryDirectory() as workdir:
        if not args.watch_alerts:
            code = run_locust(host, args.users, args.spawn_rate, args.duration, args.out)
        else:
            with watched(host, Path(workdir)) as report:
                code = run_locust(host, args.users, args.spawn_rate, args.duration, args.out)
                seen = report()
            table = alerts_table(args.users, args.duration, seen)
            save_report(args.alerts_out, "Alerts under the locust mix", table, seen, args)
            code = code or (1 if seen["paged"] else 0)
    print(f"locust report: {args.out.with_suffix('.html')} and {args.out}_stats.csv")
    return code


if __name__ == "__main__":
    sys.exit(main())
