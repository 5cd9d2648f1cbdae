"""Per-sequence, per-layer KV buffers in tiers, with exact byte accounting against one budget.

Layout of one (sequence, layer), in key order:

    keys      [ KEY_ONLY entries ... | FULL entries ... ]   at the storage precision
    values                           [ FULL values ... ]    at the storage precision
    ko_values [ quantised values ... ]                      int4 or int8, per token and head

New tokens are appended as FULL at the end, so attention reads contiguous buffers without a
gather: the probabilities of the first `num_key_only` entries meet the dequantised KEY_ONLY values,
the rest meet the FULL values. Attention does not care about key order (RoPE is baked into the
keys); only a prefill chunk's causal mask does, and its new entries are always the last ones.
Compaction rebuilds the buffers at their new size, so dropped and demoted entries really give their
bytes back. Layers of one sequence may hold different tokens; each keeps its entries' positions.

The account counts every tensor that holds keys or values (capacity, not just the filled part),
their quantisation scales included. Positions and observed attention (8 bytes a token and layer,
not KV; with the value predictor, 2 more per kept observation, 2 for the key norm and 4 for the
latest forecast) are bookkeeping and are not counted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch

from compression.quant import SCALE_DTYPE, Quantized, bytes_per_vector, dequantize, quantize

# Buffers grow by at least this many tokens, and by an eighth of their size when large, so that
# appending one token per decode step costs amortised O(1) copies with at most ~12% slack.
GROWTH_CHUNK = 16


class KVBudgetExceeded(RuntimeError):
    """Raised when a reservation would take the store past its byte budget."""


class Codec:
    """How FULL keys and values are stored: a float dtype, or int8/int4 codes with per-(token, head)
    scale (and minimum, at 4 bits), kept in buffers parallel to the codes."""

    def __init__(self, storage: torch.dtype | str, compute_dtype: torch.dtype, head_dim: int) -> None:
        self.bits = {"int8": 8, torch.int8: 8, "int4": 4}.get(storage, 0)
        self.dtype = torch.int8 if self.bits == 8 else torch.uint8 if self.bits == 4 else storage
        self.compute_dtype = compute_dtype
        self.head_dim = head_dim

    @property
    def quantized(self) -> bool:
        return self.bits > 0

    @property
    def vector_bytes(self) -> int:
        if self.quantized:
            return bytes_per_vector(self.head_dim, self.bits)
        return self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def empty(self, heads: int, capacity: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Codes [heads, capacity, width] and, when quantised, params [heads, capacity, 1 or 2] (fp16)."""
        width = self.head_dim * self.bits // 8 if self.quantized else self.head_dim
        data = torch.empty((heads, capacity, width), dtype=self.dtype, device=device)
        params = None
        if self.quantized:
            params = torch.empty((heads, capacity, 1 if self.bits == 8 else 2), dtype=SCALE_DTYPE, device=device)
        return data, params

    def write(self, data: torch.Tensor, params: torch.Tensor | None, start: int, x: torch.Tensor) -> None:
        end = start + x.shape[1]
        if not self.quantized:
            data[:, start:end] = x
            return
        q = quantize(x, self.bits)
        data[:, start:end] = q.codes
        params[:, start:end, 0] = q.scale
        if q.minimum is not None:
            params[:, start:end, 1] = q.minimum

    def read(self, data: torch.Tensor, params: torch.Tensor | None, end: int, start: int = 0) -> torch.Tensor:
        if not self.quantized:
            view = data[:, start:end]
            return view if view.dtype == self.compute_dtype else view.to(self.compute_dtype)
        p = params[:, start:end]
        q = Quantized(data[:, start:end], p[..., 0], p[..., 1] if self.bits == 4 else None, self.bits)
        return dequantize(q, self.compute_dtype)


@dataclass
class LayerKV:
    keys: torch.Tensor
    key_params: torch.Tensor | None
    values: torch.Tensor
    value_params: torch.Tensor | None
    positions: torch.Tensor  # [capacity] token positions, in key order
    attention: torch.Tensor  # [capacity] float32 attention observed by the scoring policy
    # For the value predictor only: the latest observations (oldest first) and each key's norm.
    observed: torch.Tensor | None = None  # [history_steps, capacity] fp16
    key_norm: torch.Tensor | None = None  # [capacity] fp16, mean over heads, taken before quantisation
    forecast: torch.Tensor | None = None  # [capacity] float32 predicted future attention, NaN until predicted
    ko_values: Quantized | None = None
    length: int = 0
    num_key_only: int = 0
    compacted: bool = False  # once compression manages a layer, it grows in exact chunks

    @property
    def key_capacity(self) -> int:
        return self.keys.shape[1]

    @property
    def value_capacity(self) -> int:
        return self.values.shape[1]

    @property
    def num_full(self) -> int:
        return self.length - self.num_key_only

    @property
    def nbytes(self) -> int:
        total = self.keys.nbytes + self.values.nbytes
        for t in (self.key_params, self.value_params):
            if t is not None:
                total += t.nbytes
        return total + (self.ko_values.nbytes if self.ko_values is not None else 0)


@dataclass
class LayerView:
    """What attention needs from one layer: dense keys and the values of both tiers."""

    keys: torch.Tensor  # [kv_heads, length, head_dim], compute dtype
    values: torch.Tensor  # [kv_heads, num_full, head_dim], compute dtype
    ko_values: Quantized | None
    num_key_only: int


@dataclass
class SequenceKV:
    codec: Codec
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
        storage: torch.dtype | str | None = None,
        key_only_bits: int = 4,
        history_steps: int = 0,
    ) -> None:
        self.num_layers = num_layers
        self.history_steps = history_steps  # observations each entry keeps for the value predictor
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_bytes = max_bytes
        self.dtype = dtype  # the model's dtype: what attention computes in
        self.device = torch.device(device)
        self.codec = self.make_codec(storage)  # the default storage precision
        self.key_only_bits = key_only_bits
        self.used_bytes = 0
        self._seqs: dict[int, SequenceKV] = {}
        self._storage: dict[int, Codec] = {}  # sequences stored at another precision than the default
        self.evicted_entries: Counter[str] = Counter()  # (layer, token) entries removed, by reason
        self.parked_bytes = 0  # bytes of finished sequences kept for reuse (part of used_bytes)

    def make_codec(self, storage: torch.dtype | str | None) -> Codec:
        """A codec for `storage`: None or "auto" is the model's dtype; a float dtype name; "int8"; "int4"."""
        if storage is None or storage == "auto":
            storage = self.dtype
        elif isinstance(storage, str) and not storage.startswith("int"):
            storage = getattr(torch, storage)
        return Codec(storage, self.dtype, self.head_dim)

    def set_storage(self, seq_id: int, storage: torch.dtype | str | None) -> None:
        """Store this sequence's FULL entries at `storage` (before its first reservation)."""
        self._storage[seq_id] = self.make_codec(storage)

    def codec_of(self, seq_id: int) -> Codec:
        return self._storage.get(seq_id, self.codec)

    # ----- sizes -------------------------------------------------------------------------
    def entry_bytes(self, codec: Codec | None = None) -> tuple[int, int]:
        """Bytes of one (token, layer) entry: FULL, and KEY_ONLY (key as stored, value quantised)."""
        vector = (codec or self.codec).vector_bytes
        return 2 * self.num_kv_heads * vector, self.num_kv_heads * (
            vector + bytes_per_vector(self.head_dim, self.key_only_bits)
        )

    @property
    def token_bytes_per_layer(self) -> int:
        """Bytes of one FULL token's key and value in one layer at the default storage precision."""
        return self.entry_bytes()[0]

    @property
    def token_bytes(self) -> int:
        """Bytes of one FULL token's keys and values over all layers at the default storage precision."""
        return self.num_layers * self.token_bytes_per_layer

    @property
    def model_token_bytes(self) -> int:
        """Bytes of one token over all layers in an uncompressed cache at the model's dtype."""
        element = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * element

    def bytes_for(self, num_tokens: int, codec: Codec | None = None) -> int:
        """Bytes a new sequence of `num_tokens` FULL tokens takes, growth granularity included."""
        return self.num_layers * _round_up(num_tokens, GROWTH_CHUNK) * self.entry_bytes(codec)[0]

    @property
    def free_bytes(self) -> int:
        return self.max_bytes - self.used_bytes

    def seq_bytes(self, seq_id: int) -> int:
        seq = self._seqs.get(seq_id)
        return seq.nbytes if seq else 0

    def seq_length(self, seq_id: int, layer: int = 0) -> int:
        seq = self._seqs.get(seq_id)
        return seq.layers[layer].length if seq else 0

    def layer(self, seq_id: int, layer_idx: int) -> LayerKV:
        return self._seqs[seq_id].layers[layer_idx]

    def entry_counts(self) -> dict[str, int]:
        """(layer, token) entries held, by tier, over every sequence."""
        layers = [layer for seq in list(self._seqs.values()) for layer in seq.layers]
        key_only = sum(layer.num_key_only for layer in layers)
        return {"full": sum(layer.length for layer in layers) - key_only, "key_only": key_only}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    # ----- lifecycle ---------------------------------------------------------------------
    def reserve(self, seq_id: int, num_new: int) -> None:
        """Make room for `num_new` more FULL tokens in every layer of a sequence, or raise.

        All-or-nothing: either every layer has room afterwards or nothing changed.
        """
        created = seq_id not in self._seqs
        if created:
            codec = self.codec_of(seq_id)
            self._seqs[seq_id] = SequenceKV(codec, [self._new_layer(codec, 0, 0) for _ in range(self.num_layers)])
        seq = self._seqs[seq_id]
        vector = self.num_kv_heads * seq.codec.vector_bytes  # one key or one value, one layer
        growth = []  # (layer, exact keys, generous keys, exact values, generous values)
        for layer in seq.layers:
            k_need, v_need = layer.length + num_new, layer.num_full + num_new
            if k_need > layer.key_capacity or v_need > layer.value_capacity:
                generous = not layer.compacted
                growth.append(
                    (
                        layer,
                        *_sizes(layer.key_capacity, k_need, generous),
                        *_sizes(layer.value_capacity, v_need, generous),
                    )
                )
        needed = sum(
            ((ke - layer.key_capacity) + (ve - layer.value_capacity)) * vector for layer, ke, _, ve, _ in growth
        )
        if needed > self.free_bytes:
            if created:
                del self._seqs[seq_id]
            raise KVBudgetExceeded(
                f"sequence {seq_id} needs {needed} more KV bytes; {self.free_bytes} of {self.max_bytes} are free"
            )
        # Grow generously while the budget allows it, exactly otherwise.
        slack = self.free_bytes - needed
        for layer, k_exact, k_generous, v_exact, v_generous in growth:
            surplus = ((k_generous - k_exact) + (v_generous - v_exact)) * vector
            if surplus <= slack:
                slack -= surplus
                k_exact, v_exact = k_generous, v_generous
            self._resize(seq.codec, layer, k_exact, v_exact)

    def append(
        self, seq_id: int, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Write new FULL entries (keys/values [kv_heads, n, head_dim]) after the held ones.

        Room must have been reserved; this runs inside the forward pass and never allocates.
        """
        seq = self._seqs[seq_id]
        layer = seq.layers[layer_idx]
        n = keys.shape[1]
        start = layer.length
        seq.codec.write(layer.keys, layer.key_params, start, keys)
        seq.codec.write(layer.values, layer.value_params, layer.num_full, values)
        layer.positions[start : start + n] = positions
        layer.attention[start : start + n] = 0.0
        if layer.observed is not None:
            layer.observed[:, start : start + n] = 0.0
            layer.key_norm[start : start + n] = keys.float().norm(dim=-1).mean(dim=0)
            layer.forecast[start : start + n] = float("nan")
        layer.length += n

    def view(self, seq_id: int, layer_idx: int) -> LayerView:
        """Keys and values held by one layer of one sequence (no copy at float storage)."""
        seq = self._seqs[seq_id]
        layer = seq.layers[layer_idx]
        keys = seq.codec.read(layer.keys, layer.key_params, layer.length)
        values = seq.codec.read(layer.values, layer.value_params, layer.num_full)
        return LayerView(keys, values, layer.ko_values, layer.num_key_only)

    def positions(self, seq_id: int, layer_idx: int) -> torch.Tensor:
        layer = self._seqs[seq_id].layers[layer_idx]
        return layer.positions[: layer.length]

    def retier(self, seq_id: int, layer_idx: int, keep_full: torch.Tensor, keep_key_only: torch.Tensor) -> int:
        """Rebuild one layer holding only the given entries (indices in key order); return bytes freed.

        `keep_key_only` may name KEY_ONLY entries (kept as they are) and FULL ones (their values are
        quantised now); `keep_full` may name FULL entries only, since a quantised value cannot be
        restored. Entries named in neither are dropped.
        """
        seq = self._seqs[seq_id]
        layer = seq.layers[layer_idx]
        if bool((keep_full < layer.num_key_only).any()):
            raise ValueError("a KEY_ONLY entry cannot become FULL again")
        before = layer.nbytes
        rebuilt = self._rebuilt(seq.codec, layer, keep_full, keep_key_only)
        self._seqs[seq_id].layers[layer_idx] = rebuilt
        freed = before - rebuilt.nbytes
        self.used_bytes -= freed
        self.evicted_entries["compression"] += layer.length - rebuilt.length
        return freed

    # ----- parked caches (the prefix cache's pool) -----------------------------------------
    def park(self, seq_id: int) -> SequenceKV | None:
        """Take a finished sequence's cache out of the running pool; its bytes stay counted (parked)."""
        self._storage.pop(seq_id, None)
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.parked_bytes += seq.nbytes
        return seq

    def discard(self, parked: SequenceKV) -> int:
        """Free a parked cache; return its bytes."""
        freed = parked.nbytes
        self.used_bytes -= freed
        self.parked_bytes -= freed
        self.evicted_entries["prefix_cache"] += sum(layer.length for layer in parked.layers)
        return freed

    def adopt(self, seq_id: int, parked: SequenceKV, num_tokens: int) -> None:
        """Start sequence `seq_id` from a copy of the entries of `parked` at positions < num_tokens.

        A copy, so that the running sequence and the cache never see each other's writes. Raises
        KVBudgetExceeded (holding nothing) when the copy does not fit.
        """
        layers = []
        for layer in parked.layers:
            held = layer.positions[: layer.length] < num_tokens
            index = torch.arange(layer.length, device=self.device)
            keep_key_only = index[: layer.num_key_only][held[: layer.num_key_only]]
            keep_full = index[layer.num_key_only :][held[layer.num_key_only :]]
            layers.append(self._rebuilt(parked.codec, layer, keep_full, keep_key_only))
        adopted = SequenceKV(parked.codec, layers)
        if adopted.nbytes > self.free_bytes:
            raise KVBudgetExceeded(f"a cached prefix of {adopted.nbytes} bytes does not fit in {self.free_bytes} free")
        if parked.codec is not self.codec:
            self._storage[seq_id] = parked.codec
        self._seqs[seq_id] = adopted
        self.used_bytes += adopted.nbytes

    def free(self, seq_id: int, preempted: bool = False) -> int:
        """Drop a sequence's cache and return the bytes it held.

        A `preempted` sequence will be recomputed: its storage precision is remembered and its
        entries count as evicted.
        """
        if not preempted:
            self._storage.pop(seq_id, None)
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return 0
        if preempted:
            self.evicted_entries["preemption"] += sum(layer.length for layer in seq.layers)
        freed = seq.nbytes
        self.used_bytes -= freed
        return freed

    # ----- internals ---------------------------------------------------------------------
    def _rebuilt(self, codec: Codec, layer: LayerKV, keep_full: torch.Tensor, keep_key_only: torch.Tensor) -> LayerKV:
        """A new layer holding copies of the given entries: KEY_ONLY ones first, then FULL ones."""
        keep_key_only = keep_key_only.sort().values
        keep_full = keep_full.sort().values
        order = torch.cat((keep_key_only, keep_full))
        n, n_ko, n_full = order.numel(), keep_key_only.numel(), keep_full.numel()
        rebuilt = self._new_layer(codec, _round_up(n, GROWTH_CHUNK), _round_up(n_full, GROWTH_CHUNK))
        rebuilt.keys[:, :n] = layer.keys.index_select(1, order)
        if layer.key_params is not None:
            rebuilt.key_params[:, :n] = layer.key_params.index_select(1, order)
        rebuilt.positions[:n] = layer.positions.index_select(0, order)
        rebuilt.attention[:n] = layer.attention.index_select(0, order)
        if layer.observed is not None:
            rebuilt.observed[:, :n] = layer.observed.index_select(1, order)
            rebuilt.key_norm[:n] = layer.key_norm.index_select(0, order)
            rebuilt.forecast[:n] = layer.forecast.index_select(0, order)
        full_slots = keep_full - layer.num_key_only  # FULL entry i has its value at slot i - num_key_only
        rebuilt.values[:, :n_full] = layer.values.index_select(1, full_slots)
        if layer.value_params is not None:
            rebuilt.value_params[:, :n_full] = layer.value_params.index_select(1, full_slots)
        rebuilt.ko_values = self._key_only_values(codec, layer, keep_key_only) if n_ko else None
        rebuilt.length, rebuilt.num_key_only, rebuilt.compacted = n, n_ko, True
        return rebuilt

    def _key_only_values(self, codec: Codec, layer: LayerKV, entries: torch.Tensor) -> Quantized:
        """Quantised values of `entries` (sorted): old KEY_ONLY ones kept, FULL ones quantised now."""
        old = entries[entries < layer.num_key_only]
        new = entries[entries >= layer.num_key_only] - layer.num_key_only
        parts = []
        if old.numel():
            ko = layer.ko_values
            minimum = ko.minimum.index_select(1, old) if ko.minimum is not None else None
            parts.append(Quantized(ko.codes.index_select(1, old), ko.scale.index_select(1, old), minimum, ko.bits))
        if new.numel():
            scale = layer.value_params.index_select(1, new) if layer.value_params is not None else None
            full = codec.read(layer.values.index_select(1, new), scale, new.numel())
            parts.append(quantize(full, self.key_only_bits))
        if len(parts) == 1:
            return parts[0]
        a, b = parts
        minimum = torch.cat((a.minimum, b.minimum), 1) if a.minimum is not None else None
        return Quantized(torch.cat((a.codes, b.codes), 1), torch.cat((a.scale, b.scale), 1), minimum, a.bits)

    def _new_layer(self, codec: Codec, key_capacity: int, value_capacity: int) -> LayerKV:
        keys, key_params = codec.empty(self.num_kv_heads, key_capacity, self.device)
        values, value_params = codec.empty(self.num_kv_heads, value_capacity, self.device)
        return LayerKV(
            keys=keys,
            key_params=key_params,
            values=values,
            value_params=value_params,
            positions=torch.empty(key_capacity, dtype=torch.long, device=self.device),
            attention=torch.zeros(key_capacity, dtype=torch.float32, device=self.device),
            observed=torch.zeros(self.history_steps, key_capacity, dtype=torch.float16, device=self.device)
            if self.history_steps
            else None,
            key_norm=torch.zeros(key_capacity, dtype=torch.float16, device=self.device) if self.history_steps else None,
            forecast=torch.full((key_capacity,), float("nan"), device=self.device) if self.history_steps else None,
        )

    def _resize(self, codec: Codec, layer: LayerKV, key_capacity: int, value_capacity: int) -> None:
        grown = self._new_layer(codec, max(key_capacity, layer.key_capacity), max(value_capacity, layer.value_capacity))
        n, nf = layer.length, layer.num_full
        grown.keys[:, :n] = layer.keys[:, :n]
        grown.values[:, :nf] = layer.values[:, :nf]
        if layer.key_params is not None:
            grown.key_params[:, :n] = layer.key_params[:, :n]
            grown.value_params[:, :nf] = layer.value_params[:, :nf]
        grown.positions[:n] = layer.positions[:n]
        grown.attention[:n] = layer.attention[:n]
        if layer.observed is not None:
            grown.observed[:, :n] = layer.observed[:, :n]
            grown.key_norm[:n] = layer.key_norm[:n]
            grown.forecast[:n] = layer.forecast[:n]
        before = layer.nbytes
        layer.keys, layer.key_params = grown.keys, grown.key_params
        layer.values, layer.value_params = grown.values, grown.value_params
        layer.positions, layer.attention = grown.positions, grown.attention
        layer.observed, layer.key_norm, layer.forecast = grown.observed, grown.key_norm, grown.forecast
        self.used_bytes += layer.nbytes - before


def _sizes(capacity: int, need: int, generous: bool) -> tuple[int, int]:
    """Exact and generous new capacities for a buffer that must hold `need` entries."""
    if need <= capacity:
        return capacity, capacity
    exact = _round_up(need, GROWTH_CHUNK)
    if not generous:
        return exact, exact
    return exact, max(exact, _round_up(capacity + capacity // 8, GROWTH_CHUNK))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
