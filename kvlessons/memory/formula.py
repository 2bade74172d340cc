"""The cache formula (lesson 02): exact byte counts from a ModelShape, windows, sharing and quantization included.

    bytes = sum over layers that own a cache of  rows_per_token x row_bytes(width, dtype) x tokens_held x batch

where a standard layer stores 2 rows (K and V) per KV head of width head_dim, a latent
(MLA) layer stores one row of width latent_dim, a layer with a sliding window holds at
most ``window`` tokens, and layers that read another layer's cache store nothing. For a
uniform model this is the familiar 2 x layers x kv_heads x head_dim x bytes x tokens x batch.

Every function returns an exact integer number of bytes; tests check it against the
``nbytes()`` of caches that really hold the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..shape import ModelShape, require_positive_int
from .formats import storage_format


def layer_bytes_per_token(shape: ModelShape, layer: int, dtype="bf16") -> int:
    """Bytes one token adds to ``layer``'s own cache (0 for a layer that reads another's)."""
    fmt = storage_format(dtype)
    if shape.owner(layer) != layer:
        return 0
    if shape.latent_dim is not None:
        return fmt.row_bytes(shape.latent_dim, "latent_dim")  # one latent row, no K/V split
    return 2 * shape.kv_heads * fmt.row_bytes(shape.head_dim)  # K and V, one row per KV head


def kv_bytes_per_token(shape: ModelShape, dtype="bf16", position: int = 0) -> int:
    """Bytes the token at ``position`` adds to the cache of one sequence.

    At position 0 (the default) every cache-owning layer grows: this is the textbook
    per-token figure. A layer with window W stops growing once W tokens are held, so
    later positions can cost less (Gemma-2 halves past 4,096 tokens).
    """
    require_positive_int("position", position, allow_zero=True)
    return sum(
        layer_bytes_per_token(shape, i, dtype)
        for i in shape.cache_layers
        if shape.window(i) is None or position < shape.window(i)
    )


def tokens_held(shape: ModelShape, layer: int, seq_len: int) -> int:
    """Positions ``layer``'s cache holds after ``seq_len`` tokens: all, or its window."""
    w = shape.window(layer)
    return seq_len if w is None else min(seq_len, w)


def kv_cache_bytes(shape: ModelShape, seq_len: int, batch: int = 1, dtype="bf16") -> int:
    """Exact bytes of K/V (or latents) held for ``batch`` sequences of ``seq_len`` tokens."""
    require_positive_int("seq_len", seq_len)
    require_positive_int("batch", batch)
    per_sequence = sum(
        layer_bytes_per_token(shape, i, dtype) * tokens_held(shape, i, seq_len) for i in shape.cache_layers
    )
    return per_sequence * batch


def max_sequences(shape: ModelShape, seq_len: int, budget_bytes: int, dtype="bf16") -> int:
    """How many sequences of ``seq_len`` tokens fit in ``budget_bytes`` of cache (0 if not even one)."""
    require_positive_int("budget_bytes", budget_bytes)
    return budget_bytes // kv_cache_bytes(shape, seq_len, 1, dtype)


def max_context(shape: ModelShape, budget_bytes: int, batch: int = 1, dtype="bf16") -> int:
    """Longest equal length that ``batch`` sequences can all reach within ``budget_bytes`` (0 if none).

    Unbounded models grow forever, so this always ends; a model whose every layer is
    windowed stops growing, and then the answer is "any length": that raises ValueError.
    """
    require_positive_int("budget_bytes", budget_bytes)
    require_positive_int("batch", batch)
    if all(shape.window(i) is not None for i in shape.cache_layers):
        cap = kv_cache_bytes(shape, max(shape.window(i) for i in shape.cache_layers), batch, dtype)
        if cap <= budget_bytes:
            raise ValueError("every layer is windowed and the full windows fit: any context length fits the budget")
    lo, hi = 0, 1
    while kv_cache_bytes(shape, hi, batch, dtype) <= budget_bytes:
        lo, hi = hi, hi * 2
    while hi - lo > 1:  # kv_cache_bytes grows with seq_len: binary search the last length that fits
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv_cache_bytes(shape, mid, batch, dtype) <= budget_bytes else (lo, mid)
    return lo


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


# The source texts' worked example: an 8B-class model with 32 layers, 32 query heads,
# 8 KV heads of width 128 (the shape of Llama-3-8B).
SOURCE_EXAMPLE = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128)


TENSOR_SCALE_BYTES = 4  # one fp32 scale per stored K or V tensor in a quantized cache


def quantized_cache_bytes(shape: ModelShape, seq_len: int, batch: int = 1, dtype="nvfp4", residual: int = 0, residual_dtype="fp32") -> int:
    """Exact bytes of a quantized cache (kvlessons.fp4.QuantizedCache) after ``seq_len`` appended tokens.

    The newest ``residual`` tokens stay in ``residual_dtype`` (KIVI-style); the rest are
    stored in ``dtype`` (values and block scales, as :func:`kv_cache_bytes` counts them);
    each cache layer also keeps one fp32 scale for K and one for V. Windows are not
    supported by the quantized cache, so none are allowed here.
    """
    require_positive_int("seq_len", seq_len)
    require_positive_int("batch", batch)
    require_positive_int("residual", residual, allow_zero=True)
    if any(shape.window(i) is not None for i in shape.cache_layers):
        raise ValueError("shape has sliding windows; the quantized cache stores full-attention layers only")
    full = min(seq_len, residual)
    quantized = seq_len - full
    total = len(shape.cache_layers) * (2 if shape.latent_dim is None else 1) * TENSOR_SCALE_BYTES
    if quantized:
        total += kv_cache_bytes(shape, quantized, batch, dtype)
    if full:
        total += kv_cache_bytes(shape, full, batch, residual_dtype)
    return total


@dataclass(frozen=True)
class Lever:
    """One way to shrink the cache bill, with the bytes before and after for a given workload."""

    lever: str
    change: str
    before_bytes: int
    after_bytes: int
    costs: str

    @property
    def saving(self) -> float:
        """before / after (inf when the cache is gone)."""
        return float("inf") if self.after_bytes == 0 else self.before_bytes / self.after_bytes


def levers(shape: ModelShape, seq_len: int, batch: int, dtype="bf16") -> list[Lever]:
    """The source text's levers, each applied alone to ``batch`` x ``seq_len`` tokens of ``shape`` in ``dtype``."""
    from dataclasses import replace

    base = kv_cache_bytes(shape, seq_len, batch, dtype)
    half_context = max(1, seq_len // 2)
    mqa = replace(shape, kv_heads=1, latent_dim=None)
    return [
        Lever("shorter context", f"{seq_len:,} -> {half_context:,} tokens", base,
              kv_cache_bytes(shape, half_context, batch, dtype), "less text for the model to use"),
        Lever("fewer KV heads (MQA)", f"{shape.kv_heads} -> 1 KV heads", base,
              kv_cache_bytes(mqa, seq_len, batch, dtype), "quality; needs training or uptraining with the new heads"),
        Lever("lower precision (FP8)", f"{storage_format(dtype).name} -> fp8", base,
              kv_cache_bytes(shape, seq_len, batch, "fp8"), "numerical error; evaluate on the task"),
        Lever("lower precision (INT4)", f"{storage_format(dtype).name} -> int4 (+ scales)", base,
              kv_cache_bytes(shape, seq_len, batch, "int4"), "more error; per-group scales are essential"),
        Lever("smaller batch", f"{batch} -> {max(1, batch // 2)} sequences", base,
              kv_cache_bytes(shape, seq_len, max(1, batch // 2), dtype), "lower throughput per GPU"),
        Lever("recompute instead of cache", "no cache", base, 0,
              "decode work grows with length: n(n+1)/2 K/V computations instead of n"),
    ]


@dataclass(frozen=True)
class Estimate:
    """The memory estimator's numbers for a uniform full-attention model (the widget shows these)."""

    layers: int
    kv_heads: int
    head_dim: int
    seq_len: int
    batch: int
    dtype: str
    per_token_per_layer: int
    per_token: int
    per_sequence: int
    total: int

    @property
    def formula(self) -> str:
        """The formula with the numbers filled in (bytes per value exact, 4.5 for NVFP4)."""
        bits = storage_format(self.dtype).bits_per_value
        per_value = f"{float(bits / 8):g} B"
        return (
            f"2 · {self.layers} layers · {self.kv_heads} KV head{'s' if self.kv_heads != 1 else ''} · {self.head_dim} head dim · "
            f"{self.seq_len:,} tokens · {self.batch} seq · {per_value} = {self.total:,} B = {format_bytes(self.total)}"
        )


def estimate(layers: int, kv_heads: int, head_dim: int, seq_len: int, batch: int = 1, dtype="bf16") -> Estimate:
    """The cache of a uniform model with full attention everywhere (what simple calculators assume)."""
    shape = ModelShape(layers=layers, q_heads=kv_heads, kv_heads=kv_heads, head_dim=head_dim)
    fmt = storage_format(dtype)
    return Estimate(
        layers, kv_heads, head_dim, seq_len, batch, fmt.name,
        per_token_per_layer=layer_bytes_per_token(shape, 0, fmt),
        per_token=kv_bytes_per_token(shape, fmt),
        per_sequence=kv_cache_bytes(shape, seq_len, 1, fmt),
        total=kv_cache_bytes(shape, seq_len, batch, fmt),
    )
