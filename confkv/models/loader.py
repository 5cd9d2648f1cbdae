"""Load a causal language model and its tokenizer from a local Hugging Face folder."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from confkv.models.default_model import default_model_path
from confkv.models.random_weights import build_random_model, has_random_weights

log = logging.getLogger(__name__)

# Families whose attention modules go through transformers' AttentionInterface with a layer_idx,
# which is what the packed KV attention relies on.
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3", "gpt2"}


@dataclass(frozen=True)
class KVShape:
    """What one token's KV cache is made of, from a model's config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config) -> KVShape:
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        )


def load_model(
    path: Path | None, device: torch.device, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer from `path` (default: the embedded model), on `device`.

    `dtype` None means: fp32 on CPU, the checkpoint's own dtype elsewhere.
    """
    path = Path(path) if path is not None else default_model_path()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {config.model_type!r} is not supported; use one of {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else (getattr(config, "dtype", None) or torch.float32)
    if has_random_weights(path):
        log.info("building %s (%s) with random weights on %s as %s", path, config.model_type, device, dtype)
        model = build_random_model(path, device, dtype).eval()
    else:
        log.info("loading %s (%s) on %s as %s", path, config.model_type, device, dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def profile_forward(model: PreTrainedModel, num_tokens: int) -> None:
    """One forward pass of `num_tokens` tokens (the most a step runs, one logit row as the engine
    asks), so that the peak memory of activations is known before the KV budget is taken from what
    is left."""
    num_tokens = min(num_tokens, model.config.max_position_embeddings)
    ids = torch.zeros(1, num_tokens, dtype=torch.long, device=model.device)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False, logits_to_keep=1)
