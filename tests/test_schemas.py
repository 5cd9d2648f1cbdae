"""Property tests for the request models: any JSON either validates or is refused cleanly."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from confkv.compress.config import CompressionConfig, resolve
from confkv.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from confkv.server.schemas import GenerateRequest
from tests.strategies import compression_options, sampling_options

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
    sampling=sampling_options(),
    compression=compression_options(),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=16),
)
def test_every_request_within_the_declared_ranges_is_accepted_by_both_routes(prompt, sampling, compression, stop):
    body = {"prompt": prompt, "stop": stop, "compression": compression, **sampling}
    request = GenerateRequest.model_validate(body)
    assert (request.prompt, request.max_tokens, request.stop) == (prompt, sampling.get("max_tokens"), stop)
    assert CompletionRequest.model_validate({**body, "model": "m"}).temperature == request.temperature
    # and laid over the server's config it stays valid: nothing the schema takes is refused later
    resolve(CompressionConfig(), compression, server_enabled=True, stats=False)


@pytest.mark.parametrize("route", [GenerateRequest, CompletionRequest])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e400])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "timeout", "repetition_penalty"])
def test_numbers_json_cannot_hold_are_refused_naming_the_field(route, value, field):
    with pytest.raises(ValidationError) as refused:
        route.model_validate({"prompt": "a", "model": "m", field: value} if route is CompletionRequest else
                             {"prompt": "a", field: value})  # fmt: skip
    assert [e["loc"] for e in refused.value.errors()] == [(field,)]
