"""Lesson 07's exercises: fix the bug (position ids after a cache, the bottom-right mask)."""

from __future__ import annotations

from .core import Feedback, as_list


__all__ = ["POSITION_HINTS", "MASK_HINTS", "check_positions", "check_mask"]


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
            got = as_list(fn(cache_len, new))
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

    from ..attention import causal_mask

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
