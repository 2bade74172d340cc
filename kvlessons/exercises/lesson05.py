"""Lesson 05's exercises: one NVFP4 block quantized by hand, and the bytes of an NVFP4 cache with a full-precision tail."""

from __future__ import annotations

import math

from .core import Feedback, NumericExercise, as_ints, as_number


__all__ = [
    "FP4_BLOCK", "FP4_BLOCK_HINTS", "FP4_BLOCK_SCALE", "FP4_BLOCK_CODES", "FP4_BLOCK_PACKED", "check_fp4_block",
    "FP4_CACHE_BYTES", "check_fp4_cache_bytes",
]


# 16 values whose largest magnitude is negative (so max() and abs-max differ) and which
# include exact ties between E2M1 grid points once divided by the scale 0.5.
FP4_BLOCK = (-3.0, 1.2, 0.125, 0.6, -0.75, 2.5, 0.0, 1.75, -0.2, 0.375, 1.0, -2.2, 0.9, 0.625, -1.25, 2.0)


# The answer key, worked by hand (tests check that kvlessons.fp4.quantize agrees):
# scale = max|x| / 6 = 3 / 6 = 0.5 (exact in E4M3); x / 0.5 =
#   -6, 2.4, 0.25, 1.2, -1.5, 5, 0, 3.5, -0.4, 0.75, 2, -4.4, 1.8, 1.25, -2.5, 4
# nearest E2M1 magnitude (ties 0.25, 0.75, 1.25, 2.5, 3.5, 5 to the even code), sign bit 8 for negatives:
#   -6, 2, 0, 1, -1.5, 4, 0, 4, -0.5, 1, 2, -4, 2, 1, -2, 4
# and byte i = code[2i] | code[2i + 1] << 4.
FP4_BLOCK_SCALE = 0.5
FP4_BLOCK_CODES = (15, 4, 0, 2, 11, 6, 0, 6, 9, 2, 4, 14, 4, 2, 12, 6)
FP4_BLOCK_PACKED = (79, 32, 107, 96, 41, 228, 36, 108)


def _block_answer():
    return FP4_BLOCK_SCALE, list(FP4_BLOCK_CODES), list(FP4_BLOCK_PACKED)


FP4_BLOCK_HINTS = [
    "Step 1: the block's scale maps its largest magnitude to E2M1's largest value, 6. Step 2: divide each value "
    "by the scale and round to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6; the code is that value's index, plus 8 "
    "if the value is negative. Step 3: two codes per byte, element 0 in the low 4 bits.",
    "The largest magnitude is |-3.0| = 3.0, so the scale is 3.0 / 6 = 0.5 (exact in E4M3). A value exactly halfway "
    "between two grid points goes to the even index (mantissa bit 0): 2.5 -> 2 (index 4), 1.25 -> 1 (index 2).",
    "In code: mag = abs(x) / scale; index = the nearest grid index, ties to the even one; code = index | (8 if x < 0 "
    "else 0); packed[i] = codes[2*i] | codes[2*i + 1] << 4.",
]


def check_fp4_block(scale, codes, packed) -> Feedback:
    """Exercise 05.1: quantize FP4_BLOCK by hand (tensor scale 1): its E4M3 scale, 16 codes, 8 packed bytes.

    Diagnoses the first wrong step: the scale, then each code (sign, rounding, ties),
    then the byte order of the packing.
    """
    from ..fp4 import E2M1_VALUES

    right_scale, right_codes, right_packed = _block_answer()
    amax = max(abs(v) for v in FP4_BLOCK)
    scale = as_number(scale)
    if scale is None:
        return Feedback(False, "Step 1, the scale: expected a number (a float such as 0.25), "
                               "not yet given. Start with the block's largest magnitude.")
    if abs(scale - right_scale) > 1e-9:
        if abs(scale - amax) < 1e-9:
            why = "that is the block's absolute maximum; the scale maps it to E2M1's largest value, 6, so divide by 6."
        elif abs(scale - max(FP4_BLOCK) / 6) < 1e-9:
            why = "you took the largest value, not the largest magnitude: -3.0 has the biggest |x| in this block."
        else:
            why = f"the scale is max|x| / 6 = {amax} / 6, rounded to E4M3 (exact here)."
        return Feedback(False, f"Step 1, the scale, is off ({scale}): {why}")
    codes = as_ints(codes)
    if codes is None:
        return Feedback(False, "Step 1 is right. Step 2: give the codes as a list of 16 integers 0..15, one per value "
                               "(x / scale, rounded to the nearest E2M1 value, plus 8 if negative).")
    if len(codes) != 16:
        return Feedback(False, f"Step 2: expected 16 codes, one per value, got {len(codes)}.")
    for i, (got, want) in enumerate(zip(codes, right_codes)):
        if got == want:
            continue
        x = FP4_BLOCK[i] / right_scale
        if not 0 <= got < 16:
            return Feedback(False, f"Step 2, code {i}: a code is an integer 0..15, got {got}.")
        if (got & 7) == (want & 7):
            return Feedback(False, f"Step 2, code {i} (x/scale = {x:g}): the magnitude is right but the sign bit is wrong; negative values set bit 3 (add 8).")
        got_mag, want_mag = E2M1_VALUES[got & 7], E2M1_VALUES[want & 7]
        if abs(x) == (got_mag + want_mag) / 2:
            direction = "up, away from zero" if got_mag > want_mag else "down, toward zero"
            return Feedback(False, f"Step 2, code {i}: {abs(x):g} is exactly halfway between {got_mag:g} and {want_mag:g}, "
                                   f"and you rounded {direction}. Ties go to the even code (mantissa bit 0): "
                                   f"code {want & 7}, the value {want_mag:g}.")
        if got_mag == round(abs(x)):
            return Feedback(False, f"Step 2, code {i}: {abs(x):g} rounded to the nearest integer is not the nearest E2M1 value; "
                            f"the grid is 0, 0.5, 1, 1.5, 2, 3, 4, 6, so the nearest is {want_mag:g}.")
        signed = -want_mag if want & 8 else want_mag
        return Feedback(False, f"Step 2, code {i}: x/scale = {x:g} rounds to {signed:g}, which is code {want}, not {got}.")
    packed = as_ints(packed)
    if packed is None:
        return Feedback(False, "Steps 1 and 2 are right. Step 3: give the packed bytes as a list of 8 integers, "
                               "byte i = code[2i] | code[2i+1] << 4.")
    if packed == right_packed:
        return Feedback(True, f"Correct: scale {right_scale}, codes {right_codes}, packed bytes {right_packed}: 16 values in 8 + 1 bytes.")
    swapped = [((b & 0x0F) << 4) | (b >> 4) for b in right_packed]
    if packed == swapped:
        return Feedback(False, "Step 3, packing: the nibbles are swapped. Element 0 goes in the low 4 bits: byte = code[2i] | code[2i+1] << 4.")
    if len(packed) != 8:
        return Feedback(False, f"Step 3, packing: 16 codes of 4 bits make 8 bytes, got {len(packed)}.")
    return Feedback(False, f"Step 3, packing: byte i is code[2i] + 16 x code[2i+1]; expected {right_packed}.")


# --- 05.2: the bytes of an NVFP4 cache with a full-precision tail ---------------------------------

# The source texts' 8B-class model (32 layers, 8 KV heads of width 128), running in bf16, with
# QuantizedCache("nvfp4", residual=128): one sequence of 8,192 tokens. Worked by hand (tests
# check it against kvlessons.memory.quantized_cache_bytes and a measured cache):
#   NVFP4 row of 128 values: 128 x 4 bits = 64 B of codes + 128 / 16 = 8 E4M3 block scales = 72 B
#   bf16 row: 128 x 2 B = 256 B
#   2 (K, V) x 32 layers x 8 KV heads x (8,064 x 72 + 128 x 256) = 297,271,296 + 16,777,216
#   + one fp32 tensor scale per K and per V in each layer: 32 x 2 x 4 = 256
FP4_CACHE_BYTES_ANSWER = 314_048_768


def _fp4_cache_bytes(layers=32, kv_heads=8, head_dim=128, seq_len=8192, residual=128, *, kv=2,
                     block_scale_bytes=1, tail_bytes=2, tensor_scales="layer", tail="kept") -> int:
    """Bytes an NVFP4 QuantizedCache holds for one sequence; the keywords put in one slip at a time.

    tensor_scales: "layer" (right: one fp32 per K and V per layer), "none", "head", "token"
    (one per quantized token), "every token"; tail: "kept" (right), "ignored" (all tokens
    quantized), "on top" (all tokens quantized and the tail counted as well).
    """
    tail_len = min(seq_len, residual) if tail != "ignored" else 0
    quantized = seq_len - tail_len if tail == "kept" else seq_len
    nvfp4_row = head_dim // 2 + head_dim // 16 * block_scale_bytes
    rows = kv * layers * kv_heads * (quantized * nvfp4_row + tail_len * head_dim * tail_bytes)
    per_layer = {"layer": 1, "none": 0, "head": kv_heads, "token": quantized, "every token": seq_len}[tensor_scales]
    return rows + kv * layers * 4 * per_layer


def _fp4_cache_exercise() -> NumericExercise:
    answer = FP4_CACHE_BYTES_ANSWER
    return NumericExercise(
        name="fp4_cache_bytes",
        question="32 layers, 8 KV heads of width 128, bf16 model, QuantizedCache('nvfp4', residual=128): "
                 "bytes held after one sequence of 8,192 tokens, exactly?",
        answer=answer,
        unit="B",
        explanation="8,064 old tokens x 72 B per NVFP4 row (64 B of codes + 8 B of block scales) and 128 recent "
                    "tokens x 256 B per bf16 row, times 2 x 32 layers x 8 KV heads, plus 32 x 2 fp32 tensor scales: "
                    "314,048,768 B = 299.5 MiB, 3.4x less than the 1 GiB of bf16.",
        mistakes=[
            (_fp4_cache_bytes(block_scale_bytes=0),
             "The block scales are missing: an NVFP4 row of 128 values is 64 B of codes plus 128 / 16 = 8 E4M3 "
             "scales of 1 B, 72 B in all (4.5 bits per value, not 4)."),
            (_fp4_cache_bytes(block_scale_bytes=2),
             "The block scales are counted as 2 bytes each: they are E4M3, one byte, so a row is 64 + 8 = 72 B."),
            (_fp4_cache_bytes(tensor_scales="none"),
             "Off by 256 B: the tensor scales. Each layer keeps one fp32 scale for K and one for V: 32 x 2 x 4 = 256 B."),
            (_fp4_cache_bytes(tensor_scales="token"),
             "The tensor scale is counted per token: there is one per tensor, one fp32 for K and one for V in each "
             "layer, whatever the length (32 x 2 x 4 = 256 B in all); the per-token scales are the block scales."),
            (_fp4_cache_bytes(tensor_scales="every token"),
             "The tensor scale is counted for every token: there is one per tensor, one fp32 for K and one for V in "
             "each layer (32 x 2 x 4 = 256 B in all); the per-token scales are the block scales."),
            (_fp4_cache_bytes(tensor_scales="head"),
             "The tensor scale is counted per KV head: there is one per K tensor and one per V tensor of a layer, "
             "shared by its heads: 32 x 2 x 4 = 256 B."),
            (_fp4_cache_bytes(tail="ignored"),
             "That is every token in NVFP4. The newest 128 tokens stay in bf16 (residual=128): 256 B per row, not 72."),
            (_fp4_cache_bytes(tail="on top"),
             "The tail is counted twice: the 128 recent tokens are in bf16 instead of NVFP4, so only 8,192 - 128 = "
             "8,064 tokens are quantized."),
            (_fp4_cache_bytes(tail_bytes=4),
             "The tail is counted in fp32: it is stored in the model's dtype, bf16 here, 2 B per value."),
            (_fp4_cache_bytes(kv=1),
             "Half the answer: only K is counted. V is stored the same way (codes, block scales, tail, tensor scale)."),
            (answer / 2**20, "That is MiB; the question asks for bytes (x 1024^2)."),
            (answer / 10**6, "That is MB (10^6 bytes); the question asks for bytes."),
        ],
        hints=[
            "Split the 8,192 tokens: the newest 128 stay in bf16, the other 8,064 are NVFP4. Find the bytes of one "
            "head's row (128 values) in each format, then multiply by K and V, KV heads and layers.",
            "An NVFP4 row: 128 x 4 bits = 64 B of codes + 128 / 16 = 8 E4M3 block scales of 1 B = 72 B; a bf16 row "
            "is 256 B. Each layer also keeps one fp32 tensor scale for K and one for V.",
            "2 x 32 x 8 x (8,064 x 72 + 128 x 256) + 32 x 2 x 4 = 297,271,296 + 16,777,216 + 256 = 314,048,768 B.",
        ],
        rel_tol=0.0,  # to the byte
    )


FP4_CACHE_BYTES = _fp4_cache_exercise()


def check_fp4_cache_bytes(cache_bytes) -> Feedback:
    """Exercise 05.2: bytes an NVFP4 cache with a 128-token bf16 tail holds for 8,192 tokens of the 8B-class model."""
    ex = FP4_CACHE_BYTES
    value = as_number(cache_bytes)
    if value is None or not math.isfinite(value):
        return Feedback(False, f"Expected a number of bytes (an integer), got {cache_bytes!r}. "
                               f"Replace the None (or ...) with your answer. Hint: {ex.hints[0]}")
    shown = f"{value:,.0f} B" if value == int(value) else f"{value:,} B"
    if value == ex.answer:
        return Feedback(True, f"Correct: {ex.explanation}")
    for wrong, diagnosis in ex.mistakes:
        # Byte counts must match to the byte; a figure in MiB or MB was rounded by whoever typed it.
        if math.isclose(value, wrong, rel_tol=1e-12 if wrong > 2**20 else 0.005):
            return Feedback(False, f"Not quite: {shown}. {diagnosis}")
    if abs(value - ex.answer) < 0.01 * ex.answer:
        off = f"{abs(value - ex.answer):,.0f} B {'short' if value < ex.answer else 'too many'}"
        return Feedback(False, f"Close, but not to the byte: {shown} is {off}. Hint: {ex.hints[1]}")
    return Feedback(False, f"Not {shown}. Hint: {ex.hints[0]}")
