"""Alert rules under promtool, and a real Prometheus scraping the live server."""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
import yaml

from confkv.server.api import create_app
from confkv.server.settings import Settings
from load_tests.monitoring import PROMETHEUS_DIR, Alertmanager, Prometheus, WebhookLog, fast_rules
from tests.helpers import ROOT, LiveServer, free_port

RULE_COUNT = 21  # alerts and recording rules


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=120)


def test_config_and_rules_pass_promtool_check():
    result = promtool("check", "config", "prometheus.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{RULE_COUNT} rules found" in result.stdout


def test_every_alert_rule_fires_and_stays_quiet_as_unit_tested():
    result = promtool("test", "rules", "alert_rules_test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    cases = yaml.safe_load((PROMETHEUS_DIR / "alert_rules_test.yaml").read_text())["tests"]
    tested = {t["alertname"] for case in cases for t in case["alert_rule_test"]}
    assert tested == {rule["alert"] for rule in alert_rules()}


def alert_rules() -> list[dict]:
    groups = yaml.safe_load((PROMETHEUS_DIR / "alert_rules.yaml").read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


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
            "runbook_url": "docs/operations.md#highmemoryusage",  # the one addition
        },
    }


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lstrip("#").strip().lower())
    return text.replace(" ", "-")


def test_every_alert_links_a_runbook_that_says_what_to_check_and_change():
    operations = (ROOT / "docs" / "operations.md").read_text()
    sections = {}
    for section in re.split(r"\n(?=#{2,4} )", operations):
        heading, _, body = section.partition("\n")
        sections[github_anchor(heading)] = body
    for rule in alert_rules():
        url = rule["annotations"]["runbook_url"]
        assert url == f"docs/operations.md#{rule['alert'].lower()}", rule["alert"]
        body = sections.get(url.split("#")[1])
        assert body is not None, f"{rule['alert']}: docs/operations.md has no section {url}"
        for part in ("**Means**", "**Check first**", "**Change**"):
            assert part in body, f"{rule['alert']}: its runbook lacks {part}"


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["amtool", *args], cwd=PROMETHEUS_DIR, capture_output=True, text=True, timeout=60)


def test_alertmanager_config_passes_amtool_and_pages_only_on_what_matters():
    result = amtool("check-config", "alertmanager.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 inhibit rules" in result.stdout and "3 receivers" in result.stdout
    routed = {}
    for rule in alert_rules():
        labels = [f"{k}={v}" for k, v in {"alertname": rule["alert"], **rule["labels"]}.items()]
        result = amtool("config", "routes", "test", "--config.file=alertmanager.yml", *labels)
        assert result.returncode == 0, result.stdout + result.stderr
        routed[rule["alert"]] = result.stdout.strip()
    pages = {
        "TimePerOutputTokenSLOBreach",
        "TimeToFirstTokenSLOBreach",
        "KVRunningNearBudget",
        "FrequentPreemptions",
        "HighServerErrorRate",
        "EngineLoopStalled",
        "EngineLoopRestarted",
        "ConfKVDown",
        "FrequentOOMErrors",
    }
    assert {name for name, receiver in routed.items() if receiver == "pager"} == pages
    assert routed["HighMemoryUsage"] == "log"  # critical as the seed wrote it, but never a page
    assert routed["HighMeanRequestLatency"] == routed["LowPrefixCacheHitRate"] == "log"
    assert routed["LatencySLOMet"] == "discard"
    config = yaml.safe_load((PROMETHEUS_DIR / "alertmanager.yml").read_text())
    assert config["route"]["group_by"] == ["instance"]
    inhibit = config["inhibit_rules"][0]
    assert inhibit["source_matchers"] == ['alertname="LatencySLOMet"'] and inhibit["equal"] == ["instance"]


@pytest.mark.slow
def test_real_prometheus_scrapes_the_server_and_evaluates_the_rules(server, tmp_path):
    prometheus = Prometheus([server.url.removeprefix("http://")], tmp_path)
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
        assert len(health) == RULE_COUNT and set(health.values()) == {"ok"}, health
    finally:
        prometheus.stop()


class Load:
    """Client threads sending `body(thread, n)` to /generate until stopped, keeping the status codes."""

    def __init__(self, url: str, threads: int, body: Callable[[int, int], dict]) -> None:
        self.url, self.body = url, body
        self.stopping = threading.Event()
        self.statuses: list[int] = []
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self, i: int) -> None:
        n = 0
        with httpx.Client(timeout=120) as client:
            while not self.stopping.is_set():
                try:
                    self.statuses.append(client.post(f"{self.url}/generate", json=self.body(i, n)).status_code)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    return
                n += 1

    def stop(self) -> None:
        """No new requests; wait for those under way, so that the next load runs alone."""
        self.stopping.set()
        for thread in self.threads:
            thread.join(120)


@pytest.mark.slow
def test_overload_pages_with_runbooks_a_full_prefix_pool_does_not_and_the_seed_latency_alert_is_inhibited(
    default_path, tmp_path
):
    """Two servers, one Prometheus (the repo's rules, `for` cut to 2 s), one Alertmanager (the repo's routes).

    `overloaded`: 8 MiB of KV (11 blocks of 16 uncompressed tokens) for two requests of 5 blocks and one
    of 2, a TPOT SLO of 10 ms that no token meets, and one request in 5 minutes enough to page.
    `healthy`, loaded after it: many short distinct chats that fill its 6 MiB prefix pool, SLOs of 60 s and 5 s.
    """
    # One torch thread each: torch's threads spin, and two servers must not oversubscribe a small machine.
    common = ["--model-path", str(default_path), "--shutdown-grace-period", "0"]
    with ThreadPoolExecutor(2) as starting:
        overloaded_args = ["--max-cache-size", "8", "--slo-tpot-seconds", "0.01", "--slo-min-requests", "1"]
        overloaded_start = starting.submit(LiveServer, *common, *overloaded_args, torch_threads=1)
        # Its SLOs are ones any machine meets, however loaded: that they hold must not depend on its speed.
        healthy_slo = ["--slo-ttft-seconds", "60", "--slo-tpot-seconds", "5"]
        healthy_start = starting.submit(LiveServer, *common, "--max-cache-size", "6", *healthy_slo, torch_threads=1)
        overloaded, healthy = overloaded_start.result(), healthy_start.result()
    a, b = overloaded.url.removeprefix("http://"), healthy.url.removeprefix("http://")
    webhook = WebhookLog(tmp_path)
    alertmanager = Alertmanager(tmp_path, webhook.url)
    prometheus = Prometheus([a, b], tmp_path, fast_rules(tmp_path), alertmanager.url.removeprefix("http://"))

    def story(i: int, n: int) -> dict:
        # The long ones hold most of the budget; the short one reports a TPOT early.
        prompt = f"Story {i}-{n}: once upon a time there was a"
        tokens = 16 if i == 0 else 64
        return {"prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "compression": {"enabled": False}}

    def chat(i: int, n: int) -> dict:
        question = f"Question {i}-{n}: name a colour and a number."
        return {"messages": [{"role": "user", "content": question}], "max_tokens": 48, "ignore_eos": True}

    def received(name: str, instance: str) -> dict | None:
        wanted = {"alertname": name, "instance": instance}
        return next((x for x in alertmanager.alerts() if x["labels"] | wanted == x["labels"]), None)

    loads: list[Load] = []
    try:
        loads.append(Load(overloaded.url, 3, story))
        prometheus.wait_for(lambda: received("TimePerOutputTokenSLOBreach", a), "the TPOT SLO page", 60)
        prometheus.wait_for(lambda: received("KVRunningNearBudget", a), "the running-KV page", 60)
        prometheus.wait_for(lambda: received("HighMeanRequestLatency", a), "the seed's latency alert, overloaded")
        loads[0].stop()
        assert not loads[0].errors and loads[0].statuses and set(loads[0].statuses) == {200}

        loads.append(Load(healthy.url, 2, chat))

        def seed() -> dict | None:
            return received("HighMeanRequestLatency", b)

        prometheus.wait_for(lambda: seed() and seed()["status"]["inhibitedBy"], "the seed's alert inhibited", 60)
        prefix = f'max_over_time(kv_cache_bytes{{pool="prefix", instance="{b}"}}[5m])'
        share = f"{prefix} / on (instance) kv_cache_capacity_bytes"
        prometheus.wait_for(lambda: float(prometheus.query(share)[0]["value"][1]) > 0.5, "the prefix pool full", 60)
        loads[1].stop()
        assert not loads[1].errors and loads[1].statuses and set(loads[1].statuses) == {200}

        # On the full prefix pool: no page ever went pending, and the seed's latency alert is muted
        # by LatencySLOMet; on the overloaded server the SLO is not met and the seed's alert goes out.
        pages = "TimePerOutputTokenSLOBreach|TimeToFirstTokenSLOBreach|KVRunningNearBudget|FrequentPreemptions"
        assert prometheus.query(f'ALERTS{{alertname=~"{pages}", instance="{b}"}}[10m]') == []
        assert seed()["status"]["state"] == "suppressed"
        assert seed()["status"]["inhibitedBy"] == [received("LatencySLOMet", b)["fingerprint"]]
        assert received("LatencySLOMet", a) is None
        assert received("HighMeanRequestLatency", a)["status"] == {
            "state": "active",
            "silencedBy": [],
            "inhibitedBy": [],
        }
        # The pages reached the pager receiver, each with its runbook, and none for the healthy server.
        webhook.wait_for(lambda: "pager firing KVRunningNearBudget" in webhook.log_text(), "the page notified")
        pager = [line for line in webhook.log_text().splitlines() if " pager firing " in line]
        assert any(f"TimePerOutputTokenSLOBreach instance={a} severity=critical" in line for line in pager), pager
        assert all(f"instance={a}" in line and "runbook docs/operations.md#" in line for line in pager), pager
        assert f"HighMeanRequestLatency instance={b}" not in webhook.log_text()
        # A server that stops answering its scrapes pages ConfKVDown.
        healthy.stop()
        down = f"pager firing ConfKVDown instance={b}"
        webhook.wait_for(lambda: down in webhook.log_text(), "the server-down page", 60)
    finally:
        for load in loads:
            load.stop()
        for process in (prometheus, alertmanager, webhook, overloaded, healthy):
            process.stop()


class InProcessServer:
    """The app on a real port, served from this process so that a test can break its engine loop."""

    def __init__(self, settings: Settings) -> None:
        self.app = create_app(settings)
        port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the in-process server did not start"
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.mark.slow
def test_a_dead_engine_loop_pages_its_errors_and_its_stall_with_runbooks(tiny_model_dir, tmp_path):
    """A loop that crashes under a live server: the lost and refused requests page HighServerErrorRate,
    and the heartbeat, still scraped, pages EngineLoopStalled 30 s later (`for` cut to 2 s)."""
    # No restarts: the loop dies at its first crash (a restart is `EngineLoopRestarted`'s, tested by promtool).
    settings = Settings(model_path=tiny_model_dir, max_cache_size="64", torch_threads=1, engine_max_restarts=0)
    served = InProcessServer(settings)
    instance = served.url.removeprefix("http://")
    webhook = WebhookLog(tmp_path)
    alertmanager = Alertmanager(tmp_path, webhook.url)
    prometheus = Prometheus([instance], tmp_path, fast_rules(tmp_path), alertmanager.url.removeprefix("http://"))
    try:
        body = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0}
        assert httpx.post(f"{served.url}/generate", json=body, timeout=60).status_code == 200
        prometheus.wait_for(lambda: prometheus.query('requests_total{status="length"} > 0'), "a served request")

        def crash() -> None:
            raise RuntimeError("injected loop fault")

        served.app.state.engine.llm_engine.step = crash
        crashed = time.time()  # the next request's step
        codes = []
        for _ in range(5):  # a scrape apart: a counter's rise is seen between two samples, not at its first
            codes.append(httpx.post(f"{served.url}/generate", json=body, timeout=60).status_code)
            time.sleep(1.5)
        assert codes == [500, 503, 503, 503, 503]  # lost in flight, then refused

        def paged(name: str) -> bool:
            return f"pager firing {name} instance={instance}" in webhook.log_text()

        webhook.wait_for(lambda: paged("HighServerErrorRate"), "the 5xx page", 60)
        webhook.wait_for(lambda: paged("EngineLoopStalled"), "the stalled-loop page", 90)
        assert time.time() - crashed > 30  # the heartbeat's threshold, not an early guess
        pager = [line for line in webhook.log_text().splitlines() if " pager firing " in line]
        assert all("runbook docs/operations.md#" in line for line in pager), pager
        assert not paged("ConfKVDown")  # /metrics kept answering while the loop was dead
    finally:
        for process in (prometheus, alertmanager, webhook):
            process.stop()
        served.stop()
