"""The threshold policy: from scores to tiers under a byte budget.

Entries of one layer are ranked by score, best first. The budget decides how many can stay and
how: first keep as many entries as the budget allows at the cheapest tier they can take (KEY_ONLY
for a tiering policy), then spend what is left raising the best-ranked of them back to FULL. An
entry is only ever demoted as far as the budget needs, so a budget that holds everything FULL
changes nothing.

Each entry gets a retention confidence in [0, 1] that falls with its rank and is calibrated to
those boundaries: the entries kept FULL span (high, 1), those kept KEY_ONLY (medium, high), the
dropped ones (0, medium). The thresholds of seed 002 (>= high FULL, >= medium KEY_ONLY, below
dropped) then read the plan off the confidence, and the lowest-confidence entries are always the
first demoted. Protected entries (attention sinks, the recent window) are always kept.
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
    tiering = use_tiers and high > medium  # otherwise eviction only: no new KEY_ONLY entries
    cost_now = torch.where(was_key_only, key_only_bytes, full_bytes)
    remaining = max(budget_bytes - float(cost_now[protected].sum()), 0.0)

    # Rank the unprotected entries, best first.
    candidates = index[~protected]
    order = candidates[torch.argsort(scores[candidates], descending=True, stable=True)]
    ko_ranked = was_key_only[order]
    if tiering:
        # Keep the longest prefix the budget holds at KEY_ONLY, then raise the best to FULL.
        kept = torch.arange(order.numel(), device=device) < int(remaining // key_only_bytes)
        upgrades = int((remaining - key_only_bytes * int(kept.sum())) // (full_bytes - key_only_bytes))
        full = kept & ~ko_ranked & (torch.cumsum((kept & ~ko_ranked).long(), 0) <= upgrades)
    else:
        kept = torch.cumsum(cost_now[order].float(), 0) <= remaining
        full = kept & ~ko_ranked
    key_only = kept & ~full

    confidence = torch.ones(n, device=device)
    confidence[order] = _calibrated(full, key_only, high, medium)
    keep_protected = index[protected]
    protected_full = keep_protected[~was_key_only[keep_protected]]
    protected_key_only = keep_protected[was_key_only[keep_protected]]
    return TierPlan(
        keep_full=torch.cat((protected_full, order[full])),
        keep_key_only=torch.cat((protected_key_only, order[key_only])),
        dropped=order[~kept],
        confidence=confidence,
    )


def _calibrated(full: torch.Tensor, key_only: torch.Tensor, high: float, medium: float) -> torch.Tensor:
    """Confidence of ranked entries: falls linearly with rank inside each tier's open band (bottom, top)."""
    confidence = torch.empty(full.numel(), device=full.device)
    for members, top, bottom in ((full, 1.0, high), (key_only, high, medium), (~(full | key_only), medium, 0.0)):
        count = int(members.sum())
        confidence[members] = top - (top - bottom) * torch.arange(1, count + 1, device=full.device) / (count + 1)
    return confidence
