"""The ecosystem's clients, unchanged, against the live server: LangChain's ChatOpenAI, LiteLLM,
lm-eval's local-completions and local-chat-completions, and guidellm. Each is installed from PyPI at
the version pyproject pins; none of their requests may be refused or have a field ignored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from confkv.models.default_model import FOLDER_NAME
from tests.helpers import ROOT, LiveServer

pytestmark = pytest.mark.slow

MODEL = FOLDER_NAME  # the server is started with --model-path: the model is named after its folder
QUESTION = "Name three colours of the rainbow."
# Documents of each local lm-eval task compared with transformers: 12 of the 44 questions (4 requests each), the
# 3 paragraphs.
LM_EVAL_LIMIT = 12
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


@pytest.fixture(autouse=True)
def nothing_refused_or_ignored(server, request):
    """Every request a client sends in a test is answered 200 and has no field ignored, but the
    refusals a test marks as its subject (`@pytest.mark.refused("404")`)."""
    marker = request.node.get_closest_marker("refused")
    expected = set(marker.args) if marker else set()
    before, ignored_before = _requests_by_status(server.url), _ignored(server.url)
    yield
    after = _requests_by_status(server.url)
    refused = {status: n - before.get(status, 0) for status, n in after.items() if status.isdigit()}
    unexpected = {status: n for status, n in refused.items() if n and status not in expected}
    assert not unexpected, f"requests refused: {refused}"
    assert _ignored(server.url) == ignored_before, "a client sent a field this server ignored"


def _ignored(url: str) -> list[str]:
    return [line for line in httpx.get(f"{url}/metrics").text.splitlines() if "ignored_fields_total{" in line]


def _requests_by_status(url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("requests_total{"):
            labels, value = line.rsplit(" ", 1)
            counts[labels.split('"')[1]] = float(value)
    return counts


def test_langchain_chat_openai_invokes_and_streams(server):
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_tokens=8, temperature=0, max_retries=0
    )
    answer = chat.invoke(QUESTION)
    assert answer.content and answer.response_metadata["finish_reason"] == "length"
    assert answer.usage_metadata["output_tokens"] == 8 and answer.usage_metadata["input_tokens"] > 8
    chunks = list(chat.stream(QUESTION))
    assert "".join(chunk.content for chunk in chunks) == answer.content  # greedy: the same answer
    assert [c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata] == [8]


def test_litellm_completion_streams_and_text_completion(server, monkeypatch):
    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    import litellm

    where = {"model": f"openai/{MODEL}", "api_base": f"{server.url}/v1", "api_key": "unused", "temperature": 0}
    messages = [{"role": "user", "content": QUESTION}]
    answer = litellm.completion(messages=messages, max_tokens=8, **where)
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 8
    stream = litellm.completion(
        messages=messages, max_tokens=8, stream=True, stream_options={"include_usage": True}, **where
    )
    parts = list(stream)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == answer.choices[0].message.content
    assert parts[-1].usage.completion_tokens == 8
    text = litellm.text_completion(prompt="One, two, three,", max_tokens=5, **where)
    assert text.choices[0].text.strip()


@pytest.fixture(scope="module")
def sums_task(tmp_path_factory) -> Path:
    """A generate_until task of lm-eval's, from a local file (nothing downloaded)."""
    folder = tmp_path_factory.mktemp("lm-eval-task")
    rows = [{"question": f"{a} plus {b} equals", "answer": str(a + b)} for a, b in ((1, 1), (2, 3), (4, 4), (5, 2))]
    (folder / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "sums.yaml").write_text(
        "task: confkv_sums\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder / 'data.jsonl'}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 8\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder


@pytest.mark.parametrize(
    ("model", "route", "flags"),
    [
        # Completions: text in (lm-eval's tokenizer, a local folder, only counts tokens).
        ("local-completions", "completions", []),
        ("local-chat-completions", "chat/completions", ["--apply_chat_template"]),
    ],
)
def test_lm_eval_runs_a_task_through_the_openai_routes(server, default_path, sums_task, tmp_path, model, route, flags):
    args = f"model={MODEL},base_url={server.url}/v1/{route},num_concurrent=2,max_retries=1"
    if model == "local-completions":
        args += f",tokenizer={default_path},tokenized_requests=False"
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", args, "--tasks", "confkv_sums"]
        + ["--include_path", str(sums_task), "--output_path", str(tmp_path), "--log_samples", *flags],
        cwd=ROOT,
        env={**os.environ, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    samples = [json.loads(line) for path in tmp_path.rglob("samples_confkv_sums_*.jsonl") for line in path.open()]
    assert len(samples) == 4 and all(sample["resps"][0][0].strip() for sample in samples)
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())
    assert 0.0 <= results["results"]["confkv_sums"]["exact_match,none"] <= 1.0


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_benchmarks_the_server(server, default_path, tmp_path, route):
    """`guidellm run` as its users run it: synthetic prompts, a concurrent profile, a request limit.
    It streams with vLLM's `continuous_usage_stats` and counts tokens from the server's usage."""
    benchmarks = _guidellm(server.url, MODEL, route, 2, 6, 64, 16, default_path, tmp_path)
    metrics = benchmarks[0]["metrics"]
    done = metrics["request_totals"]["successful"]  # guidellm may cancel what is in flight at its limit
    assert done >= 6 - 2 and metrics["request_totals"]["errored"] == 0
    assert metrics["output_token_count"]["successful"]["total_sum"] == done * 16
    assert metrics["prompt_token_count"]["successful"]["total_sum"] >= done * 64


def _guidellm(
    url: str, model: str, route: str, streams: int, count: int, prompt: int, output: int, tokenizer, tmp_path: Path
) -> list[dict]:
    """`guidellm run` as its users run it (a concurrent profile, a request limit, synthetic prompts of
    `prompt` tokens asking `output`): the benchmarks of its JSON report."""
    report = tmp_path / "guidellm.json"
    run = subprocess.run(
        [str(Path(sys.executable).with_name("guidellm")), "run", "--disable-console-interactive"]
        + ["--backend", f"kind=openai_http,target={url},model={model},request_format={route}"]
        + ["--profile", f"kind=concurrent,streams={streams}", "--constraint", f"kind=max_requests,count={count}"]
        + ["--data", f"kind=synthetic_text,prompt_tokens={prompt},output_tokens={output}"]
        + ["--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--output", f"kind=json,path={report}"],
        cwd=tmp_path,
        env={**os.environ, **OFFLINE},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(report.read_text())["benchmarks"]


@pytest.mark.parametrize("index", range(3))
def test_vllm_benchmark_clients_requests_replayed(server, index):
    """vLLM's serving benchmark client does not install without vLLM's engine: its request shapes,
    recorded from its source, replayed and read as it reads them (SSE `data:` lines, `:` pings
    skipped, TTFT from the first chunk with choices, output tokens from the usage chunk)."""
    fixture = json.loads((ROOT / "tests" / "fixtures" / "vllm_bench_requests.json").read_text())
    request = fixture["requests"][index]
    body = _filled(request["body"], {"MODEL": MODEL, "PROMPT": "Tell me about the sea. " * 20, "OUTPUT_LEN": 12})
    chunks, usage = [], None
    with httpx.stream(
        "POST", f"{server.url}{request['route']}", json=body, headers=fixture["headers"], timeout=120
    ) as response:
        assert response.status_code == 200 and "x-ignored-fields" not in response.headers
        for line in response.iter_lines():
            if not line or line.startswith(":"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if event.get("choices"):
                chunks.append(event["choices"][0])
            elif event.get("usage"):
                usage = event["usage"]
    assert chunks, "never a chunk with choices: vLLM's client marks the request failed"
    assert usage["completion_tokens"] == 12  # ignore_eos: every requested token


def _filled(value: object, values: dict) -> object:
    """`value` with every string that names a placeholder replaced by its value, at any depth."""
    if isinstance(value, dict):
        return {key: _filled(item, values) for key, item in value.items()}
    if isinstance(value, list):
        return [_filled(item, values) for item in value]
    return values.get(value, value) if isinstance(value, str) else value


def test_the_guidellm_benchmark_compares_both_modes_at_one_budget(tmp_path):
    """`make bench-guidellm` in a few requests: both modes measured by guidellm, saved with a plot."""
    out = tmp_path / "serving_guidellm"
    run = subprocess.run(
        [sys.executable, "benchmarks/serving_guidellm/run.py", "--streams", "2", "--requests", "2"]
        + ["--prompt-tokens", "32", "--max-tokens", "4", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    results = json.loads(out.with_suffix(".json").read_text())["results"]
    assert set(results) == {"compression off", "dynamic 0.6"}
    for rows in results.values():  # guidellm may cancel what is in flight at its request limit
        done = rows["2"]["successful"]
        assert done >= 1 and rows["2"]["errored"] == 0 and rows["2"]["output_tokens"] == done * 4
    assert out.with_suffix(".png").stat().st_size > 0


@pytest.mark.refused("404")
def test_the_guidellm_benchmark_says_what_failed(server, default_path, tmp_path):
    """When guidellm's requests fail, the benchmark stops naming guidellm's own errors (read from its
    report): here every request names a model the server does not serve."""
    from benchmarks.serving_guidellm.run import errors

    benchmarks = _guidellm(server.url, "no-such-model", "/v1/completions", 1, 2, 16, 4, default_path, tmp_path)
    assert benchmarks[0]["metrics"]["request_totals"]["errored"] >= 1
    found = errors(benchmarks)
    assert found and all("404" in error for error in found), found


def test_ruler_benchmark_scores_a_needle_through_local_completions(server, tmp_path, monkeypatch):
    """`make bench-ruler`'s path on one case: lm-eval's own RULER task, built offline at 4k tokens,
    answered through /v1/completions, with the bytes the server kept read from its /metrics."""
    from argparse import Namespace

    from benchmarks.ruler.run import run_length

    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    args = Namespace(tasks=["niah_single_1", "exact_uuid_prose"], limit=1, concurrent=1, model_path=None, seed=3)
    row = run_length(server.url, 4096, args, tmp_path)
    assert 0.0 <= row["scores"]["niah_single_1"] <= 1.0
    assert row["scores"]["exact_uuid_prose"] + row["partial"]["exact_uuid_prose"] in (0.0, 1.0)  # exact, partial, miss
    assert set(row["partial"]) == {"exact_uuid_prose"}  # RULER's own tasks are not scored for partial copies
    assert 0.0 < row["bytes_kept"] < 0.5  # the server compresses by default: its kept bytes, not a default of 1


def test_an_exact_value_copied_in_part_is_told_apart_from_a_miss(tokenizer):
    """The exact-value tasks' verdicts, and cases that fill their length with the needle inside."""
    from benchmarks.ruler.exact_values.utils import case, judge

    assert judge("9746862", " 9746862.") == "exact"
    assert judge("9746862", "974862") == "partial"  # a digit lost from the middle, as eviction leaves it
    assert judge("9746862", "the grass is green") == "miss"
    assert judge("Ottoline Hultav-Quilhul", "ottoline hultav-quilhul") == "exact"
    doc = case("number", "prose", 4096, 0, 5, tokenizer)
    assert doc["outputs"] in doc["input"] and 7 <= len(doc["outputs"]) <= 10
    assert 3500 < len(tokenizer(doc["input"]).input_ids) <= 4096 - 32


def test_lm_eval_scores_likelihoods_through_the_server_as_transformers_does(default_path, tmp_path):
    """lm-eval's `loglikelihood` (multiple choice) and `loglikelihood_rolling` (perplexity) requests, unchanged,
    through /v1/completions (echo, logprobs 1, max_tokens 1) with the server's own tokenizer routes, which
    lm-eval finds by itself: with compression off (the prompt's KV at the model's dtype) every request's
    log-likelihood is transformers' own on the same model."""
    from benchmarks.lm_eval.run import SETUPS, compare, run_lm_eval
    from benchmarks.lm_eval.tasks import write_tasks

    tasks = write_tasks(tmp_path / "tasks")
    off = LiveServer("--model-path", str(default_path), *SETUPS["compression off"])
    try:
        args = f"model={MODEL},base_url={off.url}/v1/completions,num_concurrent=2,max_retries=1"
        through = run_lm_eval("local-completions", args, tasks, tmp_path / "server", timeout=600, limit=LM_EVAL_LIMIT)
        statuses = _requests_by_status(off.url)
        # By how each ended: every request answered, none refused (a refusal counts under its HTTP status).
        assert not any(status.isdigit() for status in statuses), statuses
        assert sum(statuses.values()) == LM_EVAL_LIMIT * 4 + 3, statuses
        assert _ignored(off.url) == []  # nor a field ignored
    finally:
        off.stop()
    local = run_lm_eval("hf", f"pretrained={default_path},dtype=float32", tasks, tmp_path / "hf", 600, LM_EVAL_LIMIT)
    rows = compare(local, {"off": through})
    assert rows["confkv_choices"]["requests"] == LM_EVAL_LIMIT * 4 and rows["confkv_text"]["requests"] == 3
    for row in rows.values():
        # Sums of a few to 150 token log-probabilities, each within fp32's reordering of transformers' own.
        assert row["max_loglikelihood_difference"]["off"] < 1e-2, row
    text = rows["confkv_text"]
    assert text["server"]["off"]["word_perplexity"] == pytest.approx(text["transformers"]["word_perplexity"], rel=1e-3)
