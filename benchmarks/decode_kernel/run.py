"""The CPU decode-attention kernel alone, per storage format: its vector path against its portable loops
and against itself in memory of 4 KiB pages, and against the memory's speed.

Every format's pools hold the same batch: R rows (sequences) of N entries in each of L layers, the
embedded model's shape by default (3 KV heads, groups of 3 query heads, head_dim 64, blocks of 16),
its blocks scattered over the pool as a running server's are. One pass is one kernel call per
layer, as a decode step makes; the figure is the median of the passes, the bodies taking turns
(`CONFKV_PORTABLE_KERNEL=1` selects the portable loops, read at every call; the third body reads the
same batch from pools whose arena is not backed by huge pages). The machine's read
bandwidth is measured in the same run (`benchmarks/decode_step/run.py`'s pass over 1 GiB), so each
format's bytes read per pass give the time reading them at that speed would take: the roofline.

    python benchmarks/decode_kernel/run.py                       # every format, 16 rows x 2000 entries, 2 threads
    python benchmarks/decode_kernel/run.py --entries 800 --formats int8 kivi4
Results: benchmarks/decode_kernel/results/decode_kernel.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.decode_step.run import read_bandwidth  # noqa: E402
from benchmarks.report import Provenance, command_line, save_report  # noqa: E402
from confkv.kv.arena import Arena  # noqa: E402
from confkv.kv.block_pool import BlockPool, Codec  # noqa: E402
from confkv.kv.kernels import load_kernel  # noqa: E402
from confkv.kv.paged_attention import DecodeBatch, kernel_arguments  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MEASURES = ("confkv/kv",)
FORMATS = ("float32", "float16", "bfloat16", "int8", "int4", "kivi4")
CHUNK = 1 << 18  # entries written per call while filling a pool


def codec_of(fmt: str, args: argparse.Namespace) -> Codec:
    return Codec(getattr(torch, fmt) if fmt.startswith(("float", "bfloat")) else fmt, args.head_dim, args.block_size)


def filled_pool(fmt: str, blocks: int, args: argparse.Namespace, gen: torch.Generator, huge_pages: bool) -> BlockPool:
    """A pool of `blocks` blocks of random vectors at format `fmt` (int4c: keys per channel), in an arena
    backed by huge pages or not."""
    codec = codec_of(fmt, args)
    block_bytes = args.kv_heads * args.block_size * codec.vector_bytes
    arena = Arena((blocks + 32) * block_bytes, 32 * block_bytes, huge_pages=huge_pages)  # whole pages, one spare
    pool = BlockPool(codec, args.kv_heads, args.block_size, arena)
    ids = torch.tensor(pool.allocate(blocks))
    per_chunk = CHUNK // args.block_size
    for start in range(0, blocks, per_chunk):
        chunk = ids[start : start + per_chunk]
        x = torch.randn(len(chunk), args.block_size, args.kv_heads, args.head_dim, generator=gen)
        if fmt == "int4c":
            pool.write_blocks(chunk, x, torch.full((len(chunk),), args.block_size))
        else:
            rows = (chunk[:, None] * args.block_size + torch.arange(args.block_size)).flatten()
            pool.write(rows, x.flatten(0, 1))
    return pool


def batches(fmt: str, args: argparse.Namespace, huge_pages: bool = True) -> tuple[list[tuple], int]:
    """One layer's kernel arguments per layer, and the bytes a pass reads (every row's keys and values);
    the same seed gives the same batch, in memory backed by huge pages or not."""
    gen = torch.Generator().manual_seed(0)
    per_table = -(-args.entries // args.block_size)
    tables = args.rows * per_table * args.layers
    key_format, value_format = ("int4c", "int4") if fmt == "kivi4" else (fmt, fmt)
    # Keys and values in pools of their own (the kernel reads a row's keys and values through its two).
    pools = [filled_pool(f, tables, args, gen, huge_pages) for f in (key_format, value_format)]
    # Scattered: each table's blocks drawn at random from its pool, as a server's are after a while.
    order = [torch.randperm(tables, generator=gen).int().view(args.layers, args.rows, per_table) for _ in range(2)]
    rows = torch.arange(args.rows, dtype=torch.int32)
    layers = []
    for layer in range(args.layers):
        keys, values = order[0][layer].contiguous(), order[1][layer].contiguous()
        batch = DecodeBatch(
            query=torch.randn(args.rows, args.heads, args.head_dim, generator=gen),
            pools=[pool.tensors() for pool in pools],
            row_slot=rows,
            row_pool=torch.zeros(args.rows, dtype=torch.int32),
            row_value_pool=torch.ones(args.rows, dtype=torch.int32),
            key_only_pool=1,
            key_tables=keys,
            value_tables=values,
            key_only_tables=keys,
            num_keys=torch.full((args.rows,), args.entries, dtype=torch.int32),
            num_key_only=torch.zeros(args.rows, dtype=torch.int32),
            block_size=args.block_size,
            scale=args.head_dim**-0.5,
            observe_index=torch.full((args.rows,), -1, dtype=torch.int32),
            num_observed=0,
        )
        layers.append(kernel_arguments(batch))
    entry_bytes = sum(codec_of(f, args).vector_bytes for f in (key_format, value_format))
    return layers, args.rows * args.entries * args.layers * args.kv_heads * entry_bytes


def timed_passes(kernel, layers: list[tuple], small_pages: list[tuple], repeats: int) -> dict[str, float]:
    """Median seconds of a pass over the layers, per body (the vector path, the portable loops, and the
    vector path over the same batch in memory of 4 KiB pages), the bodies taking turns."""
    bodies = {"vector": (layers, "0"), "portable": (layers, "1"), "small_pages": (small_pages, "0")}
    times: dict[str, list[float]] = {body: [] for body in bodies}
    for _ in range(repeats + 1):  # the first round warms up
        for body, (batch, portable) in bodies.items():
            os.environ["CONFKV_PORTABLE_KERNEL"] = portable
            start = time.perf_counter()
            for arguments in batch:
                kernel.decode_attention(*arguments)
            times[body].append(time.perf_counter() - start)
    os.environ.pop("CONFKV_PORTABLE_KERNEL")
    return {body: statistics.median(runs[1:]) for body, runs in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--entries", type=int, default=2000, help="entries per row and layer")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_kernel")
    args = parser.parse_args()
    provenance = Provenance.capture(MEASURES)
    torch.set_num_threads(args.threads)
    kernel = load_kernel()
    if kernel is None:
        sys.exit("the C++ kernel is not built: run `python -m confkv.kv.kernels`")
    bandwidth = read_bandwidth(torch.device("cpu"))
    figures = {}
    with torch.inference_mode():
        for fmt in tqdm(args.formats, desc="formats"):
            layers, read = batches(fmt, args)
            small_pages, _ = batches(fmt, args, huge_pages=False)
            figures[fmt] = {"bytes_per_pass": read, **timed_passes(kernel, layers, small_pages, args.repeats)}
            del layers, small_pages
    data = {"commit": provenance.commit, "bandwidth_gbs": bandwidth, "formats": figures}
    save_report(args.out, "Decode kernel per storage format", table(data, args), data, args, provenance)


def table(data: dict, args: argparse.Namespace) -> str:
    bandwidth = data["bandwidth_gbs"]
    lines = [
        f"{args.rows} rows of {args.entries} entries in each of {args.layers} layers ({args.kv_heads} KV heads, "
        f"{args.heads} query heads, head_dim {args.head_dim}, blocks of {args.block_size}, scattered), "
        f"{args.threads} CPU threads; a pass is one kernel call per layer, median of {args.repeats}, the three "
        f"bodies taking turns (the last: the vector path over the same batch in 4 KiB pages, not the arena's "
        f"huge pages); the machine reads {bandwidth:.1f} GB/s (a sum over 1 GiB); commit "
        f"{data['commit']}, `{command_line([__file__, *sys.argv[1:]])}`.",
        "",
        "| format | read per pass | vector path | portable loops | vector vs portable | 4 KiB pages | huge vs "
        "4 KiB pages | bandwidth reached | of the machine's | at the memory's speed |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for fmt, row in data["formats"].items():
        read, vector, portable, small = row["bytes_per_pass"], row["vector"], row["portable"], row["small_pages"]
        reached = read / vector / 1e9
        lines.append(
            f"| {fmt} | {read / 2**20:.0f} MiB | {1000 * vector:.1f} ms | {1000 * portable:.1f} ms | "
            f"{vector / portable:.2f}x | {1000 * small:.1f} ms | {vector / small:.2f}x | {reached:.1f} GB/s | "
            f"{100 * reached / bandwidth:.0f}% | "
            f"{1000 * read / (bandwidth * 1e9):.1f} ms |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
