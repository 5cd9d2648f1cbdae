"""The KV cache's memory: one byte tensor allocated once, lent in pages to one storage format at a time.

Every storage format's pool views the whole arena as its own grid of blocks (block b of a format whose
blocks are B bytes is bytes [bB, (b+1)B)), and may use the blocks that lie inside pages it holds.
A page that a pool empties goes back to the arena, so memory one format used in a burst serves any
format afterwards, and nothing is allocated after start-up, whatever the mix of formats. Pages are
handed out lowest first, as pools hand out their blocks, so that use gathers at the bottom and
pages empty from the top. A page is zeroed when it is lent: a pool's new blocks read as zeros, as
they did when pools were tensors of their own.

On CPU the tensor is allocated without being touched, so a page costs resident memory only once it
is first lent; on CUDA the whole arena is device memory from the start, as vLLM's KV cache is.
On Linux the CPU arena asks for transparent huge pages (see huge_page_memory), so residency grows in
steps of 2 MiB rather than of a page.
"""

from __future__ import annotations

import ctypes
import heapq
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from confkv.kv.block_pool import BlockPool

# A page holds this many of the largest blocks (the model dtype's) where the budget is large enough:
# a block that straddles a page boundary (it cannot be used) then costs at most 1/32 of a page.
BLOCKS_PER_PAGE = 32
# Pages beyond the budget: each storage format in use may hold one page partly used (the model's dtype,
# the storage format, KEY_ONLY values, int4c keys), and pages lose their straddling blocks.
SPARE_PAGES = 4


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
MADV_HUGEPAGE = 14


def huge_page_memory(nbytes: int) -> torch.Tensor:
    """`nbytes` of CPU memory, untouched, aligned to a huge page and advised to be backed by huge pages.

    NOTE: decode attention reads a row's blocks scattered over the arena, a few KiB each; with 4 KiB
    pages nearly every block costs a TLB miss, and the kernel waits on page walks rather than on memory
    (benchmarks/decode_kernel: int8 read about 1.6x faster backed by huge pages, on this project's CPU).
    Where the kernel ignores the advice (THP off, not Linux) the memory is used as it is.
    """
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    memory = raw[offset : offset + nbytes]  # a view: it keeps the whole allocation alive
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(memory.data_ptr()), ctypes.c_size_t(nbytes), MADV_HUGEPAGE)
    return memory


class ArenaFull(RuntimeError):
    """Raised when a pool needs a page and the arena has none free."""


class Arena:
    def __init__(
        self, capacity_bytes: int, page_bytes: int, device: torch.device | str = "cpu", huge_pages: bool = True
    ) -> None:
        """At most `capacity_bytes` (one page at least), in whole pages of `page_bytes`; on CPU backed by
        huge pages unless `huge_pages` is false (a benchmark's comparison)."""
        self.page_bytes = page_bytes
        self.num_pages = max(1, capacity_bytes // page_bytes)
        nbytes = self.num_pages * page_bytes
        if torch.device(device).type == "cpu" and huge_pages:
            self.memory = huge_page_memory(nbytes)
        else:
            self.memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._free = list(range(self.num_pages))  # a heap: the lowest page first
        self._touched: set[int] = set()  # pages ever lent: on CPU, the part of the arena made resident
        self.pools: list[BlockPool] = []  # what borrows pages; asked for its empty ones when none is free

    @classmethod
    def for_budget(cls, budget_bytes: int, largest_block_bytes: int, device: torch.device | str) -> Arena:
        """An arena for a budget of `budget_bytes` whose largest block is `largest_block_bytes`: pages of
        BLOCKS_PER_PAGE such blocks, or fewer so that a page is at most 1/64 of the budget (one block at
        least), and SPARE_PAGES more than the budget (at most 1/16 of it where it holds 64 blocks)."""
        blocks = max(1, min(BLOCKS_PER_PAGE, budget_bytes // (64 * largest_block_bytes)))
        page = blocks * largest_block_bytes
        return cls(budget_bytes + SPARE_PAGES * page, page, device)

    @property
    def nbytes(self) -> int:
        return self.memory.numel()

    @property
    def touched_bytes(self) -> int:
        return len(self._touched) * self.page_bytes

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def spare_pages(self, *takers: BlockPool) -> int:
        """Pages the `takers` could be lent: the free ones, and those other pools hold empty."""
        return len(self._free) + sum(pool.empty_pages for pool in self.pools if pool not in takers)

    def lend(self, taker: BlockPool) -> int:
        """A free page for `taker`, zeroed; raises ArenaFull when there is none, even once every other
        pool has given back the pages it holds empty (the taker's own would only come back to it)."""
        if not self._free:
            for pool in self.pools:
                if pool is not taker:
                    pool.give_back_empty_pages()
        if not self._free:
            raise ArenaFull(f"all {self.num_pages} pages of {self.page_bytes} bytes are lent")
        page = heapq.heappop(self._free)
        self._touched.add(page)
        self.memory[page * self.page_bytes : (page + 1) * self.page_bytes].zero_()
        return page

    def give_back(self, page: int) -> None:
        heapq.heappush(self._free, page)

    def grid(self, block_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The whole arena as blocks of `block_shape` elements of `dtype`: [blocks, *block_shape]."""
        block_bytes = torch.Size(block_shape).numel() * torch.empty((), dtype=dtype).element_size()
        blocks = self.nbytes // block_bytes
        return self.memory[: blocks * block_bytes].view(dtype).view(blocks, *block_shape)

    def blocks_in(self, page: int, block_bytes: int) -> range:
        """The blocks of a grid of `block_bytes` blocks that lie wholly inside `page`."""
        start, end = page * self.page_bytes, (page + 1) * self.page_bytes
        return range(-(-start // block_bytes), end // block_bytes)
