"""The GPU check's CPU half: the offline bundle against pyproject, the machine check, the parts' time
limits, results that name their commit without git, and the whole check run dry with tiny shapes."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from pathlib import Path

import psutil
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from benchmarks.gpu_check import run as gpu_check
from benchmarks.report import SOURCE_SNAPSHOT_ENV, code_digest, snapshot_source
from scripts import gpu_bundle
from tests.helpers import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    """`make gpu-bundle` into a scratch folder (downloads about 11 MiB of wheels from PyPI)."""
    out = tmp_path_factory.mktemp("gpu-bundle")
    gpu_bundle.build(out)
    return out


def test_the_bundle_carries_what_the_gpu_machine_lacks_at_pyprojects_pins(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    machine = {canonicalize_name(name) for name in PYPROJECT["tool"]["conf-kv"]["gpu-machine"]["packages"]}
    wheels = {wheel["name"]: wheel for wheel in manifest["wheels"]}
    pinned = [Requirement(text) for text in PYPROJECT["project"]["dependencies"]]
    lacking = {canonicalize_name(r.name): str(r.specifier) for r in pinned if canonicalize_name(r.name) not in machine}
    assert {"fastapi", "uvicorn", "pydantic-settings", "sse-starlette"} <= set(lacking)
    for name, specifier in lacking.items():
        assert name in wheels, f"{name} is needed and the machine lacks it, but the bundle does not carry it"
        assert specifier == f"=={wheels[name]['version']}", (
            f"{name}: bundled {wheels[name]['version']}, pinned {specifier}"
        )
    assert not machine & set(wheels), "the bundle would shadow a package of the machine's own"
    assert "pydantic-core" in wheels  # a dependency's dependency, compiled: for the machine's python
    for wheel in manifest["wheels"]:
        assert wheel["file"].endswith(("-none-any.whl", "-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"))
    for spare in manifest["spares"]:  # pure-Python wheels of machine packages, with what they must satisfy
        assert spare["name"] in machine and spare["file"].endswith("-none-any.whl") and spare["accepted"]
        assert spare["name"] not in {"torch", "triton", "transformers", "numpy"}
    assert manifest["bytes"] < gpu_bundle.MAX_BYTES
    assert gpu_bundle.verify(manifest, bundle) == []


def test_the_bundle_holds_the_random_weight_models_with_their_predictors(bundle):
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert set(manifest["models"]) == {"SmolLM2-135M-Instruct", "Llama-3.1-8B"}
    for folder in manifest["models"].values():
        files = {path.name for path in (bundle / folder).iterdir()}
        assert {"config.json", "tokenizer.json", "random_weights.json", "value_predictor.safetensors"} <= files
        assert not any(name.endswith((".safetensors", ".bin")) and "model" in name for name in files)


def test_a_changed_wheel_is_refused_before_anything_is_installed(bundle, tmp_path):
    copy = shutil.copytree(bundle, tmp_path / "bundle")
    manifest = json.loads((copy / "manifest.json").read_text())
    wheel = copy / "wheels" / manifest["wheels"][0]["file"]
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    assert gpu_bundle.verify(manifest, copy) == [f"wheels/{wheel.name} differs from the manifest"]
    with pytest.raises(SystemExit, match="incomplete"):
        gpu_bundle.install(copy, tmp_path / "site")
    assert not (tmp_path / "site").exists()


def test_spares_are_installed_only_where_the_machine_has_none_or_a_refused_version():
    manifest = {"spares": [{"name": "anyio", "accepted": ">=4.7"}, {"name": "click", "accepted": ">=7.0"}]}
    versions = {"anyio": "4.3.0", "click": "8.1.0"}
    assert [s["name"] for s in gpu_bundle.spares_needed(manifest, versions.get)] == ["anyio"]
    assert [s["name"] for s in gpu_bundle.spares_needed(manifest, {}.get)] == ["anyio", "click"]
    assert gpu_bundle.spares_needed(manifest, {"anyio": "4.16.0", "click": "8.1.0"}.get) == []


def test_the_machine_check_names_every_difference(monkeypatch):
    spec = {"python": "3.99", "versions": {"torch": "0.1", "not-a-package": "1.0"}, "packages": []}
    monkeypatch.setattr(gpu_bundle, "machine", lambda: spec)
    problems = gpu_bundle.check_machine(cuda=False)
    assert problems[0].startswith("python3 is 3.") and "3.99" in problems[0]
    assert any(p.startswith("torch is 2.") and "0.1.x" in p for p in problems)
    assert "not-a-package is not installed (expected 1.0.x)" in problems


def test_a_part_past_its_limit_is_stopped_with_what_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(120)"
    )
    part = gpu_check.Part("slow", ["-c", script], limit_s=3)
    started = time.monotonic()
    gpu_check.run_part(part)
    assert part.status == "timed out after 3 s" and not part.passed
    assert time.monotonic() - started < 30
    child = psutil.Process(int(pid_file.read_text()))
    with contextlib.suppress(psutil.NoSuchProcess):  # killed (signals land a moment later): gone, or a zombie
        deadline = time.monotonic() + 10
        while child.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.1)
        assert child.status() == psutil.STATUS_ZOMBIE


def test_the_tests_part_passes_only_when_tests_ran_and_none_failed_or_skipped():
    assert gpu_check.tests_status({"a": "passed", "b": "passed"}, "ok") == "ok: 2 passed, 0 failed, 0 skipped"
    assert gpu_check.tests_status({"a": "passed", "b": "failed"}, "failed (exit 1)").startswith("failed (exit 1)")
    assert gpu_check.tests_status({"a": "skipped"}, "ok") == "failed: 0 passed, 0 failed, 1 skipped"
    assert gpu_check.tests_status({}, "timed out after 150 s") == "timed out after 150 s"


def test_results_name_their_commit_in_a_copy_without_git(tmp_path, monkeypatch):
    """A copy of the tree as a GPU machine receives it (no .git): the snapshot the bundle recorded says
    which commit it is and whether the measured code still matches it."""
    archive = tmp_path / "tree.tar"
    subprocess.run(
        ["git", "archive", "--format=tar", "-o", str(archive), "HEAD", "confkv/server", "confkv/config"],
        cwd=ROOT,
        check=True,
    )
    copy = tmp_path / "copy"
    with tarfile.open(archive) as tar:
        tar.extractall(copy, filter="data")
    snapshot = tmp_path / "source.json"
    snapshot.write_text(json.dumps(snapshot_source()))
    monkeypatch.setenv(SOURCE_SNAPSHOT_ENV, str(snapshot))
    committed = code_digest(("confkv/server", "confkv/config"), rev="HEAD")
    assert code_digest(("confkv/server", "confkv/config"), root=copy) == committed
    assert code_digest(("confkv/server", "confkv/config"), rev="HEAD", root=copy) == committed
    (copy / "confkv" / "server" / "api.py").write_text("# changed\n")
    assert code_digest(("confkv/server", "confkv/config"), root=copy) != committed


def test_the_check_refuses_a_machine_without_cuda_saying_what_to_do():
    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    run = subprocess.run([sys.executable, "benchmarks/gpu_check/run.py"], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 1
    assert "CUDA is not available" in run.stderr and "--dry-run" in run.stderr


@pytest.mark.slow
def test_the_check_runs_dry_on_the_cpu_from_the_bundle(bundle, tmp_path):
    """`make gpu-dry-run`: the machine check (as warnings), the bundle installed for the GPU machine's
    python into a scratch folder, and every part with tiny shapes on the bundle's random-weight models."""
    results = tmp_path / "results"
    run = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--results", str(results)],
        cwd=ROOT,
        env={**os.environ, "PYTHON": sys.executable, "GPU_BUNDLE": str(bundle)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for stage in ("machine", "bundle", "gpu check"):
        assert f"== {stage}: " in run.stdout
    check = json.loads((results / "gpu_check.json").read_text())
    assert [(p["name"], p["status"]) for p in check["parts"]] == [(part, "ok") for part in gpu_check.PARTS]
    assert check["machine"]["name"] == "CPU (dry run)"
    decode = check["decode_step"]
    assert set(decode) == set(gpu_check.DECODE_SETUPS)
    assert all(row["mean_step_ms"] > 0 and 0 <= row["compressor_share"] < 1 for row in decode.values())
    assert check["serving"]["errors"] == 0 and check["serving"]["off_tokens_per_s"] > 0
    assert check["targets"]["throughput"]["met"] in ("met", "not met")
    for ways in check["async_compression"].values():
        assert set(ways) == {"between steps", "beside the forward pass"}
        assert all(row["tokens_per_s"] > 0 and 0 <= row["critical_share"] < 1 for row in ways.values())
    serving = json.loads((results / "gpu_serving_fixed_budget.json").read_text())
    assert serving["args"]["model_path"] == "SmolLM2-135M-Instruct-random-0"
    assert (results / "gpu_check.md").read_text().startswith("# GPU check")
