"""Property tests for the request models: any JSON either validates or is refused cleanly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from confkv.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from confkv.server.schemas import GenerateRequest

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "prompt", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
    "stream", "timeout", "compression", "compression_stats", "model", "n", "logprobs", "top_logprobs",
]  # fmt: skip


@pytest.mark.parametrize("model", [GenerateRequest, CompletionRequest, ChatCompletionRequest])
@settings(max_examples=300, deadline=None)
@given(body=st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), json_values, max_size=6))
def test_any_json_object_validates_or_is_refused_with_a_validation_error(model, body):
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        assert exc.errors(), "a refusal names what is wrong"
        return
    assert model.model_validate(request.model_dump()) == request  # what is accepted round-trips


@settings(max_examples=200, deadline=None)
@given(
    prompt=st.text(min_size=1, max_size=50),
    max_tokens=st.integers(1, 10_000),
    temperature=st.floats(0, 10),
    top_p=st.floats(0, 1, exclude_min=True),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=16),
)
def test_every_valid_generate_request_is_accepted(prompt, max_tokens, temperature, top_p, stop):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "stop": stop}
    request = GenerateRequest.model_validate(body)
    assert (request.prompt, request.max_tokens, request.stop) == (prompt, max_tokens, stop)
