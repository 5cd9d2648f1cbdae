"""Models of a named architecture with random weights: what runs where real weights cannot travel.

Speed does not depend on the weights' values, and two devices compared on the same random model
must agree as they would on a trained one, so a machine without the checkpoint (a GPU machine
offline, say) can still run every code path at a real model's shape. A random-weight model is a
folder like any other model folder (config.json and a tokenizer) plus `random_weights.json`, which
says its seed; `load_model` builds it from its config (`from_config`, seeded) instead of reading
weights, so the server and the benchmarks take it by `--model-path` unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from confkv.models.default_model import MODEL_NAME, cache_dir, default_model_path

MARKER = "random_weights.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# Each architecture: the config's fields over the embedded model's own (the tokenizer is always the
# embedded model's, so its special tokens stay valid; a larger vocabulary only adds ids it never decodes).
ARCHITECTURES: dict[str, dict] = {
    MODEL_NAME: {},
    "Llama-3.1-8B": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    },
}


def random_model_path(architecture: str, seed: int = 0) -> Path:
    """The folder of `architecture` with random weights from `seed`, written on first use (next to
    the converted models, from the embedded model's config and tokenizer)."""
    folder = cache_dir() / f"{architecture}-random-{seed}"
    if not (folder / MARKER).is_file():
        write_random_model(architecture, folder, default_model_path(), seed)
    return folder


def write_random_model(architecture: str, folder: Path, source: Path, seed: int = 0) -> None:
    """Write `architecture`'s random-weight folder: `source`'s config with the architecture's fields
    over it, `source`'s tokenizer, and the marker with `seed`. No weights: they are drawn at load."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; choose one of {sorted(ARCHITECTURES)}")
    config = json.loads((source / "config.json").read_text())
    config.update(ARCHITECTURES[architecture])
    for name in ("quantization_config", "_model_name_or_path"):
        config.pop(name, None)
    partial = folder.with_name(folder.name + ".partial")
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, partial / name)
    (partial / MARKER).write_text(json.dumps({"architecture": architecture, "seed": seed}))
    if folder.exists():
        shutil.rmtree(folder)
    partial.rename(folder)  # last, so that a half-written folder is never taken for a model


def has_random_weights(path: Path) -> bool:
    return (path / MARKER).is_file()


def build_random_model(path: Path, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """The model of the folder at `path` with weights drawn from its seed, on `device` in `dtype`.

    The weights are drawn on `device` itself (on the CPU a model of billions of parameters would
    take minutes), so one seed gives the same model on every run on one kind of device but another
    on each kind: to compare devices on one model, build it on the CPU and move a copy.
    """
    seed = json.loads((path / MARKER).read_text())["seed"]
    config = AutoConfig.from_pretrained(path)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
