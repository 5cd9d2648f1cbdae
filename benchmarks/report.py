"""How every benchmark saves its figures: the table printed, OUT.md and OUT.json beside each other."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def save_report(out: Path, title: str, table: str, data: dict, args: argparse.Namespace | None = None) -> None:
    """Print `table`; write it as OUT.md under `title`, and `data` (with the run's arguments) as OUT.json."""
    print(table)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(f"# {title}\n\n{table}\n")
    # Arguments as text, files by name only (a full path would name this machine's folders).
    settings = {"args": {k: _text(v) for k, v in vars(args).items() if k != "out"}} if args is not None else {}
    out.with_suffix(".json").write_text(json.dumps({**settings, **data}, indent=2))


def commit_of(rev: str = "HEAD") -> str:
    """The short hash of a git revision of this repository (what a result names as measured)."""
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def _text(value: object) -> str:
    if isinstance(value, Path):
        return value.name
    if isinstance(value, list) and value and all(isinstance(v, Path) for v in value):
        return str([v.name for v in value])
    return str(value)
