"""lm-eval's likelihood requests through the server, against transformers' own on the same model.

lm-eval 0.4.13's `local-completions` scores the project's local tasks (`benchmarks/lm_eval/tasks.py`:
44 multiple-choice questions by accuracy, three paragraphs by perplexity) through `/v1/completions`
(`echo`, `logprobs: 1`, `max_tokens: 1`: the prompt's log-probabilities), tokenizing through the
server's `/tokenize` (its remote tokenizer, found by itself); its `hf` model scores the same tasks with
transformers in this process, in fp32. The server is started here twice: with compression off, where
prompt log-probabilities are the model's own, and as shipped, where they come from each request's own
prefill before any eviction but over its int8 KV. Every run logs each request's log-likelihood, so beside
the tasks' metrics the table gives the largest difference from transformers' over all requests, which
does not flip on a near-tie as accuracy can.

    python benchmarks/lm_eval/run.py
Results: benchmarks/lm_eval/results/lm_eval.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.lm_eval.tasks import TASKS, write_tasks  # noqa: E402
from benchmarks.report import Provenance, command_line, save_report  # noqa: E402
from confkv.models.default_model import FOLDER_NAME, default_model_path  # noqa: E402
from load_tests.run import served  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[2]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# Server setups: flags beside the model's. Prompt log-probabilities are of the request's KV at its storage
# precision: the model's own with compression off, over an int8 cache as shipped.
SETUPS = {"compression off": ["--compression-enabled=false"], "as shipped (int8, dynamic 0.6)": []}
METRICS = {"confkv_choices": ("acc",), "confkv_text": ("word_perplexity", "byte_perplexity", "bits_per_byte")}


def run_lm_eval(
    model: str, model_args: str, tasks: Path, out: Path, timeout: float = 1800, limit: int | None = None
) -> dict:
    """`lm_eval` on the local tasks (`tasks`, from write_tasks) with `model` (`local-completions`, `hf`), the
    first `limit` documents of each task if given:
    {"metrics": {task: {metric: value}}, "loglikelihoods": {task: [each request's, in lm-eval's order]}}."""
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", ",".join(TASKS)]
        + ["--include_path", str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "1"]
        + (["--device", "cpu"] if model == "hf" else [])
        + (["--limit", str(limit)] if limit is not None else []),
        cwd=ROOT,
        env={**os.environ, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if run.returncode != 0:
        raise RuntimeError(f"lm_eval --model {model} failed:\n{run.stderr[-3000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())["results"]
    metrics = {task: {m: results[task][f"{m},none"] for m in METRICS[task]} for task in TASKS}
    loglikelihoods = {}
    for task in TASKS:
        samples = [json.loads(line) for path in out.rglob(f"samples_{task}_*.jsonl") for line in path.open()]
        samples.sort(key=lambda sample: sample["doc_id"])
        # A request's response is [log-likelihood, is_greedy] (multiple choice) or the log-likelihood (rolling).
        loglikelihoods[task] = [
            float(resp[0][0] if isinstance(resp[0], list) else resp[0]) for s in samples for resp in s["resps"]
        ]
    return {"metrics": metrics, "loglikelihoods": loglikelihoods}


def compare(local: dict, through: dict[str, dict]) -> dict:
    """Per task: transformers' metrics, each server setup's, and the largest difference between a setup's
    requests' log-likelihoods and transformers'."""
    rows = {}
    for task in TASKS:
        want = local["loglikelihoods"][task]
        rows[task] = {
            "requests": len(want),
            "transformers": local["metrics"][task],
            "server": {name: run["metrics"][task] for name, run in through.items()},
            "max_loglikelihood_difference": {
                name: max(abs(a - b) for a, b in zip(run["loglikelihoods"][task], want, strict=True))
                for name, run in through.items()
            },
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrent", type=int, default=2, help="lm-eval's requests in flight to the server")
    parser.add_argument("--out", type=Path, default=RESULTS / "lm_eval")
    args = parser.parse_args()
    provenance = Provenance.capture()
    model = default_model_path()
    through = {}
    with tempfile.TemporaryDirectory() as tmp:
        tasks = write_tasks(Path(tmp) / "tasks")
        for name, flags in SETUPS.items():
            with served(None, ["--model-path", str(model), *flags]) as (url, _):
                server_args = f"model={FOLDER_NAME},base_url={url}/v1/completions,num_concurrent={args.concurrent}"
                through[name] = run_lm_eval("local-completions", server_args, tasks, Path(tmp) / name)
        local = run_lm_eval("hf", f"pretrained={model},dtype=float32", tasks, Path(tmp) / "hf")
    data = {"commit": provenance.commit, "tasks": compare(local, through)}
    save_report(args.out, "lm-eval through the server", table(data), data, args, provenance)


def table(data: dict) -> str:
    from importlib.metadata import version

    lines = [
        f"lm-eval {version('lm-eval')} on the project's local tasks: `local-completions` through the server (its "
        "own tokenizer routes), compression off and as shipped, against `hf` (transformers, fp32, in process) on "
        f"the embedded model; commit {data['commit']}, `{command_line([__file__, *sys.argv[1:]])}`.",
        "",
        "| task | metric | transformers | " + " | ".join(f"through the server, {name}" for name in SETUPS) + " |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in SETUPS) + " |",
    ]
    for task, row in data["tasks"].items():
        for metric, value in row["transformers"].items():
            cells = " | ".join(f"{row['server'][name][metric]:.4f}" for name in SETUPS)
            lines.append(f"| {task} | {metric} | {value:.4f} | {cells} |")
        cells = " | ".join(f"{row['max_loglikelihood_difference'][name]:.1e}" for name in SETUPS)
        lines.append(f"| {task} | largest difference of a request's log-likelihood ({row['requests']}) | 0 | {cells} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
