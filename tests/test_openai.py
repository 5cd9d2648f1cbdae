"""The OpenAI-compatible routes, driven by the official `openai` client against the live server."""

from __future__ import annotations

import contextlib
import time

import httpx
import openai
import pytest

from confkv.models.default_model import FOLDER_NAME

pytestmark = pytest.mark.slow

MODEL = FOLDER_NAME  # the server is started with --model-path: the model is named after its folder
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
# Long enough for the prefix cache, which always leaves the last 32 prompt tokens (what compression observes).
LONG_QUESTION = [
    {
        "role": "user",
        "content": "A rainbow forms when sunlight enters raindrops, bends, reflects off the back of each drop and "
        "bends again on the way out, so that every colour leaves at its own angle. Name three colours of the rainbow.",
    }
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def generate(server, body: dict) -> dict:
    r = httpx.post(f"{server.url}/generate", json={"temperature": 0, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "conf-kv"


def test_completion_matches_generate(client, server, tokenizer):
    want = generate(server, {"prompt": "The capital of France is", "max_tokens": 12, "stop": ["\n\n"]})
    got = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0, stop="\n\n"
    )
    assert got.object == "text_completion" and got.id.startswith("cmpl-")
    assert got.choices[0].text == want["text"]
    assert got.choices[0].finish_reason == want["finish_reason"]
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    assert got.usage.completion_tokens == want["usage"]["completion_tokens"]
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    # The same prompt as token ids gives the same text.
    ids = tokenizer("The capital of France is").input_ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop="\n\n")
    assert by_ids.choices[0].text == want["text"]


def test_chat_matches_generate_sync_and_streaming(client, server):
    want = generate(server, {"messages": LONG_QUESTION, "max_tokens": 24})
    got = client.chat.completions.create(model=MODEL, messages=LONG_QUESTION, max_completion_tokens=24, temperature=0)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    assert got.usage.prompt_tokens == want["usage"]["prompt_tokens"]
    # /generate just ran the same prompt: the prefix cache serves all of it but the last 32 tokens.
    assert got.usage.prompt_tokens_details.cached_tokens == got.usage.prompt_tokens - 32

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=LONG_QUESTION,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want["text"]
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [c.choices[0].finish_reason for c in finishing] == [want["finish_reason"]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == want["usage"]["completion_tokens"]
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream(client):
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_compression_extensions_pass_as_extra_body(client, server):
    extra = {"compression": {"policy": "h2o", "compression_rate": 0.5}, "compression_stats": True}
    got = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, extra_body=extra)
    metrics = got.model_extra["compression_metrics"]
    assert metrics["policy"] == "h2o" and metrics["original_size"] > 0
    # Streaming: on the last chunk before [DONE] only.
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=16, temperature=0, stream=True, extra_body=extra
        )
    )
    assert chunks[-1].model_extra["compression_metrics"]["policy"] == "h2o"
    assert not any("compression_metrics" in (c.model_extra or {}) for c in chunks[:-1])
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, temperature=0)
    assert "compression_metrics" not in (plain.model_extra or {})


def test_logprobs_chat_and_completion(client):
    got = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert entry.token == entry.top_logprobs[0].token  # greedy takes the most likely token
        assert entry.logprob == pytest.approx(values[0])
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    completion = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=5, temperature=0, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == completion.choices[0].text
    assert logprobs.text_offset[0] == 0 and all(len(t) == 2 for t in logprobs.top_logprobs)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 2}, "n"),
        ({"temperature": 3.0}, "temperature"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"extra_body": {"compression": {"policy": "magic"}}}, "compression.policy"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role"),
        ({"top_logprobs": 2}, "body"),
        ({"max_tokens": 2, "extra_body": {"min_tokens": 5}}, "min_tokens"),  # valid alone, not together
    ],
)
def test_bad_chat_requests_get_openai_errors_naming_the_field(client, kwargs, param):
    request = {"model": MODEL, "messages": QUESTION, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**request)
    error = caught.value.body
    assert caught.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param.split(".")[-1] in error["message"] or param == "body"


def test_fields_nobody_defines_are_ignored_and_reported(client, server):
    """A field this server does not know (a newer client's, vLLM's `guided_json`, a typo) never fails a
    request, as vLLM ignores it; the response names it, and a counter counts it. Our own extension
    objects stay strict."""
    with contextlib.suppress(KeyError):  # not exported before its first count
        before = 0.0
        before = server.metric("openai_ignored_fields_total", '{field="guided_json"}')
    got = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi", "tool_calls": None}],
        max_tokens=2,
        extra_body={"guided_json": {"type": "object"}, "stream_options": None, "priority": 1},
    )
    assert got.status_code == 200 and got.parse().choices[0].finish_reason == "length"
    assert got.headers["x-ignored-fields"] == "guided_json, messages.tool_calls, priority"
    assert server.metric("openai_ignored_fields_total", '{field="guided_json"}') == before + 1
    known = client.completions.with_raw_response.create(model=MODEL, prompt="One,", max_tokens=2)
    assert "x-ignored-fields" not in known.headers
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="One,", max_tokens=2, extra_body={"compression": {"rat": 0.5}})
    assert caught.value.body["param"] == "compression.rat"


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    """vLLM's extension, which guidellm sends: usage so far on every chunk, then the usage chunk."""
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="One, two, three,",
            max_tokens=6,
            temperature=0,
            stream=True,
            extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        )
    )
    content, last = [c for c in chunks if c.choices], chunks[-1]
    assert not last.choices and last.usage.completion_tokens == 6
    counts = [c.usage.completion_tokens for c in content]
    assert (
        counts == sorted(counts)
        and counts[-1] == 6
        and all(c.usage.prompt_tokens == last.usage.prompt_tokens for c in content)
    )
    plain = list(
        client.completions.create(
            model=MODEL, prompt="One,", max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.usage is None for c in plain if c.choices) and plain[-1].usage.completion_tokens == 3


def test_vllm_sampling_extensions_are_honoured(client):
    """vLLM's extra sampling fields, as its clients send them (lm-eval, guidellm): each changes the
    answer as vLLM's does, none is ignored."""
    prompt = "One, two, three, four, five,"
    plain = client.completions.with_raw_response.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    text = plain.parse().choices[0].text
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + text
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == prompt + text
    stop = text.strip().split()[1]  # a word of the greedy answer
    kept = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    )  # fmt: skip
    assert kept.choices[0].text.endswith(stop) and kept.choices[0].finish_reason == "stop"
    shaped = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3, "min_tokens": 8, "stop_token_ids": [2],
                    "skip_special_tokens": False},
    )  # fmt: skip
    assert "x-ignored-fields" not in shaped.headers
    assert shaped.parse().usage.completion_tokens == 8
    assert shaped.parse().choices[0].text != text  # the penalty moves greedy decoding off its repeats


def test_unknown_model_and_oversized_prompts(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4", messages=QUESTION)
    assert caught.value.body["code"] == "model_not_found" and MODEL in caught.value.body["message"]
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt="word " * 9000, max_tokens=4)
    assert caught.value.status_code == 413
    assert caught.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[10**7], max_tokens=4)
    assert caught.value.body["param"] == "prompt" and "vocabulary" in caught.value.body["message"]


def test_stream_client_going_away_gives_memory_back(client, server):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count from 1 to 1000."}],
        max_tokens=400,
        temperature=0,
        stream=True,
    )
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while server.metric("kv_cache_bytes", '{pool="running"}') != 0.0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server.metric("kv_cache_bytes", '{pool="running"}') == 0.0
    assert server.metric("requests_running") == 0


SCORED = "The capital of France is Paris, and the capital of Italy is Rome."
# The prompt's KV at the model's dtype: its log-probabilities are then the model's own (the server stores
# int8 as shipped, and they are the model's over an int8 cache).
MODEL_DTYPE = {"compression": {"kv_cache_dtype": "auto"}}


def prompt_reference(model, ids: list[int]):
    """transformers' log-probability of each prompt token after the first, at fp32."""
    import torch

    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, tokenizer, default_model):
    """lm-eval's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1. The prompt's tokens come
    first, the first without a log-probability, then the generated one."""
    ids = tokenizer(SCORED).input_ids
    got = client.completions.create(
        model=MODEL, prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0, extra_body=MODEL_DTYPE
    )
    choice = got.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1 == len(logprobs.token_logprobs) == len(logprobs.top_logprobs)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert logprobs.token_logprobs[1 : len(ids)] == pytest.approx(prompt_reference(default_model, ids), abs=1e-4)
    assert all(
        len(top) == 1 and max(top.values()) >= lp - 1e-6
        for top, lp in zip(logprobs.top_logprobs[1:], logprobs.token_logprobs[1:], strict=True)
    )
    assert choice.text.startswith(tokenizer.decode(ids)) and len(choice.text) > len(tokenizer.decode(ids))
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 1


def test_max_tokens_zero_with_echo_returns_the_prompt_alone(client, tokenizer):
    got = client.completions.create(model=MODEL, prompt=SCORED, echo=True, max_tokens=0, temperature=0, logprobs=0)
    choice = got.choices[0]
    assert choice.text == SCORED and choice.finish_reason == "length" and got.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == got.usage.prompt_tokens and choice.logprobs.top_logprobs[1] == {}
    plain = client.completions.create(model=MODEL, prompt=SCORED, echo=True, max_tokens=0)
    assert plain.choices[0].text == SCORED and plain.choices[0].logprobs is None


def test_vllms_prompt_logprobs_on_every_route(client, server, tokenizer, default_model):
    """vLLM's `prompt_logprobs`: per prompt token, by token id, its log-probability, rank and text, with the
    likeliest tokens; on /v1/completions (a choice's), /v1/chat/completions (the response's) and /generate."""
    ids = tokenizer(SCORED).input_ids
    want = prompt_reference(default_model, ids)
    completion = client.completions.create(
        model=MODEL, prompt=SCORED, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2, **MODEL_DTYPE}
    )
    entries = completion.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry, value in zip(ids[1:], entries[1:], want, strict=True):
        assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
        assert 2 <= len(entry) <= 3 and {e["rank"] for e in entry.values()} >= {1, 2}
    generated = generate(server, {"prompt": SCORED, "max_tokens": 0, "prompt_logprobs": 0})
    assert generated["text"] == "" and generated["finish_reason"] == "length"
    assert [list(e) for e in generated["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 0}
    )
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_a_streamed_echo_carries_the_prompts_logprobs_first(client, tokenizer):
    ids = tokenizer(SCORED).input_ids
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=SCORED, echo=True, logprobs=1, max_tokens=3, temperature=0, stream=True
        )
    )
    first = chunks[0].choices[0]
    assert first.text.startswith(SCORED) and first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.tokens) == len(ids) + 1  # the prompt, then the first generated token
    whole = client.completions.create(model=MODEL, prompt=SCORED, echo=True, logprobs=1, max_tokens=3, temperature=0)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_bad_scoring_requests_name_the_field(client, kwargs, param):
    request = {"model": MODEL, "prompt": SCORED, "echo": True, "max_tokens": 0, **kwargs}
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(**request)
    assert caught.value.body["param"] == param


def test_prompt_logprobs_on_a_chat_stream_are_refused(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert "prompt_logprobs" in caught.value.body["message"]
