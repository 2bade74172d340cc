"""Memory math for the KV cache. (Lesson 02 grows this module; lesson 01 needs only the units.)"""

from __future__ import annotations

_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(n: int, digits: int = 2) -> str:
    """Return ``n`` bytes in binary units with the unit named: 131072 -> '128 KiB'.

    Binary units (1 KiB = 1024 B) because memory is sized in powers of two; GB (10^9)
    and GiB (2^30) differ by 7%, a classic calculator error.
    """
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"n must be an integer number of bytes, got {n!r}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    value, unit = float(n), _BINARY_UNITS[0]
    for unit in _BINARY_UNITS:
        if value < 1024 or unit == _BINARY_UNITS[-1]:
            break
        value /= 1024
    if unit == "B":
        return f"{n} B"
    text = f"{value:.{digits}f}".rstrip("0").rstrip(".")
    return f"{text} {unit}"
