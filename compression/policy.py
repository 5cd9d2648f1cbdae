"""The threshold policy: from scores to tiers under a byte budget.

Entries of one layer are ranked by score. Each gets a retention confidence in [0, 1] that falls
linearly with its rank, scaled so that the entries the budget can afford span [medium, 1]:

    confidence_j = 1 - (1 - medium) * j / affordable

where `affordable` is how many entries fit the budget with the tier mix the thresholds imply
(a share (1 - high) / (1 - medium) of the kept entries FULL, the rest KEY_ONLY). Then, as seed 002
says: confidence >= high stays FULL, >= medium becomes KEY_ONLY, below is dropped. Finally the
budget is enforced exactly: while over it, the lowest-confidence entries are demoted first.
Protected entries (attention sinks, the recent window) are always kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TierPlan:
    keep_full: torch.Tensor  # indices (key order) kept FULL
    keep_key_only: torch.Tensor  # indices kept or newly made KEY_ONLY
    dropped: torch.Tensor  # indices dropped
    confidence: torch.Tensor  # [n] retention confidence of every entry


def plan_tiers(
    scores: torch.Tensor,
    protected: torch.Tensor,
    num_key_only: int,
    budget_bytes: float,
    full_bytes: int,
    key_only_bytes: int,
    high: float,
    medium: float,
    use_tiers: bool,
) -> TierPlan:
    n = scores.numel()
    device = scores.device
    index = torch.arange(n, device=device)
    was_key_only = index < num_key_only
    if not use_tiers or high <= medium:
        high = medium  # eviction only: no KEY_ONLY band
    cost_now = torch.where(was_key_only, key_only_bytes, full_bytes)
    remaining = budget_bytes - float(cost_now[protected].sum())

    # Rank the unprotected entries, best first.
    candidates = index[~protected]
    order = candidates[torch.argsort(scores[candidates], descending=True, stable=True)]
    full_share = (1.0 - high) / (1.0 - medium) if medium < 1.0 else 1.0
    mean_cost = full_share * full_bytes + (1.0 - full_share) * key_only_bytes
    affordable = max(remaining / mean_cost, 1e-9)
    rank = torch.arange(order.numel(), device=device, dtype=torch.float32)
    conf_ranked = (1.0 - (1.0 - medium) * rank / affordable).clamp(0.0, 1.0)

    # Thresholds; an entry already KEY_ONLY cannot go back to FULL.
    full = (conf_ranked >= high) & ~was_key_only[order]
    key_only = (conf_ranked >= medium) & ~full
    # Budget: keep the best-ranked prefix that fits (demoting the lowest confidence first).
    cost = torch.where(full, float(full_bytes), torch.where(key_only, float(key_only_bytes), 0.0))
    fits = torch.cumsum(cost, 0) <= max(remaining, 0.0)
    full &= fits
    key_only &= fits

    confidence = torch.ones(n, device=device)
    confidence[order] = conf_ranked
    keep_protected = index[protected]
    protected_full = keep_protected[~was_key_only[keep_protected]]
    protected_key_only = keep_protected[was_key_only[keep_protected]]
    return TierPlan(
        keep_full=torch.cat((protected_full, order[full])),
        keep_key_only=torch.cat((protected_key_only, order[key_only])),
        dropped=order[~(full | key_only)],
        confidence=confidence,
    )
