"""vLLM's tokenizer routes on the live server, as lm-eval's remote tokenizer uses them."""

from __future__ import annotations

import httpx
import pytest

from confkv.models.default_model import FOLDER_NAME

pytestmark = pytest.mark.slow

TEXT = "The quick brown fox jumps over the lazy dog."
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=60)


def test_tokenize_and_detokenize_as_the_server_tokenizes(server, tokenizer):
    r = post(server, "/tokenize", {"prompt": TEXT, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tokenizer(TEXT).input_ids
    assert body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] > len(ids)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    r = post(server, "/detokenize", {"tokens": ids, "model": FOLDER_NAME})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids)}
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert "token_strs" not in chat


def test_tokenizer_info_is_what_a_remote_tokenizer_needs(server, tokenizer):
    info = httpx.get(f"{server.url}/tokenizer_info", timeout=60).json()
    assert info["eos_token"] == tokenizer.eos_token and info["bos_token"] == tokenizer.bos_token
    assert info["chat_template"] == tokenizer.chat_template and info["vocab_size"] == len(tokenizer)
    assert info["tokenizer_class"] == type(tokenizer).__name__


def test_lm_evals_remote_tokenizer_works_against_the_server(server, tokenizer):
    from lm_eval.utils import RemoteTokenizer, check_remote_tokenizer_support

    assert check_remote_tokenizer_support(f"{server.url}/v1/completions")
    remote = RemoteTokenizer(f"{server.url}/v1/completions")
    assert remote.encode(TEXT) == tokenizer(TEXT, add_special_tokens=False).input_ids
    assert remote.decode(remote.encode(TEXT)) == TEXT
    assert remote.eos_token_id == tokenizer.eos_token_id
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert remote.apply_chat_template(CHAT) == rendered


@pytest.mark.parametrize(
    ("route", "body", "status", "field"),
    [
        ("/tokenize", {"prompt": TEXT, "messages": CHAT}, 422, "body"),
        ("/tokenize", {}, 422, "body"),
        ("/tokenize", {"prompt": TEXT, "magic": 1}, 422, "magic"),
        ("/detokenize", {"tokens": [10**9]}, 422, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 422, "tokens.0"),
        ("/detokenize", {"tokens": [1], "model": "another-model"}, 404, None),
    ],
)
def test_bad_tokenizer_requests_name_the_field(server, route, body, status, field):
    r = post(server, route, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    if field is not None:
        assert field in error.get("fields", error.get("param", "")) or error["message"].startswith(field)
