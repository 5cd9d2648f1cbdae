"""Tensor parallelism's process group: one process per rank, each holding a share of every layer's
attention heads and MLP (transformers' tensor-parallel plan shards the weights), joined by
`torch.distributed` (NCCL on CUDA, gloo on the CPU).

What a rank observes of attention is a mean over its own heads; `RankGroup.mean` turns it into the
mean over all heads, the same on every rank, so that every rank's compressor scores, keeps and drops
the same entries."""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass

import torch
import torch.distributed as dist

from confkv.models.loader import KVShape

# How long a collective may wait for a rank before it raises: a rank that died or hangs ends the
# step with an error instead of a silent hang.
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass(frozen=True)
class RankGroup:
    """This process's rank among `size` (size 1: no group, every method an identity)."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where the collectives' tensors live (CUDA for NCCL)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def mean(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of `tensor` over the ranks (each holds a mean over its own, equally many, heads)."""
        if self.size == 1:
            return tensor
        reduced = tensor.float().contiguous()
        dist.all_reduce(reduced)
        return (reduced / self.size).to(tensor.dtype)

    def gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `tensor` (one row per local head) concatenated along `dim`, rank 0's first."""
        if self.size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts, dim=dim)

    def share(self, obj: object) -> object:
        """Rank 0's `obj` on every rank (what only rank 0 decides, such as a sampled token)."""
        if self.size == 1:
            return obj
        data = None
        if self.is_leader:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.long, device=self.device)
        dist.broadcast(size, 0)
        if data is None:
            data = torch.empty(int(size), dtype=torch.uint8, device=self.device)
        dist.broadcast(data, 0)
        return obj if self.is_leader else pickle.loads(data.cpu().numpy().tobytes())

    def least(self, value: int) -> int:
        """The smallest of every rank's `value` (a KV budget every rank can hold)."""
        if self.size == 1:
            return value
        smallest = torch.tensor([value], dtype=torch.long, device=self.device)
        dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
        return int(smallest)

    def agree(self, *values: int) -> bool:
        """Whether every rank holds the same `values` (a check that the ranks have not diverged)."""
        if self.size == 1:
            return True
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        low, high = mine.clone(), mine.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN)
        dist.all_reduce(high, op=dist.ReduceOp.MAX)
        return bool(torch.equal(low, high))


SINGLE = RankGroup()  # one process, no group


def join(rank: int, size: int, address: str, port: int, device: torch.device) -> RankGroup:
    """Join the group of `size` ranks that rank 0 hosts at `address:port` (blocks until all joined)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    # transformers' tensor-parallel loading reads these, as torchrun would have set them
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(size))
    dist.init_process_group(
        backend, init_method=f"tcp://{address}:{port}", rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    return RankGroup(rank, size, device)


def check_tensor_parallel(config, size: int) -> None:
    """Refuse a family without a tensor-parallel plan in transformers, and a size that does not
    divide the model's attention and KV heads (with the sizes that do)."""
    if size == 1:
        return
    if not getattr(config, "base_model_tp_plan", None):
        raise ValueError(
            f"{config.model_type} models have no tensor-parallel plan in transformers: serve them with "
            "tensor_parallel_size 1"
        )
    heads, kv_heads = config.num_attention_heads, KVShape.of(config).num_kv_heads
    if heads % size or kv_heads % size:
        fits = [n for n in range(1, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
        raise ValueError(
            f"tensor_parallel_size {size} does not divide this model's {heads} attention heads and {kv_heads} KV "
            f"heads: each rank holds whole heads. Sizes that do: {', '.join(map(str, fits))}"
        )
