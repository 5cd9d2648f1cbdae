"""RULER over HTTP: lm-eval's own RULER tasks, run through `local-completions` against the server
started here once per setup (compression off, uniform int8, `dynamic` as shipped, and `dynamic` with
its byte budget alone at about 25%, 10% and 5% of the bytes), at 4k and 8k tokens.

The tasks are the ones that need no download: the needles in repeated filler (`niah_single_1`,
`niah_multikey_2`, `niah_multikey_3`), variable tracking (`ruler_vt`), common and frequent word
extraction (`ruler_cwe`, `ruler_fwe`). The essay-based needles and the QA tasks fetch Paul Graham's
essays or SQuAD/HotpotQA from the network, so they are left out. Scores are lm-eval's (the share of
expected strings found in the answer); the bytes kept are the server's own, `kv_compression_ratio`
in `/metrics` (compressed / original size per finished request, averaged over the run).

Beside them, our own tasks in RULER's form (`benchmarks/ruler/exact_values/`): a 7-10 digit number, a UUID
or a name of several word pieces, in repeated or in natural filler, scored exact, partial (half
the value copied, the shape a dropped span leaves) or missed; `--seed` draws their cases. Further
setups compare what eviction keeps together (`retention_unit`: each word as shipped, each token, chunks of 8)
at about 25%, 10%, 8%, 5% and 3% of the bytes.

    python benchmarks/ruler/run.py                                    # 6 tasks, 4k and 8k, 10 cases each
    python benchmarks/ruler/run.py --tasks niah_single_1 --lengths 4096 --limit 4 --setups "compression off"
    python benchmarks/ruler/run.py --tasks exact_number_repeat --lengths 4096 --seed 7 \
        --setups "compression off" "dynamic, budget ~5%" "dynamic by token, budget ~5%"
Results: benchmarks/ruler/results/ruler.{json,md,png} (make bench-ruler: ruler_4k and ruler_8k).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.report import pyplot, save_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from benchmarks.placement import add_placement_options, model_folder, placement, server_flags  # noqa: E402
from confkv.compress.config import DEFAULT_FILE  # noqa: E402
from load_tests.run import served  # noqa: E402

RULER_TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
# Our own tasks in the same form: exact values (numbers, UUIDs, names) in repeated and in natural filler.
EXACT_VALUES = Path(__file__).resolve().parent / "exact_values"
EXACT_TASKS = tuple(sorted(path.stem for path in EXACT_VALUES.glob("exact_*.yaml")))
TASKS = RULER_TASKS + EXACT_TASKS
OFF = "compression off"
RATE_ONLY = {"policy": "dynamic", "policy_options": {"dynamic": {"thresholds_decide": False}}}
BUDGETS = {"25%": 0.75, "10%": 0.9, "8%": 0.92, "5%": 0.95, "3%": 0.97}  # about that share of the bytes: the rate
UNITS = {  # what is kept or dropped together (`retention_unit`): the server's (each word), or another
    "": {},
    " by token": {"retention_unit": "token"},
    " by chunk of 8": {"retention_unit": "chunk", "chunk_tokens": 8},
}
# Each setup: the compression config file's values changed (None: the server started without compression).
SETUPS: dict[str, dict | None] = {
    OFF: None,
    # Every entry kept, at int8: policy `none` would not do, it turns compression off for requests
    # that do not ask for a storage themselves (and lm-eval asks for nothing).
    "uniform int8": {**RATE_ONLY, "compression_rate": 0.0},
    "dynamic (shipped: thresholds 0.9/0.7)": {},
    **{
        f"dynamic{unit}, budget ~{share}": {**RATE_ONLY, **spans, "compression_rate": rate}
        for unit, spans in UNITS.items()
        for share, rate in BUDGETS.items()
    },
}
DEFAULT_SETUPS = [OFF, "uniform int8", "dynamic (shipped: thresholds 0.9/0.7)"] + [
    f"dynamic, budget ~{share}" for share in ("25%", "10%", "5%")
]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# lm-eval's request limit (300 s) and the server's (600 s) count queueing: a 4k prompt waiting behind three
# others on a busy 2-core machine passes them, and one timeout ends the run or cuts an answer.
REQUEST_TIMEOUT_S = 3600


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(RULER_TASKS), choices=TASKS)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192], help="RULER's max_seq_lengths")
    parser.add_argument("--limit", type=int, default=10, help="cases of each task at each length")
    parser.add_argument("--seed", type=int, default=0, help="of the exact-value tasks' cases (fresh: unseen cases)")
    parser.add_argument("--setups", nargs="+", default=DEFAULT_SETUPS, choices=list(SETUPS))
    parser.add_argument("--concurrent", type=int, default=4, help="lm-eval's requests in flight")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    add_placement_options(parser)
    parser.add_argument("--out", type=Path, default=RESULTS / "ruler")
    args = parser.parse_args()
    # Stopped, stop the server and lm-eval too: on SIGTERM exit as on any error, so that `served` stops
    # the server and subprocess.run kills lm-eval, instead of leaving both to spoil later runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in tqdm(args.setups, unit="setup"):
            flags = ["--enable-prefix-cache=false", f"--request-timeout={REQUEST_TIMEOUT_S}"]
            flags += setup_flags(name, Path(tmp)) + server_flags(args)
            with served(None, flags) as (url, _):
                results[name] = {str(n): run_length(url, n, args, Path(tmp)) for n in args.lengths}
    setup = (
        f"lm-eval {lm_eval_version()}'s RULER tasks through `local-completions` (greedy, RULER's own prompts and "
        f"scoring), {args.limit} cases of each task at each length, one server per setup; bytes kept: "
        f"`kv_compression_ratio` from `/metrics`, averaged over the run; {placement(args)}"
    )
    save_report(args.out, "RULER over HTTP", table(results, args, setup), {"setup": setup, "results": results}, args)
    plot(results, args, args.out.with_suffix(".png"))


def setup_flags(name: str, tmp: Path) -> list[str]:
    """Server flags for a setup: compression off, or a compression config file with its values."""
    values = SETUPS[name]
    if values is None:
        return ["--compression-enabled=false"]
    config = json.loads(DEFAULT_FILE.read_text()) | values
    path = tmp / f"{len(list(tmp.iterdir()))}.json"
    path.write_text(json.dumps(config))
    return [f"--compression-config={path}"]


def run_length(url: str, length: int, args: argparse.Namespace, tmp: Path) -> dict:
    """Every task at `length` tokens against the server at `url`: lm-eval's score of each, and the
    bytes the server kept over the run."""
    before = ratio_totals(url)
    out = tmp / f"lm-eval-{length}-{len(list(tmp.iterdir()))}"
    tokenizer = str(model_folder(args.model_path))
    served_name = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    model_args = (
        f"model={served_name},base_url={url}/v1/completions,tokenizer={tokenizer},tokenized_requests=False,"
        f"num_concurrent={args.concurrent},max_retries=1,max_length={max_length(args)},timeout={REQUEST_TIMEOUT_S}"
    )
    subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args]
        + ["--tasks", ",".join(args.tasks), "--limit", str(args.limit), "--output_path", str(out)]
        + ["--include_path", str(EXACT_VALUES)]
        + ["--metadata", json.dumps({"max_seq_lengths": [length], "tokenizer": tokenizer, "seed": args.seed})],
        env={**os.environ, **OFFLINE},
        check=True,
    )
    scores = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    after = ratio_totals(url)
    requests = after[1] - before[1]
    kept = (after[0] - before[0]) / requests if requests else 1.0  # nothing compressed: every byte kept
    row = {"bytes_kept": kept, "scores": {}, "partial": {}}
    for task in args.tasks:
        exact = task in EXACT_TASKS  # scored exact, partial (half the value copied) or missed
        row["scores"][task] = scores[task][f"exact_{length},none" if exact else f"{length},none"]
        if exact:
            row["partial"][task] = scores[task][f"partial_{length},none"]
    return row


def ratio_totals(url: str) -> tuple[float, float]:
    """`kv_compression_ratio`'s sum and count in the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
        for sample in family.samples
        if sample.name in ("kv_compression_ratio_sum", "kv_compression_ratio_count")
    }
    return values.get("kv_compression_ratio_sum", 0.0), values.get("kv_compression_ratio_count", 0.0)


def max_length(args: argparse.Namespace) -> int:
    """The served model's context: lm-eval cuts a longer prompt from the left to fit it with the answer."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_folder(args.model_path)).max_position_embeddings


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm-eval")


def table(results: dict, args: argparse.Namespace, setup: str) -> str:
    lines = [
        f"{setup}.",
        "",
        f"| length | setup | bytes kept | {' | '.join(args.tasks)} | mean | mean vs off |",
        f"| ---: | --- | ---: | {' | '.join('---:' for _ in args.tasks)} | ---: | ---: |",
    ]
    for length in map(str, args.lengths):
        off = mean(results[OFF][length]) if OFF in results else None
        for name, rows in results.items():
            row = rows[length]
            vs_off = f"{mean(row) / off:.2f}" if off else "n/a"
            scores = " | ".join(cell(row, task) for task in args.tasks)
            lines.append(f"| {length} | {name} | {row['bytes_kept']:.1%} | {scores} | {mean(row):.2f} | {vs_off} |")
    return "\n".join(lines)


def cell(row: dict, task: str) -> str:
    """A task's score; for an exact-value task, the share exact and (in brackets) the share partly copied."""
    partial = row.get("partial", {}).get(task)
    return f"{row['scores'][task]:.2f}" + (f" ({partial:.2f})" if partial is not None else "")


def mean(row: dict) -> float:
    return sum(row["scores"].values()) / len(row["scores"])


def plot(results: dict, args: argparse.Namespace, path: Path) -> None:
    """Score against bytes kept, one panel per length: a line through the dynamic setups, a point for
    each other setup, and the uncompressed score as a horizontal line."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(args.lengths), figsize=(5.5 * len(args.lengths), 4), squeeze=False)
    for ax, length in zip(axes[0], map(str, args.lengths), strict=True):
        budgets = sorted((r[length]["bytes_kept"], mean(r[length])) for n, r in results.items() if "budget" in n)
        if budgets:
            ax.plot(*zip(*budgets, strict=True), marker="o", label="dynamic, byte budget")
        for name, rows in results.items():
            if name == OFF:
                ax.axhline(mean(rows[length]), color="black", linestyle="--", label=OFF)
            elif "budget" not in name:
                ax.scatter(rows[length]["bytes_kept"], mean(rows[length]), label=name, zorder=3)
        ax.set_xscale("log")
        ax.set_xlabel("KV bytes kept (share of the uncompressed cache)")
        ax.set_ylabel(f"RULER mean score over {len(args.tasks)} tasks")
        ax.set_title(f"{length} tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
