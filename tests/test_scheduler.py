"""The scheduler alone, against a store that counts bytes per token: admission, the byte budget,
preemption and the bound on how often a waiting request may be passed, under random workloads."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.engine.scheduler import Scheduler
from confkv.engine.sequence import FinishReason, SamplingParams, Sequence, SequenceStatus
from confkv.kv.kv_store import KVBudgetExceeded

TOKEN_BYTES = 10


class TokenStore:
    """Bytes in use: TOKEN_BYTES per token reserved; what the scheduler asks of a KV store."""

    def __init__(self, max_tokens: int) -> None:
        self.max_bytes = max_tokens * TOKEN_BYTES
        self.held: dict[int, int] = {}

    @property
    def free_bytes(self) -> int:
        return self.max_bytes - sum(self.held.values())

    def bytes_for(self, num_tokens: int, codec: object = None) -> int:
        return num_tokens * TOKEN_BYTES

    def codec_of(self, seq_id: int) -> None:
        return None

    def reserve(self, seq_id: int, num_new: int) -> None:
        if num_new * TOKEN_BYTES > self.free_bytes:
            raise KVBudgetExceeded(f"{num_new} tokens do not fit")
        self.held[seq_id] = self.held.get(seq_id, 0) + num_new * TOKEN_BYTES

    def free(self, seq_id: int, preempted: bool = False) -> int:
        return self.held.pop(seq_id, 0)


def run_step(scheduler: Scheduler) -> None:
    """What the engine does with a schedule: compute the chunks, sample a token where a chunk ends a
    prefill or decodes, and finish what reached max_tokens."""
    out = scheduler.schedule()
    for seq in out.rejected:
        scheduler.finish(seq, FinishReason.ERROR, "too big")
    for seq, chunk in zip(out.sequences, out.chunks, strict=True):
        seq.num_computed += len(chunk.token_ids)
        if chunk.needs_logits:
            seq.token_ids.append(1)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                scheduler.finish(seq, FinishReason.LENGTH)


requests = st.lists(
    st.tuples(st.integers(0, 6), st.integers(1, 90), st.integers(1, 30)),  # arrival step, prompt, max_tokens
    min_size=1,
    max_size=14,
)


@settings(max_examples=150, deadline=None)
@given(requests=requests, budget=st.integers(100, 200), max_num_seqs=st.integers(1, 4), chunk=st.integers(8, 64))
def test_every_request_finishes_within_the_budget_and_none_is_passed_too_often(requests, budget, max_num_seqs, chunk):
    store = TokenStore(budget)
    scheduler = Scheduler(store, max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk)
    seqs = [
        (step, Sequence(f"r{i}", [1] * prompt, SamplingParams(max_tokens=new)))
        for i, (step, prompt, new) in enumerate(requests)
    ]
    for step in range(2000):
        for arrival, seq in seqs:
            if arrival == step:
                scheduler.add(seq)
        run_step(scheduler)
        assert store.free_bytes >= 0
        assert len(scheduler.running) <= max_num_seqs
        assert not set(map(id, scheduler.running)) & set(map(id, scheduler.waiting))
        assert all(seq.seq_id not in store.held for seq in scheduler.waiting)  # waiting holds no memory
        assert all(seq.overtaken <= max_num_seqs for _, seq in seqs)
        if step > max(arrival for arrival, _ in seqs) and not scheduler.has_unfinished():
            break
    assert not scheduler.has_unfinished()  # nothing starves, nothing is stuck
    assert all(seq.status is SequenceStatus.FINISHED for _, seq in seqs)
    assert store.held == {}  # every byte given back
    for _, seq in seqs:  # what fits the budget alone runs to the end; only what cannot is refused
        fits = seq.num_prompt_tokens + seq.params.max_tokens - 1 <= budget  # the last token is never computed
        assert seq.finish_reason is (FinishReason.LENGTH if fits else FinishReason.ERROR)


def test_a_request_behind_one_that_cannot_fit_runs_if_it_fits_now():
    store = TokenStore(100)
    scheduler = Scheduler(store, max_num_seqs=4, max_num_batched_tokens=100)
    long, big, small = (Sequence(name, [1] * n, SamplingParams(max_tokens=20)) for name, n in
                        (("long", 60), ("big", 50), ("small", 10)))  # fmt: skip
    for seq in (long, big, small):
        scheduler.add(seq)
    run_step(scheduler)
    assert scheduler.running == [long, small] and list(scheduler.waiting) == [big]
    assert big.overtaken == 1
