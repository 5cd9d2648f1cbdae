"""Tensor parallelism: rank 0's engine decides, the other ranks follow.

Every rank runs the same `LLMEngine` over its share of the heads (its own KV store). Rank 0 takes
the requests; before each step it sends its followers a `StepOrder`, what changed since the last
one (requests added and aborted, a reset) and its clock, and each follower applies it and steps.
Given the same orders, the engines decide the same: what attention observed is averaged over the
ranks before anything is scored (`RankObserver`), the sampled tokens are rank 0's, and a check after
every step (`LLMEngine._check_ranks`) stops the engine if any rank's accounting differs.

The followers are child processes of the server (`Followers`); one that exits is noticed at once
and stops the server, so that its orchestrator restarts the whole group.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from confkv.compress.compressor import Compressor
from confkv.models.parallel import RankGroup

log = logging.getLogger(__name__)
START_TIMEOUT_S = 600.0  # how long rank 0 waits for its followers to load their shares
STOP_GRACE_S = 5.0


@dataclass
class StepOrder:
    """What a follower does before its next step: `commands` in order (each an `LLMEngine` method's
    name and arguments), then one step with rank 0's clock `now`. `stop`: leave instead."""

    commands: list[tuple[str, tuple]] = field(default_factory=list)
    now: float = 0.0
    stop: bool = False


class RankObserver:
    """The compressor's view of attention, averaged over every rank's heads before it scores."""

    def __init__(self, compressor: Compressor, ranks: RankGroup) -> None:
        self.compressor = compressor
        self.ranks = ranks

    def on_attention(self, seq_id: int, layer: int, rows: torch.Tensor) -> None:
        self.compressor.on_attention(seq_id, layer, self.ranks.mean(rows))

    def on_decode_attention(self, layer: int, seq_ids: list[int], rows: torch.Tensor) -> None:
        self.compressor.on_decode_attention(layer, seq_ids, self.ranks.mean(rows))

    def audit_keys(self, seq_id: int, layer: int) -> torch.Tensor | None:
        return self.compressor.audit_keys(seq_id, layer)

    def on_audit(self, seq_id: int, layer: int, recall: torch.Tensor, dropped_mass: torch.Tensor | None) -> None:
        recall = self.ranks.gather(recall)  # one row per head: every rank's
        mass = self.ranks.mean(dropped_mass) if dropped_mass is not None else None
        self.compressor.on_audit(seq_id, layer, recall, mass)


def follow(engine, orders: multiprocessing.connection.Connection) -> None:
    """A follower's loop: apply each order from rank 0, then step, until told to stop or rank 0 is gone."""
    with torch.inference_mode():
        while True:
            try:
                order: StepOrder = orders.recv()
            except EOFError:
                log.warning("rank 0 is gone: this rank stops")
                return
            if order.stop:
                return
            for name, args in order.commands:
                getattr(engine, name)(*args)
            engine.step(order.now)


class Followers:
    """Rank 0's side of the group: the follower processes, the pipes that carry their orders, and a
    watch that reports the first one to exit (`on_lost`)."""

    def __init__(self, target: Callable, size: int, args: tuple, on_lost: Callable[[str], None] | None = None) -> None:
        """Start ranks 1..size-1 as `target(rank, orders, *args)` in fresh processes."""
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or CUDA state copied
        self.on_lost = on_lost
        self._pipes = []
        self.processes = []
        for rank in range(1, size):
            mine, theirs = context.Pipe()
            process = context.Process(
                target=target, args=(rank, theirs, *args), name=f"conf-kv-rank-{rank}", daemon=True
            )
            process.start()
            theirs.close()
            self._pipes.append(mine)
            self.processes.append(process)
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="tensor-parallel-watch", daemon=True).start()

    def send(self, order: StepOrder) -> None:
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send(order)
            except (BrokenPipeError, OSError) as exc:
                raise RuntimeError(f"tensor-parallel rank {rank} is gone ({exc}); the server must restart") from exc

    def stop(self) -> None:
        self._stopping.set()
        for pipe in self._pipes:
            with contextlib.suppress(BrokenPipeError, OSError):
                pipe.send(StepOrder(stop=True))
        for process in self.processes:
            process.join(STOP_GRACE_S)
            if process.is_alive():
                process.kill()

    def _watch(self) -> None:
        sentinels = {process.sentinel: rank for rank, process in enumerate(self.processes, start=1)}
        ended = multiprocessing.connection.wait(list(sentinels))
        if self._stopping.is_set():
            return
        process = self.processes[sentinels[ended[0]] - 1]
        process.join(1.0)
        message = (
            f"tensor-parallel rank {sentinels[ended[0]]} (process {process.pid}) exited with status "
            f"{process.exitcode}: every rank holds a share of each layer, so the server cannot go on"
        )
        log.critical(message)
        if self.on_lost is not None:
            self.on_lost(message)
