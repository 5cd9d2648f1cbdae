"""The retention confidence: a calibrated probability of being needed, fitted on traces and shipped."""

from __future__ import annotations

import pytest
import torch

from confkv.compress.predictor.calibration import (
    Calibration,
    calibration_path,
    fit,
    load_calibrations,
    needed,
    reliability,
    save_calibrations,
)
from confkv.compress.predictor.model import model_fingerprint
from confkv.compress.predictor.online import load_retention, predictor_path
from confkv.compress.scoring import LayerEntries, make_policy


def synthetic(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Relative values and outcomes drawn with P(needed) = 1 - exp(-value)."""
    generator = torch.Generator().manual_seed(seed)
    relative = torch.distributions.Exponential(1.0).sample((n,)) * 2
    truth = 1 - torch.exp(-relative)
    return relative, torch.rand(n, generator=generator) < truth


def test_a_fitted_table_is_monotone_and_calibrated_on_fresh_samples():
    relative, outcome = synthetic(20_000, 0)
    calibration = fit(relative, outcome, "attention", 0.5, 128)
    assert all(a <= b for a, b in zip(calibration.probabilities, calibration.probabilities[1:], strict=False))
    fresh, fresh_outcome = synthetic(20_000, 1)
    _, error = reliability(calibration(fresh), fresh_outcome)
    assert error < 0.03
    # Against the truth it was drawn from, not only against itself.
    assert torch.allclose(calibration(torch.tensor([0.5, 2.0])), 1 - torch.exp(-torch.tensor([0.5, 2.0])), atol=0.05)


def test_the_table_reads_as_sklearn_predicts():
    from sklearn.isotonic import IsotonicRegression

    relative, outcome = synthetic(2_000, 2)
    calibration = fit(relative, outcome, "forecast", 0.5, 128)
    regression = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(relative.numpy(), outcome.numpy())
    probe = torch.linspace(-1.0, 20.0, 500)
    expected = torch.tensor(regression.predict(probe.double().numpy()), dtype=torch.float32)
    assert torch.allclose(calibration(probe), expected, atol=1e-5)


def test_reliability_bins_and_error_by_hand():
    probability = torch.tensor([0.05, 0.05, 0.95, 0.95])
    rows, error = reliability(probability, torch.tensor([False, True, True, True]))
    assert [(r.entries, round(r.observed, 3)) for r in rows] == [(2, 0.5), (2, 1.0)]
    assert error == pytest.approx((2 * 0.45 + 2 * 0.05) / 4)


def test_needed_means_a_share_of_an_average_entry():
    # 128 steps over 64 held entries: an average entry draws 2.0; needed at share 0.5 means >= 1.0.
    mass = torch.tensor([0.99, 1.0, 3.0])
    assert needed(mass, torch.full((3,), 64.0), 128, 0.5).tolist() == [False, True, True]


def test_saved_tables_load_for_their_model_only(tmp_path, default_model):
    table = Calibration("attention", 0.5, 128, (0.0, 1.0), (0.1, 0.9))
    path = calibration_path(tmp_path / "p.safetensors")
    save_calibrations([table], path, model_fingerprint(default_model.config))
    assert load_calibrations(path, model_fingerprint(default_model.config)) == {"attention": table}
    assert load_calibrations(path, "another model") == {}
    assert load_calibrations(tmp_path / "missing.json", model_fingerprint(default_model.config)) == {}


def entries(attention: list[float], calibration: Calibration | None, confidence: float = 1.0) -> LayerEntries:
    n = len(attention)
    return LayerEntries(
        keys=None,
        positions=torch.arange(n),
        attention=torch.tensor(attention),
        token_confidence=torch.full((n,), confidence),
        position=n - 1,
        layer=0,
        calibration=calibration,
    )


def test_dynamic_turns_its_score_into_the_calibrated_probability():
    policy = make_policy("dynamic", {"kernel_size": 1, "retention_kernel": 1, "thresholds_decide": True})
    table = Calibration("attention", 0.5, 128, (0.0, 1.0, 4.0), (0.0, 0.5, 1.0))
    layer = entries([0.0, 1.0, 2.0, 5.0], table)  # mean 2: relative 0, 0.5, 1, 2.5
    retention = policy.retention(layer)
    assert torch.allclose(retention, torch.tensor([0.0, 0.25, 0.5, 0.75]))
    # Doubt raises the score, hence the confidence; no table or nothing observed: the rate decides.
    doubtful = entries([0.0, 1.0, 2.0, 5.0], table, confidence=0.2)
    assert (policy.retention(doubtful)[1:] > retention[1:]).all()
    assert policy.retention(entries([1.0, 2.0], None)) is None
    assert policy.retention(entries([0.0, 0.0], table)) is None
    # As shipped its thresholds decide; turned off, it gives no confidence and the rate decides.
    assert torch.equal(make_policy("dynamic", {"retention_kernel": 1}).retention(layer), retention)
    assert make_policy("dynamic", {"thresholds_decide": False}).retention(layer) is None


def test_the_thresholds_judge_an_entry_with_its_neighbours_whatever_pooling_ranks_it():
    # A lone peak (position 5) among quiet tokens: averaging over 5 would lower its confidence, but the
    # confidence the thresholds size the request by is the same for every ranking pooling, and an
    # entry beside the peak is judged as likely needed as the peak itself.
    table = Calibration("attention", 0.5, 128, (0.0, 1.0, 4.0), (0.0, 0.5, 1.0))
    value = [0.1] * 12
    value[5] = 4.0
    layer = entries(value, table)
    poolings = ({}, {"pooling": "avg", "kernel_size": 5})
    judged = [make_policy("dynamic", options).retention(layer) for options in poolings]
    assert torch.equal(judged[0], judged[1])
    assert judged[0][4] == judged[0][5] == judged[0][6] > judged[0][3]


def test_a_forecast_is_measured_against_the_windows_average_share():
    table = Calibration("forecast", 0.5, 128, (0.0, 2.0), (0.0, 1.0))
    assert table.average(torch.ones(64)) == 2.0  # 128 steps of attention over 64 entries


def test_the_default_model_ships_a_calibration_for_both_sources(default_model):
    calibrations = load_retention(predictor_path(None), default_model.config)
    assert set(calibrations) == {"forecast", "attention"}
    for table in calibrations.values():
        p = torch.tensor(table.probabilities)
        assert (p[1:] >= p[:-1]).all() and p[0] < 0.5 < p[-1]


def test_dynamics_thresholds_decide_its_memory_on_the_default_model(default_model, tokenizer):
    """With the shipped predictor and calibration, as shipped its thresholds decide: stricter thresholds
    hold fewer bytes, all under the ceiling; turned off, the rate alone decides."""
    from confkv.compress.config import CompressionConfig, resolve
    from confkv.compress.predictor.online import load_future_value
    from confkv.engine.llm_engine import EngineConfig, LLMEngine, run_to_completion
    from confkv.models.corpus import paragraphs
    from tests.helpers import greedy

    config = CompressionConfig.load()
    future_value = load_future_value(predictor_path(None), default_model.config, torch.device("cpu"), 4)
    prompt = tokenizer(" ".join(paragraphs()[:8])).input_ids[:400]

    def held(high: float | None = None, medium: float | None = None) -> dict:
        engine = LLMEngine(default_model, tokenizer, EngineConfig(max_cache_bytes=2**30), config, future_value)
        request = {"compression_rate": 0.6, "thresholds": {"high": high or 0.0, "medium": medium or 0.0}}
        if high is None:
            request["policy_options"] = {"dynamic": {"thresholds_decide": False}}
        engine.add_request("r", prompt, greedy(4, ignore_eos=True), resolve(config, request, True, True))
        return run_to_completion(engine)["r"][-1].compression_metrics

    strict, seed, lenient, rate_only = held(0.99, 0.95), held(0.9, 0.7), held(0.8, 0.5), held()
    sizes = [m["compressed_size"] for m in (strict, seed, lenient, rate_only)]
    assert sizes == sorted(sizes) and len(set(sizes)) == 4
    assert all(m["compressed_size"] <= m["ceiling_size"] for m in (strict, seed, lenient, rate_only))
    assert seed["entries"]["dropped"] + seed["entries"]["key_only"] > 0  # the request's bytes, tiered as a rate does
    assert rate_only["entries"]["dropped"] == rate_only["entries"]["key_only"] == 0  # int8 holds all under 0.6
