"""The number formats, built from the bits up (lesson 05): E2M1 (FP4), E4M3 (FP8), NVFP4 blocks.

E2M1: 1 sign bit, 2 exponent bits, 1 mantissa bit. Its 8 non-negative values are
0, 0.5, 1, 1.5, 2, 3, 4, 6: spaced 0.5 apart up to 2, then 1, then 2, because each
exponent step doubles the spacing. A code is ``sign << 3 | index`` into that list.

NVFP4 stores a tensor as E2M1 codes, one E4M3 (8-bit float) scale per block of 16
values along the last dimension, and one fp32 scale per tensor that keeps the block
scales inside E4M3's range: 4 + 8/16 = 4.5 bits per value, plus 4 bytes per tensor.

    value = E2M1[code] x block_scale (E4M3) x tensor_scale (fp32)

Rounding is to the nearest representable value, ties to the even code (the one
whose mantissa bit is 0), as torchao does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..shape import require_even, require_positive_int


E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
E4M3_MAX = 448.0  # largest finite torch.float8_e4m3fn
E4M3_MIN = 2.0**-9  # smallest positive torch.float8_e4m3fn (a subnormal: 1/8 x 2^-6)
E2M1_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))  # 0.25, 0.75, ..., 5.0

# The largest magnitude each format stores with a tensor scale of 1. A tensor scale of
# amax / FORMAT_MAX[fmt] puts a tensor's largest value on it: for NVFP4 that is E2M1's 6
# times E4M3's largest block scale, 448, so every block scale lands in E4M3's range.
FORMAT_MAX = {"nvfp4": E2M1_MAX * E4M3_MAX, "fp8": E4M3_MAX, "fp4_tensor": E2M1_MAX}


def code_bits(code: int) -> str:
    """The 4 bits of an E2M1 code as 'S EE M' (sign, exponent, mantissa)."""
    if not 0 <= code < 16:
        raise ValueError(f"code must be in [0, 16), got {code}")
    b = f"{code:04b}"
    return f"{b[0]} {b[1:3]} {b[3]}"


def e2m1_value(code: int) -> float:
    """The value a 4-bit code stands for (sign bit 3, magnitude index bits 0-2)."""
    if not 0 <= code < 16:
        raise ValueError(f"code must be in [0, 16), got {code}")
    magnitude = E2M1_VALUES[code & 7]
    return -magnitude if code & 8 else magnitude


_E2M1_TABLE = torch.tensor([e2m1_value(c) for c in range(16)], dtype=torch.float32)  # value of each code


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of the E2M1 values nearest to ``x`` (already scaled), ties to even.

    Magnitudes beyond 6 saturate to 6. The sign bit is kept for -0.0 too.
    """
    a = x.abs().to(torch.float64).clamp(max=E2M1_MAX).contiguous()
    mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float64, device=x.device)
    below = torch.searchsorted(mids, a, right=False)  # index if a is not past a midpoint
    above = torch.searchsorted(mids, a, right=True)  # index + 1 exactly at a midpoint
    index = torch.where((below == above) | (below % 2 == 0), below, above)  # a tie picks the even index
    sign = torch.signbit(x).to(torch.uint8) << 3
    return (sign | index.to(torch.uint8)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 codes (0..15)."""
    # A table lookup; index_select, because plain indexing (table[codes]) is many times slower on CPU.
    return _E2M1_TABLE.to(codes.device).index_select(0, codes.flatten().long()).view(codes.shape)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last dimension: element 0 in the low nibble."""
    require_even("the last dimension", codes.shape[-1], "to pack two codes per byte")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`."""
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def _check_block(block) -> int:
    """``block``, the number of values that share one scale, if it is a positive integer."""
    return require_positive_int("block", block)


def _check_input(x: torch.Tensor, block: int = 1, packed: bool = False, name: str = "x") -> None:
    """Raise ValueError unless ``x`` can be stored: finite, last dimension split into blocks (and pairs, if packed)."""
    _check_block(block)
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if x.shape[-1] % block:
        raise ValueError(f"the last dimension of {name} ({x.shape[-1]}) must be divisible by block ({block})")
    if packed:
        require_even(f"the last dimension of {name}", x.shape[-1], "to pack two codes per byte")
    if not torch.isfinite(x).all():
        raise ValueError(f"{name} must be finite: NaN or Inf cannot be quantized")


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Cast to torch.float8_e4m3fn after clamping into [-448, 448].

    Clamping first matters: some PyTorch releases turn values at or above 480 into NaN
    instead of saturating (see :func:`fp8_cast_of`).
    """
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_cast_of(value: float) -> float:
    """What this PyTorch build's plain cast to float8_e4m3fn makes of ``value`` (no clamping)."""
    return torch.tensor([value]).to(torch.float8_e4m3fn).float().item()


@dataclass
class QuantizedTensor:
    """A tensor stored as codes and scales; ``nbytes`` is what is actually held.

    fmt:          "nvfp4" (packed E2M1 codes + E4M3 block scales), "fp8" (E4M3 values)
                  or "fp4_tensor" (packed E2M1 codes, no block scales).
    data:         uint8 packed codes (nvfp4, fp4_tensor) or float8_e4m3fn values (fp8).
    block_scales: float8_e4m3fn, one per block of the last dimension (nvfp4), else None.
    tensor_scale: fp32 scalar tensor.
    """

    fmt: str
    data: torch.Tensor
    block_scales: torch.Tensor | None
    tensor_scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    block: int | None = None

    @property
    def nbytes(self) -> int:
        total = self.data.nbytes + self.tensor_scale.nbytes
        return total + (self.block_scales.nbytes if self.block_scales is not None else 0)

    def codes(self) -> torch.Tensor:
        """Unpacked 4-bit codes, one uint8 per value (nvfp4 only)."""
        if self.fmt != "nvfp4":
            raise ValueError("codes() is for nvfp4 tensors")
        return unpack_nibbles(self.data)

    def dequantize(self) -> torch.Tensor:
        """The stored values in the original shape and dtype.

        Computed in float32 without error until the last step: an E2M1 value times an
        E4M3 scale has at most 2 + 4 significant bits, so only the final multiplication
        by the fp32 tensor scale rounds.
        """
        if self.fmt == "fp8":
            values = self.data.to(torch.float32)
        elif self.fmt == "fp4_tensor":
            values = decode_e2m1(unpack_nibbles(self.data))
        else:
            blocks = decode_e2m1(unpack_nibbles(self.data)).unflatten(-1, (-1, self.block))  # (..., n_blocks, block)
            values = (blocks * self.block_scales.to(torch.float32)[..., None]).flatten(-2)
        return (values * self.tensor_scale).reshape(self.shape).to(self.dtype)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """The stored values of ``q`` in its original shape and dtype."""
    return q.dequantize()


def nvfp4_tensor_scale(x: torch.Tensor) -> torch.Tensor:
    """The per-tensor fp32 scale that maps the largest block scale to E4M3's maximum."""
    return _tensor_scale(x, None, FORMAT_MAX["nvfp4"])


def _as_scale(value, device, name: str = "tensor_scale") -> torch.Tensor:
    """``value`` as an fp32 scalar tensor on ``device``; ValueError naming ``name`` unless positive and finite."""
    scale = torch.as_tensor(value, dtype=torch.float32, device=device).reshape(())
    if not torch.isfinite(scale) or scale <= 0:
        raise ValueError(f"{name} must be positive and finite, got {scale.item()}")
    return scale


def _tensor_scale(x: torch.Tensor, given, divisor: float, name: str = "tensor_scale") -> torch.Tensor:
    """``given`` as a checked fp32 scalar, or by default amax(x) / divisor (1 for an all-zero tensor)."""
    if given is None:
        amax = x.detach().abs().max().to(torch.float32)
        given = torch.where(amax > 0, amax / divisor, torch.ones_like(amax))  # all zeros: any scale works
    return _as_scale(given, x.device, name)


def quantize(x: torch.Tensor, block: int = 16, tensor_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """Store ``x`` as NVFP4: E2M1 codes, an E4M3 scale per ``block`` values, one fp32 tensor scale.

    Each block's scale is its absolute maximum / 6 (so the block's largest value maps
    to E2M1's 6), divided by the tensor scale and stored in E4M3; a block that is not
    all zeros never gets a scale below E4M3's smallest positive value, 2^-9 (rounding to
    0 would erase the whole block). Values are divided by the *stored* scale (as a
    decoder will multiply by it) and rounded to the nearest E2M1 value, ties to even.
    ``tensor_scale`` may be given (a calibrated constant, as a cache uses so every write
    shares it); by default it is amax(x) / (6 x 448), so the largest block scale is 448.
    """
    _check_input(x, block, packed=True)
    tensor_scale = _tensor_scale(x, tensor_scale, FORMAT_MAX["nvfp4"])
    blocks = x.detach().to(torch.float64).unflatten(-1, (-1, block))  # (..., n_blocks, block)
    amax = blocks.abs().amax(dim=-1)  # (..., n_blocks)
    wanted = amax / E2M1_MAX / tensor_scale.to(torch.float64)
    block_scales = to_e4m3(torch.where(amax > 0, wanted.clamp_min(E4M3_MIN), wanted))
    effective = (block_scales.to(torch.float64) * tensor_scale.to(torch.float64))[..., None]
    # Only an all-zero block has a stored scale of 0; its codes are 0 too.
    scaled = torch.where(effective > 0, blocks / effective.clamp_min(1e-300), blocks * 0)
    codes = encode_e2m1(scaled).reshape(x.shape)
    return QuantizedTensor("nvfp4", pack_nibbles(codes), block_scales, tensor_scale, x.shape, x.dtype, block)


def quantize_fp8(x: torch.Tensor, tensor_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """Store ``x`` as E4M3 values times one fp32 tensor scale (default amax / 448); 1 byte per value + 4."""
    _check_input(x)
    tensor_scale = _tensor_scale(x, tensor_scale, FORMAT_MAX["fp8"])
    data = to_e4m3(x.detach().to(torch.float32) / tensor_scale)
    return QuantizedTensor("fp8", data, None, tensor_scale, x.shape, x.dtype)


def quantize_fp4_tensor(x: torch.Tensor, tensor_scale: torch.Tensor | float | None = None) -> QuantizedTensor:
    """FP4 E2M1 codes with ONE scale for the whole tensor (default amax / 6), no block scales: 4 bits + 4 bytes.

    The format without the part that makes 4 bits usable, for comparison.
    """
    _check_input(x, packed=True)
    tensor_scale = _tensor_scale(x, tensor_scale, FORMAT_MAX["fp4_tensor"])
    codes = encode_e2m1(x.detach().to(torch.float64) / tensor_scale.to(torch.float64))
    return QuantizedTensor("fp4_tensor", pack_nibbles(codes), None, tensor_scale, x.shape, x.dtype)


QUANTIZERS = {"nvfp4": quantize, "fp8": quantize_fp8, "fp4_tensor": quantize_fp4_tensor}


def _check_fmt(fmt) -> str:
    if fmt not in QUANTIZERS:
        raise ValueError(f"fmt must be one of {tuple(QUANTIZERS)}, got {fmt!r}")
    return fmt


def fake_quantize(x: torch.Tensor, fmt: str = "nvfp4", **kwargs) -> torch.Tensor:
    """``x`` after a round trip through the format (what attention sees when reading the cache)."""
    return QUANTIZERS[_check_fmt(fmt)](x, **kwargs).dequantize()
