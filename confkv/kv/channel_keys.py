"""Writing keys stored per channel (int4c, storage "kivi4"): a block is encoded whole.

KIVI's per-channel int4 keys have their parameters per block, so a block cannot take one more key
without being encoded anew. The exact keys of each slot's partial last block are kept beside it (its
key tail, in the model's dtype), and each write re-encodes the blocks it touches from them. The KV
store hands the keys of int4c sequences here; every other format writes rows in place.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from confkv.kv.block_pool import BlockPool
from confkv.kv.kv_layout import as_tensor, blocks_for, rows_tensor


class ChannelWrite(NamedTuple):
    """Where one layer's new int4c keys go: whole blocks, each re-encoded from its exact keys."""

    blocks: torch.Tensor  # [n] pool blocks written
    counts: torch.Tensor  # [n] entries each holds after the step
    token_block: torch.Tensor  # [tokens] index in `blocks` of each new key
    token_offset: torch.Tensor  # [tokens] its offset in that block
    from_tail: torch.Tensor  # indices in `blocks` that held entries already (their slot's key tail)
    tail_slots: torch.Tensor  # their slots
    last: torch.Tensor  # index in `blocks` of each slot's last block: its new key tail
    last_slots: torch.Tensor  # their slots


class ChannelKeys:
    """The key tails of the running slots, and the writes that keep int4c blocks encoded whole."""

    def __init__(self, num_layers: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.tail: torch.Tensor | None = None  # [layers, slots, block_size, kv_heads, head_dim], once needed

    def need(self, slots: int, kv_heads: int, head_dim: int) -> None:
        """Key tails for `slots` slots: allocated when the first int4c sequence opens a slot."""
        if self.tail is None:
            shape = (self.num_layers, slots, self.block_size, kv_heads, head_dim)
            self.tail = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def grow(self, slots: int) -> None:
        """Room for `slots` slots, the tails held kept."""
        if self.tail is not None:
            tail = self.tail.new_zeros(self.num_layers, slots, *self.tail.shape[2:])
            tail[:, : self.tail.shape[1]] = self.tail
            self.tail = tail

    def plan(
        self, key_tables: np.ndarray, lengths: np.ndarray, token_slot: np.ndarray, key_index: np.ndarray
    ) -> list[ChannelWrite]:
        """Per layer, the blocks that new keys (of slots `token_slot`, at `key_index` [layers, tokens])
        touch, as `write` rewrites them. `key_tables` [layers, slots, max_blocks] and `lengths`
        [layers, slots] are the store's, the lengths already counting the new keys."""
        bs, width = self.block_size, key_tables.shape[-1]
        writes = []
        for layer in range(self.num_layers):
            position = key_index[layer] // bs
            pairs, token_block = np.unique(token_slot * width + position, return_inverse=True)
            slots, positions = pairs // width, pairs % width
            first = np.full(len(pairs), bs)
            np.minimum.at(first, token_block, key_index[layer] % bs)
            from_tail = np.flatnonzero(first > 0)  # blocks that held entries before this step
            last = np.flatnonzero(np.append(slots[1:] != slots[:-1], True))  # pairs are sorted by slot
            writes.append(
                ChannelWrite(
                    blocks=self._tensor(key_tables[layer, slots, positions]),
                    counts=self._tensor(np.minimum(bs, lengths[layer, slots] - positions * bs)),
                    token_block=self._tensor(token_block),
                    token_offset=self._tensor(key_index[layer] % bs),
                    from_tail=self._tensor(from_tail),
                    tail_slots=self._tensor(slots[from_tail]),
                    last=self._tensor(last),
                    last_slots=self._tensor(slots[last]),
                )
            )
        return writes

    def write(self, layer: int, pool: BlockPool, write: ChannelWrite, keys: torch.Tensor) -> None:
        """Store new keys [kv_heads, tokens, head_dim]: each block they touch is encoded anew from its
        exact keys, those it held before coming from its slot's key tail."""
        staged = keys.new_zeros(len(write.blocks), self.block_size, *keys.shape[::2])
        staged[write.from_tail] = self.tail[layer, write.tail_slots]
        staged[write.token_block, write.token_offset] = keys.transpose(0, 1)
        pool.write_blocks(write.blocks, staged, write.counts)
        self.tail[layer, write.last_slots] = staged[write.last]

    def write_fresh(
        self,
        pool: BlockPool,
        slot: int,
        layers: list[int],
        blocks: list[np.ndarray],
        counts: list[int],
        keys: torch.Tensor,
    ) -> None:
        """Write `keys` [kv_heads, sum(counts), head_dim], the fresh part of each layer's keys table in
        turn (counts[i] entries from a block boundary into `blocks[i]`), and make each layer's
        partial last block its key tail (a rebuild's keys)."""
        bs, heads, width = self.block_size, keys.shape[0], keys.shape[-1]
        per_layer = blocks_for(np.array(counts, dtype=np.int64), bs)
        # Each layer's keys from its first fresh block on, the rest of its last block zero: one scatter.
        first_block = np.cumsum(per_layer) - per_layer
        rows = np.arange(sum(counts)) + np.repeat(bs * first_block - (np.cumsum(counts) - counts), counts)
        staged = keys.new_zeros(int(per_layer.sum()) * bs, heads, width)
        staged[self._tensor(rows)] = keys.transpose(0, 1)
        staged = staged.view(-1, bs, heads, width)
        # Entries each block holds: whole blocks, but for each layer's last.
        in_layer = np.arange(len(staged)) - np.repeat(first_block, per_layer)
        filled = np.minimum(bs, np.repeat(counts, per_layer) - bs * in_layer)
        if len(staged):
            pool.write_blocks(rows_tensor(blocks, self.device), staged, self._tensor(filled.astype(np.int64)))
        last = first_block + per_layer - 1
        tails = [(layer, int(i)) for layer, i, n in zip(layers, last, counts, strict=True) if n % bs]
        if tails:
            index = self._tensor(np.array([i for _, i in tails]))
            self.tail[self._tensor(np.array([layer for layer, _ in tails])), slot] = staged[index]

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return as_tensor(array, self.device)
