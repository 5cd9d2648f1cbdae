"""The predictor's mistakes, as training samples (seed 000, 7.1): entries the compression dropped
that the audit then saw drawing attention.

When a sequence drops entries that the predictor ranked, their feature windows are kept; while it
runs, the audit adds up the attention each dropped entry would have received over the next
`prediction_window` decode steps. When it finishes, the entries that drew at least
`min_attention` are written (`windows`, `targets`, as in the traces) to one file per request,
which `python -m confkv.compress.predictor.train --error-samples DIR` takes in.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from confkv.compress.predictor.features import target

log = logging.getLogger(__name__)


@dataclass
class Dropped:
    """The dropped entries of one layer of one sequence, in drop order."""

    windows: torch.Tensor  # [n, T, F] their features when the predictor ranked them
    dropped_at: torch.Tensor  # [n] decode step of the drop
    future: torch.Tensor  # [n] attention received since, within the prediction window

    @classmethod
    def none(cls, like: torch.Tensor) -> Dropped:
        return cls(like[:0], torch.empty(0, dtype=torch.long, device=like.device), like.new_zeros(0))

    def add(self, windows: torch.Tensor, step: int) -> Dropped:
        return Dropped(
            torch.cat((self.windows, windows)),
            torch.cat((self.dropped_at, torch.full((len(windows),), step, device=windows.device))),
            torch.cat((self.future, torch.zeros(len(windows), device=windows.device))),
        )


class MissLog:
    def __init__(self, folder: Path, prediction_window: int, min_attention: float = 0.02, writes: bool = True) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.prediction_window = prediction_window
        self.min_attention = min_attention  # attention mass over the window that makes a drop a mistake
        self.writes = writes  # False: count only (a tensor-parallel follower: rank 0 writes)
        self.written = 0  # samples written so far

    def silent(self) -> MissLog:
        """The same log that counts and writes nothing: a tensor-parallel follower's, whose engine
        must audit as rank 0's does, while rank 0 alone writes the samples."""
        return MissLog(self.folder, self.prediction_window, self.min_attention, writes=False)

    def attended(self, dropped: Dropped, mass: torch.Tensor, step: int) -> None:
        """Count one decode step's attention on the dropped entries (`mass` in drop order)."""
        within = (step - dropped.dropped_at) < self.prediction_window
        dropped.future += mass[: len(dropped.future)] * within

    def save(self, name: str, layers: list[Dropped]) -> int:
        """Write the mistakes of one finished sequence; returns how many."""
        windows = [d.windows[d.future >= self.min_attention] for d in layers]
        futures = [d.future[d.future >= self.min_attention] for d in layers]
        count = sum(len(w) for w in windows)
        if count and self.writes:
            tensors = {"windows": torch.cat(windows).float().cpu(), "targets": target(torch.cat(futures)).float().cpu()}
            save_file({k: v.contiguous() for k, v in tensors.items()}, str(self.folder / f"{name}.safetensors"))
            self.written += count
            log.info("%d dropped entries of %s drew attention: logged as predictor error samples", count, name)
        return count
