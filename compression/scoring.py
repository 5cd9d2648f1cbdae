"""Scoring policies: each says how much every cached entry of one layer is worth keeping.

In the manner of kvpress, a policy is a small dataclass with one `score()` method (higher means
keep) and, where it uses observed attention, an `accumulate()` rule for new observations. The
engine does the rest: observing attention, turning scores into tiers under the budget, compacting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LayerEntries:
    """What a policy may look at for the entries one layer of one sequence holds."""

    keys: torch.Tensor | None  # [kv_heads, n, head_dim], for policies that use keys
    positions: torch.Tensor  # [n]
    attention: torch.Tensor  # [n] observed attention, accumulated by the policy's rule
    token_confidence: torch.Tensor  # [n] top-token probability when the entry's token was sampled (1 for prompt)
    position: int  # position of the newest token
    layer: int
    seed: int = 0
    predicted: torch.Tensor | None = None  # [n] the value predictor's future attention, when it ran


@dataclass
class ScorePolicy:
    """Base: eviction only (an entry is kept FULL or dropped), attention summed over observations."""

    name = "base"
    uses_tiers = False  # may the policy keep entries as KEY_ONLY?
    uses_attention = True  # does it need attention observations?
    uses_keys = False  # does it read the keys (dequantised at quantised storage)?
    observation_window: int | None = None  # prompt queries observed at the end of prefill (None: the config's)

    def accumulate(self, previous: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return previous + observed

    def score(self, entries: LayerEntries) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class StreamingLLM(ScorePolicy):
    """Keep the attention sinks (protected anyway) and the most recent tokens."""

    name = "streaming_llm"
    uses_attention = False

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return entries.positions.float()


@dataclass
class H2O(ScorePolicy):
    """Heavy hitters: attention accumulated over every observation."""

    name = "h2o"

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return entries.attention


@dataclass
class TOVA(ScorePolicy):
    """Attention of the latest observed query only."""

    name = "tova"
    observation_window = 1

    def accumulate(self, previous: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return observed

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return entries.attention


@dataclass
class SnapKV(ScorePolicy):
    """Attention of the latest observation window, pooled over neighbouring positions."""

    name = "snapkv"
    kernel_size: int = 5

    def accumulate(self, previous: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return observed

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return _pool(entries.attention, self.kernel_size, "avg")


@dataclass
class KNorm(ScorePolicy):
    """Keys with a small norm draw more attention (kvpress' Knorm)."""

    name = "knorm"
    uses_attention = False
    uses_keys = True

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return -entries.keys.float().norm(dim=-1).mean(dim=0)


@dataclass
class Random(ScorePolicy):
    name = "random"
    uses_attention = False

    def score(self, entries: LayerEntries) -> torch.Tensor:
        generator = torch.Generator().manual_seed(entries.seed * 1_000_003 + entries.layer * 7919 + entries.position)
        return torch.rand(entries.positions.numel(), generator=generator).to(entries.positions.device)


@dataclass
class Dynamic(ScorePolicy):
    """Future value, pooled over neighbours, raised for tokens sampled in doubt.

    The future value is the attention the value predictor expects over the coming window when it
    ran, else the decayed observed attention: old observations fade (`decay` per observation), so
    entries that mattered once but no longer do can leave. The pooling keeps the neighbours of
    attended tokens (facts span several tokens). Tokens the model sampled with low confidence
    mark points where the text could have gone another way; they get up to `doubt_weight` more.
    """

    name = "dynamic"
    uses_tiers = True
    decay: float = 0.95
    kernel_size: int = 3
    doubt_weight: float = 0.5

    def accumulate(self, previous: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return self.decay * previous + observed

    def score(self, entries: LayerEntries) -> torch.Tensor:
        value = entries.attention if entries.predicted is None else entries.predicted
        pooled = _pool(value, self.kernel_size, "max")
        return pooled * (1.0 + self.doubt_weight * (1.0 - entries.token_confidence))


def _pool(x: torch.Tensor, kernel: int, kind: str) -> torch.Tensor:
    if x.numel() < kernel:
        return x
    pool = F.max_pool1d if kind == "max" else F.avg_pool1d
    return pool(x.view(1, 1, -1), kernel, stride=1, padding=kernel // 2).view(-1)[: x.numel()]


def make_policy(name: str, attention_decay: float = 0.95) -> ScorePolicy:
    policies = {
        "streaming_llm": StreamingLLM,
        "h2o": H2O,
        "tova": TOVA,
        "snapkv": SnapKV,
        "knorm": KNorm,
        "random": Random,
    }
    if name == "dynamic":
        return Dynamic(decay=attention_decay)
    if name not in policies:
        raise ValueError(f"unknown policy {name!r}")
    return policies[name]()
