"""The offline bundle of the GPU check: built here, where PyPI is reachable, installed on a GPU machine
that has no network.

The GPU machine (pyproject.toml, `[tool.conf-kv.gpu-machine]`) has its own python3 with torch, triton,
transformers and much else, which the check uses as they are; the bundle carries what it lacks:

    .gpu-bundle/
      wheels/         cp312 manylinux x86-64 wheels of every package the server needs (pyproject's
                      dependencies and theirs) that the machine lacks, at the versions installed here
                      (pyproject's pins, and for their own dependencies the ones tested with them)
      models/         a model cache (CONFKV_MODEL_CACHE): each named architecture with random weights,
                      config and the embedded model's tokenizer (real weights are too large to travel)
      source.json     the commit and the blob of every tracked file, so that results name their commit
                      in a copy of the tree without git (CONFKV_SOURCE)
      manifest.json   what the bundle holds: each wheel's name, version, file, size and sha256

    python -m scripts.gpu_bundle build                     # make gpu-bundle
    python -m scripts.gpu_bundle check-machine             # on the GPU machine: is it the one described?
    python -m scripts.gpu_bundle install --target DIR      # pip install --no-index --no-deps --target DIR

Only the standard library and `packaging` are imported at the top: `check-machine` and `install` run
on the GPU machine before anything of the bundle is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import platform
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / ".gpu-bundle"
MAX_BYTES = 40 * 2**20  # of the 64 MiB a GPU run may carry, the tree itself and results taking the rest
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def machine() -> dict:
    """The GPU machine as pyproject describes it: python, checked versions, the packages it has."""
    return pyproject()["tool"]["conf-kv"]["gpu-machine"]


def target_environment(python: str) -> dict[str, str]:
    """Marker values of the GPU machine (Linux x86-64, CPython `python`), for dependencies' markers."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
    }


def needed_packages() -> tuple[dict[str, str], dict[str, str]]:
    """What the server needs on the GPU machine: the packages the machine lacks, with the version
    installed here (pyproject's dependencies, then theirs, as their markers apply there); and for each
    package it has that one of those requires, the versions they accept (the machine's may be older)."""
    spec = machine()
    present = {canonicalize_name(name) for name in spec["packages"]}
    environment = target_environment(spec["python"])
    # Each requirement with whether a bundled package made it (pyproject's own pins of packages the
    # machine has do not apply there: the check runs on the machine's versions of those).
    queue = [(Requirement(text), False) for text in pyproject()["project"]["dependencies"]]
    needed: dict[str, str] = {}
    floors: dict[str, SpecifierSet] = {}
    while queue:
        requirement, bundled = queue.pop()
        name = canonicalize_name(requirement.name)
        if name in present:
            if bundled:
                floors[name] = floors.get(name, SpecifierSet()) & requirement.specifier
            continue
        if name in needed:
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            sys.exit(f"{name} is needed on the GPU machine but not installed here; run `make install` first")
        needed[name] = distribution.version
        for text in distribution.requires or []:
            dependency = Requirement(text)
            extras = requirement.extras or {""}
            if not dependency.marker or any(
                dependency.marker.evaluate({**environment, "extra": extra}) for extra in extras
            ):
                dependency.marker = None
                queue.append((dependency, True))
    checked = {canonicalize_name(name) for name in spec["versions"]}
    accepted = {name: str(specifier) for name, specifier in floors.items() if str(specifier) and name not in checked}
    return dict(sorted(needed.items())), dict(sorted(accepted.items()))


def build(out: Path) -> dict:
    """Download the wheels, write the model folders and the source snapshot; return the manifest."""
    from tqdm import tqdm

    sys.path.insert(0, str(ROOT))
    from benchmarks.report import snapshot_source
    from confkv.models.default_model import default_model_path
    from confkv.models.random_weights import ARCHITECTURES, write_random_model

    packages, accepted = needed_packages()
    # For each package the machine has that a bundled one requires: this environment's version, to
    # install there only if the machine's is one the requirement refuses. Pure-Python wheels only.
    spares = {name: importlib.metadata.version(name) for name in accepted}
    with tqdm(total=4, desc="gpu bundle", unit="stage") as bar:
        bar.set_postfix_str(f"{len(packages)} wheels")
        download(packages, out / "wheels")
        bar.update()
        bar.set_postfix_str(f"{len(spares)} spare wheels")
        download(spares, out / "spares")
        for binary in (out / "spares").glob("*.whl"):
            if not binary.name.endswith("-none-any.whl"):
                binary.unlink()
        bar.update()
        bar.set_postfix_str("models")
        models = {}
        for architecture in ARCHITECTURES:
            folder = out / "models" / f"{architecture}-random-0"
            write_random_model(architecture, folder, default_model_path())
            write_random_predictor(folder)
            models[architecture] = str(folder.relative_to(out))
        bar.update()
        (out / "source.json").write_text(json.dumps(snapshot_source()))
        bar.update()
    manifest = {
        "python": machine()["python"],
        "machine_versions": machine()["versions"],
        "wheels": [wheel_entry(path) for path in sorted((out / "wheels").glob("*.whl"))],
        "spares": [
            {**wheel_entry(path), "accepted": accepted[wheel_entry(path)["name"]]}
            for path in sorted((out / "spares").glob("*.whl"))
        ],
        "models": models,
        "bytes": sum(f.stat().st_size for f in out.rglob("*") if f.is_file()),
    }
    if manifest["bytes"] > MAX_BYTES:
        sys.exit(f"the bundle holds {manifest['bytes'] / 2**20:.1f} MiB, over {MAX_BYTES / 2**20:.0f} MiB")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


def write_random_predictor(folder: Path) -> None:
    """A value predictor with random weights in the model folder, of the embedded model's predictor's
    configuration, so that the dynamic policy predicts (and costs) on the random-weight model as on a
    trained one."""
    from transformers import AutoConfig

    from confkv.compress.predictor.model import load_predictor, model_fingerprint, random_predictor, save_predictor
    from confkv.compress.predictor.online import PREDICTOR_FILE, predictor_path
    from confkv.models.default_model import default_model_path

    shipped = load_predictor(predictor_path(None), model_fingerprint(AutoConfig.from_pretrained(default_model_path())))
    fingerprint = model_fingerprint(AutoConfig.from_pretrained(folder))
    save_predictor(random_predictor(shipped), folder / PREDICTOR_FILE, fingerprint)


def download(packages: dict[str, str], folder: Path) -> None:
    """The GPU machine's wheels of `packages` (name -> version) into `folder`, which holds nothing else."""
    if folder.exists():
        for stale in folder.glob("*.whl"):
            stale.unlink()
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d", str(folder)]
        + ["--python-version", machine()["python"], "--implementation", "cp", *platforms]
        + [f"{name}=={version}" for name, version in packages.items()],
        check=True,
    )


def wheel_entry(path: Path) -> dict:
    """A wheel as the manifest lists it: name and version from its file name (the wheel standard's)."""
    name, version = path.name.split("-")[:2]
    return {
        "name": canonicalize_name(name),
        "version": version,
        "file": path.name,
        "bytes": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
    }


def check_machine(cuda: bool = True) -> list[str]:
    """How this machine differs from the GPU machine pyproject describes (empty where it does not):
    its python, the major.minor versions of its torch, triton and transformers, and a CUDA device."""
    spec = machine()
    problems = []
    python = ".".join(platform.python_version_tuple()[:2])
    if python != spec["python"]:
        problems.append(f"python3 is {python}, the bundle's wheels are for {spec['python']}")
    for name, want in spec["versions"].items():
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            problems.append(f"{name} is not installed (expected {want}.x)")
            continue
        if have.split("+")[0].split(".")[:2] != want.split("."):
            problems.append(f"{name} is {have}, checked with {want}.x")
    if cuda:
        import torch

        if not torch.cuda.is_available():
            problems.append(f"torch {torch.__version__} sees no CUDA device")
    return problems


def verify(manifest: dict, bundle: Path) -> list[str]:
    """Files of the manifest missing from `bundle` or changed since (sha256)."""
    problems = []
    for folder, wheel in [("wheels", w) for w in manifest["wheels"]] + [("spares", w) for w in manifest["spares"]]:
        path = bundle / folder / wheel["file"]
        if not path.is_file():
            problems.append(f"{folder}/{wheel['file']} is missing")
        elif hashlib.sha256(path.read_bytes()).hexdigest() != wheel["sha256"]:
            problems.append(f"{folder}/{wheel['file']} differs from the manifest")
    return problems


def spares_needed(manifest: dict, version_of: Callable[[str], str | None]) -> list[dict]:
    """The spare wheels to install: those whose package this machine (`version_of`: its installed
    version, None where absent) lacks, or has at a version the bundled packages refuse."""
    return [
        spare
        for spare in manifest["spares"]
        if (have := version_of(spare["name"])) is None or not SpecifierSet(spare["accepted"]).contains(have)
    ]


def installed_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def install(bundle: Path, target: Path, cross: bool = False) -> None:
    """Install the bundle's wheels into `target`, offline and without dependencies (the machine's own
    packages serve those, with a spare where the machine's version is refused). `cross`: for the GPU
    machine's python from another one (a dry run)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    problems = verify(manifest, bundle)
    if problems:
        sys.exit("the bundle is incomplete (run `make gpu-bundle` again): " + "; ".join(problems))
    spares = spares_needed(manifest, installed_version)
    for spare in spares:
        print(
            f"carrying {spare['name']} {spare['version']}: this machine has {installed_version(spare['name'])}, "
            f"the bundle's packages need {spare['accepted']}"
        )
    foreign = ["--python-version", manifest["python"], "--implementation", "cp", "--only-binary=:all:"]
    foreign += [arg for p in PLATFORMS for arg in ("--platform", p)]
    files = [bundle / "wheels" / w["file"] for w in manifest["wheels"]] + [
        bundle / "spares" / w["file"] for w in spares
    ]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile"]
        + ["--disable-pip-version-check", "--target", str(target), *(foreign if cross else [])]
        + [str(file) for file in files],
        check=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("build", help="download the wheels, write the models (make gpu-bundle)").add_argument(
        "--out", type=Path, default=BUNDLE
    )
    check = commands.add_parser("check-machine", help="exit 1 where this is not the machine pyproject describes")
    check.add_argument("--no-cuda", dest="cuda", action="store_false", help="do not ask for a CUDA device")
    check.add_argument("--warn", action="store_true", help="print the differences, exit 0 (a dry run)")
    setup = commands.add_parser("install", help="install the bundle's wheels into a folder, offline")
    setup.add_argument("--bundle", type=Path, default=BUNDLE)
    setup.add_argument("--target", type=Path, required=True)
    setup.add_argument("--cross", action="store_true", help="for the GPU machine's python, from another one")
    args = parser.parse_args()
    if args.command == "build":
        manifest = build(args.out)
        print(f"{args.out}: {len(manifest['wheels'])} wheels, {manifest['bytes'] / 2**20:.1f} MiB")
    elif args.command == "check-machine":
        problems = check_machine(args.cuda)
        for problem in problems:
            print(f"{'warning' if args.warn else 'error'}: {problem}", file=sys.stderr)
        if problems and not args.warn:
            sys.exit(
                "this is not the GPU machine the check was prepared for (pyproject.toml, "
                "[tool.conf-kv.gpu-machine]); update that table and run `make gpu-bundle` again"
            )
    else:
        install(args.bundle, args.target, args.cross)


if __name__ == "__main__":
    main()
