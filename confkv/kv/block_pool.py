"""Fixed-size blocks of head vectors, one pool per storage format, reference-counted.

A block holds `block_size` vectors (keys, FULL values or KEY_ONLY values: any of them) of every KV
head of one layer of one sequence, at one storage format, in one tensor `data [blocks, block_size,
kv_heads, row]`: a float format's vectors as they are, a quantised one's as bytes, each vector's
codes followed by its fp16 parameters (scale, and minimum at 4 and 2 bits; see `confkv.kv.quant`).
Token-major, so that one entry (all its heads, parameters included) is one contiguous row: gathers
and scatters of entries are single row copies, done on an integer view of the rows (several times
faster than indexing the bytes). `int4c` (KIVI's keys: int4 per channel) has parameters per block,
`[kv_heads, 2, head_dim]`: they are spread in order over the tails of the block's rows, so its blocks
are written whole (`write_blocks`). Blocks are counted by reference so that the prefix cache and the
sequences that reuse a prefix share them without copying; a block is written only while one holder
has it.

A pool lives in the KV cache's arena (`confkv.kv.arena`): its tensor views the whole arena as its
grid of blocks, and it uses the blocks inside the pages it holds. It takes a page when it has no
free block left, hands out blocks lowest first, and gives a page back when another pool needs one
and none of its blocks is in use. The KV store decides what may be held (the budget); the pool is
where it lives.

An append is cast or quantised and scattered by one kernel: on CUDA with Triton (`confkv.kv.triton_blocks`,
which also copies rows), on CPU the C++ extension's `encode_rows` (`confkv/kv/csrc/block_write.cpp`).
Both store the same bytes as the torch path, which serves where neither does; a decode step's dozen
small torch operations per layer cost more than its attention.
"""

from __future__ import annotations

import heapq
import math
from statistics import NormalDist
from types import ModuleType

import numpy as np
import torch

from confkv.kv.arena import Arena, ArenaFull
from confkv.kv.paged_attention import FORMAT_CODES, PoolTensors
from confkv.kv.quant import SCALE_DTYPE, bytes_per_vector, quantize, quantize_channels


class Codec:
    """A storage format: a float dtype, int8/int4/int2 codes with per-(token, head) scale (and minimum),
    or int4c: keys as int4 per channel over a block's tokens, their FULL values as per-token int4."""

    def __init__(self, storage: torch.dtype | str, head_dim: int, block_size: int = 16) -> None:
        self.bits = {"int8": 8, torch.int8: 8, "int4": 4, "int4c": 4, "int2": 2}.get(storage, 0)
        self.per_channel = storage == "int4c"
        if self.per_channel and (2 * head_dim) % block_size:
            raise ValueError(f"int4c spreads 2 x head_dim ({2 * head_dim}) parameters over {block_size} rows")
        if self.bits and head_dim * self.bits % 16:
            raise ValueError(f"int{self.bits} codes of head_dim {head_dim} leave fp16 parameters unaligned in a row")
        self.dtype = torch.int8 if self.bits == 8 else torch.uint8 if self.bits else storage  # of the codes
        self.storage_dtype = torch.uint8 if self.bits else storage  # of the pool's rows
        self.head_dim = head_dim
        self.block_size = block_size
        name = f"int{self.bits}" if self.bits else str(storage).removeprefix("torch.")
        self.name = "int4c" if self.per_channel else name

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def values(self) -> Codec:
        """The format of the FULL values beside keys in this one: itself, but int4 beside int4c keys."""
        return Codec("int4", self.head_dim, self.block_size) if self.per_channel else self

    @property
    def width(self) -> int:
        """Elements of a vector's codes."""
        return self.head_dim * self.bits // 8 if self.quantized else self.head_dim

    @property
    def row_width(self) -> int:
        """Elements of a vector's row in the pool (bytes for the quantised formats: codes, then parameters)."""
        return self.vector_bytes // torch.empty((), dtype=self.storage_dtype).element_size()

    @property
    def vector_bytes(self) -> int:
        """Bytes of one head vector as stored; for int4c, with its share of its block's parameters."""
        if self.per_channel:
            return self.head_dim // 2 + 2 * 2 * self.head_dim // self.block_size
        if self.quantized:
            return bytes_per_vector(self.head_dim, self.bits)
        return self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def relative_error(self) -> float:
        """Expected RMS error of a vector as stored, relative to its elements' RMS, for Gaussian elements:
        a uniform quantiser's step / sqrt(12), the step being the expected range of the elements one
        scale spans (a head vector's, a block's tokens' per channel for int4c) over its levels. Float
        formats: 0."""
        if not self.quantized:
            return 0.0
        spanned = self.block_size if self.per_channel else self.head_dim
        expected_range = 2.0 * NormalDist().inv_cdf((spanned - 0.375) / (spanned + 0.25))  # Blom's approximation
        return expected_range / (2**self.bits - 1) / math.sqrt(12.0)

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Vectors [..., head_dim] as stored: codes [..., width] and params [..., 1 or 2] (or None)."""
        if self.per_channel:
            raise ValueError("int4c encodes whole blocks (BlockPool.write_blocks), not single vectors")
        if not self.quantized:
            return x.to(self.dtype), None
        q = quantize(x, self.bits)
        params = q.scale.unsqueeze(-1) if q.minimum is None else torch.stack((q.scale, q.minimum), -1)
        return q.codes, params

    def pack(self, codes: torch.Tensor, params: torch.Tensor | None) -> torch.Tensor:
        """Codes [..., width] and their params [..., p] as pool rows [..., row_width]."""
        if params is None:
            return codes
        return torch.cat((codes.view(torch.uint8), params.to(SCALE_DTYPE).contiguous().view(torch.uint8)), dim=-1)


class BlockPool:
    def __init__(self, codec: Codec, kv_heads: int, block_size: int, arena: Arena) -> None:
        self.codec = codec
        self.kv_heads = kv_heads
        self.block_size = block_size
        self.arena = arena
        self.device = arena.memory.device
        self._triton = _triton_blocks(self.device)
        self._kernel = _cpu_kernel(self.device)
        self.data = arena.grid((block_size, kv_heads, codec.row_width), codec.storage_dtype)
        self.block_bytes = kv_heads * block_size * codec.vector_bytes
        # One row per entry, as words: what writes and reads index.
        self._rows = _rows(self.data)
        # NOTE: arrays over the grid, updated a table at a time: a compaction gives back and takes
        # thousands of blocks, and a loop over them in Python cost more than its copies.
        self.refs = np.zeros(self.data.shape[0], dtype=np.int32)  # per block: its references (0: not in use)
        self.used_blocks = 0
        self._free: list[int] = []  # a heap of the free blocks inside the pages held: the lowest first
        self._pages: dict[int, int] = {}  # pages held -> their blocks in use
        self.empty_pages = 0  # pages held with no block in use
        arena.pools.append(self)

    @property
    def pages(self) -> list[int]:
        """The arena's pages this pool holds."""
        return list(self._pages)

    @property
    def free_blocks(self) -> list[int]:
        """Its blocks in those pages that no table holds."""
        return sorted(self._free)

    @property
    def capacity_bytes(self) -> int:
        """The arena's memory this pool holds: its pages."""
        return len(self._pages) * self.arena.page_bytes

    def held(self) -> dict[int, int]:
        """The blocks in use and their references."""
        blocks = np.flatnonzero(self.refs)
        return dict(zip(blocks.tolist(), self.refs[blocks].tolist(), strict=True))

    def tensors(self) -> PoolTensors:
        return PoolTensors(self.data, self.codec.name, self.codec.head_dim)

    def pages_needed(self, n: int) -> int:
        """Pages this pool must take to hand out n more blocks."""
        short = n - len(self._free)
        if short <= 0:
            return 0
        per_page = self.arena.page_bytes // self.block_bytes - (self.arena.page_bytes % self.block_bytes > 0)
        return -(-short // per_page)

    def allocate(self, n: int) -> list[int]:
        """n blocks with one reference each; raises ArenaFull (holding nothing more) when the arena has
        no page left for them."""
        if self.pages_needed(n) > self.arena.spare_pages(self):
            raise ArenaFull(f"{self.codec.name} needs {self.pages_needed(n)} more pages of the arena")
        while len(self._free) < n:
            page = self.arena.lend(self)
            self._pages[page] = 0
            self.empty_pages += 1
            for block in self.arena.blocks_in(page, self.block_bytes):
                heapq.heappush(self._free, block)
        ids = [heapq.heappop(self._free) for _ in range(n)]
        blocks = np.array(ids, dtype=np.int64)
        self.refs[blocks] = 1
        self.used_blocks += n
        self._count_in_pages(blocks, 1)
        return ids

    def ref(self, ids: list[int]) -> None:
        np.add.at(self.refs, np.asarray(ids, dtype=np.int64), 1)

    def unref(self, ids: list[int] | np.ndarray, keep: int = 0) -> np.ndarray:
        """Drop one reference to each block. Of those no one holds any more the caller keeps the
        lowest `keep`, with one reference each as if allocated, and the rest are free; return the
        kept ones. NOTE: a rebuild keeps what it lets go of for its fresh blocks, so that thousands
        of blocks do not go through the free list and straight back out."""
        blocks = np.asarray(ids, dtype=np.int64)
        np.subtract.at(self.refs, blocks, 1)
        freed = np.unique(blocks[self.refs[blocks] == 0])
        kept, freed = freed[:keep], freed[keep:]
        self.refs[kept] = 1
        self.used_blocks -= len(freed)
        for b in freed.tolist():
            heapq.heappush(self._free, b)
        self._count_in_pages(freed, -1)
        return kept

    def _count_in_pages(self, blocks: np.ndarray, sign: int) -> None:
        """Count blocks that came into use (sign 1) or out of it (-1) in their pages' tallies."""
        pages, counts = np.unique(blocks * self.block_bytes // self.arena.page_bytes, return_counts=True)
        for page, count in zip(pages.tolist(), counts.tolist(), strict=True):
            before = self._pages[page]
            self._pages[page] = after = before + sign * count
            self.empty_pages += (after == 0) - (before == 0)

    def give_back_empty_pages(self) -> None:
        """Return to the arena the pages none of whose blocks is in use."""
        if not self.empty_pages:
            return
        empty = {page for page, used in self._pages.items() if used == 0}
        self._free = [b for b in self._free if self._page(b) not in empty]
        heapq.heapify(self._free)
        for page in empty:
            del self._pages[page]
            self.arena.give_back(page)
        self.empty_pages = 0

    def _page(self, block: int) -> int:
        return block * self.block_bytes // self.arena.page_bytes

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Store vectors x [n, kv_heads, head_dim] as entries `rows` (block * block_size + offset)."""
        if self._triton is not None:
            self._triton.encode_rows(x, rows, self.data, self.codec.name)
        elif self._kernel is not None:
            self._kernel.encode_rows(x, rows, self.data, FORMAT_CODES[self.codec.name])
        else:
            self.write_encoded(rows, *self.codec.encode(x))

    def write_blocks(self, blocks: torch.Tensor, x: torch.Tensor, counts: torch.Tensor) -> None:
        """int4c: store blocks of keys x [n, block_size, kv_heads, head_dim] whole, block i holding the
        first counts[i] of its vectors, into the pool's blocks `blocks` [n]."""
        codes, params = quantize_channels(x, counts)  # [n, bs, heads, D / 2], [n, heads, 2, D]
        n, bs, heads, _ = codes.shape
        # A head's 2 x D parameters, in order, a share after the codes of each of the block's rows.
        tails = params.reshape(n, heads, bs, -1).transpose(1, 2)
        self.data[blocks] = torch.cat((codes, tails.contiguous().view(torch.uint8)), dim=-1)

    def copy_blocks(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy whole blocks `source` [n] over blocks `target` [n], as stored."""
        self.data[target] = self.data[source]

    def write_encoded(self, rows: torch.Tensor, codes: torch.Tensor, params: torch.Tensor | None) -> None:
        """Store vectors already in this format: codes [n, kv_heads, width], params [n, kv_heads, p]."""
        self._scatter(rows, _rows(self.codec.pack(codes, params).contiguous()))

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Entries `rows` as stored, codes and params together (for `write_rows`, in a pool of the same format)."""
        return self._gather(rows)

    def write_rows(self, rows: torch.Tensor, stored: torch.Tensor) -> None:
        """Store entries read by `read_rows` as entries `rows`."""
        self._scatter(rows, stored)

    def _scatter(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        if self._triton is not None:
            self._triton.copy_rows(values, self._rows, None, rows)
        else:
            self._rows[rows] = values

    def _gather(self, rows: torch.Tensor) -> torch.Tensor:
        if self._triton is None:
            return self._rows.index_select(0, rows)
        out = self._rows.new_empty(len(rows), self._rows.shape[1])
        self._triton.copy_rows(self._rows, out, rows, None)
        return out


def _triton_blocks(device: torch.device) -> ModuleType | None:
    """The Triton block kernels when they serve `device`, else None (the torch path)."""
    # Imported here: `import confkv` reaches this module, and `python -m confkv.kv.kernels` must
    # not find its own module already imported; triton is imported only where it serves.
    from confkv.kv.kernels import triton_enabled

    if not triton_enabled(device):
        return None
    from confkv.kv import triton_blocks

    return triton_blocks


def _cpu_kernel(device: torch.device) -> ModuleType | None:
    """The C++ extension when it serves `device` (CPU, built or buildable, not disabled), else None."""
    from confkv.kv.kernels import load_kernel  # imported here for the reason above

    return load_kernel() if device.type == "cpu" else None


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t [..., kv_heads, width] (contiguous) as one row per entry, in the widest integer type that
    divides a row's bytes: a copy of rows then moves words, not single bytes."""
    row_bytes = t.shape[-2] * t.shape[-1] * t.element_size()
    word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8) if row_bytes % w.itemsize == 0)
    return t.view(-1, t.shape[-2], t.shape[-1]).view(torch.uint8).view(-1, row_bytes).view(word)
