"""`serve.py --ray` as a user starts it: its own local Ray cluster, served on the given port, and on
SIGTERM a stream already under way finishes before the process exits, on a machine kept busy."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import pytest

from confkv.cluster.replica import REPLICA_HEADER
from tests.helpers import LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_serve_py_ray_serves_and_drains_a_running_stream_on_sigterm():
    server = LiveServer("--ray", "--cluster.replicas", "1", "--max-num-seqs", "4", "--shutdown-grace-period", "120")
    # A process spinning on one of the cores: a replica running more torch threads than the CPUs it
    # reserves then decoded 8x slower, and this stream outlived the grace period.
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/generate", json=body, timeout=300) as response:
            assert response.status_code == 200 and response.headers[REPLICA_HEADER]
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            server.proc.send_signal(signal.SIGTERM)
            events = [json.loads(first[5:])] + [json.loads(line[5:]) for line in lines if line.startswith("data:")]
        assert events[-1]["finish_reason"] == "length", events[-1]
        assert events[-1]["usage"]["completion_tokens"] == 48
        assert server.proc.wait(timeout=180) == 0
    finally:
        busy.kill()
        server.stop()
