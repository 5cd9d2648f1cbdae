"""The compressor: between decode steps it scores, tiers and compacts running sequences.

It plugs into the serving engine at three points: `prepare()` marks which sequences need their
attention observed in the coming forward pass (end of prefill, then every `score_interval` decode
steps) or audited (requests that asked for `compression_metrics`, and all that the predictor
ranks while its mistakes are logged); as the `AttentionObserver` it
receives those observations; `after_step()` compresses the sequences that are due (once at the
end of prefill, then every `compression_interval` decode steps). Its `hooks` let tests and trace
collection watch it without replacing its methods.

A compression reads as budget -> score -> plan -> apply: `confkv.compress.budget` says what each
layer may keep, the scoring policy (`confkv.compress.scoring`) what each entry is worth,
`confkv.compress.tiers` which entries keep which tier, and the store's compaction applies it. The
sequences' state and the figures reported are in `confkv.compress.state`. The file is over 300
lines because the batched prediction, the pressure squeeze and the audit of dropped keys all share
the one compression path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from confkv.compress.budget import Budget, Judged, judge, layer_bytes, layers_over, layers_to_compress, plan_budget
from confkv.compress.config import CompressionParams
from confkv.compress.history import TierHistory
from confkv.compress.predictor.calibration import Calibration, Source
from confkv.compress.predictor.misses import Dropped
from confkv.compress.predictor.online import Forecast, FutureValue, PredictionJob
from confkv.compress.scoring import LayerEntries
from confkv.compress.spans import pool_over_spans, span_ids
from confkv.compress.state import (
    CompressionHooks,
    CompressionMetrics,
    CompressionPlan,
    MarkedChunk,
    SequenceState,
    TrackedSequence,
)
from confkv.compress.tiers import adaptive_weights, plan_layers
from confkv.kv.block_tables import Keep
from confkv.kv.kv_store import KVBudgetExceeded, KVStore

log = logging.getLogger(__name__)


class Compressor:
    def __init__(
        self,
        store: KVStore,
        pressure_ceiling: float = 0.9,
        pressure_step: float = 0.05,
        future_value: FutureValue | None = None,
        calibrations: dict[Source, Calibration] | None = None,
        word_starts: torch.Tensor | None = None,
    ) -> None:
        self.store = store
        self.word_starts = word_starts  # [vocabulary] tokens that begin a word (`spans.word_starts`), when known
        self.future_value = future_value  # the value predictor, when one is loaded
        self.calibrations = calibrations or {}  # retention confidence by value source, when fitted
        self.pressure_ceiling = pressure_ceiling
        self.pressure_step = pressure_step
        self.squeezes = 0  # compressions forced by memory pressure
        self.states: dict[int, SequenceState] = {}
        self.audit_bytes = 0
        self.hooks = CompressionHooks()
        self._failed: dict[int, str] = {}  # seq_id -> error, of compressions that raised, until taken

    def use_confidence(self, future_value: FutureValue | None, calibrations: dict[Source, Calibration]) -> None:
        """What dynamic's confidence stands on from now (a background fitting ended): each sequence
        takes it at its next compression."""
        if future_value is not None and future_value.history_steps > self.store.stats.history_steps:
            raise ValueError(
                f"the predictor reads {future_value.history_steps} observations per entry and the KV store keeps "
                f"{self.store.stats.history_steps}: it needs an engine built with history_steps for it"
            )
        self.future_value = future_value
        self.calibrations = calibrations

    # ----- lifecycle ---------------------------------------------------------------------
    def register(self, seq_id: int, params: CompressionParams, prompt_len: int) -> None:
        if params.active and params.retention_unit == "word" and self.word_starts is None:
            raise ValueError("retention_unit 'word' needs the tokenizer, and this compressor was given none")
        history = TierHistory() if params.inspect else None
        self.states[seq_id] = SequenceState(params, params.scorer(), prompt_len, history=history)

    def preempted(self, seq_id: int) -> None:
        state = self.states.get(seq_id)
        if state is not None:
            self.audit_bytes -= sum(k.nbytes for k in state.audit.values())
            state.reset_cache_state()

    def compresses(self, seq_id: int) -> bool:
        state = self.states.get(seq_id)
        return state is not None and state.params.active

    def prefill_tail(self, seq_id: int) -> int:
        """Tokens the last prefill chunk of a sequence must compute (at least one): the prompt
        queries its end-of-prefill compression observes, which must attend in that chunk."""
        return max(1, self.states[seq_id].observed_prompt_queries)

    def release(
        self, seq_id: int, num_tokens: int, cached_tokens: int = 0, prefix_parked: str | None = None
    ) -> CompressionMetrics | None:
        """Forget a finishing sequence (call before its cache is freed); return its metrics. Its tier
        history, if it keeps one, ends with the state it finished in (`history(seq_id)` before this)."""
        metrics = self.metrics(seq_id, num_tokens, cached_tokens, prefix_parked)
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.audit_bytes -= sum(k.nbytes for k in state.audit.values())
            if state.misses:
                self.future_value.misses.save(f"{time.time_ns()}-{seq_id}", list(state.misses.values()))
        return metrics

    def history(self, seq_id: int, num_tokens: int) -> TierHistory | None:
        """The sequence's tier history, closed with its state now (`num_tokens` processed); None
        unless it asked for one."""
        state = self.states.get(seq_id)
        if state is None or state.history is None:
            return None
        self._record(seq_id, num_tokens, state, final=True)
        return state.history

    def metrics(
        self, seq_id: int, num_tokens: int, cached_tokens: int = 0, prefix_parked: str | None = None
    ) -> CompressionMetrics | None:
        """The sequence's figures now: `num_tokens` processed, `cached_tokens` of its prompt reused
        from a prefix-cache entry parked as `prefix_parked`."""
        state = self.states.get(seq_id)
        if state is None:
            return None
        ranks = self.store.stats.ranks.size  # the request's bytes on every rank: each holds the same share
        original = num_tokens * self.store.model_token_bytes * ranks
        compressed = self.store.seq_bytes(seq_id) * ranks
        rate = state.rate if state.params.active else 0.0
        full = key_only = 0
        if seq_id in self.store:
            for layer in range(self.store.num_layers):
                kv = self.store.layer(seq_id, layer)
                full += kv.num_full
                key_only += kv.num_key_only
        held_tokens = full + key_only
        ratio = compressed / original if original else 1.0
        return CompressionMetrics(
            original_size=original,
            compressed_size=compressed,
            ceiling_size=int((1.0 - rate) * original),
            compression_ratio=ratio,
            mean_compression_ratio=state.ratio_sum / state.ratio_steps if state.ratio_steps else ratio,
            hit_rate=cached_tokens / state.prompt_len if state.prompt_len else 0.0,
            prefix_parked=prefix_parked if cached_tokens else None,
            recall_rate=state.recall_sum / state.recall_count if state.recall_count else 1.0,
            entries={
                "full": full,
                "key_only": key_only,
                "dropped": max(0, num_tokens * self.store.num_layers - held_tokens),
            },
            policy=state.params.policy if state.params.active else "none",
            compression_time_ms=1000.0 * state.seconds,
        )

    # ----- around the forward pass ---------------------------------------------------------
    def prepare(self, chunks: list[MarkedChunk]) -> None:
        """Mark the chunks whose attention must be observed or audited in this step."""
        for chunk in chunks:
            state = self.states.get(chunk.seq_id)
            if state is None or not state.params.active or state.error is not None:
                continue
            decode = state.prefilled and len(chunk.token_ids) == 1
            if not state.prefilled and chunk.needs_logits:
                chunk.observe = min(state.observed_prompt_queries, len(chunk.token_ids))
            elif decode and state.policy.uses_attention and state.decode_steps % state.params.score_interval == 0:
                chunk.observe = 1
            chunk.audit = decode and self._audits(state)

    def on_attention(self, seq_id: int, layer: int, rows: torch.Tensor) -> None:
        """A prefill chunk's observed queries' attention [queries, entries] over one layer."""
        state = self.states[seq_id]
        self.store.observe(layer, [seq_id], rows.unsqueeze(0), state.policy.accumulate, state.params.score_interval)
        for hook in self.hooks.observed:
            hook(seq_id, layer, rows)

    def on_decode_attention(self, layer: int, seq_ids: list[int], rows: torch.Tensor) -> None:
        # One update per scoring rule for the whole batch, not a call per sequence.
        groups: dict[str, list[int]] = {}
        for i, seq_id in enumerate(seq_ids):
            groups.setdefault(self.states[seq_id].observation_group, []).append(i)
        for members in groups.values():
            policy = self.states[seq_ids[members[0]]].policy
            self.store.observe(layer, [seq_ids[i] for i in members], rows[members].unsqueeze(1), policy.accumulate)
        for hook in self.hooks.observed:
            for seq_id, row in zip(seq_ids, rows, strict=True):
                hook(seq_id, layer, row[: self.store.seq_length(seq_id, layer)].unsqueeze(0))

    def audit_keys(self, seq_id: int, layer: int) -> torch.Tensor | None:
        return self.states[seq_id].audit.get(layer)

    def on_audit(self, seq_id: int, layer: int, recall: torch.Tensor, dropped_mass: torch.Tensor | None) -> None:
        state = self.states[seq_id]
        state.recall_sum += float(recall.sum())
        state.recall_count += recall.numel()
        if dropped_mass is not None and layer in state.misses:
            self.future_value.misses.attended(state.misses[layer], dropped_mass, state.decode_steps)

    def lookahead(self, seq: TrackedSequence) -> int:
        """Tokens to decode ahead on the uncompressed cache, observed, before this sequence's
        end-of-prefill compression (0: none, or not due now)."""
        state = self.states.get(seq.seq_id)
        if state is None or not state.params.active or state.prefilled or seq.seq_id not in self.store:
            return 0
        return state.params.lookahead_tokens if seq.num_computed >= len(seq.token_ids) - 1 else 0

    def after_step(self, sequences: list[TrackedSequence], sampled_confidence: dict[int, float]) -> float:
        """Compress every due sequence now; return the seconds spent."""
        started = time.perf_counter()
        self.apply(self.plan(self.due(sequences, sampled_confidence)))
        return time.perf_counter() - started

    def due(self, sequences: list[TrackedSequence], sampled_confidence: dict[int, float]) -> list[TrackedSequence]:
        """Note a step's sampling (`sampled_confidence`, by seq_id) and return the sequences whose
        compression is due now (at the end of prefill, then every `compression_interval` decode
        steps). The others note what they hold for `mean_compression_ratio`; the due ones do when
        their compression is applied."""
        for hook in self.hooks.sampled:
            hook(sampled_confidence)
        ready, not_due = [], []
        for seq in sequences:
            state = self.states.get(seq.seq_id)
            if state is None or not state.params.active or state.error is not None or seq.seq_id not in self.store:
                not_due.append(seq)
                continue
            if seq.seq_id in sampled_confidence:
                state.confidences.append(sampled_confidence[seq.seq_id])
            if seq.num_computed < len(seq.token_ids) - 1:
                continue  # still prefilling
            if not state.prefilled:
                state.prefilled = True
                due = True
            else:
                state.decode_steps += 1
                state.steps_since_compression += 1
                due = state.steps_since_compression >= state.params.compression_interval
            if due:
                state.steps_since_compression = 0
                ready.append(seq)
            else:
                not_due.append(seq)
        for seq in not_due:
            self._note_ratio(seq.seq_id, seq.num_computed)
        return ready

    def plan(self, due: list[TrackedSequence]) -> list[CompressionPlan]:
        """Decide the compression of these sequences (`due`'s), applied by `apply`. It reads their
        cache and writes only their entries' forecasts and their own state, so it may run beside a
        forward pass of other sequences; the store's shared accounts change only in `apply`."""
        if not due:
            return []
        started = time.perf_counter()
        states = [(seq, self.states[seq.seq_id]) for seq in due]
        try:
            predicted = self._predict([(seq, state) for seq, state in states if self._uses_predictor(state)])
        except Exception:  # NOTE: one sequence's fault must not fail the batch: each predicts alone below
            log.exception("batched prediction failed for %d sequences; predicting each alone", len(states))
            predicted = {}
        shared = (time.perf_counter() - started) / len(due)  # the batched prediction, shared out
        plans = []
        for seq, state in states:
            began = time.perf_counter()
            try:
                self._note_spans(seq, state)
                plan = self._plan(seq.seq_id, seq.num_computed, state, predicted.get(seq.seq_id))
            except Exception as exc:
                self._fail(seq.seq_id, state, "planning", exc)
                continue
            plan.seconds = shared + time.perf_counter() - began
            plans.append(plan)
        return plans

    def apply(self, plans: list[CompressionPlan]) -> None:
        """Compact the sequences as `plan` decided; each then notes what it holds."""
        for plan in plans:
            began = time.perf_counter()
            try:
                self._apply(plan)
            except Exception as exc:
                self._fail(plan.seq_id, plan.state, "compaction", exc)
                continue
            plan.state.seconds += plan.seconds + time.perf_counter() - began
            self._note_ratio(plan.seq_id, plan.num_tokens)

    def take_failures(self) -> dict[int, str]:
        """The sequences whose compression raised since the last call, and why: the caller ends their
        requests (with an error) and so frees their memory; until then they are no longer compressed."""
        failed, self._failed = self._failed, {}
        return failed

    def _fail(self, seq_id: int, state: SequenceState, stage: str, exc: Exception) -> None:
        log.exception("compression %s failed for sequence %d; its request ends with an error", stage, seq_id)
        state.error = f"compression failed ({stage}): {exc!r}; the request's compression settings may be at fault"
        self._failed[seq_id] = state.error

    def _note_ratio(self, seq_id: int, num_tokens: int) -> None:
        """What a decoding sequence that asked for statistics holds now, for mean_compression_ratio."""
        state, store = self.states.get(seq_id), self.store
        if state is not None and state.params.stats and state.prefilled and seq_id in store:
            state.ratio_sum += store.seq_bytes(seq_id) / (num_tokens * store.model_token_bytes)
            state.ratio_steps += 1

    def squeeze(self, sequences: list[TrackedSequence]) -> bool:
        """Memory pressure: compress these sequences harder, a step at a time up to the ceiling.

        Returns True as soon as bytes were freed, False when every one is at the ceiling. Only
        sequences whose room for this step is not reserved yet may be given.
        """
        before = self.store.used_bytes
        while True:
            squeezed = False
            for seq in reversed(sequences):  # newest first: the oldest are closest to finishing
                state = self.states.get(seq.seq_id)
                if state is None or not state.params.active or not state.prefilled or seq.seq_id not in self.store:
                    continue
                current = state.rate
                if current >= self.pressure_ceiling or state.error is not None:
                    continue
                state.pressure_rate = min(self.pressure_ceiling, current + self.pressure_step)
                try:
                    self._note_spans(seq, state)
                    self.compress(seq.seq_id, seq.num_computed, state)
                except Exception as exc:
                    self._fail(seq.seq_id, state, "squeezing", exc)
                    continue
                self.squeezes += 1
                squeezed = True
                if self.store.used_bytes < before:
                    return True
            if not squeezed:
                return False

    # ----- the compression itself ---------------------------------------------------------
    def _note_spans(self, seq: TrackedSequence, state: SequenceState) -> None:
        """The spans of the sequence's positions as its tokens stand now, where its retention unit has spans."""
        params = state.params
        if params.retention_unit == "token":  # no spans: nothing to copy at every compression
            state.spans = None
            return
        tokens = seq.token_ids[: seq.num_computed]
        spans = span_ids(params.retention_unit, tokens, self.word_starts, params.chunk_tokens)
        state.spans = spans.to(self.store.device)

    def target_rate(self, state: SequenceState) -> float:
        """The rate to apply now: the request's (or the pressure's, if higher), as the policy adjusts
        it to the model's recent confidence."""
        return state.policy.target_rate(state.rate, state.confidences[-state.params.compression_interval :])

    def _uses_predictor(self, state: SequenceState) -> bool:
        return self.future_value is not None and state.params.value_predictor and state.policy.uses_predictor

    def _calibration(self, state: SequenceState) -> Calibration | None:
        """What turns this sequence's value scores into retention confidences (a calibrated policy's)."""
        return self.calibrations.get("forecast" if self._uses_predictor(state) else "attention")

    def _logs_misses(self, state: SequenceState) -> bool:
        return self._uses_predictor(state) and self.future_value.misses is not None

    def _audits(self, state: SequenceState) -> bool:
        """Keep the dropped keys and watch the attention they would get: for compression_metrics,
        and for the predictor's error samples."""
        return state.params.stats or self._logs_misses(state)

    def _predict(self, due: list[tuple[TrackedSequence, SequenceState]]) -> dict[int, dict[int, Forecast]]:
        """Predicted future attention of every entry these sequences' compressions can change, in one batch."""
        jobs = []
        for seq, state in due:
            layers = layers_to_compress(
                self.store, seq.seq_id, state, self._budget(seq.seq_id, seq.num_computed, state)
            )
            if layers:
                jobs.append(self._prediction_job(seq.seq_id, seq.num_computed, state, layers))
        return self.future_value.predict(self.store, jobs) if jobs else {}

    def _prediction_job(self, seq_id: int, num_tokens: int, state: SequenceState, layers: list[int]) -> PredictionJob:
        # Every entry every `prediction_refresh` compressions, else only the new ones; misses are logged
        # with the features of every dropped entry, so then always every entry.
        refresh = self._logs_misses(state) or state.predictions % state.params.prediction_refresh == 0
        state.predictions += 1
        return PredictionJob(seq_id, num_tokens, self._token_confidence(state, num_tokens), layers, refresh)

    def compress(
        self, seq_id: int, num_tokens: int, state: SequenceState, predicted: dict[int, Forecast] | None = None
    ) -> None:
        """Compress one sequence now: budget, score, plan, compact. `predicted` (by layer) is the
        predictor's output, when already computed."""
        plan = self._plan(seq_id, num_tokens, state, predicted)
        self._apply(plan)

    def _apply(self, plan: CompressionPlan) -> None:
        """Compact as planned, keep the keys of the entries it drops where they are audited, then
        record the sequence's tiers and tell the hooks."""
        state = plan.state
        if plan.keep:
            try:
                self.store.compact(plan.seq_id, plan.keep)
            except KVBudgetExceeded as exc:  # the arena's pages are held by other formats: again next interval
                log.debug("sequence %d not compacted: %s", plan.seq_id, exc)
            else:
                for layer, (entries, keys) in plan.dropped.items():
                    self._audit(state, layer, keys)
                    if self._logs_misses(state):  # in the audit's order, so the audit's masses line up
                        windows = plan.predicted[layer].windows
                        known = state.misses.get(layer) or Dropped.none(windows)
                        state.misses[layer] = known.add(windows[entries], state.decode_steps)
        if state.history is not None:
            self._record(plan.seq_id, plan.num_tokens, state)
        for hook in self.hooks.compressed:
            hook(plan.seq_id, plan.num_tokens, state)

    def _record(self, seq_id: int, num_tokens: int, state: SequenceState, final: bool = False) -> None:
        if seq_id not in self.store:
            return  # finished before it held any KV
        layers = []
        for layer in range(self.store.num_layers):
            kv = self.store.layer(seq_id, layer)
            layers.append((kv.positions[: kv.length], kv.num_key_only))
        state.history.record(layers, num_tokens, state.decode_steps, final)

    def _plan(
        self, seq_id: int, num_tokens: int, state: SequenceState, predicted: dict[int, Forecast] | None
    ) -> CompressionPlan:
        """Budget, score and plan one sequence's compression; nothing in the store changes but forecasts."""
        params = state.params
        store = self.store
        budget = self._budget(seq_id, num_tokens, state)
        layers = layers_to_compress(store, seq_id, state, budget)
        state.compressions += 1
        plan = CompressionPlan(seq_id, num_tokens, state)
        if not layers:
            return plan  # nothing to remove: attention is still observed (traces, scores for later)
        if predicted is None and self._uses_predictor(state):
            job = self._prediction_job(seq_id, num_tokens, state, layers)
            predicted = self.future_value.predict(store, [job])[seq_id]
        plan.predicted = predicted
        calibration = self._calibration(state) if budget.judge else None
        entries = self._entries(seq_id, num_tokens, state, layers, predicted, calibration)
        scores = self._judge_layers(seq_id, state, entries, state.policy.score)
        held, positions = entries.held, entries.positions
        if state.spans is not None:  # a span is ranked as its best entry: kept whole or dropped whole
            scores = pool_over_spans(scores, state.spans[positions], held)
        retention = self._judge_layers(seq_id, state, entries, state.policy.retention) if budget.judge else None
        protected = (positions < params.sink_tokens) | (positions > num_tokens - 1 - params.recent_window)
        slot = store.tables.slot_of[seq_id]
        num_key_only = torch.as_tensor(store.tables.key_only[layers, slot], device=store.device)
        judged = Judged(layers, num_key_only, held, protected, scores, retention, positions < state.judged_until)
        if state.history is not None:
            for i, layer in enumerate(layers):
                n = int(held[i].sum())
                judged_retention = None if retention is None else retention[i, :n]
                state.history.scored(layer, positions[i, :n], scores[i, :n], judged_retention)
        per_layer = budget.per_layer
        if budget.judge:
            per_layer = judge(judged, budget, state, num_tokens)
        candidates = held & ~protected
        if budget.rescore and state.params.layer_budget == "adaptive":
            weights = torch.ones(store.num_layers)  # a sliding-window layer's share goes unused: it is not compacted
            weights[layers] = adaptive_weights([s[c] for s, c in zip(scores, candidates, strict=True)])
            state.layer_weights = weights
        shares = layer_bytes(store.num_layers, state, per_layer)
        over = layers_over(store, seq_id, shares, budget.rounding)
        rows = [i for i, layer in enumerate(layers) if over[layer]]
        if len(rows) < len(layers):
            at = torch.tensor(rows, dtype=torch.long, device=store.device)
            held, protected, scores, num_key_only = (t[at] for t in (held, protected, scores, num_key_only))
        tiers = plan_layers(
            scores,
            protected,
            num_key_only,
            [shares[layers[i]] for i in rows],
            budget.full_bytes,
            budget.key_only_bytes,
            state.policy.uses_tiers,
            held=held,
            value_errors=budget.value_errors,
        )
        for i, key_only, layer_tiers in zip(rows, num_key_only.tolist(), tiers, strict=True):
            if layer_tiers.dropped.numel() == 0 and layer_tiers.keep_key_only.numel() == key_only:
                continue
            layer = layers[i]
            if self._audits(state) and layer_tiers.dropped.numel():  # the keys, before compaction lets them go
                dropped = store.view(seq_id, layer).keys.index_select(1, layer_tiers.dropped)
                plan.dropped[layer] = (layer_tiers.dropped, dropped)
            plan.keep[layer] = Keep(full=layer_tiers.keep_full, key_only=layer_tiers.keep_key_only)
        state.judged_until = num_tokens
        return plan

    def _entries(
        self,
        seq_id: int,
        num_tokens: int,
        state: SequenceState,
        layers: list[int],
        predicted: dict[int, Forecast] | None,
        calibration: Calibration | None,
    ) -> LayerEntries:
        """The entries of these layers of a sequence, a row each, padded to the longest: read from the
        store's rows [layers, slots, capacity] at once rather than layer by layer."""
        store = self.store
        slot = store.tables.slot_of[seq_id]
        lengths = torch.as_tensor(store.tables.lengths[layers, slot], device=store.device)
        width = int(lengths.max())
        held = torch.arange(width, device=store.device) < lengths.view(-1, 1)
        at = torch.tensor(layers, device=store.device)
        rows = store.stats.rows
        # Past its entries a row is scratch: position 0 and no attention there, and nothing uses them.
        positions = rows["positions"][at, slot, :width].masked_fill(~held, 0)
        value = None
        if predicted is not None:
            value = torch.nn.utils.rnn.pad_sequence([predicted[layer].value for layer in layers], batch_first=True)
        return LayerEntries(
            keys=None,
            positions=positions,
            attention=rows["attention"][at, slot, :width].masked_fill(~held, 0.0),
            token_confidence=self._token_confidence(state, num_tokens)[positions],
            position=num_tokens - 1,
            layer=at,
            seed=state.params.seed,
            predicted=value,
            calibration=calibration,
            held=held,
        )

    def _judge_layers(
        self,
        seq_id: int,
        state: SequenceState,
        entries: LayerEntries,
        judgement: Callable[[LayerEntries], torch.Tensor | None],
    ) -> torch.Tensor | None:
        """A policy's `score` or `retention` of every row of `entries`: in one call where the policy
        takes several layers, else layer by layer (None if any layer's is)."""
        policy = state.policy
        if policy.scores_layers and not policy.uses_keys:
            return judgement(entries)
        judged = []
        for i, layer in enumerate(entries.layer.tolist()):
            keys = self.store.view(seq_id, layer).keys if policy.uses_keys else None
            judged.append(judgement(entries.row(i, keys)))
        if any(j is None for j in judged):
            return None
        return torch.nn.utils.rnn.pad_sequence(judged, batch_first=True)

    def _budget(self, seq_id: int, num_tokens: int, state: SequenceState) -> Budget:
        return plan_budget(self.store, seq_id, num_tokens, state, self.target_rate(state))

    def _token_confidence(self, state: SequenceState, num_tokens: int) -> torch.Tensor:
        confidence = torch.ones(num_tokens + 1, device=self.store.device)
        generated = state.confidences[: max(0, num_tokens + 1 - state.prompt_len)]
        if generated:
            confidence[state.prompt_len : state.prompt_len + len(generated)] = torch.tensor(generated)
        return confidence

    def _audit(self, state: SequenceState, layer: int, dropped: torch.Tensor) -> None:
        previous = state.audit.get(layer)
        state.audit[layer] = dropped.clone() if previous is None else torch.cat((previous, dropped), dim=1)
        self.audit_bytes += dropped.nbytes
