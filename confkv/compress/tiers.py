"""From scores to tiers: a byte budget per layer, filled most value per byte first.

The budget comes first. Where the policy gives a retention confidence, the thresholds of seed 002
(>= high FULL, >= medium KEY_ONLY, below dropped; an entry an earlier compression kept is dropped
only below `low`) judge the whole request: the compressor asks them only how many bytes they would
keep (`threshold_bytes`, a plan under an unlimited budget), and those bytes over all layers, shared
equally among the layers and capped by `compression_rate`, become every layer's budget
(`confkv.compress.budget.judge`). Without confidences the rate alone sets it. So the thresholds decide how much
a request keeps; they do not pick each entry's tier.

Within its budget a layer's plan (`plan_tiers`, as the compressor calls it) ranks entries by score,
best first; given confidences and thresholds it ranks by confidence and caps each entry at what the
thresholds allow, which is how `threshold_bytes` asks them. An entry that is KEY_ONLY already never
goes back to FULL (a quantised value is never restored). The budget then buys, most value
per byte first, two kinds of step: keeping an entry (best-ranked first, at KEY_ONLY for a tiering
policy) and raising a kept one to FULL (up to its limit). An entry moves the output by its attention
times its error, and independent errors add as variances: keeping is worth the squared expected
attention times what the KEY_ONLY value's error leaves of it, raising that square times the error
FULL removes (see `_spend`). So the entries the output leans on (a fact being copied) get precise
values before faint ones are kept, an entry is demoted only as far as the budget needs, and the
lowest-ranked go first. Protected entries (attention sinks, the recent window) are always kept as
they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from confkv.compress.config import Thresholds


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
    value_errors: tuple[float, float] = (0.0, 0.0),
) -> TierPlan:
    """`confidence` [n] in [0, 1] with `thresholds` lets the thresholds decide; `judged` [n] marks the
    entries an earlier compression kept (they keep their place down to the drop line).
    `value_errors`: the relative error of a FULL and of a KEY_ONLY value as stored (`Codec.relative_error`),
    which sets what raising an entry to FULL is worth against keeping one more (`_spend`)."""
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
        kept, full = _spend(remaining, scores[candidates], may_keep, may_full, full_bytes, key_only_bytes, value_errors)
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


def _spend(
    budget: float,
    scores: torch.Tensor,
    may_keep: torch.Tensor,
    may_full: torch.Tensor,
    full_bytes: int,
    key_only_bytes: int,
    value_errors: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the ranked entries [m] are kept, and which of them FULL: the budget buys steps, most
    worth per byte first. An entry moves the output by its attention times its error: all of it when
    dropped, the relative error of its value as stored when kept. Independent errors add as
    variances, so keeping an entry (as KEY_ONLY) is worth a^2 x (1 - KEY_ONLY error^2), raising a
    kept one to FULL a^2 x (KEY_ONLY error^2 - FULL error^2). Its future attention a is a forecast:
    its square is expected as the score's square plus the mean square over the entries, as no
    forecast tells faint entries apart. So an entry is raised at the cost of faint ones only when its
    score stands far above the layer's typical one (a fact being copied); spread attention keeps the
    count. An entry's score is that of its rank (`scores`, sorted): the ranking says which are kept,
    the scores how many are raised. With no error given, every entry the budget holds is kept
    before any is raised."""
    m = may_keep.numel()
    raise_cost = full_bytes - key_only_bytes
    if raise_cost <= 0:  # values stored as keys are: raising is free
        kept = may_keep & (torch.cumsum(may_keep.long(), 0) <= _fits(budget, key_only_bytes, m))
        return kept, kept & may_full
    full_error, key_only_error = value_errors
    variance = torch.sort(scores.float().clamp_min(0.0), descending=True).values.square()
    if m:
        variance = variance + variance[may_keep].mean().nan_to_num(0.0)
    keep_gain = variance * (1.0 - key_only_error**2) / key_only_bytes
    raise_gain = torch.minimum(variance * max(key_only_error**2 - full_error**2, 0.0) / raise_cost, keep_gain)
    never = torch.tensor(float("-inf"), device=variance.device)
    gain = torch.cat((torch.where(may_keep, keep_gain, never), torch.where(may_keep & may_full, raise_gain, never)))
    cost = torch.cat((torch.full((m,), float(key_only_bytes)), torch.full((m,), float(raise_cost)))).to(variance.device)
    steps = torch.argsort(gain, descending=True, stable=True)  # a raise never comes before its own keep
    bought = torch.zeros(2 * m, dtype=torch.bool, device=variance.device)
    bought[steps] = (torch.cumsum(cost[steps], 0) <= budget) & (gain[steps] > never)
    return bought[:m], bought[m:]


def _fits(budget: float, cost: int, most: int) -> int:
    """How many entries of `cost` bytes `budget` holds (at most `most`; an unlimited budget holds all)."""
    return most if math.isinf(budget) else int(budget // cost)
