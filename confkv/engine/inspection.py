"""The cache inspector's records: what compression did to each request that asked (`"inspect": true`).

A bounded ring: the newest `max_requests` records within `max_bytes`, the oldest dropped first. A
record keeps the prompt's text only beside its history (never logged), and only requests that opted
in have one. Tokens are decoded when a record is read, not when a request finishes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from confkv.compress.history import TIER_NAMES, TierHistory


@dataclass
class InspectionRecord:
    request_id: str
    prompt: str | None  # as given, or the chat as the template rendered it; None for token ids
    token_ids: list[int]  # prompt then generated
    num_prompt_tokens: int
    text: str
    history: TierHistory
    num_layers: int
    entry_bytes: dict[str, int]  # of one (layer, token) entry, by tier
    params: dict
    compression_metrics: dict | None = None
    created: float = field(default_factory=time.time)

    @property
    def nbytes(self) -> int:
        return self.history.nbytes + 4 * len(self.token_ids) + len(self.prompt or "") + len(self.text)

    def to_json(self, tokenizer: PreTrainedTokenizerBase) -> dict:
        return {
            "id": self.request_id,
            "created": self.created,
            "prompt": self.prompt,
            "text": self.text,
            "tokens": [tokenizer.decode([token]) for token in self.token_ids],
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_layers": self.num_layers,
            "tiers": TIER_NAMES,
            "entry_bytes": self.entry_bytes,
            "compressions": self.history.to_json(),
            "compression_metrics": self.compression_metrics,
            "params": self.params,
        }


class InspectionStore:
    """The newest records, by request id, within both bounds."""

    def __init__(self, max_requests: int, max_bytes: int) -> None:
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self._records: OrderedDict[str, InspectionRecord] = OrderedDict()
        self.nbytes = 0

    def add(self, record: InspectionRecord) -> bool:
        """Keep it, dropping the oldest as needed; False if it alone exceeds `max_bytes` (not kept)."""
        if record.nbytes > self.max_bytes or self.max_requests == 0:
            return False
        self._records[record.request_id] = record
        self.nbytes += record.nbytes
        while len(self._records) > self.max_requests or self.nbytes > self.max_bytes:
            _, oldest = self._records.popitem(last=False)
            self.nbytes -= oldest.nbytes
        return True

    def get(self, request_id: str) -> InspectionRecord | None:
        return self._records.get(request_id)

    def __len__(self) -> int:
        return len(self._records)
