"""The future-value predictor: a small LSTM that predicts an entry's coming attention (seed 000)."""

from confkv.compress.predictor.model import (
    PredictorConfig,
    ValuePredictor,
    load_predictor,
    model_fingerprint,
    save_predictor,
)

__all__ = ["PredictorConfig", "ValuePredictor", "load_predictor", "model_fingerprint", "save_predictor"]
