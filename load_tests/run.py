"""Run the locust mix headless against a server, started here unless --host names one.

    python load_tests/run.py                          # 20 users, 5 minutes, own server
    python load_tests/run.py --host http://127.0.0.1:8080 --users 10 --duration 40s
Writes locust's CSV files and HTML report under --out; exits non-zero if any request failed.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


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


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(ROOT / "serve.py"), "--port", str(port), *extra], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the server exited before it was ready; see its log above")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the server was not ready after 300 s")


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", help="a running server; default: start one on the embedded model")
    parser.add_argument("--users", type=int, default=20)
    parser.add_argument("--spawn-rate", type=float, default=2.0)
    parser.add_argument("--duration", default="5m", help="locust --run-time, e.g. 40s or 10m")
    parser.add_argument("--out", type=Path, default=ROOT / "load_tests" / "results" / "load")
    parser.add_argument("--server-arg", action="append", default=[], help="extra serve.py flag (repeatable)")
    args = parser.parse_args(argv)
    with served(args.host, args.server_arg) as (host, _):
        code = run_locust(host, args.users, args.spawn_rate, args.duration, args.out)
    print(f"locust report: {args.out.with_suffix('.html')} and {args.out}_stats.csv")
    return code


if __name__ == "__main__":
    sys.exit(main())
