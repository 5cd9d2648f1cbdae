"""The KV cache of every sequence, in blocks of one pool per storage format, against one byte budget.

The store is the lifecycle of every sequence's cache; its parts each hold one concern:

- `confkv.kv.allocator`: the arena, a block pool per storage format, and the byte budget every
  allocation is checked against;
- `confkv.kv.block_tables`: the running slots' block tables (three per layer: keys, FULL
  values, KEY_ONLY values; `confkv.kv.kv_layout`), parked caches, and how a rebuild keeps blocks;
- `confkv.kv.step_plan`: one forward pass's writes and decode reads over those tables;
- `confkv.kv.channel_keys`: keys stored per channel (int4c, "kivi4"), whose blocks are encoded whole;
- `confkv.kv.entry_stats`: what is known of each entry beside its key and value (position,
  observed attention, the predictor's history).

Compaction (`compact`) writes the surviving entries into fresh blocks and gives the old ones back;
the leading blocks it leaves unchanged are kept as they are. A finished sequence is parked (its
tables leave the slot, its blocks stay) and a later one adopts a prefix of it by sharing whole
blocks by reference: only a partial last block is copied, since the adopter appends after it.
Compaction, adoption and truncation all go through one rebuild (`_rebuild`).

The budget counts whole blocks: waste is at most one partial block per table. A running slot's
bookkeeping is allocated with the slots and not counted; a parked cache's (its tables, positions
and key norms) grows with what the prefix cache holds, so it is counted with the parked blocks.
The file is over 300 lines because every step of the lifecycle goes through the one rebuild.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import psutil
import torch

from confkv.kv.allocator import KVAllocator
from confkv.kv.block_pool import BlockPool, Codec
from confkv.kv.block_tables import BlockTables, Keep, ParkedKV, held_before, interleave, plan_rebuild
from confkv.kv.channel_keys import ChannelKeys
from confkv.kv.entry_stats import PARKED, EntryStats
from confkv.kv.kv_layout import (
    BLOCK_SIZE,
    KEY_ONLY,
    KEYS,
    VALUES,
    as_tensor,
    blocks_for,
    rows_tensor,
)
from confkv.kv.paged_attention import DecodeBatch
from confkv.kv.quant import random_rotation
from confkv.kv.step_plan import KeyBasis, StepPlan, StepPlanner
from confkv.models.loader import KVShape, attention_windows
from confkv.models.parallel import SINGLE, RankGroup

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def memory_for_cache(device: torch.device) -> int:
    """Bytes a max_cache_size percentage is a share of. On CUDA, what is free for the cache now: the
    device's free memory plus what torch's allocator holds unused, less the peak it has allocated
    (so the activations of the largest forward pass seen keep their room; call it after the weights
    are loaded and a warm-up forward). Elsewhere the system's memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(0, free + torch.cuda.memory_reserved(device) - torch.cuda.max_memory_allocated(device))
    return psutil.virtual_memory().total


class KVBudgetExceeded(RuntimeError):
    """Raised when a reservation would take the store past its byte budget."""


@dataclass
class LayerKV:
    """One layer of one sequence: its counts, and views of its bookkeeping (indexed in key order)."""

    length: int
    num_key_only: int
    positions: torch.Tensor  # [capacity] token positions
    attention: torch.Tensor  # [capacity] float32 attention observed by the scoring policy
    observed: torch.Tensor | None  # [history_steps, capacity] fp16: the predictor's latest observations
    key_norm: torch.Tensor | None  # [capacity] fp16, mean over heads, taken before quantisation
    forecast: torch.Tensor | None  # [capacity] float32 predicted future attention, NaN until predicted

    @property
    def num_full(self) -> int:
        return self.length - self.num_key_only


@dataclass
class LayerView:
    """A layer's entries gathered and dequantised: for prefill chunks, scoring and audits."""

    keys: torch.Tensor  # [kv_heads, length, head_dim], compute dtype
    values: torch.Tensor  # [kv_heads, num_full, head_dim]
    key_only_values: torch.Tensor | None  # [kv_heads, num_key_only, head_dim]
    num_key_only: int


class KVStore:
    """The KV cache of every running sequence, and the byte account over all of it."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_bytes: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        storage: torch.dtype | str | None = None,
        key_only_bits: int = 4,
        history_steps: int = 0,
        block_size: int = BLOCK_SIZE,
        key_rotation: bool = True,
        ranks: RankGroup = SINGLE,
        windows: list[int | None] | None = None,
    ) -> None:
        """`key_rotation`: store quantised keys in a rotated basis (`confkv.kv.quant`). `ranks`: the
        tensor-parallel group whose share of the KV heads this store holds. `windows`: each layer's
        sliding window, or None where it attends to the whole context (`attention_windows`)."""
        self.num_layers = num_layers
        # A sliding-window layer holds its entries in position order, none dropped between (compression
        # leaves it whole), and lets go of those behind its window (`trim_windows`).
        self.windows = windows or [None] * num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype  # the model's dtype: what attention computes in
        self.device = torch.device(device)
        self.block_size = block_size
        self.basis = KeyBasis(random_rotation(head_dim).to(self.device) if key_rotation else None)
        self.codec = self.make_codec(storage)  # the default storage precision
        key_only = Codec(f"int{key_only_bits}", head_dim)
        self.allocator = KVAllocator(max_bytes, num_kv_heads, block_size, key_only, self.device)
        self.evicted_entries: Counter[str] = Counter()  # (layer, token) entries removed, by reason
        self._storage: dict[int, Codec] = {}  # sequences stored at another precision than the default
        self.channel_keys = ChannelKeys(num_layers, block_size, dtype, self.device)  # int4c keys' writes
        self.tables = BlockTables(num_layers, block_size)  # the running sequences' block tables
        self.steps = StepPlanner(self.tables, self.channel_keys, self.basis, self.device)
        self.stats = EntryStats(num_layers, history_steps, self.device, ranks)  # what is known of every entry
        # Frees one parked cache (the prefix cache's eviction); True if there was one. A compaction whose
        # fresh blocks find no page asks it, as parked caches that share a sequence's blocks are what
        # hold the pages then.
        self.reclaim: Callable[[], bool] | None = None

    @classmethod
    def for_model(
        cls,
        model: PreTrainedModel,
        max_bytes: int,
        key_only_bits: int,
        history_steps: int = 0,
        key_rotation: bool = True,
        ranks: RankGroup = SINGLE,
    ) -> KVStore:
        """A store shaped for `model`'s KV cache (this rank's share of its heads), on its device and
        computing in its dtype."""
        shape = KVShape.of(model.config).per_rank(ranks.size)
        return cls(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_bytes=max_bytes,
            dtype=model.dtype,
            device=next(model.parameters()).device,
            key_only_bits=key_only_bits,
            history_steps=history_steps,
            key_rotation=key_rotation,
            ranks=ranks,
            windows=attention_windows(model.config),
        )

    def make_codec(self, storage: torch.dtype | str | None) -> Codec:
        """A codec for `storage`: None or "auto" is the model's dtype; a float dtype name; "int8"; "int4";
        "kivi4" (keys int4 per channel, values int4 per token)."""
        if storage is None or storage == "auto":
            storage = self.dtype
        elif storage == "kivi4":
            storage = "int4c"
        elif isinstance(storage, str) and not storage.startswith("int"):
            storage = getattr(torch, storage)
        return Codec(storage, self.head_dim, self.block_size)

    def set_storage(self, seq_id: int, storage: torch.dtype | str | None) -> None:
        """Store this sequence's FULL entries at `storage` (before its first reservation)."""
        self._storage[seq_id] = self.make_codec(storage)

    def codec_of(self, seq_id: int) -> Codec:
        return self._storage.get(seq_id, self.codec)

    # ----- sizes -------------------------------------------------------------------------
    def entry_bytes(self, codec: Codec | None = None) -> tuple[int, int]:
        """Bytes of one (token, layer) entry: FULL, and KEY_ONLY (key as stored, value quantised)."""
        codec = codec or self.codec
        key = codec.vector_bytes
        full = self.num_kv_heads * (key + codec.values.vector_bytes)
        return full, self.num_kv_heads * (key + self.allocator.key_only_pool.codec.vector_bytes)

    def value_errors(self, codec: Codec | None = None) -> tuple[float, float]:
        """Relative error of a FULL value and of a KEY_ONLY value as stored (`Codec.relative_error`)."""
        return (codec or self.codec).values.relative_error, self.allocator.key_only_pool.codec.relative_error

    @property
    def model_token_bytes(self) -> int:
        """Bytes of one token over all layers in an uncompressed cache at the model's dtype."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    def block_bytes(self, codec: Codec | None = None) -> int:
        return self.num_kv_heads * self.block_size * (codec or self.codec).vector_bytes

    def table_blocks_bytes(self, codec: Codec | None = None) -> int:
        """Bytes of one block of each of a layer's tables (keys, values, key-only values)."""
        codec = codec or self.codec
        return self.block_bytes(codec) + self.block_bytes(codec.values) + self.allocator.key_only_pool.block_bytes

    def bytes_for(self, num_tokens: int, codec: Codec | None = None) -> int:
        """Bytes a new sequence of `num_tokens` FULL tokens takes, whole blocks included."""
        codec = codec or self.codec
        blocks = self.num_layers * blocks_for(num_tokens, self.block_size)
        return blocks * (self.block_bytes(codec) + self.block_bytes(codec.values))

    @property
    def max_bytes(self) -> int:
        return self.allocator.max_bytes

    @property
    def used_bytes(self) -> int:
        """Every block in use, running or parked, and the parked caches' bookkeeping."""
        return self.allocator.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.allocator.free_bytes

    @property
    def running_bytes(self) -> int:
        """Bytes of the distinct blocks that running sequences hold."""
        held = self.tables.running_blocks().values()
        return sum(len(np.unique(np.concatenate(blocks))) * pool.block_bytes for pool, blocks in held)

    @property
    def parked_bytes(self) -> int:
        """Blocks that only parked caches (the prefix cache) hold, and their bookkeeping."""
        return self.used_bytes - self.running_bytes

    def seq_bytes(self, seq_id: int) -> int:
        """Bytes of every block this sequence's tables hold (shared ones too)."""
        slot = self.tables.slot_of.get(seq_id)
        if slot is None:
            return 0
        return int(self.layer_bytes(seq_id).sum())

    def layer_bytes(self, seq_id: int) -> np.ndarray:
        """Bytes of the blocks each layer of this sequence holds [layers]: what it costs, whole blocks counted."""
        slot = self.tables.slot_of[seq_id]
        block_bytes = np.array([pool.block_bytes for pool in self.tables.pools[slot]])
        return (self.tables.num_blocks[:, :, slot] * block_bytes[:, None]).sum(axis=0)

    def seq_length(self, seq_id: int, layer: int = 0) -> int:
        slot = self.tables.slot_of.get(seq_id)
        return int(self.tables.lengths[layer, slot]) if slot is not None else 0

    def layer(self, seq_id: int, layer_idx: int) -> LayerKV:
        slot = self.tables.slot_of[seq_id]
        meta = self.stats.of(layer_idx, slot)
        return LayerKV(
            length=int(self.tables.lengths[layer_idx, slot]),
            num_key_only=int(self.tables.key_only[layer_idx, slot]),
            positions=meta["positions"],
            attention=meta["attention"],
            observed=meta.get("observed"),
            key_norm=meta.get("key_norm"),
            forecast=meta.get("forecast"),
        )

    def entry_counts(self) -> dict[str, int]:
        """(layer, token) entries held, by tier, over every running sequence."""
        slots = list(self.tables.slot_of.values())
        total, key_only = int(self.tables.lengths[:, slots].sum()), int(self.tables.key_only[:, slots].sum())
        return {"full": total - key_only, "key_only": key_only}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.tables.slot_of

    def __len__(self) -> int:
        return len(self.tables.slot_of)

    # ----- lifecycle ---------------------------------------------------------------------
    def reserve(self, seq_id: int, num_new: int) -> None:
        """Make room for `num_new` more FULL tokens in every layer of a sequence, or raise.

        All-or-nothing: either every layer has room afterwards or nothing changed.
        """
        created = seq_id not in self.tables.slot_of
        slot = self._open_slot(seq_id) if created else self.tables.slot_of[seq_id]
        pools = self.tables.pools[slot]
        lengths = self.tables.lengths[:, slot]
        need_keys = blocks_for(lengths + num_new, self.block_size) - self.tables.num_blocks[KEYS, :, slot]
        need_values = blocks_for(lengths - self.tables.key_only[:, slot] + num_new, self.block_size)
        need_values -= self.tables.num_blocks[VALUES, :, slot]
        blocks = [(pools[KEYS], int(need_keys.clip(0).sum())), (pools[VALUES], int(need_values.clip(0).sum()))]
        if not self.allocator.fits(blocks):
            if created:
                self.tables.close(seq_id)
            needed = sum(pool.block_bytes * n for pool, n in blocks)
            raise KVBudgetExceeded(
                f"sequence {seq_id} needs {needed} more KV bytes; {self.free_bytes} of {self.max_bytes} are free"
                + ("" if needed > self.free_bytes else ", but the arena's pages are held by other storage formats")
            )
        self._fit(int(lengths.max()) + num_new)
        for kind, need in ((KEYS, need_keys), (VALUES, need_values)):
            for layer in np.flatnonzero(need > 0):
                self.tables.extend(kind, int(layer), slot, pools[kind].allocate(int(need[layer])))

    def begin_step(self, segments: list, positions: torch.Tensor) -> StepPlan:
        """Plan a forward pass of these segments (`Segment`s, room reserved, at `positions`): where
        each new entry goes in every layer, and the decode rows. The entries count as held from here on."""
        pools = list(self.allocator.pools.values())
        plan = self.steps.plan(segments, pools, self.allocator.pool, self.allocator.key_only_pool)
        self.stats.written(plan.token_slot, plan.key_index, positions)
        return plan

    def write(self, layer: int, plan: StepPlan, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store the step's new keys and values of one layer (each [kv_heads, tokens, head_dim])."""
        self.steps.write(layer, plan, keys, values)
        self.stats.note_key_norms(layer, plan.token_slot, plan.key_index[layer], keys)

    def decode_batch(self, layer: int, plan: StepPlan, query: torch.Tensor, scale: float) -> DecodeBatch:
        """The decode kernel's view of one layer for the plan's decode rows (query [rows, heads, D])."""
        batch = self.steps.decode_batch(layer, plan, query, scale)
        batch.window = self.windows[layer] or 0
        return batch

    @property
    def compressible_layers(self) -> list[int]:
        """The layers compression may drop and demote in: those that attend to the whole context.
        A sliding-window layer is bounded by its window already, and its decode attention reads its
        last entries as the window (`DecodeBatch.window`), which holds only if none are dropped."""
        return [layer for layer, window in enumerate(self.windows) if window is None]

    def trim_windows(self, seq_id: int) -> int:
        """Let go of the entries a sequence's sliding-window layers can never attend to again, in
        those layers where a block's worth of them has gathered (a compaction rewrites the window, so
        not at every step); return the bytes freed."""
        slot = self.tables.slot_of[seq_id]
        keep = {}
        for layer, window in enumerate(self.windows):
            n = int(self.tables.lengths[layer, slot])
            if window is not None and n - window >= self.block_size:
                newest = torch.arange(n - window, n, device=self.device)
                keep[layer] = Keep(newest, newest[:0])
        return self.compact(seq_id, keep, reason="window") if keep else 0

    def observe(
        self,
        layer: int,
        seq_ids: list[int],
        rows: torch.Tensor,
        accumulate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        interval: int = 1,
    ) -> None:
        """Fold the attention of some queries per sequence (rows [sequences, queries, width], zero past
        each one's entries) into their observed attention by `accumulate`, and into the predictor's
        history (queries `interval` apart). Past its entries a row's bookkeeping is scratch: a write
        resets it."""
        slots = torch.tensor([self.tables.slot_of[s] for s in seq_ids], device=self.device)
        self.stats.observe(layer, slots, rows, accumulate, interval)

    def view(self, seq_id: int, layer_idx: int) -> LayerView:
        """Keys and values held by one layer of one sequence, gathered and dequantised."""
        slot = self.tables.slot_of[seq_id]
        n, n_ko = int(self.tables.lengths[layer_idx, slot]), int(self.tables.key_only[layer_idx, slot])
        pools = self.tables.pools[slot]

        def read(kind: int, count: int) -> torch.Tensor:
            rows = self._rows(self.tables.leading_rows(kind, layer_idx, slot, count))
            return pools[kind].tensors().read(rows, self.dtype)

        keys = read(KEYS, n)
        if self.basis.turns(pools[KEYS]):
            keys = self.basis.unturn(keys)
        return LayerView(keys, read(VALUES, n - n_ko), read(KEY_ONLY, n_ko) if n_ko else None, n_ko)

    def positions(self, seq_id: int, layer_idx: int) -> torch.Tensor:
        slot = self.tables.slot_of[seq_id]
        return self.stats.rows["positions"][layer_idx, slot, : self.tables.lengths[layer_idx, slot]]

    def compact(self, seq_id: int, keep: dict[int, Keep], reason: str = "compression") -> int:
        """Rebuild the given layers holding only the entries they keep; return bytes freed (the
        dropped entries counted as evicted for `reason`).

        A layer's `key_only` may name KEY_ONLY entries (kept as they are) and FULL ones (their values
        are quantised now); `full` may name FULL entries only, since a quantised value cannot be
        restored. Entries named in neither are dropped.
        """
        slot = self.tables.slot_of[seq_id]
        layers = list(keep)
        before, held = self.used_bytes, int(self.tables.lengths[layers, slot].sum())
        self._rebuild(slot, self._snapshot(slot), keep, charge=False)
        self.evicted_entries[reason] += held - int(self.tables.lengths[layers, slot].sum())
        return before - self.used_bytes

    # ----- parked caches (the prefix cache's pool) -----------------------------------------
    def park(self, seq_id: int) -> ParkedKV | None:
        """Take a finished sequence's cache out of the running slots; its blocks stay held."""
        self._storage.pop(seq_id, None)
        if seq_id not in self.tables.slot_of:
            return None
        slot = self.tables.slot_of[seq_id]
        parked = self._snapshot(slot, PARKED)
        self.allocator.parked_bookkeeping_bytes += parked.bookkeeping_bytes
        self.tables.num_blocks[:, :, slot] = 0  # the references move to the parked cache
        self.tables.close(seq_id)
        return parked

    def share(self, seq_id: int) -> ParkedKV | None:
        """A parked copy of a running sequence's cache that leaves the sequence running: whole
        blocks are shared by reference, each table's partial last block is copied (the sequence
        goes on writing into its own). None when the copies do not fit in the budget."""
        slot = self.tables.slot_of[seq_id]
        parked = self._snapshot(slot, PARKED)
        counts = (parked.lengths, parked.lengths - parked.key_only, parked.key_only)  # entries per table kind
        pools = self.tables.pools[slot]
        partial = {(kind, int(layer)) for kind in range(3) for layer in np.flatnonzero(counts[kind] % self.block_size)}
        if not self.allocator.fits([(pools[kind], 1) for kind, _ in partial], parked.bookkeeping_bytes):
            return None
        self.allocator.parked_bookkeeping_bytes += parked.bookkeeping_bytes
        copies: dict[int, list[tuple[int, int]]] = {}  # pool -> (block, its copy) pairs
        for kind, layers in enumerate(parked.tables):
            for layer, table in enumerate(layers):
                if (kind, layer) in partial:
                    old, (table[-1],) = int(table[-1]), pools[kind].allocate(1)
                    copies.setdefault(id(pools[kind]), []).append((old, int(table[-1])))
                    pools[kind].ref(table[:-1].tolist())
                else:
                    pools[kind].ref(table.tolist())
        for pool in {id(p): p for p in pools}.values():
            if pairs := copies.get(id(pool)):
                pool.copy_blocks(*(as_tensor(np.array(ids), self.device) for ids in zip(*pairs, strict=True)))
        return parked

    def reclaimable_bytes(self, parked: list[ParkedKV]) -> int:
        """Bytes that discarding every cache of `parked` would free: the blocks nobody else holds
        (running sequences and other parked caches keep theirs), and the caches' bookkeeping."""
        held: dict[int, tuple[BlockPool, list[np.ndarray]]] = {}
        for kv in parked:
            for pool, layers in zip(self.allocator.pools_of(kv.codec), kv.tables, strict=True):
                held.setdefault(id(pool), (pool, []))[1].extend(layers)
        freed = 0
        for pool, tables in held.values():
            blocks, counts = np.unique(np.concatenate(tables), return_counts=True)
            freed += int((pool.refs[blocks] == counts).sum()) * pool.block_bytes
        return freed + sum(kv.bookkeeping_bytes for kv in parked)

    def discard(self, parked: ParkedKV) -> int:
        """Give back a parked cache's references; return the bytes that became free."""
        before = self.used_bytes
        self.allocator.unref(self.allocator.pools_of(parked.codec), parked.tables)
        self.allocator.parked_bookkeeping_bytes -= parked.bookkeeping_bytes
        self.evicted_entries["prefix_cache"] += int(parked.lengths.sum())
        return before - self.used_bytes

    def adopt(self, seq_id: int, parked: ParkedKV, num_tokens: int) -> None:
        """Start sequence `seq_id` from the entries of `parked` at positions < num_tokens.

        Whole blocks are shared; what the new sequence will write into (a partial last block) and
        any table whose held entries are not a prefix of the parked one are copied. Raises
        KVBudgetExceeded (holding nothing) when the copies do not fit.
        """
        self._storage[seq_id] = parked.codec
        slot = self._open_slot(seq_id)
        self._fit(int(parked.lengths.max()))
        try:
            self._rebuild(slot, parked, held_before(parked, num_tokens))
        except KVBudgetExceeded:
            self.free(seq_id)
            raise
        self.stats.forget_observations(slot)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Forget a running sequence's entries at positions >= num_tokens (tokens it decoded only to
        look ahead); they do not count as evicted."""
        slot = self.tables.slot_of[seq_id]
        source = self._snapshot(slot)
        self._rebuild(slot, source, held_before(source, num_tokens), charge=False)

    def free(self, seq_id: int, preempted: bool = False) -> int:
        """Drop a sequence's cache and return the bytes that became free.

        A `preempted` sequence will be recomputed: its storage precision is remembered and its
        entries count as evicted.
        """
        if not preempted:
            self._storage.pop(seq_id, None)
        slot = self.tables.slot_of.get(seq_id)
        if slot is None:
            return 0
        if preempted:
            self.evicted_entries["preemption"] += int(self.tables.lengths[:, slot].sum())
        before = self.used_bytes
        self.allocator.unref(self.tables.pools[slot], self.tables.copies(slot))
        self.tables.num_blocks[:, :, slot] = 0
        self.tables.close(seq_id)
        return before - self.used_bytes

    # ----- internals ---------------------------------------------------------------------
    def _open_slot(self, seq_id: int) -> int:
        slot = self.tables.open(seq_id, self.allocator.pools_of(self.codec_of(seq_id)))
        if self.stats.num_slots < self.tables.num_slots:
            self.stats.grow(self.tables.num_slots, self.stats.capacity)
            self.channel_keys.grow(self.tables.num_slots)
        if self.tables.pools[slot][KEYS].codec.per_channel:
            self.channel_keys.need(self.tables.num_slots, self.num_kv_heads, self.head_dim)
        return slot

    def _fit(self, entries: int) -> None:
        """Room for `entries` in every table row and bookkeeping row."""
        self.tables.fit(entries)
        if entries > self.stats.capacity:
            self.stats.grow(self.tables.num_slots, max(entries, 2 * self.stats.capacity))

    def _rows(self, rows: np.ndarray) -> torch.Tensor:
        return as_tensor(rows, self.device)

    def _snapshot(self, slot: int, own: dict[str, torch.dtype] | None = None) -> ParkedKV:
        """A running slot's cache as a parked one holds it: tables copied, bookkeeping as views of the
        slot's rows, or only the rows named in `own`, copied at their dtype up to the longest layer,
        to outlive the slot."""
        return ParkedKV(
            codec=self.tables.pools[slot][KEYS].codec,
            tables=self.tables.copies(slot),
            lengths=self.tables.lengths[:, slot].copy(),
            key_only=self.tables.key_only[:, slot].copy(),
            meta=self.stats.snapshot(slot, int(self.tables.lengths[:, slot].max()), own),
        )

    def _rebuild(self, slot: int, source: ParkedKV, keep: dict[int, Keep], charge: bool = True) -> None:
        """Make the given layers of `slot` hold the entries of `source` they keep: KEY_ONLY first, then FULL.

        Each new table starts with the longest run of the source table's entries it keeps in place;
        the whole blocks of that run are shared, the rest is written into fresh blocks. Every layer
        is done at once: one read and one write per table kind, whatever the number of layers.
        Everything is read before anything the slot held is let go. With `charge` the fresh blocks
        must fit in the budget; compaction does not check it, since it only ever gives bytes back, up
        to one block of rounding per table. Either way they must fit in the arena's pages, counting
        those the rebuild lets go of first (a newly KEY_ONLY value may need a page of another format):
        else KVBudgetExceeded, nothing changed. int4c keys are read as keys and their fresh blocks
        encoded anew (their parameters are the blocks').
        """
        if not keep:
            return
        bs, pools = self.block_size, self.allocator.pools_of(source.codec)
        per_channel = pools[KEYS].codec.per_channel
        layers, orders, layouts, reads, demoted = plan_rebuild(source, keep, bs)
        # NOTE: entries that keep their format are moved as stored rows, never decoded and encoded again.
        stored = [pools[kind].read_rows(rows_tensor(reads[kind], self.device)) for kind in range(per_channel, 3)]
        if per_channel:
            stored.insert(KEYS, pools[KEYS].tensors().read(rows_tensor(reads[KEYS], self.device), self.dtype))
        demoted_values, from_kept = None, None
        if any(rows.size for rows in demoted):
            # [entries, kv_heads, head_dim], quantised as they are written (the pool's write kernel).
            demoted_values = pools[VALUES].tensors().read(rows_tensor(demoted, self.device), torch.float32)
            demoted_values = demoted_values.transpose(0, 1).contiguous()
            # Each layer's KEY_ONLY table: the entries it kept, then those it demoted.
            kept = [len(rows) for rows in reads[KEY_ONLY]]
            from_kept = interleave(kept, [len(rows) for rows in demoted]) < sum(kept)
        if charge:
            fresh = sum(
                blocks_for(n, bs) * pools[kind].block_bytes for lay in layouts for kind, (_, n) in enumerate(lay)
            )
            if fresh > self.free_bytes:
                raise KVBudgetExceeded(f"a cached prefix needs {fresh} bytes; {self.free_bytes} are free")
        while not self._rebuild_fits(slot, pools, layers, layouts):
            # Never while adopting: the parked cache read from could be the one to go.
            if charge or self.reclaim is None or not self.reclaim():
                raise KVBudgetExceeded("the arena's pages are held by other storage formats")

        targets, fresh_keys = self._replace_blocks(slot, pools, layers, layouts)
        if per_channel:
            counts = [layout[KEYS][1] for layout in layouts]
            self.channel_keys.write_fresh(pools[KEYS], slot, layers, fresh_keys, counts, stored.pop(KEYS))
        if demoted_values is not None:
            pools[KEY_ONLY].write(as_tensor(targets[KEY_ONLY][~from_kept], self.device), demoted_values)
            targets[KEY_ONLY] = targets[KEY_ONLY][from_kept]
        for kind, rows in enumerate(stored, start=per_channel):
            if len(rows):
                pools[kind].write_rows(as_tensor(targets[kind], self.device), rows)

        self.stats.copy_kept(slot, source.meta, layers, [order for order, _ in orders])
        self.tables.lengths[layers, slot] = [len(order) for order, _ in orders]
        self.tables.key_only[layers, slot] = [n_ko for _, n_ko in orders]

    def _replace_blocks(
        self, slot: int, pools: tuple[BlockPool, ...], layers: list[int], layouts: list
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Give the rebuilt tables of `slot` their blocks: the shared ones, then fresh ones for what is
        written. Return, per table kind, the pool rows the written entries go to (layer after layer),
        and each layer's fresh key blocks. Every kind's references are taken, then every old one given
        back (keeping what it needs of the blocks that became free), before any other block is
        allocated, so that a compaction finds room in what it frees; each pool is called once per kind,
        whatever the number of layers."""
        bs = self.block_size
        written = [np.array([layout[kind][1] for layout in layouts], dtype=np.int64) for kind in range(3)]
        counts = [blocks_for(n, bs) for n in written]
        for kind, pool in enumerate(pools):
            pool.ref(np.concatenate([layout[kind][0] for layout in layouts]))
        reused = []
        for kind, pool in enumerate(pools):
            old = np.concatenate([self.tables.held(kind, layer, slot) for layer in layers])
            reused.append(pool.unref(old, keep=int(counts[kind].sum())))
            self.tables.num_blocks[kind, layers, slot] = 0
        targets, fresh_keys = [], []
        for kind, pool in enumerate(pools):
            entries, blocks = written[kind], counts[kind]
            more = pool.allocate(int(blocks.sum()) - len(reused[kind]))
            fresh = np.concatenate((reused[kind], np.array(more, dtype=np.int64)))
            per_layer = np.split(fresh, np.cumsum(blocks)[:-1])
            for layer, layout, own in zip(layers, layouts, per_layer, strict=True):
                self.tables.extend(kind, layer, slot, [*layout[kind][0].tolist(), *own.tolist()])
            # A fresh block starts at an entry that is a multiple of the block size: its rows are whole,
            # but for the last block of each table, which holds what is left.
            filled = np.full(len(fresh), bs, dtype=np.int64)
            some = blocks > 0
            filled[np.cumsum(blocks)[some] - 1] = entries[some] - (blocks[some] - 1) * bs
            rows = fresh[:, None] * bs + np.arange(bs)
            targets.append(rows[np.arange(bs) < filled[:, None]])
            if kind == KEYS:
                fresh_keys = per_layer
        return targets, fresh_keys

    def _rebuild_fits(self, slot: int, pools: tuple[BlockPool, ...], layers: list[int], layouts: list) -> bool:
        """Do a rebuild's fresh blocks fit in the arena, counting the blocks it lets go of first?"""
        blocks = []
        for layer, layout in zip(layers, layouts, strict=True):
            for kind, (shared, n) in enumerate(layout):
                let_go = self.tables.ids[kind, layer, slot, len(shared) : self.tables.num_blocks[kind, layer, slot]]
                freed = int((pools[kind].refs[let_go] == 1).sum())
                blocks.append((pools[kind], blocks_for(n, self.block_size) - freed))
        return self.allocator.arena_fits(blocks)
