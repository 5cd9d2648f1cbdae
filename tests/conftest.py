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

from confkv.models.default_model import default_model_path  # noqa: E402
from confkv.models.loader import load_model  # noqa: E402
from tests.helpers import LiveServer, tiny_model  # noqa: E402

torch.set_num_threads(2)
# NOTE: a server on a model with no confidence for it (the tiny random ones) would fit one in a child
# process; the tests that are about that turn it on.
os.environ.setdefault("CONFKV_CALIBRATION__BACKGROUND", "false")


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


# Every test belongs to one tier, by its module unless it is marked with another (`pytest -m unit`;
# make test-fast). A module missing here fails collection: a new file chooses its tier.
TIERS = {
    "unit": (
        "test_allocator", "test_budget", "test_compression_worker", "test_detokenizer", "test_kv_store", "test_loader",
        "test_lru", "test_paged_attention", "test_readme_figures", "test_sampler", "test_scheduler", "test_schemas",
        "test_settings", "test_step_plan", "test_tiers_layers", "test_triton_kernels",
    ),
    "engine": (
        "test_async_compression", "test_calibration", "test_compression", "test_decode_step_benchmark", "test_engine",
        "test_engine_equivalence", "test_engine_faults", "test_fitting", "test_layer_budgets", "test_library",
        "test_lookahead", "test_policies", "test_predictor", "test_prefix_cache", "test_prompt_logprobs",
        "test_quality_benchmark", "test_random_weights", "test_spans", "test_thresholds",
    ),
    "server": (
        "test_app_faults", "test_bad_requests", "test_clients", "test_fuzz", "test_inspect", "test_middleware",
        "test_openai", "test_server", "test_tensor_parallel", "test_tokenizer_routes",
    ),
    "ops": (
        "test_cluster", "test_cluster_live", "test_cluster_serve", "test_deploy", "test_gpu_check",
        "test_inspect_page", "test_load", "test_prometheus", "test_wheel",
    ),
    "gpu": ("test_cuda",),
}  # fmt: skip
_TIER_OF = {module: tier for tier, modules in TIERS.items() for module in modules}


def pytest_configure(config: pytest.Config) -> None:
    for tier in TIERS:
        config.addinivalue_line("markers", f"{tier}: the {tier} tier of tests (tests/conftest.py, TIERS)")
    config.addinivalue_line(
        "markers", "refused(status): a client test that expects the server to refuse its requests with that status"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if any(item.get_closest_marker(tier) for tier in TIERS):
            continue
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module not in _TIER_OF:
            raise pytest.UsageError(f"{module} has no tier: add it to TIERS in tests/conftest.py")
        item.add_marker(_TIER_OF[module])
