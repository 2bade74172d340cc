"""Checkers for the lessons' exercises (02, 05, 07): they say what is wrong, in words, and hint before they tell.

A checker takes the learner's value as an argument (never reads notebook globals),
compares it with the answer computed by kvlessons, and recognises the common wrong
answers by computing them too: forgetting K and V, ignoring GQA, GB for GiB, and so on.

One module per lesson (``lesson02``, ...), on ``core``'s Feedback and NumericExercise;
everything is importable from here: ``from kvlessons import exercises; exercises.check_32k_estimate(...)``.
"""

from .core import Feedback, NumericExercise
from .lesson02 import KV_32K, SHRINK_64K, USERS_64K, check_32k_estimate, check_64k_plan
from .lesson05 import FP4_BLOCK, FP4_BLOCK_CODES, FP4_BLOCK_PACKED, FP4_BLOCK_SCALE, check_fp4_block
from .lesson07 import MASK_HINTS, POSITION_HINTS, check_mask, check_positions

__all__ = [
    "EXERCISES", "FP4_BLOCK", "FP4_BLOCK_CODES", "FP4_BLOCK_PACKED", "FP4_BLOCK_SCALE", "Feedback", "KV_32K",
    "MASK_HINTS", "NumericExercise", "POSITION_HINTS", "SHRINK_64K", "USERS_64K", "check_32k_estimate",
    "check_64k_plan", "check_fp4_block", "check_mask", "check_positions", "hint",
]

EXERCISES = {e.name: e for e in (KV_32K, USERS_64K, SHRINK_64K)}


def hint(name: str, level: int = 1) -> str:
    """Hint ``level`` for the exercise called ``name`` (e.g. hint('kv_32k', 2))."""
    if name not in EXERCISES:
        raise ValueError(f"name must be one of {', '.join(EXERCISES)}; got {name!r}")
    return EXERCISES[name].hint(level)
