"""Decode attention over the block pool in Triton: the GPU counterpart of the C++ kernel.

Same interface and semantics as `decode_attention_reference` (see `confkv.kv.paged_attention`).
One program per (row, KV head) scores every query head of the GQA group against each key loaded
once, reading entries in place at their storage format and dequantising in registers, with an online
softmax over tiles of entries. Formats are compile-time constants, so each (key pool, value pool)
pair of a row gets its own specialisation (with the key-only pool's format): rows are launched by
that pair. `int4c` keys are read with their block's per-channel scale and minimum. The observed
probabilities are a second pass over the observed rows once their lse is known, one program per tile
of entries summing over all heads, launched by key pool (it reads no values), so no scores are kept
in between. The file is over 300 lines because it is one unit: the two kernels, the loaders and dequantisers
both inline, and the host code that groups rows by storage pair and launches them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from confkv.kv.paged_attention import (
    FORMAT_CODES,
    KEY_FORMATS,
    KEY_ONLY_FORMATS,
    DecodeBatch,
    DecodeResult,
    PoolTensors,
)

INT8, INT4, INT2, INT4C = (tl.constexpr(FORMAT_CODES[name]) for name in ("int8", "int4", "int2", "int4c"))
# Elements of the [group, entries, head_dim] products a program holds per tile: bounds registers.
TILE_ELEMENTS = 8192


@triton.jit
def _entry_rows(table, j, mask, block_size):
    """Pool rows (block * block_size + offset) of table entries j."""
    block = tl.load(table + j // block_size, mask=mask, other=0)
    return block.to(tl.int64) * block_size + j % block_size


@triton.jit
def _load_vectors(
    data,
    params,
    rows,
    mask,
    kv_head,
    row_width,
    block_size,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FORMAT: tl.constexpr,
):
    """Head vectors [entries, BLOCK_D] of pool rows `rows` as float32, dequantised (zero where masked).
    A vector is `row_width` elements of `data`; a quantised one's params follow its codes, read through
    `params`, the same memory as fp16."""
    d = tl.arange(0, BLOCK_D)
    vector = (rows * KV_HEADS + kv_head).to(tl.int64)
    mask2 = mask[:, None] & (d < HEAD_DIM)[None, :]
    if FORMAT == INT4C:
        # The block's params for the head (scales, then minimums, per channel), a share after the codes of
        # each of its rows: channel c is in the block's row c // share.
        codes = _unpack(data, vector, d, mask2, row_width, HEAD_DIM, 4)
        share = 2 * HEAD_DIM // block_size
        first = (rows // block_size) * block_size
        scale = _channel_params(params, first, d, mask2, kv_head, share, row_width, KV_HEADS, HEAD_DIM)
        minimum = _channel_params(params, first, d + HEAD_DIM, mask2, kv_head, share, row_width, KV_HEADS, HEAD_DIM)
        return tl.where(mask2, codes * scale + minimum, 0.0)
    if FORMAT == INT4:
        codes = _unpack(data, vector, d, mask2, row_width, HEAD_DIM, 4)
        return _dequantize(codes, params, vector, mask, mask2, row_width, HEAD_DIM // 2)
    if FORMAT == INT2:
        codes = _unpack(data, vector, d, mask2, row_width, HEAD_DIM, 2)
        return _dequantize(codes, params, vector, mask, mask2, row_width, HEAD_DIM // 4)
    x = tl.load(data + vector[:, None] * row_width + d[None, :], mask=mask2, other=0).to(tl.float32)
    if FORMAT == INT8:
        scale = tl.load(params + (vector * row_width + HEAD_DIM) // 2, mask=mask, other=0.0).to(tl.float32)
        x = x * scale[:, None]
    return x


@triton.jit
def _channel_params(params, first, c, mask2, kv_head, share, row_width, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """int4c: parameter c [entries, BLOCK_D] of the blocks whose first rows are `first`, as float32."""
    vector = ((first[:, None] + c[None, :] // share) * KV_HEADS + kv_head).to(tl.int64)
    return tl.load(params + (vector * row_width + HEAD_DIM // 2) // 2 + c[None, :] % share, mask=mask2, other=0.0).to(
        tl.float32
    )


@triton.jit
def _unpack(data, vector, d, mask2, row_width, HEAD_DIM: tl.constexpr, BITS: tl.constexpr):
    """Packed codes as float32: bits [k * BITS, (k + 1) * BITS) of byte i are dimension i + k * part."""
    part = HEAD_DIM * BITS // 8
    column = d % part
    byte = tl.load(data + vector[:, None] * row_width + column[None, :], mask=mask2, other=0).to(tl.int32)
    return ((byte >> ((d // part) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _dequantize(codes, params, vector, mask, mask2, row_width, codes_bytes):
    """Per-vector asymmetric codes dequantised with their vector's scale and minimum (after its codes)."""
    at = (vector * row_width + codes_bytes) // 2
    scale = tl.load(params + at, mask=mask, other=0.0).to(tl.float32)
    minimum = tl.load(params + at + 1, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask2, codes * scale[:, None] + minimum[:, None], 0.0)


@triton.jit
def _scores(
    query,
    data,
    params,
    row_width,
    key_table,
    j,
    valid,
    block_size,
    row,
    kv_head,
    scale,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FORMAT: tl.constexpr,
):
    """Scaled scores [GROUP_PAD, entries] of the group's query heads against keys j (-inf where not valid)."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    head = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(query + (row * (KV_HEADS * GROUP) + head)[:, None] * HEAD_DIM + d[None, :], mask=q_mask, other=0.0)
    rows = _entry_rows(key_table, j, valid, block_size)
    keys = _load_vectors(data, params, rows, valid, kv_head, row_width, block_size, KV_HEADS, HEAD_DIM, BLOCK_D, FORMAT)
    s = tl.sum(q[:, None, :] * keys[None, :, :], axis=2) * scale
    return tl.where(valid[None, :], s, float("-inf"))


@triton.jit
def _attend(
    query,
    out,
    lse,
    launch_rows,
    row_slot,
    num_keys,
    num_key_only,
    key_tables,
    value_tables,
    key_only_tables,
    key_stride,
    value_stride,
    key_only_stride,
    data,
    params,
    row_width,
    v_data,
    v_params,
    v_row_width,
    ko_data,
    ko_params,
    ko_row_width,
    block_size,
    scale,
    first_keys,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FORMAT: tl.constexpr,
    V_FORMAT: tl.constexpr,
    KO_FORMAT: tl.constexpr,
):
    """Output and lse of one (row, KV head) pair: an online softmax over tiles of BLOCK_N entries. Keys
    are read from the key pool (`data`, FORMAT), FULL values from the value pool (`v_data`, V_FORMAT),
    KEY_ONLY values from the key-only pool (`ko_data`, KO_FORMAT), from the slot's first attended
    entry on (`first_keys`: past a sliding-window layer's window; else 0)."""
    row = tl.load(launch_rows + tl.program_id(0)).to(tl.int64)
    kv_head = tl.program_id(1)
    slot = tl.load(row_slot + row).to(tl.int64)
    n = tl.load(num_keys + slot)
    n_key_only = tl.load(num_key_only + slot)
    first = tl.load(first_keys + slot)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    for j0 in range(first, n, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        valid = j < n
        s = _scores(
            query,
            data,
            params,
            row_width,
            key_tables + slot * key_stride,
            j,
            valid,
            block_size,
            row,
            kv_head,
            scale,
            KV_HEADS,
            GROUP,
            GROUP_PAD,
            HEAD_DIM,
            BLOCK_D,
            FORMAT,
        )
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        # KEY_ONLY entries come first in key order; their values live in the key-only pool.
        key_only = valid & (j < n_key_only)
        full = valid & (j >= n_key_only)
        ko_rows = _entry_rows(key_only_tables + slot * key_only_stride, j, key_only, block_size)
        full_rows = _entry_rows(value_tables + slot * value_stride, j - n_key_only, full, block_size)
        ko_values = _load_vectors(
            ko_data,
            ko_params,
            ko_rows,
            key_only,
            kv_head,
            ko_row_width,
            block_size,
            KV_HEADS,
            HEAD_DIM,
            BLOCK_D,
            KO_FORMAT,
        )
        full_values = _load_vectors(
            v_data,
            v_params,
            full_rows,
            full,
            kv_head,
            v_row_width,
            block_size,
            KV_HEADS,
            HEAD_DIM,
            BLOCK_D,
            V_FORMAT,
        )
        values = tl.where(key_only[:, None], ko_values, full_values)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values[None, :, :], axis=1)
        m = m_new
    # A sequence with no entries: zeros and -inf.
    held = total > 0
    acc = acc / tl.where(held, total, 1.0)[:, None]
    head = row * (KV_HEADS * GROUP) + kv_head * GROUP + g
    tl.store(out + head[:, None] * HEAD_DIM + d[None, :], acc, mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :])
    tl.store(lse + head, tl.where(held, m + tl.log(tl.where(held, total, 1.0)), float("-inf")), mask=g < GROUP)


@triton.jit
def _observe(
    query,
    lse,
    observed,
    observed_width,
    launch_rows,
    observe_index,
    row_slot,
    num_keys,
    key_tables,
    key_stride,
    data,
    params,
    row_width,
    block_size,
    scale,
    first_keys,
    KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FORMAT: tl.constexpr,
):
    """The probability entries of one tile of an observed row received, mean over every query head
    (zero before a sliding-window row's window)."""
    row = tl.load(launch_rows + tl.program_id(0)).to(tl.int64)
    slot = tl.load(row_slot + row).to(tl.int64)
    n = tl.load(num_keys + slot)
    first = tl.load(first_keys + slot)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = (j < n) & (j >= first)
    g = tl.arange(0, GROUP_PAD)
    probs = tl.zeros([BLOCK_N], tl.float32)
    for kv_head in range(KV_HEADS):
        s = _scores(
            query,
            data,
            params,
            row_width,
            key_tables + slot * key_stride,
            j,
            valid,
            block_size,
            row,
            kv_head,
            scale,
            KV_HEADS,
            GROUP,
            GROUP_PAD,
            HEAD_DIM,
            BLOCK_D,
            FORMAT,
        )
        head_lse = tl.load(lse + row * (KV_HEADS * GROUP) + kv_head * GROUP + g, mask=g < GROUP, other=0.0)
        p = tl.exp(s - head_lse[:, None])
        probs += tl.sum(tl.where((g < GROUP)[:, None], p, 0.0), axis=0)
    target = tl.load(observe_index + row).to(tl.int64)
    tl.store(observed + target * observed_width + j, probs / (KV_HEADS * GROUP), mask=valid)


def _pool_arguments(pool: PoolTensors) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """A pool as kernel arguments: its rows as the codes' dtype, the same memory as fp16 (where its
    params are read; None for float formats), and the elements of a vector's row."""
    data = pool.data.contiguous()
    if not pool.bits:
        return data, None, data.shape[-1]
    return data.view(torch.int8) if pool.bits == 8 else data, data.view(torch.float16), data.shape[-1]


def _rows_on_host(batch: DecodeBatch) -> tuple[list[int], list[int], list[int], list[int]]:
    """Each row's key pool, value pool, observe index and entries, fetched in one copy, once checked: the
    kernels do no bounds checks, so what would make them read outside their tensors raises here."""
    rows, slots, pools, bs = batch.query.shape[0], batch.num_keys.shape[0], len(batch.pools), batch.block_size
    if not 0 <= batch.key_only_pool < pools:
        raise IndexError(f"key_only_pool {batch.key_only_pool} is out of range")
    if any(t.shape != (rows,) for t in (batch.row_slot, batch.row_pool, batch.row_value_pool, batch.observe_index)):
        raise ValueError(f"row_slot, row_pool, row_value_pool and observe_index must hold one entry per row ({rows})")
    device = batch.query.device
    slot = batch.row_slot.long().clamp(0, slots - 1)
    key_pool = batch.row_pool.long().clamp(0, pools - 1)
    value_pool = batch.row_value_pool.long().clamp(0, pools - 1)
    n, n_ko = batch.num_keys[slot].long(), batch.num_key_only[slot].long()
    limit = torch.tensor([p.data.shape[0] for p in batch.pools], device=device)
    bad = (n_ko < 0) | (n_ko > n)
    for table, entries, blocks in (
        (batch.key_tables, n, limit[key_pool]),
        (batch.value_tables, n - n_ko, limit[value_pool]),
        (batch.key_only_tables, n_ko, limit[batch.key_only_pool].expand_as(n)),
    ):
        used = (entries + bs - 1) // bs
        needed = torch.arange(table.shape[1], device=device) < used[:, None]
        held = table[slot].long()
        bad |= (used > table.shape[1]) | (needed & ((held < 0) | (held >= blocks[:, None]))).any(1)
    columns = (batch.row_slot, batch.row_pool, batch.row_value_pool, batch.observe_index, n, bad)
    row_slot, row_pool, row_value_pool, observe, entries, bad_rows = torch.stack([c.long() for c in columns]).tolist()
    if any(not 0 <= s < slots for s in row_slot):
        raise IndexError("a row's slot is out of range")
    if any(not 0 <= p < pools for p in row_pool + row_value_pool):
        raise IndexError("a row's key pool or value pool is out of range")
    if any(bad_rows):
        raise IndexError("a row's entry counts or block tables do not fit its tables or pools")
    taken = [o for o in observe if o >= 0]
    if len(set(taken)) != len(taken) or any(o >= batch.num_observed for o in taken):
        raise ValueError("observe_index must name distinct rows of `observed`, below num_observed")
    return row_pool, row_value_pool, observe, entries


def _check_formats(batch: DecodeBatch, pairs: list[tuple[int, int]]) -> None:
    """Each pool holds what its format can: no keys in a KEY_ONLY-values format, no values in a keys-only one."""
    key_only = batch.pools[batch.key_only_pool].format
    if key_only in KEY_FORMATS:
        raise ValueError(f"{key_only} holds keys only, not KEY_ONLY values (key_only_pool {batch.key_only_pool})")
    for key_pool, value_pool in pairs:
        keys, values = batch.pools[key_pool].format, batch.pools[value_pool].format
        if keys in KEY_ONLY_FORMATS:
            raise ValueError(f"{keys} holds KEY_ONLY values only, not a row's keys (pool {key_pool})")
        if values in KEY_FORMATS:
            raise ValueError(f"{values} holds keys only, not a row's values (pool {value_pool})")


def decode_attention_triton(batch: DecodeBatch) -> DecodeResult:
    """Decode attention for one layer with the Triton kernels (on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    query = batch.query.float().contiguous()
    rows, heads, head_dim = query.shape
    kv_heads = batch.pools[0].data.shape[2]
    group = heads // kv_heads
    device = query.device
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    out = torch.empty(rows, heads, head_dim, dtype=torch.float32, device=device)
    lse = torch.empty(rows, heads, dtype=torch.float32, device=device)
    if rows == 0:
        return DecodeResult(out, lse, torch.zeros(batch.num_observed, 0, device=device))
    # The launches depend on the rows' pools and the observed width: one small copy to the host.
    row_pool, row_value_pool, observe, entries = _rows_on_host(batch)
    pairs = sorted(set(zip(row_pool, row_value_pool, strict=True)))
    _check_formats(batch, pairs)
    width = max((entries[r] for r in range(rows) if observe[r] >= 0), default=0)
    observed = torch.zeros(batch.num_observed, width, dtype=torch.float32, device=device)

    def index(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32).contiguous()

    row_slot, observe_index = index(batch.row_slot), index(batch.observe_index)
    num_keys, num_key_only = index(batch.num_keys), index(batch.num_key_only)
    # Each slot's first attended entry (`first_attended`), computed here once rather than per program.
    first_keys = index((batch.num_keys - batch.window).clamp_min(0) if batch.window else torch.zeros_like(num_keys))
    key_tables, value_tables = index(batch.key_tables), index(batch.value_tables)
    key_only_tables = index(batch.key_only_tables)
    ko_data, ko_params, ko_row_width = _pool_arguments(batch.pools[batch.key_only_pool])
    group_pad, block_d = triton.next_power_of_2(group), triton.next_power_of_2(head_dim)
    block_n = max(16, min(128, TILE_ELEMENTS // (group_pad * block_d)))
    shape = dict(
        KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n
    )
    for key_pool, value_pool in pairs:
        served = [r for r in range(rows) if (row_pool[r], row_value_pool[r]) == (key_pool, value_pool)]
        data, params, row_width = _pool_arguments(batch.pools[key_pool])
        v_data, v_params, v_row_width = _pool_arguments(batch.pools[value_pool])
        _attend[(len(served), kv_heads)](
            query,
            out,
            lse,
            torch.tensor(served, dtype=torch.int32, device=device),
            row_slot,
            num_keys,
            num_key_only,
            key_tables,
            value_tables,
            key_only_tables,
            key_tables.shape[1],
            value_tables.shape[1],
            key_only_tables.shape[1],
            data,
            params,
            row_width,
            v_data,
            v_params,
            v_row_width,
            ko_data,
            ko_params,
            ko_row_width,
            batch.block_size,
            batch.scale,
            first_keys,
            FORMAT=FORMAT_CODES[batch.pools[key_pool].format],
            V_FORMAT=FORMAT_CODES[batch.pools[value_pool].format],
            KO_FORMAT=FORMAT_CODES[batch.pools[batch.key_only_pool].format],
            **shape,
        )
    # The observed probabilities read keys only: one launch per key pool, after every row's lse.
    for key_pool in sorted(set(row_pool)):
        watched = [r for r in range(rows) if row_pool[r] == key_pool and observe[r] >= 0 and entries[r] > 0]
        if not watched:  # an empty row's stay zero
            continue
        data, params, row_width = _pool_arguments(batch.pools[key_pool])
        _observe[(len(watched), triton.cdiv(width, block_n))](
            query,
            lse,
            observed,
            width,
            torch.tensor(watched, dtype=torch.int32, device=device),
            observe_index,
            row_slot,
            num_keys,
            key_tables,
            key_tables.shape[1],
            data,
            params,
            row_width,
            batch.block_size,
            batch.scale,
            first_keys,
            FORMAT=FORMAT_CODES[batch.pools[key_pool].format],
            **shape,
        )
    return DecodeResult(out, lse, observed)
