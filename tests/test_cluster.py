"""The Ray Serve application's logic, without a cluster: routing ranks, prompt text, metrics merging,
the autoscaling policy, the settings and the KubeRay manifest (by Ray's own config loader)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError
from ray.serve.schema import ServeDeploySchema

from confkv.cluster.autoscaling import KV_USAGE, KVPressurePolicy
from confkv.cluster.ingress import routing_text
from confkv.cluster.metrics import REPLICA_LABEL, exposition, labelled
from confkv.cluster.router import ReplicaLoad, free_share, rank
from confkv.server.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent

loads = st.lists(st.floats(0.0, 1.0, allow_nan=False).map(lambda f: round(f, 3)), min_size=1, max_size=6).map(
    lambda shares: [ReplicaLoad(f"r{i}", s) for i, s in enumerate(shares)]
)


@given(loads, st.data(), st.floats(0.0, 1.0))
def test_ranks_hold_every_replica_once_and_follow_the_rule(replicas, data, threshold):
    ids = [r.replica_id for r in replicas]
    cached = set(data.draw(st.lists(st.sampled_from(ids), unique=True)))
    ranks, reason = rank(replicas, cached, threshold)
    flat = [rid for group in ranks for rid in group]
    assert sorted(flat) == sorted(ids) and all(ranks)
    share = {r.replica_id: r.free_share for r in replicas}
    spread = max(share.values()) - min(share.values())
    if cached and spread <= threshold:
        assert reason == "prefix" and set(ranks[0]) == cached
    else:
        assert reason == ("imbalance" if cached else "free_kv")
        assert max(share.values()) in {share[rid] for rid in ranks[0]}  # the freest is in the first rank
        assert all(share[rid] >= max(share.values()) - 0.05 for rid in ranks[0])
    later = [share[group[0]] for group in ranks[1:]]
    assert later == sorted(later, reverse=True)  # the rest, freest first


def test_a_prefix_wins_while_balanced_and_free_memory_wins_past_the_threshold():
    balanced = [ReplicaLoad("a", 0.6), ReplicaLoad("b", 0.9)]
    assert rank(balanced, {"a"}, 0.5) == ([["a"], ["b"]], "prefix")
    full = [ReplicaLoad("a", 0.1), ReplicaLoad("b", 0.9)]
    assert rank(full, {"a"}, 0.5) == ([["b"], ["a"]], "imbalance")
    assert rank(full, set(), 0.5) == ([["b"], ["a"]], "free_kv")
    assert rank([ReplicaLoad("a", 1.0), ReplicaLoad("b", 0.98)], set(), 0.5)[0] == [["a", "b"]]  # tied


def test_free_share_from_routing_stats():
    assert free_share({}) == 1.0  # not reported yet: counts as empty
    assert free_share({"kv_capacity_bytes": 100, "kv_free_bytes": 25}) == 0.25
    assert free_share({"kv_capacity_bytes": 100, "kv_free_bytes": -5}) == 0.0


def test_routing_text_of_each_route_and_a_conversation_extends_its_last_turn():
    assert routing_text(json.dumps({"prompt": "Once upon"}).encode()) == "Once upon"
    assert routing_text(json.dumps({"prompt_token_ids": [5, 17]}).encode()) == "5,17,"
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": [{"text": "More"}]}]
    first, second = (routing_text(json.dumps({"messages": m}).encode()) for m in (turn1, turn2))
    assert second.startswith(first) and "More" in second and len(second) > len(first)
    for body in (b"", b"not json", b"[1, 2]", json.dumps({"max_tokens": 3}).encode()):
        assert routing_text(body) == ""


def _exposition(requests: float) -> str:
    """A replica's metrics as prometheus_client writes them: a counter, a gauge and a histogram."""
    registry = CollectorRegistry()
    Counter("requests", "Requests", ["status"], registry=registry).labels("200").inc(requests)
    Gauge("kv_cache_bytes", "KV bytes", ["pool"], registry=registry).labels("running").set(1024)
    Histogram("ttft", "TTFT", buckets=(0.5,), registry=registry).observe(0.2)
    return generate_latest(registry).decode()


def test_replica_metrics_merge_into_one_family_each_labelled_by_replica():
    text = exposition(labelled({"r1": _exposition(3), "r2": _exposition(5)})).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert {"requests", "kv_cache_bytes", "ttft"} <= set(families)
    values = {s.labels[REPLICA_LABEL]: s.value for s in families["requests"].samples if s.name == "requests_total"}
    assert values == {"r1": 3.0, "r2": 5.0}
    assert all(REPLICA_LABEL in s.labels for f in families.values() for s in f.samples)
    assert text.count("# TYPE ttft histogram") == 1


def test_merged_metrics_pass_promtool(tmp_path):
    path = tmp_path / "metrics.txt"
    path.write_bytes(exposition(labelled({"r1": _exposition(3), "r2": _exposition(5)})))
    result = subprocess.run(["promtool", "check", "metrics"], stdin=path.open("rb"), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _context(requests: float, usage: dict[str, float], target_requests: float = 8.0, replicas: int = 2):
    config = SimpleNamespace(get_target_ongoing_requests=lambda: target_requests)
    return SimpleNamespace(
        policy_state={},
        total_num_requests=requests,
        aggregated_metrics={KV_USAGE: usage},
        config=config,
        target_num_replicas=replicas,
        deployment_name="EngineReplica",
    )


def test_autoscaling_wants_the_larger_of_the_request_and_the_kv_counts():
    policy = KVPressurePolicy(target_kv_usage=0.5)
    desired, state = policy(_context(requests=4, usage={"a": 0.9, "b": 0.8}))  # few requests, long ones
    assert desired == pytest.approx(3.4) and state["by_requests"] == pytest.approx(0.5) and state["wanted"] == 4
    desired, _ = policy(_context(requests=40, usage={"a": 0.1, "b": 0.1}))  # many short requests
    assert desired == pytest.approx(5.0)
    assert policy(_context(requests=0, usage={}))[0] == 0.0
    with pytest.raises(ValueError, match="target_kv_usage"):
        KVPressurePolicy(target_kv_usage=0.0)


def test_cluster_settings_from_flags_env_config_file_and_bounds(monkeypatch, tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text("cluster:\n  replicas: 4\n  target_kv_usage: 0.5\n")
    from_file = load_settings(["--config", str(config)]).cluster
    assert (from_file.replicas, from_file.target_kv_usage) == (4, 0.5)
    settings = load_settings(["--ray", "--cluster.replicas", "3", "--cluster.router", "power_of_two"])
    assert settings.ray and settings.cluster.replicas == 3 and settings.cluster.router == "power_of_two"
    assert not load_settings([]).ray
    monkeypatch.setenv("CONFKV_CLUSTER__IMBALANCE_THRESHOLD", "0.3")
    assert load_settings([]).cluster.imbalance_threshold == 0.3
    with pytest.raises(ValidationError, match="max_replicas"):
        load_settings(["--cluster.replicas", "3", "--cluster.max-replicas", "2"])


def _manifest() -> tuple[dict, dict]:
    service = yaml.safe_load((ROOT / "deploy" / "rayservice.yaml").read_text())
    return service, yaml.safe_load(service["spec"]["serveConfigV2"])


def test_rayservice_manifest_passes_rays_config_loader_and_builds_our_application():
    service, serve_config = _manifest()
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    schema = ServeDeploySchema.model_validate(serve_config)  # what `serve deploy` and KubeRay's Serve run
    (application,) = schema.applications
    assert application.import_path == "confkv.cluster.app:app_builder"
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == _pinned_ray()
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    assert all(g["template"]["spec"]["containers"][0]["image"] for g in groups)
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["minReplicas"] <= workers["replicas"] <= workers["maxReplicas"]

    from ray.serve._private.build_app import build_app

    from confkv.cluster.app import app_builder

    built = {d.name: d for d in build_app(app_builder(application.args), name=application.name).deployments}
    assert set(built) == {"Ingress", "EngineReplica", "MetricsHub"}
    engine = built["EngineReplica"]._deployment_config
    assert engine.request_router_config.request_router_class == "confkv.cluster.router:PrefixKVRouter"
    scaling = engine.autoscaling_config
    args = application.args["cluster"]
    assert (scaling.min_replicas, scaling.max_replicas) == (args["replicas"], args["max_replicas"])
    assert scaling.policy.policy_function == "confkv.cluster.autoscaling:KVPressurePolicy"


def _pinned_ray() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    return text.split('"ray[serve]==', 1)[1].split('"', 1)[0]


def test_a_replica_runs_no_more_torch_threads_than_the_cpus_it_reserves():
    from confkv.cluster.replica import replica_threads
    from confkv.server.settings import ClusterSettings, Settings

    def threads(torch_threads, cpus):
        return replica_threads(Settings(torch_threads=torch_threads, cluster=ClusterSettings(replica_cpus=cpus)))

    assert threads(None, 1.0) == 1 and threads(2, 1.0) == 1 and threads(None, 4.0) == 4
    assert threads(2, 4.0) == 2 and threads(None, 0.0) == 1 and threads(8, 2.5) == 2


def test_a_tensor_parallel_replica_reserves_each_ranks_cpus_and_gpus_on_one_node():
    from confkv.cluster.app import replica_resources
    from confkv.server.settings import ClusterSettings, Settings

    cluster = ClusterSettings(replica_cpus=2.0, replica_gpus=1.0)
    assert replica_resources(Settings(cluster=cluster)) == {"num_cpus": 2.0, "num_gpus": 1.0}
    assert replica_resources(Settings(cluster=cluster, tensor_parallel_size=4)) == {"num_cpus": 8.0, "num_gpus": 4.0}
