"""Lesson 02's exercises: the cache of a real workload in GiB, and what a longer context costs in users."""

from __future__ import annotations

import itertools
import math

from ..memory import SOURCE_EXAMPLE as SOURCE_MODEL
from ..memory import kv_cache_bytes, max_sequences
from .core import Feedback, NumericExercise, check_parts


__all__ = ["KV_32K", "USERS_64K", "SHRINK_64K", "check_32k_estimate", "check_64k_plan"]


GIB = 2**30


# The usual slips on 02.1, each as the factor it puts on the right answer in GiB (for a unit
# slip: what the bytes were divided by instead of 2^30). A group holds slips that exclude
# each other (a number is in one unit; a value has one size).
_32K_SLIPS = [
    ("unit", 10**9, "it is in GB (10^9 bytes), not GiB: divide the bytes by 2^30 = 1024^3, not 10^9"),
    ("unit", 2**20, "it is in MiB: divide by 1024 once more for GiB"),
    ("unit", 1, "it is in bytes: divide by 2^30 = 1,073,741,824 for GiB"),
    ("kv", 1 / 2, "only keys are counted: each token stores a key and a value (the leading 2)"),
    ("heads", 4, "the 32 query heads are counted: only the 8 KV heads are cached (GQA), 4x fewer"),
    ("batch", 1 / 4, "it is one sequence: the question has 4 of them"),
    ("size", 2, "4 bytes per value are counted: fp16 is 2 bytes per value"),
    ("size", 8, "bits are counted, not bytes: fp16 is 2 bytes per value (16 bits)"),
    ("layers", 1 / 32, "it is one layer's share: multiply by the 32 layers"),
    ("tokens", 32000 / 32768, "32,000 tokens are counted: 32K here is 32,768 = 2^15 tokens"),
]


def _32k_mistakes(answer_bytes: int, rel_tol: float) -> list[tuple[float, str]]:
    """Every answer one slip or two slips together give, in GiB, with what went wrong in words.

    Two slips can cancel (32 query heads and one sequence give the right 16 GiB: the
    checker cannot see those) or land where another slip does (query heads and only keys
    give 2x, as fp32 does). A number reached in several ways names every way, so no
    diagnosis hides another; the returned values lie more than twice the tolerance
    apart, so no answer is near two of them.
    """
    ways: list[tuple[float, list[tuple[str, ...]]]] = []

    def add(slips):
        unit = next((factor for group, factor, _ in slips if group == "unit"), GIB)  # what the bytes are divided by
        value = answer_bytes / unit * math.prod(factor for group, factor, _ in slips if group != "unit")
        if math.isclose(value, answer_bytes / GIB, rel_tol=2 * rel_tol):
            return  # the slips cancel: right by accident
        says = tuple(s[2] for s in slips)
        for known, explanations in ways:
            if math.isclose(value, known, rel_tol=2 * rel_tol):
                explanations.append(says)
                return
        ways.append((value, [says]))

    for slip in _32K_SLIPS:
        add([slip])
    for a, b in itertools.combinations(_32K_SLIPS, 2):
        if a[0] != b[0]:
            add([a, b])
    return [(value, _describe(explanations)) for value, explanations in ways]


def _describe(explanations: list[tuple[str, ...]]) -> str:
    """One explanation as a sentence; several as the list of ways to reach the number."""
    def one(says):
        return says[0] if len(says) == 1 else f"two slips at once: {says[0]}. And {says[1]}"

    if len(explanations) == 1:
        text = one(explanations[0])
        return text[0].upper() + text[1:] + "."
    ways = " ".join(f"({i}) {one(says)}." for i, says in enumerate(explanations, 1))
    return f"{len(explanations)} ways to get this number, check each: {ways}"


def _kv_32k_exercise() -> NumericExercise:
    answer = kv_cache_bytes(SOURCE_MODEL, 32768, batch=4, dtype="fp16")
    rel_tol = 0.005
    return NumericExercise(
        name="kv_32k",
        question="32 layers, 32 query / 8 KV heads, head_dim 128, fp16: the cache for 4 sequences of 32,768 tokens, in GiB?",
        answer=answer / GIB,
        unit="GiB",
        explanation="2 x 32 x 8 x 128 x 2 B = 128 KiB per token; x 32,768 tokens = 4 GiB per sequence; x 4 = 16 GiB.",
        mistakes=_32k_mistakes(answer, rel_tol),
        hints=[
            "Start from the bytes per token: 2 (K and V) x layers x KV heads x head_dim x bytes per value.",
            "Per token that is 2 x 32 x 8 x 128 x 2 = 131,072 bytes = 128 KiB. Now multiply by tokens and sequences.",
            "128 KiB x 32,768 tokens = 4 GiB per sequence; four sequences: 16 GiB (divide bytes by 1024^3 for GiB).",
        ],
        rel_tol=rel_tol,
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
    return check_parts(("Users at 64K", USERS_64K, users_at_64k), ("Shrink factor", SHRINK_64K, shrink_factor))
