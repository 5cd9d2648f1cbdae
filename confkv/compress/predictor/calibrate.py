"""Fit the retention confidence on traces and save it next to the predictor's weights.

For every sampled entry of the training traces: its relative value as the dynamic policy computes
it (the predictor's forecast, or the decayed attention, raised for doubtful tokens, over the
average held entry's) and whether it turned out needed over the following window; one isotonic
table per source. The held-out traces are left for the evidence (`benchmarks/predictor/run.py`).

    python -m confkv.compress.predictor.calibrate --traces traces/
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from confkv.compress.predictor.calibration import (
    DEFAULT_SHARE,
    SOURCES,
    Calibration,
    Source,
    calibration_path,
    fit,
    needed,
    save_calibrations,
)
from confkv.compress.predictor.features import FEATURES, unscaled_attention
from confkv.compress.predictor.model import ValuePredictor, load_predictor, model_fingerprint
from confkv.compress.predictor.online import predictor_path
from confkv.compress.predictor.train import load_traces
from confkv.compress.scoring import Dynamic, make_policy

log = logging.getLogger(__name__)


@torch.inference_mode()
def forecasts(predictor: ValuePredictor, windows: torch.Tensor) -> torch.Tensor:
    """The attention mass the predictor expects each sample's entry to draw over the window."""
    return unscaled_attention(torch.cat([predictor(w) for w in windows.split(65536)]).float())


def relative_values(
    traces: dict[str, torch.Tensor], forecast: torch.Tensor, policy: Dynamic, window: int
) -> dict[Source, torch.Tensor]:
    """By source: each sample's value as `policy` scores it, over the average held entry's (unpooled:
    traces sample entries apart from their neighbours)."""
    latest = traces["windows"][:, -1]
    doubt = policy.doubt(latest[:, FEATURES.index("token_confidence")])
    held = traces["held"].float()
    decayed = unscaled_attention(latest[:, FEATURES.index("attention_decayed")])
    return {
        "forecast": forecast * held / window * doubt,
        "attention": decayed * held / traces["decayed_total"].clamp(min=1e-12) * doubt,
    }


def outcomes(traces: dict[str, torch.Tensor], window: int, share: float) -> torch.Tensor:
    return needed(unscaled_attention(traces["targets"]), traces["held"].float(), window, share)


def calibrate(
    traces: dict[str, torch.Tensor], predictor: ValuePredictor, share: float = DEFAULT_SHARE
) -> list[Calibration]:
    """One table per source, fitted on `traces` for `predictor`'s window."""
    window = predictor.config.prediction_window
    relative = relative_values(traces, forecasts(predictor, traces["windows"]), make_policy("dynamic"), window)
    outcome = outcomes(traces, window, share)
    log.info("calibrating on %d samples, %.1f%% needed", len(outcome), 100 * float(outcome.float().mean()))
    return [fit(relative[source], outcome, source, share, window) for source in SOURCES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", type=Path, required=True)
    parser.add_argument("--predictor", type=Path, default=None, help="default: the shipped weights")
    parser.add_argument("--model-path", type=Path, default=None, help="the traces' model (default: embedded)")
    parser.add_argument("--share", type=float, default=DEFAULT_SHARE, help="needed = at least this x an average entry")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    from transformers import AutoConfig

    from confkv.models.default_model import default_model_path

    fingerprint = model_fingerprint(AutoConfig.from_pretrained(args.model_path or default_model_path()))
    path = args.predictor or predictor_path(args.model_path)
    predictor = load_predictor(path, fingerprint)
    if predictor is None:
        raise SystemExit(f"no predictor at {path}: train one first (make train-predictor)")
    out = calibration_path(path)
    save_calibrations(calibrate(load_traces(args.traces), predictor, args.share), out, fingerprint)
    log.info("saved %s", out)


if __name__ == "__main__":
    main()
