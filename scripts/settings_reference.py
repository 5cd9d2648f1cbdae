"""docs/configuration.md's tables, generated from the settings' own declarations (`python -m
scripts.settings_reference` writes them, `make docs` too; a test holds the file to what this renders):
a setting is documented where it is declared, in its `Field(description=...)`."""

from __future__ import annotations

import json
import re
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from confkv.compress.config import CompressionConfig, Thresholds
from confkv.compress.scoring import POLICIES, option_fields
from confkv.models.loader import FAMILIES, REFUSED_FAMILIES
from confkv.server.sampling_options import SamplingOptions
from confkv.server.settings import CalibrationSettings, ClusterSettings, Settings

DOCUMENT = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
_BLOCK = re.compile(r"(<!-- settings (?P<name>\w+) -->\n).*?(<!-- /settings -->)", re.S)
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
_KINDS = {Path: "path", str: "text", int: "integer", float: "number", bool: "true or false"}


def server_table(model: type[BaseModel] = Settings, prefix: str = "") -> str:
    """One row per server setting: its flag and environment variable, default, values and meaning."""
    rows = ["| flag | environment | default | values | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            continue  # a nested group has its own table
        flag = f"--{prefix}{name.replace('_', '-')}" if not prefix else f"--{prefix}{name}"
        env = f"CONFKV_{prefix.rstrip('.').upper()}{'__' if prefix else ''}{name.upper()}"
        rows.append(f"| `{flag}` | `{env}` | {_default(field)} | {_values(field)} | {_meaning(field)} |")
    return "\n".join(rows)


def policy_file_table(model: type[BaseModel] = CompressionConfig) -> str:
    """One row per key of the compression config file (`confkv/config/compression.json`)."""
    rows = ["| key | default | values | meaning |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        key = field.validation_alias.choices[-1] if field.validation_alias else name  # the seed's name first
        rows.append(f"| `{key}` | {_default(field)} | {_values(field)} | {_meaning(field)} |")
    return "\n".join(rows)


def policy_options_table() -> str:
    """One row per option of every registered policy: its default, range and meaning, as its field declares them."""
    rows = ["| policy | option | default | values | meaning |", "| --- | --- | --- | --- | --- |"]
    for name, policy in POLICIES.items():
        for option, field in option_fields(policy).items():
            rows.append(f"| `{name}` | `{option}` | {_default(field)} | {_values(field)} | {_meaning(field)} |")
    return "\n".join(rows)


def sampling_table() -> str:
    """One row per sampling parameter both request routes take (`SamplingOptions`)."""
    rows = ["| field | default | values | meaning |", "| --- | --- | --- | --- |"]
    for name, field in SamplingOptions.model_fields.items():
        if name not in ("compression", "compression_stats"):
            rows.append(f"| `{name}` | {_default(field)} | {_values(field)} | {_meaning(field)} |")
    return "\n".join(rows)


def families_table() -> str:
    """The model families `--model-path` takes, and those it refuses with why (`confkv.models.loader`)."""
    rows = ["| family | `model_type` | served |", "| --- | --- | --- |"]
    rows += [f"| {name} | `{key}` | yes |" for key, name in FAMILIES.items()]
    rows += [f"| | `{key}` | no: {why} |" for key, why in REFUSED_FAMILIES.items()]
    return "\n".join(rows)


TABLES = {
    "families": families_table,
    "server": server_table,
    "cluster": lambda: server_table(ClusterSettings, "cluster."),
    "calibration": lambda: server_table(CalibrationSettings, "calibration."),
    "policy_file": policy_file_table,
    "thresholds": lambda: policy_file_table(Thresholds),
    "policy_options": policy_options_table,
    "sampling": sampling_table,
}


def render(text: str) -> str:
    """`text` with every `<!-- settings NAME -->` block regenerated."""
    return _BLOCK.sub(lambda m: f"{m.group(1)}{TABLES[m['name']]()}\n{m.group(3)}", text)


def _default(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump()
    return "none" if value is None else f"`{json.dumps(value, default=str)}`"


def _values(field: FieldInfo) -> str:
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return ", ".join(f"`{choice}`" for choice in typing.get_args(annotation))
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = [kind for kind in typing.get_args(annotation) if kind is not type(None)] if union else [annotation]
    bounds = [f"{sign} {getattr(m, key)}" for m in field.metadata for key, sign in _BOUNDS if hasattr(m, key)]
    text = " ".join([" or ".join(map(_kind, kinds)), *bounds])
    return f"{text}, or none" if union and type(None) in typing.get_args(annotation) else text


def _kind(annotation: object) -> str:
    origin = typing.get_origin(annotation)
    if origin is list:
        return "list"
    if origin is dict or (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return "object"
    return _KINDS.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _meaning(field: FieldInfo) -> str:
    if not field.description:
        raise ValueError(f"{field} has no description: a setting says what it means where it is declared")
    return field.description.replace("|", "\\|")


def main() -> None:
    text = DOCUMENT.read_text()
    rendered = render(text)
    if "--check" in sys.argv:
        sys.exit(0 if rendered == text else f"{DOCUMENT.name} differs from the settings: run `make docs`")
    DOCUMENT.write_text(rendered)


if __name__ == "__main__":
    main()
