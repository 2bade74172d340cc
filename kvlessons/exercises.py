"""Checkers for the lessons' exercises (02, 05, 07): they say what is wrong, in words, and hint before they tell.

A checker takes the learner's value as an argument (never reads notebook globals),
compares it with the answer computed by kvlessons, and recognises the common wrong
answers by computing them too: forgetting K and V, ignoring GQA, GB for GiB, and so on.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

from .memory import SOURCE_EXAMPLE as SOURCE_MODEL
from .memory import kv_cache_bytes, max_sequences
from .shape import ModelShape


@dataclass(frozen=True)
class Feedback:
    """A checker's verdict; shows as its message in a notebook."""

    correct: bool
    message: str

    def __repr__(self) -> str:
        return self.message


@dataclass
class NumericExercise:
    """A question with one numeric answer, known wrong answers with their diagnosis, and tiered hints."""

    name: str
    question: str
    answer: float
    unit: str
    explanation: str
    mistakes: list[tuple[float, str]] = field(default_factory=list)
    hints: list[str] = field(default_factory=list)
    rel_tol: float = 0.005

    def _close(self, a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=self.rel_tol, abs_tol=1e-9)

    def check(self, value) -> Feedback:
        """Feedback on ``value``: correct, a named mistake with a hint, or a first hint."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return Feedback(False, f"Expected a number ({self.unit}), got {value!r}. Replace the ... with your answer.")
        if self._close(value, self.answer):
            return Feedback(True, f"Correct: {self.explanation}")
        for wrong, diagnosis in self.mistakes:
            if self._close(value, wrong):
                return Feedback(False, f"Not quite: {value:g} {self.unit}. {diagnosis}")
        return Feedback(False, f"Not {value:g} {self.unit}. Hint: {self.hints[0]}" if self.hints else f"Not {value:g}.")

    def hint(self, level: int = 1) -> str:
        """Hint number ``level`` (1 = gentlest); the last one works the answer out."""
        if not self.hints:
            return "No hints for this one."
        level = min(max(int(level), 1), len(self.hints))
        return f"Hint {level}/{len(self.hints)}: {self.hints[level - 1]}"


# ---------------------------------------------------------------------------------------------
# Lesson 02: memory math
# ---------------------------------------------------------------------------------------------

GIB = 2**30


def _kv_32k_exercise() -> NumericExercise:
    answer = kv_cache_bytes(SOURCE_MODEL, 32768, batch=4, dtype="fp16")
    mha = ModelShape(layers=32, q_heads=32, kv_heads=32, head_dim=128)
    return NumericExercise(
        name="kv_32k",
        question="32 layers, 32 query / 8 KV heads, head_dim 128, fp16: the cache for 4 sequences of 32,768 tokens, in GiB?",
        answer=answer / GIB,
        unit="GiB",
        explanation="2 x 32 x 8 x 128 x 2 B = 128 KiB per token; x 32,768 tokens = 4 GiB per sequence; x 4 = 16 GiB.",
        mistakes=[
            (answer / 10**9, "That is GB (10^9 bytes). The question asks for GiB: divide by 1024^3 = 2^30, not 10^9."),
            (answer / 2 / GIB, "Half the answer: did you count only keys? Each token stores a key and a value (the leading 2)."),
            (kv_cache_bytes(mha, 32768, 4, "fp16") / GIB,
             "Four times too much: you used the 32 query heads. Only the 8 KV heads are cached (GQA)."),
            (answer / 4 / GIB, "That is one sequence. The question has 4 of them."),
            (kv_cache_bytes(SOURCE_MODEL, 32768, 4, "fp32") / GIB, "Twice too much: fp16 is 2 bytes per value, not 4."),
            (answer * 8 / GIB, "Eight times too much: that counts bits. Bytes per value for fp16 is 2."),
            (answer / 32 / GIB, "That is one layer's share. Multiply by the 32 layers."),
        ],
        hints=[
            "Start from the bytes per token: 2 (K and V) x layers x KV heads x head_dim x bytes per value.",
            "Per token that is 2 x 32 x 8 x 128 x 2 = 131,072 bytes = 128 KiB. Now multiply by tokens and sequences.",
            "128 KiB x 32,768 tokens = 4 GiB per sequence; four sequences: 16 GiB (divide bytes by 1024^3 for GiB).",
        ],
    )


KV_32K = _kv_32k_exercise()


def check_32k_estimate(answer_gib) -> Feedback:
    """Exercise 02.1: the cache for 4 sequences of 32,768 tokens on the source texts' model, in GiB."""
    return KV_32K.check(answer_gib)


def _users_64k_exercise() -> NumericExercise:
    budget = kv_cache_bytes(SOURCE_MODEL, 8192, batch=8, dtype="fp16")  # today: 8 users at 8K fill it
    users = max_sequences(SOURCE_MODEL, 65536, budget, dtype="fp16")
    return NumericExercise(
        name="users_64k",
        question="8 users at 8K context fill the cache budget today. At 64K context, same budget, how many users fit?",
        answer=users,
        unit="users",
        explanation="each sequence's cache grows 8x (8K -> 64K tokens), so the budget that held 8 holds 1.",
        mistakes=[
            (8, "That is today's number. The cache per user grows with context: 8x the tokens is 8x the bytes."),
            (64, "Other way round: a longer context means fewer users, not more."),
            (0, "One still fits: 64K tokens x 128 KiB = 8 GiB, exactly the budget 8 users at 8K used."),
        ],
        hints=[
            "The budget is what 8 users x 8,192 tokens use. How many tokens does one 64K user need?",
            "Budget = 8 x 8,192 = 65,536 tokens' worth. One 64K user needs 65,536 tokens.",
        ],
    )


def _shrink_64k_exercise() -> NumericExercise:
    budget = kv_cache_bytes(SOURCE_MODEL, 8192, batch=8, dtype="fp16")
    need = kv_cache_bytes(SOURCE_MODEL, 65536, batch=8, dtype="fp16")
    return NumericExercise(
        name="shrink_64k",
        question="To keep 8 users at 64K on the same memory, by what factor must bytes per token shrink?",
        answer=need / budget,
        unit="x",
        explanation="8 users x 64K tokens is 8x the tokens of 8 x 8K, so each token must cost 8x less: "
        "for example GQA 8 -> 2 KV heads (4x) with an FP8 cache (2x).",
        mistakes=[
            (budget / need, "That is the fraction of today's bytes each token may use; the factor asked for is its inverse."),
            (64, "Too much: 8 users are the same today and tomorrow, only the context grows, by 8x."),
            (1, "The tokens per user grow 8x while the memory stays the same, so something must shrink."),
        ],
        hints=[
            "Compare total tokens: 8 users x 8,192 today, 8 users x 65,536 tomorrow.",
            "65,536 / 8,192 = 8: each token has to cost 8x fewer bytes. Which levers multiply to 8?",
        ],
    )


USERS_64K = _users_64k_exercise()
SHRINK_64K = _shrink_64k_exercise()


def check_64k_plan(users_at_64k, shrink_factor) -> Feedback:
    """Exercise 02.2 (numeric part): users that fit at 64K, and the shrink needed to keep 8."""
    first, second = USERS_64K.check(users_at_64k), SHRINK_64K.check(shrink_factor)
    message = f"Users at 64K: {first.message}\nShrink factor: {second.message}"
    return Feedback(first.correct and second.correct, message)


EXERCISES = {e.name: e for e in (KV_32K, USERS_64K, SHRINK_64K)}


def hint(name: str, level: int = 1) -> str:
    """Hint ``level`` for the exercise called ``name`` (e.g. hint('kv_32k', 2))."""
    if name not in EXERCISES:
        raise ValueError(f"name must be one of {', '.join(EXERCISES)}; got {name!r}")
    return EXERCISES[name].hint(level)


# ---------------------------------------------------------------------------------------------
# Lesson 05: one NVFP4 block by hand
# ---------------------------------------------------------------------------------------------

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
    from .fp4 import E2M1_VALUES

    right_scale, right_codes, right_packed = _block_answer()
    amax = max(abs(v) for v in FP4_BLOCK)
    scale = _as_number(scale)
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
    codes = _as_ints(codes)
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
    packed = _as_ints(packed)
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


def _as_number(value) -> float | None:
    """``value`` as a float if it is one number (int, float, NumPy scalar, one-element tensor), else None."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _as_ints(values) -> list[int] | None:
    """``values`` (a list, tuple, NumPy array or tensor of integers) as a list of ints, else None."""
    if values is None or isinstance(values, (str, bytes)):
        return None
    try:
        items = _as_list(values)
        if any(isinstance(v, bool) for v in items):  # True is no code
            return None
        return [operator.index(v) for v in items]  # ints and NumPy ints; not floats
    except TypeError:
        return None


# ---------------------------------------------------------------------------------------------
# Lesson 07: fix the bug
# ---------------------------------------------------------------------------------------------


def _as_list(x):
    import torch

    if isinstance(x, torch.Tensor):
        return x.reshape(-1).tolist()
    return list(x)


POSITION_HINTS = [
    "The new tokens come right after the cached ones. What is the position of the first new token?",
    "With cache_len tokens cached (positions 0 .. cache_len - 1), the next free position is cache_len.",
    "Return list(range(cache_len, cache_len + new_tokens)).",
]


def check_positions(fn) -> Feedback:
    """Exercise 07.1: ``fn(cache_len, new_tokens)`` must return the new tokens' position ids."""
    cases = [(7, 1), (12, 3), (0, 5), (1, 1)]  # cached tokens first: that is where the bugs show
    for cache_len, new in cases:
        try:
            got = _as_list(fn(cache_len, new))
        except Exception as err:  # noqa: BLE001 - a learner's code may raise anything
            return Feedback(False, f"fn({cache_len}, {new}) raised {type(err).__name__}: {err}. Hint: {POSITION_HINTS[0]}")
        want = list(range(cache_len, cache_len + new))
        if got == want:
            continue
        if len(got) != new:
            return Feedback(False, f"fn({cache_len}, {new}) returned {len(got)} positions; there is one per new token ({new}).")
        if got == list(range(new)):
            return Feedback(False, f"Your new tokens start at position 0 (fn({cache_len}, {new}) = {got}): positions must "
                                   f"continue after the {cache_len} cached tokens. Hint: {POSITION_HINTS[1]}")
        if got == [p + 1 for p in want]:
            return Feedback(False, f"Off by one: fn({cache_len}, {new}) = {got} skips position {cache_len}. "
                                   f"The last cached token is at {cache_len - 1}, so the next is {cache_len}.")
        if got == [p - 1 for p in want]:
            return Feedback(False, f"Off by one: fn({cache_len}, {new}) = {got} reuses position {cache_len - 1}, "
                                   f"which the last cached token already holds.")
        return Feedback(False, f"fn({cache_len}, {new}) = {got}, expected {want}. Hint: {POSITION_HINTS[0]}")
    return Feedback(True, "Correct: new tokens continue at cache_len, cache_len + 1, ... in every case tried.")


MASK_HINTS = [
    "Query i is the (kv_len - q_len + i)-th position overall. Which keys are at or before it?",
    "Compare a row of key positions with a column of query positions: keys <= kv_len - q_len + i.",
    "torch.ones(q_len, kv_len, dtype=torch.bool).tril(diagonal=kv_len - q_len)",
]


def check_mask(fn) -> Feedback:
    """Exercise 07.2: ``fn(q_len, kv_len)`` must return the bool mask (q_len, kv_len), True = may attend."""
    import torch

    from .attention import causal_mask

    for q_len, kv_len in [(1, 6), (3, 7), (4, 4), (2, 9)]:
        try:
            got = fn(q_len, kv_len)
        except Exception as err:  # noqa: BLE001
            return Feedback(False, f"fn({q_len}, {kv_len}) raised {type(err).__name__}: {err}. Hint: {MASK_HINTS[0]}")
        got = torch.as_tensor(got)
        want = causal_mask(q_len, kv_len)
        if tuple(got.shape) != (q_len, kv_len):
            if tuple(got.shape) == (kv_len, q_len):
                return Feedback(False, f"The mask is transposed: shape {tuple(got.shape)}; rows are queries, columns keys: ({q_len}, {kv_len}).")
            return Feedback(False, f"fn({q_len}, {kv_len}) has shape {tuple(got.shape)}, expected ({q_len}, {kv_len}).")
        got = got.bool()
        if torch.equal(got, want):
            continue
        if torch.equal(got, causal_mask(q_len, kv_len, align="top_left")):
            queries = f"{q_len} quer{'y' if q_len == 1 else 'ies'}"
            return Feedback(False, f"Your mask is aligned to the top left (like is_causal=True): with {queries} over "
                                   f"{kv_len} keys, query 0 sees only key 0, but it sits at position {kv_len - q_len} and "
                                   f"may see keys 0..{kv_len - q_len}. Hint: {MASK_HINTS[1]}")
        future = got & ~want
        if future.any():
            i, j = [int(v) for v in future.nonzero()[0]]
            pos = kv_len - q_len + i
            return Feedback(False, f"Your mask lets token {pos} see token {j}, which comes after it "
                                   f"(query {i} of {q_len} over {kv_len} keys). Hint: {MASK_HINTS[1]}")
        i, j = [int(v) for v in (want & ~got).nonzero()[0]]
        return Feedback(False, f"Your mask hides token {j} from token {kv_len - q_len + i}, which may see it. Hint: {MASK_HINTS[0]}")
    return Feedback(True, "Correct: bottom-right aligned, every query sees exactly the keys at or before it.")
