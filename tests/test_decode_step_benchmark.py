"""The decode-step benchmark's process handling: a stopped run leaves nothing measuring behind."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def _measuring_children(parent: psutil.Process) -> list[psutil.Process]:
    children = []
    for child in parent.children(recursive=True):
        try:
            if "--measure" in child.cmdline():
                children.append(child)
        except psutil.NoSuchProcess:
            continue
    return children


def test_stopping_the_benchmark_stops_its_measuring_child(tmp_path, default_path):
    command = [sys.executable, "benchmarks/decode_step/run.py", "--seqs", "1", "--prompt-tokens", "16", "--steps", "1"]
    command += ["--model-path", str(default_path), "--out", str(tmp_path / "decode_step")]
    parent = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        children: list[psutil.Process] = []
        while not children and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            children = _measuring_children(psutil.Process(parent.pid))
        assert children, "the benchmark started no measuring child"
        parent.send_signal(signal.SIGTERM)
        stopped_with = parent.wait(timeout=60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, "the measuring child outlived the stopped benchmark"
        assert stopped_with == 128 + signal.SIGTERM
        assert not (tmp_path / "decode_step.json").exists()
    finally:
        parent.kill()
        parent.wait()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
