"""From scores to tiers: the thresholds decide where the policy gives a retention confidence, and
the byte budget (`compression_rate`) is a ceiling.

Entries of one layer are ranked best first: by retention confidence when the policy gives one (ties
by score), else by score. The most each unprotected entry may keep is its limit:
- with a confidence, the thresholds of seed 002: >= high FULL, >= medium KEY_ONLY, below dropped;
  an entry that an earlier compression kept (`judged`) is dropped only below the drop line (`low`,
  default medium), and between it and high it stays as KEY_ONLY. Memory then follows the content;
- without one, FULL for every entry: the budget alone decides.
An entry that is KEY_ONLY already never goes back to FULL. The budget then keeps as many entries as
it holds, best-ranked first, at the cheapest tier they can take (KEY_ONLY for a tiering policy), and
spends what is left raising the best of them to their limit. So an entry is demoted only as far as
the budget or its own confidence needs, and the lowest-ranked go first. Protected entries
(attention sinks, the recent window) are always kept as they are.

The compressor asks the thresholds only what they would keep (`threshold_bytes`, the bytes
of a plan under an unlimited budget); those bytes over all layers, shared equally among the layers,
become the budget of plans without them (`Compressor._judge`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compression.config import Thresholds


@dataclass
class TierPlan:
    keep_full: torch.Tensor  # indices (key order) kept FULL
    keep_key_only: torch.Tensor  # indices kept or newly made KEY_ONLY
    dropped: torch.Tensor  # indices dropped


def plan_tiers(
    scores: torch.Tensor,
    protected: torch.Tensor,
    num_key_only: int,
    budget_bytes: float,
    full_bytes: int,
    key_only_bytes: int,
    use_tiers: bool,
    confidence: torch.Tensor | None = None,
    thresholds: Thresholds | None = None,
    judged: torch.Tensor | None = None,
) -> TierPlan:
    """`confidence` [n] in [0, 1] with `thresholds` lets the thresholds decide; `judged` [n] marks the
    entries an earlier compression kept (they keep their place down to the drop line)."""
    n = scores.numel()
    device = scores.device
    index = torch.arange(n, device=device)
    was_key_only = index < num_key_only
    cost_now = torch.where(was_key_only, key_only_bytes, full_bytes)
    remaining = max(budget_bytes - float(cost_now[protected].sum()), 0.0)

    candidates = index[~protected]
    order = candidates[torch.argsort(scores[candidates], descending=True, stable=True)]
    if confidence is not None:  # by confidence, ties (a calibration's flat steps) by score
        order = order[torch.argsort(confidence[order], descending=True, stable=True)]
    ko_ranked = was_key_only[order]
    may_keep, may_full = _limits(was_key_only, use_tiers, confidence, thresholds, judged)
    may_keep, may_full = may_keep[order], may_full[order]

    if use_tiers:
        # Keep the best-ranked the budget holds at KEY_ONLY, then raise the best of them to their limit.
        kept = may_keep & (torch.cumsum(may_keep.long(), 0) <= _fits(remaining, key_only_bytes, n))
        left = remaining - key_only_bytes * int(kept.sum())
        raised = kept & may_full
        full = raised & (torch.cumsum(raised.long(), 0) <= _fits(left, full_bytes - key_only_bytes, n))
    else:  # eviction only: a kept entry stays at its tier
        kept = may_keep & (torch.cumsum(torch.where(may_keep, cost_now[order], 0).float(), 0) <= remaining)
        full = kept & ~ko_ranked
    key_only = kept & ~full

    keep_protected = index[protected]
    protected_full = keep_protected[~was_key_only[keep_protected]]
    protected_key_only = keep_protected[was_key_only[keep_protected]]
    return TierPlan(
        keep_full=torch.cat((protected_full, order[full])),
        keep_key_only=torch.cat((protected_key_only, order[key_only])),
        dropped=order[~kept],
    )


def threshold_bytes(
    protected: torch.Tensor,
    num_key_only: int,
    full_bytes: int,
    key_only_bytes: int,
    use_tiers: bool,
    confidence: torch.Tensor,
    thresholds: Thresholds | None = None,
    judged: torch.Tensor | None = None,
) -> int:
    """Bytes the thresholds alone would keep of one layer: what `plan_tiers` keeps under an unlimited
    budget, counted without ranking."""
    was_key_only = torch.arange(protected.numel(), device=protected.device) < num_key_only
    may_keep, may_full = _limits(was_key_only, use_tiers, confidence, thresholds, judged)
    kept, full = int((may_keep & ~protected).sum()), int((may_full & ~protected).sum())
    protected_key_only = int((was_key_only & protected).sum())
    protected_full = int(protected.sum()) - protected_key_only
    return (full + protected_full) * full_bytes + (kept - full + protected_key_only) * key_only_bytes


PYRAMID_BETA = 20.0  # PyramidKV's (and kvpress's) default: the top layer holds 1/beta of the mean
ADAPTIVE_FLOOR = 0.2  # share of every layer's bytes given uniformly before the adaptive share (AdaKV's safeguard)


def pyramid_weights(num_layers: int, beta: float = PYRAMID_BETA) -> torch.Tensor:
    """PyramidKV's per-layer shares of a request's bytes, mean 1: an arithmetic sequence from the
    bottom layer down to 1/beta at the top (lower layers attend broadly, upper ones to few entries)."""
    if num_layers == 1:
        return torch.ones(1)
    low = 1.0 / beta
    return torch.linspace(2.0 - low, low, num_layers)


def adaptive_weights(values: list[torch.Tensor], floor: float = ADAPTIVE_FLOOR) -> torch.Tensor:
    """Per-layer shares of a request's bytes, mean 1, from each layer's expected attention over its
    unprotected entries (`values`: the forecast, or the observed attention): in proportion to the
    distribution's effective number of entries, exp(entropy), so a layer whose attention spreads
    wide holds more than one that looks at a few entries. `floor` of the bytes is shared uniformly,
    so no layer is starved by a forecast that missed. A layer with nothing observed counts as average."""
    spread = torch.empty(len(values))
    for i, value in enumerate(values):
        total = float(value.sum())
        if value.numel() == 0 or total <= 0.0:
            spread[i] = float("nan")
            continue
        p = value.float().clamp_min(0.0) / total
        spread[i] = torch.exp(-(p * torch.log(p.clamp_min(1e-12))).sum())
    known = ~spread.isnan()
    if not known.any():
        return torch.ones(len(values))
    spread[~known] = spread[known].mean()
    return floor + (1.0 - floor) * spread / spread.mean()


def _limits(
    was_key_only: torch.Tensor,
    use_tiers: bool,
    confidence: torch.Tensor | None,
    thresholds: Thresholds | None,
    judged: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """May each entry be kept, and kept FULL: by the thresholds where there is a confidence, else
    always (FULL unless it is KEY_ONLY already)."""
    if confidence is None:
        return torch.ones_like(was_key_only), ~was_key_only
    thresholds = thresholds or Thresholds()
    line = torch.full_like(confidence, thresholds.medium)
    if judged is not None:
        line[judged] = thresholds.drop_line
    may_keep = confidence >= line
    return may_keep, may_keep & ~was_key_only & ((confidence >= thresholds.high) | (not use_tiers))


def _fits(budget: float, cost: int, most: int) -> int:
    """How many entries of `cost` bytes `budget` holds (at most `most`; an unlimited budget, or a
    free step, as raising KEY_ONLY to FULL is where values are stored as keys are, holds all)."""
    return most if math.isinf(budget) or cost <= 0 else int(budget // cost)
