"""The GPU check: the CUDA paths on one NVIDIA GPU and the first GPU figures, in one run of a few
minutes on a machine that has no network. `make gpu-check` (scripts/gpu_check.sh) installs the offline
bundle (`make gpu-bundle`) into the machine's own python3 and runs this.

Its parts, in order of what matters most, each under a time limit:

1. tests: the CUDA tests (`tests/test_cuda.py`): decode attention at the embedded model's sizes
   against the CPU reference; the block writes against the CPU's bytes; logits on CUDA against the
   CPU's, step by step, on the embedded architecture with random weights, compression off and on;
   generation under torch's CUDA sanitizer; the KV budget taken from free GPU memory;
2. decode: the decode step at the same batch (`benchmarks/decode_step/run.py`), a Llama-3.1-8B-shaped
   model with random weights (speed does not depend on their values) in bf16, 64 sequences of 4096
   tokens: compression off against int8 at rates 0.6 and 0.875, with the compressor's share of the
   step from torch's profiler;
3. serving: a fixed KV budget over HTTP (`benchmarks/serving_http/run.py --headline`), the server on
   the same model, a budget that holds 16 uncompressed requests, 128 requests of 4096 tokens
   offered, compression off against dynamic 0.6;
4. async: asynchronous compression against compressing between steps
   (`benchmarks/async_compression/run.py`), 16 and 64 sequences of 1024 tokens on the same model:
   decode throughput, and compression's share of the step on the critical path and beside it;
5. calibrate: the retention confidence fitted for the same model on the GPU (`conf-kv calibrate
   --device cuda`, a quarter of its corpus sequences): how long a model of this size waits for its
   thresholds.

Each part writes its own results under benchmarks/gpu_check/results/gpu/; this script adds gpu_check.{json,md}
(the GPU, torch, triton and transformers, each part's status and time, the figures) and reports two
targets, met or not, never asserted:

- the compressed (int8) decode step at most 0.6x the bf16 step, every step counted;
- fixed-budget output token throughput at least 2.3x that of compression off.

The exit status is 0 when every part ran and passed, 1 otherwise. `--dry-run` runs the same parts on
the CPU with tiny shapes (the embedded architecture; the CUDA tests collected, not run), so that the
script cannot rot between GPU runs; the test suite runs it. `--parts` runs some parts only (a second
try). Nothing is downloaded: models come from the model cache (the bundle's, on a GPU machine).

    python benchmarks/gpu_check/run.py
    python benchmarks/gpu_check/run.py --parts decode serving
    python benchmarks/gpu_check/run.py --dry-run --results /tmp/gpu-dry-run
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.report import ROOT, Provenance, command_line, save_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

TESTS, DECODE, SERVING, ASYNC, CALIBRATE = "tests", "decode", "serving", "async", "calibrate"
PARTS = (TESTS, DECODE, SERVING, ASYNC, CALIBRATE)
DECODE_SETUPS = ("compression off", "int8, rate 0.6", "int8, rate 0.875")
SERVING_ON = "dynamic 0.6"  # serving_client.py's compressed mode
DECODE_TARGET = 0.6  # compressed int8 step / bf16 step, at most
THROUGHPUT_TARGET = 2.3  # fixed-budget output token throughput, compressed / off, at least


@dataclass(frozen=True)
class Plan:
    """What the parts run: where, on which model, at which sizes, within which limits (seconds)."""

    device: str
    dtype: str
    architecture: str  # the figures' model, with random weights (confkv.models.random_weights)
    seqs: int  # decode step: sequences decoding together
    prompt_tokens: int  # decode step and serving: prompt length
    steps: int  # decode step: tokens each sequence decodes, timed (2 compression intervals)
    profile_steps: int  # decode step: profiled after those, not timed (1 compression interval)
    fit: int  # serving: uncompressed requests the KV budget holds
    requests: int  # serving: requests offered at once
    max_tokens: int  # serving: tokens each decodes
    async_prompt_tokens: int  # async: prompt length (two engines' caches at once, both batches)
    calibrate_sequences: int  # calibrate: corpus sequences recorded (24 by default)
    calibrate_prompt_tokens: int  # calibrate: tokens of each
    calibrate_window: int  # calibrate: the prediction window fitted for
    threads: int
    limits: dict[str, float] = field(default_factory=dict)


# An H200 (about 139 GiB): 64 x 4096 tokens of this model's KV are 32 GiB in bf16, the weights 16 GiB.
# The limits add up to 9 minutes, so that a lease of a quarter of an hour leaves time to run again the
# parts that failed (`--parts`).
GPU = Plan(
    "cuda", "bfloat16", "Llama-3.1-8B", seqs=64, prompt_tokens=4096, steps=32, profile_steps=16, fit=16,
    requests=128, max_tokens=128, async_prompt_tokens=1024, calibrate_sequences=6, calibrate_prompt_tokens=800,
    calibrate_window=128, threads=os.cpu_count() or 16,
    limits={TESTS: 150, DECODE: 120, SERVING: 150, ASYNC: 60, CALIBRATE: 60},
)  # fmt: skip
DRY_RUN = Plan(
    "cpu", "float32", "SmolLM2-135M-Instruct", seqs=2, prompt_tokens=64, steps=4, profile_steps=4, fit=2,
    requests=4, max_tokens=8, async_prompt_tokens=64, calibrate_sequences=2, calibrate_prompt_tokens=64,
    calibrate_window=16, threads=2,
    limits={TESTS: 120, DECODE: 240, SERVING: 300, ASYNC: 240, CALIBRATE: 240},
)  # fmt: skip


@dataclass
class Part:
    """One part of the check: what it runs, how long it may take, and how it went."""

    name: str
    command: list[str]  # the interpreter's arguments, paths relative to the repository (where it runs)
    limit_s: float
    status: str = "not run"
    elapsed_s: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status.startswith("ok")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: everything but the GPU")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--results", type=Path, default=RESULTS / "gpu", help="where every part writes")
    args = parser.parse_args()
    plan = DRY_RUN if args.dry_run else GPU
    machine = describe_machine(args.dry_run)
    os.environ["HF_HUB_OFFLINE"] = "1"  # for this process and every part: nothing is ever downloaded
    provenance = Provenance.capture()
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "cuda_tests.xml"
        parts = [part for part in plan_parts(plan, args.results, junit, args.dry_run) if part.name in args.parts]
        with tqdm(parts, unit="part", desc="gpu check") as bar:
            for part in bar:
                bar.set_postfix_str(part.name)
                run_part(part)
                if part.name == TESTS and not args.dry_run:
                    part.status = tests_status(test_outcomes(junit), part.status)
                tqdm.write(f"{part.name}: {part.status} in {part.elapsed_s:.0f} s (limit {part.limit_s:.0f} s)")
        tests = test_outcomes(junit)
    ran = {part.name for part in parts if part.passed}
    data = {
        "machine": machine,
        "plan": asdict(plan),
        "elapsed_s": time.monotonic() - started,
        "parts": [{**asdict(part), "command": command_line(part.command)} for part in parts],
        "tests": tests,
        "decode_step": decode_figures(args.results) if DECODE in ran else None,
        "serving": serving_figures(args.results) if SERVING in ran else None,
        "async_compression": async_figures(args.results) if ASYNC in ran else None,
    }
    data["targets"] = targets(data)
    save_report(args.results / "gpu_check", "GPU check", summary(data), data, args, provenance)
    sys.exit(0 if all(part.passed for part in parts) else 1)


def plan_parts(plan: Plan, results: Path, junit: Path, dry_run: bool) -> list[Part]:
    """The parts' commands for `plan`, their results under `results`."""
    from confkv.models.random_weights import random_model_path

    model = random_model_path(plan.architecture)
    placement = ["--device", plan.device, "--dtype", plan.dtype, "--model-path", str(model)]
    placement += ["--threads", str(plan.threads)]
    tests = ["-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider"]
    tests += ["--collect-only"] if dry_run else ["--junitxml", str(junit)]
    return [
        Part(TESTS, tests, plan.limits[TESTS]),
        Part(
            DECODE,
            ["benchmarks/decode_step/run.py", *placement, "--seqs", str(plan.seqs), "--prompt-tokens"]
            + [str(plan.prompt_tokens), "--steps", str(plan.steps), "--compressor-profile-steps"]
            + [str(plan.profile_steps), "--setups", *DECODE_SETUPS, "--out", relative(results / "gpu_decode_step")],
            plan.limits[DECODE],
        ),
        Part(
            SERVING,
            ["benchmarks/serving_http/run.py", "--headline", "--no-generate-batch", "--check-answers", "0", *placement]
            + ["--fit", str(plan.fit), "--num-prompts", str(plan.requests), "--prompt-tokens", str(plan.prompt_tokens)]
            + ["--max-tokens", str(plan.max_tokens), "--out", relative(results / "gpu_serving_fixed_budget")],
            plan.limits[SERVING],
        ),
        Part(
            ASYNC,
            ["benchmarks/async_compression/run.py", *placement, "--seqs", "16", str(plan.seqs), "--prompt-tokens"]
            + [str(plan.async_prompt_tokens), "--tokens", str(plan.steps), "--out"]
            + [relative(results / "gpu_async_compression")],
            plan.limits[ASYNC],
        ),
        Part(
            CALIBRATE,
            ["-m", "confkv.compress.predictor.fitting", "--model-path", str(model), "--device", plan.device]
            + ["--threads", str(plan.threads), "--sequences", str(plan.calibrate_sequences), "--prompt-tokens"]
            + [str(plan.calibrate_prompt_tokens), "--prediction-window", str(plan.calibrate_window), "--out"]
            + [relative(results / "gpu_fitted_confidence")],
            plan.limits[CALIBRATE],
        ),
    ]


def describe_machine(dry_run: bool) -> dict:
    """The GPU and the versions this check ran with; without CUDA, exits saying what to do (a dry
    run describes the CPU instead)."""
    import torch

    versions = {name: version_of(name) for name in ("torch", "triton", "transformers")}
    if dry_run:
        return {"name": "CPU (dry run)", **versions}
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA: a CPU build"
        sys.exit(
            f"CUDA is not available (torch {torch.__version__}, {build}). This check needs an NVIDIA GPU: run "
            "`make gpu-check` on a GPU machine, or `make gpu-check ARGS=--dry-run` to try everything else here."
        )
    free, total = torch.cuda.mem_get_info()
    return {
        "name": torch.cuda.get_device_name(),
        **versions,
        "cuda": torch.version.cuda,
        "memory_gib": round(total / 2**30, 1),
        "free_gib_at_start": round(free / 2**30, 1),
    }


def version_of(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def relative(path: Path) -> str:
    """`path` as the parts are given it: relative to the repository where it lies inside it, so that
    the commands their results record name no folder of this machine."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def run_part(part: Part) -> None:
    """Run the part's command in its own process group, so that on time-out everything it started
    (a server included) is stopped with it."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, *part.command], cwd=ROOT, start_new_session=True)
    try:
        code = proc.wait(timeout=part.limit_s)
        part.status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):  # a server still finishing its requests
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        part.status = f"timed out after {part.limit_s:.0f} s"
    part.elapsed_s = time.monotonic() - started


def test_outcomes(junit: Path) -> dict[str, str]:
    """Each CUDA test's outcome (passed, failed, skipped), from pytest's JUnit report; none without one."""
    if not junit.is_file():
        return {}
    outcomes = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        found = {child.tag for child in case}
        outcome = "failed" if found & {"failure", "error"} else "skipped" if "skipped" in found else "passed"
        outcomes[case.get("name")] = outcome
    return outcomes


def tests_status(outcomes: dict[str, str], status: str) -> str:
    """The tests part's status with its counts; "ok" only where tests ran and none failed or was skipped."""
    counts = {outcome: list(outcomes.values()).count(outcome) for outcome in ("passed", "failed", "skipped")}
    detail = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
    if not outcomes:
        return status
    if not status.startswith("ok") or counts["failed"]:
        return f"{status}: {detail}"
    return f"ok: {detail}" if counts["passed"] and not counts["skipped"] else f"failed: {detail}"


def decode_figures(results: Path) -> dict:
    """Each setup's decode step (median and mean ms, their ratios to compression off) and the
    compressor's profiled share, from the decode part's results."""
    rows = json.loads((results / "gpu_decode_step.json").read_text())["results"]["this tree"]
    off = rows["compression off"]
    return {
        setup: {
            "median_step_ms": row["median_step_ms"],
            "mean_step_ms": row["mean_step_ms"],
            "median_vs_off": row["median_step_ms"] / off["median_step_ms"],
            "mean_vs_off": row["mean_step_ms"] / off["mean_step_ms"],
            "compressor_share": row["compressor"]["share"],
        }
        for setup, row in rows.items()
    }


def serving_figures(results: Path) -> dict:
    """Output token throughput off and on at the fixed budget, and the peak running requests."""
    summaries = json.loads((results / "gpu_serving_fixed_budget.json").read_text())["summaries"]
    off, on = summaries["compression off"], summaries[SERVING_ON]
    return {
        "off_tokens_per_s": off["output_token_throughput"],
        "on_tokens_per_s": on["output_token_throughput"],
        "ratio": on["output_token_throughput"] / max(off["output_token_throughput"], 1e-9),
        "off_peak_running": off["peak_running"],
        "on_peak_running": on["peak_running"],
        "errors": off["errors"] + on["errors"],
    }


def async_figures(results: Path) -> dict:
    """By batch: each way's decode throughput and compression's share of the step on the critical path."""
    batches = json.loads((results / "gpu_async_compression.json").read_text())["results"]
    return {
        seqs: {
            way: {"tokens_per_s": row["tokens_per_s"], "critical_share": row["critical_share"]}
            for way, row in ways.items()
        }
        for seqs, ways in batches.items()
    }


def targets(data: dict) -> dict:
    """Each target: what was measured and whether it is met (None where its part did not run)."""
    decode, serving = data["decode_step"], data["serving"]
    ratios = {setup: row["mean_vs_off"] for setup, row in (decode or {}).items() if setup != "compression off"}
    met_at = [setup for setup, ratio in ratios.items() if ratio <= DECODE_TARGET]
    return {
        "decode_step": {
            "target": f"int8 decode step <= {DECODE_TARGET}x the bf16 step (mean of every step)",
            "measured": ", ".join(f"{setup}: {ratio:.2f}x" for setup, ratio in ratios.items()) or "not measured",
            "met": (f"met at {', '.join(met_at)}" if met_at else "not met") if ratios else None,
        },
        "throughput": {
            "target": f"fixed-budget output token throughput >= {THROUGHPUT_TARGET}x compression off",
            "measured": f"{serving['ratio']:.2f}x ({serving['on_tokens_per_s']:.0f} against "
            f"{serving['off_tokens_per_s']:.0f} tok/s)"
            if serving
            else "not measured",
            "met": ("met" if serving["ratio"] >= THROUGHPUT_TARGET else "not met") if serving else None,
        },
    }


def summary(data: dict) -> str:
    """The one table this check prints: each part, its figures, and the targets."""
    machine, plan = data["machine"], data["plan"]
    memory = f", {machine['memory_gib']} GiB" if "memory_gib" in machine else ""
    lines = [
        f"{machine['name']}{memory}; torch {machine['torch']}, triton {machine['triton']}, transformers "
        f"{machine['transformers']}. Figures on {plan['architecture']} with random weights in {plan['dtype']}: "
        f"decode step {plan['seqs']} x {plan['prompt_tokens']} tokens; serving a budget of {plan['fit']} "
        f"uncompressed requests, {plan['requests']} of {plan['prompt_tokens']} tokens offered, "
        f"{plan['max_tokens']} new each. The parts took {data['elapsed_s']:.0f} s; each part's own results "
        "are beside this file.",
        "",
        "| check | result | time (limit) |",
        "| --- | --- | ---: |",
    ]
    for part in data["parts"]:
        lines.append(f"| {part['name']} | {part['status']} | {part['elapsed_s']:.0f} s ({part['limit_s']:.0f} s) |")
        if part["name"] == DECODE and data["decode_step"]:
            for setup, row in data["decode_step"].items():
                lines.append(
                    f"| - {setup} | {row['mean_step_ms']:.1f} ms a step ({row['mean_vs_off']:.2f}x off), median "
                    f"{row['median_step_ms']:.1f} ms ({row['median_vs_off']:.2f}x); compressor "
                    f"{100 * row['compressor_share']:.1f}% of the step | |"
                )
        if part["name"] == SERVING and data["serving"]:
            s = data["serving"]
            lines.append(
                f"| - off / {SERVING_ON} | {s['off_tokens_per_s']:.0f} / {s['on_tokens_per_s']:.0f} output tok/s, "
                f"peak running {s['off_peak_running']} / {s['on_peak_running']}, {s['errors']} errors | |"
            )
        if part["name"] == ASYNC and data["async_compression"]:
            for seqs, ways in data["async_compression"].items():
                between, beside = ways["between steps"], ways["beside the forward pass"]
                lines.append(
                    f"| - {seqs} sequences, between steps / beside the forward pass | {between['tokens_per_s']:.0f} / "
                    f"{beside['tokens_per_s']:.0f} tok/s ({beside['tokens_per_s'] / between['tokens_per_s']:.2f}x); "
                    f"compression on the critical path {100 * between['critical_share']:.1f}% / "
                    f"{100 * beside['critical_share']:.1f}% of the step | |"
                )
        if part["name"] == CALIBRATE and part["status"].startswith("ok"):
            lines.append(
                f"| - {plan['calibrate_sequences']} corpus sequences of {plan['calibrate_prompt_tokens']} tokens, "
                f"window {plan['calibrate_window']} | {part['elapsed_s']:.0f} s, the model's load included (the "
                "default records 24) | |"
            )
    for target in data["targets"].values():
        lines.append(f"| target: {target['target']} | {target['measured']}: {target['met'] or 'not measured'} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
