"""The locust mix, headless and bounded, against the live server watched by a real Prometheus and
Alertmanager: no request may fail, and nothing but a true latency page may reach the pager."""

from __future__ import annotations

import csv
import json

import pytest

from load_tests import run

pytestmark = pytest.mark.slow


def test_locust_mix_runs_without_a_failed_request_or_a_false_page(server, tmp_path):
    out, alerts = tmp_path / "load", tmp_path / "alerts"
    args = ["--host", server.url, "--users", "12", "--spawn-rate", "4", "--duration", "40s", "--out", str(out)]
    run.main([*args, "--watch-alerts", "--alerts-out", str(alerts)])
    rows = list(csv.DictReader((tmp_path / "load_stats.csv").read_text().splitlines()))
    total = next(row for row in rows if row["Name"] == "Aggregated")
    failures = (tmp_path / "load_failures.csv").read_text()
    assert int(total["Failure Count"]) == 0, failures
    assert int(total["Request Count"]) >= 20
    names = {row["Name"] for row in rows}
    # Which tasks a short run happens to pick is chance; the mix must at least reach several kinds.
    kinds = {"generate short", "generate stream", "openai chat turn 2", "generate invalid (422 expected)"}
    kinds |= {name for name in names if name.startswith("generate long")}
    assert len(kinds & names) >= 3, names
    # On a machine this small, 12 users breach the default latency SLOs: a true page. Nothing else may
    # page (KV budget, preemptions, errors, the loop, the scrapes), and the seed's alerts that fire
    # under any load (mean latency, prefix hits) go to the log.
    seen = json.loads(alerts.with_suffix(".json").read_text())
    latency = {"TimePerOutputTokenSLOBreach", "TimeToFirstTokenSLOBreach"}
    assert set(seen["paged"]) <= latency, seen["notifications"]
    faults = {"KVRunningNearBudget", "FrequentPreemptions", "HighServerErrorRate", "EngineLoopStalled", "ConfKVDown"}
    assert not faults & set(seen["fired"]), seen["fired"]
    assert "HighMeanRequestLatency" not in seen["paged"]
