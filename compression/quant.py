"""Per-(token, head) quantisation of key and value vectors.

int8 is symmetric (scale = absmax / 127); int4 is asymmetric (scale and minimum per token and
head, two codes packed in a byte), which matters at 4 bits where the range is tiny. Scales are
kept in float16: two bytes per 64-dim head vector.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16


@dataclass
class Quantized:
    """Codes [..., D] (int8) or [..., D/2] (uint8, int4 packed), with per-vector scale (and minimum)."""

    codes: torch.Tensor
    scale: torch.Tensor  # [...]
    minimum: torch.Tensor | None = None  # [...] (int4 only)
    bits: int = 8

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + (self.minimum.nbytes if self.minimum is not None else 0)


def quantize(x: torch.Tensor, bits: int) -> Quantized:
    if bits == 8:
        scale = x.abs().amax(dim=-1).float().clamp_min(1e-8) / 127.0
        codes = torch.round(x.float() / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return Quantized(codes, scale.to(SCALE_DTYPE), None, 8)
    if bits == 4:
        lo = x.amin(dim=-1).float()
        hi = x.amax(dim=-1).float()
        scale = ((hi - lo) / 15.0).clamp_min(1e-8)
        # Round the stored parameters first so that dequantisation uses exactly what is kept.
        scale, lo = scale.to(SCALE_DTYPE), lo.to(SCALE_DTYPE)
        q = torch.round((x.float() - lo.float().unsqueeze(-1)) / scale.float().unsqueeze(-1)).clamp_(0, 15)
        q = q.to(torch.uint8)
        # Low nibbles hold the first half of the dimensions, high nibbles the second half, so that
        # unpacking is one concatenation rather than an interleave.
        half = q.shape[-1] // 2
        codes = q[..., :half] | (q[..., half:] << 4)
        return Quantized(codes, scale, lo, 4)
    raise ValueError(f"unsupported bit width {bits}; use 4 or 8")


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if q.bits == 8:
        return q.codes.to(dtype).mul_(q.scale.to(dtype).unsqueeze(-1))
    values = torch.cat((q.codes & 0x0F, q.codes >> 4), dim=-1).to(dtype)
    return values.mul_(q.scale.to(dtype).unsqueeze(-1)).add_(q.minimum.to(dtype).unsqueeze(-1))


def bytes_per_vector(head_dim: int, bits: int) -> int:
    """Bytes one quantised head vector takes, parameters included."""
    params = 2 if bits == 8 else 4
    return head_dim * bits // 8 + params
