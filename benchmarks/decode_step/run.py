"""Decode step time at the same batch: compression off against int8 (and kivi4) storage at several rates.

N sequences of P prompt tokens are prefilled, then decode together (greedy, EOS ignored); the
figure is the median duration of the engine's pure decode steps (every sequence one token). All
setups run in one process, one engine each on the same prompts, sharing the model; once all are
prefilled their decode steps take turns one step at a time, so that drift on this noisy machine
hits every setup alike. Each setup's prefill (its steps up to the first pure decode step: the
prompts, one after another, and the first tokens of those already prefilled) is summed too; the
setups prefill one after another, so drift is not shared there. With `--baseline REV` the same
setups also run on the code of git revision REV (a temporary worktree, in its own process, before
this tree's).

    python benchmarks/decode_step/run.py                   # 16 x 2000 tokens: off, 0.6 (also thresholds off,
        # every 16 steps), 0.75, 0.875, kivi4
    python benchmarks/decode_step/run.py --baseline HEAD~3  # and the same on an older revision
    python benchmarks/decode_step/run.py --profile-seqs 32  # also: the Python share of a decode step
    python benchmarks/decode_step/run.py --setups --profile-seqs 32 \
        --out benchmarks/decode_step/results/decode_step_profile
    python benchmarks/decode_step/run.py --setups "compression off" "int8, rate 0.875" "int8, rate 0.875, by token" \
        --out benchmarks/decode_step/results/decode_step_spans        # words kept whole (the default) against tokens
    python benchmarks/decode_step/run.py --device cuda --dtype bfloat16 --out benchmarks/gpu_check/results/decode_step
Results: benchmarks/decode_step/results/decode_step.{json,md}.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.placement import add_placement_options  # noqa: E402
from benchmarks.report import (  # noqa: E402
    Provenance,
    command_line,
    commit_of,
    save_report,
)

if TYPE_CHECKING:  # not imported here: `measure` imports the engine from the code it measures
    import torch

    from confkv.engine.llm_engine import LLMEngine

ROOT = Path(__file__).resolve().parents[2]
ROOFLINE_STEPS = 2  # decode steps profiled for the kernel's time when the compressor's share is not asked
RESULTS = Path(__file__).resolve().parent / "results"
RATE_ONLY = {"policy_options": {"dynamic": {"thresholds_decide": False}}}
SETUPS = {  # label -> request (dynamic's thresholds decide under the rate's ceiling unless turned off)
    "compression off": {"policy": "none", "compression_rate": 0.0},
    "int8, rate 0.6": {"policy": "dynamic", "compression_rate": 0.6},
    "int8, rate 0.6, thresholds off": {"policy": "dynamic", "compression_rate": 0.6, **RATE_ONLY},
    # Compressing twice as often as shipped (the interval before 32): each compression costs the same.
    "int8, rate 0.6, every 16 steps": {"policy": "dynamic", "compression_rate": 0.6, "compression_interval": 16},
    "int8, rate 0.75": {"policy": "dynamic", "compression_rate": 0.75},
    "int8, rate 0.875": {"policy": "dynamic", "compression_rate": 0.875},
    "kivi4, rate 0.875": {"policy": "dynamic", "compression_rate": 0.875, "kv_cache_dtype": "kivi4"},
    # Each entry on its own (`retention_unit` token), against words kept whole (the default), whose spans
    # are found and pooled at every compression.
    "int8, rate 0.6, by token": {"policy": "dynamic", "compression_rate": 0.6, "retention_unit": "token"},
    "int8, rate 0.875, by token": {"policy": "dynamic", "compression_rate": 0.875, "retention_unit": "token"},
}
DEFAULT_SETUPS = [setup for setup in SETUPS if "by token" not in setup]
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm"}


@dataclass
class DecodeSteps:
    """One setup's pure decode steps (every sequence one token): their durations and the KV held."""

    durations: list[float] = field(default_factory=list)
    compression: list[float] = field(default_factory=list)  # seconds of each spent in the compressor
    kv_bytes: list[int] = field(default_factory=list)
    prefill_s: float = 0.0  # the steps before them: every prompt, with the first tokens decoded on the way

    def record(self, engine: LLMEngine, duration: float) -> None:
        """The engine's last step, `duration` seconds long, and the KV it holds after it."""
        self.durations.append(duration)
        self.compression.append(engine.last_step.compression_s)
        self.kv_bytes.append(engine.compression.store.used_bytes)

    def figures(self) -> dict:
        return {
            "median_step_ms": 1000 * statistics.median(self.durations),
            "mean_step_ms": 1000 * statistics.mean(self.durations),
            "median_compression_ms": 1000 * statistics.median(self.compression),
            "mean_compression_ms": 1000 * statistics.mean(self.compression),
            "median_kv_mib": statistics.median(self.kv_bytes) / 2**20,
            "decode_steps": len(self.durations),
            "prefill_s": self.prefill_s,
        }


def use_code_of(code_root: Path) -> None:
    """Make every later import of the project and of the benchmark helpers come from `code_root`:
    first on the path, and none of them left imported from this tree (the helpers of a revision
    import that revision's packages, which were not always `confkv`)."""
    sys.path.insert(0, str(code_root))
    for name in [name for name in sys.modules if name.partition(".")[0] in ("benchmarks", "confkv")]:
        del sys.modules[name]


def measure(code_root: Path, setups: list[str], args: argparse.Namespace) -> dict:
    """Run the setups on the code at `code_root` (imported from there), their decode steps taking
    turns one step at a time, so that drift on this machine hits every setup alike; return their figures."""
    import torch

    use_code_of(code_root)
    # Only now, so that the helpers, the engine, compression and the model loader come from `code_root`.
    from benchmarks.engine import advance, decoding_engine, is_pure_decode, load_with_predictor

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), args.dtype and getattr(torch, args.dtype)
    seqs = args.seqs
    model, tokenizer, future_value = load_with_predictor(args.model_path, device=device, dtype=dtype)
    tokens = args.steps + (args.compressor_profile_steps or ROOFLINE_STEPS)  # the profiled steps are not timed
    # A short request of each setup first, untimed: the kernels are built (a baseline's, in its own
    # folder, may not be yet) and loaded, and each code path run once, before anything is timed.
    with torch.inference_mode():
        for setup in setups:
            warm_up = decoding_engine(model, tokenizer, future_value, SETUPS[setup], 1, 64, 2)
            while warm_up.has_unfinished():
                warm_up.step()
    engines = {  # one engine each, sharing the model
        setup: decoding_engine(model, tokenizer, future_value, SETUPS[setup], seqs, args.prompt_tokens, tokens)
        for setup in setups
    }
    for engine in engines.values():
        if not Path(inspect.getfile(type(engine))).resolve().is_relative_to(code_root.resolve()):
            raise RuntimeError(f"the engine measured is {inspect.getfile(type(engine))}, not {code_root}'s")
    decoded = {setup: DecodeSteps() for setup in setups}
    shares: dict[str, dict] = {}
    bar = tqdm(total=len(setups) * seqs * tokens, desc=code_root.name, leave=False)
    with torch.inference_mode(), bar:
        for setup, engine in engines.items():  # prefill each, up to its first pure decode step
            while engine.last_step is None or engine.last_step.num_tokens != seqs:
                decoded[setup].prefill_s += advance(engine, bar, device)
        while any(engine.has_unfinished() for engine in engines.values()):
            for setup, engine in engines.items():
                halfway = len(decoded[setup].durations) == args.steps // 2
                if args.profile and halfway:
                    return {"python_share": python_share(engine, device)}
                if halfway and setup not in shares:
                    shares[setup] = step_profile(engine, device, args.compressor_profile_steps or ROOFLINE_STEPS)
                    bar.update(seqs * (args.compressor_profile_steps or ROOFLINE_STEPS))
                if engine.has_unfinished():
                    duration = advance(engine, bar, device)
                    if is_pure_decode(engine.last_step, seqs):
                        decoded[setup].record(engine, duration)
    figures = {setup: {**run.figures(), "compressor": shares[setup]} for setup, run in decoded.items()}
    return {"bandwidth_gbs": read_bandwidth(device), "setups": figures}


def read_bandwidth(device: torch.device, mib: int = 1024, repeats: int = 5) -> float:
    """The machine's memory bandwidth for reading, GB/s: a STREAM-like pass (a sum) over a buffer far
    larger than any cache, at the threads set, median of `repeats`. Attention reads, it does not write."""
    import time

    import torch

    buffer = torch.ones(mib * 2**20 // 4, device=device)
    times = []
    for _ in range(repeats + 1):  # the first pass faults the pages in
        start = time.perf_counter()
        buffer.sum().item()
        times.append(time.perf_counter() - start)
    return buffer.numel() * 4 / statistics.median(times[1:]) / 1e9


def profiled(engine: LLMEngine, steps: int, device: torch.device) -> tuple[list, float]:
    """Run `steps` engine steps under torch's profiler (host activity: it needs no CUPTI): the
    events, and the steps' wall time in microseconds (each step synchronised on CUDA)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("engine_step"):
                engine.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    events = prof.key_averages()
    return events, sum(e.cpu_time_total for e in events if e.key == "engine_step")


def python_share(engine: LLMEngine, device: torch.device, steps: int = 4) -> dict:
    """Profile a few decode steps: the share of their wall time spent outside torch operators and
    the decode kernel, i.e. in Python, dispatch and bookkeeping."""
    events, wall = profiled(engine, steps, device)
    # Operators' own time; the decode kernel is a named range (confkv.kv.paged_attention.KERNEL_EVENT)
    # whose own time is the kernel's.
    native = sum(e.self_cpu_time_total for e in events if e.key != "engine_step")
    kernel = sum(e.self_cpu_time_total for e in events if e.key == "conf_kv::decode_attention")
    # The model's projections and MLPs: the same work whatever the cache holds.
    matmul = sum(e.self_cpu_time_total for e in events if e.key in MATMULS)
    return {
        "step_ms": wall / 1000 / steps,
        "python_ms": (wall - native) / 1000 / steps,
        "kernel_ms": kernel / 1000 / steps,
        "matmul_ms": matmul / 1000 / steps,
        "share": 1 - native / wall,
    }


def step_profile(engine: LLMEngine, device: torch.device, steps: int) -> dict:
    """Profile `steps` decode steps (for the compressor's share, a whole number of compression intervals,
    so that compressing steps count as often as they come): the wall time the compressor takes (the
    engine's `conf_kv::compress` range; on CUDA its wall time holds the device work it waits for), the
    decode-attention kernel's (its own range, confkv.kv.paged_attention.KERNEL_EVENT) and the KV held,
    which attention reads once per step."""
    from confkv.engine.llm_engine import COMPRESS_EVENT

    held = engine.compression.store.used_bytes  # before: the last of the steps may finish the sequences
    events, wall = profiled(engine, steps, device)
    compress = sum(e.cpu_time_total for e in events if e.key == COMPRESS_EVENT)
    kernel = sum(e.cpu_time_total for e in events if e.key == "conf_kv::decode_attention")
    return {
        "steps": steps,
        "step_ms": wall / 1000 / steps,
        "compressor_ms": compress / 1000 / steps,
        "share": compress / wall,
        "kernel_ms": kernel / 1000 / steps,
        "kv_bytes": held,
    }


def run_tree(code_root: Path, setups: list[str], args: argparse.Namespace, profile: bool = False) -> dict:
    """The setups on one code tree, in a fresh process. Another tree builds its C++ extension into a
    folder of its own: in the shared one it would replace this tree's build (and a server's) with its
    sources, and each would rebuild in turn."""
    env = dict(os.environ)
    if code_root != ROOT:
        env["CONFKV_EXTENSION_DIR"] = str(code_root / ".extension")
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--measure",
            *setups,
            "--code-root",
            str(code_root),
            "--seqs",
            str(args.profile_seqs if profile else args.seqs),
            "--prompt-tokens",
            str(args.profile_prompt_tokens if profile else args.prompt_tokens),
            "--steps",
            str(args.steps),
            "--threads",
            str(args.threads),
            "--device",
            args.device,
            *(["--dtype", args.dtype] if args.dtype else []),
            *(["--model-path", str(args.model_path)] if args.model_path else []),
            *(["--profile"] if profile else []),
            "--compressor-profile-steps",
            str(0 if profile else args.compressor_profile_steps),
        ],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument(
        "--steps", type=int, default=64, help="tokens each sequence decodes (2 compressions at the shipped interval)"
    )
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    add_placement_options(parser)
    parser.add_argument("--baseline", help="a git revision to measure side by side (before/after)")
    parser.add_argument(
        "--setups", nargs="*", default=DEFAULT_SETUPS, choices=list(SETUPS), help="none: only the profile"
    )
    parser.add_argument("--profile-seqs", type=int, default=0, help="also profile decode steps at this batch")
    parser.add_argument("--profile-prompt-tokens", type=int, default=512, help="prompt length of the profiled runs")
    parser.add_argument(
        "--compressor-profile-steps",
        type=int,
        default=0,
        help="also profile this many decode steps of each setup halfway (not timed): the compressor's share",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_step")
    parser.add_argument("--measure", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--code-root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.code_root, args.measure, args)))
        return
    # Stopped, stop the measuring child too: subprocess.run kills its child on any exception, and
    # SIGTERM otherwise ends this process alone and leaves the child spoiling later runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    provenance = Provenance.capture()  # the code measured, before anything can change it
    commit = provenance.commit
    trees = {"this tree": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            baseline = Path(tmp) / f"baseline-{commit_of(args.baseline)}"
            subprocess.run(["git", "worktree", "add", "--detach", str(baseline), args.baseline], cwd=ROOT, check=True)
            trees = {f"{args.baseline} ({commit_of(args.baseline)})": baseline, "this tree": ROOT}
        try:
            results, bandwidth = {}, {}
            if args.setups:
                for tree, root in tqdm(trees.items(), unit="tree"):
                    measured = run_tree(root, args.setups, args)
                    results[tree], bandwidth[tree] = measured["setups"], measured["bandwidth_gbs"]
            profiles = {}
            if args.profile_seqs:
                for setup in tqdm(SETUPS, desc="profiles"):
                    profiles[setup] = run_tree(ROOT, [setup], args, profile=True)["python_share"]
        finally:
            if args.baseline:
                subprocess.run(["git", "worktree", "remove", "--force", str(baseline)], cwd=ROOT, check=True)
    data = {
        "commit": commit,
        "results": results,
        "bandwidth_gbs": bandwidth,
        "compressor_profile_steps": args.compressor_profile_steps,
        "profiles": profiles,
    }
    save_report(args.out, "Decode step at the same batch", table(data, args), data, args, provenance)


def where(args: argparse.Namespace) -> str:
    """Where the setups ran, as the table says it: CPU threads, or the device and dtype (and a model
    other than the embedded one)."""
    place = f"{args.threads} CPU threads" if args.device == "cpu" else f"on {args.device}"
    place += f", {args.dtype}" if args.dtype else ""
    return place + (f", model {args.model_path.name}" if args.model_path else "")


def table(data: dict, args: argparse.Namespace) -> str:
    command = f"commit {data['commit']}, `{command_line([__file__, *sys.argv[1:]])}`"
    lines = []
    if data["results"]:
        lines += [
            f"{args.seqs} sequence{'s' if args.seqs != 1 else ''} of {args.prompt_tokens} prompt tokens decoding "
            f"together, {where(args)}, median "
            f"of {args.steps}-token runs' pure decode steps, the setups' steps taking turns in one process; {command}.",
            "",
            "| code | setup | median decode step | vs compression off | compressor (median / mean) | "
            "compressor's share (mean) | KV held (median) | prefill |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
    for tree, rows in data["results"].items():
        off = rows.get("compression off", {})
        for setup, row in rows.items():
            step, engine = row["median_step_ms"], row["median_compression_ms"]
            ratio = f"{step / off['median_step_ms']:.2f}x" if off else "-"
            mean = f" / {row['mean_compression_ms']:.1f}" if "mean_compression_ms" in row else ""  # older revisions
            kv = f"{row['median_kv_mib']:.0f} MiB" if "median_kv_mib" in row else "-"
            prefill = f"{row['prefill_s']:.1f} s" if "prefill_s" in row else "-"
            share = f"{100 * row['mean_compression_ms'] / row['mean_step_ms']:.1f}%" if mean else "-"
            lines.append(
                f"| {tree} | {setup} | {step:.0f} ms | {ratio} | {engine:.1f}{mean} ms | {share} | {kv} | {prefill} |"
            )
    if args.device == "cpu":  # on CUDA the profiler's host ranges time the kernel's launch, not its run
        lines += roofline(data)
    means = {(tree, setup): row for tree, rows in data["results"].items() for setup, row in rows.items()}
    if means and data["compressor_profile_steps"]:
        lines += [
            "",
            "Every decode step counted, and the compressor's share of the step from torch's profiler (its "
            "`conf_kv::compress` range over whole compression intervals of steps, profiled halfway and not "
            "timed above):",
            "",
            "| code | setup | mean decode step | vs compression off | profiled step | compressor | share |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for (tree, setup), row in means.items():
            off = data["results"][tree].get("compression off")
            ratio = f"{row['mean_step_ms'] / off['mean_step_ms']:.2f}x" if off else "-"
            p = row["compressor"]
            lines.append(
                f"| {tree} | {setup} | {row['mean_step_ms']:.1f} ms | {ratio} | {p['step_ms']:.1f} ms | "
                f"{p['compressor_ms']:.1f} ms | {100 * p['share']:.1f}% |"
            )
    if data["profiles"]:
        lines += [
            "",
            f"Python share of a decode step at {args.profile_seqs} sequences of {args.profile_prompt_tokens} prompt "
            "tokens (torch profiler, 4 steps; time outside torch operators and the decode kernel); "
            f"{command}:",
            "",
        ]
        lines += [
            "| setup | step | decode-attention kernel | projections and MLPs (matmuls) | outside operators and "
            "kernel | share |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for setup, p in data["profiles"].items():
            lines.append(
                f"| {setup} | {p['step_ms']:.0f} ms | {p['kernel_ms']:.1f} ms | {p['matmul_ms']:.1f} ms "
                f"| {p['python_ms']:.1f} ms | {100 * p['share']:.1f}% |"
            )
    return "\n".join(lines).strip()


def roofline(data: dict) -> list[str]:
    """How far each setup's attention is from the memory's speed: the KV it reads per step, the kernel's
    time, the bandwidth that makes, and the time reading it at the machine's measured bandwidth would take."""
    lines = []
    for tree, rows in data["results"].items():
        bandwidth = data["bandwidth_gbs"][tree]
        lines += [
            "",
            f"Roofline ({tree}): attention reads every held entry once per step; the machine reads "
            f"{bandwidth:.1f} GB/s (a sum over 1 GiB at the same threads, median of 5). Kernel time from "
            "torch's profiler over the steps profiled halfway:",
            "",
            "| setup | KV read per step | attention kernel per step | bandwidth reached | of the machine's | "
            "kernel at the memory's speed |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for setup, row in rows.items():
            p = row["compressor"]
            reached = p["kv_bytes"] / (p["kernel_ms"] / 1000) / 1e9
            floor = p["kv_bytes"] / (bandwidth * 1e9) * 1000
            lines.append(
                f"| {setup} | {p['kv_bytes'] / 2**20:.0f} MiB | {p['kernel_ms']:.1f} ms | {reached:.1f} GB/s | "
                f"{100 * reached / bandwidth:.0f}% | {floor:.1f} ms |"
            )
    return lines


if __name__ == "__main__":
    main()
