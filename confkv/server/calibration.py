"""The retention confidence a server runs with, and its fitting in the background for a model that
has none for its fingerprint and prediction_window: a child process (`conf-kv calibrate`) at the
lowest CPU priority records the built-in corpus, trains the value predictor and calibrates it, while
`dynamic` serves by its rate alone; when it is done, the engine switches to the thresholds between
two steps, without a restart. The state is on `/health` (`calibration`) and `/metrics`
(`kv_calibration`)."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from confkv.compress.config import CompressionConfig
from confkv.compress.predictor.fitting import PROFILE
from confkv.compress.predictor.misses import MissLog
from confkv.compress.predictor.model import PredictorConfig
from confkv.compress.predictor.online import (
    PREDICTOR_FILE,
    CalibrationState,
    Confidence,
    fitted_dir,
    load_confidence,
    load_future_value,
    load_retention,
    predictor_path,
)
from confkv.engine.async_engine import AsyncEngine
from confkv.server.settings import Settings

log = logging.getLogger(__name__)
STOP_GRACE_S = 5.0  # how long a stopping fitting may take to exit before it is killed


def server_confidence(
    settings: Settings, model_config, compression: CompressionConfig, device, leader: bool = True
) -> Confidence:
    """The predictor and calibration the settings name (`value_predictor`), for this model; a
    tensor-parallel follower's (not `leader`) logs no misses of its own."""
    misses = miss_log(settings, compression)
    if misses is not None and not leader:
        misses = misses.silent()
    if settings.value_predictor not in ("off", "auto"):  # the operator's own file: refused if it does not fit
        path = Path(settings.value_predictor)
        future_value = load_future_value(path, model_config, device, compression.score_interval, misses)
        if future_value is not None:
            future_value.require_window(compression.prediction_window)
        calibrations = load_retention(path, model_config)
        return Confidence(future_value, calibrations, "shipped" if calibrations else "rate only")
    window = compression.prediction_window
    path = predictor_path(settings.model_path, model_config, window)
    with_predictor = settings.value_predictor == "auto"
    return load_confidence(path, model_config, device, compression.score_interval, window, misses, with_predictor)


def miss_log(settings: Settings, compression: CompressionConfig) -> MissLog | None:
    """Where the predictor's misses are logged, if the settings ask for it."""
    if settings.predictor_error_samples is None:
        return None
    return MissLog(settings.predictor_error_samples, compression.prediction_window)


class BackgroundCalibration:
    """The server's confidence state, and the fitting that runs while it is `rate only`."""

    def __init__(self, settings: Settings, model_config, confidence: Confidence) -> None:
        self.settings = settings
        self.model_config = model_config
        self.with_predictor = settings.value_predictor == "auto"
        self.state: CalibrationState = confidence.state
        self.listeners: list[Callable[[CalibrationState], None]] = []
        self._process: subprocess.Popen | None = None
        self._stopping = threading.Event()

    @property
    def wanted(self) -> bool:
        """Nothing decides by the thresholds yet, and the settings let the server fit it."""
        settings = self.settings
        can_fit = settings.value_predictor in ("off", "auto") and settings.compression_enabled
        return self.state == "rate only" and settings.calibration.background and can_fit

    @staticmethod
    def history_steps() -> int:
        """Observations each entry must keep for the predictor a fitting will bring."""
        return PredictorConfig.load(profile=PROFILE).observation_steps

    def start(self, engine: AsyncEngine) -> None:
        """Start fitting if `wanted`; the engine takes the result when it is done."""
        if not self.wanted:
            return
        calibration = self.settings.calibration
        compression = self.settings.compression()
        command = [sys.executable, "-m", "confkv.compress.predictor.fitting"]
        command += ["--prediction-window", str(compression.prediction_window)]
        command += ["--sequences", str(calibration.sequences), "--prompt-tokens", str(calibration.prompt_tokens)]
        command += ["--threads", str(calibration.threads)]
        if self.settings.model_path is not None:
            command += ["--model-path", str(self.settings.model_path)]
        if self.settings.compression_config is not None:
            command += ["--compression-config", str(self.settings.compression_config)]
        # NOTE: the lowest priority, not a fixed share: requests take the CPU they need, and the
        # fitting has what they leave (all of it while the server is idle).
        env = {**os.environ, "OMP_NUM_THREADS": str(calibration.threads), "TQDM_MININTERVAL": "30"}
        self._process = subprocess.Popen(command, env=env, preexec_fn=lambda: os.nice(19))
        self._set("fitting")
        log.info(
            "no retention confidence for this model and a prediction_window of %d: fitting one in the background "
            "(process %d, %d thread%s at the lowest priority; %d corpus sequences). dynamic decides by its rate "
            "until then, and by its thresholds after, without a restart",
            compression.prediction_window,
            self._process.pid,
            calibration.threads,
            "" if calibration.threads == 1 else "s",
            calibration.sequences,
        )
        threading.Thread(target=self._finish, args=(engine, time.monotonic()), name="calibration", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def _finish(self, engine: AsyncEngine, started: float) -> None:
        code = self._process.wait()
        if self._stopping.is_set():
            return
        if code != 0:
            self._set("rate only")
            log.error(
                "the background calibration exited with status %d (its log is above): dynamic goes on deciding by "
                "its rate. Fit it with `conf-kv calibrate --model-path DIR` and restart the server",
                code,
            )
            return
        compression = self.settings.compression()
        path = fitted_dir(self.model_config, compression.prediction_window) / PREDICTOR_FILE
        misses = miss_log(self.settings, compression)
        switched = engine.call(lambda e: e.use_confidence(path, misses, self.with_predictor))
        while True:  # between two steps; a loop that died never answers
            try:
                if switched.result(timeout=1.0).state != "fitted":
                    self._set("rate only")
                    log.error(
                        "the background calibration ended but %s holds no usable confidence: the rate decides", path
                    )
                    return
                break
            except concurrent.futures.TimeoutError:
                if not engine.is_alive:
                    return
            except Exception as exc:
                self._set("rate only")
                log.error("the engine refused the fitted confidence (%s): dynamic keeps deciding by its rate", exc)
                return
        self._set("fitted")
        log.info(
            "retention confidence fitted in %.0f s (%s): dynamic now decides by its thresholds",
            time.monotonic() - started,
            path.parent,
        )

    def _set(self, state: CalibrationState) -> None:
        self.state = state
        for listener in self.listeners:
            listener(state)
