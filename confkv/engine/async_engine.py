"""Runs `LLMEngine` on its own thread and gives the asyncio side per-request output streams.

The HTTP side never touches the engine: it sends commands (add, abort, snapshot) through a
thread-safe inbox and reads `RequestOutput`s from an asyncio queue per request. A request whose consumer goes away
(client disconnect, cancelled task) is aborted and its KV memory is returned.

The loop is supervised. A request's own failure ends that request inside the step (`LLMEngine`);
should a step raise anyway, every request in flight gets an error, the engine is reset (every
request ended, the prefix cache emptied, every byte checked back) and the loop goes on, up to
`max_restarts` times. Past that, or if the reset finds memory unaccounted for, the loop is dead:
`error` says why, `on_dead` is told (the server exits non-zero so that its orchestrator restarts
it), and requests are refused with `EngineDeadError`. A step that hangs (a deadlock, a device that
stopped answering) cannot be interrupted from Python: once a step has run past `iteration_timeout`,
a watchdog declares the loop dead the same way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

from confkv.compress.config import CompressionParams
from confkv.engine.llm_engine import EngineSnapshot, LLMEngine, StepStats
from confkv.engine.outputs import RequestOutput
from confkv.engine.sequence import FinishReason, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A request refused because the engine loop has stopped; the server needs a restart. (Requests
    in flight when it stops get a final output with the error instead.)"""


class EngineStalledError(RuntimeError):
    """Why the loop was declared dead when a step ran past the iteration timeout."""


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    compression: CompressionParams | None
    loop: asyncio.AbstractEventLoop
    stream: asyncio.Queue


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Snapshot:
    answer: concurrent.futures.Future


@dataclass
class _CutOff:
    error: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], object]
    answer: concurrent.futures.Future


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[StepStats], None] | None = None,
        max_restarts: int = 0,
        on_dead: Callable[[BaseException], None] | None = None,
        iteration_timeout: float = 0.0,
    ) -> None:
        self.llm_engine = engine
        self.on_step = on_step
        self.max_restarts = max_restarts
        self.on_dead = on_dead
        self.iteration_timeout = iteration_timeout  # seconds a step may take; 0: no watchdog
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.error: BaseException | None = None  # why the loop died for good
        self.restarts = 0  # times the loop was reset and went on after a step raised
        self.restarting = False  # between a crash and the reset's end: not ready, still alive
        # Unix time of the loop's last pass; it stops moving when a step hangs or the loop dies.
        self.heartbeat = time.time()
        self._last_snapshot = engine.snapshot()

    # ----- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()
        if self.iteration_timeout > 0:
            threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._inbox.put(None)  # wake the loop
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        """The loop runs or is being reset after a crash (liveness)."""
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def is_running(self) -> bool:
        """The loop runs and takes requests now (readiness)."""
        return self.is_alive and not self.restarting

    def check_running(self) -> None:
        """Raise EngineDeadError unless the loop is alive (before a request is accepted, so that a
        stream is refused before its first byte, not cut after it). A request sent while the loop
        is being reset waits in the inbox and is served after."""
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop is not running: {self.error!r}")

    def snapshot(self, timeout: float = 0.2) -> EngineSnapshot:
        """The engine's accounting, taken by the loop between two steps. When the loop is inside a
        step longer than `timeout` (a long prefill), the answer is the last snapshot it took, for an
        earlier caller: scrapes stay fast, one scrape behind. A stopped loop's engine is read here."""
        if self._thread is None or not self._thread.is_alive():
            self._last_snapshot = self.llm_engine.snapshot()  # no other thread touches the engine
            return self._last_snapshot
        query = _Snapshot(concurrent.futures.Future())
        self._inbox.put(query)
        with contextlib.suppress(concurrent.futures.TimeoutError):
            return query.answer.result(timeout)
        return self._last_snapshot

    def lost(self, why: str) -> None:
        """Something the engine cannot go on without is gone (a tensor-parallel rank): the loop is
        dead, every request in flight gets `why`, and the server exits to be restarted."""
        self._stopping.set()
        self._inbox.put(None)
        self._die(RuntimeError(why), why)

    def cut_off(self, error: str) -> None:
        """End every request in flight now (shutdown past its grace period): each gets a final
        output, finish reason `abort` with `error`, and its memory comes back."""
        self._inbox.put(_CutOff(error))

    def call(self, fn: Callable[[LLMEngine], object]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the loop between two steps, where nothing else touches the engine;
        the future holds its result or its exception."""
        call = _Call(fn, concurrent.futures.Future())
        self._inbox.put(call)
        return call.answer

    # ----- requests ----------------------------------------------------------------------
    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        compression: CompressionParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.check_running()
        request_id = request_id or uuid.uuid4().hex
        stream: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._streams[request_id] = (loop, stream)
        self._inbox.put(_Add(request_id, prompt_token_ids, params, compression, loop, stream))
        finished = False
        try:
            while not finished:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._inbox.put(_Abort(request_id))

    # ----- the loop thread ---------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                with torch.inference_mode():
                    self._loop()
                return  # stopped
            except BaseException as exc:  # the loop must never die silently
                log.exception("engine loop crashed")
                if self._recovered(exc):
                    continue
                if self.error is None:  # else the watchdog declared it dead already
                    self._die(exc, f"engine loop crashed: {exc!r}")
                return

    def _watch(self) -> None:
        """Declare the loop dead once a step has run past `iteration_timeout`. The heartbeat moves at
        least every half second while the loop waits for work, so only a step can make it stale."""
        while not self._stopping.wait(min(1.0, self.iteration_timeout / 4)):
            stalled = time.time() - self.heartbeat
            if self.error is None and stalled > self.iteration_timeout and not self.restarting:
                message = (
                    f"an engine step has run for {stalled:.0f} s, past engine_iteration_timeout "
                    f"({self.iteration_timeout:g} s); the engine loop is hung"
                )
                log.critical(message)
                self._stopping.set()  # should the step ever return, the loop stops after it
                self._die(EngineStalledError(message), message)
                return

    def _die(self, error: BaseException, why: str) -> None:
        self.error = error
        self._fail_in_flight(f"{why}; the server is exiting, retry after its restart")
        if self.on_dead is not None:
            self.on_dead(error)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self.heartbeat = time.time()
            self._drain_inbox(block=not self.llm_engine.has_unfinished())
            if self.llm_engine.has_unfinished():
                outputs = self.llm_engine.step()
                self._dispatch(outputs)
                if self.on_step and self.llm_engine.last_step:
                    self.on_step(self.llm_engine.last_step)

    def _recovered(self, exc: BaseException) -> bool:
        """Fail the requests in flight and reset the engine, if restarts are left; True if it may go on."""
        if self.restarts >= self.max_restarts or not isinstance(exc, Exception):
            return False
        self.restarting = True
        try:
            reason = f"engine loop crashed: {exc!r}; the engine restarted, retry the request"
            self._fail_in_flight(reason)
            with torch.inference_mode():
                self.llm_engine.reset(reason)
        except Exception:
            log.exception("the engine could not be reset after the crash")
            return False
        finally:
            self.restarting = False
        self.restarts += 1
        log.error("engine loop restarted (%d of %d restarts) after: %r", self.restarts, self.max_restarts, exc)
        return True

    def _fail_in_flight(self, error: str) -> None:
        for request_id, (loop, stream) in list(self._streams.items()):
            _send(loop, stream, self._lost(request_id, error))
        self._streams.clear()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, _Add):
                self._add(item)
            elif isinstance(item, _Abort):
                self._streams.pop(item.request_id, None)
                self.llm_engine.abort(item.request_id)
            elif isinstance(item, _Snapshot):
                self._last_snapshot = self.llm_engine.snapshot()
                item.answer.set_result(self._last_snapshot)
            elif isinstance(item, _CutOff):
                self._cut_off(item.error)
            elif isinstance(item, _Call):
                try:
                    item.answer.set_result(item.fn(self.llm_engine))
                except Exception as exc:  # the caller's to handle; the loop goes on
                    item.answer.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add(self, cmd: _Add) -> None:
        try:
            self.llm_engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cmd.compression)
        except Exception as exc:  # a bad request fails alone
            self._streams.pop(cmd.request_id, None)
            _send(cmd.loop, cmd.stream, exc)

    def _cut_off(self, error: str) -> None:
        for request_id, target in list(self._streams.items()):
            out = self.llm_engine.abort(request_id) or self._lost(request_id, error)
            out.finish_reason, out.error = FinishReason.ABORT, error
            _send(*target, out)
        self._streams.clear()

    def _lost(self, request_id: str, error: str) -> RequestOutput:
        """The final output of a request in flight when the loop stopped: it failed, with what it had."""
        seq = self.llm_engine.outputs.requests.get(request_id)
        prompt, completion = (seq.num_prompt_tokens, len(seq.output_token_ids)) if seq is not None else (0, 0)
        return RequestOutput(request_id, [], "", True, "error", prompt, completion, error=error)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is None:
                continue  # consumer already gone
            if out.finished:
                del self._streams[out.request_id]
            _send(*target, out)


def _send(loop: asyncio.AbstractEventLoop, stream: asyncio.Queue, item: object) -> None:
    # RuntimeError: the consumer's event loop is closed (shutdown), nobody is left to tell.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(stream.put_nowait, item)
