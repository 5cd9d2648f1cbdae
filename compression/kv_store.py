"""Per-sequence, per-layer KV buffers with exact byte accounting against one global budget.

Each (sequence, layer) owns contiguous key and value buffers of shape [kv_heads, capacity, head_dim]
that grow in chunks and can be compacted in place, so attention reads them without a gather.
Layers of one sequence may hold different tokens once compression drops entries, which is why
every layer keeps the positions of the tokens it holds.

The account counts the bytes of every buffer allocated (capacity, not just the filled part), so
`used_bytes` is the memory really held and `max_bytes` is a hard limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Buffers grow by at least this many tokens, and by an eighth of their size when large, so that
# appending one token per decode step costs amortised O(1) copies with at most ~12% slack.
GROWTH_CHUNK = 16


class KVBudgetExceeded(RuntimeError):
    """Raised when a reservation would take the store past its byte budget."""


@dataclass
class LayerKV:
    keys: torch.Tensor  # [kv_heads, capacity, head_dim]
    values: torch.Tensor  # [kv_heads, capacity, head_dim]
    positions: torch.Tensor  # [capacity] token positions of the entries held
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass
class SequenceKV:
    layers: list[LayerKV] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


class KVStore:
    """The KV cache of every running sequence, and the byte account over all of it."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_bytes: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_bytes = max_bytes
        self.dtype = dtype
        self.device = torch.device(device)
        self.used_bytes = 0
        self._seqs: dict[int, SequenceKV] = {}

    # ----- sizes -------------------------------------------------------------------------
    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of one token's key and value in one layer at the store's dtype."""
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's keys and values over all layers."""
        return self.num_layers * self.token_bytes_per_layer

    def bytes_for(self, num_tokens: int) -> int:
        """Bytes a new sequence of `num_tokens` tokens takes, growth granularity included."""
        return self.num_layers * _round_up(num_tokens, GROWTH_CHUNK) * self.token_bytes_per_layer

    @property
    def free_bytes(self) -> int:
        return self.max_bytes - self.used_bytes

    def seq_bytes(self, seq_id: int) -> int:
        seq = self._seqs.get(seq_id)
        return seq.nbytes if seq else 0

    def seq_length(self, seq_id: int, layer: int = 0) -> int:
        seq = self._seqs.get(seq_id)
        return seq.layers[layer].length if seq else 0

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    # ----- lifecycle ---------------------------------------------------------------------
    def reserve(self, seq_id: int, num_new: int) -> None:
        """Make room for `num_new` more tokens in every layer of a sequence, or raise.

        All-or-nothing: either every layer has room afterwards or nothing changed.
        """
        created = seq_id not in self._seqs
        seq = self._seqs.setdefault(seq_id, SequenceKV(self._empty_layers()))
        per_token = self.token_bytes_per_layer
        growth = []
        for layer in seq.layers:
            need = layer.length + num_new
            if need > layer.capacity:
                exact = _round_up(need, GROWTH_CHUNK)
                generous = max(exact, _round_up(layer.capacity + layer.capacity // 8, GROWTH_CHUNK))
                growth.append((layer, exact, generous))
        needed = sum((exact - layer.capacity) * per_token for layer, exact, _ in growth)
        if needed > self.free_bytes:
            if created:
                del self._seqs[seq_id]
            raise KVBudgetExceeded(
                f"sequence {seq_id} needs {needed} more KV bytes; {self.free_bytes} of {self.max_bytes} are free"
            )
        # Grow generously while the budget allows it, exactly otherwise.
        slack = self.free_bytes - needed
        for layer, exact, generous in growth:
            surplus = (generous - exact) * per_token
            if surplus <= slack:
                slack -= surplus
                exact = generous
            self._resize(layer, exact)

    def append(
        self, seq_id: int, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Write new entries (keys/values [kv_heads, n, head_dim]) after the filled part.

        Room must have been reserved; this runs inside the forward pass and never allocates.
        """
        layer = self._seqs[seq_id].layers[layer_idx]
        n = keys.shape[1]
        end = layer.length + n
        layer.keys[:, layer.length : end] = keys
        layer.values[:, layer.length : end] = values
        layer.positions[layer.length : end] = positions
        layer.length = end

    def view(self, seq_id: int, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values held by one layer of one sequence, without a copy."""
        layer = self._seqs[seq_id].layers[layer_idx]
        return layer.keys[:, : layer.length], layer.values[:, : layer.length]

    def positions(self, seq_id: int, layer_idx: int) -> torch.Tensor:
        layer = self._seqs[seq_id].layers[layer_idx]
        return layer.positions[: layer.length]

    def compact(self, seq_id: int, layer_idx: int, keep: torch.Tensor) -> int:
        """Keep only the entries at indices `keep` (sorted) and give back the freed bytes."""
        layer = self._seqs[seq_id].layers[layer_idx]
        before = layer.nbytes
        n = int(keep.numel())
        cap = _round_up(n, GROWTH_CHUNK)
        keys = torch.empty((self.num_kv_heads, cap, self.head_dim), dtype=self.dtype, device=self.device)
        values = torch.empty_like(keys)
        pos = torch.empty(cap, dtype=torch.long, device=self.device)
        keys[:, :n] = layer.keys.index_select(1, keep)
        values[:, :n] = layer.values.index_select(1, keep)
        pos[:n] = layer.positions.index_select(0, keep)
        layer.keys, layer.values, layer.positions, layer.length = keys, values, pos, n
        freed = before - layer.nbytes
        self.used_bytes -= freed
        return freed

    def free(self, seq_id: int) -> int:
        """Drop a sequence's cache and return the bytes it held."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return 0
        freed = seq.nbytes
        self.used_bytes -= freed
        return freed

    # ----- internals ---------------------------------------------------------------------
    def _empty_layers(self) -> list[LayerKV]:
        return [self._new_layer(0) for _ in range(self.num_layers)]

    def _new_layer(self, capacity: int) -> LayerKV:
        shape = (self.num_kv_heads, capacity, self.head_dim)
        return LayerKV(
            keys=torch.empty(shape, dtype=self.dtype, device=self.device),
            values=torch.empty(shape, dtype=self.dtype, device=self.device),
            positions=torch.empty(capacity, dtype=torch.long, device=self.device),
        )

    def _resize(self, layer: LayerKV, capacity: int) -> None:
        grown = self._new_layer(capacity)
        n = layer.length
        grown.keys[:, :n] = layer.keys[:, :n]
        grown.values[:, :n] = layer.values[:, :n]
        grown.positions[:n] = layer.positions[:n]
        self.used_bytes += grown.nbytes - layer.nbytes
        layer.keys, layer.values, layer.positions = grown.keys, grown.values, grown.positions


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
