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

# Families (config `model_type`) whose attention modules go through transformers' AttentionInterface
# with a layer_idx and ask nothing of it that the packed KV attention does not do; each is checked
# against transformers' own forward (tests/test_engine_equivalence.py). Their MLPs, mixtures of
# experts included, are transformers' own.
FAMILIES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "mixtral": "Mixtral (MoE)",
    "qwen2": "Qwen2",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3": "Qwen3",
    "qwen3_moe": "Qwen3-MoE",
    "phi3": "Phi-3",
    "granite": "Granite",
    "olmo2": "OLMo 2",
    "gemma3_text": "Gemma 3 (text)",
    "gpt2": "GPT-2",
}
# Families people ask for that are refused, and why.
REFUSED_FAMILIES = {
    "gemma2": "its attention soft-caps the logits, which the packed KV attention does not do",
    "gemma3": "it is multimodal; serve its language model (a folder whose model_type is gemma3_text)",
    "gpt_oss": "its attention adds learned sinks, which the packed KV attention does not do",
    "deepseek_v3": "its attention (multi-head latent attention) caches a latent, not keys and values per head",
}


def check_family(config) -> None:
    """Raise ValueError, naming why and the families served, unless the packed KV attention serves
    this model exactly."""
    family = config.model_type
    served = ", ".join(f"{name} ({key})" for key, name in FAMILIES.items())
    if family not in FAMILIES:
        why = REFUSED_FAMILIES.get(family, "it has not been checked against transformers' own forward")
        raise ValueError(f"model type {family!r} is not supported: {why}. Supported families: {served}")
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"this {FAMILIES[family]} model soft-caps its attention logits, which is not supported")


def attention_windows(config) -> list[int | None]:
    """How far back each layer attends: its sliding window, or None for the whole context. (A config
    with `layer_types` says which layers slide; Mistral's and Phi-3's have none and slide on every
    layer when `sliding_window` is set.)"""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if not window:
        return [None] * config.num_hidden_layers
    if layer_types is None:
        return [int(window)] * config.num_hidden_layers
    return [int(window) if kind == "sliding_attention" else None for kind in layer_types]


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

    def per_rank(self, tensor_parallel_size: int) -> KVShape:
        """What one rank holds when the heads are split over `tensor_parallel_size` ranks."""
        return KVShape(self.num_layers, self.num_kv_heads // tensor_parallel_size, self.head_dim)


def load_model(
    path: Path | None, device: torch.device, dtype: torch.dtype | None = None, tensor_parallel_size: int = 1
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load model and tokenizer from `path` (default: the embedded model), on `device`.

    `dtype` None means: fp32 on CPU, the checkpoint's own dtype elsewhere. With a
    `tensor_parallel_size` above 1 the process must have joined its rank group (`parallel.join`):
    this rank's share of the weights is loaded, by the family's tensor-parallel plan.
    """
    path = Path(path) if path is not None else default_model_path()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
    config = AutoConfig.from_pretrained(path)
    check_family(config)
    windows = attention_windows(config)
    if any(windows):
        log.info(
            "%s has sliding-window attention (%d of %d layers, %d tokens): those layers hold only their window, "
            "and compression leaves them whole",
            path.name,
            sum(w is not None for w in windows),
            len(windows),
            max(w for w in windows if w),
        )
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else (getattr(config, "dtype", None) or torch.float32)
    if tensor_parallel_size > 1:
        log.info(
            "loading %s (%s) on %s as %s, its share of %d ranks",
            path,
            config.model_type,
            device,
            dtype,
            tensor_parallel_size,
        )
        from transformers.distributed.configuration_utils import DistributedConfig

        sharding = DistributedConfig(tp_size=tensor_parallel_size)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, distributed_config=sharding).eval()
    elif has_random_weights(path):
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
