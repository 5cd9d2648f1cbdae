"""What one compression of a sequence may keep: the budget step of budget -> score -> plan -> apply.

The request's rate sets a ceiling of bytes per layer (whole blocks counted); where the thresholds
judge the request, its content may set less (`judge`); `layer_budget` shares the bytes among the
layers; only layers over their share are compacted (`layers_over`), since memory is held in whole
blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from confkv.compress.state import SequenceState
from confkv.compress.tiers import layers_threshold_bytes, pyramid_weights
from confkv.kv.kv_store import KVStore


class Budget(NamedTuple):
    """What one compression of a sequence may keep."""

    ceiling: float  # bytes per layer the rate allows, on average over the layers
    per_layer: float  # bytes per layer it may keep on average: the ceiling, or less where the thresholds judged so
    full_bytes: int  # of a FULL entry
    key_only_bytes: int  # of a KEY_ONLY entry
    value_errors: tuple[float, float]  # relative error of a FULL and of a KEY_ONLY value as stored; (0, 0): count first
    rounding: float  # a partial block of each of a layer's tables: what whole blocks may hold past `per_layer`
    judge: bool  # do the thresholds judge the request now (every layer)?
    rescore: bool  # is every layer scored now (to judge, or to share the bytes among layers afresh)?


class Judged(NamedTuple):
    """The layers of a sequence a compression judges, a row [layers, n] each, padded past its entries."""

    layers: list[int]
    num_key_only: torch.Tensor  # [layers]
    held: torch.Tensor  # the row's entries (its first): the rest is padding
    protected: torch.Tensor  # sinks and the recent window
    scores: torch.Tensor
    retention: torch.Tensor | None  # retention confidence, where the policy gives one
    judged: torch.Tensor  # entries an earlier compression kept


def plan_budget(store: KVStore, seq_id: int, num_tokens: int, state: SequenceState, rate: float) -> Budget:
    """What this compression may keep of each layer at `rate`, and whether the thresholds judge the request now."""
    codec = store.codec_of(seq_id)
    # Scores that are expected attention also say what a precise value is worth (`_spend`);
    # others (positions, key norms) say nothing of it, and the plan keeps the count first.
    errors = store.value_errors(codec) if state.policy.uses_attention else (0.0, 0.0)
    sizes = (*store.entry_bytes(codec), errors)
    if rate <= 0.0:
        return Budget(float("inf"), float("inf"), *sizes, 0.0, judge=False, rescore=False)
    per_token = store.model_token_bytes / store.num_layers
    # Tables hold whole blocks: leave room for a partial one of each of the three tables.
    rounding = store.table_blocks_bytes(codec)
    ceiling = (1.0 - rate) * num_tokens * per_token - rounding
    # The thresholds judge every layer's entries, so only every `prediction_refresh` compressions
    # (when the predictor refreshes its forecasts); in between, what they kept per token holds.
    # Adaptive layer budgets are shared out afresh as often, from every layer's scores.
    refresh = state.compressions % state.params.prediction_refresh == 0
    judge = state.policy.thresholds_decide and refresh
    rescore = judge or (refresh and state.params.layer_budget == "adaptive")
    per_layer = ceiling
    if state.content_bytes_per_token is not None and not judge:
        per_layer = min(ceiling, state.content_bytes_per_token * num_tokens)
    return Budget(ceiling, per_layer, *sizes, rounding, judge, rescore)


def judge(judged: Judged, budget: Budget, state: SequenceState, num_tokens: int) -> float:
    """Bytes each layer may hold, as the thresholds judge the request: its share of what they keep
    over all its layers (under the rate's ceiling), so memory follows the content of the request
    while every layer holds as much. Remembered per token for the compressions until the next
    judgment. Without retention confidences (no calibration, nothing observed yet) the rate decides.

    The thresholds judge the request, not each layer: letting them set each layer's bytes (few
    where attention is concentrated, many where it is diffuse) lost fidelity at equal bytes
    against a fixed rate (see docs/design.md)."""
    if judged.retention is None:
        state.content_bytes_per_token = None
        return budget.ceiling
    held = layers_threshold_bytes(
        judged.protected,
        judged.num_key_only,
        budget.full_bytes,
        budget.key_only_bytes,
        state.policy.uses_tiers,
        judged.retention,
        judged.judged,
        judged.held,
        state.params.thresholds,
    )
    per_layer = int(held.sum()) / len(judged.layers)
    state.content_bytes_per_token = per_layer / num_tokens
    return min(budget.ceiling, per_layer)


def layer_bytes(num_layers: int, state: SequenceState, per_layer: float) -> list[float]:
    """Each layer's bytes: the per-layer mean, shared among the layers as `layer_budget` says."""
    kind = state.params.layer_budget
    weights = pyramid_weights(num_layers) if kind == "pyramid" else state.layer_weights
    if kind == "uniform" or weights is None:
        return [per_layer] * num_layers
    return (per_layer * weights).tolist()


def layers_to_compress(store: KVStore, seq_id: int, state: SequenceState, budget: Budget) -> list[int]:
    """The layers a compression scores: every layer it may change (`KVStore.compressible_layers`: not a
    sliding window's) when the thresholds judge the request or the layers' shares are renewed, else
    only those of them over their budget (`layers_over`)."""
    if budget.rescore:
        return store.compressible_layers
    shares = layer_bytes(store.num_layers, state, budget.per_layer)
    over = layers_over(store, seq_id, shares, budget.rounding)
    return [layer for layer in store.compressible_layers if over[layer]]


def layers_over(store: KVStore, seq_id: int, shares: list[float], rounding: float) -> np.ndarray:
    """Which layers [layers] hold more than their bytes, whole blocks counted (a partial block of
    each table allowed): only compacting those frees memory, which is held in whole blocks.
    Compacting a layer that fits would drop entries and rewrite its tables for no block freed."""
    return store.layer_bytes(seq_id) > np.asarray(shares) + rounding
