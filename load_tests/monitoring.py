"""Real Prometheus, Alertmanager and webhook receiver processes on loopback, with the repo's own
configuration aimed at them: for the live alert tests and for load runs that watch the alerts."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = ROOT / "prometheus"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Process:
    """A real binary on loopback at `address`, its output in a log file under the test's folder."""

    name = ""

    def __init__(self, args: list[str], workdir: Path, address: str, ready: Callable[[str], bool]) -> None:
        self.url = f"http://{address}"
        self.log = open(workdir / f"{self.name}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        self.wait_for(lambda: ready(self.url), "ready", 60)

    def wait_for(self, check: Callable[[], object], what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"{self.name}: {what} not seen in {timeout}s; log:\n{self.log_text()[-3000:]}")

    def log_text(self) -> str:
        return Path(self.log.name).read_text()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


class Prometheus(_Process):
    """The repo's config aimed at the given servers and Alertmanager, scraping and evaluating every second."""

    name = "prometheus"

    def __init__(self, targets: list[str], workdir: Path, rules: Path | None = None, alertmanager: str = "") -> None:
        config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(rules)] if rules else [str(PROMETHEUS_DIR / f) for f in config["rule_files"]]
        config["scrape_configs"][0]["static_configs"] = [{"targets": targets}]
        if alertmanager:
            config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [alertmanager]}]
        else:
            del config["alerting"]
        path = workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config))
        address = f"127.0.0.1:{free_port()}"
        args = [
            "prometheus",
            f"--config.file={path}",
            f"--storage.tsdb.path={workdir / 'prometheus-data'}",
            f"--web.listen-address={address}",
        ]
        super().__init__(args, workdir, address, _ready)

    def query(self, expr: str) -> list[dict]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]


class WebhookLog(_Process):
    """prometheus/webhook_log.py, the receiver docker-compose gives Alertmanager by default."""

    name = "webhook-log"

    def __init__(self, workdir: Path) -> None:
        port = free_port()
        args = [sys.executable, str(PROMETHEUS_DIR / "webhook_log.py"), "--host", "127.0.0.1", "--port", str(port)]
        super().__init__(args, workdir, f"127.0.0.1:{port}", _takes_posts)


class Alertmanager(_Process):
    """The repo's Alertmanager config, notifying at once (1 s group wait and interval) into `webhook`."""

    name = "alertmanager"

    def __init__(self, workdir: Path, webhook: str) -> None:
        config = yaml.safe_load((PROMETHEUS_DIR / "alertmanager.yml").read_text())
        config["route"] |= {"group_wait": "1s", "group_interval": "1s"}
        for receiver in config["receivers"]:
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = webhook + urlsplit(hook["url"]).path
        path = workdir / "alertmanager.yml"
        path.write_text(yaml.safe_dump(config))
        address = f"127.0.0.1:{free_port()}"
        args = [
            shutil.which("alertmanager") or "prometheus-alertmanager",  # Debian's name for it
            f"--config.file={path}",
            f"--storage.path={workdir / 'alertmanager-data'}",
            f"--web.listen-address={address}",
            "--cluster.listen-address=",  # a single instance: no gossip port to collide with
        ]
        super().__init__(args, workdir, address, _ready)

    def alerts(self) -> list[dict]:
        return httpx.get(f"{self.url}/api/v2/alerts", timeout=10).json()


def _ready(url: str) -> bool:
    return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200


def _takes_posts(url: str) -> bool:
    return httpx.post(url, content=b"{}", timeout=2).status_code == 200


def fast_rules(workdir: Path) -> Path:
    """alert_rules.yaml with every `for` cut to 2 s: the same expressions, labels and annotations."""
    groups = yaml.safe_load((PROMETHEUS_DIR / "alert_rules.yaml").read_text())
    for group in groups["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "2s"
    path = workdir / "alert_rules.yaml"
    path.write_text(yaml.safe_dump(groups, allow_unicode=True))
    return path
