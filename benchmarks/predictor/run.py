"""Evidence for the value predictor: what it keeps, against attention-only scorers, and its cost.

1. Offline, on held-out traces (every 4th trace file, never trained on): within each layer at each
   observation, keep the top `--keep` share of the sampled entries by each scorer and measure the
   share of the attention mass of the next `prediction_window` decode steps that they hold. The
   predictor against accumulated attention (H2O), the latest query (TOVA), the latest observations
   (SnapKV-like), the dynamic policy's own decayed score, key norm (Knorm) and recency; the future
   itself (oracle) bounds what any scorer can reach.
2. Calibration of the retention confidence on the same held-out traces: per source (forecast,
   decayed attention), stated probability of being needed against how often such entries were, in
   ten bins, and the expected calibration error; and what the default thresholds would keep.
3. Cost: decode steps of 16 x 2k-token sequences, compression off, dynamic by attention, dynamic
   with the predictor: the compressor's share of each step. At rate 0.75 by default: at
   0.6 the budget holds every entry at int8, so the predictor runs only to judge the request
   (every `prediction_refresh` compressions) and ranks nothing.

End-to-end quality (dynamic with and without the predictor, and the baselines) is
`benchmarks/quality/run.py`, whose `dynamic` rows use the shipped predictor and `dynamic, attention
only` rows do not.

    python benchmarks/predictor/run.py --traces traces           # after make collect-traces / train-predictor
    python benchmarks/predictor/run.py --traces traces --skip-cost
Results: benchmarks/predictor/results/predictor.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.engine import load_with_predictor  # noqa: E402
from benchmarks.report import Provenance, save_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from benchmarks.serving.run import measure_overhead, overhead_table  # noqa: E402
from confkv.compress.config import CompressionConfig  # noqa: E402
from confkv.compress.predictor.calibrate import outcomes, relative_values  # noqa: E402
from confkv.compress.predictor.calibration import reliability  # noqa: E402
from confkv.compress.predictor.features import FEATURES, unscaled_attention  # noqa: E402
from confkv.compress.predictor.online import load_retention, predictor_path  # noqa: E402
from confkv.compress.predictor.train import load_traces  # noqa: E402
from confkv.compress.scoring import LayerEntries, make_policy  # noqa: E402

LATEST = -1  # the window's newest observation


def feature(windows: torch.Tensor, name: str, step: int = LATEST) -> torch.Tensor:
    return windows[:, step, FEATURES.index(name)]


def scorers(traces: dict[str, torch.Tensor], predicted: torch.Tensor) -> dict[str, torch.Tensor]:
    """Higher keeps. Attention features are stored scaled (log1p); sums are taken on the masses.

    The baselines that score each entry on its own are the serving policies themselves. Dynamic and
    SnapKV pool over neighbouring positions, and a group's samples are random entries of a layer,
    not neighbours: their rows score by the attention they pool, unpooled."""
    windows = traces["windows"]
    latest_window = unscaled_attention(windows[:, :, FEATURES.index("attention_last")]).sum(dim=1)
    latest_query = unscaled_attention(feature(windows, "attention_last"))
    return {
        "value predictor (LSTM)": predicted,
        "dynamic's decayed attention (no predictor)": feature(windows, "attention_decayed"),
        "H2O: accumulated attention": policy_score("h2o", windows, traces["accumulated"]),
        "TOVA: latest query": policy_score("tova", windows, latest_query),
        "SnapKV-like: the last observations": latest_window,
        "Knorm: smallest key norm": policy_score("knorm", windows),
        "StreamingLLM: most recent": policy_score("streaming_llm", windows),
        "oracle: the future attention itself": traces["targets"],
    }


def policy_score(name: str, windows: torch.Tensor, attention: torch.Tensor | None = None) -> torch.Tensor:
    """The serving policy `name`'s score of every sample, by its latest observation; `attention` as
    the policy accumulates it. The policies scored here treat each entry on its own, so one call
    scores the samples of every group."""
    entries = LayerEntries(
        # Traces keep each key's norm (mean over heads), not the key: a one-element key of that norm scores the same.
        keys=feature(windows, "key_norm").view(1, -1, 1),
        # Relative to the query, which a group's samples share: the order of their absolute positions.
        positions=feature(windows, "position"),
        attention=torch.zeros(len(windows)) if attention is None else attention,
        token_confidence=feature(windows, "token_confidence"),
        position=0,
        layer=0,
    )
    return make_policy(name).score(entries)


def captured_share(scores: torch.Tensor, future: torch.Tensor, groups: torch.Tensor, keep: float) -> float:
    """Mean over groups of the share of future attention mass held by the top `keep` by score."""
    order = torch.argsort(scores, descending=True, stable=True)
    order = order[torch.argsort(groups[order], stable=True)]
    _, counts = torch.unique_consecutive(groups[order], return_counts=True)
    index = torch.repeat_interleave(torch.arange(len(counts)), counts)
    starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    rank = torch.arange(len(order)) - starts
    kept = rank < torch.repeat_interleave(torch.ceil(keep * counts), counts)
    mass = future[order]
    total = torch.zeros(len(counts)).index_add_(0, index, mass)
    held = torch.zeros(len(counts)).index_add_(0, index, mass * kept)
    valid = total > 0
    return float((held[valid] / total[valid]).mean())


def offline(traces: dict[str, torch.Tensor], predicted: torch.Tensor, keep: float) -> dict[str, dict[str, float]]:
    future = unscaled_attention(traces["targets"])
    stages = {
        "all observations": torch.ones_like(traces["at_prefill"]),
        "end of prefill": traces["at_prefill"],
        "during decoding": ~traces["at_prefill"],
    }
    table = {}
    for name, scores in scorers(traces, predicted).items():
        table[name] = {
            stage: captured_share(scores[mask], future[mask], traces["groups"][mask], keep)
            for stage, mask in stages.items()
        }
    return table


def offline_markdown(table: dict, keep: float, samples: int, groups: int) -> str:
    stages = list(next(iter(table.values())))
    lines = [
        f"Held-out traces: {samples} (entry, observation) samples in {groups} groups (one layer at one observation, "
        f"random entries of it). Share of the next-window attention mass held by the top {keep:.0%} of each group "
        "by each scorer (mean over groups; higher is better).",
        "",
        "| scorer | " + " | ".join(stages) + " |",
        "| --- |" + " ---: |" * len(stages),
    ]
    for name, row in table.items():
        lines.append(f"| {name} | " + " | ".join(f"{row[s]:.3f}" for s in stages) + " |")
    return "\n".join(lines)


def calibration_evidence(traces: dict[str, torch.Tensor], predicted: torch.Tensor, calibrations: dict) -> dict:
    """Reliability of each source's retention confidence on held-out traces."""
    thresholds = CompressionConfig.load().thresholds
    evidence = {}
    for source, calibration in calibrations.items():
        window = calibration.prediction_window
        relative = relative_values(traces, unscaled_attention(predicted), make_policy("dynamic"), window)[source]
        outcome = outcomes(traces, window, calibration.share)
        probability = calibration(relative)
        rows, error = reliability(probability, outcome)
        evidence[source] = {
            "share": calibration.share,
            "window": window,
            "needed": float(outcome.float().mean()),
            "ece": error,
            "rows": [vars(r) for r in rows],
            "full": float((probability >= thresholds.high).float().mean()),
            "key_only": float(((probability >= thresholds.medium) & (probability < thresholds.high)).float().mean()),
        }
    return evidence


def calibration_markdown(evidence: dict, samples: int) -> str:
    names = {"forecast": "value predictor's forecast", "attention": "decayed attention (no predictor)"}
    lines = []
    for source, e in evidence.items():
        lines += [
            f"Retention confidence from the {names[source]}: P(the entry draws at least {e['share']} x an average "
            f"held entry's attention over the next {e['window']} decode steps), on {samples} held-out samples "
            f"({e['needed']:.1%} were needed). Expected calibration error **{e['ece']:.3f}**. At the default "
            f"thresholds {e['full']:.1%} of the samples would be FULL and {e['key_only']:.1%} KEY_ONLY.",
            "",
            "| stated probability | samples | mean stated | observed frequency |",
            "| --- | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r['low']:.1f}-{r['high']:.1f} | {r['entries']} | {r['stated']:.3f} | {r['observed']:.3f} |"
            for r in e["rows"]
        ]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, default=Path("traces"))
    parser.add_argument("--predictor", type=Path, default=None, help="default: the shipped weights")
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--keep", type=float, default=0.4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--overhead-seqs", type=int, default=16)
    parser.add_argument("--overhead-prompt-tokens", type=int, default=2000)
    parser.add_argument("--cost-rate", type=float, default=0.75)
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "predictor")
    args = parser.parse_args()
    provenance = Provenance.capture()  # the code measured, before anything can change it
    commit = provenance.commit
    torch.set_num_threads(args.threads)
    path = args.predictor or predictor_path(args.model_path)
    model, tokenizer, future_value = load_with_predictor(args.model_path, path)
    if future_value is None:
        raise SystemExit(f"no predictor at {path}: train one first (make train-predictor)")
    traces = load_traces(args.traces, held_out=True)
    with torch.inference_mode():
        predicted = torch.cat([future_value.predictor(w) for w in traces["windows"].split(65536)])
    table = offline(traces, predicted, args.keep)
    sections = [offline_markdown(table, args.keep, len(predicted), int(traces["groups"].unique().numel()))]
    data = {
        "commit": commit,
        "offline": table,
        "predictor": path.name,
        "config": future_value.predictor.config.short_description,
    }
    calibrations = load_retention(path, model.config)
    if calibrations:
        data["calibration"] = calibration_evidence(traces, predicted, calibrations)
        sections.append(calibration_markdown(data["calibration"], len(predicted)))
    if not args.skip_cost:
        cost = measure_overhead(
            model, tokenizer, args.overhead_seqs, args.overhead_prompt_tokens, 48, future_value, args.cost_rate
        )
        sections.append(overhead_table(cost, args.overhead_seqs, args.overhead_prompt_tokens, args.threads))
        data["cost"] = cost
    sections.append(f"Commit {commit}.")
    save_report(args.out, "Value predictor", "\n\n".join(sections), data, args, provenance)


if __name__ == "__main__":
    main()
