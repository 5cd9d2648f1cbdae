"""Asynchronous compression against compressing between steps, at the same batch: what compression
still costs on the decode step's critical path, and decode throughput.

N sequences of P corpus tokens decode T greedy tokens together (EOS ignored), compressed as one
setup of the decode-step benchmark asks, in two engines sharing the model in one process: one
compresses between steps (`async_compression` off), the other plans the compressions due at the
end of a step beside the next one's forward pass, on a worker thread, while the sequences it
compresses sit that step out (on). Once both are prefilled (every sequence has its first token)
their steps take turns, one at a time, so that drift on this noisy machine hits both alike. Over
those steps it counts the tokens, the wall time, and the compressor's time on the critical path
(what each step waited for: the sampling's bookkeeping, the compactions, and waiting for the
worker) and beside it (the worker's planning).

    python benchmarks/async_compression/run.py                        # 16 and 64 sequences of 512 tokens
    python benchmarks/async_compression/run.py --device cuda --dtype bfloat16 \\
        --out benchmarks/gpu_check/results/async_compression
Results: benchmarks/async_compression/results/async_compression.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_step.run import SETUPS, where  # noqa: E402
from benchmarks.engine import advance, decoding_engine, load_with_predictor  # noqa: E402
from benchmarks.placement import add_placement_options  # noqa: E402
from benchmarks.report import Provenance, command_line, save_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WAYS = {"between steps": False, "beside the forward pass": True}  # label -> async_compression


@dataclass
class Decoding:
    """One engine's steps after its prefill: their wall time, tokens and compression seconds."""

    seconds: list[float] = field(default_factory=list)
    tokens: int = 0
    critical: float = 0.0  # compression the steps waited for
    background: float = 0.0  # compression planned beside the forward passes

    def figures(self) -> dict:
        wall = sum(self.seconds)
        return {
            "steps": len(self.seconds),
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / wall,
            "ms_per_token": 1000 * wall / self.tokens,
            "critical_share": self.critical / wall,
            "background_share": self.background / wall,
            "critical_ms_per_token": 1000 * self.critical / self.tokens,
            "background_ms_per_token": 1000 * self.background / self.tokens,
        }


def step(engine, bar: tqdm, device: torch.device, run: Decoding | None = None) -> None:
    """One engine step; after the prefill (`run` given), counted: each sequence it ran decoded a token."""
    duration = advance(engine, bar, device)
    if run is not None:
        stats = engine.last_step
        run.seconds.append(duration)
        run.tokens += stats.num_tokens
        run.critical += stats.compression_s
        run.background += stats.compression_background_s


def measure(seqs: int, args: argparse.Namespace, model, tokenizer, future_value, device) -> dict:
    """Both ways at `seqs` sequences, their steps taking turns once both are prefilled."""
    tokens = args.tokens
    engines = {
        way: decoding_engine(
            model, tokenizer, future_value, SETUPS[args.setup], seqs, args.prompt_tokens, tokens, async_compression=on
        )
        for way, on in WAYS.items()
    }
    runs = {way: Decoding() for way in WAYS}
    bar = tqdm(total=len(WAYS) * seqs * tokens, desc=f"{seqs} sequences", leave=False)
    with torch.inference_mode(), bar:
        for engine in engines.values():  # until every sequence has its first token
            while any(not seq.output_token_ids for seq in engine.outputs.requests.values()):
                step(engine, bar, device)
        while any(engine.has_unfinished() for engine in engines.values()):
            for way, engine in engines.items():
                if engine.has_unfinished():
                    step(engine, bar, device, runs[way])
    return {way: run.figures() for way, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64, help="tokens each sequence decodes")
    parser.add_argument("--setup", default="int8, rate 0.875", choices=[s for s in SETUPS if s != "compression off"])
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    add_placement_options(parser)
    parser.add_argument("--out", type=Path, default=RESULTS / "async_compression")
    args = parser.parse_args()
    provenance = Provenance.capture()  # the code measured, before anything can change it
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), args.dtype and getattr(torch, args.dtype)
    model, tokenizer, future_value = load_with_predictor(args.model_path, device=device, dtype=dtype)
    results = {
        str(seqs): measure(seqs, args, model, tokenizer, future_value, device) for seqs in tqdm(args.seqs, unit="batch")
    }
    data = {"commit": provenance.commit, "setup": args.setup, "results": results}
    save_report(args.out, "Asynchronous compression", table(data, args), data, args, provenance)


def table(data: dict, args: argparse.Namespace) -> str:
    lines = [
        f"`{args.setup}`, sequences of {args.prompt_tokens} prompt tokens decoding {args.tokens} tokens each "
        f"together, {where(args)}; every step after the prefill counted, the two ways' steps taking turns in one "
        f"process; commit {data['commit']}, `{command_line([__file__, *sys.argv[1:]])}`.",
        "",
        "| sequences | compression | tokens/s | vs between steps | compression on the critical path | "
        "share of the step time | compression beside it |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for seqs, ways in data["results"].items():
        base = ways["between steps"]["tokens_per_s"]
        for way, row in ways.items():
            lines.append(
                f"| {seqs} | {way} | {row['tokens_per_s']:.1f} | {row['tokens_per_s'] / base:.2f}x | "
                f"{row['critical_ms_per_token']:.2f} ms/token | {100 * row['critical_share']:.1f}% | "
                f"{row['background_ms_per_token']:.2f} ms/token |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
