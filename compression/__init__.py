"""KV cache storage and compression, usable with or without the server."""

from compression.kv_store import KVBudgetExceeded, KVStore
from compression.library import DynamicKVCompressor

__all__ = ["DynamicKVCompressor", "KVBudgetExceeded", "KVStore"]
