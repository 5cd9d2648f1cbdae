"""Decode attention over the block pool: the kernel interface, its PyTorch reference, and dispatch.

One call per layer serves every decoding sequence of the step: one query row per sequence, reading
that sequence's keys and values through its block tables, in place, at their storage format (float
or int8/int4 codes with their scales). This interface is what a kernel takes, on any device:

- `pools[i]` holds blocks of one storage format, `data [num_blocks, block_size, kv_heads, row]`: a
  float format's vectors as they are (row = head_dim), a quantised one's as bytes, each vector's
  codes followed by its fp16 params (scale, and minimum at 4 and 2 bits; see `confkv.kv.quant`).
  Entry j of a table lives at block `table[j // block_size]`, offset `j % block_size`. The one
  exception is `int4c` (keys only, int4 per channel, KIVI's): its params are the block's, `[kv_heads,
  2, head_dim]` (scale, then minimum, per channel), spread in order over the tails of the block's
  rows (2 x head_dim / block_size each), so an entry is `code * scale[c] + minimum[c]` of its
  block's head.
- Per sequence slot, in key order: keys (KEY_ONLY entries first, then FULL), through `key_tables`
  in `pools[row_pool]`; FULL entry j >= num_key_only has its value at j - num_key_only through
  `value_tables` in `pools[row_value_pool]` (the same pool but for `int4c` keys, whose values are
  per token); KEY_ONLY entry j has its value at j through `key_only_tables`, in
  `pools[key_only_pool]`.
- GQA: query head h reads KV head h // (heads // kv_heads).
- Outputs: the attention output, the log-sum-exp of each row's scaled scores (what audits of
  dropped keys combine with), and for rows with `observe_index >= 0` the probability each entry
  received, mean over heads (what the scoring policies observe).

The C++ kernel (`confkv/kv/csrc/paged_attention.cpp`, built by `python -m confkv.kv.kernels`
or at first use) runs it on CPU with an online softmax over blocks, in parallel over rows and KV
heads. On CUDA, when triton imports, the Triton kernel (`confkv.kv.triton_attention`) runs it: one
program per (row, KV head), each pair of pool formats compiled on its own, the observed
probabilities in a second pass. Without a compiler on CPU, on another device, or with
`CONFKV_DISABLE_KERNEL=1`, the reference below runs instead.

The kernels take the pools' tensors as they are (contiguous; `kernel_arguments` copies any that are
not, which for a whole pool is costly) and raise on a table naming a block outside its pool, a slot
or pool index out of range, or two rows with the same `observe_index` (the Triton kernel checks on
the device and reads the verdict with the rows' pools, in the one copy to the host it needs). A
sequence with no entries gets zeros for its output and -inf for its lse.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from confkv.kv.quant import SCALE_DTYPE, Quantized, dequantize, dequantize_channels

log = logging.getLogger(__name__)

KERNEL_EVENT = "conf_kv::decode_attention"  # the kernel's name in torch profiler traces
# Storage formats as the kernel knows them.
FORMAT_CODES: dict[str, int] = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "int4": 4, "int2": 5, "int4c": 6}
KEY_ONLY_FORMATS = ("int2",)  # formats that hold KEY_ONLY values only, never a sequence's keys
KEY_FORMATS = ("int4c",)  # formats that hold keys only, never values


@dataclass
class PoolTensors:
    """The blocks of one storage format (see the module docstring for the layout)."""

    data: torch.Tensor
    format: str  # a key of FORMAT_CODES
    head_dim: int

    @property
    def bits(self) -> int:
        return int(self.format.removeprefix("int").removesuffix("c")) if self.format.startswith("int") else 0

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Entries `rows` (block * block_size + offset) as [kv_heads, n, head_dim] in `dtype`."""
        stored = self.data.flatten(0, 1).index_select(0, rows).transpose(0, 1)  # [kv_heads, n, row]
        if not self.bits:
            return stored.to(dtype)
        width = self.head_dim * self.bits // 8
        codes = stored[..., :width].view(torch.int8) if self.bits == 8 else stored[..., :width]
        if self.format == "int4c":
            bs = self.data.shape[1]
            tails = self.data[..., width:].index_select(0, rows // bs)  # [n, bs, kv_heads, tail]: the blocks' rows
            blocks = tails.transpose(1, 2).contiguous().view(SCALE_DTYPE)  # [n, kv_heads, bs, 2 * D / bs]
            channels = blocks.view(*blocks.shape[:2], 2, self.head_dim)  # sized, so that no rows read as none
            return dequantize_channels(codes, channels.transpose(0, 1), dtype)
        p = stored[..., width:].contiguous().view(SCALE_DTYPE)
        return dequantize(Quantized(codes, p[..., 0], p[..., 1] if self.bits < 8 else None, self.bits), dtype)


@dataclass
class DecodeBatch:
    """What decode attention reads for one layer: one query row per decoding sequence."""

    query: torch.Tensor  # [rows, heads, head_dim] float32
    pools: list[PoolTensors]
    row_slot: torch.Tensor  # [rows] int32: the row's sequence slot (a row of the tables)
    row_pool: torch.Tensor  # [rows] int32: index in `pools` of the row's keys
    row_value_pool: torch.Tensor  # [rows] int32: index in `pools` of the row's FULL values
    key_only_pool: int  # index in `pools` of KEY_ONLY values
    key_tables: torch.Tensor  # [slots, max_blocks] int32
    value_tables: torch.Tensor  # [slots, max_blocks] int32
    key_only_tables: torch.Tensor  # [slots, max_blocks] int32
    num_keys: torch.Tensor  # [slots] int32: entries held, the new token's included
    num_key_only: torch.Tensor  # [slots] int32
    block_size: int
    scale: float
    observe_index: torch.Tensor  # [rows] int32: the row of `DecodeResult.observed` it fills, or -1
    num_observed: int
    # A sliding-window layer's window: a row attends to its last `window` entries (0: to all). Such a
    # layer holds its entries in position order, none dropped between, so its last ones are its newest.
    window: int = 0


def first_attended(num_keys: int, window: int) -> int:
    """The first entry (in key order) a row holding `num_keys` attends to under `window`."""
    return max(0, num_keys - window) if window else 0


@dataclass
class DecodeResult:
    out: torch.Tensor  # [rows, heads, head_dim] float32
    lse: torch.Tensor  # [rows, heads] float32: log of the sum over held entries of exp(scaled score)
    observed: torch.Tensor  # [num_observed, max entries held by an observed row] float32, zero-padded


def entry_rows(table: torch.Tensor, n: int, block_size: int) -> torch.Tensor:
    """Pool rows (block * block_size + offset) of a table's first n entries."""
    j = torch.arange(n, device=table.device)
    return table[j // block_size].long() * block_size + j % block_size


def gather_layer(batch: DecodeBatch, row: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [kv_heads, n, head_dim] of one row's sequence, in key order, dequantised."""
    slot = int(batch.row_slot[row])
    key_pool, value_pool = batch.pools[int(batch.row_pool[row])], batch.pools[int(batch.row_value_pool[row])]
    n, n_ko, bs = int(batch.num_keys[slot]), int(batch.num_key_only[slot]), batch.block_size
    keys = key_pool.read(entry_rows(batch.key_tables[slot], n, bs), dtype)
    values = value_pool.read(entry_rows(batch.value_tables[slot], n - n_ko, bs), dtype)
    if n_ko:
        ko = batch.pools[batch.key_only_pool].read(entry_rows(batch.key_only_tables[slot], n_ko, bs), dtype)
        values = torch.cat((ko, values), dim=1)
    return keys, values


def decode_attention_reference(batch: DecodeBatch) -> DecodeResult:
    """The oracle: gather and dequantise each row's entries, then plain attention."""
    rows, heads, d = batch.query.shape
    out = torch.empty(rows, heads, d, dtype=torch.float32, device=batch.query.device)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=batch.query.device)
    observed_rows = (batch.observe_index >= 0).nonzero().flatten().tolist()
    width = max((int(batch.num_keys[int(batch.row_slot[r])]) for r in observed_rows), default=0)
    observed = torch.zeros(batch.num_observed, width, dtype=torch.float32, device=batch.query.device)
    for r in range(rows):
        keys, values = gather_layer(batch, r, torch.float32)
        first = first_attended(keys.shape[1], batch.window)
        keys, values = keys[:, first:], values[:, first:]
        kv_heads = keys.shape[0]
        q = batch.query[r].float().view(kv_heads, heads // kv_heads, d)
        scores = torch.matmul(q, keys.transpose(1, 2)) * batch.scale  # [kv_heads, group, n]
        probs = scores.softmax(dim=-1)
        out[r] = torch.matmul(probs, values).reshape(heads, d)
        lse[r] = scores.logsumexp(dim=-1).reshape(heads)
        if int(batch.observe_index[r]) >= 0:
            observed[int(batch.observe_index[r]), first : first + keys.shape[1]] = probs.mean(dim=(0, 1))
    return DecodeResult(out, lse, observed)


def kernel_arguments(batch: DecodeBatch) -> tuple:
    """`batch` as the C++ kernel's positional arguments: contiguous tensors, int32 indices, format codes."""

    def index(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32).contiguous()

    return (
        batch.query.float().contiguous(),
        [pool.data.contiguous() for pool in batch.pools],
        [FORMAT_CODES[pool.format] for pool in batch.pools],
        index(batch.row_slot),
        index(batch.row_pool),
        index(batch.row_value_pool),
        int(batch.key_only_pool),
        index(batch.key_tables),
        index(batch.value_tables),
        index(batch.key_only_tables),
        index(batch.num_keys),
        index(batch.num_key_only),
        int(batch.block_size),
        float(batch.scale),
        index(batch.observe_index),
        int(batch.num_observed),
        int(batch.window),
    )


def decode_attention(batch: DecodeBatch) -> DecodeResult:
    """Decode attention for one layer: the Triton kernel on CUDA, the C++ kernel on CPU when it is built,
    else the reference."""
    # Imported here: `import confkv` reaches this module, and `python -m confkv.kv.kernels` must
    # not find its own module already imported.
    from confkv.kv.kernels import load_kernel, triton_enabled

    if triton_enabled(batch.query.device):
        from confkv.kv.triton_attention import decode_attention_triton

        with torch.profiler.record_function(KERNEL_EVENT):
            return decode_attention_triton(batch)
    kernel = load_kernel() if batch.query.device.type == "cpu" else None
    if kernel is None:
        return decode_attention_reference(batch)
    # Named for profilers: the extension is called directly, not dispatched as a torch operator.
    with torch.profiler.record_function(KERNEL_EVENT):
        return DecodeResult(*kernel.decode_attention(*kernel_arguments(batch)))
