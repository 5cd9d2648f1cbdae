"""The locust mix, headless and bounded, against the live server: no request may fail."""

from __future__ import annotations

import csv

import pytest

from load_tests import run

pytestmark = pytest.mark.slow


def test_locust_mix_runs_without_a_failed_request(server, tmp_path):
    out = tmp_path / "load"
    args = ["--host", server.url, "--users", "12", "--spawn-rate", "4", "--duration", "40s", "--out", str(out)]
    code = run.main(args)
    rows = list(csv.DictReader((tmp_path / "load_stats.csv").read_text().splitlines()))
    total = next(row for row in rows if row["Name"] == "Aggregated")
    failures = (tmp_path / "load_failures.csv").read_text()
    assert int(total["Failure Count"]) == 0, failures
    assert code == 0
    assert int(total["Request Count"]) >= 20
    names = {row["Name"] for row in rows}
    # Which tasks a short run happens to pick is chance; the mix must at least reach several kinds.
    kinds = {"generate short", "generate stream", "openai chat turn 2", "generate invalid (422 expected)"}
    kinds |= {name for name in names if name.startswith("generate long")}
    assert len(kinds & names) >= 3, names
