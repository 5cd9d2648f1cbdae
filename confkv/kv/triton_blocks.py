"""Block-pool writes and row copies in Triton: what `BlockPool` runs on CUDA.

An append writes each new entry (all its KV heads) in one program that casts or quantises it and
stores it at its pool row, instead of the separate quantisation, packing and scatter operators of the
torch path. The result is the torch path's bit for bit (`confkv.kv.quant.quantize`, `Tensor.to`):
divisions are IEEE (`tl.div_rn`, not the fast default), rounding is half to even, and a code that
torch computes as NaN (a constant int4 vector, whose scale rounds to zero) is stored as 0, as torch
stores it on CPU. bfloat16 is rounded with integer operations, as torch does: Triton's interpreter
truncates a float32 -> bfloat16 cast, and this way the code the tests run is the code a GPU runs.
Compaction moves rows as stored, as words, with `copy_rows`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from confkv.kv.paged_attention import FORMAT_CODES

BF16, INT8, INT4 = (tl.constexpr(FORMAT_CODES[name]) for name in ("bfloat16", "int8", "int4"))
# 1.5 * 2^23: (x + ROUNDER) - ROUNDER rounds |x| < 2^22 to an integer, ties to even.
ROUNDER = tl.constexpr(12582912.0)
COPY_WORDS = 1024  # at most this many words of a row per step of a copy


@triton.jit
def _round_codes(q, low: tl.constexpr, high: tl.constexpr):
    """torch.round(q).clamp(low, high) for float32 q, with NaN (0 / 0) as 0, as an integer-valued float."""
    # Clamping to integer bounds commutes with rounding; it also brings q within the rounder's range.
    q = tl.minimum(tl.maximum(tl.where(q == q, q, 0.0), low), high)
    return (q + ROUNDER) - ROUNDER


@triton.jit
def _to_bfloat16_bits(x):
    """float32 x as bfloat16 bits, rounded to nearest even (NaN as the quiet NaN), like torch."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x == x, rounded, 0x7FC0).to(tl.uint16)


@triton.jit
def _encode(
    x,
    rows,
    data,
    params,
    row_width,
    stride_n,
    stride_h,
    stride_d,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FORMAT: tl.constexpr,
):
    """Entry i of x [n, kv_heads, head_dim], every head, cast or quantised into pool row rows[i]: a
    vector's row is `row_width` elements of `data`, a quantised one's params after its codes, written
    through `params`, the same memory as fp16."""
    i = tl.program_id(0)
    row = tl.load(rows + i).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    source = x + i.to(tl.int64) * stride_n + h[:, None] * stride_h
    vector = row * KV_HEADS + h
    if FORMAT == INT4:
        # Low nibbles hold the first half of the dimensions, high nibbles the second.
        d = tl.arange(0, BLOCK_D // 2)
        mask = (h < KV_HEADS)[:, None] & (d < HEAD_DIM // 2)[None, :]
        first = tl.load(source + d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(source + (d + HEAD_DIM // 2)[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        lo = (
            tl.minimum(
                tl.min(tl.where(mask, first, float("inf")), axis=1),
                tl.min(tl.where(mask, second, float("inf")), axis=1),
            )
            + 0.0  # -0.0 as 0.0, as `quantize` stores it
        )
        hi = tl.maximum(
            tl.max(tl.where(mask, first, float("-inf")), axis=1), tl.max(tl.where(mask, second, float("-inf")), axis=1)
        )
        # The stored (fp16) scale and minimum are what the codes are computed with.
        scale = tl.maximum(tl.div_rn(hi - lo, 15.0), 1e-8).to(tl.float16)
        minimum = lo.to(tl.float16)
        scale_f, minimum_f = scale.to(tl.float32)[:, None], minimum.to(tl.float32)[:, None]
        low = _round_codes(tl.div_rn(first - minimum_f, scale_f), 0, 15).to(tl.uint8)
        high = _round_codes(tl.div_rn(second - minimum_f, scale_f), 0, 15).to(tl.uint8)
        tl.store(data + vector[:, None] * row_width + d[None, :], low | (high << 4), mask=mask)
        at = (vector * row_width + HEAD_DIM // 2) // 2
        tl.store(params + at, scale, mask=h < KV_HEADS)
        tl.store(params + at + 1, minimum, mask=h < KV_HEADS)
    else:
        d = tl.arange(0, BLOCK_D)
        mask = (h < KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
        v = tl.load(source + d[None, :] * stride_d, mask=mask, other=0.0).to(tl.float32)
        target = data + vector[:, None] * row_width + d[None, :]
        if FORMAT == INT8:
            scale = tl.div_rn(tl.maximum(tl.max(tl.abs(v), axis=1), 1e-8), 127.0)
            codes = _round_codes(tl.div_rn(v, scale[:, None]), -127, 127).to(tl.int8)
            tl.store(target, codes, mask=mask)
            tl.store(params + (vector * row_width + HEAD_DIM) // 2, scale.to(tl.float16), mask=h < KV_HEADS)
        elif FORMAT == BF16:
            tl.store(target, _to_bfloat16_bits(v), mask=mask)
        else:
            tl.store(target, v.to(data.dtype.element_ty), mask=mask)


@triton.jit
def _copy_rows(
    src,
    dst,
    src_index,
    dst_index,
    words,
    HAS_SRC_INDEX: tl.constexpr,
    HAS_DST_INDEX: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """dst[dst_index[i]] = src[src_index[i]] for rows of `words` elements (an index left out is i)."""
    i = tl.program_id(0).to(tl.int64)
    source = tl.load(src_index + i).to(tl.int64) if HAS_SRC_INDEX else i
    target = tl.load(dst_index + i).to(tl.int64) if HAS_DST_INDEX else i
    for w0 in range(0, words, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        tl.store(dst + target * words + w, tl.load(src + source * words + w, mask=w < words), mask=w < words)


def encode_rows(x: torch.Tensor, rows: torch.Tensor, data: torch.Tensor, fmt: str) -> None:
    """Store vectors x [n, kv_heads, head_dim] at pool rows `rows` of a pool's `data` (contiguous,
    [blocks, block_size, kv_heads, row]) in format `fmt`, as `Codec.encode` and `Codec.pack` would."""
    n, kv_heads, head_dim = x.shape
    if n == 0:
        return
    # bfloat16 is stored as its bits (see _to_bfloat16_bits); int8 codes are signed bytes.
    views = {"bfloat16": torch.uint16, "int8": torch.int8}
    target = data.view(views[fmt]) if fmt in views else data
    params = data.view(torch.float16) if fmt in ("int8", "int4") else None
    _encode[(n,)](
        x,
        rows,
        target,
        params,
        data.shape[-1],
        *x.stride(),
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FORMAT=FORMAT_CODES[fmt],
    )


def copy_rows(
    src: torch.Tensor, dst: torch.Tensor, src_index: torch.Tensor | None, dst_index: torch.Tensor | None
) -> None:
    """dst[dst_index] = src[src_index] for 2-D contiguous tensors of rows of the same width (in
    elements of one dtype); an index left out (None) means rows 0, 1, ... in order."""
    n = len(src_index) if src_index is not None else len(dst_index) if dst_index is not None else len(src)
    if n == 0:
        return
    words = src.shape[1]
    _copy_rows[(n,)](
        src,
        dst,
        src_index,
        dst_index,
        words,
        HAS_SRC_INDEX=src_index is not None,
        HAS_DST_INDEX=dst_index is not None,
        BLOCK_W=min(triton.next_power_of_2(words), COPY_WORDS),
    )
