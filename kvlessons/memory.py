"""Memory math for the KV cache: exact byte counts from a ModelShape.

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
from fractions import Fraction

from .shape import ModelShape, alternating_windows, require_positive_int

# ---------------------------------------------------------------------------------------------
# Storage formats
# ---------------------------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------------------------
# Bytes
# ---------------------------------------------------------------------------------------------


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
SEED_EXAMPLE = ModelShape(layers=32, q_heads=32, kv_heads=8, head_dim=128)

# ---------------------------------------------------------------------------------------------
# Real models
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Preset:
    """A real model's cache-relevant shape, its parameter count and where the numbers come from."""

    name: str
    shape: ModelShape
    params: int  # total parameters as published, for weight memory
    context: int  # longest context the released model supports, in tokens
    source: str
    note: str = ""

    def weight_bytes(self, dtype="bf16") -> int:
        """Bytes of the weights stored in ``dtype`` (no scales for plain float formats)."""
        fmt = storage_format(dtype)
        return int(self.params * fmt.bits_per_value) // 8


def _preset(name, layers, q_heads, kv_heads, head_dim, hidden, params, context, source, note="", **extra):
    shape = ModelShape(layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, hidden_size=hidden, **extra)
    return Preset(name, shape, params, context, source, note)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _preset("Llama-2-7B", 32, 32, 32, 128, 4096, 6_738_415_616, 4_096,
                "meta-llama/Llama-2-7b-hf config.json; Touvron et al. 2023 (arXiv 2307.09288)", "MHA: every query head has its own K/V"),
        _preset("Llama-2-70B", 80, 64, 8, 128, 8192, 68_976_648_192, 4_096,
                "meta-llama/Llama-2-70b-hf config.json; Touvron et al. 2023", "GQA, 8 query heads per KV head"),
        _preset("Llama-3-8B", 32, 32, 8, 128, 4096, 8_030_261_248, 8_192,
                "meta-llama/Meta-Llama-3-8B config.json", "the seed texts' 8B-class example"),
        _preset("Llama-3-70B", 80, 64, 8, 128, 8192, 70_553_706_496, 8_192,
                "meta-llama/Meta-Llama-3-70B config.json"),
        _preset("Mistral-7B-v0.1", 32, 32, 8, 128, 4096, 7_241_732_096, 32_768,
                "mistralai/Mistral-7B-v0.1 config.json (sliding_window 4096); Jiang et al. 2023 (arXiv 2310.06825)",
                "sliding window 4,096 in every layer: the cache stops growing at 4,096 tokens",
                windows=(4096,) * 32),
        _preset("Qwen2.5-7B", 28, 28, 4, 128, 3584, 7_615_616_512, 131_072,
                "Qwen/Qwen2.5-7B config.json", "7 query heads per KV head"),
        _preset("Gemma-2-9B", 42, 16, 8, 256, 3584, 9_241_705_984, 8_192,
                "google/gemma-2-9b config.json (head_dim 256, sliding_window 4096); Gemma Team 2024 (arXiv 2408.00118)",
                "head_dim 256 is not hidden/heads (3584/16 = 224); even layers use a 4,096-token window",
                windows=alternating_windows(42, 4096)),
        _preset("GPT-2 small", 12, 12, 12, 64, 768, 124_439_808, 1_024,
                "openai-community/gpt2 config.json; Radford et al. 2019", "MHA, stored in fp32 by default"),
        _preset("SmolLM2-135M", 30, 9, 3, 64, 576, 134_515_008, 8_192,
                "HuggingFaceTB/SmolLM2-135M config.json; the capstone's model", "GQA, 3 query heads per KV head"),
        _preset("DeepSeek-V3", 61, 128, 128, 128, 7168, 671_026_419_200, 131_072,
                "deepseek-ai/DeepSeek-V3 config.json (kv_lora_rank 512, qk_rope_head_dim 64); DeepSeek-AI 2024 (arXiv 2412.19437)",
                "MLA: caches one 576-wide latent (512 + 64 rotary) per layer per token, not K/V per head",
                latent_dim=576),
    ]
}


def preset(name: str) -> Preset:
    """The preset called ``name``; unknown names raise ValueError listing the known ones."""
    if name not in PRESETS:
        raise ValueError(f"name must be one of {', '.join(PRESETS)}; got {name!r}")
    return PRESETS[name]


# ---------------------------------------------------------------------------------------------
# Levers
# ---------------------------------------------------------------------------------------------


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
    """The seed's levers, each applied alone to ``batch`` x ``seq_len`` tokens of ``shape`` in ``dtype``."""
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


def sequences_beside_weights(p: Preset, seq_len: int, card_bytes: int, dtype="bf16") -> int:
    """Sequences of ``seq_len`` whose cache fits on a card of ``card_bytes`` after the weights (0 if none).

    Weights and cache both in ``dtype``; activations, workspaces and allocator slack are
    ignored, so this is an upper bound.
    """
    require_positive_int("card_bytes", card_bytes)
    free = card_bytes - p.weight_bytes(dtype)
    return max_sequences(p.shape, seq_len, free, dtype) if free > 0 else 0


def preset_table(seq_lens=(8192, 131072), card_bytes: int = 80 * 10**9, dtype="bf16") -> list[dict]:
    """One row per preset: bytes per token, per sequence at each length, weights, supported context,
    and how many sequences of the first length fit beside the weights on the card."""
    rows = []
    for p in PRESETS.values():
        row = {"model": p.name, "per_token": kv_bytes_per_token(p.shape, dtype), "weights": p.weight_bytes(dtype)}
        for n in seq_lens:
            row[n] = kv_cache_bytes(p.shape, n, 1, dtype)
        row["context"] = p.context
        row["fit"] = sequences_beside_weights(p, seq_lens[0], card_bytes, dtype)
        rows.append(row)
    return rows


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
            f"2 · {self.layers} layers · {self.kv_heads} KV heads · {self.head_dim} head dim · "
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


def format_preset_table(rows: list[dict], seq_lens=(8192, 131072)) -> str:
    """The rows of :func:`preset_table` as aligned text; '*' marks lengths past a model's supported context."""
    def short(n):
        return f"{n // 1024}K" if n % 1024 == 0 else str(n)

    head = f"{'model':<16}{'per token':>11}" + "".join(f"{'per ' + short(n) + ' seq':>15}" for n in seq_lens)
    head += f"{'weights':>12}{'context':>9}{short(seq_lens[0]) + ' seqs on card':>18}"
    lines = [head]
    for r in rows:
        cells = f"{r['model']:<16}{format_bytes(r['per_token']):>11}"
        for n in seq_lens:
            mark = "*" if n > r["context"] else " "
            cells += f"{format_bytes(r[n]) + mark:>15}"
        mark = "*" if seq_lens[0] > r["context"] else " "
        cells += f"{format_bytes(r['weights']):>12}{short(r['context']):>9}{str(r['fit']) + mark:>18}"
        lines.append(cells)
    return "\n".join(lines)


def cache_curves(names, lengths, dtype="bf16") -> dict[str, list[int]]:
    """Bytes of one sequence at each length, for each preset named (input to plots.plot_cache_vs_context)."""
    return {name: [kv_cache_bytes(preset(name).shape, n, 1, dtype) for n in lengths] for name in names}


def concurrency_curves(names, lengths, budget_bytes: int, dtype="bf16") -> dict[str, list[int]]:
    """Sequences that fit in ``budget_bytes`` at each length, for each preset named."""
    return {name: [max_sequences(preset(name).shape, n, budget_bytes, dtype) for n in lengths] for name in names}


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


# ---------------------------------------------------------------------------------------------
# Measured bytes: what tensors really hold
# ---------------------------------------------------------------------------------------------


def measured_bytes(obj) -> int:
    """Bytes of every tensor reachable from ``obj``, each underlying storage counted once.

    Follows attributes, lists, tuples, dicts and dataclass fields (not properties, which
    compute on demand), so it counts what an object *keeps*, whatever its own accounting
    says. A view counts its whole storage: a 2-token slice that pins a 4,096-token tensor
    holds 4,096 tokens of memory. The formulas in this module predict this number; the
    tests check them against it.
    """
    import torch

    seen_storages: set[tuple[str, int]] = set()
    seen_objects: set[int] = set()
    total = 0
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen_objects:
            continue
        seen_objects.add(id(item))
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = (str(item.device), storage.data_ptr())
            if storage.nbytes() and key not in seen_storages:
                seen_storages.add(key)
                total += storage.nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, (type, torch.nn.Module)):
            stack.extend(vars(item).values())
    return total
