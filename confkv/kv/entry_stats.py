"""What the KV store keeps about every entry beside its key and value: its position, the attention
the scoring policy observed, the value predictor's recent observations, the key's norm and the
predictor's forecast. Rows are [layers, slots, ..., capacity], indexed like the keys table (in key
order); past a layer's entries a row is scratch, and a write resets it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from confkv.kv.kv_layout import as_tensor
from confkv.models.parallel import SINGLE, RankGroup

# What a parked cache keeps of its bookkeeping: what adoption reads. Observations and forecasts
# answered the parking request's questions; an adopter starts them afresh.
PARKED = {"positions": torch.int32, "key_norm": torch.float16}


class EntryStats:
    """The per-entry rows of every running slot (`rows`: by name)."""

    def __init__(self, num_layers: int, history_steps: int, device: torch.device, ranks: RankGroup = SINGLE) -> None:
        self.num_layers = num_layers
        self.ranks = ranks  # key norms are means over every rank's heads
        self.history_steps = history_steps  # observations each entry keeps for the value predictor
        self.device = device
        self.rows: dict[str, torch.Tensor] = {}
        self.grow(0, 64)

    @property
    def num_slots(self) -> int:
        return self.rows["positions"].shape[1]

    @property
    def capacity(self) -> int:
        return self.rows["positions"].shape[-1]

    def grow(self, slots: int, capacity: int) -> None:
        """Rows for `slots` slots of `capacity` entries, those held kept."""
        shape = (self.num_layers, slots)
        fresh = {
            "positions": torch.zeros(*shape, capacity, dtype=torch.long, device=self.device),
            "attention": torch.zeros(*shape, capacity, dtype=torch.float32, device=self.device),
        }
        if self.history_steps:
            fresh["observed"] = torch.zeros(
                *shape, self.history_steps, capacity, dtype=torch.float16, device=self.device
            )
            fresh["key_norm"] = torch.zeros(*shape, capacity, dtype=torch.float16, device=self.device)
            fresh["forecast"] = torch.full((*shape, capacity), float("nan"), device=self.device)
        for name, old in self.rows.items():
            fresh[name][:, : old.shape[1], ..., : old.shape[-1]] = old
        self.rows = fresh

    def of(self, layer: int, slot: int) -> dict[str, torch.Tensor]:
        """One layer's rows of one slot (views)."""
        return {name: t[layer, slot] for name, t in self.rows.items()}

    def written(self, token_slot: torch.Tensor, key_index: torch.Tensor, positions: torch.Tensor) -> None:
        """New entries (of slots `token_slot` at `key_index` [layers, tokens]) at these positions:
        nothing observed of them yet."""
        layers = torch.arange(self.num_layers, device=self.device)[:, None]
        where = (layers, token_slot, key_index)
        self.rows["positions"][where] = positions
        self.rows["attention"][where] = 0.0
        if self.history_steps:
            self.rows["observed"][layers, token_slot, :, key_index] = 0.0
            self.rows["forecast"][where] = float("nan")

    def note_key_norms(self, layer: int, token_slot: torch.Tensor, key_index: torch.Tensor, keys: torch.Tensor) -> None:
        """The norms of one layer's new keys [kv_heads, tokens, head_dim], mean over heads (for the predictor)."""
        if self.history_steps:
            norms = self.ranks.mean(keys.float().norm(dim=-1).mean(dim=0))
            self.rows["key_norm"][layer, token_slot, key_index] = norms.to(torch.float16)

    def observe(
        self,
        layer: int,
        slots: torch.Tensor,
        rows: torch.Tensor,
        accumulate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        interval: int = 1,
    ) -> None:
        """Fold the attention of some queries per slot (rows [slots, queries, width], zero past each
        slot's entries) into the observed attention by `accumulate`, and into the predictor's history,
        whose timeline is queries `interval` apart (a decode step brings one; the end of a prefill, its
        last queries)."""
        width = rows.shape[-1]
        attention = self.rows["attention"]
        attention[layer, slots, :width] = accumulate(attention[layer, slots, :width], rows.sum(dim=1))
        if self.history_steps:
            picked = rows.flip(1)[:, ::interval][:, : self.history_steps].flip(1)  # [slots, steps taken, width]
            history = self.rows["observed"]
            recent = history[layer, slots, :, :width]  # [slots, steps, width]
            kept = recent[:, picked.shape[1] :]
            history[layer, slots, :, :width] = torch.cat((kept, picked.to(recent.dtype)), dim=1)

    def forget_observations(self, slot: int) -> None:
        """A slot that adopted a parked cache: what earlier requests observed was their own
        questions' attention, and the new one starts afresh."""
        self.rows["attention"][:, slot] = 0.0
        if self.history_steps:
            self.rows["observed"][:, slot] = 0.0
            self.rows["forecast"][:, slot] = float("nan")

    def snapshot(self, slot: int, entries: int, own: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
        """A slot's rows as a parked cache holds them: views, or only the rows named in `own`, copied
        at their dtype up to `entries`, to outlive the slot."""
        if own is None:
            return {name: t[:, slot] for name, t in self.rows.items()}
        return {
            name: t[:, slot, ..., :entries].to(own[name], copy=True) for name, t in self.rows.items() if name in own
        }

    def copy_kept(
        self, slot: int, source: dict[str, torch.Tensor], layers: list[int], orders: list[np.ndarray]
    ) -> None:
        """The rows of `source`'s kept entries (`orders`: per layer, in their new order) into `slot`."""
        width = max(len(order) for order in orders)
        if not width:
            return
        index = np.zeros((len(layers), width), dtype=np.int64)  # past a layer's entries: scratch
        for i, order in enumerate(orders):
            index[i, : len(order)] = order
        rows, layer_index = as_tensor(index, self.device), as_tensor(np.array(layers), self.device)
        for name, t in source.items():
            held = t[layer_index]  # [layers, ..., entries]
            gather = rows.view(len(layers), *[1] * (held.dim() - 2), width).expand(*held.shape[:-1], width)
            self.rows[name][layer_index, slot, ..., :width] = held.gather(-1, gather).to(self.rows[name].dtype)
