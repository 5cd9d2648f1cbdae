"""Scoring policies: each says how much every cached entry of one layer is worth keeping.

In the manner of kvpress, a policy is a small dataclass with one `score()` method (higher means
keep) and, where it uses observed attention, an `accumulate()` rule for new observations. Its
parameters are its fields; what the engine must do for it (observe attention, read keys, run the
value predictor, allow KEY_ONLY) are class properties. The engine does the rest: observing
attention, turning scores into tiers under the budget, compacting.

A subclass that sets `name` is registered: that name is what requests and config files accept
(`policy`), and its fields are the options they may set (`policy_options: {name: {...}}`). An
option is declared once, as its field: its type with its range and meaning (`Option`), from which
the request schema, the config file's validation, the docs' table and the fuzzer's requests all
come, so that no value a request may send fails later, inside a compression.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, fields
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, create_model
from pydantic.fields import FieldInfo

if TYPE_CHECKING:
    from confkv.compress.predictor.calibration import Calibration


@dataclass
class LayerEntries:
    """What a policy may look at for the entries one layer of one sequence holds; for a policy that
    `scores_layers`, several layers at once: a row [layers, n] each, padded past its entries (`held`)."""

    keys: torch.Tensor | None  # [kv_heads, n, head_dim], for policies that use keys
    positions: torch.Tensor  # [n]
    attention: torch.Tensor  # [n] observed attention, accumulated by the policy's rule
    token_confidence: torch.Tensor  # [n] top-token probability when the entry's token was sampled (1 for prompt)
    position: int  # position of the newest token
    layer: int | torch.Tensor  # the layer, or [layers] those of the rows
    seed: int = 0
    predicted: torch.Tensor | None = None  # [n] the value predictor's future attention, when it ran
    calibration: Calibration | None = None  # relative value -> P(needed), for the value below, when fitted
    held: torch.Tensor | None = None  # [layers, n] the entries a padded row holds (its first); None: all

    def text_order(self) -> torch.Tensor:
        """[..., n] the entries in position order, row by row (a padded row's tail last): what pooling
        over neighbours runs in."""
        positions = self.positions
        if self.held is not None:
            positions = positions.masked_fill(~self.held, torch.iinfo(positions.dtype).max)
        return torch.argsort(positions, dim=-1)

    def row(self, i: int, keys: torch.Tensor | None = None) -> LayerEntries:
        """One layer of several (row `i`, its held entries), as a policy that scores one layer sees it."""
        n = int(self.held[i].sum())
        predicted = self.predicted[i, :n] if self.predicted is not None else None
        return LayerEntries(
            keys,
            self.positions[i, :n],
            self.attention[i, :n],
            self.token_confidence[i, :n],
            self.position,
            int(self.layer[i]),
            self.seed,
            predicted,
            self.calibration,
        )

    @property
    def value(self) -> torch.Tensor:
        """What an entry is expected to be worth: the predictor's forecast when it ran, else the observed attention."""
        return self.attention if self.predicted is None else self.predicted


# Widest pooling a policy may ask for: a sentence or two either side; wider costs time for nothing.
MAX_KERNEL = 1025


def Option(description: str, **bounds: float) -> FieldInfo:  # noqa: N802 (read as a type's metadata)
    """A policy option's range and meaning, as `Annotated` metadata on its field (a number with
    bounds is finite)."""
    return Field(description=description, **bounds, **({"allow_inf_nan": False} if bounds else {}))


Kernel = Annotated[int, Option("neighbouring positions pooled, centred on the entry", ge=1, le=MAX_KERNEL)]

POLICIES: dict[str, type[ScorePolicy]] = {}  # name -> policy class, filled as subclasses are defined
NO_COMPRESSION = "none"  # the policy name that turns compression off for a request


@dataclass
class ScorePolicy:
    """Base: eviction only (an entry is kept FULL or dropped), attention summed over observations."""

    name: ClassVar[str]
    uses_tiers: ClassVar[bool] = False  # may the policy keep entries as KEY_ONLY?
    uses_attention: ClassVar[bool] = True  # does it need attention observations?
    uses_keys: ClassVar[bool] = False  # does it read the keys (dequantised at quantised storage)?
    uses_predictor: ClassVar[bool] = False  # does it score by the value predictor's forecast, when one is loaded?
    thresholds_decide: ClassVar[bool] = False  # does it give a retention confidence (`retention`)?
    # Do score() and retention() take several layers at once (`LayerEntries.held`, no keys)? One call
    # for every layer saves the per-layer calls, which cost most of a judgment; a policy that
    # does not is given one layer at a time.
    scores_layers: ClassVar[bool] = False
    observation_window: ClassVar[int | None] = None  # prompt queries observed at the end of prefill (None: config)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            POLICIES[cls.name] = cls

    def accumulate(self, previous: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return previous + observed

    def score(self, entries: LayerEntries) -> torch.Tensor:
        raise NotImplementedError

    def retention(self, entries: LayerEntries) -> torch.Tensor | None:
        """Each entry's retention confidence, a probability in [0, 1] that the thresholds turn into
        tiers (with `compression_rate` as a ceiling); None: the policy only ranks, and the rate decides."""
        return None

    def target_rate(self, rate: float, recent_confidence: list[float]) -> float:
        """The rate to compress at now, given the request's and the model's recent top-token probabilities."""
        return rate


@dataclass
class StreamingLLM(ScorePolicy):
    """Keep the attention sinks (protected anyway) and the most recent tokens."""

    name = "streaming_llm"
    uses_attention = False
    scores_layers = True

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return entries.positions.float()


@dataclass
class H2O(ScorePolicy):
    """Heavy hitters: attention accumulated over every observation."""

    name = "h2o"
    scores_layers = True

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return entries.attention


@dataclass
class TOVA(ScorePolicy):
    """Attention of the latest observed query only."""

    name = "tova"
    observation_window = 1
    scores_layers = True

    def accumulate(self, previous: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return observed

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return entries.attention


@dataclass
class SnapKV(ScorePolicy):
    """Attention of the latest observation window, pooled over neighbouring positions."""

    name = "snapkv"
    scores_layers = True
    kernel_size: Kernel = 5

    def accumulate(self, previous: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return observed

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return _pool(entries.attention, entries, self.kernel_size, "avg")


@dataclass
class KNorm(ScorePolicy):
    """Keys with a small norm draw more attention (kvpress' Knorm)."""

    name = "knorm"
    uses_attention = False
    uses_keys = True

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return -entries.keys.float().norm(dim=-1).mean(dim=0)


@dataclass
class Random(ScorePolicy):
    name = "random"
    uses_attention = False

    def score(self, entries: LayerEntries) -> torch.Tensor:
        generator = torch.Generator().manual_seed(entries.seed * 1_000_003 + entries.layer * 7919 + entries.position)
        return torch.rand(entries.positions.numel(), generator=generator).to(entries.positions.device)


@dataclass
class Dynamic(ScorePolicy):
    """Future value, averaged over neighbours, raised for tokens sampled in doubt; its thresholds decide.

    The future value is the attention the value predictor expects over the coming window when it
    ran, else the decayed observed attention: old observations fade (`decay` per observation), so
    entries that mattered once but no longer do can leave. Averaging over 7 neighbours ranks runs
    of attended tokens (a fact spans a sentence) above an isolated peak and its neighbours: at 4-7k
    tokens it keeps the needles that the maximum over 3 (the earlier default) lost, and at 1-2k it
    is closer to the full cache at the same bytes (docs/design.md). Tokens the model sampled with
    low confidence mark points where the text could have gone another way; they get up to
    `doubt_weight` more.
    Its retention confidence is the calibrated probability that an entry or an adjacent token is
    needed (`confkv.compress.predictor.calibration`). With `thresholds_decide` the thresholds set how
    many bytes the request holds, under the rate's ceiling, judged every `prediction_refresh`
    compressions, and its layers spend them as a rate does; without a fitted calibration the rate
    alone decides.
    """

    name = "dynamic"
    uses_tiers = True
    uses_predictor = True
    scores_layers = True
    thresholds_decide: Annotated[
        bool, Option("its retention confidence and the thresholds decide the bytes held; false: the rate alone")
    ] = True
    decay: Annotated[float, Option("observed attention kept per observation (older observations fade)", gt=0, le=1)] = (
        0.95
    )
    kernel_size: Kernel = 7
    pooling: Annotated[Literal["avg", "max"], Option("how a score is pooled over `kernel_size` neighbours")] = "avg"
    retention_kernel: Annotated[
        int, Option("the thresholds judge an entry by the likeliest of this many around it", ge=1, le=MAX_KERNEL)
    ] = 3
    doubt_weight: Annotated[
        float, Option("raise of a token sampled in doubt (top-token probability 0); below 0 a lowering", ge=-1, le=100)
    ] = 0.5
    confident_extra_rate: Annotated[
        float, Option("share of the bytes the rate leaves also removed while the model is confident", ge=0, le=1)
    ] = 0.1

    def accumulate(self, previous: torch.Tensor, observed: torch.Tensor) -> torch.Tensor:
        return self.decay * previous + observed

    def doubt(self, token_confidence: torch.Tensor) -> torch.Tensor:
        """How much a token's value is raised: 1 for a sure token, up to 1 + doubt_weight."""
        return 1.0 + self.doubt_weight * (1.0 - token_confidence)

    def score(self, entries: LayerEntries) -> torch.Tensor:
        return self._pooled(entries, self.kernel_size, self.pooling)

    def retention(self, entries: LayerEntries) -> torch.Tensor | None:
        """P(needed) of the entry's or an adjacent token's value (the maximum over `retention_kernel`),
        over the average held entry's. Judged apart from the ranking's pooling: the thresholds size the
        request, the ranking chooses what fills it, and averaging (which ranks runs of attended tokens
        higher) would lower an isolated peak's confidence and give up bytes."""
        calibration = entries.calibration
        if not self.thresholds_decide or calibration is None:
            return None
        average = calibration.average(entries.value, entries.held)
        if (average <= 0.0).any():
            return None  # nothing observed yet: the rate decides
        return calibration(self._pooled(entries, self.retention_kernel, "max") / average)

    def _pooled(self, entries: LayerEntries, kernel: int, kind: Literal["avg", "max"]) -> torch.Tensor:
        return _pool(entries.value, entries, kernel, kind) * self.doubt(entries.token_confidence)

    def target_rate(self, rate: float, recent_confidence: list[float]) -> float:
        """Confident (mean top-token probability above 0.5), remove up to `confident_extra_rate` of
        what the rate leaves; unsure, keep all the rate allows."""
        if not recent_confidence:
            return rate
        confident = min(1.0, max(0.0, (sum(recent_confidence) / len(recent_confidence) - 0.5) / 0.5))
        return rate + self.confident_extra_rate * (1.0 - rate) * confident


def _pool(x: torch.Tensor, entries: LayerEntries, kernel: int, kind: Literal["avg", "max"]) -> torch.Tensor:
    """`x` [..., n] pooled over each entry's `kernel` nearest held neighbours in the text, row by row
    (`entries.held`: the entries of padded rows). Entries are stored in key order (KEY_ONLY first
    after a compression), so the pool runs in position order; a row shorter than the kernel is not pooled."""
    n, held = x.shape[-1], entries.held
    if n < kernel:
        return x
    if held is not None:  # what lies past a row's entries is what lies past its end: nothing
        x = x.masked_fill(~held, 0.0 if kind == "avg" else float("-inf"))
    order = entries.text_order()
    pool = F.max_pool1d if kind == "max" else F.avg_pool1d
    pooled = pool(x.gather(-1, order).reshape(-1, 1, n), kernel, stride=1, padding=kernel // 2)
    pooled = torch.empty_like(x).scatter_(-1, order, pooled[..., :n].reshape(x.shape))
    if held is not None:
        pooled = torch.where(held.sum(-1, keepdim=True) < kernel, x, pooled)
    return pooled


def make_policy(name: str, options: dict[str, Any] | None = None) -> ScorePolicy:
    """The registered policy `name` with `options` over its defaults; unknown names or options, and
    values outside an option's declared range, raise (a `ValueError`; pydantic's, naming the option,
    for a value)."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}: use one of {', '.join(policy_names())}")
    known = list(option_fields(POLICIES[name]))
    unknown = sorted(set(options or {}) - set(known))
    if unknown:
        takes = ", ".join(known) if known else "none"
        raise ValueError(f"policy {name!r} has no option {', '.join(map(repr, unknown))} (its options: {takes})")
    return _adapter(POLICIES[name]).validate_python(options or {})  # checks the options' types and ranges


def option_fields(policy: type[ScorePolicy]) -> dict[str, FieldInfo]:
    """A policy's options as pydantic fields: type, range, default and meaning, as declared."""
    hints = typing.get_type_hints(policy, include_extras=True)
    return {
        f.name: FieldInfo.from_annotated_attribute(hints[f.name], f.default if f.default is not MISSING else ...)
        for f in fields(policy)
    }


@cache
def options_model(policy: type[ScorePolicy]) -> type[BaseModel]:
    """What `policy_options.{name}` accepts, as a model: every option optional (left out, not null),
    none other (the request schema's part for this policy)."""
    optional = {}
    for name, field in option_fields(policy).items():
        optional[name] = (field.annotation, FieldInfo.merge_field_infos(field, default=None))
    config = ConfigDict(extra="forbid", allow_inf_nan=False)
    return create_model(f"{policy.__name__}Options", __config__=config, **optional)


@cache
def _adapter(policy: type[ScorePolicy]) -> TypeAdapter:
    return TypeAdapter(policy)


def policy_names() -> tuple[str, ...]:
    """What `policy` accepts: `none` (no compression) and every registered policy."""
    return (NO_COMPRESSION, *POLICIES)
