"""Memory math for the KV cache (lesson 02, and every lesson that counts bytes).

    bytes = sum over layers that own a cache of  rows_per_token x row_bytes(width, dtype) x tokens_held x batch

One concept per module:

- ``formats``: how one cached number is stored (bits per value, shared scales): the dtype table;
- ``formula``: exact bytes of a cache from a ModelShape (windows, sharing, latents,
  quantized formats), what fits in a budget, the levers that shrink it;
- ``presets``: real models' shapes with their sources, and tables and curves over them;
- ``measured``: the bytes a cache's tensors really hold, which the formula must predict.
"""

from .formats import ALIASES, DTYPES, StorageFormat, dtype_name, storage_format
from .formula import (
    SOURCE_EXAMPLE, TENSOR_SCALE_BYTES, Estimate, Lever, estimate, format_bytes, kv_bytes_per_token, kv_cache_bytes,
    layer_bytes_per_token, levers, max_context, max_sequences, quantized_cache_bytes, tokens_held,
)
from .measured import measured_bytes
from .presets import (
    PRESETS, Preset, cache_curves, concurrency_curves, format_preset_table, preset, preset_table,
    sequences_beside_weights,
)

__all__ = [
    "ALIASES", "DTYPES", "PRESETS", "SOURCE_EXAMPLE", "TENSOR_SCALE_BYTES", "Estimate", "Lever", "Preset",
    "StorageFormat", "cache_curves", "concurrency_curves", "dtype_name", "estimate", "format_bytes",
    "format_preset_table", "kv_bytes_per_token", "kv_cache_bytes", "layer_bytes_per_token", "levers", "max_context",
    "max_sequences", "measured_bytes", "preset", "preset_table", "quantized_cache_bytes", "sequences_beside_weights",
    "storage_format", "tokens_held",
]
