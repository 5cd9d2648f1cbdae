"""Where a benchmark's server runs which model: the placement flags every server-starting benchmark
takes, the server's flags from them, and how a report names the placement."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from confkv.models.loader import KVShape


def add_placement_options(parser: argparse.ArgumentParser) -> None:
    """`--device`, `--dtype` and `--model-path`: where a benchmark runs which model. Their defaults
    (the CPU, the dtype `load_model` picks, the embedded model) are what the results at the top of
    the benchmarks' results were measured with, so a command that gives none of them measures the same."""
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument(
        "--dtype",
        choices=["float32", "float16", "bfloat16"],
        help="model dtype; default: fp32 on CPU, else the model's",
    )
    parser.add_argument("--model-path", type=Path, help="a local Hugging Face model folder; default: the embedded one")


def token_bytes(config, dtype: torch.dtype = torch.float32) -> int:
    """KV bytes of one token over all layers, held in `dtype` (fp32: the CPU default)."""
    shape = KVShape.of(config)
    return shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * dtype.itemsize


def model_folder(model_path: Path | None) -> Path:
    """The model the server is started with: `model_path`, or the embedded one."""
    from confkv.models.default_model import default_model_path

    return model_path or default_model_path()


def served_dtype(args: argparse.Namespace) -> torch.dtype:
    """The dtype the started server holds the model and its uncompressed KV in: `--dtype`, else what
    `load_model` picks (fp32 on CPU, the checkpoint's dtype elsewhere)."""
    if args.dtype:
        return getattr(torch, args.dtype)
    if args.device == "cpu":
        return torch.float32
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_folder(args.model_path)), "dtype", None) or torch.float32


def server_flags(args: argparse.Namespace) -> list[str]:
    """Flags for the server started here: CPU threads, the device, and the model and its dtype where
    given (else the embedded model, in the dtype `load_model` picks)."""
    flags = [f"--torch-threads={args.threads}", "--log-level=warning", f"--device={args.device}"]
    flags += [f"--dtype={args.dtype}"] if args.dtype else []
    return flags + ([f"--model-path={args.model_path}"] if args.model_path else [])


def placement(args: argparse.Namespace) -> str:
    """The model, dtype and device the server ran, as the report says it."""
    dtype = served_dtype(args)
    model = args.model_path.name if args.model_path else "default model"
    where = f"{args.threads} CPU threads" if args.device == "cpu" else f"on {args.device}"
    return f"{model}, {'fp32' if dtype == torch.float32 else str(dtype).removeprefix('torch.')}, {where}"
