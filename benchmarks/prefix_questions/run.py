"""A document asked two questions: does the prefix cache carry the first question's compression into the second?

Each needle case (a hidden password in 1k, 2k or 3k tokens of text) is asked twice in a row: first
a decoy question about something else, then the question that needs the password, each as a new
request whose prompt is the document and the question, as a document-chat client sends them.
With the prefix cache, the second request reuses the document's KV parked by the first; without it
(a fresh server), the second request prefills everything. Compression is `dynamic` with int8
storage at each rate; everything else is the server's defaults. Reported per rate: needles found
by the second question (fresh and with reuse), its median TTFT, the share of its prompt reused,
and the KV bytes parked after the first question. With `--peers`, kvpress's KVzipPress runs the
same cases in its own environment (`make bench-peers`): the document compressed once without a
question, at the same rate (the same bytes as ours, whose int8 storage is part of the rate), then asked.

    python benchmarks/prefix_questions/run.py            # 9 needles (3 per length) x rates 0.6, 0.75, 0.875
    python benchmarks/prefix_questions/run.py --peers    # and KVzip on the same cases
    python benchmarks/prefix_questions/run.py --quick    # 3 needles, rate 0.875
Results: benchmarks/prefix_questions/results/prefix_questions.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.chat import ask  # noqa: E402
from benchmarks.report import Provenance, save_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from benchmarks.tasks import NeedleCase, needle_cases  # noqa: E402
from confkv.compress.config import CompressionConfig, resolve  # noqa: E402
from confkv.compress.predictor.online import load_future_value, predictor_path  # noqa: E402
from confkv.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from confkv.models.default_model import default_model_path  # noqa: E402
from confkv.models.loader import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
DECOY = "What is this text about? Answer in one sentence."
MAX_TOKENS = 16


def split(case: NeedleCase) -> tuple[str, str]:
    """The case's user message as (document followed by a blank line, question)."""
    content = case.messages[0]["content"]
    cut = content.rindex("\n\n") + 2
    return content[:cut], content[cut:]


def ask_case(engine: LLMEngine, tokenizer, request_id: str, case: NeedleCase, question: str | None, params) -> dict:
    """One request: the case's document with `question` (None: the case's own); its answer and timings."""
    document, own = split(case)
    messages = [{"role": "user", "content": document + (own if question is None else question)}]
    answer = ask(engine, tokenizer, request_id, messages, MAX_TOKENS, params)
    reused = answer.cached_tokens / answer.prompt_tokens
    return {"answer": answer.text, "correct": case.correct(answer.text), "ttft": answer.ttft, "reused": reused}


def run_rate(model, tokenizer, cases: list[NeedleCase], rate: float, prefix_cache: bool, future_value) -> list[dict]:
    config = CompressionConfig.load()
    engine = LLMEngine(
        model, tokenizer, EngineConfig(max_cache_bytes=2**31, prefix_cache=prefix_cache), config, future_value
    )
    params = resolve(config, {"policy": "dynamic", "compression_rate": rate, "kv_cache_dtype": "int8"}, True, False)
    rows = []
    label = f"rate {rate}, {'prefix cache' if prefix_cache else 'fresh'}"
    with torch.inference_mode():
        for case in tqdm(cases, desc=label, unit="case"):
            parked = None
            if prefix_cache:
                before = engine.store.parked_bytes
                ask_case(engine, tokenizer, f"{case.name}-decoy", case, DECOY, params)
                parked = engine.store.parked_bytes - before  # what the decoy left for the question
            row = ask_case(engine, tokenizer, case.name, case, None, params)
            rows.append({"case": case.name, "tokens": case.context_tokens, "parked_bytes": parked, **row})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--needles", type=int, default=9, help="split evenly over 1k, 2k and 3k tokens")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.6, 0.75, 0.875])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--peers", action="store_true", help="also run kvpress's KVzipPress (make bench-peers)")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_questions")
    args = parser.parse_args()
    if args.quick:
        args.needles, args.rates = 3, [0.875]
    provenance = Provenance.capture()  # the code measured, before anything can change it
    commit = provenance.commit
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(None, torch.device("cpu"))
    config = CompressionConfig.load()
    future_value = load_future_value(predictor_path(None), model.config, torch.device("cpu"), config.score_interval)
    cases = needle_cases(tokenizer, args.needles, lengths=(1000, 2000, 3000))
    results = {
        str(rate): {
            mode: run_rate(model, tokenizer, cases, rate, on, future_value)
            for mode, on in (("fresh", False), ("reuse", True))
        }
        for rate in args.rates
    }
    data = {"commit": commit, "results": results}
    if args.peers:
        data["kvzip"] = kvzip(cases, args)
    save_report(args.out, "A document asked two questions", table(data, args), data, args, provenance)


def kvzip(cases: list[NeedleCase], args: argparse.Namespace) -> dict[str, list[dict]]:
    """KVzipPress's answers per rate, from kvpress's environment, scored here."""
    if not PEERS_PYTHON.exists():
        raise SystemExit(f"{PEERS_PYTHON} is missing: run `make bench-peers` (it builds kvpress's environment)")
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp) / "cases.json", Path(tmp) / "answers.json"
        spec.write_text(
            json.dumps(
                {
                    "model_path": str(default_model_path()),
                    "rates": args.rates,
                    "cases": [
                        {"name": c.name, "context": split(c)[0], "question": split(c)[1], "max_tokens": MAX_TOKENS}
                        for c in cases
                    ],
                }
            )
        )
        runner = Path(__file__).resolve().parent / "kvzip_questions.py"
        command = [str(PEERS_PYTHON), str(runner), "--cases", str(spec), "--out", str(out)]
        subprocess.run([*command, "--threads", str(args.threads)], check=True)
        answers = json.loads(out.read_text())["answers"]
    return {
        str(rate): [
            {"case": c.name, "answer": answers[str(rate)][c.name], "correct": c.correct(answers[str(rate)][c.name])}
            for c in cases
        ]
        for rate in args.rates
    }


def found(rows: list[dict]) -> str:
    return f"{sum(r['correct'] for r in rows)}/{len(rows)}"


def table(data: dict, args: argparse.Namespace) -> str:
    lines = [
        f"{args.needles} needle cases (1k, 2k and 3k tokens), a decoy question then the needle question, `dynamic` "
        f"with int8 storage; default model, fp32, {args.threads} CPU threads; commit {data['commit']}, "
        "`python benchmarks/prefix_questions/run.py`.",
        "",
        "| rate | needles found, fresh | needles found, after the decoy with reuse | median TTFT fresh (s) "
        "| median TTFT with reuse (s) | prompt reused | KV the decoy parked (median) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rate, modes in data["results"].items():
        fresh, reuse = modes["fresh"], modes["reuse"]
        lines.append(
            f"| {rate} | {found(fresh)} | {found(reuse)} "
            f"| {statistics.median(r['ttft'] for r in fresh):.2f} | {statistics.median(r['ttft'] for r in reuse):.2f} "
            f"| {statistics.mean(r['reused'] for r in reuse):.0%} "
            f"| {statistics.median(r['parked_bytes'] for r in reuse) / 2**20:.1f} MiB |"
        )
    if "kvzip" in data:
        lines += [
            "",
            "kvpress's KVzipPress (query-agnostic: the document compressed once without a question, then asked) "
            "at the same rate, i.e. the same bytes:",
            "",
            "| rate | needles found, KVzip | needles found, ours after the decoy with reuse |",
            "| ---: | ---: | ---: |",
        ]
        for rate, rows in data["kvzip"].items():
            lines.append(f"| {rate} | {found(rows)} | {found(data['results'][rate]['reuse'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
