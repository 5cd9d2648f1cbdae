"""Asynchronous compression (`async_compression`): compressions planned beside the forward pass.

The sequences whose compression fell due at the end of a step sit the next step out. While the
engine's thread runs that step's forward pass over the others, this worker's thread plans their
compressions (`Compressor.plan`: prediction, scores, tier plans), which read only their own cache;
after the forward pass the engine's thread applies them (`Compressor.apply`: compaction), so
blocks are taken and given back on one thread and one stream only. On CUDA the worker plans on a
stream of its own, which first waits for everything the engine's stream queued before (the
entries and observations it reads); the engine's stream waits for the worker's before it applies
the plans. Torch releases the GIL inside its operators, so on the CPU the two threads overlap
where either one computes.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import torch

from confkv.compress.state import CompressionPlan, TrackedSequence

Planner = Callable[[list[TrackedSequence]], list[CompressionPlan]]


class CompressionWorker:
    """One thread that plans compressions (`plan`) while the caller runs a forward pass."""

    def __init__(self, plan: Planner, device: torch.device) -> None:
        self._plan = plan
        self._device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="confkv-compress")
        weakref.finalize(self, self._pool.shutdown, wait=False)

    def start(self, due: list[TrackedSequence]) -> Future[tuple[list[CompressionPlan], float]]:
        """Plan the compressions of `due` on the worker's thread; the future gives them and the seconds taken."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
        return self._pool.submit(self._run, due)

    def finish(self, job: Future[tuple[list[CompressionPlan], float]]) -> tuple[list[CompressionPlan], float]:
        """Wait for a started job; the caller's stream then waits for the worker's."""
        plans, seconds = job.result()
        if self._stream is not None:
            torch.cuda.current_stream(self._device).wait_stream(self._stream)
        return plans, seconds

    def _run(self, due: list[TrackedSequence]) -> tuple[list[CompressionPlan], float]:
        started = time.perf_counter()
        stream = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with torch.inference_mode(), stream:  # both are per thread: the engine's do not reach here
            plans = self._plan(due)
        return plans, time.perf_counter() - started
