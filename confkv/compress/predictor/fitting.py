"""Fit a model's retention confidence in one go: traces on the built-in corpus, the value predictor
and its calibration, saved where the server looks for them (`fitted_dir`: by the model's
fingerprint and the window they forecast). What `make train-predictor` does for the embedded model,
for any model a server may be pointed at:

    conf-kv calibrate --model-path DIR [--prediction-window 128]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
from pathlib import Path

import torch

from confkv.compress.config import CompressionConfig
from confkv.compress.predictor.calibrate import calibrate
from confkv.compress.predictor.calibration import calibration_path, save_calibrations
from confkv.compress.predictor.collect import TraceSize, collect
from confkv.compress.predictor.model import PredictorConfig, model_fingerprint, save_predictor
from confkv.compress.predictor.online import PREDICTOR_FILE, fitted_dir
from confkv.compress.predictor.train import concat_traces, sample_weights, train
from confkv.models.loader import load_model

log = logging.getLogger(__name__)
PROFILE = "small"  # the shipped predictor's: the seed's 2 x 256 LSTM costs ~90x per entry (prediction_model.yaml)


def fit_confidence(
    model,
    tokenizer,
    out: Path,
    serving: CompressionConfig,
    size: TraceSize | None = None,
    **predictor_overrides,
) -> Path:
    """Record traces of `model` as `serving` (the server's compression config) observes entries,
    train a predictor for its `prediction_window` on them and calibrate it; save both in `out` and
    return the predictor's path (its calibration lies beside it)."""
    config = PredictorConfig.load(profile=PROFILE, prediction_window=serving.prediction_window, **predictor_overrides)
    fingerprint = model_fingerprint(model.config)
    started = time.monotonic()
    log.info(
        "fitting the retention confidence for a window of %d: recording the built-in corpus", config.prediction_window
    )
    traces = concat_traces(collect(model, tokenizer, config, size or TraceSize(), serving))
    log.info("training the value predictor on %d samples", len(traces["targets"]))
    predictor, history = train(traces["windows"], traces["targets"], config, weights=sample_weights(traces, config))
    path = out / PREDICTOR_FILE
    save_predictor(predictor, path, fingerprint, {"best_validation_loss": min(history.validation_loss)})
    save_calibrations(calibrate(traces, predictor), calibration_path(path), fingerprint)
    log.info("fitted in %.0f s: %s and its calibration", time.monotonic() - started, path)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="conf-kv calibrate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-path", type=Path, default=None, help="a model folder (default: the embedded model)")
    parser.add_argument(
        "--prediction-window",
        type=int,
        default=None,
        help="decode steps the predictor forecasts (default: the compression config's prediction_window)",
    )
    parser.add_argument("--compression-config", type=Path, default=None, help="the server's compression config file")
    parser.add_argument("--out", type=Path, default=None, help="default: where the server looks for it")
    parser.add_argument("--sequences", type=int, default=TraceSize.sequences, help="corpus sequences to record")
    parser.add_argument("--prompt-tokens", type=int, default=TraceSize.prompt_tokens, help="tokens of each prompt")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on the CPU")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:1...")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    serving = CompressionConfig.load(args.compression_config)
    if args.prediction_window is not None:
        serving = serving.model_copy(update={"prediction_window": args.prediction_window})
    model, tokenizer = load_model(args.model_path, torch.device(args.device))
    out = args.out or fitted_dir(model.config, serving.prediction_window)
    # NOTE: fitted into a folder of its own, then renamed: a server never finds half a fitting,
    # and one stopped midway leaves the last complete one in place.
    partial = out.with_name(f"{out.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True)
    try:
        fit_confidence(model, tokenizer, partial, serving, TraceSize(args.sequences, args.prompt_tokens))
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log.info("saved in %s", out)


if __name__ == "__main__":
    main()
