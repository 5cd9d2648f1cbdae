"""One forward pass over the block tables: where its new entries are written, and what its decode
rows read.

A plan is made once per step, before the forward (`StepPlanner.plan`), so that every layer writes
its new keys and values (`write`) and hands the decode kernel its rows (`decode_batch`) without a
Python loop over sequences; what the kernel reads besides the query (block tables, lengths, pools)
is made ready once per step too, since per layer its small conversions cost about as much as a
decode step's attention. Keys are written by their pool's format: in place for a float or a
per-token format (quantised keys turned into a rotated basis first, `KeyBasis`), or whole blocks
re-encoded for per-channel int4 (`confkv.kv.channel_keys`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from confkv.kv.block_pool import BlockPool, Codec
from confkv.kv.block_tables import BlockTables
from confkv.kv.channel_keys import ChannelKeys, ChannelWrite
from confkv.kv.kv_layout import KEY_ONLY, KEYS, VALUES, as_tensor
from confkv.kv.paged_attention import DecodeBatch, PoolTensors


class WriteGroup(NamedTuple):
    """The step's tokens whose keys go to one pool."""

    keys: BlockPool
    values: BlockPool
    tokens: torch.Tensor | None  # indices in the step (None: all of them)
    channel: list[ChannelWrite] | None  # per layer, for int4c keys


@dataclass
class StepPlan:
    """Where one forward pass writes its new entries, and which of its rows decode."""

    token_slot: torch.Tensor  # [tokens]
    key_index: torch.Tensor  # [layers, tokens] the new entries' places in their keys tables
    rows: torch.Tensor  # [layers, 2 * tokens] pool rows of the new keys, then of their values
    groups: list[WriteGroup]  # the step's tokens by key pool
    decode_tokens: torch.Tensor  # [rows] tokens of one-token segments
    row_slot: torch.Tensor  # [rows] int32
    row_pool: torch.Tensor  # [rows] int32, an index in `pool_tensors`: keys
    row_value_pool: torch.Tensor  # [rows] int32, an index in `pool_tensors`: FULL values
    observe_index: torch.Tensor  # [rows] int32
    num_observed: int
    turned_rows: torch.Tensor | None  # decode rows whose keys are stored rotated (None: none)
    only_decode: bool  # every segment is one token: decode row i is token i
    # What every layer's decode kernel reads besides its query, made once per step (empty without rows):
    pool_tensors: list[PoolTensors]
    key_only_pool: int  # an index in `pool_tensors`: KEY_ONLY values
    tables: torch.Tensor | None  # [kinds, layers, slots, max_blocks] int32: the block tables
    lengths: torch.Tensor | None  # [layers, slots] int32: entries held
    key_only_counts: torch.Tensor | None  # [layers, slots] int32: KEY_ONLY entries among them


class KeyBasis:
    """Quantised keys stored per token are stored in a rotated basis (`confkv.kv.quant`), which
    spreads an outlier channel over all of them; q.k is the same once the query is turned alike.
    Per-channel keys are not turned: the channels are what their parameters follow."""

    def __init__(self, rotation: torch.Tensor | None) -> None:
        self.rotation = rotation  # None: keys stored as they are

    def turns(self, pool: BlockPool) -> bool:
        """Are the keys stored in `pool` turned? (The KEY_ONLY values that may share a pool are
        values, never turned.)"""
        return self.rotation is not None and pool.codec.quantized and not pool.codec.per_channel

    def turn(self, x: torch.Tensor) -> torch.Tensor:
        """Vectors x [..., head_dim] into the stored basis, in x's dtype."""
        return (x.float() @ self.rotation).to(x.dtype)

    def unturn(self, x: torch.Tensor) -> torch.Tensor:
        """Stored vectors x [..., head_dim] back into the model's basis."""
        return (x.float() @ self.rotation.T).to(x.dtype)


class StepPlanner:
    """Plans each step over the store's block tables and carries its writes and decode reads out."""

    def __init__(self, tables: BlockTables, channel_keys: ChannelKeys, basis: KeyBasis, device: torch.device) -> None:
        self.tables = tables
        self.channel_keys = channel_keys
        self.basis = basis
        self.device = device

    def plan(
        self,
        segments: list,
        pools: list[BlockPool],
        values_pool: Callable[[Codec], BlockPool],
        key_only_pool: BlockPool,
    ) -> StepPlan:
        """Where each new entry of these segments (`Segment`s, room reserved) goes in every layer, and
        the decode rows; `pools`: every pool, `values_pool`: the pool of a key format's values,
        `key_only_pool`: that of KEY_ONLY values. The entries count as held from here on."""
        tables, device, bs = self.tables, self.device, self.tables.block_size
        slots = np.array([tables.slot_of[seg.seq_id] for seg in segments], dtype=np.int64)
        counts = np.array([seg.num_tokens for seg in segments], dtype=np.int64)
        token_slot = np.repeat(slots, counts)
        offset = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        layers = np.arange(tables.num_layers)[:, None]
        key_index = tables.lengths[:, token_slot] + offset
        value_index = key_index - tables.key_only[:, token_slot]

        def rows(kind: int, index: np.ndarray) -> np.ndarray:
            return tables.ids[kind][layers, token_slot, index // bs].astype(np.int64) * bs + index % bs

        key_rows, value_rows = rows(KEYS, key_index), rows(VALUES, value_index)
        np.add.at(tables.lengths, (slice(None), slots), counts)

        by_pool: dict[int, list[int]] = {}
        for i, seg in enumerate(segments):
            by_pool.setdefault(id(tables.pools[slots[i]][KEYS]), []).extend(range(seg.start, seg.end))
        groups = []
        for pool in pools:
            tokens = by_pool.get(id(pool))
            if tokens is not None:
                channel = None
                if pool.codec.per_channel:
                    channel = self.channel_keys.plan(
                        tables.ids[KEYS], tables.lengths, token_slot[tokens], key_index[:, tokens]
                    )
                index = None if len(by_pool) == 1 else as_tensor(tokens, device)
                groups.append(WriteGroup(pool, values_pool(pool.codec.values), index, channel))
        decode = [i for i, seg in enumerate(segments) if seg.num_tokens == 1]
        decode_pools = [tables.pools[slots[i]] for i in decode]
        observe = np.full(len(decode), -1, dtype=np.int32)
        observed = [j for j, i in enumerate(decode) if segments[i].observe]
        observe[observed] = np.arange(len(observed))
        turned = [row for row, p in enumerate(decode_pools) if self.basis.turns(p[KEYS])]

        # One copy per step of what the layers' kernels read (none on CPU: numpy's memory is shared).
        def int32(array: np.ndarray) -> torch.Tensor | None:
            return as_tensor(array, device, torch.int32) if decode else None

        return StepPlan(
            token_slot=as_tensor(token_slot, device),
            key_index=as_tensor(key_index, device),
            rows=as_tensor(np.concatenate((key_rows, value_rows), axis=1), device),
            groups=groups,
            decode_tokens=torch.tensor([segments[i].start for i in decode], dtype=torch.long, device=device),
            row_slot=as_tensor(slots[decode], device, torch.int32),
            row_pool=torch.tensor([pools.index(p[KEYS]) for p in decode_pools], dtype=torch.int32),
            row_value_pool=torch.tensor([pools.index(p[VALUES]) for p in decode_pools], dtype=torch.int32),
            observe_index=as_tensor(observe, device),
            num_observed=len(observed),
            turned_rows=as_tensor(np.array(turned), device) if turned else None,
            only_decode=len(decode) == len(segments),
            pool_tensors=[pool.tensors() for pool in pools] if decode else [],
            key_only_pool=pools.index(key_only_pool),
            tables=int32(tables.ids),
            lengths=int32(tables.lengths),
            key_only_counts=int32(tables.key_only),
        )

    def write(self, layer: int, plan: StepPlan, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the step's new keys and values of one layer (each [kv_heads, tokens, head_dim])."""
        rows, n = plan.rows[layer], keys.shape[1]
        for group in plan.groups:
            tokens = group.tokens
            k, v = (keys, values) if tokens is None else (keys[:, tokens], values[:, tokens])
            key_rows, value_rows = (rows[:n], rows[n:]) if tokens is None else (rows[tokens], rows[tokens + n])
            if group.channel is not None:
                self.channel_keys.write(layer, group.keys, group.channel[layer], k)
            else:
                group.keys.write(key_rows, (self.basis.turn(k) if self.basis.turns(group.keys) else k).transpose(0, 1))
            group.values.write(value_rows, v.transpose(0, 1))

    def decode_batch(self, layer: int, plan: StepPlan, query: torch.Tensor, scale: float) -> DecodeBatch:
        """The decode kernel's view of one layer for the plan's decode rows (query [rows, heads, D])."""
        if plan.turned_rows is not None:  # their keys are stored rotated: q.k is the same in that basis
            turned = self.basis.turn(query.index_select(0, plan.turned_rows))
            query = query.index_copy(0, plan.turned_rows, turned)
        tables = plan.tables
        return DecodeBatch(
            query=query,
            pools=plan.pool_tensors,
            row_slot=plan.row_slot,
            row_pool=plan.row_pool,
            row_value_pool=plan.row_value_pool,
            key_only_pool=plan.key_only_pool,
            key_tables=tables[KEYS, layer],
            value_tables=tables[VALUES, layer],
            key_only_tables=tables[KEY_ONLY, layer],
            num_keys=plan.lengths[layer],
            num_key_only=plan.key_only_counts[layer],
            block_size=self.tables.block_size,
            scale=scale,
            observe_index=plan.observe_index,
            num_observed=plan.num_observed,
        )
