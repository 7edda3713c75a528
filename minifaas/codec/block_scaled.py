"""Lossy 8-bit coding of attention KV: one byte per element and one float32 scale per block of ``BLOCK``.

Each block is scaled so that its largest value fills the code's range (float8 e4m3 or int8), which keeps an
outlier local to its token. Payload of ``n`` elements: ceil(n / BLOCK) float32 scales, then n codes. Both ends
decode with the same float32 arithmetic, so the sender checksums exactly the bytes a receiver writes.
"""

from __future__ import annotations

import math

import torch

from minifaas.model.layer_state import tensor_bytes

BLOCK = 128
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_CODES = {"fp8": (torch.float8_e4m3fn, 448.0), "int8": (torch.int8, 127.0)}


class BlockError(ValueError):
    """A lossy payload whose size does not match the range it claims."""


def payload_bytes(n: int) -> int:
    return 4 * math.ceil(n / BLOCK) + n


def encode_blocks(raw: memoryview, dtype: torch.dtype, code: str) -> tuple[list[memoryview], torch.Tensor] | None:
    """The payload parts of ``raw`` (elements of ``dtype``) and its decoded tensor; None if a value is
    not finite (the frame then goes lossless)."""
    values = _view(raw, dtype).float()
    n = values.numel()
    blocks = torch.nn.functional.pad(values, (0, -n % BLOCK)).view(-1, BLOCK)
    amax = blocks.abs().amax(dim=1)
    if not torch.isfinite(amax).all():
        return None
    code_dtype, top = _CODES[code]
    scales = amax / top
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a zero or subnormal block: no 0/0
    scaled = (blocks / scales[:, None]).clamp_(-top, top)
    codes = (scaled.round() if code == "int8" else scaled).to(code_dtype).view(-1)[:n]
    decoded = _dequantise(codes, scales, dtype)
    return [tensor_bytes(scales), tensor_bytes(codes)], decoded


def decode_into(payload: memoryview, dtype: torch.dtype, code: str, out: memoryview) -> None:
    """Write the elements ``payload`` codes (``len(out)`` bytes of ``dtype``) into ``out``."""
    itemsize = dtype.itemsize
    if dtype not in FLOATS or len(out) % itemsize:
        raise BlockError(f"{len(out)} bytes are not whole {dtype} elements")
    n = len(out) // itemsize
    if len(payload) != payload_bytes(n):
        raise BlockError(f"payload of {len(payload)} bytes does not code {n} elements")
    split = len(payload) - n
    scales = _view(payload[:split], torch.float32)
    codes = _view(payload[split:], _CODES[code][0])
    _view(out, dtype).copy_(_dequantise(codes, scales, dtype))


def _dequantise(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    n = codes.numel()
    padded = torch.nn.functional.pad(codes.float(), (0, -n % BLOCK)).view(-1, BLOCK)
    return (padded * scales[:, None]).view(-1)[:n].to(dtype)


def _view(buf: memoryview, dtype: torch.dtype) -> torch.Tensor:
    if len(buf) == 0:
        return torch.empty(0, dtype=dtype)
    if buf.readonly:  # torch wants writable memory; what the transport hands in always is
        buf = memoryview(bytearray(buf))
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)
