"""One check of the CUDA paths on a machine with one NVIDIA GPU: `make gpu-check` installs the
project into .venv-gpu with a CUDA build of torch and runs this; or run it in any environment that
has one.

What a CPU-only test suite cannot see, in parts, each under a time limit so that the whole (with the
installation) stays within about 8 minutes on one H200-class GPU:

1. the CUDA tests (`pytest -m cuda tests/test_cuda.py`): decode attention at the embedded model's
   sizes against the CPU reference, greedy generation against the CPU with compression off and on,
   and the same generation under torch's CUDA sanitizer;
2. the decode step on cuda in bf16 (`benchmarks/decode_step.py`): compression off against int8 at
   rate 0.6, 0.75 and 0.875, 16 sequences x 2000 tokens;
3. the fixed-budget serving headline in its short form (`benchmarks/serving_client.py --headline
   --quick`), the server on cuda in bf16;
4. the decode step at 64 sequences x 2000 tokens, where free GPU memory holds its KV (estimated from
   the model's KV bytes per token, with margin) and time is left.

Each part writes its own results under benchmarks/results/gpu/; this script adds gpu_check.{json,md}
and prints one summary: each part's status and time, and the two targets, met or not met:

- the compressed (int8) decode step at most 0.6x the uncompressed bf16 step, at 16 x 2000 tokens;
- fixed-budget output token throughput at least 2.3x that of compression off.

Targets are reported, never asserted: the exit status is 0 when every part ran and passed, 1 when a
part failed or ran out of time; without CUDA it refuses at once (exit 2), saying what to do. Nothing
is downloaded: the model is the embedded one or a local folder (`--model-path`), the hub kept offline.

    python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --model-path /models/Qwen2.5-7B-Instruct    # the benchmarks on it
    python benchmarks/gpu_check.py --budget-s 600                              # more time for the parts
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.report import RESULTS, ROOT, Provenance, command_line, save_report  # noqa: E402

OUT = RESULTS / "gpu"
RATES = (0.6, 0.75, 0.875)
SETUPS = ["compression off", *(f"int8, rate {rate}" for rate in RATES)]
PROMPT_TOKENS, STEPS = 2000, 48  # decode_step.py's defaults: 48 steps hold 3 compressions
DECODE_TARGET = 0.6  # compressed int8 step / bf16 step, at most
THROUGHPUT_TARGET = 2.3  # fixed-budget output token throughput, compressed / off, at least
TESTS, SERVING = "CUDA tests", "serving headline (quick)"
DECODE_16, DECODE_64 = (f"decode step {seqs} x {PROMPT_TOKENS}" for seqs in (16, 64))
# Seconds each part may take at most (the 64-sequence run takes what the budget leaves, if enough).
LIMITS = {TESTS: 150, DECODE_16: 100, SERVING: 90}
MIN_DECODE_64_S = 60
KV_MARGIN = 1.5  # block pools grow by half their size at a time
HEADROOM_BYTES = 4 * 2**30  # CUDA context, activations of a 2048-token prefill chunk, allocator slack


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
    parser.add_argument("--model-path", type=Path, help="a local Hugging Face model folder for the benchmarks")
    parser.add_argument("--budget-s", type=float, default=340, help="seconds all parts may take together")
    parser.add_argument("--out", type=Path, default=OUT / "gpu_check")
    args = parser.parse_args()
    device = cuda_device()
    if args.model_path is not None and not (args.model_path / "config.json").is_file():
        sys.exit(f"{args.model_path} is not a Hugging Face model folder (no config.json); give a local folder")
    os.environ["HF_HUB_OFFLINE"] = "1"  # for this process and every part: nothing is ever downloaded
    provenance = Provenance.capture()
    started = time.monotonic()
    placement = ["--device", "cuda", "--dtype", "bfloat16"]
    placement += ["--model-path", str(args.model_path)] if args.model_path else []
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "cuda_tests.xml"
        parts = [
            Part(
                TESTS,
                ["-m", "pytest", "-m", "cuda", "tests/test_cuda.py", "-q", "-p", "no:cacheprovider"]
                + ["--junitxml", str(junit)],
                LIMITS[TESTS],
            ),
            Part(DECODE_16, decode_command(16, placement), LIMITS[DECODE_16]),
            Part(
                SERVING,
                ["benchmarks/serving_client.py", "--headline", "--quick", "--no-generate-batch", *placement]
                + ["--out", relative(OUT / "serving_http")],
                LIMITS[SERVING],
            ),
            Part(DECODE_64, decode_command(64, placement), 0),
        ]
        run_parts(parts, started + args.budget_s, args.model_path, junit)
        tests = test_outcomes(junit)
    data = {
        "gpu": device,
        "elapsed_s": time.monotonic() - started,
        "model": args.model_path.name if args.model_path else "default model",
        "parts": [{**asdict(part), "command": command_line(part.command)} for part in parts],
        "tests": tests,
        "decode_step": {
            name: decode_figures(seqs) for name, seqs in ((DECODE_16, 16), (DECODE_64, 64)) if ran_ok(parts, name)
        },
        "serving": serving_figures() if ran_ok(parts, SERVING) else None,
    }
    data["targets"] = targets(data)
    save_report(args.out, "GPU check", summary(data), data, args, provenance)
    sys.exit(0 if all(part.passed or part.status.startswith("skipped") for part in parts) else 1)


def run_parts(parts: list[Part], deadline: float, model_path: Path | None, junit: Path) -> None:
    """Run the parts in order, each within its limit and what is left until `deadline`; the
    64-sequence decode step only where memory and time allow."""
    with tqdm(parts, unit="part", desc="gpu check") as bar:
        for part in bar:
            bar.set_postfix_str(part.name)
            left = deadline - time.monotonic()
            if part.name == DECODE_64:
                part.limit_s = left
                reason = decode_64_skipped(model_path, left)
                if reason:
                    part.status = f"skipped: {reason}"
                    tqdm.write(f"{part.name}: {part.status}")
                    continue
            run_part(part, min(part.limit_s, max(left, 1.0)))
            if part.name == TESTS:
                part.status = tests_status(test_outcomes(junit), part.status)
            tqdm.write(f"{part.name}: {part.status} in {part.elapsed_s:.0f} s (limit {part.limit_s:.0f} s)")


def cuda_device() -> dict:
    """The GPU this check runs on; exits with what to do when torch sees none."""
    import torch

    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA: a CPU build"
        print(
            f"CUDA is not available (torch {torch.__version__}, {build}). This check needs an NVIDIA GPU and a "
            "CUDA build of torch: run `make gpu-check` on a GPU machine, which installs one into .venv-gpu "
            "(TORCH_INDEX_URL chooses the wheel index), or install torch from a CUDA wheel index here.",
            file=sys.stderr,
        )
        sys.exit(2)
    free, total = torch.cuda.mem_get_info()
    return {
        "name": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "memory_gib": round(total / 2**30, 1),
        "free_gib_at_start": round(free / 2**30, 1),
    }


def decode_command(seqs: int, placement: list[str]) -> list[str]:
    """decode_step.py's arguments: off against int8 at each rate, `seqs` x PROMPT_TOKENS, where `placement` says."""
    return [
        "benchmarks/decode_step.py",
        *placement,
        "--seqs",
        str(seqs),
        "--setups",
        *SETUPS,
        "--out",
        relative(OUT / f"decode_step_{seqs}x{PROMPT_TOKENS}"),
    ]


def relative(path: Path) -> str:
    """`path` (in the repository) as the parts are given it: relative, as they run there, so that the
    commands their results record name no folder of this machine."""
    return str(path.relative_to(ROOT))


def run_part(part: Part, limit_s: float) -> None:
    """Run the part's command in its own process group, so that on time-out everything it started
    (a server included) is stopped with it."""
    part.limit_s = limit_s
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, *part.command], cwd=ROOT, start_new_session=True)
    try:
        code = proc.wait(timeout=limit_s)
        part.status = "ok" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):  # a server still finishing its requests
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        part.status = f"timed out after {limit_s:.0f} s"
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
    """The tests part's status with its counts; "ok" only where tests ran and none failed."""
    counts = {outcome: list(outcomes.values()).count(outcome) for outcome in ("passed", "failed", "skipped")}
    detail = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
    if not outcomes or counts["failed"] or not status.startswith("ok"):
        return f"{status}: {detail}" if outcomes else status
    return f"ok: {detail}" if counts["passed"] else f"failed: none ran ({detail})"


def decode_64_skipped(model_path: Path | None, left_s: float) -> str:
    """Why the 64-sequence decode step is not run, or "" when free memory and time allow it."""
    if left_s < MIN_DECODE_64_S:
        return f"{left_s:.0f} s left of the budget, under {MIN_DECODE_64_S} s"
    import torch
    from transformers import AutoConfig

    from benchmarks.engine import KV_BUDGET
    from models.default_model import default_model_path
    from models.loader import KVShape

    folder = model_path or default_model_path()
    shape = KVShape.of(AutoConfig.from_pretrained(folder))
    token_bytes = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * torch.bfloat16.itemsize
    per_setup = 64 * (PROMPT_TOKENS + STEPS) * token_bytes  # every setup's engine holds its KV at once
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))  # at most: bf16 halves fp32 files
    need = KV_MARGIN * len(SETUPS) * per_setup + weights + HEADROOM_BYTES
    free, _ = torch.cuda.mem_get_info()
    if per_setup > KV_BUDGET:
        return f"64 x {PROMPT_TOKENS} tokens need {per_setup / 2**30:.1f} GiB of KV, over an engine's budget"
    if need > free:
        return f"it needs about {need / 2**30:.0f} GiB of GPU memory, {free / 2**30:.0f} GiB are free"
    return ""


def ran_ok(parts: list[Part], name: str) -> bool:
    return next(part for part in parts if part.name == name).passed


def decode_figures(seqs: int) -> dict:
    """Median decode step of each setup (ms) and its ratio to compression off, from the part's results."""
    rows = json.loads((OUT / f"decode_step_{seqs}x{PROMPT_TOKENS}.json").read_text())["results"]["this tree"]
    off = rows["compression off"]["median_step_ms"]
    return {
        setup: {"median_step_ms": row["median_step_ms"], "vs_off": row["median_step_ms"] / off}
        for setup, row in rows.items()
    }


def serving_figures() -> dict:
    """Output token throughput off and on at the fixed budget, from the part's results."""
    summaries = json.loads((OUT / "serving_http.json").read_text())["summaries"]
    off, on = (summaries[mode]["output_token_throughput"] for mode in ("compression off", "dynamic 0.6"))
    return {"off_tokens_per_s": off, "on_tokens_per_s": on, "ratio": on / off if off else 0.0}


def targets(data: dict) -> dict:
    """Each target: what was measured and whether it is met (None where its part did not run)."""
    decode = data["decode_step"].get(DECODE_16)
    ratios = {rate: decode[f"int8, rate {rate}"]["vs_off"] for rate in RATES} if decode else {}
    met_at = [rate for rate, ratio in ratios.items() if ratio <= DECODE_TARGET]
    serving = data["serving"]
    return {
        "decode_step": {
            "target": f"int8 decode step <= {DECODE_TARGET}x the bf16 step at 16 x {PROMPT_TOKENS}",
            "measured": ", ".join(f"rate {rate}: {ratio:.2f}x" for rate, ratio in ratios.items()) or "not measured",
            "met": (f"met at rate {', '.join(map(str, met_at))}" if met_at else "not met") if ratios else None,
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
    gpu = data["gpu"]
    lines = [
        f"{gpu['name']} ({gpu['memory_gib']} GiB, torch {gpu['torch']}, CUDA {gpu['cuda']}); {data['model']} in "
        f"bf16; the parts took {data['elapsed_s']:.0f} s. Each part's own results are beside this file in "
        "benchmarks/results/gpu/.",
        "",
        "| check | result | time (limit) |",
        "| --- | --- | ---: |",
    ]
    for part in data["parts"]:
        lines.append(f"| {part['name']} | {part['status']} | {part['elapsed_s']:.0f} s ({part['limit_s']:.0f} s) |")
        for setup, row in data["decode_step"].get(part["name"], {}).items():
            lines.append(f"| - {setup} | {row['median_step_ms']:.1f} ms per step, {row['vs_off']:.2f}x off | |")
        if part["name"] == SERVING and data["serving"]:
            serving = data["serving"]
            lines.append(
                f"| - output tokens/s, off / dynamic 0.6 | {serving['off_tokens_per_s']:.0f} / "
                f"{serving['on_tokens_per_s']:.0f} | |"
            )
    for target in data["targets"].values():
        lines.append(f"| target: {target['target']} | {target['measured']}: {target['met'] or 'not measured'} | |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
