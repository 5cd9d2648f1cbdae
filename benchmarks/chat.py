"""One chat request through the engine, as a chat client sends it, with its time to first token."""

from __future__ import annotations

import time
from dataclasses import dataclass

from confkv.compress.config import CompressionParams
from confkv.engine.llm_engine import LLMEngine
from confkv.engine.sequence import SamplingParams


@dataclass
class ChatAnswer:
    text: str
    ttft: float  # seconds from submission to the first generated token
    cached_tokens: int  # prompt tokens served from the prefix cache
    prompt_tokens: int


def ask(
    engine: LLMEngine, tokenizer, request_id: str, messages: list[dict], max_tokens: int, params: CompressionParams
) -> ChatAnswer:
    """Send `messages` (chat template applied) as one greedy request and step the engine until it ends."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    started, first, answer, cached = time.perf_counter(), None, "", 0
    engine.add_request(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0), params)
    while engine.has_unfinished():
        for out in engine.step():
            if first is None and out.completion_tokens:
                first = time.perf_counter() - started
            answer += out.delta_text
            if out.finished:
                cached = out.cached_prompt_tokens
    return ChatAnswer(answer, first, cached, len(ids))
