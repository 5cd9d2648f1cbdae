"""Builds and loads the C++ kernels (one extension from `confkv/kv/csrc/`: decode attention in
`paged_attention.cpp`, the block pool's row writes in `block_write.cpp`), and says whether the Triton
kernels (`confkv.kv.triton_attention`, `confkv.kv.triton_blocks`) serve a device.

The extension is compiled once per torch version into `$CONFKV_EXTENSION_DIR`, by default
`~/.cache/conf-kv/extensions/<torch version>`; it needs g++ and ninja. `python -m confkv.kv.kernels`
builds it ahead of time. Once built, it is imported directly (no compiler, ninja or write access
needed, as in a container run by another user) as long as a stamp beside it matches the sources,
torch and Python. Without it, decode attention runs the PyTorch reference and block writes take the
torch path; so they do with `CONFKV_DISABLE_KERNEL=1`, for tests of the fallback and for benchmarks
that compare the two. On CUDA
the Triton kernels serve when triton imports, unless `CONFKV_DISABLE_KERNEL=1` (then the reference
and the torch block writes do).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

NAME = "conf_kv_paged_attention"
CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "paged_attention.cpp", CSRC / "block_write.cpp")
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)


def build_directory() -> Path:
    configured = os.environ.get("CONFKV_EXTENSION_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "conf-kv" / "extensions" / torch.__version__


def _stamp() -> str:
    """What the built library depends on: the sources and headers, the flags, torch and the Python ABI."""
    digest = hashlib.sha256()
    for path in sorted([*CSRC.glob("*.cpp"), *CSRC.glob("*.h")]):
        digest.update(path.read_bytes())
    digest.update(repr((CFLAGS, LDFLAGS, torch.__version__, sys.implementation.cache_tag)).encode())
    return digest.hexdigest()


def _import_built(directory: Path) -> ModuleType | None:
    """The library built earlier in `directory`, if its stamp matches; torch's loader would rerun ninja."""
    library, stamp = directory / f"{NAME}.so", directory / f"{NAME}.stamp"
    if not (library.is_file() and stamp.is_file() and stamp.read_text() == _stamp()):
        return None
    spec = importlib.util.spec_from_file_location(NAME, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(verbose: bool = False) -> ModuleType:
    """Compile the extension (or reuse an up-to-date build) and import it; raises when it cannot."""
    from torch.utils.cpp_extension import load  # imports setuptools: only when building

    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
        # `pip install ninja` puts it next to the interpreter, off PATH unless the venv is activated.
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    module = load(
        name=NAME,
        sources=[str(source) for source in SOURCES],
        # Copies: torch appends to the lists it is given.
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        verbose=verbose,
    )
    (directory / f"{NAME}.stamp").write_text(_stamp())
    return module


@functools.cache
def _built() -> ModuleType | None:
    try:
        return _import_built(build_directory()) or build()
    except Exception as exc:  # a missing compiler or ninja shows up as any of several exception types
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning(
            "decode attention falls back to the PyTorch reference (slower): the C++ kernel did not build (%s); "
            "install g++ and ninja, then run `python -m confkv.kv.kernels`",
            reason,
        )
        return None


def disabled() -> bool:
    """Whether `CONFKV_DISABLE_KERNEL=1` asks for the PyTorch paths instead of any kernel."""
    return os.environ.get("CONFKV_DISABLE_KERNEL") == "1"


def load_kernel() -> ModuleType | None:
    """The compiled kernel module, built on first use; None when disabled or when it cannot be built."""
    if disabled():
        return None
    return _built()


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken install fails in several ways, not only with ImportError
        log.warning("CUDA tensors take the PyTorch paths (slower): triton does not import (%s)", exc)
        return False
    return True


def triton_enabled(device: torch.device) -> bool:
    """Whether the Triton kernels serve tensors on `device`: CUDA, with triton importable, unless disabled."""
    return device.type == "cuda" and not disabled() and _triton_importable()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    log.info("building the C++ kernels, decode attention and block writes (once, about a minute)...")
    try:
        module = build()
    except Exception as exc:
        log.error("the C++ kernels did not build: %s", exc)
        return 1
    log.info("C++ kernels ready: %s", module.__file__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
