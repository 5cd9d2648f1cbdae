"""The predictor at serving time: predicted future attention for every held entry, in one batch.

Each entry of the live cache keeps its last `observation_steps` observations (the KV store's
`observed`, filled by the compressor) and its key norm (taken when written); from those,
the entry's decayed score, position and token confidence, the same features as in the traces are
built for every layer of every sequence due for compression, and the LSTM runs once over all of
them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from safetensors import safe_open

from confkv.compress.predictor.calibration import Calibration, Source, calibration_path, load_calibrations
from confkv.compress.predictor.features import unscaled_attention, window_features
from confkv.compress.predictor.misses import MissLog
from confkv.compress.predictor.model import ValuePredictor, load_predictor, model_fingerprint
from confkv.kv.kv_store import KVStore
from confkv.models.default_model import MODEL_NAME

log = logging.getLogger(__name__)

PREDICTOR_DIR = Path(__file__).resolve().parent / "weights"
PREDICTOR_FILE = "value_predictor.safetensors"  # a model folder's own predictor, where it brings one


@dataclass
class Forecast:
    """For the held entries of one layer: predicted future attention, and the features it read."""

    value: torch.Tensor  # [n] attention mass over the coming prediction_window steps
    windows: torch.Tensor  # [m, T, F] the features of the entries predicted this time (all n on a refresh)


@dataclass
class PredictionJob:
    seq_id: int
    num_tokens: int  # tokens whose KV is computed; the newest query sits at num_tokens - 1
    token_confidence: torch.Tensor  # [num_tokens + 1] by position
    layers: list[int]  # the layers to predict
    refresh: bool = True  # every entry; otherwise only those without a forecast yet


class FutureValue:
    def __init__(
        self, predictor: ValuePredictor, score_interval: int, misses: MissLog | None = None, path: Path | None = None
    ) -> None:
        self.predictor = predictor
        self.path = path  # where its weights were read, and its calibration lies beside them
        self.score_interval = score_interval  # decode steps between the observations an entry keeps
        self.misses = misses  # where dropped entries that drew attention are logged, if anywhere

    @property
    def history_steps(self) -> int:
        return self.predictor.config.observation_steps

    def require_window(self, prediction_window: int) -> None:
        """Refuse settings whose `prediction_window` is not the one the predictor was trained for."""
        if prediction_window != self.predictor.config.prediction_window:
            raise ValueError(self.window_mismatch(prediction_window))

    def window_mismatch(self, prediction_window: int) -> str:
        trained = self.predictor.config.prediction_window
        return (
            f"prediction_window is {prediction_window} but the value predictor was trained to forecast "
            f"{trained} tokens ahead: set prediction_window to {trained} in the compression config, or fit "
            "one for that window (`conf-kv calibrate --model-path DIR --prediction-window N`, or let the "
            "server fit it in the background)"
        )

    @torch.inference_mode()
    def predict(self, store: KVStore, jobs: list[PredictionJob]) -> dict[int, dict[int, Forecast]]:
        """Per sequence, by layer: the attention mass each held entry is predicted to receive.

        The forecasts are kept with the entries: a job that does not refresh predicts only the entries
        that have none (new since the last refresh, or in a layer not predicted before)."""
        if not jobs:
            return {}
        windows, targets = [], []
        offsets = self.score_interval * torch.arange(self.history_steps - 1, -1, -1, device=store.device)
        rows = store.stats.rows
        for job in jobs:
            # Every layer of a job at once: its rows [layers, slot, :width], the entries to predict picked by a mask.
            slot = store.tables.slot_of[job.seq_id]
            at = torch.tensor(job.layers, device=store.device)
            lengths = torch.as_tensor(store.tables.lengths[job.layers, slot], device=store.device)
            width = int(lengths.max())
            todo = torch.arange(width, device=store.device) < lengths.view(-1, 1)
            forecast = rows["forecast"][at, slot, :width]
            if not job.refresh:
                todo &= forecast.isnan()
            layer, entry = todo.nonzero(as_tuple=True)  # layer by layer, in entry order
            positions = rows["positions"][at, slot, :width][layer, entry]
            windows.append(
                window_features(
                    rows["observed"][at, slot, :, :width][layer, :, entry].T,
                    rows["attention"][at, slot, :width][layer, entry],
                    positions,
                    job.num_tokens - 1 - offsets,
                    job.token_confidence[positions],
                    rows["key_norm"][at, slot, :width][layer, entry],
                    at[layer],
                    store.num_layers,
                )
            )
            targets.append((job, slot, at, lengths, at[layer], entry, todo.sum(dim=1).tolist()))
        rows_in = torch.cat(windows)
        predicted = unscaled_attention(self.predictor(rows_in).float()) if len(rows_in) else rows_in.new_zeros(0)
        forecasts: dict[int, dict[int, Forecast]] = {}
        for (job, slot, at, lengths, layer, entry, counts), window, value in zip(
            targets, windows, predicted.split([len(w) for w in windows]), strict=True
        ):
            rows["forecast"][layer, slot, entry] = value.to(rows["forecast"].dtype)
            held = rows["forecast"][at, slot]
            forecasts[job.seq_id] = {
                layer_idx: Forecast(held[i, :n].clone(), layer_windows)
                for i, (layer_idx, n, layer_windows) in enumerate(
                    zip(job.layers, lengths.tolist(), window.split(counts), strict=True)
                )
            }
        return forecasts


def predictor_path(model_path: Path | None, model_config=None, prediction_window: int | None = None) -> Path:
    """Where a model's predictor lives, the first that exists of: the model folder's own
    (PREDICTOR_FILE); given the model's config and window, the one fitted for them (`fitted_dir`,
    `conf-kv calibrate`); given its config, the one shipped for its fingerprint; the one shipped
    under its folder's name, confkv/compress/predictor/weights/<name>.safetensors (the last when
    none exists)."""
    candidates = [Path(model_path) / PREDICTOR_FILE] if model_path is not None else []
    if model_config is not None and prediction_window is not None:
        candidates.append(fitted_dir(model_config, prediction_window) / PREDICTOR_FILE)
    if model_config is not None and (shipped := shipped_for(model_config)) is not None:
        candidates.append(shipped)
    candidates.append(PREDICTOR_DIR / f"{model_path.name if model_path else MODEL_NAME}.safetensors")
    return next((path for path in candidates if path.is_file()), candidates[-1])


def shipped_for(model_config) -> Path | None:
    """The shipped predictor trained on this model's fingerprint, whatever its folder is called (the
    embedded model converted, a copy renamed)."""
    fingerprint = model_fingerprint(model_config)
    for path in sorted(PREDICTOR_DIR.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            if handle.metadata().get("model_fingerprint") == fingerprint:
                return path
    return None


def fitted_dir(model_config, prediction_window: int) -> Path:
    """Where the predictor and calibration fitted for a model (`conf-kv calibrate`) are kept: under
    $CONFKV_CONFIDENCE_CACHE, else ~/.cache/conf-kv/confidence, by the model's fingerprint and the
    window they forecast, never inside the package."""
    root = Path(os.environ.get("CONFKV_CONFIDENCE_CACHE") or Path.home() / ".cache" / "conf-kv" / "confidence")
    return root / f"{model_fingerprint(model_config)}-w{prediction_window}"


# What dynamic's retention confidence stands on: a predictor and calibration shipped with the
# package or the model folder, one fitted for this model and window, one being fitted in the
# background, or none (the rate alone decides).
CalibrationState = Literal["shipped", "fitted", "fitting", "rate only"]


@dataclass
class Confidence:
    """The value predictor and the retention calibration a server uses, and where they came from."""

    future_value: FutureValue | None = None
    calibrations: dict[Source, Calibration] = field(default_factory=dict)
    state: CalibrationState = "rate only"


def load_confidence(
    path: Path,
    model_config,
    device: torch.device,
    score_interval: int,
    prediction_window: int,
    misses: MissLog | None = None,
    with_predictor: bool = True,
) -> Confidence:
    """The predictor at `path` (unless not `with_predictor`) and the calibration beside it, for this
    model and window. What was fitted (`fitted_dir`) and cannot be read, or a predictor for another
    window, counts as none, with a log line: it is fitted again. Another model's predictor is refused."""
    fitted = path.parent == fitted_dir(model_config, prediction_window)
    try:
        future_value = load_future_value(path, model_config, device, score_interval, misses) if with_predictor else None
        calibrations = load_retention(path, model_config)
    except Exception as exc:
        if not fitted:
            raise
        log.warning("the confidence fitted at %s cannot be read (%s): it counts as none and is fitted again", path, exc)
        return Confidence()
    if future_value is not None and future_value.predictor.config.prediction_window != prediction_window:
        log.warning("%s", future_value.window_mismatch(prediction_window))
        return Confidence()
    if not calibrations:
        return Confidence(future_value)
    return Confidence(future_value, calibrations, "fitted" if fitted else "shipped")


def load_future_value(
    path: Path, model_config, device: torch.device, score_interval: int, misses: MissLog | None = None
) -> FutureValue | None:
    """The predictor saved at `path` for this model, or None with one log line saying that the
    dynamic policy scores by observed attention only."""
    predictor = load_predictor(path, model_fingerprint(model_config))
    if predictor is None:
        log.warning(
            "no value predictor at %s: the dynamic policy scores by observed attention only "
            "(fit one for this model with `conf-kv calibrate --model-path DIR`)",
            path,
        )
        return None
    log.info("value predictor %s loaded (%s)", path, predictor.config.short_description)
    return FutureValue(predictor.to(device), score_interval, misses, path)


def calibrations_for(
    future_value: FutureValue | None, model_config, prediction_window: int
) -> dict[Source, Calibration]:
    """The retention calibration that goes with `future_value` (beside its weights); without one,
    the one a server would find for this model and window."""
    if future_value is not None and future_value.path is not None:
        return load_retention(future_value.path, model_config)
    return load_retention(predictor_path(None, model_config, prediction_window), model_config)


def load_retention(predictor_file: Path, model_config) -> dict[Source, Calibration]:
    """The retention confidence's calibration saved next to `predictor_file` for this model, or none
    with one log line saying that the rate alone decides what `dynamic` keeps."""
    path = calibration_path(predictor_file)
    calibrations = load_calibrations(path, model_fingerprint(model_config))
    if not calibrations:
        log.warning(
            "no retention calibration for this model at %s: dynamic's thresholds do not decide, its rate does "
            "(fit one with `conf-kv calibrate --model-path DIR`)",
            path,
        )
    return calibrations
