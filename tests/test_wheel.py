"""The package as a user installs it: the wheel built from the checkout, installed into a scratch venv
outside it, its library API run and its server started there on a tiny model. What the code reads
beside itself (configs, the inspector's page, the C++ source, the predictor's weights) must travel in
the wheel, since nothing of the checkout is on that venv's path."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT, LiveServer

PACKAGE_DATA = (
    "confkv/config/compression.json",
    "confkv/config/prediction_model.yaml",
    "confkv/config/server.yaml",
    "confkv/server/web/inspect/index.html",
    "confkv/kv/csrc/paged_attention.cpp",
    "confkv/kv/csrc/block_write.cpp",
    "confkv/kv/csrc/formats.h",
    "confkv/compress/predictor/weights/SmolLM2-135M-Instruct.safetensors",
)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of what packaging reads (a build folder in the checkout could
    carry modules deleted since into the wheel)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "confkv", source / "confkv", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("dist")
    build = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", out, source]
    subprocess.run(build, check=True, capture_output=True)
    (found,) = out.glob("conf_kv-*.whl")
    return found


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, wheel) -> Path:
    """A venv outside the checkout with only the wheel installed; its dependencies are this
    interpreter's, reached through a path file (so no download, and not this checkout's editable install,
    whose own path file a plain path entry does not run)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(purelib, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", wheel]
    subprocess.run(install, check=True, capture_output=True, cwd=venv)
    return venv


def test_the_wheel_carries_the_package_and_its_data_and_nothing_else_at_the_top(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"confkv", wheel.name.split("-")[0] + "-0.1.0.dist-info"}
    for data in PACKAGE_DATA:
        assert data in names, f"{data} is missing from the wheel: add it to [tool.setuptools.package-data]"


def test_the_installed_library_api_compresses_a_generation_outside_the_checkout(scratch, tiny_model_dir, tmp_path):
    script = textwrap.dedent(f"""
        import confkv, torch
        from transformers import AutoModelForCausalLM
        from confkv import DynamicKVCompressor
        assert confkv.__file__.startswith({str(scratch)!r}), confkv.__file__
        model = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r})
        compressor = DynamicKVCompressor(max_cache_size=64, prediction_window=128, compression_rate=0.5)
        out = compressor.generate(model, torch.tensor([list(range(3, 60))]), max_new_tokens=8)
        metrics = compressor.metrics()
        print(out.shape[1], metrics.original_size, metrics.compressed_size)
    """)
    run = subprocess.run([scratch / "bin" / "python", "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    length, original, compressed = (int(x) for x in run.stdout.split())
    assert length == 57 + 8
    assert 0 < compressed < original


def test_the_installed_server_starts_serves_and_shows_its_page(scratch, tiny_model_dir, tmp_path):
    launcher = [str(scratch / "bin" / "conf-kv")]
    server = LiveServer("--model-path", str(tiny_model_dir), "--max-cache-size", "64", launcher=launcher, cwd=tmp_path)
    try:
        body = {"prompt": "one two three four five", "max_tokens": 4, "compression_stats": True}
        response = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["compression_metrics"]["original_size"] > 0
        page = httpx.get(f"{server.url}/inspect", timeout=10)
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert "kv_cache_bytes" in httpx.get(f"{server.url}/metrics", timeout=10).text
    finally:
        server.stop()
