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
    """One layer's plan (`plan_layers` for a single layer): `scores` and `protected` [n]."""
    rows = (None if t is None else t.unsqueeze(0) for t in (confidence, judged))
    return plan_layers(
        scores.unsqueeze(0),
        protected.unsqueeze(0),
        torch.tensor([num_key_only]),
        [budget_bytes],
        full_bytes,
        key_only_bytes,
        use_tiers,
        *rows,
        thresholds=thresholds,
        value_errors=value_errors,
    )[0]


def plan_layers(
    scores: torch.Tensor,
    protected: torch.Tensor,
    num_key_only: torch.Tensor,
    budget_bytes: list[float],
    full_bytes: int,
    key_only_bytes: int,
    use_tiers: bool,
    confidence: torch.Tensor | None = None,
    judged: torch.Tensor | None = None,
    held: torch.Tensor | None = None,
    thresholds: Thresholds | None = None,
    value_errors: tuple[float, float] = (0.0, 0.0),
) -> list[TierPlan]:
    """The plans of several layers at once, each a row [layers, n] (`held`: the entries of padded rows,
    their first; None: all), under its budget (`budget_bytes`, `num_key_only` [layers]). `confidence`
    [layers, n] in [0, 1] with `thresholds` lets the thresholds decide; `judged` marks the entries an
    earlier compression kept (they keep their place down to the drop line). `value_errors`: the
    relative error of a FULL and of a KEY_ONLY value as stored (`Codec.relative_error`), which sets
    what raising an entry to FULL is worth against keeping one more (`_spend`). Every row is planned
    as it would be alone; one call for all saves the per-layer calls, which cost most of a judgment."""
    layers, n = scores.shape
    if not layers:
        return []
    device = scores.device
    held = torch.ones_like(protected) if held is None else held
    protected = protected & held
    candidate = held & ~protected
    index = torch.arange(n, device=device).expand(layers, n)
    was_key_only = index < num_key_only.to(device).view(-1, 1)
    cost_now = torch.where(was_key_only, key_only_bytes, full_bytes)
    # In float64, as a Python float subtracts; compared below in float32, as a float32 tensor is with a float.
    protected_cost = torch.where(protected, cost_now, 0).sum(-1)
    remaining = (torch.tensor(budget_bytes, dtype=torch.float64, device=device) - protected_cost).clamp_min(0.0)

    order = _ranked(index, scores, candidate)
    if confidence is not None:  # by confidence, ties (a calibration's flat steps) by score
        order = _ranked(order, confidence, candidate)
    ranked = candidate.gather(-1, order)  # each row's candidates come first, best first
    may_keep, may_full = _limits(was_key_only, use_tiers, confidence, thresholds, judged)
    may_keep, may_full = may_keep.gather(-1, order) & ranked, may_full.gather(-1, order) & ranked

    if use_tiers:
        # Each row's candidates' scores in descending order (ranked by score, they are in it already).
        ranked_scores = scores.float().clamp_min(0.0)
        if confidence is None:
            ranked_scores = ranked_scores.gather(-1, order)
        else:
            ranked_scores = torch.sort(ranked_scores.masked_fill(~candidate, -1.0), dim=-1, descending=True).values
        kept, full = _spend(remaining, ranked_scores, may_keep, may_full, full_bytes, key_only_bytes, value_errors)
    else:  # eviction only: a kept entry stays at its tier
        spent = torch.cumsum(torch.where(may_keep, cost_now.gather(-1, order), 0).float(), -1)
        kept = may_keep & (spent <= remaining.float().view(-1, 1))
        full = kept & ~was_key_only.gather(-1, order)
    key_only = kept & ~full

    def taken(first: torch.Tensor, then: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per row: its indices where `first`, then its ranked entries where `then`."""
        mask = torch.cat((first, then), -1)
        return torch.cat((index, order), -1)[mask].split(mask.sum(-1).tolist())

    dropped = ranked & ~kept
    return [
        TierPlan(*tiers)
        for tiers in zip(
            taken(protected & ~was_key_only, full),
            taken(protected & was_key_only, key_only),
            order[dropped].split(dropped.sum(-1).tolist()),
            strict=True,
        )
    ]


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
    """Bytes the thresholds alone would keep of one layer (`layers_threshold_bytes` for a single layer)."""
    held = layers_threshold_bytes(
        protected.unsqueeze(0),
        torch.tensor([num_key_only]),
        full_bytes,
        key_only_bytes,
        use_tiers,
        confidence.unsqueeze(0),
        None if judged is None else judged.unsqueeze(0),
        thresholds=thresholds,
    )
    return int(held[0])


def layers_threshold_bytes(
    protected: torch.Tensor,
    num_key_only: torch.Tensor,
    full_bytes: int,
    key_only_bytes: int,
    use_tiers: bool,
    confidence: torch.Tensor,
    judged: torch.Tensor | None = None,
    held: torch.Tensor | None = None,
    thresholds: Thresholds | None = None,
) -> torch.Tensor:
    """Bytes [layers] the thresholds alone would keep of each layer, a row [layers, n] each (`held` as
    in `plan_layers`): what `plan_layers` keeps under an unlimited budget, counted without ranking."""
    layers, n = protected.shape
    held = torch.ones_like(protected) if held is None else held
    protected = protected & held
    was_key_only = torch.arange(n, device=protected.device).expand(layers, n) < num_key_only.view(-1, 1)
    may_keep, may_full = _limits(was_key_only, use_tiers, confidence, thresholds, judged)
    candidate = held & ~protected
    kept, full = (may_keep & candidate).sum(-1), (may_full & candidate).sum(-1)
    protected_key_only = (was_key_only & protected).sum(-1)
    protected_full = protected.sum(-1) - protected_key_only
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


def _ranked(order: torch.Tensor, key: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """`order` [layers, n] re-sorted by `key` descending, ties as they stood, each row's candidates first."""
    order = order.gather(-1, torch.argsort(key.gather(-1, order), dim=-1, descending=True, stable=True))
    # Candidates first, each side in the order it stood: where each goes, counted, not sorted.
    first = candidate.gather(-1, order)
    ahead = torch.cumsum(first, -1) - 1
    behind = first.sum(-1, keepdim=True) + torch.cumsum(~first, -1) - 1
    return torch.empty_like(order).scatter_(-1, torch.where(first, ahead, behind), order)


def _spend(
    budget: torch.Tensor,
    scores: torch.Tensor,
    may_keep: torch.Tensor,
    may_full: torch.Tensor,
    full_bytes: int,
    key_only_bytes: int,
    value_errors: tuple[float, float],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the ranked entries [layers, n] are kept, and which of them FULL, under each row's
    `budget` [layers] (float64): the budget buys steps, most worth per byte first. An entry moves the
    output by its attention times its error: all of it when dropped, the relative error of its value
    as stored when kept. Independent errors add as variances, so keeping an entry (as KEY_ONLY) is
    worth a^2 x (1 - KEY_ONLY error^2), raising a kept one to FULL a^2 x (KEY_ONLY error^2 - FULL
    error^2). Its future attention a is a forecast: its square is expected as the score's square plus
    the mean square over the entries, as no forecast tells faint entries apart. So an entry is raised
    at the cost of faint ones only when its score stands far above the layer's typical one (a fact
    being copied); spread attention keeps the count. An entry's score is that of its rank (`scores`,
    sorted): the ranking says which are kept, the scores how many are raised. With no error given,
    every entry the budget holds is kept before any is raised. Entries that may not be kept (past a
    row's candidates too) are never bought."""
    layers, n = may_keep.shape
    raise_cost = full_bytes - key_only_bytes
    if raise_cost <= 0:  # values stored as keys are: raising is free
        kept = may_keep & (torch.cumsum(may_keep.long(), -1) <= _fits(budget, key_only_bytes, n))
        return kept, kept & may_full
    full_error, key_only_error = value_errors
    variance = scores.square()
    # Row by row: a mean over a padded row would add in another order, and round differently.
    mean = torch.stack([v[k].mean() if k.any() else v.new_zeros(()) for v, k in zip(variance, may_keep, strict=True)])
    variance = variance + mean.view(-1, 1)
    keep_gain = variance * (1.0 - key_only_error**2) / key_only_bytes
    raise_gain = torch.minimum(variance * max(key_only_error**2 - full_error**2, 0.0) / raise_cost, keep_gain)
    never = torch.tensor(float("-inf"), device=variance.device)
    gain = torch.cat((torch.where(may_keep, keep_gain, never), torch.where(may_keep & may_full, raise_gain, never)), -1)
    cost = torch.cat((torch.full((n,), float(key_only_bytes)), torch.full((n,), float(raise_cost)))).to(gain.device)
    steps = torch.argsort(gain, dim=-1, descending=True, stable=True)  # a raise never comes before its own keep
    affordable = torch.cumsum(cost[steps], -1) <= budget.float().view(-1, 1)
    bought = torch.zeros_like(gain, dtype=torch.bool).scatter_(-1, steps, affordable & (gain.gather(-1, steps) > never))
    return bought[:, :n], bought[:, n:]


def _fits(budget: torch.Tensor, cost: int, most: int) -> torch.Tensor:
    """How many entries of `cost` bytes each row's `budget` [layers] holds, [layers, 1] (an unlimited
    budget holds all `most`)."""
    return torch.where(budget.isinf(), most, torch.div(budget, cost, rounding_mode="floor")).view(-1, 1)
