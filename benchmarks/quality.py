"""Quality benchmark: every policy through the real engine, against the uncompressed cache.

Needle retrieval accuracy (relative to the uncompressed cache), ROUGE-L of greedy summaries
against the uncompressed summaries, the memory actually kept (compressed_size / original_size,
measured) and the attention recall, for each policy and compression rate, plus uniform int8 and
int4 quantisation of every key and value as baselines at their own byte counts. `dynamic` runs as
shipped (with the value predictor when its weights are there); `dynamic, attention only` without it.

    python benchmarks/quality.py                # 30 needle cases (1k-2k tokens), 8 summaries, rates 0.6 0.75
    python benchmarks/quality.py --quick        # 6 needle cases, 3 summaries, rate 0.6
Results: benchmarks/results/quality.{json,md,png}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.engine import EngineConfig, LLMEngine  # noqa: E402
from app.sequence import SamplingParams  # noqa: E402
from benchmarks.report import save_report  # noqa: E402
from benchmarks.tasks import fidelity_cases, needle_cases  # noqa: E402
from compression.config import CompressionConfig, resolve  # noqa: E402
from compression.predictor.online import FutureValue, load_future_value, predictor_path  # noqa: E402
from models.loader import load_model  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("dynamic", "tova", "snapkv", "h2o", "knorm", "streaming_llm", "random")
ATTENTION_ONLY = "dynamic, attention only"  # the dynamic policy without the value predictor


@dataclass(frozen=True)
class Setup:
    label: str
    storage: str  # kv_cache_dtype
    policy: str
    rate: float
    value_predictor: bool = True  # dynamic: rank by the predictor (when one is loaded)


@dataclass
class Row:
    setup: Setup
    needle_accuracy: float = 0.0
    needle_relative: float = 0.0
    rouge_l: float = 0.0
    memory_kept: float = 0.0
    recall: float = 0.0
    seconds: float = 0.0
    outputs: dict[str, str] = field(default_factory=dict)


def setups(rates: list[float]) -> list[Setup]:
    plan = [
        Setup("uncompressed", "auto", "none", 0.0),
        Setup("uniform int8", "int8", "none", 0.0),
        Setup("uniform int4", "int4", "none", 0.0),
    ]
    for rate in rates:
        # Baselines evict at the model's dtype, as published; dynamic runs as shipped (int8 storage).
        plan += [Setup(policy, "int8" if policy == "dynamic" else "auto", policy, rate) for policy in POLICIES]
        plan.append(Setup(ATTENTION_ONLY, "int8", "dynamic", rate, value_predictor=False))
    return plan


def run_setup(
    model,
    tokenizer,
    setup: Setup,
    prompts: dict[str, list[int]],
    max_tokens: dict[str, int],
    future_value: FutureValue | None,
) -> tuple[dict[str, str], dict[str, dict], float]:
    config = CompressionConfig()
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(max_cache_bytes=2**33, max_num_seqs=8, max_num_batched_tokens=1024),
        config,
        future_value,
    )
    request = {
        "policy": setup.policy,
        "compression_rate": setup.rate,
        "kv_cache_dtype": setup.storage,
        "value_predictor": setup.value_predictor,
    }
    params = resolve(config, request, True, True)
    for name, ids in prompts.items():
        engine.add_request(name, ids, SamplingParams(max_tokens=max_tokens[name], temperature=0.0), params)
    texts = {name: "" for name in prompts}
    metrics: dict[str, dict] = {}
    started = time.perf_counter()
    label = f"{setup.label} @ {setup.rate}" if setup.rate else setup.label
    with torch.inference_mode(), tqdm(total=len(prompts), desc=label, unit="case", leave=False) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id] += out.delta_text
                if out.finished:
                    metrics[out.request_id] = out.compression_metrics
                    bar.update(1)
    return texts, metrics, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--needles", type=int, default=30)
    parser.add_argument("--summaries", type=int, default=8)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.6, 0.75])
    parser.add_argument("--policies", nargs="+", default=None, help="only these rows (labels), plus baselines")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "quality")
    args = parser.parse_args()
    if args.quick:
        args.needles, args.summaries, args.rates = 6, 3, [0.6]
    torch.set_num_threads(args.threads)

    from rouge_score import rouge_scorer

    model, tokenizer = load_model(args.model_path, torch.device("cpu"))
    interval = CompressionConfig().score_interval
    future_value = load_future_value(predictor_path(args.model_path), model.config, torch.device("cpu"), interval)
    needles = needle_cases(tokenizer, args.needles)
    summaries = fidelity_cases(tokenizer, args.summaries)
    prompts, max_tokens = {}, {}
    for case in [*needles, *summaries]:
        text = tokenizer.apply_chat_template(case.messages, tokenize=False, add_generation_prompt=True)
        prompts[case.name] = tokenizer(text, add_special_tokens=False).input_ids
        max_tokens[case.name] = 16 if case in needles else 48
    scorer = rouge_scorer.RougeScorer(["rougeL"])

    plan = setups(args.rates)
    if args.policies:
        plan = [s for s in plan if s.policy == "none" or s.label in args.policies]
    rows: list[Row] = []
    reference: dict[str, str] = {}
    for setup in tqdm(plan, desc="quality benchmark", unit="setup"):
        texts, metrics, seconds = run_setup(model, tokenizer, setup, prompts, max_tokens, future_value)
        if setup.label == "uncompressed":
            reference = texts
        row = Row(setup, seconds=seconds, outputs=texts)
        row.needle_accuracy = statistics.mean(c.correct(texts[c.name]) for c in needles)
        row.rouge_l = statistics.mean(
            scorer.score(reference[c.name], texts[c.name])["rougeL"].fmeasure for c in summaries
        )
        row.memory_kept = statistics.mean(m["compression_ratio"] for m in metrics.values())
        row.recall = statistics.mean(m["recall_rate"] for m in metrics.values())
        rows.append(row)
        tqdm.write(
            f"{setup.label:24s} rate {setup.rate:.2f}  needle {row.needle_accuracy:.2f}  "
            f"ROUGE-L {row.rouge_l:.3f}  memory {row.memory_kept:.3f}  recall {row.recall:.3f}  "
            f"({seconds:.0f}s)"
        )
    base = rows[0].needle_accuracy or 1.0
    for row in rows:
        row.needle_relative = row.needle_accuracy / base
    report(rows, args, needles, summaries)


def report(rows: list[Row], args, needles, summaries) -> None:
    lines = [
        f"{len(needles)} needle cases ({min(c.context_tokens for c in needles)}-"
        f"{max(c.context_tokens for c in needles)} tokens of text, fact at depths 0.1-0.9), {len(summaries)} "
        f"greedy 48-token summaries of ~800-token passages; default model, fp32, {args.threads} CPU threads. "
        "Memory kept is measured: compressed_size / original_size (uncompressed fp32 = 1.0; buffer growth "
        "slack included). Needle accuracy is relative to the uncompressed cache "
        f"({rows[0].needle_accuracy:.0%} absolute).",
        "",
        "| setup | rate | memory kept | needle (relative) | ROUGE-L vs uncompressed | recall |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        rate = f"{r.setup.rate:.2f}" if r.setup.rate else "-"
        lines.append(
            f"| {r.setup.label} | {rate} | {r.memory_kept:.3f} | {r.needle_relative:.0%} | "
            f"{r.rouge_l:.3f} | {r.recall:.3f} |"
        )
    save_report(args.out, "Quality benchmark", "\n".join(lines), {"rows": [asdict(r) for r in rows]}, args)
    plot(rows, args.out.with_suffix(".png"))


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, metric, title in (
        (axes[0], "needle_relative", "Needle accuracy (relative)"),
        (axes[1], "rouge_l", "ROUGE-L vs uncompressed"),
    ):
        labels = dict.fromkeys(r.setup.label for r in rows)
        for label in labels:
            points = sorted((r.memory_kept, getattr(r, metric)) for r in rows if r.setup.label == label)
            xs, ys = zip(*points, strict=True)
            style = "o-" if len(points) > 1 else "s"
            ax.plot(xs, ys, style, label=label, linewidth=2.5 if label.startswith("dynamic") else 1.2)
        ax.set_xlabel("memory kept (compressed / uncompressed bytes)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
