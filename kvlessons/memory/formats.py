"""How one cached number is stored (lessons 02 and 05): bits per value, shared scales, the dtype table."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..shape import require_positive_int


@dataclass(frozen=True)
class StorageFormat:
    """How one cached number is stored.

    value_bits: bits of each stored value.
    group_size: values that share one scale (None: no scale).
    scale_bits: bits of each shared scale.
    """

    name: str
    value_bits: int
    group_size: int | None = None
    scale_bits: int = 0
    description: str = ""

    @property
    def bits_per_value(self) -> Fraction:
        """Average bits per value, scales included (exact: 4.5 for NVFP4 is Fraction(9, 2))."""
        scale = Fraction(self.scale_bits, self.group_size) if self.group_size else Fraction(0)
        return self.value_bits + scale

    def row_bytes(self, width: int, what: str = "head_dim") -> int:
        """Bytes to store one row of ``width`` values (a head's key, or a latent), scales included.

        Scales are shared along the row, so a grouped format needs ``width`` to be a
        multiple of its group; values must pack into whole bytes.
        """
        require_positive_int(what, width)
        if self.group_size and width % self.group_size:
            raise ValueError(
                f"{what} must be a multiple of {self.group_size} for {self.name} "
                f"(one scale per {self.group_size} values along the row), got {width}"
            )
        bits = width * self.value_bits + (width // self.group_size * self.scale_bits if self.group_size else 0)
        if bits % 8:
            raise ValueError(f"{what}={width} values of {self.name} do not fill whole bytes")
        return bits // 8


DTYPES: dict[str, StorageFormat] = {
    f.name: f
    for f in [
        StorageFormat("fp32", 32, description="IEEE single precision"),
        StorageFormat("fp16", 16, description="IEEE half precision"),
        StorageFormat("bf16", 16, description="bfloat16: fp32's exponent range, 8 bits of mantissa"),
        StorageFormat("fp8", 8, description="FP8 E4M3 (torch.float8_e4m3fn), one byte per value"),
        StorageFormat(
            "nvfp4", 4, group_size=16, scale_bits=8,
            description="FP4 E2M1 values, one E4M3 scale per 16 values: 4 + 8/16 = 4.5 bits per value",
        ),
        StorageFormat(
            "fp4_tensor", 4,
            description="FP4 E2M1 values with one scale per tensor and no block scales: 4 bits per value",
        ),
        StorageFormat(
            "mxfp4", 4, group_size=32, scale_bits=8,
            description="OCP MXFP4: E2M1 values, one power-of-two E8M0 scale per 32: 4.25 bits per value",
        ),
        StorageFormat(
            "int4", 4, group_size=32, scale_bits=16,
            description="symmetric int4, one fp16 scale per 32 values (llama.cpp's Q4_0 layout): 4.5 bits",
        ),
    ]
}
ALIASES = {"float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16", "fp8_e4m3": "fp8", "e4m3": "fp8", "fp4": "nvfp4"}


def storage_format(dtype: str | StorageFormat) -> StorageFormat:
    """Return the StorageFormat named ``dtype`` (or an alias such as 'bfloat16', 'fp4')."""
    if isinstance(dtype, StorageFormat):
        return dtype
    key = ALIASES.get(dtype, dtype) if isinstance(dtype, str) else None
    if key not in DTYPES:
        known = ", ".join(list(DTYPES) + list(ALIASES))
        raise ValueError(f"dtype must be one of {known}; got {dtype!r}")
    return DTYPES[key]


def dtype_name(torch_dtype) -> str:
    """The table's name for a torch dtype (torch.bfloat16 -> 'bf16')."""
    import torch

    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "fp8"}
    if torch_dtype not in names:
        raise ValueError(f"torch dtype {torch_dtype} has no entry in the dtype table ({', '.join(DTYPES)})")
    return names[torch_dtype]
