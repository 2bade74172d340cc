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


# A float mask is additive (SDPA adds it to the scores): 0 where a key may be seen, and -inf, or a
# number so negative that softmax gives it no weight (finfo.min, -1e9), where it may not.
_HIDDEN_BELOW = -1e4


def _read_mask(got):
    """(bool mask with True = may attend, the convention it came in): 'bool', 'additive', or 'float01'.

    None for a float mask that is neither additive nor 0/1 (it cannot be read as a mask).
    """
    import torch

    if got.dtype == torch.bool:
        return got, "bool"
    if not torch.is_floating_point(got):
        return got.bool(), "int"  # attention would reject (SDPA) or add (a hand-written one) integers
    if bool(((got == 0) | (got <= _HIDDEN_BELOW)).all()):
        return got == 0, "additive"
    if bool(((got == 0) | (got == 1)).all()):
        return got == 1, "float01"
    return None, "float"


def check_mask(fn) -> Feedback:
    """Exercise 07.2: ``fn(q_len, kv_len)`` must return the bool mask (q_len, kv_len), True = may attend.

    An additive float mask (0 = attend, -inf = hidden) with the right pattern is accepted,
    and the convention explained; True-means-hidden (nn.MultiheadAttention's convention)
    is recognised as a flip, not as wrong logic; a float mask of 1.0 / 0.0 is refused,
    since attention would add it to the scores and hide nothing.
    """
    import torch

    from ..attention import causal_mask

    cases = []  # (q_len, kv_len, the mask read as bool, its convention), for every shape tried
    for q_len, kv_len in [(1, 6), (3, 7), (4, 4), (2, 9)]:
        try:
            got = fn(q_len, kv_len)
        except Exception as err:  # noqa: BLE001
            return Feedback(False, f"fn({q_len}, {kv_len}) raised {type(err).__name__}: {err}. Hint: {MASK_HINTS[0]}")
        try:
            got = torch.as_tensor(got)
        except Exception:  # noqa: BLE001 - None, a string, ...
            return Feedback(False, f"fn({q_len}, {kv_len}) returned {type(got).__name__}, not a tensor. "
                                   f"Return a bool tensor of shape ({q_len}, {kv_len}). Hint: {MASK_HINTS[0]}")
        if tuple(got.shape) != (q_len, kv_len):
            if tuple(got.shape) == (kv_len, q_len):
                return Feedback(False, f"The mask is transposed: shape {tuple(got.shape)}; rows are queries, columns keys: ({q_len}, {kv_len}).")
            return Feedback(False, f"fn({q_len}, {kv_len}) has shape {tuple(got.shape)}, expected ({q_len}, {kv_len}).")
        got, convention = _read_mask(got)
        if got is None:
            return Feedback(False, f"fn({q_len}, {kv_len}) returned floats other than 0, 1 and large negatives, so it "
                                   f"is no mask. Return a bool tensor, True where query i may attend to key j.")
        cases.append((q_len, kv_len, got, convention))
    conventions = {c for *_, c in cases}
    wants = [causal_mask(q, k) for q, k, *_ in cases]
    if not all(torch.equal(got, want) for (_, _, got, _), want in zip(cases, wants)):
        return _diagnose_mask(cases, wants)
    if "int" in conventions:
        return Feedback(False, "The pattern is right, but the mask holds integers. scaled_dot_product_attention takes a "
                               "bool mask (True = may attend) or a float one that it adds to the scores; integers are "
                               "refused there, and hand-written attention would add them. Return bool (.bool()).")
    if "float01" in conventions:
        return Feedback(False, "The pattern is right, but the mask holds the floats 1.0 and 0.0. A float mask is "
                               "added to the attention scores (scaled_dot_product_attention's attn_mask), so ones and "
                               "zeros would hide nothing. Return bool (dtype=torch.bool, or .bool()).")
    if "additive" in conventions:
        return Feedback(True, "Correct, as an additive mask: 0 where a query may attend, -inf (or a large negative) "
                              "where it may not, bottom-right aligned. scaled_dot_product_attention adds a float "
                              "attn_mask to the scores, so this works as it is; the bool form asked for is mask == 0.")
    return Feedback(True, "Correct: bottom-right aligned, every query sees exactly the keys at or before it.")


def _diagnose_mask(cases, wants) -> Feedback:
    """What is wrong with a mask that differs from the bottom-right one in at least one of ``cases``."""
    import torch

    from ..attention import causal_mask

    convention = "additive" if any(c == "additive" for *_, c in cases) else "bool"
    if convention == "additive":
        flipped = "the 0s and -infs are swapped: -inf goes on the keys a query may not see (its future), 0 on the rest"
    else:
        flipped = ("True marks the keys a query may NOT see. That is nn.MultiheadAttention's convention (attn_mask "
                   "and key_padding_mask: True = masked out); scaled_dot_product_attention and this exercise use "
                   "the opposite, True = may attend, so return ~mask")
    read_as = " (read as an additive mask: 0 = may attend, -inf = hidden)" if convention == "additive" else ""
    tops = [causal_mask(q, k, align="top_left") for q, k, *_ in cases]
    if all(torch.equal(got, ~want) for (_, _, got, _), want in zip(cases, wants)):
        return Feedback(False, f"Your mask is inverted but otherwise right: {flipped}.")
    if all(torch.equal(got, ~top) for (_, _, got, _), top in zip(cases, tops)):
        q_len, kv_len = cases[0][:2]
        return Feedback(False, f"Two things at once. First, {flipped}. Second, the mask is aligned to the top left "
                               f"like is_causal=True: query 0 sits at position {kv_len - q_len}, not 0, so the "
                               f"mask must be aligned to the bottom right. Hint: {MASK_HINTS[1]}")
    for (q_len, kv_len, got, _), want, top in zip(cases, wants, tops):
        if torch.equal(got, want):
            continue
        if torch.equal(got, top):
            queries = f"{q_len} quer{'y' if q_len == 1 else 'ies'}"
            return Feedback(False, f"Your mask{read_as} is aligned to the top left (like is_causal=True): with {queries} over "
                                   f"{kv_len} keys, query 0 sees only key 0, but it sits at position {kv_len - q_len} and "
                                   f"may see keys 0..{kv_len - q_len}. Hint: {MASK_HINTS[1]}")
        future = got & ~want
        if future.any():
            i, j = [int(v) for v in future.nonzero()[0]]
            return Feedback(False, f"Your mask{read_as} lets token {kv_len - q_len + i} see token {j}, which comes after it "
                                   f"(query {i} of {q_len} over {kv_len} keys). Hint: {MASK_HINTS[1]}")
        i, j = [int(v) for v in (want & ~got).nonzero()[0]]
        return Feedback(False, f"Your mask{read_as} hides token {j} from token {kv_len - q_len + i}, which may see it "
                               f"(query {i} of {q_len} over {kv_len} keys). Hint: {MASK_HINTS[0]}")
    raise AssertionError("unreachable: some case differs")  # pragma: no cover
