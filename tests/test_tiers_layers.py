"""A compression judges all its layers at once, each a padded row: every row comes out exactly as
that layer would alone (scores, confidences, spans and tier plans), whatever the other rows hold."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from confkv.compress.config import Thresholds
from confkv.compress.predictor.calibration import Calibration
from confkv.compress.scoring import LayerEntries, make_policy
from confkv.compress.spans import pool_over_spans
from confkv.compress.tiers import layers_threshold_bytes, plan_layers, plan_tiers, threshold_bytes

FULL, KEY_ONLY = 396, 306  # int8 entries, FULL and with 4-bit values, on the embedded model
ERRORS = (0.005, 0.09)


def padded(rows: list[torch.Tensor], fill: float | int | bool) -> torch.Tensor:
    """Rows of several lengths as one tensor, `fill` past each: what a padded row holds is never read."""
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), fill, dtype=rows[0].dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def layers_of(seed: int, count: int, ties: bool) -> list[dict]:
    """Random layers: lengths, KEY_ONLY counts, scores (many ties where asked), protected entries."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(count):
        n = int(torch.randint(1, 60, (), generator=gen))
        scores = torch.rand(n, generator=gen) ** 3
        if ties:
            scores = (scores * 4).round() / 4
        layers.append(
            {
                "scores": scores,
                "protected": torch.rand(n, generator=gen) < 0.2,
                "num_key_only": int(torch.randint(0, n + 1, (), generator=gen)),
                "confidence": torch.rand(n, generator=gen).round(decimals=1),
                "judged": torch.rand(n, generator=gen) < 0.5,
                "budget": float(torch.rand((), generator=gen)) * n * FULL,
                "positions": torch.randperm(3 * n, generator=gen)[:n],
            }
        )
    return layers


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), count=st.integers(1, 6), ties=st.booleans(), use_tiers=st.booleans())
def test_a_layer_planned_among_others_is_planned_as_alone(seed, count, ties, use_tiers):
    layers = layers_of(seed, count, ties)
    held = padded([torch.ones(len(layer["scores"]), dtype=torch.bool) for layer in layers], False)
    scores = padded([layer["scores"] for layer in layers], 7.0)  # padding scored above every entry
    protected = padded([layer["protected"] for layer in layers], True)
    num_key_only = torch.tensor([layer["num_key_only"] for layer in layers])
    budgets = [layer["budget"] for layer in layers]
    for errors in (ERRORS, (0.0, 0.0)):
        together = plan_layers(
            scores, protected, num_key_only, budgets, FULL, KEY_ONLY, use_tiers, held=held, value_errors=errors
        )
        for layer, plan in zip(layers, together, strict=True):
            alone = plan_tiers(
                layer["scores"],
                layer["protected"],
                layer["num_key_only"],
                layer["budget"],
                FULL,
                KEY_ONLY,
                use_tiers,
                value_errors=errors,
            )
            for field in ("keep_full", "keep_key_only", "dropped"):
                assert torch.equal(getattr(plan, field), getattr(alone, field)), field


def test_no_layers_no_plans():
    nothing = torch.zeros(0, 5)
    assert plan_layers(nothing, nothing.bool(), torch.zeros(0), [], FULL, KEY_ONLY, True, value_errors=ERRORS) == []


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), count=st.integers(1, 6), use_tiers=st.booleans())
def test_the_thresholds_count_each_layer_among_others_as_alone(seed, count, use_tiers):
    layers = layers_of(seed, count, ties=True)
    thresholds = Thresholds(high=0.8, medium=0.5, low=0.3)
    rows = {
        name: padded([layer[name] for layer in layers], fill)
        for name, fill in (("protected", True), ("confidence", 1.0), ("judged", True))
    }
    held = padded([torch.ones(len(layer["scores"]), dtype=torch.bool) for layer in layers], False)
    num_key_only = torch.tensor([layer["num_key_only"] for layer in layers])
    together = layers_threshold_bytes(
        rows["protected"], num_key_only, FULL, KEY_ONLY, use_tiers, rows["confidence"], rows["judged"], held, thresholds
    )
    alone = [
        threshold_bytes(
            layer["protected"],
            layer["num_key_only"],
            FULL,
            KEY_ONLY,
            use_tiers,
            layer["confidence"],
            thresholds,
            layer["judged"],
        )
        for layer in layers
    ]
    assert together.tolist() == alone


@pytest.mark.parametrize("source", ["forecast", "attention"])
@pytest.mark.parametrize("policy", ["dynamic", "snapkv", "h2o"])
def test_a_layer_scored_among_others_is_scored_as_alone(policy, source):
    layers = layers_of(3, 5, ties=False)
    layers[1] = {**layers[1], "scores": layers[1]["scores"][:3], "positions": layers[1]["positions"][:3]}  # < kernel
    calibration = Calibration(source, 0.02, 128, (0.0, 0.5, 1.0, 4.0), (0.0, 0.3, 0.6, 1.0))
    confidence = torch.rand(200, generator=torch.Generator().manual_seed(1))
    values = [layer["scores"] for layer in layers]
    positions = [layer["positions"] for layer in layers]
    held = padded([torch.ones(len(v), dtype=torch.bool) for v in values], False)
    position = padded(positions, 0)
    entries = LayerEntries(
        None,
        position,
        padded(values, 5.0),
        confidence[position],
        199,
        torch.arange(len(layers)),
        predicted=padded(values, 5.0),
        calibration=calibration,
        held=held,
    )
    scorer = make_policy(policy)
    scores, retention = scorer.score(entries), scorer.retention(entries)
    spans = padded([p // 3 for p in positions], 0)
    pooled = pool_over_spans(scores, spans, held)
    for i, (value, at) in enumerate(zip(values, positions, strict=True)):
        n = len(value)
        alone = LayerEntries(None, at, value, confidence[at], 199, i, predicted=value, calibration=calibration)
        assert torch.equal(scores[i, :n], scorer.score(alone))
        assert torch.equal(pooled[i, :n], pool_over_spans(scorer.score(alone), at // 3))
        if retention is not None:
            assert torch.equal(retention[i, :n], scorer.retention(alone))
    assert (retention is None) == (policy != "dynamic")
