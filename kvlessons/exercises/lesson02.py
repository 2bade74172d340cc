"""Lesson 02's exercises: the cache of a real workload in GiB, and what a longer context costs in users."""

from __future__ import annotations

from ..memory import SOURCE_EXAMPLE as SOURCE_MODEL
from ..memory import kv_cache_bytes, max_sequences
from ..shape import ModelShape
from .core import Feedback, NumericExercise


__all__ = ["KV_32K", "USERS_64K", "SHRINK_64K", "check_32k_estimate", "check_64k_plan"]


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
