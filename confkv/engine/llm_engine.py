"""The synchronous engine: one `step()` schedules, runs the model, samples and emits outputs.

It owns the scheduler, the model runner and the KV store and is driven either directly (tests,
benchmarks) or by `AsyncEngine`'s loop thread (the server). Sequences finish and are preempted
only through the scheduler, which tells the compressor, the prefix cache and the outputs.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from confkv.compress.compressor import Compressor
from confkv.compress.config import CompressionConfig, CompressionParams, resolve
from confkv.compress.predictor.calibration import Calibration, Source
from confkv.compress.predictor.misses import MissLog
from confkv.compress.predictor.online import Confidence, FutureValue, calibrations_for, load_confidence
from confkv.compress.spans import word_starts
from confkv.engine.compression_worker import CompressionWorker
from confkv.engine.listeners import CompressionListener, PrefixCacheListener
from confkv.engine.model_runner import ModelRunner
from confkv.engine.outputs import Outputs, RequestOutput
from confkv.engine.sampler import History, SampleOutput, prompt_logprobs, sample
from confkv.engine.scheduler import Scheduler, SchedulerOutput, SequenceListener
from confkv.engine.sequence import FinishReason, SamplingParams, ScheduledChunk, Sequence, SequenceStatus
from confkv.engine.tensor_parallel import Followers, RankObserver, StepOrder
from confkv.kv.kv_store import KVBudgetExceeded, KVStore
from confkv.kv.prefix_cache import PrefixCache
from confkv.models.parallel import SINGLE, RankGroup

log = logging.getLogger(__name__)
# The profiler's name for the compression after a step (lookahead included): its share of the step.
COMPRESS_EVENT = "conf_kv::compress"


@dataclass
class EngineConfig:
    max_cache_bytes: int
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    prefix_cache: bool = False  # keep finished requests' KV for reuse by the requests that follow
    lru_k: int = 2  # the prefix cache's replacement policy, LRU-K
    # Plan due compressions on a worker thread beside the next step's forward pass; the sequences
    # they compress sit that step out (`confkv.engine.compression_worker`).
    async_compression: bool = False
    # Observations each entry keeps for a value predictor that arrives later (one is being fitted
    # in the background): the store's rows are laid out once, at build.
    history_steps: int = 0


@dataclass
class StepStats:
    """What one step did, for metrics and benchmarks."""

    duration_s: float
    num_seqs: int
    num_tokens: int
    num_preempted: int
    compression_s: float = 0.0  # compression on the critical path: what the step waited for
    compression_background_s: float = 0.0  # compression planned beside the forward pass (`async_compression`)
    queue_s: list[float] = field(default_factory=list)  # waits of the sequences admitted in this step
    num_out_of_memory: int = 0  # requests failed for want of KV memory (too big, or an OOM in the forward)
    # Requests failed alone by an exception in their own work, by stage (forward, sampling,
    # detokenization, compression); the others in the step went on.
    failures: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's accounting at one moment, as plain numbers other threads may read."""

    num_running: int
    num_waiting: int
    capacity_bytes: int
    allocated_bytes: int  # the arena every block lives in, allocated at start
    touched_bytes: int  # its pages ever lent (on CPU, the resident part)
    kv_bytes: dict[str, int]  # by pool: running requests, prefix cache, audit of dropped keys
    entries: dict[str, int]  # (layer, token) entries of running requests, by tier
    format_bytes: dict[str, int]  # the arena's pages each storage format's pool holds
    bookkeeping_bytes: int  # the parked caches' tables, positions and key norms
    evicted: dict[str, int]  # (layer, token) entries removed, by reason
    prefix_queries: int = 0  # the prefix cache's counters (zero without one)
    prefix_hits: int = 0
    prefix_reused_tokens: dict[str, int] = field(default_factory=dict)  # by how their entry was parked
    prefix_evictions: dict[str, int] = field(default_factory=dict)  # by reason
    prefix_warmup_tokens: int = 0

    @property
    def used_bytes(self) -> int:
        """Running requests and the prefix cache: what the budget counts."""
        return self.kv_bytes["running"] + self.kv_bytes["prefix"]


class LLMEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: EngineConfig,
        compression: CompressionConfig | None = None,
        future_value: FutureValue | None = None,
        calibrations: dict[Source, Calibration] | None = None,
        ranks: RankGroup = SINGLE,
    ) -> None:
        """`calibrations`: the retention confidence's tables (None: those that go with `future_value`,
        or a server's for this model; `calibrations_for`). `ranks`: the tensor-parallel group this
        engine is a rank of (`confkv.engine.tensor_parallel`); rank 0 sends the others their orders
        once `followers` is set."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config
        self.compression_config = compression or CompressionConfig()
        cfg = model.config
        self.store = KVStore.for_model(
            model,
            config.max_cache_bytes,
            self.compression_config.key_only_value_bits,
            max(future_value.history_steps if future_value else 0, config.history_steps),
            self.compression_config.key_rotation,
            ranks,
        )
        self.compression = Compressor(
            self.store,
            self.compression_config.pressure_rate_ceiling,
            self.compression_config.pressure_rate_step,
            future_value,
            calibrations_for(future_value, model.config, self.compression_config.prediction_window)
            if calibrations is None
            else calibrations,
            word_starts(tokenizer),
        )
        self.ranks = ranks
        self.observer = RankObserver(self.compression, ranks) if ranks.size > 1 else self.compression
        self.followers: Followers | None = None  # rank 0 of a tensor-parallel group: the other ranks
        self._orders: list[tuple[str, tuple]] = []  # what the followers apply before the next step
        self.runner = ModelRunner(model, self.store)
        self.prefix_cache = PrefixCache(self.store, config.lru_k) if config.prefix_cache else None
        if self.prefix_cache is not None:
            self.store.reclaim = self.prefix_cache.evict_one
        self.outputs = Outputs(tokenizer.backend_tokenizer)
        # In this order: the compression metrics are read before the prefix cache takes the KV,
        # and the final output carries them.
        listeners: list[SequenceListener] = [CompressionListener(self.compression)]
        if self.prefix_cache is not None:
            listeners.append(PrefixCacheListener(self.prefix_cache))
        listeners.append(self.outputs)
        self.scheduler = Scheduler(
            self.store,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.prefix_cache,
            self.compression.squeeze,
            listeners,
        )
        self.eos_token_ids = _eos_ids(model, tokenizer)
        self.max_model_len = _max_model_len(cfg)
        self._slides = any(self.store.windows)  # the model has sliding-window layers
        self.last_step: StepStats | None = None
        self.worker = CompressionWorker(self.compression.plan, self.store.device) if config.async_compression else None
        self._due: list[Sequence] = []  # compressions due at the end of the last step (`async_compression`)
        self._failures: dict[str, int] = {}  # this step's requests failed alone, by stage (`StepStats.failures`)

    # ----- requests ----------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        compression: CompressionParams | None = None,
    ) -> Sequence:
        """Queue a request; `compression` None means the server's defaults, without stats."""
        if not prompt_token_ids:
            raise ValueError("the prompt has no tokens")
        if request_id in self.outputs.requests:
            raise ValueError(f"request id {request_id!r} is already running")
        seq = Sequence(request_id, list(prompt_token_ids), params)
        self.outputs.add(seq)
        compression = compression or self.default_compression()
        seq.prefix_fingerprint = compression.fingerprint
        self.store.set_storage(seq.seq_id, compression.kv_cache_dtype)
        self.compression.register(seq.seq_id, compression, seq.num_prompt_tokens)
        seq.prefill_tail = self.compression.prefill_tail(seq.seq_id)
        self.scheduler.add(seq)
        self._order("add_request", request_id, prompt_token_ids, params, compression)
        return seq

    def warm_up(self, prompts: list[list[int]], compression: CompressionParams) -> int:
        """Prefill `prompts` into the prefix cache (before serving); return the tokens now cached."""
        if self.prefix_cache is None:
            raise ValueError("warm-up needs the prefix cache; enable it or drop the warm-up prompts")
        for i, prompt in enumerate(prompts):
            self.add_request(f"warmup-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0), compression)
        failed = [outs[-1].error for outs in run_to_completion(self).values() if outs[-1].error]
        if failed:
            raise RuntimeError(f"warm-up failed: {failed[0]}")
        self.prefix_cache.warmup_tokens = sum(len(p) for p in prompts)
        return self.prefix_cache.warmup_tokens

    def default_compression(self, stats: bool = False) -> CompressionParams:
        return resolve(self.compression_config, None, server_enabled=True, stats=stats)

    def use_confidence(self, predictor_file: Path, misses: MissLog | None, with_predictor: bool = True) -> Confidence:
        """Score by the predictor at `predictor_file` (unless not `with_predictor`) and decide by the
        calibration beside it from now on (a background fitting ended), on every rank; returns what
        was found, `rate only` (and nothing changed) if nothing usable."""
        cfg = self.compression_config
        device, window = self.store.device, cfg.prediction_window
        found = load_confidence(
            predictor_file, self.model.config, device, cfg.score_interval, window, misses, with_predictor
        )
        if found.calibrations:
            self.compression.use_confidence(found.future_value, found.calibrations)
            self._order("use_confidence", predictor_file, misses.silent() if misses else None, with_predictor)
        return found

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request; its memory is returned at once. Its final output is returned here, not
        by a step."""
        seq = self.outputs.requests.get(request_id)
        if seq is None:
            return None
        self._order("abort", request_id)
        self.scheduler.finish(seq, FinishReason.ABORT)
        outputs = self.outputs.drain()  # between steps, only the abort's own
        return outputs[-1]

    def reset(self, reason: str) -> None:
        """After a step raised: end every request with `reason`, empty the prefix cache (a step cut
        short may have left any KV half written), and check that every byte came back. Raises
        `RuntimeError` if not: then the engine cannot go on and the process must be restarted."""
        self._due = []
        self._orders = []  # what the followers had not applied yet is undone with the rest
        self._order("reset", reason)
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            self.scheduler.finish(seq, FinishReason.ERROR, reason)
        self.outputs.drain()  # their final outputs: the engine loop told their clients already
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        self.compression.take_failures()
        held = {name: pool.used_blocks for name, pool in self.store.allocator.pools.items() if pool.used_blocks}
        if self.store.used_bytes or held or self.compression.states:
            raise RuntimeError(
                f"after ending every request {self.store.used_bytes} bytes of KV are still counted, blocks still "
                f"held by pool {held}, {len(self.compression.states)} sequences still tracked"
            )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def kv_bytes_for(self, num_tokens: int, kv_cache_dtype: str) -> int:
        """Bytes of KV cache `num_tokens` take at that storage, as the budget counts them (whole blocks)."""
        return self.store.bytes_for(num_tokens, self.store.make_codec(kv_cache_dtype))

    def entry_bytes(self, kv_cache_dtype: str) -> tuple[int, int]:
        """Bytes of one (layer, token) entry at that storage: FULL, and KEY_ONLY."""
        return self.store.entry_bytes(self.store.make_codec(kv_cache_dtype))

    @property
    def max_cache_bytes(self) -> int:
        return self.store.max_bytes

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def snapshot(self) -> EngineSnapshot:
        """The accounting now. Only the thread that steps the engine may take it: the store's tables
        change under a step."""
        store, cache = self.store, self.prefix_cache
        running = store.running_bytes
        prefix = (
            {}
            if cache is None
            else {
                "prefix_queries": cache.queries,
                "prefix_hits": cache.hits,
                "prefix_reused_tokens": dict(cache.reused_tokens),
                "prefix_evictions": dict(cache.evictions),
                "prefix_warmup_tokens": cache.warmup_tokens,
            }
        )
        return EngineSnapshot(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            capacity_bytes=store.max_bytes,
            allocated_bytes=store.allocator.allocated_bytes,
            touched_bytes=store.allocator.touched_bytes,
            kv_bytes={"running": running, "prefix": store.used_bytes - running, "audit": self.compression.audit_bytes},
            entries=store.entry_counts(),
            format_bytes=store.allocator.pool_bytes,
            bookkeeping_bytes=store.allocator.parked_bookkeeping_bytes,
            evicted=dict(store.evicted_entries),
            **prefix,
        )

    # ----- the step ----------------------------------------------------------------------
    def step(self, now: float | None = None) -> list[RequestOutput]:
        """Schedule, run the model once over every scheduled chunk, then postprocess: sample,
        detokenise, stop and compress. Returns the outputs for the clients.

        With `async_compression` the compressions due at the end of a step are planned during the
        next one, beside its forward pass, by the worker; the sequences they compress sit it out.
        `now`: the clock deadlines are read against (a follower steps with rank 0's)."""
        started = time.perf_counter()
        now = time.monotonic() if now is None else now
        if self.followers is not None:
            orders, self._orders = self._orders, []
            self.followers.send(StepOrder(orders, now))
        due, self._due = self._due, []
        sched = self._schedule(due, now)
        # Those preempted or finished while it scheduled (or aborted since) are no longer due.
        due = [seq for seq in due if seq.status is SequenceStatus.RUNNING and seq.seq_id in self.store]
        out_of_memory = len(sched.rejected)
        job = self.worker.start(due) if due and sched.chunks else None
        logits, prompt_logits = None, {}
        try:
            if sched.chunks:
                logits, prompt_logits, failed = self._run(sched)
                out_of_memory += failed
        finally:
            waited = time.perf_counter()
            plans, background_s = self.worker.finish(job) if job else (self.compression.plan(due), 0.0)
            self.compression.apply(plans)
            compression_s = time.perf_counter() - waited
        if sched.chunks:
            compression_s += self._postprocess(sched, logits, prompt_logits)
        self._end_failed_compressions()
        outputs = self.outputs.drain()
        self._check_ranks()
        failures, self._failures = self._failures, {}
        self.last_step = StepStats(
            time.perf_counter() - started,
            len(sched.chunks),
            sched.num_tokens,
            len(sched.preempted),
            compression_s,
            background_s,
            [seq.first_scheduled_time - seq.arrival_time for seq in sched.admitted],
            out_of_memory,
            failures,
        )
        return outputs

    def _schedule(self, compressing: list[Sequence], now: float) -> SchedulerOutput:
        """Time out requests past their deadline at `now`, schedule (all but the `compressing`
        sequences), and fail those that can never fit."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.params.deadline is not None and now > seq.params.deadline:
                self.scheduler.finish(seq, FinishReason.TIMEOUT)
        sched = self.scheduler.schedule({seq.seq_id for seq in compressing or []})
        for seq in sched.rejected:
            # All its tokens, not the ones left to compute: a running request refused for its next
            # token needs the room of every token it holds and that one.
            need = self.store.bytes_for(len(seq.token_ids), self.store.codec_of(seq.seq_id))
            error = (
                f"the request needs {need} bytes of KV cache for its {len(seq.token_ids)} tokens but "
                f"max_cache_size is {self.store.max_bytes}; shorten the prompt or raise max_cache_size"
            )
            self.scheduler.finish(seq, FinishReason.ERROR, error)
        return sched

    def _run(self, sched: SchedulerOutput) -> tuple[torch.Tensor | None, dict[int, torch.Tensor], int]:
        """One forward pass; logits of the chunks that need them, those of their prompt positions (by
        seq_id), and the requests failed for want of memory. A failed forward fails only the sequences
        in it (and leaves nothing scheduled)."""
        self.compression.prepare(sched.chunks)
        try:
            return *self.runner.run(sched.chunks, observer=self.observer), 0
        except Exception as exc:
            log.exception("forward pass failed for %d sequences", len(sched.sequences))
            out_of_memory = len(sched.sequences) if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) else 0
            for seq in sched.sequences:
                self._fail(seq, "forward", f"model forward failed: {exc}")
            sched.sequences, sched.chunks = [], []
            return None, {}, out_of_memory

    def _postprocess(
        self, sched: SchedulerOutput, logits: torch.Tensor | None, prompt_logits: dict[int, torch.Tensor]
    ) -> float:
        """Advance the scheduled sequences, note their prompt log-probabilities, sample the next token of
        those that need one (end those that asked for none), then compress the sequences still running
        whose compression is due (with `async_compression`, leave it for the next step); return the
        seconds compression took here."""
        sampled = [seq for seq, chunk in zip(sched.sequences, sched.chunks, strict=True) if chunk.needs_logits]
        for seq, chunk in zip(sched.sequences, sched.chunks, strict=True):
            seq.num_computed += len(chunk.token_ids)
        self._park_prompts(sched.sequences)
        if prompt_logits:  # NOTE: on every rank, so that their chunks keep the same rows of logits
            self._note_prompt_logprobs(sched, prompt_logits)
        rows = [i for i, seq in enumerate(sampled) if not seq.is_finished and seq.params.max_tokens > 0]
        for seq in sampled:
            if not seq.is_finished and seq.params.max_tokens == 0:
                self.scheduler.finish(seq, FinishReason.LENGTH)  # prefilled for its prompt log-probabilities
        if len(rows) < len(sampled):
            sampled = [sampled[i] for i in rows]
            logits = logits[rows]
        confidence: dict[int, float] = {}
        if sampled:
            params = [s.params for s in sampled]
            looks_back = any(p.repetition_penalty != 1.0 or p.min_tokens for p in params)
            histories = [self._history(s) for s in sampled] if looks_back else None
            results = self.ranks.share(
                self._sample(logits, sampled, params, histories) if self.ranks.is_leader else None
            )
            for seq, result in zip(sampled, results, strict=True):
                confidence[seq.seq_id] = result.top_prob
                self._append_token(seq, result)
        running = [seq for seq in sched.sequences if not seq.is_finished]
        with torch.profiler.record_function(COMPRESS_EVENT):
            started = time.perf_counter()
            self._look_ahead(running)
            due = self.compression.due(running, confidence)
            if self.worker is not None:
                self._due = due
            else:
                self.compression.apply(self.compression.plan(due))
            self._trim_windows(running)
            return time.perf_counter() - started

    # ----- internals ---------------------------------------------------------------------
    def _order(self, name: str, *args: object) -> None:
        """Have the followers call `name(*args)` before the next step, as this rank just did."""
        if self.followers is not None:
            self._orders.append((name, args))

    def _check_ranks(self) -> None:
        """Stop the engine if the ranks' accounting differs after a step: they would decide apart."""
        if self.ranks.size == 1:  # NOTE: one rank agrees with itself; counting entries costs a pass over the store
            return
        running = self.scheduler.running
        held = (len(running), len(self.scheduler.waiting), sum(len(s.token_ids) for s in running))
        if not self.ranks.agree(*held, self.store.used_bytes, *self.store.entry_counts().values()):
            raise RuntimeError(
                "the tensor-parallel ranks no longer hold the same requests and entries after a step; the "
                "server must restart (a bug: report it with the log)"
            )

    def _fail(self, seq: Sequence, stage: str, error: str) -> None:
        """End one request with an error from its own work; its memory comes back, the others go on."""
        self._failures[stage] = self._failures.get(stage, 0) + 1
        self.scheduler.finish(seq, FinishReason.ERROR, error)

    def _end_failed_compressions(self) -> None:
        failed = self.compression.take_failures()
        if not failed:
            return
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.seq_id in failed and not seq.is_finished:
                self._fail(seq, "compression", failed[seq.seq_id])

    def _sample(
        self, logits: torch.Tensor, sampled: list[Sequence], params: list[SamplingParams], histories: list | None
    ) -> list[SampleOutput]:
        """The batch sampled at once; should that raise, row by row, so that the row at fault fails alone."""
        generators = [s.generator for s in sampled]
        try:
            return sample(logits, params, generators, histories)
        except Exception:
            log.exception("sampling a batch of %d failed; sampling row by row", len(sampled))
        results = []
        for i in range(len(sampled)):
            try:
                history = [histories[i]] if histories is not None else None
                results.extend(sample(logits[i : i + 1], [params[i]], [generators[i]], history))
            except Exception as exc:
                results.append(SampleOutput(None, 0.0, f"sampling failed: {exc!r}"))
        return results

    def _note_prompt_logprobs(self, sched: SchedulerOutput, prompt_logits: dict[int, torch.Tensor]) -> None:
        """Each scheduled prompt position's log-probability of the next prompt token, onto its sequence."""
        for seq, chunk in zip(sched.sequences, sched.chunks, strict=True):
            if not chunk.prompt_positions:
                continue
            targets = [seq.prompt_token_ids[p + 1] for p in chunk.prompt_positions]
            try:
                reports = prompt_logprobs(prompt_logits[seq.seq_id], targets, seq.params.prompt_logprobs)
            except Exception as exc:  # this request fails alone
                self._fail(seq, "prompt_logprobs", f"prompt log-probabilities failed: {exc}")
                continue
            seq.prompt_logprobs.extend(reports)

    def _park_prompts(self, sequences: list[Sequence]) -> None:
        """Park the prompt KV of the sequences whose prefill just ended that will not hold all of it: those
        that compress, before their query-aware compression, and any of a model with sliding-window
        layers, before those let go of what is behind their window (`_trim_windows`). A request that
        keeps everything is parked whole as it finishes."""
        if self.prefix_cache is None:
            return
        slides = self._slides
        for seq in sequences:
            if seq.num_computed == seq.num_prompt_tokens and (slides or self.compression.compresses(seq.seq_id)):
                self.prefix_cache.park_prompt(seq.seq_id, seq.prompt_token_ids, seq.prefix_fingerprint)

    def _look_ahead(self, sequences: list[Sequence]) -> None:
        """Decode a few greedy tokens on the uncompressed cache of the sequences whose prefill just
        ended (those that ask for `lookahead_tokens`), observing their attention, then forget them.
        Their first compression then also sees what answering reads, which the prompt's own last
        queries may not point at: a question attends to the words it shares with the fact, not to
        the fact's answer after them (LAQ's lookahead queries)."""
        ahead: dict[int, tuple[Sequence, int]] = {}
        for seq in sequences:
            steps = min(self.compression.lookahead(seq), self.max_model_len - seq.num_computed)
            if steps > 0:
                try:
                    self.store.reserve(seq.seq_id, steps)
                except KVBudgetExceeded:
                    continue  # no room to look ahead: it compresses on its prompt's attention alone
                ahead[seq.seq_id] = (seq, steps)
        tokens = {seq_id: seq.token_ids[-1] for seq_id, (seq, _) in ahead.items()}
        try:
            for step in range(max((steps for _, steps in ahead.values()), default=0)):
                chunks = [
                    ScheduledChunk(seq_id, [tokens[seq_id]], seq.num_computed + step, needs_logits=True, observe=1)
                    for seq_id, (seq, steps) in ahead.items()
                    if step < steps
                ]
                logits, _ = self.runner.run(chunks, observer=self.observer)
                for chunk, token in zip(chunks, logits.argmax(dim=-1).tolist(), strict=True):
                    tokens[chunk.seq_id] = token
        except Exception:
            log.exception("looking ahead failed for %d sequences; they compress on their prompts alone", len(ahead))
        finally:
            for seq, _ in ahead.values():
                self.store.truncate(seq.seq_id, seq.num_computed)

    def _trim_windows(self, sequences: list[Sequence]) -> None:
        """Free what sliding-window layers can no longer attend to, once a prompt is prefilled (and
        parked whole: the prefix cache serves any shorter prefix of it exactly)."""
        if not self._slides:
            return
        for seq in sequences:
            if seq.num_computed >= seq.num_prompt_tokens and seq.seq_id in self.store:
                self.store.trim_windows(seq.seq_id)

    def _history(self, seq: Sequence) -> History:
        ends = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else self.eos_token_ids)
        return History(seq.token_ids, len(seq.output_token_ids), frozenset(ends))

    def _append_token(self, seq: Sequence, result: SampleOutput) -> None:
        if result.token_id is None:
            self._fail(seq, "sampling", result.error)
            return
        token = result.token_id
        seq.token_ids.append(token)
        reason = None
        if (token in self.eos_token_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids:
            reason = FinishReason.STOP
        else:
            try:
                if self.outputs.detokenize(seq, token):
                    reason = FinishReason.STOP
            except Exception as exc:
                self._fail(seq, "detokenization", f"detokenization failed: {exc}")
                return
            if reason is None and (
                len(seq.output_token_ids) >= seq.params.max_tokens or len(seq.token_ids) >= self.max_model_len
            ):
                reason = FinishReason.LENGTH
        logprobs = [result.logprob] if result.logprob is not None else []
        if reason is None:
            self.outputs.emit(seq, token, logprobs)
        else:
            self.outputs.hold_last(seq, token, logprobs)
            self.scheduler.finish(seq, reason)


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def _max_model_len(cfg) -> int:
    return next((int(getattr(cfg, name)) for name in _POSITION_FIELDS if getattr(cfg, name, None)), 2048)


@torch.inference_mode()
def run_to_completion(engine: LLMEngine) -> dict[str, list[RequestOutput]]:
    """Step until every request has finished; return each request's outputs in order."""
    results: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            results.setdefault(out.request_id, []).append(out)
    return results
