"""Prefix cache benchmark: multi-turn chats with and without reuse, side by side in one run.

8 conversations of 4 turns: turn 1 asks about a ~1k-token document, turns 2-4 ask follow-ups with
the whole history (document, answers) sent again, as chat clients do. Each turn generates greedy
tokens through the real engine under the server's default compression. Reported: time to first
token (TTFT) per turn with the prefix cache and without it, and the prefix hit rate.

    python benchmarks/prefix_cache/run.py            # 8 conversations x 4 turns, ~1k-token documents
    python benchmarks/prefix_cache/run.py --quick    # 2 conversations, ~400-token documents
Results: benchmarks/prefix_cache/results/prefix_cache.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.chat import ask  # noqa: E402
from benchmarks.report import commit_of, pyplot, save_report  # noqa: E402
from confkv.models.corpus import paragraphs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from confkv.compress.config import CompressionConfig, resolve  # noqa: E402
from confkv.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from confkv.models.loader import load_model  # noqa: E402

FOLLOW_UPS = ("What is the main point?", "Give one example from the text.", "Summarise it in one sentence.")


def document(tokenizer, index: int, tokens: int) -> str:
    texts = paragraphs()
    parts: list[str] = []
    while len(tokenizer("\n\n".join(parts)).input_ids) < tokens:
        parts.append(texts[(index * 17 + len(parts)) % len(texts)])
    return "\n\n".join(parts)


def run_conversations(model, tokenizer, docs: list[str], turns: int, max_tokens: int, prefix_cache: bool) -> dict:
    config = CompressionConfig.load()
    engine = LLMEngine(model, tokenizer, EngineConfig(max_cache_bytes=2**31, prefix_cache=prefix_cache), config)
    params = resolve(config, None, server_enabled=True, stats=True)
    ttft: dict[int, list[float]] = {turn: [] for turn in range(1, turns + 1)}
    cached = prompt = 0
    label = "prefix cache" if prefix_cache else "no prefix cache"
    with torch.inference_mode(), tqdm(total=len(docs) * turns, desc=label, unit="turn") as bar:
        for c, doc in enumerate(docs):
            messages = [{"role": "user", "content": f"{doc}\n\nWhat is this text about?"}]
            for turn in range(1, turns + 1):
                answer = ask(engine, tokenizer, f"{c}-{turn}", messages, max_tokens, params)
                if turn > 1:
                    cached, prompt = cached + answer.cached_tokens, prompt + answer.prompt_tokens
                ttft[turn].append(answer.ttft)
                messages += [
                    {"role": "assistant", "content": answer.text},
                    {"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]},
                ]
                bar.update(1)
    return {"ttft": ttft, "hit_rate": cached / prompt if prompt else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--document-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_cache")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.document_tokens = 2, 400
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_path, torch.device("cpu"))
    docs = [document(tokenizer, i, args.document_tokens) for i in range(args.conversations)]
    results = {
        mode: run_conversations(model, tokenizer, docs, args.turns, args.max_tokens, prefix_cache=on)
        for mode, on in (("without", False), ("with", True))
    }
    report(results, args)


def report(results: dict, args) -> None:
    rows = []
    for turn in range(1, args.turns + 1):
        without = statistics.median(results["without"]["ttft"][turn])
        with_ = statistics.median(results["with"]["ttft"][turn])
        rows.append((turn, without, with_, without / with_))
    later = range(2, args.turns + 1)
    without_all = statistics.median(x for t in later for x in results["without"]["ttft"][t])
    with_all = statistics.median(x for t in later for x in results["with"]["ttft"][t])
    lines = [
        f"{args.conversations} conversations x {args.turns} turns, ~{args.document_tokens}-token documents, "
        f"{args.max_tokens} greedy tokens per answer, server default compression; default model, fp32, "
        f"{args.threads} CPU threads; medians of one run, both modes side by side; commit {commit_of()}.",
        "",
        "| turn | TTFT without prefix cache (s) | TTFT with prefix cache (s) | speed-up |",
        "| ---: | ---: | ---: | ---: |",
        *(f"| {t} | {a:.3f} | {b:.3f} | {r:.1f}x |" for t, a, b, r in rows),
        f"| 2-{args.turns} | {without_all:.3f} | {with_all:.3f} | {without_all / with_all:.1f}x |",
        "",
        f"Prefix hit rate of turns 2-{args.turns} (prompt tokens served from the cache): "
        f"{results['with']['hit_rate']:.1%}.",
    ]
    save_report(args.out, "Prefix cache benchmark", "\n".join(lines), {"commit": commit_of(), "results": results}, args)
    plot(rows, args.out.with_suffix(".png"))


def plot(rows: list[tuple], path: Path) -> None:
    plt = pyplot()
    turns = [r[0] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.38
    ax.bar([t - width / 2 for t in turns], [r[1] for r in rows], width, label="without prefix cache")
    ax.bar([t + width / 2 for t in turns], [r[2] for r in rows], width, label="with prefix cache")
    ax.set_xlabel("turn")
    ax.set_ylabel("median time to first token (s)")
    ax.set_xticks(turns)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
