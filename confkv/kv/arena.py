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
"""

from __future__ import annotations

import heapq
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


class ArenaFull(RuntimeError):
    """Raised when a pool needs a page and the arena has none free."""


class Arena:
    def __init__(self, capacity_bytes: int, page_bytes: int, device: torch.device | str = "cpu") -> None:
        """At most `capacity_bytes` (one page at least), in whole pages of `page_bytes`."""
        self.page_bytes = page_bytes
        self.num_pages = max(1, capacity_bytes // page_bytes)
        self.memory = torch.empty(self.num_pages * page_bytes, dtype=torch.uint8, device=device)
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
