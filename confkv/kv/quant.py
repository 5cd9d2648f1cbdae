"""Per-(token, head) quantisation of key and value vectors.

int8 is symmetric (scale = absmax / 127); int4 and int2 are asymmetric (scale and minimum per token
and head, two or four codes packed in a byte), which matters at few bits where the range is tiny.
Scales are kept in float16: two bytes per 64-dim head vector. int2 holds KEY_ONLY values only (as
KIVI quantises values: per token), never keys.

Keys have outlier channels (KIVI's finding): a few channels set a head vector's range, so per-token
quantisation spends its levels on them. `random_rotation` is the orthogonal basis in which quantised keys
are stored instead: it spreads every channel over all of them, and since the query is turned by the
same matrix q.k is unchanged, while the entries stay per token (they move between blocks as stored).

`quantize_channels` is KIVI's alternative for keys: int4 per channel over the tokens of a block, a
scale and minimum per (block, head, channel), so an outlier channel spends only its own range.
Its parameters belong to a block, not an entry: a block is encoded whole, from exact vectors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
PACKED_BITS = (4, 2)  # asymmetric, several codes per byte


@dataclass
class Quantized:
    """Codes [..., D] (int8) or [..., D * bits / 8] (uint8, packed), with per-vector scale (and minimum)."""

    codes: torch.Tensor
    scale: torch.Tensor  # [...]
    minimum: torch.Tensor | None = None  # [...] (packed widths only)
    bits: int = 8

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + (self.minimum.nbytes if self.minimum is not None else 0)


def quantize(x: torch.Tensor, bits: int) -> Quantized:
    if bits == 8:
        scale = x.abs().amax(dim=-1).float().clamp_min(1e-8) / 127.0
        codes = torch.round(x.float() / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return Quantized(codes, scale.to(SCALE_DTYPE), None, 8)
    if bits not in PACKED_BITS:
        raise ValueError(f"unsupported bit width {bits}; use 2, 4 or 8")
    levels = 2**bits - 1
    # + 0.0 turns a minimum of -0.0 into 0.0: which zero a min keeps depends on the order it reduces in,
    # and the kernels that write rows (confkv.kv.triton_blocks, csrc/block_write.cpp) reduce in others.
    lo = x.amin(dim=-1).float() + 0.0
    hi = x.amax(dim=-1).float()
    scale = ((hi - lo) / levels).clamp_min(1e-8)
    # Round the stored parameters first so that dequantisation uses exactly what is kept.
    scale, lo = scale.to(SCALE_DTYPE), lo.to(SCALE_DTYPE)
    q = torch.round((x.float() - lo.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, levels)
    q = q.to(torch.uint8)
    # Byte i holds dimension i in its lowest bits, then i + D/k, i + 2D/k...: k = 8 / bits parts of
    # the vector side by side, so that unpacking is one concatenation rather than an interleave.
    parts = q.chunk(8 // bits, dim=-1)
    codes = parts[0].clone()
    for k, part in enumerate(parts[1:], start=1):
        codes |= part << (k * bits)
    return Quantized(codes, scale, lo, bits)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if q.bits == 8:
        return q.codes.to(dtype).mul_(q.scale.to(dtype).unsqueeze(-1))
    mask = 2**q.bits - 1
    values = torch.cat([(q.codes >> (k * q.bits)) & mask for k in range(8 // q.bits)], dim=-1).to(dtype)
    return values.mul_(q.scale.to(dtype).unsqueeze(-1)).add_(q.minimum.to(dtype).unsqueeze(-1))


def quantize_channels(x: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of vectors x [blocks, block_size, heads, D] as int4 per channel: codes [blocks, block_size,
    heads, D / 2] (packed as `quantize` packs them) and params [blocks, heads, 2, D] fp16 (scale, then
    minimum). Only the first `counts[b]` vectors of block b are held (all when None): the range is
    theirs, and the codes past them are meaningless."""
    if counts is None:
        lo, hi = x.amin(dim=1).float(), x.amax(dim=1).float()  # [blocks, heads, D]
    else:
        held = (torch.arange(x.shape[1], device=x.device) < counts.to(x.device)[:, None]).view(*x.shape[:2], 1, 1)
        lo = x.float().masked_fill(~held, math.inf).amin(dim=1)
        hi = x.float().masked_fill(~held, -math.inf).amax(dim=1)
        empty = ~torch.isfinite(lo)  # blocks holding nothing
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
    scale = ((hi - lo) / 15).clamp_min(1e-8).to(SCALE_DTYPE)
    lo = lo.to(SCALE_DTYPE)
    q = torch.round((x.float() - lo.float().unsqueeze(1)) / scale.float().unsqueeze(1)).clamp_(0, 15).to(torch.uint8)
    low, high = q.chunk(2, dim=-1)
    return low | (high << 4), torch.stack((scale, lo), dim=2)


def dequantize_channels(codes: torch.Tensor, params: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Vectors [..., D] from int4 codes [..., D / 2] and their blocks' params [..., 2, D] (broadcast
    to the codes' leading shape): the inverse of `quantize_channels`, entry by entry."""
    values = torch.cat((codes & 15, codes >> 4), dim=-1).to(dtype)
    return values.mul_(params[..., 0, :].to(dtype)).add_(params[..., 1, :].to(dtype))


def bytes_per_vector(head_dim: int, bits: int) -> int:
    """Bytes one quantised head vector takes, parameters included."""
    params = 2 if bits == 8 else 4
    return head_dim * bits // 8 + params


def random_rotation(head_dim: int, seed: int = 0) -> torch.Tensor:
    """An orthogonal [head_dim, head_dim] float32 matrix, the same for every call with these arguments:
    a Hadamard matrix with random column signs (QuaRot's) where head_dim is a power of two, else the Q
    of a random Gaussian matrix."""
    generator = torch.Generator().manual_seed(seed)
    if head_dim & (head_dim - 1) == 0:
        hadamard = torch.ones(1, 1)
        while hadamard.shape[0] < head_dim:
            hadamard = torch.cat((torch.cat((hadamard, hadamard), 1), torch.cat((hadamard, -hadamard), 1)), 0)
        signs = torch.randint(0, 2, (head_dim,), generator=generator).float() * 2 - 1
        return hadamard / math.sqrt(head_dim) * signs
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator))
    return q * torch.sign(torch.diagonal(r))
