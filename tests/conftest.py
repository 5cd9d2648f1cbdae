from __future__ import annotations

import os

import torch

# Without a GPU the Triton kernels' tests run them on CPU tensors under Triton's interpreter. Triton reads
# the variable when a function is decorated, its own library's included, and transformers' models import
# triton: so it is set before those (torch alone does not import triton). With a GPU they are compiled.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from models.default_model import default_model_path  # noqa: E402
from models.loader import load_model  # noqa: E402
from tests.helpers import LiveServer, tiny_model  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def default_path():
    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer(default_path):
    return AutoTokenizer.from_pretrained(default_path)


@pytest.fixture(scope="session")
def default_model(default_path):
    model, _ = load_model(default_path, torch.device("cpu"))
    return model


@pytest.fixture(scope="session")
def server(default_path):
    """The real server on loopback with the default model, shared by the live tests."""
    srv = LiveServer("--model-path", str(default_path), "--max-cache-size", "256", "--max-num-seqs", "8")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A small random llama with the default tokenizer, saved where a server can load it."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
