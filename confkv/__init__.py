"""CONF-KV: an HTTP inference server that compresses the KV cache while it generates.

`confkv.server` (HTTP, settings, metrics), `confkv.engine` (scheduler, runner, sampler, loop),
`confkv.kv` (arena, block tables, codecs, kernels), `confkv.compress` (scorers, predictor, tiers,
budget), `confkv.cluster` (Ray Serve replicas), `confkv.models` (loading, the default model).
The library API is importable from here: `from confkv import DynamicKVCompressor`."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

# The configuration files that ship with the package (compression, predictor, server).
CONFIG_DIR = Path(__file__).resolve().parent / "config"

_EXPORTS = {
    "DynamicKVCompressor": "confkv.compress.library",
    "KVStore": "confkv.kv.kv_store",
    "KVBudgetExceeded": "confkv.kv.kv_store",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    # Imported on first use, so that `python -m confkv.models.default_model` and the settings
    # load without the engine's imports.
    if name not in _EXPORTS:
        raise AttributeError(f"module 'confkv' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
