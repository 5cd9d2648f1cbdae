"""What compression did to one request, compression by compression, for the cache inspector.

Kept only for requests that ask for it (`inspect`): after each compression (the end of prefill, then
every `compression_interval` decode steps, or one forced by memory pressure) the tier of every
(layer, token) entry, and the scores and retention confidences of the layers that were scored then,
plus the state as the request finished. Tiers are run-length encoded, scores float16: a 4k-token
prompt over 30 layers takes a few hundred kB per compression.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np
import torch

DROPPED, KEY_ONLY, FULL = 0, 1, 2
TIER_NAMES = {DROPPED: "dropped", KEY_ONLY: "key_only", FULL: "full"}


@dataclass
class LayerRecord:
    tiers: np.ndarray  # int32 runs, flat: tier, count, tier, count... over positions 0..num_tokens-1
    scores: np.ndarray | None = None  # float16 [num_tokens], NaN where not scored; None: not scored
    retention: np.ndarray | None = None  # float16 [num_tokens], the retention confidence, likewise

    @property
    def nbytes(self) -> int:
        return self.tiers.nbytes + sum(a.nbytes for a in (self.scores, self.retention) if a is not None)

    def to_json(self) -> dict:
        return {"tiers": self.tiers.tolist(), "scores": _base64(self.scores), "retention": _base64(self.retention)}


@dataclass
class CompressionRecord:
    step: int  # decode steps done
    num_tokens: int  # tokens in the sequence's cache then
    layers: list[LayerRecord]
    final: bool = False

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "num_tokens": self.num_tokens,
            "final": self.final,
            "layers": [layer.to_json() for layer in self.layers],
        }


@dataclass
class TierHistory:
    records: list[CompressionRecord] = field(default_factory=list)
    _scored: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray | None]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(record.nbytes for record in self.records)

    def scored(self, layer: int, positions: torch.Tensor, scores: torch.Tensor, retention: torch.Tensor | None) -> None:
        """The scores (and retention confidences) one layer's entries got in the compression under way."""
        as_numpy = (t.detach().float().cpu().numpy() if t is not None else None for t in (positions, scores, retention))
        self._scored[layer] = tuple(as_numpy)

    def record(self, layers: list[tuple[torch.Tensor, int]], num_tokens: int, step: int, final: bool = False) -> None:
        """The tiers after a compression: per layer, the held positions in key order (KEY_ONLY first)
        and how many are KEY_ONLY; with the scores noted since the last record."""
        out = []
        for layer, (positions, num_key_only) in enumerate(layers):
            tiers = np.full(num_tokens, DROPPED, dtype=np.int8)
            held = positions.cpu().numpy()
            tiers[held[:num_key_only]] = KEY_ONLY
            tiers[held[num_key_only:]] = FULL
            record = LayerRecord(tier_runs(tiers))
            if layer in self._scored:
                at, scores, retention = self._scored[layer]
                record.scores = _by_position(at, scores, num_tokens)
                record.retention = _by_position(at, retention, num_tokens) if retention is not None else None
            out.append(record)
        self._scored.clear()
        self.records.append(CompressionRecord(step, num_tokens, out, final))

    def clear(self) -> None:
        """The cache was lost (preemption) and is rebuilt: what it held before no longer applies."""
        self.records.clear()
        self._scored.clear()

    def to_json(self) -> list[dict]:
        return [record.to_json() for record in self.records]


def tier_runs(tiers: np.ndarray) -> np.ndarray:
    """Tiers by position as [tier, count, tier, count...] of equal neighbours; `tiers_by_position` undoes it."""
    if tiers.size == 0:
        return np.zeros(0, dtype=np.int32)
    starts = np.flatnonzero(np.diff(tiers, prepend=tiers[0] - 1))
    counts = np.diff(np.append(starts, tiers.size))
    return np.stack([tiers[starts].astype(np.int32), counts.astype(np.int32)], axis=1).ravel()


def tiers_by_position(runs: list[int]) -> np.ndarray:
    """A layer's run-length tiers [tier, count, tier, count...] (its record's `tiers`) as one tier per position."""
    return np.repeat(np.array(runs[::2], dtype=np.int8), np.array(runs[1::2], dtype=np.int64))


def tier_counts(compression: dict) -> dict[str, int]:
    """Entries by tier in one compression of a record (`CompressionRecord.to_json()`), summed from its runs."""
    tiers = np.concatenate([tiers_by_position(layer["tiers"]) for layer in compression["layers"]])
    counts = np.bincount(tiers, minlength=len(TIER_NAMES))
    return {name: int(counts[tier]) for tier, name in TIER_NAMES.items()}


def _by_position(positions: np.ndarray, values: np.ndarray, num_tokens: int) -> np.ndarray:
    out = np.full(num_tokens, np.nan, dtype=np.float16)
    out[positions.astype(np.int64)] = values
    return out


def _base64(values: np.ndarray | None) -> str | None:
    return None if values is None else base64.b64encode(values.astype("<f2").tobytes()).decode()
