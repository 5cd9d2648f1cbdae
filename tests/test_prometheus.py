"""Alert rules under promtool, and a real Prometheus scraping the live server."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers import ROOT, free_port

PROMETHEUS_DIR = ROOT / "prometheus"


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=120)


def test_config_and_rules_pass_promtool_check():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "7 rules found" in result.stdout


def test_every_alert_rule_fires_and_stays_quiet_as_unit_tested():
    result = promtool("test", "rules", "alert_rules_test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    tested = {
        t["alertname"]
        for case in yaml.safe_load((PROMETHEUS_DIR / "alert_rules_test.yaml").read_text())["tests"]
        for t in case["alert_rule_test"]
    }
    rules = yaml.safe_load((PROMETHEUS_DIR / "alert_rules.yaml").read_text())["groups"]
    assert tested == {rule["alert"] for group in rules for rule in group["rules"]}


def test_seed_high_memory_rule_is_kept_as_written():
    rule = yaml.safe_load((PROMETHEUS_DIR / "alert_rules.yaml").read_text())["groups"][0]["rules"][0]
    assert rule == {
        "alert": "HighMemoryUsage",
        "expr": "kv_cache_memory_bytes / 1024^3 > 30",
        "for": "5m",
        "labels": {"severity": "critical"},
        "annotations": {
            "summary": "KV缓存内存占用超过阈值",
            "description": "当前占用 {{ $value }}GB，可能影响服务稳定性",
        },
    }


class Prometheus:
    """The Prometheus binary on loopback, with the repo's config aimed at one server and sped up."""

    def __init__(self, target: str, workdir: Path) -> None:
        config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
        config["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(workdir / "prometheus.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={path}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address={self.url.removeprefix('http://')}",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.wait_for(lambda: httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200, "ready", 60)

    def query(self, expr: str) -> list[dict]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_for(self, check, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(
            f"Prometheus: {what} not seen in {timeout}s; log:\n{Path(self.log.name).read_text()[-3000:]}"
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


@pytest.mark.slow
def test_real_prometheus_scrapes_the_server_and_evaluates_the_rules(server, tmp_path):
    prometheus = Prometheus(server.url.removeprefix("http://"), tmp_path)
    try:
        prometheus.wait_for(lambda: prometheus.query('up{job="conf-kv"} == 1'), "the server up")
        prometheus.wait_for(lambda: prometheus.query("kv_oom_errors_total"), "a first sample of kv_oom_errors_total")
        # A request long enough to be scraped while its KV cache is held.
        body = {"prompt": "Count from 1 to 100: 1, 2, 3,", "max_tokens": 64, "temperature": 0}
        assert httpx.post(f"{server.url}/generate", json=body, timeout=120).status_code == 200
        prometheus.wait_for(
            lambda: float(prometheus.query("max_over_time(kv_cache_memory_bytes[5m])")[0]["value"][1]) > 0,
            "KV memory held during the request",
        )
        running = 'kv_cache_bytes{pool="running"}'
        prometheus.wait_for(lambda: float(prometheus.query(running)[0]["value"][1]) == 0, "memory back")
        # Four requests that can never fit the KV budget: more than 3 OOM errors in the hour.
        too_big = {"prompt": "word " * 5000, "max_tokens": 2000, "compression": {"enabled": False}}
        for _ in range(4):
            assert httpx.post(f"{server.url}/generate", json=too_big, timeout=60).status_code == 413

        def firing() -> list[str]:
            alerts = httpx.get(f"{prometheus.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]
            return [a["labels"]["alertname"] for a in alerts if a["state"] == "firing"]

        prometheus.wait_for(lambda: "FrequentOOMErrors" in firing(), "FrequentOOMErrors firing")
        assert "HighMemoryUsage" not in firing()
        rules = httpx.get(f"{prometheus.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
        health = {rule["name"]: rule["health"] for group in rules for rule in group["rules"]}
        assert len(health) == 7 and set(health.values()) == {"ok"}, health
    finally:
        prometheus.stop()
