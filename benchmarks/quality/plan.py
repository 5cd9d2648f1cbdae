"""What a quality run measures, declared in a file rather than in flags: `benchmarks/quality/runs/*.yaml`.

A run file names the task sizes, the rates, the setups measured at each rate (a setup with its own
`rates` is measured at those instead; one that compresses nothing, once) and whether kvpress's presses
run beside them. The uncompressed setup always comes first: every other is scored against it. Each key
of a setup is a field of `Setup`; a file with an unknown key or a wrong value is refused, naming it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.dataclasses import dataclass

RUNS = Path(__file__).resolve().parent / "runs"


@dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class Setup:
    """One measured setup; a run file's setup entry holds these fields (less `rate` and `source`)."""

    label: str
    storage: str = "int8"  # kv_cache_dtype
    policy: str = "dynamic"
    rate: float = 0.0
    value_predictor: bool = True  # dynamic: rank by the predictor (when one is loaded)
    source: str = "ours"  # or "kvpress"
    doubt_weight: float | None = None  # dynamic: its own default, or this weight on the tokens' sampling doubt
    thresholds: tuple[float, float] | None = None  # (high, medium): the config's, or these
    thresholds_decide: bool | None = None  # dynamic: its own default, or this
    layer_budget: str | None = None  # the config's (uniform), or this sharing of bytes among layers
    kivi_bits: int | None = None  # KIVI as published at this width (benchmarks/kivi.py), not our engine
    key_only_bits: int = 4  # the server's key_only_value_bits: what KEY_ONLY values are stored at
    key_rotation: bool = True  # the server's: quantised keys stored rotated (False: per token as they are)
    pooling: tuple[str, int] | None = None  # dynamic: its own pooling over neighbours, or (this kind, over this many)
    lookahead: int = 0  # the server's lookahead_tokens: greedy tokens observed before the first compression
    retention_unit: str | None = None  # what is kept or dropped together: the server's own, or token, chunk...
    compression_interval: int | None = None  # decode steps between compressions: the config's, or this

    @property
    def compresses(self) -> bool:
        return self.policy != "none"


UNCOMPRESSED = Setup("uncompressed", "auto", "none")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TaskSizes(_Strict):
    needles: int = Field(9, ge=0, description="needle cases, split evenly over the lengths")
    needles_from: int = Field(0, ge=0, description="the needle cases from this index on (held out from tuning)")
    needle_lengths: list[int] = Field([1000, 2000, 3000], min_length=1, description="tokens of text")
    summaries: int = Field(4, ge=0)
    answer_tokens: int | None = Field(None, gt=0, description="summaries of exactly this many tokens, EOS ignored")
    perplexity_tokens: int = Field(2048, ge=0, description="0: no perplexity task")
    forced: bool = Field(True, description="teacher-forced fidelity against the uncompressed answers")


class SetupEntry(_Strict):
    """A setup as a run file writes it: flat, at the file's rates or at `rates` of its own."""

    setup: Setup
    rates: list[float] | None = Field(None, description="the file's rates unless given")

    @model_validator(mode="before")
    @classmethod
    def _flat(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "setup" in data:
            return data
        fixed = sorted({"rate", "source"} & data.keys())
        if fixed:
            raise ValueError(f"{', '.join(fixed)}: set by the run (a setup's own rates are `rates`)")
        return {"setup": {k: v for k, v in data.items() if k != "rates"}, "rates": data.get("rates")}

    def at(self, rate: float) -> Setup:
        return replace(self.setup, rate=rate)

    @property
    def compresses(self) -> bool:
        return self.setup.compresses


class Peers(_Strict):
    presses: list[str] | None = Field(None, description="kvpress's presses (default: all the runner knows)")
    after: bool = Field(False, description="after our setups with every thread, not alongside with half")


class RunFile(_Strict):
    tasks: TaskSizes = TaskSizes()
    rates: list[float] = Field([0.4, 0.6, 0.75, 0.9], min_length=1)
    setups: list[SetupEntry] = []
    peers: Peers | None = None

    @classmethod
    def load(cls, path: Path) -> RunFile:
        return cls.model_validate(yaml.safe_load(path.read_text()) or {})

    def plan(self) -> list[Setup]:
        """Uncompressed first, then what compresses nothing (once), then each rate's setups in turn,
        then the setups with rates of their own."""
        plan = [UNCOMPRESSED, *(entry.at(0.0) for entry in self.setups if not entry.compresses)]
        compressing = [entry for entry in self.setups if entry.compresses]
        plan += [entry.at(rate) for rate in self.rates for entry in compressing if entry.rates is None]
        plan += [entry.at(rate) for entry in compressing if entry.rates is not None for rate in entry.rates]
        return plan
