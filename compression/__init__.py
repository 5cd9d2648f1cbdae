"""KV cache storage and compression."""

from compression.kv_store import KVBudgetExceeded, KVStore

__all__ = ["KVBudgetExceeded", "KVStore"]
