"""Lesson 05's exercise: one NVFP4 block quantized by hand."""

from __future__ import annotations

from .core import Feedback, as_ints, as_number


__all__ = ["FP4_BLOCK", "FP4_BLOCK_SCALE", "FP4_BLOCK_CODES", "FP4_BLOCK_PACKED", "check_fp4_block"]


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
        return Feedback(False, f"Step 2, code {i}: x/scale = {x:g} rounds to {want_mag:g}, which is code {want}, not {got}.")
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
