"""Models of a named architecture with random weights: folders any model path takes, the same model
from the same seed, and the Llama-3.1-8B shape the GPU figures use."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from confkv.models.loader import KVShape, load_model
from confkv.models.random_weights import ARCHITECTURES, MARKER, write_random_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(default_path, tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("random")
    made = {}
    for seed in (0, 1):
        made[seed] = root / f"seed-{seed}"
        write_random_model("SmolLM2-135M-Instruct", made[seed], default_path, seed)
    made["8b"] = root / "llama-8b"
    write_random_model("Llama-3.1-8B", made["8b"], default_path)
    return made


def test_a_seed_gives_the_same_model_and_another_seed_another(folders):
    first, _ = load_model(folders[0], CPU)
    again, tokenizer = load_model(folders[0], CPU)
    other, _ = load_model(folders[1], CPU)
    assert not any(path.suffix == ".safetensors" for path in folders[0].iterdir())  # nothing read: drawn
    weights = [model.state_dict() for model in (first, again, other)]
    assert all(torch.equal(weights[0][name], weights[1][name]) for name in weights[0])
    assert not torch.equal(weights[0]["model.embed_tokens.weight"], weights[2]["model.embed_tokens.weight"])
    ids = torch.tensor([tokenizer.encode("The capital of France is")])
    logits = first(ids).logits[0, -1]
    assert torch.isfinite(logits).all() and logits.std() > 0.1  # a working model, not a constant


def test_the_embedded_architecture_keeps_the_embedded_models_shape_and_tokenizer(folders, default_path):
    ours, embedded = (AutoConfig.from_pretrained(path) for path in (folders[0], default_path))
    assert KVShape.of(ours) == KVShape.of(embedded) and ours.vocab_size == embedded.vocab_size
    assert json.loads((folders[0] / MARKER).read_text()) == {"architecture": "SmolLM2-135M-Instruct", "seed": 0}


def test_the_8b_shape_is_llama_3_1_8b(folders):
    config = AutoConfig.from_pretrained(folders["8b"])
    assert KVShape.of(config) == KVShape(num_layers=32, num_kv_heads=8, head_dim=128)
    assert config.dtype == torch.bfloat16 and config.rope_parameters["rope_type"] == "llama3"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9


def test_an_unknown_architecture_is_refused_naming_the_known_ones(default_path, tmp_path):
    with pytest.raises(ValueError, match="unknown architecture 'gpt-5'.*Llama-3.1-8B"):
        write_random_model("gpt-5", tmp_path / "x", default_path)
    assert set(ARCHITECTURES) == {"SmolLM2-135M-Instruct", "Llama-3.1-8B"}
