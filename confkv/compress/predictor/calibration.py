"""Retention confidence: the probability that a cached entry will still be needed.

"Needed" has one stated meaning: over the coming `prediction_window` decode steps the entry draws at
least `share` times the attention of an average held entry (an average entry draws `window / n` of
the window's attention mass when n entries are held). What the dynamic policy knows of an entry now,
its value (the predictor's forecast of that mass, or its decayed observed attention when the
predictor is off) raised for tokens sampled in doubt, is first put on a scale free of the sequence's
length: as a multiple of the average held entry's (`relative`). An isotonic regression fitted on
traces maps that multiple to the frequency with which such entries turned out needed; the map ships
next to the predictor's weights (`confkv/compress/predictor/weights/<model>.calibration.json`, one table per source)
and is read at serving time by linear interpolation. `reliability` is the evidence: observed
frequency against stated probability on held-out traces, and the expected calibration error.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Literal

import torch

Source = Literal["forecast", "attention"]
SOURCES: tuple[Source, ...] = ("forecast", "attention")
DEFAULT_SHARE = 0.02  # needed: at least a fiftieth of an average held entry's attention over the window


@dataclass(frozen=True)
class Calibration:
    """A monotone map from an entry's relative value to the probability that it is needed."""

    source: Source  # what the value is: the predictor's forecast, or decayed observed attention
    share: float  # needed = at least `share` x an average held entry's attention over the window
    prediction_window: int  # decode steps the event looks ahead
    knots: tuple[float, ...]  # relative values, increasing
    probabilities: tuple[float, ...]  # P(needed) at each knot, non-decreasing

    def average(self, value: torch.Tensor, held: torch.Tensor | None = None) -> torch.Tensor:
        """What an average held entry's value is, [..., 1] per row of `value` [..., n] (`held`: the
        entries of padded rows): a forecast is a share of the window's attention mass, decayed
        attention is compared with the held entries' own mean."""
        held = torch.ones_like(value, dtype=torch.bool) if held is None else held
        if self.source == "forecast":  # divided as a float is, then rounded to the values' precision
            count = held.sum(-1, keepdim=True).clamp_min(1).double()
            return (self.prediction_window / count).to(value.dtype)
        # Row by row: a mean over a padded row would add in another order, and round differently.
        rows = value.shape[:-1]
        means = [
            row[mask].mean() if mask.any() else row.new_zeros(())
            for row, mask in zip(value.view(math.prod(rows), -1), held.view(math.prod(rows), -1), strict=True)
        ]
        return torch.stack(means).view(*rows, 1)

    def __call__(self, relative: torch.Tensor) -> torch.Tensor:
        """P(needed) for entries whose value is `relative` x the average, interpolated between knots."""
        knots, probabilities = _table(self.knots, self.probabilities, relative.device)
        x = relative.float().clamp(knots[0], knots[-1])
        right = torch.searchsorted(knots, x).clamp(1, len(knots) - 1)
        x0, x1 = knots[right - 1], knots[right]
        p0, p1 = probabilities[right - 1], probabilities[right]
        weight = torch.where(x1 > x0, (x - x0) / (x1 - x0).clamp(min=1e-12), torch.ones_like(x))
        return p0 + weight * (p1 - p0)


@cache
def _table(knots: tuple[float, ...], probabilities: tuple[float, ...], device: torch.device) -> tuple:
    """A table's knots and probabilities as tensors, made once per device (read at every layer)."""
    return tuple(torch.tensor(v, dtype=torch.float32, device=device) for v in (knots, probabilities))


def needed(future_mass: torch.Tensor, held: torch.Tensor, window: int, share: float) -> torch.Tensor:
    """The event a retention confidence gives the probability of (see the module's docstring)."""
    return future_mass * held >= share * window


def fit(relative: torch.Tensor, outcome: torch.Tensor, source: Source, share: float, window: int) -> Calibration:
    """Isotonic regression of the outcome (needed or not) on the relative value."""
    from sklearn.isotonic import IsotonicRegression  # fitting only; serving reads the table

    regression = IsotonicRegression(y_min=0.0, y_max=1.0, increasing=True, out_of_bounds="clip")
    regression.fit(relative.double().numpy(), outcome.double().numpy())
    knots, probabilities = regression.X_thresholds_, regression.y_thresholds_
    return Calibration(source, share, window, tuple(map(float, knots)), tuple(map(float, probabilities)))


@dataclass
class ReliabilityRow:
    low: float  # stated probability, bin edges
    high: float
    entries: int
    stated: float  # mean stated probability in the bin
    observed: float  # share of the bin's entries that were needed


def reliability(probability: torch.Tensor, outcome: torch.Tensor, bins: int = 10) -> tuple[list[ReliabilityRow], float]:
    """Equal-width bins of stated probability, and the expected calibration error (the bins' gaps
    between stated and observed, weighed by their entries)."""
    rows, error = [], 0.0
    edges = torch.linspace(0.0, 1.0, bins + 1)
    which = torch.bucketize(probability.clamp(0.0, 1.0), edges[1:-1], right=True)
    for b in range(bins):
        inside = which == b
        count = int(inside.sum())
        if not count:
            continue
        stated, observed = float(probability[inside].mean()), float(outcome[inside].float().mean())
        rows.append(ReliabilityRow(float(edges[b]), float(edges[b + 1]), count, stated, observed))
        error += count * abs(stated - observed)
    return rows, error / max(len(probability), 1)


def calibration_path(predictor_path: Path) -> Path:
    """Where a predictor's calibration lives: next to its weights."""
    return predictor_path.with_suffix(".calibration.json")


def save_calibrations(calibrations: list[Calibration], path: Path, fingerprint: str) -> None:
    tables = {c.source: asdict(c) for c in calibrations}
    path.write_text(json.dumps({"model_fingerprint": fingerprint, "tables": tables}, indent=1) + "\n")


def load_calibrations(path: Path, fingerprint: str) -> dict[Source, Calibration]:
    """The tables fitted for this model, by source; none if the file is missing or for another model."""
    if not path.exists():
        return {}
    saved = json.loads(path.read_text())
    if saved.get("model_fingerprint") != fingerprint:
        return {}
    return {
        source: Calibration(**{**table, "knots": tuple(table["knots"]), "probabilities": tuple(table["probabilities"])})
        for source, table in saved["tables"].items()
    }
