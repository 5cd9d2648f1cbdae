"""Hypothesis strategies for requests, drawn from the options' own declarations.

Each sampling parameter (`SamplingOptions`), compression setting (`CompressionSettings`) and policy
option (the policies' fields) declares its type and range once; these strategies read them, so a
value the declaration accepts is one some test sends, and a range widened there is fuzzed at once.
"""

from __future__ import annotations

import types
import typing

import annotated_types as at
from hypothesis import strategies as st
from pydantic.fields import FieldInfo

from confkv.compress.config import CompressionSettings, Thresholds
from confkv.compress.scoring import POLICIES, option_fields, policy_names
from confkv.server.sampling_options import SamplingOptions

# Unbounded integers are drawn below this: larger ones test nothing more and make long requests.
INT_CEILING = 4096


def for_field(field: FieldInfo) -> st.SearchStrategy:
    """Any value the field's declaration accepts (its type within its bounds); None where it is optional."""
    annotation = field.annotation
    optional = typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in typing.get_args(
        annotation
    )
    if optional:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    strategy = _for_type(annotation, field.metadata)
    return st.none() | strategy if optional else strategy


def _for_type(annotation: object, metadata: list) -> st.SearchStrategy:
    if typing.get_origin(annotation) is typing.Literal:
        return st.sampled_from(typing.get_args(annotation))
    bounds = {type(m): m for m in metadata}
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        low = bounds[at.Ge].ge if at.Ge in bounds else (bounds[at.Gt].gt + 1 if at.Gt in bounds else -INT_CEILING)
        high = bounds[at.Le].le if at.Le in bounds else (bounds[at.Lt].lt - 1 if at.Lt in bounds else INT_CEILING)
        return st.integers(low, min(high, max(low, INT_CEILING)))
    if annotation is float:
        low = bounds[at.Ge].ge if at.Ge in bounds else bounds[at.Gt].gt if at.Gt in bounds else -1e6
        high = bounds[at.Le].le if at.Le in bounds else bounds[at.Lt].lt if at.Lt in bounds else 1e6
        capped = min(high, 1e6)
        return st.floats(low, capped, exclude_min=at.Gt in bounds, exclude_max=at.Lt in bounds and capped == high)
    raise TypeError(f"no strategy for {annotation!r}: add one to tests/strategies.py")


def _optional_keys(fields: dict[str, FieldInfo], skip: set[str] = frozenset()) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional={name: for_field(f) for name, f in fields.items() if name not in skip})


def sampling_options() -> st.SearchStrategy[dict]:
    """The sampling parameters of a request, any subset, each within its range."""
    fields = SamplingOptions.model_fields
    drawn = _optional_keys(fields, skip={"compression", "compression_stats", "timeout"})
    return drawn.filter(lambda d: d.get("max_tokens") is None or d.get("min_tokens", 0) <= d["max_tokens"])


def policy_options() -> st.SearchStrategy[dict]:
    """`policy_options`: some registered policies, each with any subset of its options."""
    return st.fixed_dictionaries(
        {}, optional={name: _optional_keys(option_fields(policy)) for name, policy in POLICIES.items()}
    )


@st.composite
def thresholds(draw: st.DrawFn) -> dict:
    """high >= medium >= low, each in [0, 1] (their declared range and order)."""
    values = sorted(draw(st.lists(st.floats(0, 1), min_size=3, max_size=3)), reverse=True)
    chosen = dict(zip(Thresholds.model_fields, values, strict=True))
    return {k: v for k, v in chosen.items() if k != "low" or draw(st.booleans())}


def compression_options() -> st.SearchStrategy[dict]:
    """A request's `compression` object: any subset of what a request may choose, each within its range."""
    fields = CompressionSettings.model_fields
    simple = {"policy", "policy_options", "thresholds", "prediction_window"}
    return st.fixed_dictionaries(
        {},
        optional={
            "enabled": st.booleans(),
            "policy": st.sampled_from(policy_names()),
            "policy_options": policy_options(),
            "thresholds": thresholds(),
            **{name: for_field(f) for name, f in fields.items() if name not in simple},
        },
    )
