"""The future-value predictor: an LSTM over an entry's recent observations, and its weights file.

Weights are saved as safetensors with JSON metadata: the predictor config, the feature list and the
fingerprint of the language model whose attention it learned. Loading refuses another model's
weights with a clear message, and a missing file means attention-only scoring (the caller logs it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from confkv import CONFIG_DIR
from confkv.compress.predictor.features import FEATURES

DEFAULT_CONFIG = CONFIG_DIR / "prediction_model.yaml"


@dataclass(frozen=True)
class PredictorConfig:
    model_arch: str = "lstm"
    hidden_size: int = 256
    num_layers: int = 2
    dropout_rate: float = 0.1
    learning_rate: float = 1e-4
    features: tuple[str, ...] = field(default_factory=tuple)
    observation_steps: int = 4
    prediction_window: int = 128
    target: str = "log1p_future_attention"
    batch_size: int = 512
    max_epochs: int = 30
    patience: int = 3
    validation_share: float = 0.2
    prefill_weight: float = 1.0

    @classmethod
    def load(cls, path: Path | None = None, profile: str | None = None, **overrides) -> PredictorConfig:
        """The config file's settings, with a named profile's and then `overrides` over them."""
        data = yaml.safe_load(Path(path or DEFAULT_CONFIG).read_text())
        profiles = data.pop("profiles", {}) or {}
        if profile is not None:
            if profile not in profiles:
                raise ValueError(f"no predictor profile {profile!r}; the config has {sorted(profiles)}")
            data.update(profiles[profile])
        data.update(overrides)
        if data.get("model_arch") != "lstm":
            raise ValueError(f"model_arch {data.get('model_arch')!r} is not supported; use lstm")
        if tuple(data["features"]) != FEATURES:
            raise ValueError(f"features must be {list(FEATURES)}: those are the ones traces and scoring compute")
        return cls(**{**data, "features": tuple(data["features"])})

    @property
    def num_features(self) -> int:
        return len(self.features)

    @property
    def short_description(self) -> str:
        return f"{self.model_arch} {self.num_layers}x{self.hidden_size}, {self.observation_steps} observations"


class ValuePredictor(nn.Module):
    """[entries, observation_steps, features] -> predicted log1p future attention, [entries]."""

    def __init__(self, config: PredictorConfig) -> None:
        super().__init__()
        self.config = config
        self.lstm = nn.LSTM(
            config.num_features,
            config.hidden_size,
            num_layers=config.num_layers,
            dropout=config.dropout_rate if config.num_layers > 1 else 0.0,
            batch_first=True,
        )
        self.head = nn.Linear(config.hidden_size, 1)

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(window)
        return self.head(out[:, -1]).squeeze(-1)


def model_fingerprint(model_config) -> str:
    """What the predictor's training depends on: the language model's architecture and vocabulary."""
    keys = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")
    keys += ("vocab_size",)
    described = {k: getattr(model_config, k, None) for k in keys}
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def random_predictor(like: ValuePredictor, seed: int = 0) -> ValuePredictor:
    """A predictor of `like`'s configuration with weights drawn from `seed`: what a model with random
    weights brings, so that its compression costs what a trained predictor's would."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ValuePredictor(like.config).eval()


def save_predictor(predictor: ValuePredictor, path: Path, fingerprint: str, extra: dict | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "config": json.dumps(asdict(predictor.config)),
        "model_fingerprint": fingerprint,
        **{k: json.dumps(v) for k, v in (extra or {}).items()},
    }
    state = {k: v.detach().contiguous() for k, v in predictor.state_dict().items()}
    save_file(state, str(path), metadata=metadata)
    path.chmod(0o644)  # safetensors writes 0600; servers often run as another user


def load_predictor(path: Path, fingerprint: str) -> ValuePredictor | None:
    """The predictor saved at `path`, or None if there is none; another model's weights are refused."""
    if not path.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
    if metadata.get("model_fingerprint") != fingerprint:
        raise ValueError(
            f"{path} was trained on another model (fingerprint {metadata.get('model_fingerprint')}, this model "
            f"{fingerprint}); train one for this model with `make train-predictor` or remove the file"
        )
    config = json.loads(metadata["config"])
    predictor = ValuePredictor(PredictorConfig(**{**config, "features": tuple(config["features"])}))
    predictor.load_state_dict(load_file(str(path)))
    return predictor.eval()
