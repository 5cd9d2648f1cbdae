"""Quality benchmark: our policies through the real engine, NVIDIA kvpress's presses on the same cases.

Three tasks, all generated from text that ships with Python (benchmarks/tasks.py):
- needle in natural text, 1k, 2k and 3k tokens: accuracy relative to the uncompressed cache;
- generation fidelity: greedy summaries, ROUGE-L and BLEU against the uncompressed summaries;
- perplexity of a 2k-token text: the first 1.5k prefilled, the last 512 teacher-forced one token at a
  time, compressed as decoding proceeds (every 128 tokens, to the same fraction of every token seen so far);
- teacher-forced fidelity, the primary fidelity figure: every needle and summary case's uncompressed answer
  is forced through the compressed cache, compression running between the forced steps as in serving
  (every `compression_interval`), and each step's next-token distribution is compared with the
  uncompressed cache's: top-1 agreement and mean KL(uncompressed || compressed) per token. Unlike greedy
  ROUGE-L it does not flip on a near-tie, since one different token never changes what follows.
Memory kept is measured for our setups (compressed bytes / uncompressed bytes after every decode step,
averaged over the request: `mean_compression_ratio`; KEY_ONLY's int4 values and int8 storage counted
as stored); for kvpress it is its `compression_ratio` (1 - ratio of fp32 entries).
Uniform int8 and int4 quantisation of every key and value run as their own rows at their own bytes.

`dynamic` runs as shipped (with the value predictor when its weights are there); `dynamic, attention
only` without it. Our re-implementations of the classic scorers (tova, snapkv, h2o, ...) are available
in a run file; by default the kvpress presses stand for them.

What a run measures is declared in a run file, `benchmarks/quality/runs/NAME.yaml` (benchmarks/quality/plan.py
says what it may hold): the task sizes, the rates and the setups; its results are quality_NAME (`default`:
quality).

    python benchmarks/quality/run.py benchmarks/quality/runs/default.yaml   # = make bench-quality-peers; 9
        # needles, 4 summaries, 2k perplexity, kvpress alongside: ~45 minutes on 2 cores
    python benchmarks/quality/run.py benchmarks/quality/runs/spans.yaml --quick   # a few minutes: 3 needles,
        # 2 summaries, rate 0.6
Results: benchmarks/quality/results/quality_NAME.{json,md} and one plot per task, quality_NAME_<task>.png.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks import kivi  # noqa: E402
from benchmarks.engine import load_with_predictor  # noqa: E402
from benchmarks.quality.plan import RunFile, Setup  # noqa: E402
from benchmarks.report import SERVER_CODE, Provenance, pyplot, save_report  # noqa: E402
from confkv.models.corpus import text_of_tokens  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
from benchmarks.tasks import fidelity_cases, needle_cases  # noqa: E402
from confkv.compress.config import CompressionConfig, resolve  # noqa: E402
from confkv.compress.library import DynamicKVCompressor, cache_keyword  # noqa: E402
from confkv.compress.predictor.online import FutureValue  # noqa: E402
from confkv.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from confkv.engine.sequence import SamplingParams  # noqa: E402
from confkv.models.default_model import default_model_path  # noqa: E402

PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
PEERS_RUNNER = Path(__file__).resolve().parent / "kvpress_runner.py"
RATE_ONLY = "dynamic, rate only"  # dynamic with its thresholds off, the rate alone deciding: the sweep's comparison
PPL_FORCED = 512  # the perplexity text's last tokens, teacher-forced; the rest is prefilled uncompressed
PPL_INTERVAL = 128  # tokens between compressions in the perplexity task (kvpress's decoding press needs
# more buffered queries than SnapKV's 64-token window; the same interval applies to every setup)


@dataclass
class Row:
    setup: Setup
    needle_relative: float = 0.0  # all lengths
    needle_by_length: dict[int, float] = field(default_factory=dict)  # accuracy relative to uncompressed
    rouge_l: float | None = None  # None: not measured (the task was not run, or not for this row)
    bleu: float | None = None
    perplexity: float | None = None
    memory_kept: float = 0.0  # needle and fidelity cases, mean
    perplexity_memory_kept: float = 0.0  # at the end of the perplexity text
    forced_top1: float | None = None  # teacher-forced answers: share of steps whose top token is the uncompressed one
    forced_kl: float | None = None  # teacher-forced answers: mean KL(uncompressed || compressed) per token, nats
    memory_by_case: dict[str, float] = field(default_factory=dict)  # needle and fidelity cases
    seconds: float = 0.0
    outputs: dict[str, str] = field(default_factory=dict)


@dataclass
class Tasks:
    needles: list
    summaries: list
    prompts: dict[str, list[int]]
    max_tokens: dict[str, int]
    perplexity_ids: list[int]
    ignore_eos: set[str] = field(default_factory=set)  # cases that run their max_tokens in full (long answers)
    answers: dict[str, list[int]] = field(default_factory=dict)  # the uncompressed greedy answers
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # their uncompressed log-probs, forced

    @property
    def perplexity_prefill(self) -> int:
        return len(self.perplexity_ids) - PPL_FORCED


def build_tasks(
    tokenizer,
    needles: int,
    summaries: int,
    ppl_tokens: int,
    answer_tokens: int | None = None,
    needle_lengths: tuple[int, ...] = (1000, 2000, 3000),
    first_needle: int = 0,
) -> Tasks:
    """`answer_tokens`: summaries of exactly that many tokens, EOS ignored; else up to 48. `ppl_tokens`
    0: no perplexity task. `first_needle`: the needle cases from this one on (others than the usual set's)."""
    needle_set = needle_cases(tokenizer, first_needle + needles, lengths=needle_lengths)[first_needle:]
    summary_set = fidelity_cases(tokenizer, summaries)
    prompts, max_tokens = {}, {}
    for case in [*needle_set, *summary_set]:
        text = tokenizer.apply_chat_template(case.messages, tokenize=False, add_generation_prompt=True)
        prompts[case.name] = tokenizer(text, add_special_tokens=False).input_ids
        max_tokens[case.name] = 16 if case in needle_set else answer_tokens or 48
    # Paragraphs from the far end of the corpus: the needle haystacks draw from all of it, but this is one
    # contiguous text, and the value predictor's traces start at the front.
    perplexity_ids = text_of_tokens(tokenizer, ppl_tokens, offset=400) if ppl_tokens else []
    return Tasks(
        needle_set,
        summary_set,
        prompts,
        max_tokens,
        perplexity_ids,
        ignore_eos={c.name for c in summary_set} if answer_tokens else set(),
    )


def request_of(setup: Setup, interval: int | None = None) -> dict:
    request = {
        "policy": setup.policy,
        "compression_rate": setup.rate,
        "kv_cache_dtype": setup.storage,
        "value_predictor": setup.value_predictor,
    }
    options = {}
    if setup.doubt_weight is not None:
        options["doubt_weight"] = setup.doubt_weight
    if setup.thresholds_decide is not None:
        options["thresholds_decide"] = setup.thresholds_decide
    if setup.pooling is not None:
        options["pooling"], options["kernel_size"] = setup.pooling
    if setup.thresholds is not None:
        request["thresholds"] = dict(zip(("high", "medium"), setup.thresholds, strict=True))
    if setup.layer_budget is not None:
        request["layer_budget"] = setup.layer_budget
    if setup.lookahead:
        request["lookahead_tokens"] = setup.lookahead
    if setup.retention_unit is not None:
        request["retention_unit"] = setup.retention_unit
    if setup.compression_interval is not None:
        request["compression_interval"] = setup.compression_interval
    if options:
        request["policy_options"] = {"dynamic": options}
    return {**request, "compression_interval": interval} if interval else request


def new_engine(
    model, tokenizer, future_value: FutureValue | None, key_only_bits: int = 4, key_rotation: bool = True
) -> LLMEngine:
    config = EngineConfig(max_cache_bytes=2**33, max_num_seqs=8, max_num_batched_tokens=1024, prefix_cache=True)
    compression = CompressionConfig(key_only_value_bits=key_only_bits, key_rotation=key_rotation)
    return LLMEngine(model, tokenizer, config, compression, future_value)


def run_setup(
    model, tokenizer, setup: Setup, tasks: Tasks, future_value: FutureValue | None, engine: LLMEngine | None = None
) -> tuple[dict[str, str], dict[str, list[int]], dict[str, dict], float]:
    """Greedy outputs (text and tokens) of every needle and summary case, batched through the engine
    (a new one, or `engine`: then its prefix cache may hold the prompts already), and their metrics."""
    engine = engine or new_engine(model, tokenizer, future_value, setup.key_only_bits, setup.key_rotation)
    params = resolve(engine.compression_config, request_of(setup), True, True)
    for name, ids in tasks.prompts.items():
        sampling = SamplingParams(
            max_tokens=tasks.max_tokens[name],
            temperature=0.0,
            ignore_eos=name in tasks.ignore_eos,
        )
        engine.add_request(name, ids, sampling, params)
    texts = {name: "" for name in tasks.prompts}
    tokens: dict[str, list[int]] = {name: [] for name in tasks.prompts}
    metrics: dict[str, dict] = {}
    started = time.perf_counter()
    label = f"{setup.label} @ {setup.rate}" if setup.rate else setup.label
    with torch.inference_mode(), tqdm(total=len(tasks.prompts), desc=label, unit="case", leave=False) as bar:
        while engine.has_unfinished():
            for out in engine.step():
                texts[out.request_id] += out.delta_text
                tokens[out.request_id] += out.new_token_ids
                if out.finished:
                    metrics[out.request_id] = out.compression_metrics
                    bar.update(1)
    return texts, tokens, metrics, time.perf_counter() - started


@torch.inference_mode()
def forced(
    model,
    tokenizer,
    ids: list[int],
    prefill: int,
    request: dict,
    future_value: FutureValue | None,
    progress: bool = False,
) -> tuple[torch.Tensor, float]:
    """Log-probs [len(ids) - prefill, vocab] of the next token at each of ids[prefill:], the prefix
    prefilled and the rest teacher-forced one token at a time through the compressed cache (which
    compresses between the forced steps as in serving), and the memory kept at the end."""
    compressor = DynamicKVCompressor(max_cache_size="8GiB", future_value=future_value, tokenizer=tokenizer, **request)
    tokens = torch.tensor([ids])
    steps = []
    with compressor.attached(model):
        logits = model(input_ids=tokens[:, :prefill], **{cache_keyword(model): compressor}).logits[:, -1]
        for pos in tqdm(range(prefill, len(ids)), desc="forced", unit="tok", leave=False, disable=not progress):
            steps.append(torch.log_softmax(logits[0].float(), -1))
            if pos + 1 < len(ids):
                compressor(tokens[:, : pos + 1], logits)  # the model's confidence, as generate would report
                logits = model(input_ids=tokens[:, pos : pos + 1], **{cache_keyword(model): compressor}).logits[:, -1]
        kept = compressor.metrics().compression_ratio
    return torch.stack(steps), kept


def perplexity(
    model, tokenizer, ids: list[int], prefill: int, setup: Setup, future_value: FutureValue | None
) -> tuple[float, float]:
    """exp(mean NLL) of ids[prefill:], teacher-forced through the compressed cache, and the memory kept."""
    logprobs, kept = forced(
        model, tokenizer, ids, prefill, request_of(setup, PPL_INTERVAL), future_value, progress=True
    )
    nll = -logprobs.gather(1, torch.tensor(ids[prefill:]).view(-1, 1)).mean()
    return math.exp(float(nll)), kept


def teacher_forced_fidelity(
    model, tokenizer, setup: Setup, tasks: Tasks, future_value: FutureValue | None
) -> tuple[float, float]:
    """Every case's uncompressed answer forced through this setup's cache: the share of steps whose top
    token is the uncompressed cache's, and the mean KL(uncompressed || compressed) per token. The
    uncompressed setup (the first) records the reference as it runs."""
    agree, divergence, steps = 0, 0.0, 0
    for name, answer in tqdm(tasks.answers.items(), desc="teacher-forced", unit="case", leave=False):
        prompt = tasks.prompts[name]
        logprobs, _ = forced(model, tokenizer, prompt + answer, len(prompt), request_of(setup), future_value)
        reference = tasks.reference.setdefault(name, logprobs)
        agree += int((logprobs.argmax(-1) == reference.argmax(-1)).sum())
        divergence += float((reference.exp() * (reference - logprobs)).sum())
        steps += len(answer)
    return agree / steps, divergence / steps


def score(row: Row, texts: dict[str, str], reference: Row | None, tasks: Tasks) -> None:
    """Fill the row's task scores from its outputs; `reference` is the uncompressed row of the same source."""
    from rouge_score import rouge_scorer
    from sacrebleu.metrics import BLEU

    ref = reference.outputs if reference else texts
    row.outputs = texts
    lengths = sorted({c.context_tokens for c in tasks.needles})
    base = {n: _needle_accuracy(tasks.needles, ref, n) or 1.0 for n in lengths}
    row.needle_by_length = {n: _needle_accuracy(tasks.needles, texts, n) / base[n] for n in lengths}
    row.needle_relative = statistics.mean(row.needle_by_length.values())
    if not tasks.summaries:
        return
    rouge = rouge_scorer.RougeScorer(["rougeL"])
    bleu = BLEU(effective_order=True)
    summaries = [c.name for c in tasks.summaries]
    row.rouge_l = statistics.mean(rouge.score(ref[n], texts[n])["rougeL"].fmeasure for n in summaries)
    row.bleu = statistics.mean(bleu.sentence_score(texts[n], [ref[n]]).score / 100 for n in summaries)


def _needle_accuracy(needles: list, texts: dict[str, str], length: int) -> float:
    return statistics.mean(c.correct(texts[c.name]) for c in needles if c.context_tokens == length)


@contextlib.contextmanager
def peers_alongside(args, tasks: Tasks, threads: int) -> Iterator[Callable[[], list[tuple[Setup, dict]]]]:
    """kvpress's presses in their own environment (make bench-peers), running from now on (alongside our
    setups, or after them); yields a function that waits for its raw outputs per setup. Stopped if our
    side fails."""
    if not PEERS_PYTHON.exists():
        raise SystemExit(f"{PEERS_PYTHON} is missing: run `make bench-peers` (it builds kvpress's environment)")
    with tempfile.TemporaryDirectory() as tmp:
        cases = Path(tmp) / "cases.json"
        cases.write_text(
            json.dumps(
                {
                    "model_path": str(args.model_path or default_model_path()),
                    "cases": [
                        {"name": c.name, "messages": c.messages, "max_tokens": tasks.max_tokens[c.name]}
                        for c in [*tasks.needles, *tasks.summaries]
                    ],
                    "perplexity": {
                        "token_ids": tasks.perplexity_ids,
                        "prefill": tasks.perplexity_prefill,
                        "interval": PPL_INTERVAL,
                    },
                }
            )
        )
        out = Path(tmp) / "peers.json"
        command = [str(PEERS_PYTHON), str(PEERS_RUNNER), "--cases", str(cases), "--out", str(out)]
        command += ["--rates", *map(str, args.rates), "--threads", str(threads), "--position", "2"]
        command += ["--presses", *args.presses] if args.presses else []
        runner = subprocess.Popen(command)

        def result() -> list[tuple[Setup, dict]]:
            if runner.wait() != 0:
                raise SystemExit(f"the kvpress runner failed (exit {runner.returncode}); its error is above")
            return _peer_setups(json.loads(out.read_text())["runs"])

        try:
            yield result
        finally:
            if runner.poll() is None:
                runner.kill()
                runner.wait()


def _peer_setups(runs: list[dict]) -> list[tuple[Setup, dict]]:
    return [(Setup(_peer_label(r["press"]), "auto", r["press"], r["rate"], source="kvpress"), r) for r in runs]


def _peer_label(press: str) -> str:
    return "kvpress " + ("uncompressed" if press == "none" else press)


def main() -> None:
    args = parse_args()
    # With kvpress alongside, each side gets half the threads: the two run at the same time. After our
    # setups, it gets them all.
    alongside = args.peers and not args.peers_after
    peers_threads = max(1, args.threads // 2) if alongside else args.threads
    torch.set_num_threads(max(1, args.threads - peers_threads) if alongside else args.threads)

    model, tokenizer, future_value = load_with_predictor(args.model_path, args.predictor)
    tasks = build_tasks(
        tokenizer,
        args.needles,
        args.summaries,
        args.perplexity_tokens,
        args.answer_tokens,
        tuple(args.needle_lengths),
        args.needles_from,
    )

    with peers_alongside(args, tasks, peers_threads) if alongside else contextlib.nullcontext() as peers:
        rows = load_rows(args.ours_from) if args.ours_from else run_ours(args, model, tokenizer, tasks, future_value)
        runs = peers() if peers else read_peers(args.peers_from) if args.peers_from else []
    if args.peers and args.peers_after:
        report(rows, args, tasks)  # our rows are saved before kvpress runs, and saved again with its rows
        with peers_alongside(args, tasks, peers_threads) as peers:
            runs = peers()
    rows += peer_rows(runs, tasks)
    report(rows, args, tasks)


def parse_args() -> argparse.Namespace:
    """The command line and its run file, with `provenance` and `commit`: the code measured (the run file
    with it), taken before anything can change it."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_file", type=Path, help="what to measure: a file in benchmarks/quality/runs/")
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--no-peers", dest="peers", action="store_false", help="not kvpress, whatever the file asks")
    parser.add_argument("--ours-from", type=Path, default=None, help="our rows from a saved quality.json")
    parser.add_argument(
        "--peers-from", type=Path, nargs="+", default=None, help="kvpress runner outputs to score (no rerun)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--predictor",
        type=Path,
        default=None,
        help="value predictor weights, its calibration beside them (default: those a server finds for the model)",
    )
    parser.add_argument("--quick", action="store_true", help="3 needles, 2 summaries, a short perplexity, rate 0.6")
    parser.add_argument("--out", type=Path, default=None, help="default: results/quality_NAME for runs/NAME.yaml")
    args = parser.parse_args()
    try:
        args.run = RunFile.load(args.run_file)
    except (OSError, ValueError) as error:
        parser.error(f"{args.run_file}: {error}")
    vars(args).update(args.run.tasks.model_dump(), rates=args.run.rates)
    args.peers = args.peers and args.run.peers is not None
    args.presses = args.run.peers.presses if args.run.peers else None
    args.peers_after = bool(args.run.peers and args.run.peers.after)
    stem = args.run_file.stem
    args.out = args.out or RESULTS / ("quality" if stem == "default" else f"quality_{stem}")
    run_file = args.run_file.resolve()
    measured = (str(run_file.relative_to(ROOT)),) if run_file.is_relative_to(ROOT) else ()
    args.provenance = Provenance.capture((*SERVER_CODE, *measured))
    args.commit = args.provenance.commit
    if args.quick:
        args.needles, args.summaries, args.perplexity_tokens, args.rates = 3, 2, PPL_FORCED + 256, [0.6]
        args.run = args.run.model_copy(update={"rates": args.rates})
        args.presses = args.presses or ["SnapKV", "ExpectedAttention"]
    return args


def run_ours(args, model, tokenizer, tasks: Tasks, future_value: FutureValue | None) -> list[Row]:
    """Every setup of ours in turn. Setups of one storage format share an engine, so a prompt is
    prefilled once and later setups take it from the prefix cache, as a server would: all of it but
    the last `observation_window` tokens, which every compressing request computes (their queries
    are what its end-of-prefill compression observes), so what each setup keeps is its own."""
    rows: list[Row] = []
    plan = args.run.plan()
    engines: dict[tuple[str, int], LLMEngine] = {}
    kivi_runs: dict[int, Row] = {}
    for i, setup in enumerate(tqdm(plan, desc="our setups", unit="setup")):
        if setup.kivi_bits is not None:
            kivi_runs = kivi_runs or run_kivi(model, tokenizer, tasks, [s for s in plan if s.kivi_bits], rows[0])
            rows.append(kivi_runs[setup.kivi_bits])
            _log(rows[-1])
            continue
        kind = (setup.storage, setup.key_only_bits, setup.key_rotation)
        if kind not in engines:
            engines[kind] = new_engine(model, tokenizer, future_value, *kind[1:])
        engine = engines[kind]
        texts, tokens, metrics, seconds = run_setup(model, tokenizer, setup, tasks, future_value, engine)
        if all((later.storage, later.key_only_bits, later.key_rotation) != kind for later in plan[i + 1 :]):
            del engines[kind]  # its memory back
        row = Row(setup, seconds=seconds)
        score(row, texts, rows[0] if rows else None, tasks)
        row.memory_by_case = {name: m["mean_compression_ratio"] for name, m in metrics.items()}
        row.memory_kept = statistics.mean(row.memory_by_case.values())
        if tasks.perplexity_ids:
            row.perplexity, row.perplexity_memory_kept = perplexity(
                model, tokenizer, tasks.perplexity_ids, tasks.perplexity_prefill, setup, future_value
            )
        if not rows and args.forced:  # the uncompressed setup: its answers are what the others are forced through
            tasks.answers = {name: ids for name, ids in tokens.items() if ids}
        if tasks.answers:
            row.forced_top1, row.forced_kl = teacher_forced_fidelity(model, tokenizer, setup, tasks, future_value)
        rows.append(row)
        _log(row)
    return rows


def run_kivi(model, tokenizer, tasks: Tasks, plan: list[Setup], reference: Row) -> dict[int, Row]:
    """KIVI as published at each width of `plan`, on the needle and summary cases (one prefill per case
    serves every width); by width. Perplexity and teacher-forced fidelity are not measured for it."""
    widths = [s.kivi_bits for s in plan]
    model_bits = torch.finfo(model.dtype).bits
    texts: dict[int, dict[str, str]] = {bits: {} for bits in widths}
    kept: dict[int, dict[str, float]] = {bits: {} for bits in widths}
    started = time.perf_counter()
    for name, prompt in tqdm(tasks.prompts.items(), desc="KIVI", unit="case", leave=False):
        for bits, answer in kivi.generate(model, prompt, widths, tasks.max_tokens[name]).items():
            texts[bits][name] = tokenizer.decode(answer, skip_special_tokens=True)
            kept[bits][name] = kivi.memory_kept(len(prompt) + len(answer), bits, model_bits)
    seconds = (time.perf_counter() - started) / len(widths)
    rows = {}
    for setup in plan:
        row = Row(setup, seconds=seconds)
        score(row, texts[setup.kivi_bits], reference, tasks)
        row.memory_by_case = kept[setup.kivi_bits]
        row.memory_kept = statistics.mean(row.memory_by_case.values())
        rows[setup.kivi_bits] = row
    return rows


def peer_rows(runs: list[tuple[Setup, dict]], tasks: Tasks) -> list[Row]:
    """kvpress's outputs scored as ours are, against kvpress's own uncompressed run (the first)."""
    rows: list[Row] = []
    for setup, run in runs:
        kept = 1.0 - setup.rate
        row = Row(setup, perplexity=run["perplexity"], memory_kept=kept, perplexity_memory_kept=kept)
        row.seconds = run["seconds"]
        score(row, run["outputs"], rows[0] if rows else None, tasks)
        rows.append(row)
        _log(row)
    return rows


def load_rows(path: Path) -> list[Row]:
    """Our rows as a previous run saved them (quality.json)."""
    rows = []
    for saved in json.loads(path.read_text())["rows"]:
        if saved["setup"]["source"] != "ours":
            continue
        saved["needle_by_length"] = {int(k): v for k, v in saved["needle_by_length"].items()}
        rows.append(Row(**{**saved, "setup": Setup(**saved["setup"])}))
    return rows


def read_peers(paths: list[Path]) -> list[tuple[Setup, dict]]:
    """kvpress runner outputs, merged: one uncompressed run (the first), each (press, rate) once."""
    merged: dict[tuple[str, float], dict] = {}
    for path in paths:
        for run in json.loads(path.read_text())["runs"]:
            merged.setdefault((run["press"], run["rate"]), run)
    return _peer_setups(list(merged.values()))


def _log(row: Row) -> None:
    scores = {"top-1": row.forced_top1, "KL": row.forced_kl, "ROUGE-L": row.rouge_l, "BLEU": row.bleu}
    scores["perplexity"] = row.perplexity
    measured = "  ".join(f"{name} {value:.4g}" for name, value in scores.items() if value is not None)
    tqdm.write(
        f"{row.setup.label:32s} rate {row.setup.rate:.2f}  memory {row.memory_kept:.3f}  "
        f"needle {row.needle_relative:.2f}  {measured}  ({row.seconds:.0f}s)"
    )


TASKS = {  # name: (title, column header, how a row gives its score, higher is better)
    "needle": ("Needle in natural text, accuracy relative to uncompressed", "needle", "needle_relative", True),
    "forced_top1": (
        "Teacher-forced fidelity: top-1 agreement with the uncompressed cache on its own answers",
        "top-1 agreement",
        "forced_top1",
        True,
    ),
    "forced_kl": (
        "Teacher-forced fidelity: mean KL(uncompressed || compressed) per token, nats",
        "KL",
        "forced_kl",
        False,
    ),
    "rouge_l": ("Generation fidelity, ROUGE-L against the uncompressed output", "ROUGE-L", "rouge_l", True),
    "bleu": ("Generation fidelity, BLEU against the uncompressed output", "BLEU", "bleu", True),
    "perplexity": ("Perplexity, teacher-forced, compressed as decoding proceeds", "perplexity", "perplexity", False),
}


def report(rows: list[Row], args, tasks: Tasks) -> None:
    lengths = sorted({c.context_tokens for c in tasks.needles})
    rates = sorted({r.setup.rate for r in rows if r.setup.rate})
    first = tasks.summaries[0].name if tasks.summaries else None
    summary_tokens = f"{tasks.max_tokens.get(first, 48)}-token" + (
        " (EOS ignored)" if first in tasks.ignore_eos else ""
    )
    parts = [
        f"{len(tasks.needles)} needle cases ({', '.join(map(str, lengths))} tokens of text, fact at depths 0.1-0.9)"
    ]
    if tasks.summaries:
        parts.append(f"{len(tasks.summaries)} greedy {summary_tokens} summaries of ~800-token passages")
    if tasks.perplexity_ids:
        parts.append(
            f"perplexity of {len(tasks.perplexity_ids)} tokens ({tasks.perplexity_prefill} prefilled, the rest "
            f"teacher-forced, compressed every {PPL_INTERVAL})"
        )
    lines = [
        f"{', '.join(parts)}; default model, fp32, {_threads(args)}. "
        "Each cell: score (memory kept). "
        "Memory kept is measured for ours (compressed / uncompressed bytes, averaged over each request's decode "
        "steps), 1 - compression_ratio for kvpress, and counted from KIVI's format for KIVI. "
        f"Commit {args.commit}. "
        "Needle and fidelity scores are against each library's own uncompressed run."
        + (
            f" Teacher-forced fidelity ({sum(map(len, tasks.answers.values()))} forced tokens over "
            f"{len(tasks.answers)} cases) is measured for ours only."
            if tasks.answers
            else ""
        ),
    ]
    labels = list(dict.fromkeys(r.setup.label for r in rows))
    for key, (title, _, attr, _) in measured_tasks(rows).items():
        lines += ["", f"#### {title}", "", "| setup | " + " | ".join(f"rate {r:.2f}" for r in rates) + " |"]
        lines.append("| --- |" + " ---: |" * len(rates))
        for label in labels:
            mine = [r for r in rows if r.setup.label == label]
            if not mine[0].setup.rate:  # uncompressed and uniform quantisation: one value, every column
                cells = [_cell(mine[0], attr)] * len(rates)
            else:
                by_rate = {r.setup.rate: r for r in mine}
                cells = [_cell(by_rate[rate], attr) if rate in by_rate else "-" for rate in rates]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        if key == "needle":
            lines += ["", "Needle accuracy by length (relative):", ""]
            lines.append("| setup | rate | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
            lines.append("| --- | ---: |" + " ---: |" * len(lengths))
            for r in rows:
                by = " | ".join(f"{r.needle_by_length[n]:.0%}" for n in lengths)
                lines.append(f"| {r.setup.label} | {r.setup.rate or '-'} | {by} |")
    lines += thresholds_section(rows)
    rows_data = {"rows": [asdict(r) for r in rows]}
    save_report(args.out, "Quality benchmark", "\n".join(lines), rows_data, args, getattr(args, "provenance", None))
    for key in measured_tasks(rows):
        plot(rows, key, args.out.with_name(f"{args.out.name}_{key}.png"))
    if any(r.setup.thresholds for r in rows):
        plot_memory_by_case(rows, args.out.with_name(f"{args.out.name}_memory_by_case.png"))


def measured_tasks(rows: list[Row]) -> dict[str, tuple]:
    """The entries of TASKS some row measured."""
    return {key: task for key, task in TASKS.items() if any(getattr(r, task[2]) is not None for r in rows)}


COMPARED = ("needle_relative", "forced_top1", "forced_kl", "rouge_l", "perplexity")


def thresholds_section(rows: list[Row]) -> list[str]:
    """The thresholds sweep (memory per request, quality), and each point against fixed-rate dynamic
    at the same mean bytes (interpolated between the two fixed rates around it)."""
    swept = [r for r in rows if r.setup.thresholds]
    if not swept:
        return []
    fixed = sorted((r for r in rows if r.setup.label == RATE_ONLY), key=lambda r: r.memory_kept)
    lines = [
        "",
        "#### Thresholds decide, the rate is a ceiling",
        "",
        "Memory kept per request (compressed / uncompressed bytes after every decode step, averaged over the "
        "request, then over the needle and summary cases) and quality for dynamic deciding by each (high, medium) "
        "pair; '" + RATE_ONLY + "' is dynamic with its thresholds off, the rate alone deciding.",
        "",
        "| setup | ceiling rate | memory kept, mean | min / median / max per request | needle | top-1 | KL | "
        "ROUGE-L | perplexity |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in [*swept, *fixed]:
        by_case = sorted(r.memory_by_case.values())
        spread = f"{by_case[0]:.3f} / {statistics.median(by_case):.3f} / {by_case[-1]:.3f}" if by_case else "-"
        lines.append(
            f"| {r.setup.label} | {r.setup.rate:.2f} | {r.memory_kept:.3f} | {spread} | {r.needle_relative:.0%} | "
            f"{r.forced_top1:.3f} | {r.forced_kl:.4f} | {r.rouge_l:.3f} | {r.perplexity:.2f} |"
        )
    if len(fixed) < 2:
        return lines
    lines += [
        "",
        "At equal mean bytes: each thresholds point against fixed-rate dynamic interpolated at its memory kept "
        "(thresholds / fixed rate; '-' where its memory lies outside the fixed rates measured).",
        "",
        "| setup | memory kept | needle | top-1 | KL | ROUGE-L | perplexity |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in swept:
        cells = []
        for attr in COMPARED:
            at = _interpolate(fixed, r.memory_kept, attr)
            form = "{:.0%}" if attr == "needle_relative" else "{:.4f}" if attr == "forced_kl" else "{:.3f}"
            cells.append("-" if at is None else f"{form.format(getattr(r, attr))} / {form.format(at)}")
        lines.append(f"| {r.setup.label} | {r.memory_kept:.3f} | " + " | ".join(cells) + " |")
    return lines


def _interpolate(fixed: list[Row], memory: float, attr: str) -> float | None:
    """`attr` of fixed-rate rows (sorted by memory) linearly interpolated at `memory`."""
    for low, high in itertools.pairwise(fixed):
        if low.memory_kept <= memory <= high.memory_kept:
            span = high.memory_kept - low.memory_kept
            weight = (memory - low.memory_kept) / span if span else 0.0
            return getattr(low, attr) + weight * (getattr(high, attr) - getattr(low, attr))
    return None


def plot_memory_by_case(rows: list[Row], path: Path) -> None:
    """Memory follows content: each request's memory kept, per thresholds setup and fixed rate."""
    plt = pyplot()
    shown = [r for r in rows if r.setup.thresholds or r.setup.label == RATE_ONLY]
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(shown) + 1.5))
    for i, r in enumerate(shown):
        values = list(r.memory_by_case.values())
        ax.plot(values, [i] * len(values), "o", alpha=0.6)
    ax.set_yticks(range(len(shown)), [f"{r.setup.label} @ {r.setup.rate:g}" for r in shown], fontsize=7)
    ax.set_xlabel("memory kept per request (compressed / uncompressed bytes)")
    ax.set_title("Memory per request: thresholds against a fixed rate", fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _threads(args) -> str:
    if args.peers and args.peers_after:
        return f"{args.threads} CPU threads, kvpress's presses after our setups"
    if args.peers:
        return f"{args.threads} CPU threads shared by our setups and kvpress's, which run at the same time"
    return f"{args.threads} CPU threads"


def _cell(row: Row, attr: str) -> str:
    value = getattr(row, attr)
    if value is None:
        return "-"
    shown = f"{value:.2f}" if attr == "perplexity" else f"{value:.0%}" if attr == "needle_relative" else f"{value:.3f}"
    shown = f"{value:.4f}" if attr == "forced_kl" else shown
    return f"{shown} ({_memory(row, attr):.2f})"


def _memory(row: Row, attr: str) -> float:
    return row.perplexity_memory_kept if attr == "perplexity" else row.memory_kept


def plot(rows: list[Row], key: str, path: Path) -> None:
    plt = pyplot()
    title, header, attr, higher = TASKS[key]
    fig, ax = plt.subplots(figsize=(8, 5))
    for label in dict.fromkeys(r.setup.label for r in rows if getattr(r, attr) is not None):
        points = sorted(
            (_memory(r, attr), getattr(r, attr))
            for r in rows
            if r.setup.label == label and getattr(r, attr) is not None
        )
        xs, ys = zip(*points, strict=True)
        ours = next(r for r in rows if r.setup.label == label).setup.source == "ours"
        style = ("o-" if ours else "x--") if len(points) > 1 else "s"
        ax.plot(xs, ys, style, label=label, linewidth=2.5 if label.startswith("dynamic") else 1.0)
    if attr == "perplexity":
        ax.set_yscale("log")
    ax.set_xlabel("memory kept (compressed / uncompressed bytes)")
    ax.set_ylabel(header + ("" if higher else " (lower is better)"))
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
