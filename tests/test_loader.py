"""Which model folders the loader serves: every family it names, a clear refusal for the rest, and
the sliding window that bounds a model's context."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from confkv.models.loader import FAMILIES, attention_windows, load_model
from tests.helpers import TINY_CONFIGS

CPU = torch.device("cpu")


def folder_of(tmp_path, model_type: str, **fields):
    AutoConfig.for_model(model_type, **fields).save_pretrained(tmp_path)
    return tmp_path


def test_every_family_served_has_a_small_config_the_equivalence_tests_check():
    assert set(FAMILIES) == set(TINY_CONFIGS)


@pytest.mark.parametrize(
    ("model_type", "why"),
    [
        ("gemma2", "soft-caps the logits"),
        ("gemma3", "multimodal"),
        ("bert", "has not been checked against transformers' own forward"),
    ],
)
def test_a_family_not_served_is_refused_naming_why_and_the_families_served(tmp_path, model_type, why):
    with pytest.raises(ValueError) as refused:
        load_model(folder_of(tmp_path, model_type), CPU)
    message = str(refused.value)
    assert repr(model_type) in message and why in message
    assert all(name in message for name in ("Llama (llama)", "Qwen3-MoE (qwen3_moe)", "GPT-2 (gpt2)"))


def test_a_served_family_with_soft_capped_attention_is_refused(tmp_path):
    with pytest.raises(ValueError, match="soft-caps its attention logits"):
        load_model(folder_of(tmp_path, "gemma3_text", attn_logit_softcapping=50.0), CPU)


@pytest.mark.parametrize(
    ("model_type", "fields", "windows"),
    [
        ("llama", {}, [None, None]),
        ("mistral", {}, [4096, 4096]),  # Mistral slides on every layer when a window is set
        ("mistral", {"sliding_window": None}, [None, None]),
        ("qwen2", {}, [None, None]),  # its window is off unless use_sliding_window
        ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}, [None, 4096]),
        ("qwen3", {}, [None, None]),
        ("gemma3_text", {"sliding_window": 512, "sliding_window_pattern": 2}, [512, None]),
        ("phi3", {"sliding_window": 2047}, [2047, 2047]),
        ("gpt2", {}, [None, None]),
    ],
)
def test_each_layers_attention_window_is_read_from_the_config_of_each_family(model_type, fields, windows):
    config = AutoConfig.for_model(model_type, num_hidden_layers=2, n_layer=2, **fields)
    assert attention_windows(config) == windows
