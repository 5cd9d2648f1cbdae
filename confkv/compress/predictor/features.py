"""What the predictor sees of one (layer, entry) over its last observations: the same in traces
and online, so that the weights learned from traces read the live cache the same way."""

from __future__ import annotations

import math

import torch

FEATURES = ("attention_last", "attention_decayed", "age", "position", "token_confidence", "key_norm", "layer")
ATTENTION_SCALE = 100.0  # attention masses are small; log1p(100 x mass) spreads them over ~[0, 5]
MAX_CONTEXT = 8192
KEY_NORM_SCALE = 10.0


def scaled_attention(mass: torch.Tensor) -> torch.Tensor:
    return torch.log1p(ATTENTION_SCALE * mass)


def unscaled_attention(scaled: torch.Tensor) -> torch.Tensor:
    """The inverse of `scaled_attention`: back to attention mass (never negative)."""
    return torch.expm1(scaled).clamp(min=0.0) / ATTENTION_SCALE


def window_features(
    masses: torch.Tensor,
    decayed: torch.Tensor,
    entry_positions: torch.Tensor,
    query_positions: torch.Tensor,
    token_confidence: torch.Tensor,
    key_norm: torch.Tensor,
    layer: int | torch.Tensor,
    num_layers: int,
) -> torch.Tensor:
    """[n, T, len(FEATURES)] for n entries over T observations (oldest first), of one `layer` or each
    of its own (`layer` [n]).

    masses [T, n]: attention each entry received from each observed query (mean over heads);
    query_positions [T]: those queries' positions; decayed [n]: the dynamic policy's decayed score
    now, the same at every observation (it summarises the time before the window).
    """
    steps, n = masses.shape
    query = query_positions.view(steps, 1).to(masses.device).float()
    position = entry_positions.view(1, n).float()
    age = (query - position).clamp(min=0.0)
    columns = (
        scaled_attention(masses.float()),
        scaled_attention(decayed.float()).view(1, n),
        torch.log1p(age) / math.log(MAX_CONTEXT),
        position / query.clamp(min=1.0),
        token_confidence.float().view(1, n),
        key_norm.float().view(1, n) / KEY_NORM_SCALE,
        (torch.as_tensor(layer, dtype=torch.float64, device=masses.device) / num_layers).float().view(1, -1),
    )
    return torch.stack([c.expand(steps, n) for c in columns], dim=-1).transpose(0, 1)


def target(future_mass: torch.Tensor) -> torch.Tensor:
    """What the predictor learns: log1p of the attention mass an entry receives over the window."""
    return scaled_attention(future_mass)
