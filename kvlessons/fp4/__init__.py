"""4-bit floating-point storage (NVFP4-style) and FP8, and a KV cache stored that way (lessons 05 and 08).

One concept per module:

- ``formats``: E2M1 and E4M3 from the bits up; NVFP4 (E2M1 codes, an E4M3 scale per 16
  values, an fp32 tensor scale) and FP8 quantizers; packing two codes per byte;
- ``quantized_cache``: ``QuantizedCache``, which keeps only codes, scales and a
  full-precision tail of recent tokens, and dequantizes when attention reads;
- ``measures``: what that does to keys (error, RoPE order), to attention, and to the
  text a model generates or reads.
"""

from .formats import (
    E2M1_MAX, E2M1_MIDPOINTS, E2M1_VALUES, E4M3_MAX, E4M3_MIN, FORMAT_MAX, QUANTIZERS, QuantizedTensor, code_bits,
    decode_e2m1, dequantize, e2m1_value, encode_e2m1, fake_quantize, fp8_cast_of, nvfp4_tensor_scale, pack_nibbles,
    quantize, quantize_fp4_tensor, quantize_fp8, to_e4m3, unpack_nibbles,
)
from .measures import (
    attention_drift, compare_generation, outlier_keys, passage_agreement, relative_error, rope_order_error,
)
from .quantized_cache import QuantizedCache, QuantizedLayer

__all__ = [
    "E2M1_MAX", "E2M1_MIDPOINTS", "E2M1_VALUES", "E4M3_MAX", "E4M3_MIN", "FORMAT_MAX", "QUANTIZERS", "QuantizedCache",
    "QuantizedLayer", "QuantizedTensor", "attention_drift", "code_bits", "compare_generation", "decode_e2m1",
    "dequantize", "e2m1_value", "encode_e2m1", "fake_quantize", "fp8_cast_of", "nvfp4_tensor_scale", "outlier_keys",
    "pack_nibbles", "passage_agreement", "quantize", "quantize_fp4_tensor", "quantize_fp8", "relative_error",
    "rope_order_error", "to_e4m3", "unpack_nibbles",
]
