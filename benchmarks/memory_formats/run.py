"""KV memory allocated while a server's requests move from one storage format to the next.

    python benchmarks/memory_formats/run.py                        # this checkout
    python benchmarks/memory_formats/run.py --compare 4f753ad      # beside the commit before the arena

Each checkout's `serve.py` (this one's, and a temporary git worktree of each --compare revision) is
started with a small KV budget; then come phases of concurrent requests
with long prompts, one storage format per phase (uncompressed at the model's dtype, then compressed
at int8, int4, kivi4 and float16, then uncompressed again), each enough to fill the budget. After
every phase it reads the KV memory allocated (`kv_cache_allocated_bytes`, or, where a server has
no arena, the sum of its pools, `kv_cache_pool_bytes`), the part of it ever touched, and the
server's resident memory. The budget bounds the bytes in use; this shows whether it also bounds
the memory allocated, whatever the mix. Results: benchmarks/memory_formats/results/memory_formats.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import psutil
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.report import ROOT, save_report  # noqa: E402
from confkv.models.corpus import paragraphs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from load_tests.run import start_server  # noqa: E402

PHASES = {
    "uncompressed": {"enabled": False},
    "int8": {"kv_cache_dtype": "int8"},
    "int4": {"kv_cache_dtype": "int4"},
    "kivi4": {"kv_cache_dtype": "kivi4"},
    "float16": {"kv_cache_dtype": "float16"},
    "uncompressed again": {"enabled": False},
}


def prompt(index: int, words: int) -> str:
    texts = paragraphs()
    parts: list[str] = []
    while sum(len(p.split()) for p in parts) < words:
        parts.append(texts[(index * 7 + len(parts)) % len(texts)])
    return "\n\n".join(parts) + "\n\nSummarise the text above."


def kv_memory(url: str) -> dict[str, float]:
    """Budget, allocated and touched KV bytes as the server reports them (allocated: the pools' sum
    where it exports no arena)."""
    gauges: dict[str, float] = {}
    pools = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("kv_cache_pool_bytes{"):
            pools += float(value)
        elif name in ("kv_cache_capacity_bytes", "kv_cache_allocated_bytes", "kv_cache_touched_bytes"):
            gauges[name] = float(value)
    return {
        "budget": gauges["kv_cache_capacity_bytes"],
        "allocated": gauges.get("kv_cache_allocated_bytes", pools),
        "touched": gauges.get("kv_cache_touched_bytes", pools),
    }


def run_phase(url: str, options: dict, args: argparse.Namespace, offset: int) -> None:
    def one(i: int) -> None:
        payload = {
            "prompt": prompt(offset + i, args.prompt_words),
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "compression": {"compression_rate": args.rate, **options} if "enabled" not in options else options,
        }
        httpx.post(f"{url}/generate", json=payload, timeout=1800).raise_for_status()

    with ThreadPoolExecutor(args.requests) as pool:
        list(pool.map(one, range(args.requests)))


def measure_tree(label: str, root: Path, args: argparse.Namespace) -> list[dict]:
    env = {**os.environ, "CONFKV_EXTENSION_DIR": str(Path(args.extension_dir) / label)}
    flags = ["--max-cache-size", str(args.budget_mib), "--max-num-seqs", str(args.requests), "--torch-threads", "2"]
    proc, url = start_server(flags, root=root, env=env)
    rows = []
    try:
        process = psutil.Process(proc.pid)
        for index, (phase, options) in enumerate(tqdm(PHASES.items(), desc=label, unit="phase")):
            run_phase(url, options, args, offset=index * args.requests)
            rows.append({"tree": label, "phase": phase, "rss": process.memory_info().rss, **kv_memory(url)})
    finally:
        proc.terminate()
        proc.wait(60)
    return rows


def revision(root: Path) -> str:
    return git(root, "rev-parse", "--short", "HEAD")


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


@contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """A temporary worktree of this repository at `rev`, removed afterwards."""
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "tree"
        git(ROOT, "worktree", "add", "--detach", str(tree), rev)
        try:
            yield tree
        finally:
            git(ROOT, "worktree", "remove", "--force", str(tree))


def table(rows: list[dict], trees: dict[str, str]) -> str:
    labels = list(trees)
    names = [t if t == trees[t] else f"{t} ({trees[t]})" for t in labels]
    head = "| phase | " + " | ".join(f"{name}: KV allocated / budget, touched, RSS MiB" for name in names)
    lines = [head + " |", "| --- |" + " ---: |" * len(labels)]
    for phase in PHASES:
        cells = []
        for label in labels:
            r = next(r for r in rows if r["tree"] == label and r["phase"] == phase)
            share = f"{r['allocated'] / r['budget']:.2f}x, {r['touched'] / r['budget']:.2f}x"
            cells.append(f"{share}, {r['rss'] / 2**20:.0f}")
        lines.append(f"| {phase} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compare", action="append", default=[], help="a revision to measure beside this checkout")
    parser.add_argument("--budget-mib", type=int, default=64, help="max_cache_size of every server")
    parser.add_argument("--requests", type=int, default=4, help="concurrent requests a phase")
    parser.add_argument("--prompt-words", type=int, default=700)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--rate", type=float, default=0.5, help="compression_rate of the compressed phases")
    parser.add_argument("--extension-dir", default=str(Path.home() / ".cache" / "conf-kv" / "memory-formats"))
    parser.add_argument("--out", type=Path, default=RESULTS / "memory_formats")
    args = parser.parse_args()
    with ExitStack() as stack:
        roots = {rev: stack.enter_context(checkout(rev)) for rev in args.compare} | {"now": ROOT}
        revisions = {label: revision(root) for label, root in roots.items()}
        rows = [row for label, root in roots.items() for row in measure_tree(label, root, args)]
    text = (
        f"KV budget {args.budget_mib} MiB; each phase {args.requests} requests at once of about "
        f"{args.prompt_words} words, compressed phases at rate {args.rate}. Allocated: the memory KV blocks "
        "live in; touched: the part of it ever written (resident on the CPU); both relative to the budget.\n\n"
        + table(rows, revisions)
    )
    save_report(args.out, "KV memory across storage formats", text, {"trees": revisions, "rows": rows}, args)


if __name__ == "__main__":
    main()
