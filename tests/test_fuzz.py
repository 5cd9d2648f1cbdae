"""Schemathesis against the live server's own OpenAPI schema: no 5xx, no response off the schema."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import LiveServer

pytestmark = pytest.mark.slow


def test_fuzzed_requests_get_no_server_error_and_match_the_schema(default_path, tmp_path):
    srv = LiveServer(
        "--model-path",
        str(default_path),
        "--max-cache-size",
        "64",
        "--default-max-tokens",
        "2",
        "--request-timeout",  # fuzzed max_tokens may be large: bound every request's time
        "5",
    )
    try:
        cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
        result = subprocess.run(
            [
                cli,
                "run",
                f"{srv.url}/openapi.json",
                "--checks",
                "not_a_server_error,response_schema_conformance",
                "--max-examples",
                "12",
                "--seed",
                "1",
                "--generation-database",
                "none",
                "--request-timeout",
                "60",
                "--exclude-path-regex",
                "^/metrics$",  # Prometheus text, not JSON
            ],
            capture_output=True,
            text=True,
            timeout=900,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
        assert "passed" in result.stdout.lower()
    finally:
        srv.stop()
