"""The benchmarks' process handling: the decode step's measuring child runs the code it is given,
and a stopped run leaves nothing behind (that child, RULER's server and lm-eval)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _children(parent: psutil.Process, matches: Callable[[list[str]], bool]) -> list[psutil.Process]:
    """The descendants of `parent` whose command line `matches`."""
    children = []
    for child in parent.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if matches(child.cmdline()):
                children.append(child)
    return children


def _kill_all(parent: subprocess.Popen, children: list[psutil.Process]) -> None:
    """Whatever a test left running, gone (a failed assertion must not leave a benchmark behind)."""
    parent.kill()
    parent.wait()
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


def test_a_baseline_is_measured_on_its_own_code_and_helpers(tmp_path):
    """Importing the benchmark imports this tree's `confkv` (its placement options need it): the
    measuring child of a baseline must still import the baseline's packages and helpers, not
    measure this tree twice."""
    for package in ("confkv", "benchmarks"):
        (tmp_path / package).mkdir()
    (tmp_path / "confkv" / "__init__.py").write_text("REVISION = 'baseline'\n")
    (tmp_path / "benchmarks" / "__init__.py").write_text("")
    (tmp_path / "benchmarks" / "engine.py").write_text("import confkv\nREVISION = confkv.REVISION\n")
    script = (
        "import sys, runpy\n"
        "run = runpy.run_path('benchmarks/decode_step/run.py', run_name='measured')\n"
        "assert 'confkv' in sys.modules\n"
        f"run['use_code_of'](__import__('pathlib').Path({str(tmp_path)!r}))\n"
        "import benchmarks.engine\n"
        "print(benchmarks.engine.REVISION, benchmarks.engine.__file__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    revision, path = out.stdout.split()
    assert revision == "baseline" and Path(path).is_relative_to(tmp_path)


def test_stopping_the_benchmark_stops_its_measuring_child(tmp_path, default_path):
    command = [sys.executable, "benchmarks/decode_step/run.py", "--seqs", "1", "--prompt-tokens", "16", "--steps", "1"]
    command += ["--model-path", str(default_path), "--out", str(tmp_path / "decode_step")]
    parent = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        children: list[psutil.Process] = []
        while not children and parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            children = _children(psutil.Process(parent.pid), lambda cmdline: "--measure" in cmdline)
        assert children, "the benchmark started no measuring child"
        parent.send_signal(signal.SIGTERM)
        stopped_with = parent.wait(timeout=60)
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, "the measuring child outlived the stopped benchmark"
        assert stopped_with == 128 + signal.SIGTERM
        assert not (tmp_path / "decode_step.json").exists()
    finally:
        _kill_all(parent, children)


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_stopping_ruler_stops_its_server_and_lm_eval(tmp_path, default_path, when):
    """Stopped while its server starts, or while lm-eval runs against it: nothing it started lives on."""
    command = [sys.executable, "benchmarks/ruler/run.py", "--tasks", "niah_single_1", "--lengths", "4096"]
    command += ["--limit", "1", "--setups", "compression off", "--model-path", str(default_path)]
    command += ["--out", str(tmp_path / "ruler")]
    parent = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while parent.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            servers = _children(psutil.Process(parent.pid), lambda line: any(a.endswith("serve.py") for a in line))
            others = [c for c in psutil.Process(parent.pid).children() if c not in servers]
            if servers and (when == "starting" or others):  # serving: lm-eval is running beside it
                started = psutil.Process(parent.pid).children(recursive=True)
                break
        assert started, f"the benchmark never got to {when}"
        parent.send_signal(signal.SIGTERM)
        assert parent.wait(timeout=90) == 128 + signal.SIGTERM
        _, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, f"outlived the stopped benchmark: {[p.cmdline()[:3] for p in alive]}"
        assert not (tmp_path / "ruler.json").exists()
    finally:
        _kill_all(parent, started)


def test_the_roofline_sets_each_setups_kernel_against_the_machines_bandwidth():
    run = __import__("runpy").run_path(str(ROOT / "benchmarks/decode_step/run.py"), run_name="measured")
    profile = {"kernel_ms": 50.0, "kv_bytes": 10**9, "compressor_ms": 0.0, "share": 0.0, "step_ms": 1.0, "steps": 2}
    data = {"results": {"this tree": {"int8, rate 0.6": {"compressor": profile}}}, "bandwidth_gbs": {"this tree": 40.0}}
    (row,) = [line for line in run["roofline"](data) if line.startswith("| int8")]
    # 1 GB in 50 ms is 20 GB/s, half of 40; at 40 GB/s it would take 25 ms.
    assert row == "| int8, rate 0.6 | 954 MiB | 50.0 ms | 20.0 GB/s | 50% | 25.0 ms |"


def test_the_kernel_benchmark_times_both_bodies_of_every_format(tmp_path):
    out = tmp_path / "decode_kernel"
    command = [sys.executable, "benchmarks/decode_kernel/run.py", "--rows", "2", "--entries", "40", "--layers", "2"]
    subprocess.run([*command, "--repeats", "1", "--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    formats = __import__("json").loads(out.with_suffix(".json").read_text())["formats"]
    assert set(formats) == {"float32", "float16", "bfloat16", "int8", "int4", "kivi4"}
    for row in formats.values():
        assert row["vector"] > 0 and row["portable"] > 0
    # 2 rows x 40 entries x 2 layers x 3 KV heads, a key and a value each: 64 + 2 bytes per int8 vector.
    assert formats["int8"]["bytes_per_pass"] == 2 * 40 * 2 * 3 * 2 * 66
