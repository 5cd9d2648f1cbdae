"""The block tables' shape, shared by the parts of the KV store: three tables per (sequence, layer),
entries in blocks of `BLOCK_SIZE`, and the arithmetic from an entry to its row in a pool.

    keys      [ KEY_ONLY entries ... | FULL entries ... ]   at the sequence's storage format
    values                           [ FULL values ... ]    same format (int4 beside int4c keys)
    key-only  [ quantised values ... ]                      int4 or int8
"""

from __future__ import annotations

import numpy as np
import torch

BLOCK_SIZE = 16
KEYS, VALUES, KEY_ONLY = 0, 1, 2  # the three tables of a (sequence, layer)


def blocks_for(entries, block_size: int):
    """Blocks that hold `entries` (an int or an array of them)."""
    return -(-entries // block_size)


def entry_rows(table: np.ndarray, entries: np.ndarray, block_size: int) -> np.ndarray:
    """Pool rows (block * block_size + offset) of a table's entries."""
    return table[entries // block_size].astype(np.int64) * block_size + entries % block_size


def as_tensor(array: np.ndarray, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """A numpy array as a tensor on `device`: no copy on CPU when the dtype already matches."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)


def rows_tensor(rows: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """Pool rows of several tables, one after another, as one tensor."""
    return as_tensor(np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64), device)


def pad(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    """`array` grown with zeros along `axis` to `size`."""
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, size - array.shape[axis])
    return np.pad(array, widths)
