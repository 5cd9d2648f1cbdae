"""What the predictor sees of one (layer, entry) at one observation: the same in traces and online."""

from __future__ import annotations

import math

import torch

FEATURES = ("attention_last", "attention_decayed", "age", "position", "token_confidence", "key_norm", "layer")
ATTENTION_SCALE = 100.0  # attention masses are small; log1p(100 x mass) spreads them over ~[0, 5]
MAX_CONTEXT = 8192
KEY_NORM_SCALE = 10.0


def scaled_attention(mass: torch.Tensor) -> torch.Tensor:
    return torch.log1p(ATTENTION_SCALE * mass)


def entry_features(
    mass: torch.Tensor,
    decayed: torch.Tensor,
    entry_positions: torch.Tensor,
    query_position: int,
    token_confidence: torch.Tensor,
    key_norm: torch.Tensor,
    layer: int,
    num_layers: int,
) -> torch.Tensor:
    """[n, len(FEATURES)] for n entries of one layer at one observation, in FEATURES order."""
    age = (query_position - entry_positions).clamp(min=0).float()
    columns = (
        scaled_attention(mass),
        scaled_attention(decayed),
        torch.log1p(age) / math.log(MAX_CONTEXT),
        entry_positions.float() / max(query_position, 1),
        token_confidence,
        key_norm / KEY_NORM_SCALE,
        torch.full_like(mass, layer / num_layers),
    )
    return torch.stack([c.float() for c in columns], dim=-1)


def target(future_mass: torch.Tensor) -> torch.Tensor:
    """What the predictor learns: log1p of the attention mass an entry receives over the window."""
    return scaled_attention(future_mass)
