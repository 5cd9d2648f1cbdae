"""Dockerfile, compose stack, Grafana dashboard and alert rules agree with the code and each other.

There is no Docker engine in CI, so these tests read the files: every path they copy or mount
exists, ports and health checks line up, both compose profiles (CPU, and GPU by an override file)
resolve, and every metric a rule or a panel queries is one the server really exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib

import pytest
import yaml
from prometheus_client import generate_latest

from confkv.engine.async_engine import AsyncEngine
from confkv.models.default_model import PACKAGE_PIN
from confkv.server.metrics import Metrics
from confkv.server.settings import Settings
from tests.helpers import ROOT, make_engine, tiny_model

PROMQL_WORDS = {"by", "without", "on", "ignoring", "and", "or", "unless", "le", "instance", "job"}
PROMQL_WORDS |= {"sum", "avg", "min", "max", "count"}  # aggregations, written before `by`
PROMQL_WORDS |= {"pool", "reason", "tier", "status", "kind", "stage"}  # our label names
PROMETHEUS_SERIES = {"up"}  # what Prometheus records of every scrape


def dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) pairs, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


CPU_PROFILE = ("docker-compose.yml",)
GPU_PROFILE = ("docker-compose.yml", "docker-compose.gpu.yml")


def has_compose() -> bool:
    docker = shutil.which("docker")
    return docker is not None and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0


def resolved(files: tuple[str, ...]) -> dict:
    """The stack as compose resolves these files: `docker compose config` where the docker CLI has
    compose; otherwise the files merged key by key (later wins) with `${VAR:-default}` substituted."""
    if has_compose():
        flags = [arg for name in files for arg in ("-f", name)]
        out = subprocess.run(
            ["docker", "compose", *flags, "config", "--format", "json"], cwd=ROOT, check=True, capture_output=True
        )
        return json.loads(out.stdout)

    def substitute(text: str) -> str:
        return re.sub(r"\$\{(\w+):-([^}]*)\}", lambda m: os.environ.get(m[1], m[2]), text)

    def merge(base: dict, override: dict) -> dict:
        out = dict(base)
        for key, value in override.items():
            out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        return out

    stack: dict = {}
    for name in files:
        stack = merge(stack, yaml.safe_load(substitute((ROOT / name).read_text())))
    return stack


def test_dockerfile_is_multi_stage_slim_by_default_non_root_and_healthchecked():
    steps = dockerfile()
    stages = [args for op, args in steps if op == "FROM"]
    assert len(stages) >= 3 and all(" AS " in s.upper() for s in stages)
    assert ("ARG", "BASE_IMAGE=python:3.11-slim-bookworm") in steps  # CUDA base selectable by build argument
    runtime = steps[max(i for i, (op, _) in enumerate(steps) if op == "FROM") :]
    users = [args for op, args in runtime if op == "USER"]
    assert users and users[-1] not in ("root", "0")
    health = next(args for op, args in runtime if op == "HEALTHCHECK")
    assert "/health" in health
    assert ("EXPOSE", "8080") in runtime
    assert any(op == "ENV" and "CONFKV_PORT=8080" in args for op, args in runtime)
    assert ("ENTRYPOINT", '["python", "serve.py"]') in runtime


def test_dockerfile_installs_what_the_project_pins_and_converts_the_model():
    text = (ROOT / "Dockerfile").read_text()
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(p for p in pins if p.startswith("torch=="))
    assert torch_pin in text and PACKAGE_PIN in text
    assert "python -m confkv.models.default_model" in text
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for op, args in dockerfile():
        if op == "COPY" and "--from" not in args:
            for source in args.split()[:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such path"
                assert source not in ignored, f"COPY {source} is excluded by .dockerignore"


def test_compose_services_paths_ports_and_health_checks_line_up():
    stack = compose()["services"]
    assert set(stack) == {"server", "prometheus", "alertmanager", "alert-log", "grafana"}
    for name, service in stack.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which does not exist"
    server = stack["server"]
    assert server["build"]["context"] == "."
    assert "8080:8080" in server["ports"]
    assert any("/health" in part for part in server["healthcheck"]["test"])
    grace = float(server["stop_grace_period"].rstrip("s"))
    assert grace > Settings.model_fields["shutdown_grace_period"].default  # it drains before it is killed
    fields = {f"CONFKV_{name.upper()}" for name in Settings.model_fields}
    assert set(server["environment"]) <= fields
    assert stack["prometheus"]["depends_on"]["server"]["condition"] == "service_healthy"
    assert "./prometheus:/etc/prometheus:ro" in stack["prometheus"]["volumes"]
    assert stack["prometheus"]["depends_on"]["alertmanager"]["condition"] == "service_healthy"
    assert "9093:9093" in stack["alertmanager"]["ports"]
    assert any("/-/ready" in part for part in stack["alertmanager"]["healthcheck"]["test"])


def test_gpu_profile_builds_for_cuda_reserves_a_gpu_and_changes_only_the_server():
    cpu, gpu = resolved(CPU_PROFILE)["services"], resolved(GPU_PROFILE)["services"]
    assert "deploy" not in cpu["server"]
    assert cpu["server"]["build"]["args"]["TORCH_INDEX_URL"].endswith("/cpu")
    args = gpu["server"]["build"]["args"]
    cuda = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-[\w-]*runtime[\w.-]*", args["BASE_IMAGE"])
    assert cuda, f"{args['BASE_IMAGE']} is not a CUDA runtime image"
    assert args["TORCH_INDEX_URL"].endswith(f"/cu{cuda[1]}{cuda[2]}"), "torch wheels must match the image's CUDA"
    devices = gpu["server"]["deploy"]["resources"]["reservations"]["devices"]
    assert [(d["driver"], int(d["count"]), d["capabilities"]) for d in devices] == [("nvidia", 1, ["gpu"])]
    environment = gpu["server"]["environment"]
    assert Settings(device=environment["CONFKV_DEVICE"], max_cache_size=environment["CONFKV_MAX_CACHE_SIZE"])
    assert environment["CONFKV_DEVICE"] == "cuda"
    assert {name: service for name, service in gpu.items() if name != "server"} == {
        name: service for name, service in cpu.items() if name != "server"
    }
    declared = {args.split("=")[0] for op, args in dockerfile() if op == "ARG"}
    assert set(args) <= declared and set(cpu["server"]["build"]["args"]) <= declared


def test_prometheus_alerts_the_compose_alertmanager_which_notifies_alert_log():
    scrape = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    assert scrape["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    stack = compose()["services"]
    config_path = next(v.split(":")[1] for v in stack["alertmanager"]["volumes"] if v.startswith("./"))
    assert f"--config.file={config_path}" in stack["alertmanager"]["command"]
    log = stack["alert-log"]
    mount = next(v.split(":")[1] for v in log["volumes"] if v.startswith("./prometheus:"))
    assert log["command"][:2] == ["python", f"{mount}/webhook_log.py"]
    port = log["command"][log["command"].index("--port") + 1]
    config = yaml.safe_load((ROOT / "prometheus" / "alertmanager.yml").read_text())
    urls = [hook["url"] for r in config["receivers"] for hook in r.get("webhook_configs", [])]
    assert urls and all(url.startswith(f"http://alert-log:{port}/") for url in urls)


def test_prometheus_scrapes_the_compose_server_and_grafana_reads_prometheus():
    scrape = yaml.safe_load((ROOT / "prometheus" / "prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["server:8080"]
    for rule_file in scrape["rule_files"]:
        assert (ROOT / "prometheus" / rule_file).is_file()
    source = yaml.safe_load((ROOT / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    provider = yaml.safe_load((ROOT / "grafana" / "provisioning" / "dashboards" / "conf-kv.yaml").read_text())
    mounted = {v.split(":")[1] for v in compose()["services"]["grafana"]["volumes"]}
    assert provider["providers"][0]["options"]["path"] in mounted


@pytest.fixture(scope="module")
def exported_names(tokenizer) -> set[str]:
    """Every sample name the server exports, from a registry bound to a real (tiny) engine."""
    metrics = Metrics()
    model = tiny_model("llama", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = make_engine(model, tokenizer)
    metrics.bind_engine(engine.snapshot, engine.store.device)
    metrics.bind_loop(AsyncEngine(engine))  # not started: its supervision's metrics are read as they stand
    names = set()
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("# TYPE "):  # labelled metrics have no samples until a label is used
            _, _, name, kind = line.split()
            suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
            names |= {name + suffix for suffix in suffixes}
    return names


def metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', "", expr)  # label values
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    names = set(re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b(?!\s*\()", expr))
    functions = set(re.findall(r"([a-zA-Z_]+)\s*\(", expr))
    return {n for n in names - functions - PROMQL_WORDS if not re.fullmatch(r"[0-9e]+", n)}


def test_every_metric_in_alerts_and_dashboard_is_exported(exported_names):
    rules = [
        rule
        for group in yaml.safe_load((ROOT / "prometheus" / "alert_rules.yaml").read_text())["groups"]
        for rule in group["rules"]
    ]
    expressions = [rule["expr"] for rule in rules]
    recorded = {rule["record"] for rule in rules if "record" in rule}
    panels = json.loads((ROOT / "grafana" / "dashboards" / "conf-kv.json").read_text())["panels"]
    expressions += [target["expr"] for panel in panels for target in panel["targets"]]
    used = set().union(*(metric_names(e) for e in expressions)) - recorded - PROMETHEUS_SERIES
    assert {"kv_cache_memory_bytes", "kv_compression_ratio_bucket", "slo_target_seconds"} <= used
    assert "engine_loop_heartbeat_timestamp_seconds" in used
    assert used <= exported_names, f"not exported: {sorted(used - exported_names)}"
    titles = " ".join(panel["title"].lower() for panel in panels)
    for topic in ("memory", "compression ratio", "recall", "prefix", "latency", "throughput", "queue"):
        assert topic in titles
